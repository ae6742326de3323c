"""Tests for speculative decoding (engine.py's Speculation, sampling.accept_drafts, KVCache.rewind).

    .venv/bin/pytest tests/test_speculative.py -q

References: greedy output of the target alone (generate_naive: no cache, no draft) token for token; the
target's exact next-token probabilities, computed by enumeration, for a chi-square test of sampled
tokens; a fresh forward over the shorter sequence for a rewound cache; the CLI's own text path without
a draft for stop strings; apply_plan on a deep copy for the quantized self-draft.
"""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch

from gpt2 import GPT, GPTConfig, KVCache
from gpt2 import kernels
from gpt2.config import GPT2_VOCAB_SIZE
from gpt2 import engine
from gpt2.engine import DraftCosts, DraftLength, Stream, generate, generate_naive, make_config, quantized_copy
from gpt2.errors import ConfigError
from gpt2.quantize import apply_plan
from gpt2.sampling import SamplingConfig, process_logits


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path, monkeypatch):
    """Self-drafts measure kernels into their own cache file, never the user's."""
    monkeypatch.setattr(kernels, "default_cache_path", lambda: tmp_path / "kernels.json")


# initializer_range 0.2 spreads the logits, so greedy argmax has no near-ties at float32 noise level.
CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=400, n_positions=160, initializer_range=0.2)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [12, 13], [301, 2, 2, 40]]  # different lengths: left padding


def random_model(config=CONFIG, seed=0):
    torch.manual_seed(seed)
    return GPT(config).eval()


def perturbed(model, scale, seed=1):
    """The model with noise on every weight: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    return draft


@pytest.fixture(scope="module")
def target():
    return random_model()


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, 0.3)


def speculate(target, prompts, **options):
    """generate's output with a draft, and the Stream's statistics."""
    steps = Stream(target, prompts, make_config(**options))
    out = [[] for _ in prompts]
    for step in steps:
        for row, t in zip(out, step):
            if t is not None:
                row.append(t)
    return out, steps.speculation


# --- greedy: the target's own output, token for token ----------------------------------------------

@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_equals_the_target_alone(target, draft, k):
    for prompts in ([PROMPTS[0]], PROMPTS):
        reference = generate_naive(target, prompts, max_new_tokens=40)
        out, stats = speculate(target, prompts, max_new_tokens=40, draft=draft, draft_tokens=k,
                               adaptive_draft=False)
        assert out == reference
        if len(prompts) == 1:  # some rounds keep drafts and some reject: both paths ran
            assert 0 < stats.accepted < stats.proposed


def test_greedy_with_adaptive_k_and_penalties_equals_the_target_alone(target, draft):
    options = dict(max_new_tokens=60, repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={7: 2.0})
    reference = generate_naive(target, PROMPTS, **options)
    assert speculate(target, PROMPTS, draft=draft, draft_tokens=3, **options)[0] == reference


def test_a_perfect_draft_keeps_every_token_and_k_grows(target, monkeypatch):
    # The target as its own draft costs a whole step per draft; priced as a cheap draft, k must grow.
    monkeypatch.setattr(engine, "draft_costs",
                        lambda t, d, compiled=False: DraftCosts(draft_step=0.05, verify_position=0.01))
    out, stats = speculate(target, [PROMPTS[0]], max_new_tokens=50, draft=target, draft_tokens=2)
    assert out == generate_naive(target, [PROMPTS[0]], max_new_tokens=50)
    assert stats.accepted == stats.proposed
    # k: 2, 4, 6, ... (capped by what is left): far fewer rounds than tokens
    assert stats.rounds <= 7 and stats.tokens_per_round > 7


def optimal_k(alpha: float, costs) -> int:
    """The k with the most expected tokens per cost when every draft is accepted with probability alpha."""
    return max(range(1, engine.MAX_DRAFT_TOKENS + 1),
               key=lambda k: (1 - alpha ** (k + 1)) / (1 - alpha) / costs.round(k))


@pytest.mark.parametrize("alpha, draft_step", [(0.9, 0.05), (0.8, 0.15), (0.7, 0.42), (0.3, 0.1), (0.97, 0.02)])
def test_adaptive_k_settles_where_tokens_per_cost_peak(alpha, draft_step):
    """Rounds whose drafts are each accepted with probability alpha: the k the schedule settles on is the
    analytic optimum's, or one whose expected tokens per cost are within 3% of it."""
    costs = DraftCosts(draft_step=draft_step, verify_position=0.02)
    schedule = DraftLength(4, True, costs)
    gen = torch.Generator().manual_seed(0)
    chosen = []
    for _ in range(400):
        k = schedule.k
        accepted = 0
        while accepted < k and torch.rand((), generator=gen).item() < alpha:
            accepted += 1
        schedule.update(k, accepted)
        chosen.append(schedule.k)
    settled = max(set(chosen[100:]), key=chosen[100:].count)  # the k it chose most after 100 rounds
    best = optimal_k(alpha, costs)

    def value(k):
        return (1 - alpha ** (k + 1)) / (1 - alpha) / costs.round(k)
    assert value(settled) >= 0.97 * value(best), (settled, best)


