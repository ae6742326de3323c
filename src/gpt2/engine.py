"""The inference engine: prefill, then decode with a preallocated KV cache. It knows only token ids.

    from gpt2 import GPT, generate, stream
    model = GPT.from_pretrained("gpt2")                       # dtype=torch.bfloat16 for bf16 compute
    new_ids = generate(model, [[464, 3290], [15496]], max_new_tokens=32, temperature=0.8, top_k=50, seed=0)
    for step in stream(model, prompts, max_new_tokens=32):   # step: one id (or None once done) per row
        ...

    gpt2 generate --model gpt2 "Hello, my dog" --max-new-tokens 40 --stream   # the text edge (cli.py)

How a batch runs:
  1. Prompts of different lengths are LEFT-padded to P tokens, with an attention mask (B, P + N) that
     is 0 on padding; the model derives positions as cumsum(mask) - 1, as Transformers does. Equal
     lengths need no mask at all (plain causal attention, the fastest path).
  2. Prefill: one forward over (B, P) that fills the cache and computes the lm_head for the last
     position only.
  3. Decode: one forward per step over (B, 1). The cache and the mask are allocated once, before
     prefill; each step only slices them.
  4. Each row stops on its own (EOS, stop ids, the caller's `finish(row)`, e.g. on a stop string);
     the batch stops when every row has.
  5. With compile=True, decode runs `decode_step` under torch.compile instead: the same blocks, but
     every shape fixed (the whole cache, rounded up, with a mask), so one graph serves every step.

Sampling lives in sampling.py as pure functions. `generate_naive` is the uncached reference
(a full forward over the whole sequence every step) that the tests compare the fast path against.
Stop strings are text, so they are matched at the edges (the CLI, the server) with
`gpt2.tokenizer.TextStream`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpt2.config import GPT2_EOT
from gpt2.errors import ConfigError, ContextLengthError
from gpt2.kv_cache import KVCache
from gpt2.sampling import SamplingConfig, SamplingState, make_generators, next_tokens



@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | list[int] | None = None      # int: one generator for the batch; list: one per row
    stop_token_ids: list[int] | None = None  # besides EOS; a stop token is not part of the output
    ignore_eos: bool = False                 # EOS is <|endoftext|> when the vocabulary is GPT-2's
    truncate: str | None = None              # None: a too-long prompt is an error; "left": keep its end
    compile: bool = False                    # decode with one torch.compile'd, fixed-shape step


def make_config(*, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None, seed=None, stop_token_ids=None,
                min_p=None, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None,
                ignore_eos=False, truncate=None, compile=False) -> GenerationConfig:
    """The keyword arguments of generate/stream as one GenerationConfig."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if truncate not in (None, "left"):
        raise ConfigError(f"truncate must be None or 'left', got {truncate!r}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, logit_bias=dict(logit_bias or {}))
    return GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                            stop_token_ids=list(stop_token_ids or []), ignore_eos=ignore_eos, truncate=truncate,
                            compile=bool(compile))


# ---------------------------------------------------------------------------------------------
# request preparation: pure functions
# ---------------------------------------------------------------------------------------------

def check_prompts(prompts, max_new_tokens: int, n_positions: int, vocab_size: int,
                  truncate: str | None = None) -> list[list[int]]:
    """Validate ids and the context limit; with truncate='left', keep the end of a too-long prompt."""
    if not prompts or not all(isinstance(p, (list, tuple)) for p in prompts):
        raise ConfigError("prompts must be a non-empty list of lists of token ids")
    if max_new_tokens >= n_positions:
        raise ContextLengthError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the "
                                 f"context of {n_positions} tokens")
    rows = []
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ConfigError(f"prompt {i} is empty; GPT-2 has no BOS token, start it with <|endoftext|> ({GPT2_EOT})")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in p):
            raise ConfigError(f"prompt {i} holds ids outside [0, {vocab_size})")
        if len(p) + max_new_tokens > n_positions:
            if truncate != "left":
                raise ContextLengthError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that is "
                    f"{len(p) + max_new_tokens} > the context length {n_positions}. Shorten it, lower "
                    f"max_new_tokens, or truncate the prompt from the left (truncate='left', --truncate left)")
            p = p[len(p) + max_new_tokens - n_positions:]
        rows.append(list(p))
    return rows


def left_pad(rows: list[list[int]], total: int, device=None):
    """Ids (B, P) left-padded with 0, and a mask (B, total >= P) that is 0 on padding and 1 elsewhere."""
    P = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), P, dtype=torch.long)
    mask = torch.ones(len(rows), total, dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, : P - len(r)] = 0
    return idx.to(device), mask.to(device)


