"""Sampling as small pure functions on a batch of next-token logits (B, V).

    from gpt2.sampling import SamplingConfig, next_tokens
    ids = next_tokens(logits, SamplingConfig(temperature=0.8, top_k=50), generators)   # (B,)

The order is Transformers' logits-processor order: penalties and logit bias on the raw logits, then
temperature, then top-k, top-p and min-p filtering, then a draw from the softmax. Temperature 0 is
greedy (argmax after penalties and bias) and never touches a generator, so it never depends on a seed.

Randomness comes only from explicit torch.Generator objects: one for the whole batch, or one per row
(then a row's draws do not depend on which other rows share its batch).

Speculative decoding (engine.py) checks a draft model's tokens with `accept_drafts`: greedy keeps a
draft while it is the target's argmax; sampling keeps it with probability min(1, p/q) and replaces the
first rejected one by a draw from max(0, p - q), so the kept tokens follow the target's distribution.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from gpt2.errors import ConfigError


@dataclass
class SamplingConfig:
    temperature: float = 0.0             # 0 means greedy
    top_k: int | None = None             # keep the k most likely tokens
    top_p: float | None = None           # keep the smallest set whose probability reaches p (nucleus)
    min_p: float | None = None           # keep tokens with probability >= min_p * the top probability
    repetition_penalty: float = 1.0      # CTRL's: divide positive / multiply negative logits of seen tokens
    frequency_penalty: float = 0.0       # OpenAI's: subtract penalty * count of each generated token
    presence_penalty: float = 0.0        # OpenAI's: subtract penalty once from every generated token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_repetition(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_counts(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL / Transformers: seen (B, V) bool marks tokens in the prompt or output so far."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence(logits: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float):
    """OpenAI's penalties: counts (B, V) of each token among the generated ones."""
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """bias: a dense (V,) tensor, zero except at the biased ids."""
    return logits + bias


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _exact_dtype(device: torch.device) -> torch.dtype:
    """float64 for sums of probabilities, where the device has it (MPS does not: float32 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: drop the tokens outside the smallest set whose probability mass reaches p.

    Token j is dropped when its tail mass (its own probability and that of every less likely token) is at
    most 1 - p; the most likely token is always kept. Transformers sorts all V logits and sums float32
    probabilities from the least likely up; sorting GPT-2's 50,257 took 3.4 ms a row. Here only the k most
    likely are sorted (torch.topk: 256 first, then 16 times more while the mass outside them exceeds 1 - p,
    when not every token outside is certain to be dropped), and masses are summed in float64: the mass
    outside the top k is the total less theirs, both summed from the same exponentials, so it keeps its
    precision when it is tiny (p near 1). The kept set is the float64 nucleus, which is Transformers'
    wherever its float32 rounding does not decide (tests/test_sampling.py).
    """
    if p >= 1.0:
        return logits
    V = logits.size(-1)
    exp = (logits - logits.amax(dim=-1, keepdim=True)).exp()  # (B, V) float32, the largest 1
    total = exp.sum(dim=-1, keepdim=True, dtype=_exact_dtype(logits.device))  # (B, 1)
    k = min(V, 256)
    while True:
        order = logits.topk(k, dim=-1).indices  # (B, k), most likely first
        top = exp.gather(-1, order).to(total.dtype)  # (B, k)
        outside = (total - top.sum(dim=-1, keepdim=True)).clamp(min=0.0) / total  # (B, 1): the other V - k's mass
        if k == V or bool((outside <= 1 - p).all()):
            break  # every token outside the top k has a tail mass <= outside <= 1 - p: dropped
        k = min(V, 16 * k)  # topk of 256 / 4096 / all took 0.12 / 0.6 / 3.7 ms: a flat distribution costs a sort
    tail_mass = outside + (top / total).flip(-1).cumsum(dim=-1).flip(-1)  # (B, k): from the least likely up
    keep = tail_mass > 1 - p
    keep[:, 0] = True  # always keep the most likely token
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, keep)
    return logits.masked_fill(~kept, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The index of the largest logit along the last dim, the first of equal ones: argmax.

    max(...).indices computes the same index (first on ties, a NaN counts as the largest, as in argmax)
    2-3x faster on a CPU: 31 against 71 us for (1, 50257), 98 against 286 us for (8, 50257)."""
    return logits.max(dim=-1).indices


def draw(probs: torch.Tensor, generators: list[torch.Generator] | torch.Generator | None) -> torch.Tensor:
    """One id per row from probs (B, V), which need not be normalised: one generator for the batch, or a
    list with one per row.

    Inverse transform sampling: one uniform u per row, and the first id whose cumulative mass (float64)
    exceeds u times the total. An id of probability 0 adds nothing to the cumulative mass, so it is never
    the first to exceed it. torch.multinomial draws V exponentials per row instead (~1 ms for GPT-2's
    vocabulary on a CPU core, against ~0.04 ms here). Row by row: a (B, V) float64 temporary of a few MB
    measured up to 2 ms in page faults.
    """
    exact = _exact_dtype(probs.device)
    u = uniform(probs.size(0), 1, generators, probs.device, exact)  # (B, 1): 53 bits, finer than any id's mass
    ids = []
    for row, u_row in zip(probs, u):
        cdf = row.to(exact).cumsum(dim=0)  # (V,)
        ids.append(torch.searchsorted(cdf, u_row * cdf[-1], right=True))  # (1,): the first cdf > u * total
    return torch.cat(ids).clamp_(max=probs.size(-1) - 1)


def uniform(batch_size: int, n: int, generators, device=None, dtype=torch.float32) -> torch.Tensor:
    """(B, n) draws from U[0, 1): one generator for the batch, or a list with one per row."""
    if isinstance(generators, (list, tuple)):
        return torch.stack([torch.rand(n, generator=g, device=device, dtype=dtype) for g in generators])
    return torch.rand(batch_size, n, generator=generators, device=device, dtype=dtype)


def process_logits(logits: torch.Tensor, cfg: SamplingConfig, seen=None, counts=None, bias=None) -> torch.Tensor:
    """Penalties, bias, temperature and filters: float32 logits (B, V) ready for argmax or softmax."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
    if counts is not None:
        logits = apply_frequency_presence(logits, counts, cfg.frequency_penalty, cfg.presence_penalty)
    if bias is not None:
        logits = apply_logit_bias(logits, bias)
    if cfg.greedy:
        return logits
    logits = logits / cfg.temperature
    if cfg.top_k is not None:
        logits = top_k_filter(logits, cfg.top_k)
    if cfg.top_p is not None:
        logits = top_p_filter(logits, cfg.top_p)
    if cfg.min_p is not None and cfg.min_p > 0:
        logits = min_p_filter(logits, cfg.min_p)
    return logits


def next_tokens(logits: torch.Tensor, cfg: SamplingConfig, generators=None, seen=None, counts=None,
                bias=None) -> torch.Tensor:
    """The next id of every row: logits (B, V) -> (B,) int64."""
    logits = process_logits(logits, cfg, seen, counts, bias)
    if cfg.greedy:
        return greedy(logits)
    return draw(logits.softmax(dim=-1), generators)


def accept_drafts(target_logits: torch.Tensor, draft_probs: torch.Tensor | None, drafts: torch.Tensor,
                  cfg: SamplingConfig, generators=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): how many drafts each row keeps, and
    the target's own token after them.

    target_logits (B, k + 1, V): the target's processed logits (process_logits) at each draft and one past
    the last; draft_probs (B, k, V): the distributions the drafts (B, k) were drawn from (None if greedy).
    Returns accepted (B,) in [0, k] and next_ids (B,).
      greedy:   a draft is kept while it equals the target's argmax; next is the argmax after the kept ones.
      sampling: draft i is kept with probability min(1, p_i(d) / q_i(d)); at the first rejection next is
                drawn from max(0, p - q) renormalised, after k kept drafts from p_{k+1}. Kept drafts plus
                next are then distributed exactly as tokens sampled from the target one by one.
    """
    B, k = drafts.shape
    if cfg.greedy:
        target_ids = greedy(target_logits)  # (B, k + 1)
        accepted = (target_ids[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)
        return accepted, target_ids.gather(1, accepted.view(B, 1)).view(B)
    p = target_logits.softmax(dim=-1)  # (B, k + 1, V)
    p_draft = p[:, :k].gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # (B, k): p_i(d_i)
    q_draft = draft_probs.gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # (B, k): q_i(d_i) > 0
    keep = uniform(B, k, generators, p.device) * q_draft < p_draft  # u < p / q, without dividing
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, accepted]  # (B, V)
    q_next = torch.cat([draft_probs, torch.zeros_like(p[:, :1])], dim=1)[rows, accepted]  # 0 past the drafts
    residual = (p_next - q_next).clamp(min=0)
    # A rejection means p < q somewhere, so p > q elsewhere; only rounding can leave no mass at all.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    return accepted, draw(residual, generators)  # draw normalises: no pass to divide by the sum


def make_generators(seed, batch_size: int, device) -> torch.Generator | list[torch.Generator]:
    """One generator for the batch (seed None or int), or one per row (a list of seeds)."""
    def gen(s):
        g = torch.Generator(device=device)
        if s is None:
            g.seed()  # fresh entropy: sampling without a seed is not reproducible, by request
        else:
            g.manual_seed(int(s))
        return g
    if isinstance(seed, (list, tuple)):
        if len(seed) != batch_size:
            raise ConfigError(f"seed has {len(seed)} entries for {batch_size} prompts")
        return [gen(s) for s in seed]
    return gen(seed)


class SamplingState:
    """Per-batch tensors the samplers need: seen tokens, generated counts, dense logit bias. Allocated once."""

    def __init__(self, rows: list[list[int]], cfg: SamplingConfig, vocab_size: int, device):
        B = len(rows)
        self.seen = self.counts = self.bias = None
        if cfg.uses_repetition:
            self.seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)  # prompt + output
            for i, r in enumerate(rows):
                self.seen[i, torch.tensor(r, device=device)] = True
        if cfg.uses_counts:
            self.counts = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)  # output only
        if cfg.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            for t, b in cfg.logit_bias.items():
                if not 0 <= int(t) < vocab_size:
                    raise ConfigError(f"logit_bias names token {t}, outside [0, {vocab_size})")
                self.bias[int(t)] = float(b)

    def clone(self) -> "SamplingState":
        """A copy to record tentative ids in (speculative drafts); this one stays as it was."""
        other = copy.copy(self)
        other.seen = None if self.seen is None else self.seen.clone()
        other.counts = None if self.counts is None else self.counts.clone()
        return other

    def process(self, logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
        """process_logits with this state's penalties and bias: logits (B, V) -> float32 (B, V)."""
        return process_logits(logits, cfg, self.seen, self.counts, self.bias)

    def record(self, ids: torch.Tensor) -> None:
        """Count the ids (B,) just sampled."""
        if self.seen is not None:
            self.seen.scatter_(1, ids.view(-1, 1), True)
        if self.counts is not None:
            self.counts.scatter_add_(1, ids.view(-1, 1), torch.ones_like(ids, dtype=torch.float32).view(-1, 1))