def tokens_per_cost(schedule, costs, accept_after_accept: float, accept_after_reject: float, tokens: int,
                    seed: int) -> float:
    """Tokens per target step of a generation whose drafts are accepted in runs (a two-state chain)."""
    rng = random.Random(seed)
    state, made, cost = True, 0, 0.0
    while made < tokens:
        k = min(schedule.k, tokens - made - 1)
        n = 0
        while n < k:
            state = rng.random() < (accept_after_accept if state else accept_after_reject)
            if not state:
                break
            n += 1
        cost += costs.round(k)
        made += n + 1
        schedule.update(k, n)
    return tokens / cost


@pytest.mark.parametrize("draft_step", [0.13, 0.25, 0.44])
@pytest.mark.parametrize("after_accept, after_reject", [(0.9, 0.5), (0.7, 0.7), (0.98, 0.1)])
def test_adaptive_k_does_about_as_well_as_the_best_fixed_k_in_hindsight(draft_step, after_accept, after_reject):
    """Over 100 simulated 128-token generations with acceptance in runs: adaptive k reaches >= 95% of
    the tokens per cost of the best fixed k chosen in hindsight (Hugging Face's +2 / -1 rule: 83-88% of it
    when drafting is dear)."""
    costs = DraftCosts(draft_step=draft_step, verify_position=0.02)

    def mean(make):
        return sum(tokens_per_cost(make(), costs, after_accept, after_reject, 128, s) for s in range(100)) / 100
    best_fixed = max(mean(lambda: DraftLength(k, False)) for k in range(1, 9))
    assert mean(lambda: DraftLength(4, True, costs)) >= 0.95 * best_fixed


def test_a_draft_as_dear_as_the_target_is_kept_at_one_token():
    schedule = DraftLength(4, True, DraftCosts(draft_step=1.0, verify_position=0.05))
    for _ in range(20):
        schedule.update(schedule.k, schedule.k)  # every draft accepted, yet each costs a target step
    assert schedule.k == 1


def test_draft_costs_are_measured_once_then_read_from_the_cache(target, draft, monkeypatch):
    calls = []
    real = engine._round_seconds
    monkeypatch.setattr(engine, "_round_seconds", lambda spec, k: calls.append(k) or real(spec, k))
    first = engine.draft_costs(target, draft)
    assert calls == [0, engine.PROBE_DRAFTS] and first.draft_step > 0 and first.verify_position >= 0
    assert engine.draft_costs(target, draft) == first and len(calls) == 2  # the cache
    other = perturbed(target, 0.3, seed=2)  # the same shapes and formats: the same costs
    assert engine.draft_costs(target, other) == first and len(calls) == 2


def test_measuring_a_round_leaves_both_caches_where_they_were(target, draft):
    spec = engine.Speculation.for_prompts(target, draft, [PROMPTS[0]], make_config(
        max_new_tokens=10, draft=draft, draft_tokens=4, adaptive_draft=False))
    before = spec.target_cache.pos, spec.draft_cache.pos, spec.length
    propose, verify = engine._round_seconds(spec, 4, repeats=2)
    assert propose > 0 and verify > 0 and (spec.target_cache.pos, spec.draft_cache.pos, spec.length) == before


def test_adaptive_k_shrinks_when_drafts_are_rejected(target):
    bad = random_model(seed=5)  # unrelated weights: almost nothing is accepted
    _, fixed = speculate(target, [PROMPTS[0]], max_new_tokens=30, draft=bad, draft_tokens=8, adaptive_draft=False)
    _, adaptive = speculate(target, [PROMPTS[0]], max_new_tokens=30, draft=bad, draft_tokens=8)
    assert adaptive.proposed < fixed.proposed / 3  # k fell to 1 instead of drafting 8 a round


def stop_inside_accepted_run(target, prompt, n=40):
    """A token of the target's greedy output that first appears mid-way, and where."""
    out = generate_naive(target, [prompt], max_new_tokens=n, ignore_eos=True)[0]
    i = next(i for i in range(5, n) if out[i] not in out[:i])
    return out, i