def stop_ids_for(model, cfg: GenerationConfig) -> set[int]:
    stops = set(cfg.stop_token_ids or [])
    if not cfg.ignore_eos and model.config.vocab_size > GPT2_EOT:
        stops.add(GPT2_EOT)
    return stops


# ---------------------------------------------------------------------------------------------
# the fast path: prefill + cached decode
# ---------------------------------------------------------------------------------------------

class Stream:
    """Iterator over decode steps. Each step is a list with, per row, the new id or None once it is done.

    `finish(row)` stops a row from the outside (the edges call it when a stop string appears).
    After iteration, `finish_reasons[row]` is "stop" (EOS, a stop id or finish()) or "length".
    """

    def __init__(self, model, prompts, cfg: GenerationConfig):
        self.model = model
        self.cfg = cfg
        config = model.config
        self.rows = check_prompts(prompts, cfg.max_new_tokens, config.n_positions, config.vocab_size, cfg.truncate)
        self.finish_reasons: list[str | None] = [None] * len(self.rows)
        self._steps = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> list[int | None]:
        return next(self._steps)

    def finish(self, row: int) -> None:
        if self.finish_reasons[row] is None:
            self.finish_reasons[row] = "stop"

    def _run(self):
        model, cfg, rows = self.model, self.cfg, self.rows
        B, N = len(rows), cfg.max_new_tokens
        if N == 0:
            return
        if cfg.compile and not all(getattr(m, "compilable", True) for m in model.modules()):
            raise ConfigError("compile=True supports float32 and bfloat16 models; int8 and int4 kernels run "
                              "eagerly (on CPU compiling gains nothing measurable: BENCHMARKS.md)")
        device = model.transformer.wte.weight.device
        P = max(len(r) for r in rows)
        padded = any(len(r) != P for r in rows)
        # The last sampled token is never fed back. A compiled step attends over the whole cache, so
        # its capacity is rounded up: requests of similar length then share one compiled graph.
        capacity = static_capacity(P + N - 1, model.config.n_positions) if cfg.compile else P + N - 1
        # inference_mode is entered per step, never across a yield: a grad mode left on while the
        # generator is suspended would leak into the caller's code.
        with torch.inference_mode():
            # Everything the loop needs is allocated here, once: cache, mask, sampler state.
            idx, mask = left_pad(rows, P + N, device)  # mask (B, P + N); decode steps are never padding
            cache = KVCache.for_model(model, B, capacity)
            state = SamplingState(rows, cfg.sampling, model.config.vocab_size, device)
            generators = None if cfg.sampling.greedy else make_generators(cfg.seed, B, device)
            stops = stop_ids_for(model, cfg)
            logits = model(idx, cache=cache, attention_mask=mask[:, :P] if padded else None,
                           last_logits_only=True)[:, -1]  # (B, V)
            if cfg.compile:
                static_step = StaticDecode(model, rows, mask, capacity)
        for t in range(N):
            with torch.inference_mode():
                ids = next_tokens(logits, cfg.sampling, generators, state.seen, state.counts, state.bias)  # (B,)
                state.record(ids)
                step = self._bookkeep(ids.tolist(), stops, last=t == N - 1)
            yield step
            if all(r is not None for r in self.finish_reasons):
                return
            with torch.inference_mode():
                if cfg.compile:
                    logits = static_step(ids, cache)  # (B, V)
                else:
                    mask_t = mask[:, : P + t + 1] if padded else None  # a view: no allocation
                    logits = model(ids.view(B, 1), cache=cache, attention_mask=mask_t)[:, -1]  # (B, V)

    def _bookkeep(self, ids: list[int], stops: set[int], last: bool) -> list[int | None]:
        out = []
        for i, t in enumerate(ids):
            if self.finish_reasons[i] is not None:
                out.append(None)
            elif t in stops:
                self.finish_reasons[i] = "stop"
                out.append(None)
            else:
                out.append(t)
                if last:
                    self.finish_reasons[i] = "length"
        return out


# ---------------------------------------------------------------------------------------------
# the compiled path: one decode step with fixed shapes, so torch.compile builds one graph
# ---------------------------------------------------------------------------------------------

