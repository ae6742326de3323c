"""The sampling functions (gpt2.sampling) against Transformers' logits processors, an independent reference.

    .venv/bin/python -m pytest tests/test_sampling.py -q

References: `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper` and
`RepetitionPenaltyLogitsProcessor` on the same random float32 logits, one at a time and chained in
Transformers' order. Every comparison is exact: the same filtered logits bit for bit (so the same kept
set and the same -inf elsewhere). Where tied logits straddle a cut, which of the tied tokens survive
is arbitrary (each sort breaks ties its own way), so there the kept *values* must agree as a multiset.
For top-p, a third reference is the nucleus computed in float64 from the same logits.
"""

from __future__ import annotations

import pytest
import torch

from gpt2.config import GPT2_VOCAB_SIZE
from gpt2.sampling import (SamplingConfig, apply_repetition_penalty, greedy, min_p_filter, process_logits,
                           top_k_filter, top_p_filter)

transformers = pytest.importorskip("transformers")
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,  # noqa: E402
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

SHAPES = [(1, 7), (3, 50), (4, 1000), (2, GPT2_VOCAB_SIZE)]  # (B, V)
SEEDS = range(4)
NO_IDS = torch.zeros(1, 1, dtype=torch.long)  # the warpers ignore input_ids


def random_logits(B, V, seed):
    """(B, V) float32 logits with a per-seed spread: from nearly flat to sharply peaked."""
    g = torch.Generator().manual_seed(seed)
    scale = 0.5 + 4 * torch.rand(1, generator=g).item()
    return torch.randn(B, V, generator=g) * scale


def tied_logits(B, V, seed):
    """(B, V) logits with few distinct values, so most cuts fall inside a run of ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (B, V), generator=g).float()


def cases(make=random_logits):
    return [pytest.param(make(B, V, seed), id=f"B{B}-V{V}-seed{seed}") for B, V in SHAPES for seed in SEEDS]


def hf(processor, logits, input_ids=NO_IDS):
    return processor(input_ids, logits.clone())


def assert_same_kept_values(ours, theirs):
    """Row by row: the same number of tokens kept, holding the same logit values (ties may swap places)."""
    for a, b in zip(ours, theirs):
        ka, kb = a[torch.isfinite(a)], b[torch.isfinite(b)]
        assert torch.equal(ka.sort().values, kb.sort().values)


def nucleus_size_float64(row, p):
    """How many tokens the smallest set with probability mass >= p has, in float64."""
    probs = row.double().softmax(-1).sort(descending=True).values
    mass_before = probs.cumsum(-1) - probs
    return int((mass_before < p).sum())


# ---------------------------------------------------------------------------------------------
# temperature
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("logits", cases())
@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 1.5, 100.0])
def test_temperature_matches_transformers(logits, temperature):
    ours = process_logits(logits, SamplingConfig(temperature=temperature))
    assert torch.equal(ours, hf(TemperatureLogitsWarper(temperature), logits))


# ---------------------------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("logits", cases() + cases(tied_logits))
@pytest.mark.parametrize("k", [1, 2, 5, "V-1", "V", "V+3"])
def test_top_k_matches_transformers(logits, k):
    V = logits.size(-1)
    k = {"V-1": max(1, V - 1), "V": V, "V+3": V + 3}.get(k, k)
    ours = top_k_filter(logits, k)
    assert torch.equal(ours, hf(TopKLogitsWarper(k), logits))  # both keep every tie of the k-th value
    if k >= V:
        assert torch.equal(ours, logits)


# ---------------------------------------------------------------------------------------------
# top-p
# ---------------------------------------------------------------------------------------------

# Where float32 rounding of the cumulative mass decides the cut (p near 1, thousands of tokens inside
# the nucleus), a cumulative sum from the top keeps too few tokens; the test after these checks it.
TOP_P = [1e-6, 0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0]


@pytest.mark.parametrize("logits", list(cases()))
@pytest.mark.parametrize("p", TOP_P)
def test_top_p_matches_transformers(logits, p):
    ours = top_p_filter(logits, p)
    assert torch.equal(ours, hf(TopPLogitsWarper(p), logits))
    for row, kept in zip(logits, torch.isfinite(ours).sum(-1).tolist()):
        assert kept == nucleus_size_float64(row, p)


@pytest.mark.parametrize("seed", SEEDS)
def test_top_p_at_every_cut_of_the_full_vocabulary(seed):
    """p halfway between consecutive nucleus masses (float64), so no rounding decides: each cut j keeps j tokens."""
    row = random_logits(1, GPT2_VOCAB_SIZE, seed)
    probs = row[0].double().softmax(-1).sort(descending=True).values
    mass = probs.cumsum(-1)
    for j in [1, 2, 3, 10, 100, 1000]:
        p = float((mass[j - 2] + mass[j - 1]) / 2) if j > 1 else float(mass[0] / 2)
        ours = top_p_filter(row, p)
        assert torch.equal(ours, hf(TopPLogitsWarper(p), row))
        assert int(torch.isfinite(ours).sum()) == j


@pytest.mark.parametrize("logits", list(cases(tied_logits)))
@pytest.mark.parametrize("p", TOP_P)
def test_top_p_with_ties_keeps_the_same_values_as_transformers(logits, p):
    """Transformers' values, row by row, except where its float32 sum decides the cut: there (the float64
    mass before or after the cut within FLOAT32_SUM_ROUNDING of p) ours is the float64 nucleus. Which
    side float32 falls on depends on the CPU's vector width (AVX-512 and AVX2 sum in different orders)."""
    ours, theirs = top_p_filter(logits, p), hf(TopPLogitsWarper(p), logits)
    for row, a, b in zip(logits, ours, theirs):
        if float32_rounding_decides(row, p):
            assert int(torch.isfinite(a).sum()) == nucleus_size_float64(row, p)
        else:
            assert_same_kept_values(a[None], b[None])


