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
  5. With compile=True, decode runs `decode_step` compiled instead: the same blocks, the cache
     position a tensor and the attended length a dynamic size, so one graph serves every step of
     every request of one batch size, the model's weights frozen into it (StaticDecode). A model
     load_for_inference prepared is compiled ahead of time into a package file that later processes
     load (PackagedDecodeStep); anything else goes through torch.compile in every process.

Speculative decoding (draft=a smaller GPT of the same vocabulary, or "self:int8" / "self:int4"):
    new_ids = generate(model, prompts, max_new_tokens=64, draft=small, draft_tokens=4)
  each round the draft proposes k ids, the target scores them in one forward over k + 1 positions,
  sampling.accept_drafts keeps the accepted prefix plus one id of the target's own, and both caches
  rewind to the kept ids (Speculation). Greedy output equals the target's alone; sampled output is
  distributed as the target's. Rows move in lockstep, so batch 1 gains most.

Sampling lives in sampling.py as pure functions. `generate_naive` is the uncached reference
(a full forward over the whole sequence every step) that the tests compare the fast path against.
Stop strings are text, so they are matched at the edges (the CLI, the server) with
`gpt2.tokenizer.TextStream`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import time
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from gpt2 import native_ops
from gpt2.atomic import durable_replace
from gpt2.config import GPT2_EOT
from gpt2.errors import ConfigError, ContextLengthError
from gpt2.huge_pages import collapsing_what_loads
from gpt2.kv_cache import KVCache
from gpt2.sampling import SamplingConfig, SamplingState, accept_drafts, draw, greedy, make_generators, next_tokens
from gpt2.user_cache import default_cache_dir, drop_least_recently_used, mark_used

log = logging.getLogger(__name__)



@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | list[int] | None = None      # int: one generator for the batch; list: one per row
    stop_token_ids: list[int] | None = None  # besides EOS; a stop token is not part of the output
    ignore_eos: bool = False                 # EOS is <|endoftext|> when the vocabulary is GPT-2's
    truncate: str | None = None              # None: a too-long prompt is an error; "left": keep its end
    compile: bool = False                    # decode with one compiled step (with a draft: the draft's)
    draft: object = None                     # speculative decoding: a GPT with the same vocabulary,
                                             # or "self:int8" / "self:int4" (the target's weights, quantized)
    draft_tokens: int = 4                    # k: tokens the draft proposes per round (the first round's)
    adaptive_draft: bool = True              # k grows after a round that kept every draft, shrinks otherwise


def make_config(*, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None, seed=None, stop_token_ids=None,
                min_p=None, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None,
                ignore_eos=False, truncate=None, compile=False, draft=None, draft_tokens=4,
                adaptive_draft=True) -> GenerationConfig:
    """The keyword arguments of generate/stream as one GenerationConfig."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ConfigError(f"draft_tokens must be a positive integer, got {draft_tokens!r}")
    if truncate not in (None, "left"):
        raise ConfigError(f"truncate must be None or 'left', got {truncate!r}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, logit_bias=dict(logit_bias or {}))
    return GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                            stop_token_ids=list(stop_token_ids or []), ignore_eos=ignore_eos, truncate=truncate,
                            compile=bool(compile), draft=draft, draft_tokens=draft_tokens,
                            adaptive_draft=bool(adaptive_draft))


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
        self.speculation: SpeculationStats | None = None  # with a draft: rounds, drafts proposed and kept
        if cfg.draft is None:
            self._steps = self._run()
        else:
            self._steps = self._speculate(resolve_draft(model, cfg.draft))

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
        device = model.transformer.wte.weight.device
        P = max(len(r) for r in rows)
        padded = any(len(r) != P for r in rows)
        # The last sampled token is never fed back. A compiled step's graph holds for any length below
        # the capacity (Dynamo guards that the two differ), so its cache keeps one slot to spare.
        capacity = P + N - 1 + int(cfg.compile)
        # inference_mode is entered per step, never across a yield: a grad mode left on while the
        # generator is suspended would leak into the caller's code.
        with torch.inference_mode():
            # Everything the loop needs is allocated here, once: cache, mask, sampler state.
            idx, mask = left_pad(rows, P + N, device)  # mask (B, P + N); decode steps are never padding
            cache = KVCache.for_model(model, B, capacity, compiled=cfg.compile)
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

    def _speculate(self, draft):
        """Speculative decoding, round by round; one step per kept token, as _run yields them."""
        N = self.cfg.max_new_tokens
        if N == 0:
            return
        with torch.inference_mode():
            spec = Speculation.for_prompts(self.model, draft, self.rows, self.cfg)
        self.speculation = spec.stats
        stops = stop_ids_for(self.model, self.cfg)
        while True:
            with torch.inference_mode():
                live = torch.tensor([r is None for r in self.finish_reasons])
                drafts, draft_probs = spec.propose(spec.draft_length())    # (B, k), (B, k, V) or None
                target_logits = spec.verify(drafts)                        # (B, k + 1, V), processed
                accepted, next_ids = accept_drafts(target_logits, draft_probs, drafts, self.cfg.sampling,
                                                   spec.generators)        # (B,), (B,)
                kept = spec.keep(drafts, accepted, next_ids, live)         # (B, n + 1), one n for all rows
                first = spec.generated
                spec.commit(kept, proposed=drafts.size(1))                 # append; roll both caches back
            for t, column in enumerate(kept.t().tolist(), start=first):
                yield self._bookkeep(column, stops, last=t == N - 1)
                if all(r is not None for r in self.finish_reasons):
                    return

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
# the compiled path: one decode step whose only changing size is dynamic, so torch.compile builds one graph
# ---------------------------------------------------------------------------------------------

class _SlotCache:
    """The cache as a compiled decode step sees it: its position `pos` is a (1,) tensor (a Python int
    would be baked into the graph), `update` writes the new k, v at that slot and returns the first
    `length` slots, the written ones: `length` is symbolic in the graph (StaticDecode marks it dynamic),
    so one graph serves every step and a step reads only the keys it attends to. StaticDecode moves the
    position, outside the graph, so `advance` here does nothing."""

    def __init__(self, cache: KVCache, slot: torch.Tensor, length):
        # slot (1,) int64; length = slot + 1, which GPT.forward reads as `capacity`: the keys it attends to
        self.cache, self.pos, self.capacity = cache, slot, length

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        keys, values = self.cache.k[layer], self.cache.v[layer]
        torch._check(self.capacity <= keys.size(2))  # the slots attended fit the cache (else export fixes both sizes)
        keys.index_copy_(2, self.pos, k.to(keys.dtype))  # k, v (B, nh, 1, hs) into (B, nh, capacity, hs)
        values.index_copy_(2, self.pos, v.to(values.dtype))
        return keys[:, :, : self.capacity], values[:, :, : self.capacity]

    def advance(self, num_positions: int) -> None:
        pass


def decode_step(model, ids, positions, slot, keys, cache: KVCache) -> torch.Tensor:
    """One decode step whose graph never changes: logits (B, V) for ids (B, 1), through GPT.forward.

    positions (B, 1): each row's position id; slot (1,): the cache slot this step writes;
    keys (B, slot + 1) bool: the slots this step attends to, False on left padding (a dynamic size).
    """
    cache_view = _SlotCache(cache, slot, keys.size(1))
    return model(ids, cache=cache_view, attention_mask=keys, position_ids=positions)[:, -1]


_compiled_decode_steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its compiled step


def compiled_decode_step(model):
    """decode_step compiled for this model, built once per model; each batch size compiles.

    A model load_for_inference prepared, on a CPU, gets a PackagedDecodeStep: AOTInductor compiles the
    step into a file, which later processes load in seconds. Any other (a plain GPT, a GPU, u8s8 engines
    called through their custom op, quantize.u8s8_compiles_from_tensors) gets decode_step under
    torch.compile, which compiles again in every process.

    Either way each graph has the model's packed weights frozen into it as constants (StaticDecode), so
    a graph serves one model only. Dynamo counts recompilations per code object (8 at most, then
    fullgraph fails), so every model gets its own copy of decode_step's code: the limit counts its batch
    sizes only. Dynamo keeps compiled graphs, their frozen weights with them, until torch._dynamo.reset().
    """
    step = _compiled_decode_steps.get(model)
    if step is None:
        name_engine_objects(model)
        if PACKAGE_DECODE_STEPS and PackagedDecodeStep.applies(model):
            step = _compiled_decode_steps[model] = PackagedDecodeStep(model)  # builds with add_compile_weights
        else:
            step = _compiled_decode_steps[model] = _torch_compiled_step(model)
    return step


def name_engine_objects(model) -> None:
    """Keys the engine objects of model's layers (quantize._Packed) by the model's weights digest and each
    layer's name: the names any process gives the same weights. A compiled graph holds the keys, so a
    package built in one process finds the objects again in another, and Inductor's cache hits."""
    from gpt2.quantize import FastLinear
    layers = {name: layer for name, layer in model.named_modules()
              if isinstance(layer, FastLinear) and _holds_an_engine_object(layer)}
    if layers:  # the digest only where some layer needs it (hashing gpt2-xl takes seconds)
        digest = weights_digest(model)
        for name, layer in layers.items():
            layer.name_engine_objects(f"{digest} {name}")