def static_capacity(needed: int, n_positions: int, multiple: int = 64) -> int:
    """Cache capacity for a compiled decode: `needed` rounded up to a multiple, within the context."""
    return min(n_positions, -(-needed // multiple) * multiple)


class _SlotCache:
    """The cache as a compiled decode step sees it: its position `pos` is a (1,) tensor (a Python int
    would be baked into the graph), `update` writes the new k, v at that slot and returns every slot;
    GPT.forward's causal mask then hides the slots not yet written. StaticDecode moves the position,
    outside the graph, so `advance` here does nothing."""

    def __init__(self, cache: KVCache, slot: torch.Tensor):
        self.cache, self.pos, self.capacity = cache, slot, cache.capacity  # slot (1,) int64

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.cache.k[layer].index_copy_(2, self.pos, k)  # k, v (B, nh, 1, hs) into (B, nh, capacity, hs)
        self.cache.v[layer].index_copy_(2, self.pos, v)
        return self.cache.k[layer], self.cache.v[layer]

    def advance(self, num_positions: int) -> None:
        pass


def decode_step(model, ids, positions, slot, keys, cache: KVCache) -> torch.Tensor:
    """One decode step whose shapes never change: logits (B, V) for ids (B, 1), through GPT.forward.

    positions (B, 1): each row's position id; slot (1,): the cache slot this step writes;
    keys (B, capacity) bool: False on left padding.
    """
    return model(ids, cache=_SlotCache(cache, slot), attention_mask=keys, position_ids=positions)[:, -1]


_compiled_decode_step = None


def compiled_decode_step():
    """decode_step under torch.compile, built once per process; each new model or shape recompiles."""
    global _compiled_decode_step
    if _compiled_decode_step is None:
        _compiled_decode_step = torch.compile(decode_step, dynamic=False, fullgraph=True)
    return _compiled_decode_step


class StaticDecode:
    """The state a compiled decode carries between steps, allocated once: positions, slot, key mask."""

    def __init__(self, model, rows: list[list[int]], mask: torch.Tensor, capacity: int):
        device = mask.device
        P = max(len(r) for r in rows)
        self.model = model
        self.positions = torch.tensor([[len(r)] for r in rows], device=device)  # (B, 1): next position id
        self.slot = torch.tensor([P], device=device)  # (1,): the cache slot the next token writes
        self.keys = torch.zeros(len(rows), capacity, dtype=torch.bool, device=device)  # (B, capacity)
        n = min(capacity, mask.size(1))
        self.keys[:, :n] = mask[:, :n].bool()
        self.fn = compiled_decode_step()

    def __call__(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        logits = self.fn(self.model, ids.view(-1, 1), self.positions, self.slot, self.keys, cache)
        cache.advance(1)
        self.positions += 1
        self.slot += 1
        return logits


def stream(model, prompts: list[list[int]], max_new_tokens: int = 64, **options) -> Stream:
    """Yield, step by step, the new id of each row (None for rows that are done). Options: generate's."""
    return Stream(model, prompts, make_config(max_new_tokens=max_new_tokens, **options))


def generate(model, prompts: list[list[int]], max_new_tokens: int = 64, **options) -> list[list[int]]:
    """New ids of each prompt (stop tokens excluded).

    options (keywords, make_config's): temperature (0: greedy), top_k, top_p, min_p, seed (an int, or
    one per row), stop_token_ids, repetition_penalty, frequency_penalty, presence_penalty, logit_bias
    ({id: bias}), ignore_eos (EOS is <|endoftext|> for GPT-2's vocabulary), truncate ("left"),
    compile (torch.compile one fixed-shape decode step; the first call per shape compiles: BENCHMARKS.md).
    """
    steps = stream(model, prompts, max_new_tokens, **options)
    out = [[] for _ in steps.rows]
    for step in steps:
        for row, t in zip(out, step):
            if t is not None:
                row.append(t)
    return out


# ---------------------------------------------------------------------------------------------
# the reference: no cache, a full forward over the whole (padded) sequence every step
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def generate_naive(model, prompts: list[list[int]], max_new_tokens: int = 64, **options) -> list[list[int]]:
    """What generate computes, the slow and obvious way. Tests compare the two token for token."""
    cfg = make_config(max_new_tokens=max_new_tokens, **options)
    config = model.config
    rows = check_prompts(prompts, cfg.max_new_tokens, config.n_positions, config.vocab_size, cfg.truncate)
    device = model.transformer.wte.weight.device
    B, P = len(rows), max(len(r) for r in rows)
    seq, mask = left_pad(rows, P, device)
    state = SamplingState(rows, cfg.sampling, config.vocab_size, device)
    generators = None if cfg.sampling.greedy else make_generators(cfg.seed, B, device)
    stops = stop_ids_for(model, cfg)
    out, done = [[] for _ in rows], [False] * B
    for _ in range(cfg.max_new_tokens):
        logits = model(seq, attention_mask=mask)[:, -1]  # (B, V): every position recomputed
        ids = next_tokens(logits, cfg.sampling, generators, state.seen, state.counts, state.bias)
        state.record(ids)
        for i, t in enumerate(ids.tolist()):
            if not done[i]:
                done[i] = t in stops
                if not done[i]:
                    out[i].append(t)
        if all(done):
            break
        seq = torch.cat([seq, ids.view(B, 1)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return out