def test_stop_tokens_inside_the_accepted_run(target):
    for prompts in ([PROMPTS[0]], PROMPTS):
        out, i = stop_inside_accepted_run(target, prompts[0])
        options = dict(max_new_tokens=40, stop_token_ids=[out[i]])
        reference = generate_naive(target, prompts, **options)
        assert reference[0] == out[:i]
        # a perfect draft with k = 8 accepts long runs, so the stop token falls inside one
        got, stats = speculate(target, prompts, draft=target, draft_tokens=8, adaptive_draft=False, **options)
        assert got == reference and stats.tokens_per_round > 3


def test_stop_strings_inside_the_accepted_run():
    from gpt2.cli import _generate_text
    from gpt2.tokenizer import Tokenizer
    tok = Tokenizer.gpt2()
    model = random_model(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=GPT2_VOCAB_SIZE, n_positions=64,
                                   initializer_range=0.2))
    prompt = "Hello"
    ids = tok.encode(prompt)
    out = generate_naive(model, [ids], max_new_tokens=30, ignore_eos=True)[0]
    stop = tok.decode(out[12:14])  # text from the middle of the output
    plain = make_config(max_new_tokens=30, ignore_eos=True)
    spec = make_config(max_new_tokens=30, ignore_eos=True, draft=model, draft_tokens=8, adaptive_draft=False)
    for stream in (False, True):
        reference = list(_generate_text(model, tok, prompt, plain, 2, None, [stop], stream))
        assert list(_generate_text(model, tok, prompt, spec, 2, None, [stop], stream)) == reference
    text = "".join(c for c in reference if c is not None)
    assert stop not in text and text.startswith(prompt + tok.decode(out[:10]))


def test_stream_finish_inside_a_round(target):
    steps = Stream(target, PROMPTS, make_config(max_new_tokens=20, draft=target, draft_tokens=8))
    first = next(steps)
    steps.finish(1)  # mid-round: the rest of row 1's accepted run is dropped
    rest = list(steps)
    assert first[1] is not None and all(step[1] is None for step in rest)
    reference = generate_naive(target, PROMPTS, max_new_tokens=20)
    assert [first[0]] + [s[0] for s in rest] == reference[0]
    assert steps.finish_reasons == ["length", "stop", "length"]


# --- sampling: the target's distribution ------------------------------------------------------------

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=12, n_positions=16, initializer_range=0.5)
SAMPLING = dict(temperature=0.8, top_k=9, top_p=0.95)
PROMPT = [3, 5]
SAMPLES = 3000
ALPHA = 1e-3


def target_probabilities(model, sampling: SamplingConfig):
    """Exact P(first token) (V,) and P(second token) (V,), by enumerating the first (float64)."""
    def next_probs(seq):
        with torch.inference_mode():
            logits = model(torch.tensor([seq]))[:, -1]
        return process_logits(logits, sampling).double().softmax(-1)[0]
    first = next_probs(PROMPT)
    second = sum(first[x] * next_probs(PROMPT + [x]) for x in range(len(first)))
    return first, second


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts (V,) against probs (V,); cells expected below 5 are pooled. Impossible
    tokens (probability 0) must never appear."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "sampled a token the target cannot produce"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))  # the chi-square survival function


def counts_of(samples, position, V):
    return torch.bincount(torch.tensor([s[position] for s in samples]), minlength=V).double()


@pytest.fixture(scope="module")
def sampled_pair():
    target, draft = random_model(TINY, seed=0), random_model(TINY, seed=1)
    # Each run alone (batch 1), a seed each: the first round drafts one token; when it is kept the second
    # is the target's bonus token of the same round, when rejected the next round's.
    samples = [speculate(target, [PROMPT], max_new_tokens=2, ignore_eos=True, seed=s, draft=draft,
                         draft_tokens=4, **SAMPLING)[0][0] for s in range(SAMPLES)]
    return target, draft, samples


def test_sampled_tokens_follow_the_target_distribution(sampled_pair):
    target, draft, samples = sampled_pair
    first, second = target_probabilities(target, SamplingConfig(**SAMPLING))
    for position, probs in ((0, first), (1, second)):
        assert chi_square_p_value(counts_of(samples, position, TINY.vocab_size), probs) > ALPHA
    # the draft often disagrees, so the rejection path (the residual) produced many of these tokens
    draft_first, _ = target_probabilities(draft, SamplingConfig(**SAMPLING))
    assert 0.5 * (first - draft_first).abs().sum() > 0.2