FLOAT32_SUM_ROUNDING = 1e-5  # relative: ~ sqrt(V) float32 roundings of a sum over GPT-2's 50,257 tokens


def float32_rounding_decides(row, p) -> bool:
    """Whether the tail mass Transformers compares with 1 - p (float32, summed from the least likely token
    up) lies, at the last kept token or the first dropped one, within float32's rounding of 1 - p."""
    probs = row.double().softmax(-1).sort(descending=True).values
    k = nucleus_size_float64(row, p)
    tails = [float(probs[k:].sum())]  # the first dropped token's
    if k > 1:  # the last kept token's (the most likely one is kept whatever its tail)
        tails.append(float(probs[k - 1:].sum()))
    return any(abs(tail - (1 - p)) < FLOAT32_SUM_ROUNDING * (1 - p) for tail in tails)


def test_top_p_keeps_the_most_likely_token_and_skips_minus_inf():
    logits = torch.tensor([[0.0, 9.0, float("-inf"), 1.0], [float("-inf"), float("-inf"), 2.0, 2.0]])
    for p in (1e-9, 0.5, 0.999):
        ours = top_p_filter(logits, p)
        assert_same_kept_values(ours, hf(TopPLogitsWarper(p), logits))  # row 1: two tied tokens of mass 0.5 each
        assert ours[0, 1] == 9.0 and torch.isinf(ours[:, :2][1]).all() and torch.isinf(ours[0, 2])


def test_top_p_matches_transformers_and_float64_where_rounding_decides():
    mismatches = []
    for make in (random_logits, tied_logits):
        for B, V in SHAPES:
            for seed in range(10):
                logits = make(B, V, seed)
                for p in (0.3, 0.9, 0.95, 0.999, 1 - 1e-7):
                    ours = top_p_filter(logits, p)
                    kept = torch.isfinite(ours).sum(-1).tolist()
                    exact = [nucleus_size_float64(r, p) for r in logits]
                    theirs = hf(TopPLogitsWarper(p), logits)
                    same = torch.equal(ours, theirs) if make is random_logits else kept == exact
                    if not same or kept != exact:
                        mismatches.append((make.__name__, B, V, seed, p, kept, exact))
    assert not mismatches, f"{len(mismatches)} cases (logits, B, V, seed, p, kept, float64 nucleus): {mismatches[:4]}"


# ---------------------------------------------------------------------------------------------
# min-p
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("logits", cases() + cases(tied_logits))
@pytest.mark.parametrize("min_p", [0.0, 1e-4, 0.05, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers(logits, min_p):
    ours = min_p_filter(logits, min_p)
    assert torch.equal(ours, hf(MinPLogitsWarper(min_p), logits))
    if min_p == 1.0:  # only the top value survives (with its ties)
        assert torch.equal(torch.isfinite(ours), logits == logits.max(-1, keepdim=True).values)


# ---------------------------------------------------------------------------------------------
# repetition penalty
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("logits", cases() + cases(tied_logits))  # tied_logits holds exact zeros
@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(logits, penalty):
    B, V = logits.shape
    g = torch.Generator().manual_seed(V)
    input_ids = torch.randint(0, min(V, 20), (B, 12), generator=g)  # (B, T) with repeats
    seen = torch.zeros(B, V, dtype=torch.bool).scatter_(1, input_ids, True)
    ours = apply_repetition_penalty(logits, seen, penalty)
    assert torch.equal(ours, hf(RepetitionPenaltyLogitsProcessor(penalty), logits, input_ids))


# ---------------------------------------------------------------------------------------------
# the whole chain, in Transformers' order
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("logits", [c for c in cases() if c.values[0].size(-1) <= 1000])
@pytest.mark.parametrize("cfg", [
    SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3),
    SamplingConfig(temperature=1.2, top_p=0.5, min_p=0.05, repetition_penalty=0.7),
    SamplingConfig(temperature=0.3, top_k=3, min_p=0.2),
    SamplingConfig(temperature=1.0, top_k=100_000, top_p=1.0, min_p=0.0),
], ids=["k-p-rep", "p-minp-rep<1", "k-minp", "all-off"])
def test_process_logits_matches_transformers_chain(logits, cfg):
    B, V = logits.shape
    input_ids = torch.randint(0, V, (B, 9), generator=torch.Generator().manual_seed(1))
    seen = torch.zeros(B, V, dtype=torch.bool).scatter_(1, input_ids, True)
    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty),
                                 TemperatureLogitsWarper(cfg.temperature)])
    if cfg.top_k is not None:
        chain.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p is not None:
        chain.append(TopPLogitsWarper(cfg.top_p))
    if cfg.min_p is not None:
        chain.append(MinPLogitsWarper(cfg.min_p))
    ours = process_logits(logits, cfg, seen=seen if cfg.uses_repetition else None)
    assert torch.equal(ours, chain(input_ids, logits.clone()))