def _torch_compiled_step(model):
    """decode_step's own copy under torch.compile, and the plain weights its graph reads, which some packings
    do not keep (MKL's, oneDNN's), given back for Inductor to pack (add_compile_weights)."""
    from gpt2.quantize import add_compile_weights
    add_compile_weights(model)
    own = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__, decode_step.__name__)
    return torch.compile(own, dynamic=False, fullgraph=True)


# ---------------------------------------------------------------------------------------------
# the compiled step, packaged: compiled once per model, machine and batch size, then loaded from a file
# ---------------------------------------------------------------------------------------------

COMPILING = "the decode step was compiled (its GEMMs autotuned)"  # what a busy-machine warning names

PACKAGE_DECODE_STEPS = True  # False: every compiled step through torch.compile (tests of Dynamo's own paths)
PACKAGE_CACHE_BYTES = 8 << 30  # the packages kept (least recently used dropped first); each holds its weights
# One package serves 1 to PACKAGE_ROWS rows (the rows dynamic), the decode and batch regimes in which a FastLinear
# takes the same path (quantize.regime_of); a step of more rows gets a package for its own row count.
PACKAGE_ROWS = 32
# The weights a package holds stay beside the package's code, not inside its shared library: a loaded .so
# maps the whole file, which added the weights' bytes again to the process's resident memory.
PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False,
                   "aot_inductor.package_constants_on_disk_format": "binary_blob"}
# Building a package (export, Inductor packing every weight its own way, autotuning, writing the file and
# loading it) peaked, above the loaded model, at ~6.2x the float32 and bf16 linear weights' bytes (19 GB for
# gpt2-xl in bf16, on a machine of 24 GB), ~9.6x the int8 ones (14.9 GB for gpt2-xl's 1.6 GB; 2.0 GB for
# GPT-2 124M's 0.12) and, past its int8 lm_head, ~3x the int4 ones (3.5 GB in all for gpt2-xl), each
# counted at the bytes it is stored in (quantize.WEIGHT_BYTES; BENCHMARKS.md). Where that is not available,
# nothing is built.
PACKAGE_BUILD_BYTES_PER_WEIGHT_BYTE = {"float32": 6.5, "bfloat16": 6.5, "int8": 10, "int4": 3.5}


def package_build_bytes(model) -> float:
    """The memory building model's package takes beyond the loaded model (PACKAGE_BUILD_BYTES_PER_WEIGHT_BYTE)."""
    from gpt2.quantize import linear_weight_bytes
    return sum(PACKAGE_BUILD_BYTES_PER_WEIGHT_BYTE[p] * stored for p, stored in linear_weight_bytes(model).items())