def test_the_chi_square_test_detects_a_five_percent_error(sampled_pair):
    target, _, samples = sampled_pair
    first, second = target_probabilities(target, SamplingConfig(**SAMPLING))
    for position, probs in ((0, first), (1, second)):
        # move 5% of the mass from the likeliest token to the second likeliest
        wrong = probs.clone()
        top = probs.argsort(descending=True)
        wrong[top[0]] -= 0.05
        wrong[top[1]] += 0.05
        assert chi_square_p_value(counts_of(samples, position, TINY.vocab_size), wrong) < ALPHA


def test_seeds_reproduce(target, draft):
    options = dict(max_new_tokens=30, temperature=1.0, top_k=40, draft=draft, draft_tokens=3)
    for seed in (7, [7, 8, 9]):
        a, b = (speculate(target, PROMPTS, seed=seed, **options)[0] for _ in range(2))
        assert a == b
    assert speculate(target, PROMPTS, seed=8, **options)[0] != speculate(target, PROMPTS, seed=7, **options)[0]


# --- drafts: self-drafts, errors -----------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_self_draft_greedy_equals_the_target(target, precision):
    out, stats = speculate(target, PROMPTS, max_new_tokens=30, draft=f"self:{precision}", draft_tokens=4)
    assert out == generate_naive(target, PROMPTS, max_new_tokens=30)
    assert stats.proposed > 0


def test_quantized_copy_equals_apply_plan_and_leaves_the_model_alone(target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    quantized = quantized_copy(target, "int8")
    reference = apply_plan(copy.deepcopy(target), kernels.plan_for(target, "int8"))
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        assert torch.equal(quantized(ids), reference(ids))
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    # a packed int8 model copies too (read back through its format's reference weights)
    with torch.inference_mode():
        assert torch.equal(quantized_copy(reference, "int8")(ids), reference(ids))
    bf16_cache = copy.deepcopy(target)
    bf16_cache.kv_dtype = torch.bfloat16
    assert quantized_copy(bf16_cache, "int8").kv_dtype == torch.bfloat16 and quantized.kv_dtype is None


@pytest.mark.parametrize("precision,fmt", [("float32", "onednn"), ("float32", "onednn b8"), ("bfloat16", "onednn")])
def test_a_model_packed_for_onednn_can_be_self_drafted(target, precision, fmt):
    """oneDNN keeps only its packed layout; quantized_copy reads it back exactly (to_dense), so the int8
    copy of a packed model equals the int8 copy of the plain one. An int4 model cannot be read back."""
    from gpt2.quantize import CPU_FORMATS
    if not next(f for f in CPU_FORMATS if (f.precision, f.name) == (precision, fmt)).available():
        pytest.skip(f"oneDNN has no {precision} linear on this CPU (quantize.onednn_runs)")
    plan = kernels.plan_for(target, precision)
    plan.choices = {k: kernels.Choice(fmt, {r: "onednn" for r in kernels.REGIMES}, {}) for k in plan.choices}
    packed = apply_plan(copy.deepcopy(target), plan)
    reference = target if precision == "float32" else quantized_copy(target, "bfloat16")
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        assert torch.equal(quantized_copy(packed, "int8")(ids), quantized_copy(reference, "int8")(ids))
    int4 = apply_plan(copy.deepcopy(target), kernels.plan_for(target, "int4"))
    with pytest.raises(ConfigError, match="cannot be read back"):
        quantized_copy(int4, "int8")


def test_a_self_draft_is_built_once_and_again_when_the_weights_change(target, monkeypatch):
    import gpt2.engine as engine
    built = []
    real = engine.quantized_copy
    monkeypatch.setattr(engine, "quantized_copy", lambda model, p: built.append(p) or real(model, p))
    model = copy.deepcopy(target)
    first = generate(model, PROMPTS, max_new_tokens=6, draft="self:int8")
    assert generate(model, PROMPTS, max_new_tokens=6, draft="self:int8") == first and built == ["int8"]
    generate(model, PROMPTS, max_new_tokens=6, draft="self:int4")
    generate(model, PROMPTS, max_new_tokens=6, draft="self:int8")  # both kept
    assert built == ["int8", "int4"]
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(-1)  # in place: the cached int4 copy is stale
    changed = generate(model, PROMPTS, max_new_tokens=6, draft="self:int4")
    assert built == ["int8", "int4", "int4"]
    assert changed == generate_naive(model, PROMPTS, max_new_tokens=6)  # greedy: exact with the new weights


@pytest.mark.slow
def test_a_compiled_draft_proposes_what_the_eager_one_does(target, draft):
    """compile=True with a draft: the draft decodes through its compiled step, one graph across rounds
    and rewinds (a 1-token prompt's first step eager). Greedy output is the target's own, and each
    round proposes and keeps what the eager draft does (the same statistics), fixed and adaptive k."""
    from torch._dynamo.utils import counters
    compiled_draft = copy.deepcopy(draft)  # its own compiled step
    graphs, accepted = {}, 0
    for prompts in (PROMPTS, [PROMPTS[0]], [[77]]):  # a left-padded batch, one row, a 1-token prompt
        reference = generate_naive(target, prompts, max_new_tokens=20)
        for adaptive in (False, True):
            options = dict(max_new_tokens=20, draft_tokens=3, adaptive_draft=adaptive)
            eager, eager_stats = speculate(target, prompts, draft=compiled_draft, **options)
            out, stats = speculate(target, prompts, draft=compiled_draft, compile=True, **options)
            assert out == eager == reference
            assert (stats.rounds, stats.proposed, stats.accepted) == (eager_stats.rounds, eager_stats.proposed,
                                                                      eager_stats.accepted)
            accepted += stats.accepted
            graphs.setdefault(len(prompts), counters["stats"]["unique_graphs"])
    assert accepted > 0  # rounds that kept drafts and rewound the draft's cache past rejected ones
    assert counters["stats"]["unique_graphs"] == graphs[1]  # one graph per batch size, reused after
    assert compiled_draft in engine._compiled_decode_steps and target not in engine._compiled_decode_steps


def test_draft_errors(target):
    other_vocab = random_model(GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=401, n_positions=160))
    with pytest.raises(ConfigError, match="vocabulary"):
        generate(target, PROMPTS, max_new_tokens=4, draft=other_vocab)
    with pytest.raises(ConfigError, match="self:int8"):
        generate(target, PROMPTS, max_new_tokens=4, draft="gpt2")
    with pytest.raises(ConfigError, match="draft_tokens"):
        generate(target, PROMPTS, max_new_tokens=4, draft=target, draft_tokens=0)