# --- speculative acceptance ---------------------------------------------------------------------------

def test_accept_drafts_keeps_drafts_the_target_agrees_with():
    from gpt2.sampling import accept_drafts
    logits = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(0))  # (B, k + 1, V)
    target_ids = logits.argmax(-1)
    drafts = target_ids[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % 10  # row 1 disagrees at its second draft
    drafts[2, 0] = (drafts[2, 0] + 1) % 10  # row 2 at its first
    accepted, next_ids = accept_drafts(logits, None, drafts, SamplingConfig())
    assert accepted.tolist() == [3, 1, 0]
    assert next_ids.tolist() == [target_ids[0, 3], target_ids[1, 1], target_ids[2, 0]]
    # sampling with q == p keeps everything (u < 1 = p/q); with p(d) = 0 never, and the replacement
    # comes from max(0, p - q), which is 0 wherever the draft put more mass than the target
    cfg = SamplingConfig(temperature=1.0)
    p = logits.softmax(-1)
    gen = torch.Generator().manual_seed(1)
    accepted, _ = accept_drafts(logits, p[:, :3], target_ids[:, :3], cfg, gen)
    assert accepted.tolist() == [3, 3, 3]
    impossible = logits.clone()
    impossible[:, 0, 0] = float("-inf")
    q = torch.zeros(3, 3, 10)
    q[:, :, 0] = 1.0  # the draft is sure of token 0
    for _ in range(20):
        accepted, next_ids = accept_drafts(impossible, q, torch.zeros(3, 3, dtype=torch.long), cfg, gen)
        assert accepted.tolist() == [0, 0, 0] and 0 not in next_ids.tolist()


# --- drawing an id ----------------------------------------------------------------------------------

def test_draw_follows_the_distribution_and_never_draws_an_impossible_id():
    """Inverse transform sampling against the distribution it is given (unnormalised, with zeros, and a
    wide one with GPT-2's vocabulary): Pearson's chi-square at test_speculative's significance."""
    from test_speculative import ALPHA, chi_square_p_value

    from gpt2.sampling import draw
    g = torch.Generator().manual_seed(0)
    small = torch.tensor([[0.0, 5.0, 2.0, 0.0, 3.0, 0.5]])  # sums to 10.5, two impossible ids
    wide = (torch.randn(1, GPT2_VOCAB_SIZE, generator=g) * 4).softmax(-1)  # most mass on a few hundred ids
    wide[0, wide[0].argmax()] = 0.0  # the likeliest id made impossible
    for probs, n in ((small, 5_000), (wide, 5_000)):
        ids = torch.cat([draw(probs, g) for _ in range(n)])
        counts = torch.bincount(ids, minlength=probs.size(-1)).double()
        assert chi_square_p_value(counts, (probs[0] / probs[0].sum()).double()) > ALPHA


def test_draw_gives_each_row_its_own_generator_and_reproduces_with_a_seed():
    """A row's draw depends only on its own generator (the server's sequences share no randomness), and
    a seed gives the same ids again."""
    from gpt2.sampling import draw
    probs = torch.rand(3, 1000, generator=torch.Generator().manual_seed(1))
    together = draw(probs, [torch.Generator().manual_seed(s) for s in (7, 8, 9)])
    alone = torch.cat([draw(probs[i:i + 1], torch.Generator().manual_seed(s)) for i, s in enumerate((7, 8, 9))])
    assert torch.equal(together, alone)
    assert torch.equal(draw(probs, torch.Generator().manual_seed(3)), draw(probs, torch.Generator().manual_seed(3)))


def test_greedy_is_argmax_first_on_ties_and_nan():
    """sampling.greedy is max().indices for speed; it must pick what argmax picks: the first of equal
    logits, and a NaN over any number (random small integers make ties in every row)."""
    logits = torch.randint(0, 4, (64, GPT2_VOCAB_SIZE)).float()
    logits[3, 500] = float("nan")
    logits[7] = 0.0  # every entry tied
    expected = logits.argmax(dim=-1)
    assert expected[3] == 500 and expected[7] == 0
    assert torch.equal(greedy(logits), expected)
    assert torch.equal(greedy(logits.view(8, 8, -1)), logits.view(8, 8, -1).argmax(dim=-1))  # (B, k + 1, V)