class _StepModule(torch.nn.Module):
    """decode_step as a module for torch.export, the model its submodule (its weights lifted as such).
    Where the lm_head stays outside the package (lm_head_outside), the step returns ln_f's output (B, C)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, slot, keys, k: list, v: list):
        return decode_step(self.model, ids, positions, slot, keys, SimpleNamespace(k=k, v=v))


def _holds_engine_objects(layer) -> bool:
    """A FastLinear whose compiled paths call a u8s8 engine's packed object through its custom op: such a
    layer is not packaged (its op by key in a package is not tested; fbgemm fp16's is), it goes through
    torch.compile, or, an lm_head, runs after the package (lm_head_outside). Where the u8s8 paths compile
    from q and its scales (quantize.u8s8_compiles_from_tensors), none does, nor does a format whose compiled
    paths never call its engine or call it by a key (WeightFormat.packages)."""
    from gpt2.quantize import u8s8_compiles_from_tensors
    if layer.format.packages or u8s8_compiles_from_tensors():
        return False
    return _holds_an_engine_object(layer)


def _holds_an_engine_object(layer) -> bool:
    from gpt2.quantize import _Packed
    return any(isinstance(t, _Packed) and isinstance(t.obj, torch.ScriptObject) for t in layer.tensors.values())


def _packed_layers(model) -> list:
    from gpt2.quantize import FastLinear, linear_layers
    return [layer for _, _, layer, _ in linear_layers(model) if isinstance(layer, FastLinear)]


def lm_head_outside(model) -> bool:
    """An int4 model's lm_head is int8, most often on a u8s8 engine, while its blocks are int4pack_mm. Where
    its compiled paths call the engine (quantize.u8s8_compiles_from_tensors false), its package ends at
    ln_f and the lm_head runs eagerly after it (one call a step, the same kernel a compiled graph calls
    through its custom op), so that the step still loads from a file."""
    return _holds_engine_objects(model.lm_head)


@contextlib.contextmanager
def _lm_head_left_out(model):
    """The model without its lm_head while it exports (identity: GPT.forward's logits are then ln_f's output,
    (B, 1, C), which the vocabulary slice keeps whole), where lm_head_outside."""
    if not lm_head_outside(model):
        yield
        return
    lm_head, model.lm_head = model.lm_head, torch.nn.Identity()
    try:
        yield
    finally:
        model.lm_head = lm_head


class PackagedDecodeStep:
    """decode_step compiled ahead of time (AOTInductor), one package file per model and machine.

    torch.compile builds its graph again in every process: 30-60 s for a bf16 GPT-2 124M on 2 cores,
    as its oneDNN-packed constants keep Inductor's graph cache from storing it. Here the step is
    exported with the attended length and the cache's capacity dynamic, compiled with the same options
    (compile_options: freezing, autotuned GEMMs) into a .pt2 package holding the code and its frozen
    weights, and loaded in 2-3 s by any later process: under $XDG_CACHE_HOME/gpt2/compiled, keyed by
    the weights (weights_digest), the machine (kernels.machine_key), the inputs' dtypes, the compile
    options and this package's code. The batch's rows are dynamic too, up to PACKAGE_ROWS: one package
    serves generate and every row count of the scheduler (int8, int4: one per row count,
    ROWS_STATIC_PRECISIONS). It runs as a C++ function: no guards, no Python wrapper. u8s8 layers (int8's,
    int4's lm_head) compile from their q and scales (quantize._u8s8_from_tensors); where a CPU's u8s8 does
    not allow it, int8 goes through torch.compile and int4's lm_head runs after the package, eagerly
    (lm_head_outside). A corrupt package is compiled again; where export or
    AOTInductor fails, or building would not fit in memory, checked_compiled_step falls back to
    torch.compile. The cache keeps PACKAGE_CACHE_BYTES.

    The plain weights export reads (add_compile_weights) are kept only while a package builds: the package
    holds its own, and the model's eager paths read their packed copies (gpt2-xl in bf16: 3.1 GB).
    """

    def __init__(self, model):
        self.runners: dict[tuple, object] = {}  # (package_rows, cache dtype) -> the loaded package
        self.lm_head_outside = lm_head_outside(model)  # read once: each step asks

    @staticmethod
    def applies(model) -> bool:
        """A model whose every linear is packed for inference (FastLinear), on a CPU, whose blocks' compiled
        paths read tensors only: not u8s8 engines through their custom op (_holds_engine_objects). An lm_head
        on one runs outside the package (lm_head_outside)."""
        from gpt2.quantize import FastLinear, linear_layers
        layers = [layer for _, _, layer, _ in linear_layers(model)]
        if model.transformer.wte.weight.device.type != "cpu" or not all(isinstance(x, FastLinear) for x in layers):
            return False
        if lm_head_outside(model) and model.config.n_embd > model.config.vocab_size:
            return False  # GPT.forward's vocabulary slice would cut the hidden state the package returns
        return not any(_holds_engine_objects(layer) for layer in layers if layer is not model.lm_head)

    def __call__(self, model, ids, positions, slot, keys, cache) -> torch.Tensor:
        # keys is a view of the (B, capacity) mask: a copy, so that no stride ties its length to the capacity
        inputs = (ids, positions, slot, keys.clone(memory_format=torch.contiguous_format), list(cache.k), list(cache.v))
        key = (package_rows(model, ids.size(0)), cache.k[0].dtype)
        runner = self.runners.get(key)
        if runner is None:
            runner = self.runners[key] = _load_or_build_package(model, inputs)
        if self.lm_head_outside:
            return model.lm_head(runner(*inputs))[:, : model.config.vocab_size]  # (B, C) -> (B, V)
        return runner(*inputs)  # (B, V)


def compiled_step_rows(model, rows: int, available: int) -> int:
    """The rows the compiled step of a scheduler's batch runs for `rows` live ones, at most `available`:
    as many where one package takes every row count (PackagedDecodeStep, up to PACKAGE_ROWS), else the
    power of two from rows up, so that torch.compile builds few graphs (1, 2, 4, ...). Padding 5 rows
    to 8 cost 9-11% a step (bf16 124M: 10.6 against 11.4-12.0 ms)."""
    if isinstance(compiled_decode_step(model), PackagedDecodeStep) and package_rows(model, rows) is None:
        return rows
    return min(available, 1 << (rows - 1).bit_length())


def package_rows(model, rows: int) -> int | None:
    """The rows a package is built for: None for the one with 1 to PACKAGE_ROWS rows, else that many.
    An int8 or int4 model gets a package for each row count (ROWS_STATIC_PRECISIONS), and so does a model
    with a layer whose plan takes one path at decode and another at batch: the package of 1 to PACKAGE_ROWS
    rows is exported on 2 (_export_step) and would take the batch path at 1 row too (an AMD EPYC Zen 3's
    bf16 plan: float32 GEMMs at batch, reading twice the bytes of the bf16 decode path)."""
    static = _rows_static.get(model)
    if static is None:  # a scheduler asks every step: the layers are looked at once
        from gpt2.quantize import FastLinear
        static = _rows_static[model] = any(
            layer.format.precision in ROWS_STATIC_PRECISIONS or layer.path_names["decode"] != layer.path_names["batch"]
            for layer in model.modules() if isinstance(layer, FastLinear))
    return None if rows <= PACKAGE_ROWS and not static else rows


def package_regimes(rows: int | None) -> tuple[str, ...]:
    """The regimes (quantize.regime_of) at which a package's layers take their paths, for package_rows' rows."""
    from gpt2.quantize import regime_of
    return ("decode", "batch") if rows is None else (regime_of(rows),)


# An int4 step compiled for a dynamic row count ran slower than one compiled for its rows (GPT-2 124M on an
# Intel Xeon with AMX, a step at 8 rows 18.6 against 14.4-14.8 ms, at 1 row 5.7-6.3 against 5.2), and so did an
# int8 one (4.5-5.2 against 3.8-4.6 ms at 1 row, 9.3-9.7 against 7.7-8.4 at 8; BENCHMARKS.md), and a float32 one
# on an AMD EPYC Zen 4, whose GEMMs are Inductor's (8 rows 30.3 against 20.3 ms a step, 1 row 10.3 against 9.7).
# Such models get one package per row count. bf16 there, on fbgemm's GEMM by key, measured the same either way
# (8 rows 16.3 against 16.0 ms): one package serves its 1 to PACKAGE_ROWS rows.
ROWS_STATIC_PRECISIONS = {"int4", "int8", "float32"}
_rows_static: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> whether package_rows is static


def package_directory() -> Path:
    """$XDG_CACHE_HOME/gpt2/compiled (default ~/.cache): the packaged decode steps."""
    return default_cache_dir() / "compiled"


def package_path(model, inputs) -> Path:
    """Where the package of decode_step for this model and these inputs (their dtypes and static sizes) lives."""
    from gpt2.kernels import machine_key
    ids, positions, slot, keys, k, v = inputs
    from gpt2.quantize import FastLinear
    described = {"weights": weights_digest(model), "machine": machine_key(), "code": _code_digest(),
                 # the paths each layer's graph computes with: a format's paths share its tensors
                 "paths": [layer.path_names for layer in model.modules() if isinstance(layer, FastLinear)],
                 "lm_head": "outside" if lm_head_outside(model) else "inside",
                 # the op in C++ its graph calls, where its layers hold engine objects (a float32 graph calls none)
                 "native ops": native_ops.loaded() and any(map(_holds_an_engine_object, _packed_layers(model)))
                 and native_ops.loaded().name,
                 "options": {**compile_options(model, "cpu", package_regimes(package_rows(model, ids.size(0)))),
                             **PACKAGE_OPTIONS}, "layers": len(k),
                 "rows": package_rows(model, ids.size(0)),
                 "inputs": [str(t.dtype) for t in (ids, positions, slot, keys)]
                 + [(str(t.dtype), t.size(1), t.size(3)) for t in (k[0], v[0])]}
    key = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return package_directory() / f"decode-{key}.pt2"


@functools.cache
def _code_digest() -> str:
    """sha256 of this package's Python files: a package compiled by other code is never loaded."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def _load_or_build_package(model, inputs):
    path = package_path(model, inputs)
    if path.exists():
        start = time.perf_counter()
        try:
            runner = _load_package(path)
            mark_used(path)  # the cache drops the least recently used first
            log.info("loaded the compiled decode step from %s in %.1f s", path, time.perf_counter() - start)
            return runner
        except Exception as error:  # a truncated or corrupt file: compile it again
            log.warning("compiled decode step %s does not load (%s): compiling it again", path, error)
            path.unlink(missing_ok=True)
    from gpt2.quantize import add_compile_weights, available_memory_bytes, drop_compile_weights
    needed, available = package_build_bytes(model), available_memory_bytes()
    if needed > available:
        raise MemoryError(f"building it needs ~{needed / 1e9:.1f} GB, {available / 1e9:.1f} GB available")
    start, started = time.perf_counter(), time.time()
    add_compile_weights(model)  # the plain weights export reads, for Inductor to pack; let go once it has
    if any(layer.format.compile_weight is not None and "weight" not in layer.tensors
           for layer in _packed_layers(model)):
        # left out for memory: their compiled paths would call their kernels on packed tensors (MKL's,
        # oneDNN's), which no package holds
        drop_compile_weights(model)
        raise MemoryError("the plain weights a package reads do not fit in memory")
    rows = package_rows(model, inputs[0].size(0))
    log.info("compiling the decode step for %s rows into %s (once per model and machine)",
             f"1 to {PACKAGE_ROWS}" if rows is None else rows, path)
    with _opaque_buffers_hidden(model), _lm_head_left_out(model):
        program = _export_step(model, inputs, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".partial-{os.getpid()}-{path.name}")  # .pt2 at the end, as AOTInductor requires
    try:
        from gpt2.kernels import others_cpu_share, warn_if_busy
        options = {**compile_options(model, "cpu", package_regimes(rows)), **PACKAGE_OPTIONS}
        with others_cpu_share() as cpus:  # its GEMMs are autotuned: timed, as kernels.py times them
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
        durable_replace(partial, path)  # atomic: a reader sees the whole package or none
        warn_if_busy(cpus, COMPILING, "the package keeps what was "
                     f"chosen (`gpt2 cache --clear compiled` builds it again; {path})")
    finally:
        partial.unlink(missing_ok=True)
        del program
        drop_compile_weights(model)  # and the build's garbage handed back, before the package's weights are read in
    drop_least_recently_used(path.parent.glob("decode-*.pt2"), PACKAGE_CACHE_BYTES, used_since=started)
    log.info("compiled the decode step in %.1f s", time.perf_counter() - start)
    return _load_package(path)


def _load_package(path: Path):
    """The package at path, loaded, and the weights it holds moved into huge pages (huge_pages.py)."""
    with collapsing_what_loads():
        return torch._inductor.aoti_load_package(str(path))


def _export_step(model, inputs, rows: int | None):
    """torch.export of decode_step on inputs, the attended length and the cache's capacity dynamic, and the
    batch's rows too where rows is None (1 to PACKAGE_ROWS). Export takes a dynamic size from an example
    of at least 2, so a 1-row call is exported on its rows twice over."""
    ids, positions, slot, keys, k, v = inputs
    if rows is None and ids.size(0) == 1:
        ids, positions, keys = ids.repeat(2, 1), positions.repeat(2, 1), keys.repeat(2, 1)
        k, v = [t.repeat(2, 1, 1, 1) for t in k], [t.repeat(2, 1, 1, 1) for t in v]
    batch = {} if rows is not None else {0: torch.export.Dim("rows", min=1, max=PACKAGE_ROWS)}
    length = torch.export.Dim("length", min=2, max=1 << 16)  # the keys attended to: slot + 1
    capacity = torch.export.Dim("capacity", min=3, max=1 << 16)  # the cache's slots
    cache = [{**batch, 2: capacity}] * len(k)
    dynamic = (batch or None, batch or None, None, {**batch, 1: length}, cache, cache)
    return torch.export.export(_StepModule(model), (ids, positions, slot, keys, k, v), dynamic_shapes=dynamic,
                               strict=False)


@contextlib.contextmanager
def _opaque_buffers_hidden(model):
    """The model's opaque buffers (oneDNN's and MKL's packed weights, which torch.export cannot trace) out of
    sight while it exports: the compiled paths read their plain copies instead (add_compile_weights)."""
    hidden = []
    for module in model.modules():
        for name, t in list(module._buffers.items()):
            if t is not None and t.is_mkldnn:  # oneDNN's packed weights and MKL's both have the mkldnn layout
                hidden.append((module, name, module._buffers.pop(name)))
    try:
        yield
    finally:
        for module, name, t in hidden:
            module._buffers[name] = t


def _inductor_config():
    import torch._inductor.config  # imported on first use: eager generation never pays for it
    return torch._inductor.config


def cache_key_pass(model):
    """A graph pass that does nothing, so that Inductor's on-disk graph cache tells models and machines apart.

    With freezing, the FX graph cache keys a graph by its code and its weights' shapes, and a cache
    entry keeps the constants Inductor derived from the weights while compiling (the C++ GEMM
    template's packed weights among them) by value. A second model of the same shapes
    then hit that entry and decoded with the first model's weights (pytorch/pytorch#143808 stores
    derived constants this way). Nor does the key name the CPU (only a GPU's name): a graph compiled
    for AMX, or under ATEN_CPU_CAPABILITY=avx2, would be served to another CPU or ISA limit (one such
    int8 graph aborted a normal process). Inductor adds a custom pass's uuid() to the key: this one's
    is a hash of every weight the model holds (weights_digest) and of kernels.machine_key() (the CPU
    model and flags, torch, the threads, the ISA limits set), so a cached graph serves the same
    weights on the same machine only.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass  # ~1 s to import: compiling pays it

    from gpt2.kernels import machine_key

    class CacheKey(CustomGraphPass):
        def __init__(self, digest: str):
            self.digest = digest

        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> str:
            return self.digest

    machine = json.dumps(machine_key(), sort_keys=True)
    return CacheKey(hashlib.sha256(f"{weights_digest(model)}|{machine}".encode()).hexdigest())


_weights_digests: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> weights_digest


def weights_digest(model) -> str:
    """sha256 over the model's parameters and buffers (names, dtypes, shapes, bytes), once a model.

    A oneDNN-packed weight is hashed in its plain layout. Packed engine objects (int8's u8s8 weights)
    are not tensors: they are made from the q and scales buffers beside them, which are hashed. MKL's
    packed bytes are not (WeightFormat.unset_padding: two packs of one weight differ in bytes): the
    weight MKL's GEMM reads back is. The plain copies add_compile_weights gives a compiled step are
    left out: they are read back from the packed weights, which are hashed, and come and go (a loaded
    package lets them go), while the digest must not. hashlib lets go of the GIL, so tensors are hashed
    on every core: 124M in 0.2-0.3 s on 2 cores (float32 ~1 s, reading MKL's weights back).
    """
    digest = _weights_digests.get(model)
    if digest is None:
        from gpt2.quantize import FastLinear
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        layers = {name: layer for name, layer in model.named_modules() if isinstance(layer, FastLinear)}
        # A weight held only in an engine's object (fbgemm's fp16) is hashed as read back
        tensors.update({f"{name}.read_back": layer.format.read_back(layer.kernel_args)
                        for name, layer in layers.items() if layer.format.read_back is not None})
        # by name: a float32 lm_head's plain copy is wte's own table, which is hashed as wte
        plain_copies = {f"{name}.weight" for name, layer in layers.items()
                        if layer.format.compile_weight is not None and "weight" in layer.tensors}
        read_back = {id(layer.tensors[key]): layer for layer in layers.values() for key in layer.format.unset_padding}

        def describe(item) -> str:
            name, t = item
            if id(t) in read_back:
                layer = read_back[id(t)]
                t = layer.format.compile_weight(layer.kernel_args)
            t = (t.to_dense() if t.is_mkldnn else t).detach().cpu().contiguous()
            data = t.view(-1).view(torch.uint8).numpy().data if t.numel() else b""
            return f"{name}:{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(data).hexdigest()};"

        items = sorted((name, t) for name, t in tensors.items() if t is not None and name not in plain_copies)
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            described = "".join(pool.map(describe, items))
        digest = _weights_digests[model] = hashlib.sha256(described.encode()).hexdigest()
    return digest


# False: a compiled step's GEMMs are the eager path's library calls, untimed (a graph builds 15-27 s sooner).
# The test suite turns autotuning off except in the tests about it (tests/conftest.py).
AUTOTUNE_CPU_GEMMS = True


def compile_options(model, device_type: str, regimes=("decode", "batch")) -> dict:
    """The Inductor settings model's compiled decode step is built under, for a step whose layers take
    their paths at these regimes (quantize.regime_of: a package of 1 to PACKAGE_ROWS rows, decode and batch).

    freezing: the model's packed weights become constants of the graph, which Inductor's oneDNN
    lowering requires (quantize._onednn). On a CPU, also max_autotune_gemm: Inductor times each GEMM
    of the graph, at its shape, as the library call the eager path makes (oneDNN, MKL, int4pack_mm)
    and as its own C++ GEMM template (AMX or AVX-512 micro-kernels, the weight packed its own way),
    and keeps the faster. Measured on an Intel Xeon with AMX (BENCHMARKS.md): bf16 decode 70 -> 83
    tok/s, int4 at batch 8 494 -> 581; each batch size's graph then takes 15-27 s longer to build
    for GPT-2 124M on 2 cores. Only the CPP and ATen backends (Triton's are GPU kernels). On a GPU it
    stays off: autotuning Triton GEMMs takes minutes, and it has not been measured there.

    emulate_precision_casts, only where a layer rounds on purpose (FastLinear.rounds_to: int8's c_attn
    rounds q, k and v to bf16, quantize.ROUNDS_KEYS_TO): a cast to bf16 and back then rounds inside a
    fused kernel as it does eagerly; without it int8 decoded other tokens compiled than eager.
    Elsewhere it is off, and a kernel fused after a bf16 GEMM reads the GEMM's float32 accumulator
    instead of its bf16 output: the bf16 lm_head's logits (and any sum fused after a bf16 GEMM) come out
    unrounded, which no eager CPU kernel here gives (bf16 GEMMs return bf16). On the quickstart model, compiled
    bf16 decode went from a KL divergence from float32 of 0.0000245 to 0.0000102 (BENCHMARKS.md).

    epilogue_fusion off where a layer of a bf16, int8 or int4 model multiplies in float32 at these
    regimes (quantize.FLOAT32_GEMM_PATHS): the next bf16 kernel casts its output to bf16, and Inductor
    (torch 2.13) fuses that cast into its C++ GEMM template, which then stores the GEMM's float32
    result (its bias added) into the bf16 output's buffer, twice the bytes: past the buffer's end (on an
    AMD EPYC Zen 3 with AVX2 only, whose bf16 plan takes "fp32 GEMM" at batch: "corrupted size vs.
    prev_size", the process aborted) and over the columns of the other thread's block.
    """
    from gpt2.quantize import FLOAT32_GEMM_PATHS, FastLinear
    rounds = any(getattr(layer, "rounds_to", None) is not None for layer in model.modules())
    options = {"freezing": True, "emulate_precision_casts": rounds}
    if any(isinstance(layer, FastLinear) and layer.format.precision != "float32"
           and any(layer.path_names.get(regime) in FLOAT32_GEMM_PATHS for regime in regimes)
           for layer in model.modules()):
        options["epilogue_fusion"] = False
    if device_type == "cpu" and AUTOTUNE_CPU_GEMMS:
        options.update(max_autotune_gemm=True, max_autotune_gemm_backends="CPP,ATEN",
                       autotune_num_choices_displayed=0, max_autotune_report_choices_stats=False)
    return options


def checked_compiled_step(model, args) -> torch.Tensor:
    """compiled_decode_step(model)(*args), args as decode_step takes them, with every guard checked.

    This checks all of torch.compile's guards (~3,000 on GPT-2's modules, ~0.8 ms) and compiles if
    none of the model's graphs fits (compile_options; torch.compile's options= does not reach the
    freezing pass, so the config is set around the call). The attended length grows by one a step,
    and the cache's capacity follows the request: both marked dynamic, one graph serves every step of
    every request of this batch size.
    """
    step = compiled_decode_step(model)
    if isinstance(step, PackagedDecodeStep):
        try:
            return step(*args)  # no guards: its inputs come from StaticDecode or the scheduler
        except Exception as error:  # export or AOTInductor failed on some format: torch.compile's graph instead
            log.warning("could not package the compiled decode step (%s: %s): compiling it with torch.compile",
                        type(error).__name__, error)
            _compiled_decode_steps[model] = _torch_compiled_step(model)
    keys, cache = args[4], args[5]
    torch._dynamo.mark_dynamic(keys, 1)
    for layer_cache in list(cache.k) + list(cache.v):  # (B, nh, capacity, hs) each
        torch._dynamo.mark_dynamic(layer_cache, 2)
    from gpt2.kernels import others_cpu_share, warn_if_busy
    from gpt2.quantize import regime_of
    options = compile_options(model, keys.device.type, (regime_of(keys.size(0)),))
    options["post_grad_custom_post_pass"] = cache_key_pass(model)  # the cache key names weights and machine
    from torch._dynamo.utils import counters
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"]
    with _inductor_config().patch(options), others_cpu_share(scan_at_entry=False) as cpus:  # read if it compiled
        logits = compiled_decode_step(model)(*args)
    compiled = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"] > misses
    if options.get("max_autotune_gemm") and compiled:  # a graph compiled here, its GEMMs timed
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        warn_if_busy(cpus, COMPILING, "Inductor's cache keeps what "
                     f"was chosen (delete {cache_dir()} to compile it again)")
    return logits


def unchecked_compiled_step(model, args) -> torch.Tensor:
    """compiled_decode_step(model)(*args) evaluating only the guards that tell the model's graphs apart,
    for a caller whose last call, with every guard checked, had the same model, cache storage and
    sizes but the attended length; if a size guard fails after all, every guard is checked again."""
    step = compiled_decode_step(model)
    if isinstance(step, PackagedDecodeStep):
        return step(*args)
    try:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return step(*args)
    except RuntimeError as error:
        if "skip_guard_eval_unsafe" not in str(error):
            raise
        return checked_compiled_step(model, args)


class StaticDecode:
    """The state a compiled decode carries between steps, allocated once: positions, slot, key mask."""

    def __init__(self, model, rows: list[list[int]], mask: torch.Tensor, capacity: int):
        device = mask.device
        P = max(len(r) for r in rows)
        self.model = model
        self.positions = torch.tensor([[len(r)] for r in rows], device=device)  # (B, 1): next position id
        self.slot = torch.tensor([P], device=device)  # (1,): the cache slot the next token writes
        self.length = P + 1  # slots the next step attends to: slot + 1, kept as an int too
        self.keys = torch.zeros(len(rows), capacity, dtype=torch.bool, device=device)  # (B, capacity)
        n = min(capacity, mask.size(1))
        self.keys[:, :n] = mask[:, :n].bool()
        self.guards_checked = False

    def __call__(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) of ids (B,) written at the cache's position, which then advances by one."""
        moved = cache.pos + 1 - self.length
        if moved:  # the cache moved without this step (a speculative round's rewind): follow it
            self.positions += moved
            self.slot += moved
            self.length += moved
        keys = self.keys[:, : self.length]  # a view: (B, slot + 1)
        args = (self.model, ids.view(-1, 1), self.positions, self.slot, keys, cache)
        if self.length == 1:
            # A draft's first step after a 1-token prompt: Dynamo specializes sizes 0 and 1, so a dynamic
            # length cannot start there. This one step runs eagerly.
            logits = decode_step(*args)
        elif self.guards_checked:  # every later step runs on the same model, cache and input tensors
            logits = unchecked_compiled_step(self.model, args)
        else:
            logits = checked_compiled_step(self.model, args)
            self.guards_checked = True
        cache.advance(1)
        self.positions += 1
        self.slot += 1
        self.length += 1
        return logits


# ---------------------------------------------------------------------------------------------
# speculative decoding: a draft proposes k tokens, the target checks them in one forward
# ---------------------------------------------------------------------------------------------

SELF_DRAFTS = {"self:int8": "int8", "self:int4": "int4"}  # draft= strings: the target's weights, quantized
MAX_DRAFT_TOKENS = 16  # adaptive k stays within [1, MAX_DRAFT_TOKENS]


@dataclass
class SpeculationStats:
    rounds: int = 0
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of those, kept (in a batch: the fewest any live row kept that round)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens per target forward: the kept drafts plus the target's own one."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def __add__(self, other: "SpeculationStats") -> "SpeculationStats":
        """Two generations' counts together: sum(stats, SpeculationStats())."""
        return SpeculationStats(self.rounds + other.rounds, self.proposed + other.proposed,
                                self.accepted + other.accepted)


@dataclass
class DraftCosts:
    """What a round costs, in target decode steps: a draft step, and each position a verify adds to the
    target's one-position forward. A round of k drafts costs k * draft_step + 1 + k * verify_position."""
    draft_step: float
    verify_position: float

    def round(self, k: int) -> float:
        return 1.0 + k * (self.draft_step + self.verify_position)


PROBE_DRAFTS = 8  # drafts in the rounds whose cost is measured; other k are interpolated linearly


def _round_seconds(spec: "Speculation", k: int, repeats: int = 5) -> tuple[float, float]:
    """(propose, verify) seconds of one round of k drafts as the engine runs it (forwards, the logits'
    processing, argmax), the fastest of `repeats` (other work on the machine only ever adds time);
    both caches are rewound after each, so every repeat starts where the first did."""
    device = spec.seq.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # CUDA runs asynchronously
    best = (float("inf"), float("inf"))
    for i in range(repeats + 1):  # the first is a warm-up
        sync()
        start = time.perf_counter()
        drafts, _ = spec.propose(k)
        sync()
        proposed = time.perf_counter()
        spec.verify(drafts)
        sync()
        verified = time.perf_counter()
        spec.draft_cache.rewind(k)
        spec.target_cache.rewind(k + 1)
        if i:
            best = (min(best[0], proposed - start), min(best[1], verified - proposed))
    return best


def _model_signature(model) -> dict:
    """What a forward's time depends on: the shape, and every linear's weight format (or dtype)."""
    from gpt2.quantize import FastLinear
    c = model.config
    formats = sorted({f"{m.format.precision} {m.format.name}" if isinstance(m, FastLinear) else str(m.weight.dtype)
                      for m in model.modules() if isinstance(m, (FastLinear, torch.nn.Linear))})
    return {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "vocab": model.padded_vocab_size,
            "device": str(model.transformer.wte.weight.device), "linears": formats}


@torch.inference_mode()
def draft_costs(target, draft, compiled: bool = False) -> DraftCosts:
    """The pair's DraftCosts, measured once per machine and pair, then read from the cache beside the
    kernel plans: greedy rounds of 0 and PROBE_DRAFTS drafts after a 16-token prompt, as
    Speculation runs them (~15 target forwards and ~50 draft steps: under a second for GPT-2 124M, a
    few for gpt2-xl). A round of 0 drafts is one target step with its processing, as plain decoding's."""
    from gpt2.kernels import cached_measurement, default_cache_path

    def measure() -> dict:
        context = min(target.config.n_positions, draft.config.n_positions)
        k = min(PROBE_DRAFTS, context - 2)
        if k < 1:  # no room for a round: count a draft as dear as the target
            return {"draft_step": 1.0, "verify_position": 0.0}
        prompt = [0] * min(16, context - k - 1)
        spec = Speculation.for_prompts(target, draft, [prompt], make_config(
            max_new_tokens=k + 1, ignore_eos=True, draft=draft, draft_tokens=k, adaptive_draft=False,
            compile=compiled))
        _, step = _round_seconds(spec, 0)
        propose, verify = _round_seconds(spec, k)
        return {"draft_step": propose / k / step, "verify_position": max(0.0, verify - step) / k / step}
    key = {"target": _model_signature(target), "draft": _model_signature(draft), "rounds of": PROBE_DRAFTS}
    if compiled:  # a compiled draft step costs less; the eager key stays as it was
        key["draft compiled"] = True
    # Every generate call with a draft asks: the cache file (and /proc/cpuinfo, for the machine's key)
    # is read once per process and cache location, not per call.
    memo_key = (str(default_cache_path()), json.dumps(key, sort_keys=True))
    if memo_key not in _draft_costs_read:
        costs, _ = cached_measurement("speculation", key, measure, validate=lambda entry: DraftCosts(**entry))
        _draft_costs_read[memo_key] = DraftCosts(**costs)
    return _draft_costs_read[memo_key]


_draft_costs_read: dict[tuple[str, str], DraftCosts] = {}  # draft_costs' answers in this process


@dataclass
class DraftLength:
    """k for the next round: fixed, or (adaptive) the k expected to give the most tokens per unit of time.

    Acceptance comes in runs (an easy stretch of text, then a hard token), so two chances are counted
    over the rounds so far, recent ones weighted more (DECAY per round): p1, that a round's first draft
    is accepted, and p, that a later draft is accepted given the one before it was (pooled over the
    positions 2..k: a few rounds measure it). Each has one pseudo-count, p1 at 1/2 and p at p1. Then,
    with the costs measured for the pair,
        k = argmax_k  E[tokens | k] / costs.round(k),   E[tokens | k] = 1 + p1 (1 + p + ... + p^(k-1))
    over last k // 2 <= k <= last k + GROWTH: k shrinks when acceptance falls or drafting is dear, and
    grows when acceptance is high. The outcomes alone decide k (never a clock), so a seed reproduces
    the same rounds.
    """
    k: int
    adaptive: bool = True
    costs: DraftCosts | None = None  # required when adaptive
    first: tuple[float, float] = (0.0, 0.0)  # (rounds, of which the first draft was accepted), decayed
    later: tuple[float, float] = (0.0, 0.0)  # (later drafts reached, of which accepted), decayed

    DECAY = 0.9  # per round: a round 7 rounds ago counts half
    # k grows by at most GROWTH a round (positions beyond the last k are extrapolated, not measured) and
    # at most halves (one early rejection, with little counted yet, would otherwise drop it to 1)
    GROWTH = 2

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or not proposed:
            return
        d = self.DECAY
        self.first = (d * self.first[0] + 1, d * self.first[1] + (accepted > 0))
        # drafts 2..k are reached while the one before was accepted: 2..min(accepted + 1, k)
        self.later = (d * self.later[0] + min(accepted, proposed - 1), d * self.later[1] + max(0, accepted - 1))
        p1, p = self.acceptance()
        lowest, highest = max(1, self.k // 2), min(MAX_DRAFT_TOKENS, self.k + self.GROWTH)
        self.k = max(range(lowest, highest + 1), key=lambda k: self.tokens_per_cost(k, p1, p))

    def acceptance(self) -> tuple[float, float]:
        """(p1, p), as the class docstring defines them."""
        p1 = (self.first[1] + 0.5) / (self.first[0] + 1.0)
        return p1, (self.later[1] + p1) / (self.later[0] + 1.0)

    def tokens_per_cost(self, k: int, p1: float, p: float) -> float:
        expected = 1.0 + p1 * sum(p ** i for i in range(k))
        return expected / self.costs.round(k)


class Speculation:
    """What speculative decoding carries from round to round: both caches, the committed ids, the samplers.

    seq (B, P + N) holds the committed ids, left-padded as `mask` is (None: no padding); `length`
    columns are committed, the first `prompt_length` of them the prompt.
    The target's cache holds every committed id but the last, which the next verify feeds first. The
    draft's cache holds at most as many: after a round that kept every draft it has not seen the last
    draft, so each round starts by feeding it the committed ids it has not seen (one or two; more when
    ids were committed without it, as the server does while a sequence shares the batch).
    Every row moves in lockstep (one cache position for the batch), so a round keeps, in every row, as
    many drafts as the live row that kept the fewest.
    """

    def __init__(self, target, draft, seq: torch.Tensor, length: int, prompt_length: int, target_cache,
                 draft_cache: KVCache | None, state: SamplingState, sampling: SamplingConfig, schedule: DraftLength,
                 generators=None, mask: torch.Tensor | None = None, stats: SpeculationStats | None = None,
                 draft_step: StaticDecode | None = None):
        self.target, self.draft, self.sampling = target, draft, sampling
        self.draft_step = draft_step  # the draft's compiled decode step (compile=True), else None: eager
        self.seq, self.length, self.prompt_length, self.mask = seq, length, prompt_length, mask
        # anything with KVCache's interface; the draft's may come later (batching.py), before the first round
        self.target_cache, self.draft_cache = target_cache, draft_cache
        self.state, self.generators, self.schedule = state, generators, schedule
        self.stats = SpeculationStats() if stats is None else stats  # the server's is shared by all its sequences

    @classmethod
    def for_prompts(cls, target, draft, rows: list[list[int]], cfg: GenerationConfig) -> "Speculation":
        """Both caches allocated for the prompts and max_new_tokens, and prefilled with every prompt id
        but the last (the first round's verify feeds that one)."""
        B, P, N = len(rows), max(len(r) for r in rows), cfg.max_new_tokens
        device = target.transformer.wte.weight.device
        check_draft_context(draft, P + N - 1)
        prompt, mask = left_pad(rows, P + N, device)  # (B, P), (B, P + N)
        seq = torch.zeros(B, P + N, dtype=torch.long, device=device)
        seq[:, :P] = prompt
        state = SamplingState(rows, cfg.sampling, target.config.vocab_size, device)
        # A compiled draft step keeps a slot to spare in its cache, as _run's does.
        draft_capacity = P + N - 1 + int(cfg.compile)
        spec = cls(target, draft, seq, P, P, KVCache.for_model(target, B, P + N - 1),
                   KVCache.for_model(draft, B, draft_capacity, compiled=cfg.compile), state, cfg.sampling,
                   DraftLength(cfg.draft_tokens, cfg.adaptive_draft,
                               draft_costs(target, draft, cfg.compile) if cfg.adaptive_draft else None),
                   None if cfg.sampling.greedy else make_generators(cfg.seed, B, device),
                   mask if any(len(r) != P for r in rows) else None,
                   draft_step=StaticDecode(draft, rows, mask, draft_capacity) if cfg.compile else None)
        if P > 1:
            spec._forward(target, spec.target_cache, prompt[:, :-1], last_logits_only=True)
            spec._forward(draft, spec.draft_cache, prompt[:, :-1], last_logits_only=True)
        return spec

    @property
    def generated(self) -> int:
        return self.length - self.prompt_length

    def draft_length(self) -> int:
        """This round's k: the schedule's, less where the round would commit past max_new_tokens."""
        return min(self.schedule.k, self.seq.size(1) - self.length - 1)

    def _forward(self, model, cache: KVCache, ids: torch.Tensor, last_logits_only: bool = False) -> torch.Tensor:
        """model over ids (B, T) after the cache's positions: logits (B, T, V), or (B, 1, V)."""
        mask = None if self.mask is None else self.mask[:, :cache.pos + ids.size(1)]
        return model(ids, cache=cache, attention_mask=mask, last_logits_only=last_logits_only)

    def _draft_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft's raw logits (B, V) after it reads ids (B, T)."""
        if self.draft_step is None:
            return self._forward(self.draft, self.draft_cache, ids, last_logits_only=True)[:, -1]
        for j in range(ids.size(1)):  # the compiled step reads one id at a time
            # a copy with standard strides: a strided view would fail the compiled graph's guards
            logits = self.draft_step(ids[:, j].clone(memory_format=torch.contiguous_format), self.draft_cache)
        return logits

    def propose(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's next k ids (B, k), each drawn as the target would draw (the same sampling config),
        and the distributions they came from (B, k, V); None when greedy."""
        B, V = self.seq.size(0), self.target.config.vocab_size
        drafts = torch.zeros(B, k, dtype=torch.long, device=self.seq.device)
        probs = torch.zeros(B, k, V, device=self.seq.device) if not self.sampling.greedy else None
        state = self.state.clone()  # penalties see the drafts before each one
        ids = self.seq[:, self.draft_cache.pos:self.length]  # (B, 1 or 2): committed, unseen by the draft
        for i in range(k):
            logits = state.process(self._draft_logits(ids), self.sampling)  # (B, V)
            if probs is None:
                drafts[:, i] = greedy(logits)
            else:
                probs[:, i] = logits.softmax(dim=-1)
                drafts[:, i] = draw(probs[:, i], self.generators)
            state.record(drafts[:, i])
            ids = drafts[:, i:i + 1]
        return drafts, probs

    def verify(self, drafts: torch.Tensor) -> torch.Tensor:
        """One target forward over the last committed id and the k drafts: processed logits (B, k + 1, V)."""
        ids = torch.cat([self.seq[:, self.length - 1:self.length], drafts], dim=1)  # (B, k + 1)
        logits = self._forward(self.target, self.target_cache, ids)  # (B, k + 1, V)
        state = self.state.clone()
        processed = []
        for i in range(ids.size(1)):  # position i's penalties count the drafts before it
            processed.append(state.process(logits[:, i], self.sampling))
            if i < drafts.size(1):
                state.record(drafts[:, i])
        return torch.stack(processed, dim=1)

    @staticmethod
    def keep(drafts: torch.Tensor, accepted: torch.Tensor, next_ids: torch.Tensor,
             live: torch.Tensor) -> torch.Tensor:
        """The ids every row keeps (B, n + 1): n = the fewest drafts a live row accepted. A row that accepted
        more keeps its draft n as the last id (accepted, so distributed as the target's); the others their
        own next id."""
        n = int(accepted[live.to(accepted.device)].min()) if bool(live.any()) else 0
        last = next_ids if n == drafts.size(1) else torch.where(accepted == n, next_ids, drafts[:, n])
        return torch.cat([drafts[:, :n], last.view(-1, 1)], dim=1)

    def extend(self, next_id: int) -> None:
        """A committed id that did not come from a round (the server's plain steps); the target's cache
        took it as usual, the draft's catches up at the next round."""
        self.seq[:, self.length] = next_id
        self.length += 1

    def commit(self, kept: torch.Tensor, proposed: int) -> None:
        """Append the kept ids; both caches roll back to every committed id but the last; adapt k."""
        n = kept.size(1)
        self.seq[:, self.length:self.length + n] = kept
        self.length += n
        self.target_cache.rewind(self.target_cache.pos - (self.length - 1))  # the rejected drafts and one past
        self.draft_cache.rewind(max(0, self.draft_cache.pos - (self.length - 1)))  # it may lag instead
        for column in kept.t():
            self.state.record(column)
        self.stats.rounds += 1
        self.stats.proposed += proposed
        self.stats.accepted += n - 1
        self.schedule.update(proposed, n - 1)


# target -> (weights' identity, precision) -> its quantized copy: a self-draft is built once, not per call
_self_drafts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def draft_fits(draft, positions: int) -> bool:
    """Whether the draft's context holds `positions` (prompt + max_new_tokens - 1): its cache needs them."""
    return positions <= draft.config.n_positions


def check_draft_context(draft, positions: int) -> None:
    if not draft_fits(draft, positions):
        raise ContextLengthError(f"the draft's context is {draft.config.n_positions} tokens; this request needs "
                                 f"{positions} (prompt + max_new_tokens - 1)")


def resolve_draft(target, draft):
    """The draft model: `draft` itself, or for "self:int8" / "self:int4" the target's weights quantized
    (built on the first call and kept while the target lives and its weights are unchanged)."""
    if isinstance(draft, str):
        if draft not in SELF_DRAFTS:
            raise ConfigError(f"draft {draft!r} is not a model; pass a GPT, or one of {', '.join(SELF_DRAFTS)}")
        # A weight changed in place bumps its version counter; a replaced one is a new tensor.
        weights = tuple((id(t), t._version) for t in (*target.parameters(), *target.buffers()))
        cached = _self_drafts.setdefault(target, {})
        if (weights, draft) not in cached:
            for stale in [key for key in cached if key[0] != weights]:  # copies of weights the target no longer has
                del cached[stale]
            cached[weights, draft] = quantized_copy(target, SELF_DRAFTS[draft])
        draft = cached[weights, draft]
    if not hasattr(draft, "config") or not hasattr(draft, "transformer"):
        raise ConfigError(f"draft must be a GPT model or one of {', '.join(SELF_DRAFTS)}, got {type(draft).__name__}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"the draft's vocabulary has {draft.config.vocab_size} tokens and the target's "
                          f"{target.config.vocab_size}: speculative decoding needs one vocabulary")
    if draft.transformer.wte.weight.device != target.transformer.wte.weight.device:
        raise ConfigError(f"the draft is on {draft.transformer.wte.weight.device}, the target on "
                          f"{target.transformer.wte.weight.device}")
    return draft


@torch.no_grad()
def quantized_copy(model, precision: str):
    """A new model with `model`'s weights, its linears in `precision` (the kernels kernels.py measured
    fastest here); `model` is untouched. The self-draft of speculative decoding.

    Float32 weights are shared, not copied, until each linear is packed. Packed linears (FastLinear) are
    read back through their format's reference weights, so a float32, bfloat16 or int8 model loaded for
    inference can be copied (its float32 weights then exist at once, briefly); an int4 one cannot.
    """
    from gpt2.kernels import plan_for
    from gpt2.model import GPT
    from gpt2.quantize import FastLinear, apply_plan
    state = {name: t.float() for name, t in model.state_dict().items()}
    for name, layer in model.named_modules():
        if isinstance(layer, FastLinear):
            try:
                state[f"{name}.weight"] = layer.reference_weight().float()
            except ValueError as e:
                raise ConfigError(f"{name} is packed as {layer.format.precision} {layer.format.name}, whose weights "
                                  f"cannot be read back ({e}); quantize the model before packing it") from None
            if layer.bias is not None:
                state[f"{name}.bias"] = layer.bias.float()
    with torch.device("meta"):
        copy = GPT(model.config, vocab_multiple=model.padded_vocab_size)  # the same padded rows
    copy.load_state_dict(state, strict=True, assign=True)
    copy.kv_dtype = getattr(model, "kv_dtype", None)  # a self-draft's caches as the target's
    copy.compiled_kv_dtype = getattr(model, "compiled_kv_dtype", None)  # "auto": chosen for the copy's own keys
    del state  # the packed copies replace them one linear at a time
    return apply_plan(copy, plan_for(copy, precision))


def stream(model, prompts: list[list[int]], max_new_tokens: int = 64, **options) -> Stream:
    """Yield, step by step, the new id of each row (None for rows that are done). Options: generate's."""
    return Stream(model, prompts, make_config(max_new_tokens=max_new_tokens, **options))


def generate(model, prompts: list[list[int]], max_new_tokens: int = 64, **options) -> list[list[int]]:
    """New ids of each prompt (stop tokens excluded).

    options (keywords, make_config's): temperature (0: greedy), top_k, top_p, min_p, seed (an int, or
    one per row), stop_token_ids, repetition_penalty, frequency_penalty, presence_penalty, logit_bias
    ({id: bias}), ignore_eos (EOS is <|endoftext|> for GPT-2's vocabulary), truncate ("left"),
    compile (torch.compile one fixed-shape decode step; the first call per shape compiles: BENCHMARKS.md),
    draft (a GPT with the same vocabulary, or "self:int8" / "self:int4"), draft_tokens (k, default 4),
    adaptive_draft (default True: k grows while drafts are kept, shrinks when they are rejected).
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