# --- the cache rolls back exactly ---------------------------------------------------------------------

def test_rewound_cache_equals_a_fresh_one(target):
    ids = torch.tensor([PROMPTS[0] + [1, 2, 3]])
    with torch.inference_mode():
        cache = KVCache.for_model(target, 1, 16)
        target(ids, cache=cache)           # 10 positions
        cache.rewind(4)                    # back to 6
        rolled = target(torch.tensor([[9, 8]]), cache=cache)
        fresh_cache = KVCache.for_model(target, 1, 16)
        fresh = target(torch.tensor([PROMPTS[0][:6] + [9, 8]]), cache=fresh_cache)[:, -2:]
    assert cache.pos == fresh_cache.pos == 8
    torch.testing.assert_close(rolled, fresh)
    for k, fresh_k in zip(cache.k, fresh_cache.k):
        torch.testing.assert_close(k[:, :, :8], fresh_k[:, :, :8])
    with pytest.raises(ValueError, match="rewind"):
        cache.rewind(9)


# --- the CLI ----------------------------------------------------------------------------------------------

@pytest.mark.slow  # ~25 s: measures the kernels of a 50,257-token lm_head at two precisions
def test_cli_generate_with_a_draft_prints_the_plain_greedy_text(tmp_path, capsys):
    from gpt2.cli import main
    model = random_model(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=GPT2_VOCAB_SIZE, n_positions=64,
                                   initializer_range=0.2))
    small = random_model(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=GPT2_VOCAB_SIZE, n_positions=64))
    model.save_pretrained(tmp_path / "target")
    small.save_pretrained(tmp_path / "draft")
    base = ["generate", "--model", str(tmp_path / "target"), "Once upon a time", "--max-new-tokens", "20",
            "--ignore-eos", "--device", "cpu"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    for draft in (["--draft", "self:int8"], ["--draft", str(tmp_path / "draft"), "--draft-tokens", "3", "--stream"],
                  ["--draft", str(tmp_path / "draft"), "--compile"]):  # the draft's steps compiled
        assert main(base + draft) == 0
        assert capsys.readouterr().out == plain
    # --verbose also reports the rounds: 20 tokens = the kept drafts + one target token a round
    assert main(base + ["--draft", str(tmp_path / "draft"), "--verbose"]) == 0
    captured = capsys.readouterr()
    report = re.search(r"speculation: (\d+) rounds, (\d+) of (\d+) drafts kept", captured.err)
    assert report and int(report[1]) + int(report[2]) == 20 and int(report[2]) <= int(report[3])
    assert plain in captured.out
