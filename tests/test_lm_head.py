"""The fused lm_head's plans (lm_head.HeadPlan) and their measurement (lm_head.py).

    pytest tests/test_lm_head.py -q

Every plan the tuner can choose is checked against the plain head (logits -> F.cross_entropy): in
float64 to 1e-12 (oneDNN has no float64, so there the plans differ in chunking only), in float32
against the float64 reference, and under bf16 autocast against the plain autocast head, with the
tolerances of tests/test_model.py. Then: the choice is measured once, cached, reused, and a corrupt
cache is measured again after one warning.
"""

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from gpt2.errors import ConfigError
from gpt2.lm_head import candidate_plans, choose_head_plan, grouped_plans
from gpt2.kernels import MEASUREMENT_CACHE_VERSION
from gpt2.lm_head import HeadPlan, lm_head_cross_entropy, softmax_and_target_log_probs

ROWS, WIDTH, VOCAB = 70, 16, 37  # 70 rows: every chunk size leaves a ragged last chunk


def every_plan() -> list[HeadPlan]:
    plans = candidate_plans(ROWS, WIDTH)
    return list(dict.fromkeys(plans + [g for p in plans for g in grouped_plans(p, ROWS)]))


PLANS = every_plan()


def head_inputs(dtype, padding: int = 0):
    torch.manual_seed(0)
    x = torch.randn(ROWS, WIDTH, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB + padding, WIDTH, dtype=dtype, requires_grad=True)  # padded rows are never scored
    targets = torch.randint(0, VOCAB, (ROWS,))
    targets[[0, 5, 6, 33, 69]] = -100  # ignored rows, in the first and the ragged last chunk
    return x, weight, targets


def test_the_tuner_tries_both_libraries_and_grouped_weight_gradients():
    libraries = {p.library for p in PLANS}
    assert "aten" in libraries and ("onednn" in libraries) == torch.backends.mkldnn.is_available()
    assert any(p.weight_grad_rows > p.chunk_rows for p in PLANS)


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("padding", [0, 11], ids=["vocab", "padded vocab"])
def test_every_plan_equals_plain_cross_entropy_in_float64_and_float32(plan, padding):
    for dtype, loss_tol, atol, rtol in ((torch.float64, 1e-12, 1e-12, 1e-10), (torch.float32, 1e-6, 1e-6, 1e-4)):
        x, weight, targets = head_inputs(dtype, padding)
        x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        reference = F.cross_entropy(x64 @ w64[:VOCAB].t(), targets, ignore_index=-100)
        grads = torch.autograd.grad(2.5 * reference, (x64, w64))  # padded rows: exactly 0
        loss = lm_head_cross_entropy(x, weight, targets, plan, vocab_size=VOCAB)
        ours = torch.autograd.grad(2.5 * loss, (x, weight))
        assert loss.dtype == dtype and abs(loss.item() - reference.item()) < loss_tol * max(1.0, reference.item())
        for a, b in zip(ours, grads):
            assert a.dtype == dtype and torch.allclose(a.double(), b, atol=atol, rtol=rtol)
        assert (ours[1][VOCAB:] == 0).all()


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_every_plan_under_bf16_autocast_matches_the_plain_autocast_head(plan):
    x, weight, targets = head_inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_head_cross_entropy(x, weight, targets, plan)
        reference = F.cross_entropy((x @ weight.t()).float(), targets, ignore_index=-100)
    assert abs(loss.item() - reference.item()) < 1e-5
    for a, b in zip(torch.autograd.grad(loss, (x, weight)), torch.autograd.grad(reference, (x, weight))):
        assert (a - b).abs().max().item() < 2e-2 * b.abs().max().item()  # bf16 GEMMs both ways


@pytest.mark.parametrize("sync_free", [False, True], ids=["cpu: softmax, log of the target", "gpu: log_softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_target_log_probabilities_stay_exact_where_the_target_probability_underflows(sync_free, dtype):
    # Rows whose target sits 0, 20, 95 (subnormal in float32) and 900 (0 even in float64) nats below the
    # row's largest logit, in a row of 1,000 near-equal logits; the softmax path scores those rows again.
    torch.manual_seed(0)
    gaps = torch.tensor([0.0, 20.0, 95.0, 900.0])
    scores = torch.randn(4, 1000, dtype=torch.float64)
    picked = torch.tensor([[3], [10], [500], [999]])
    scores[torch.arange(4), picked.squeeze(1)] = scores.max(1).values - gaps
    reference = torch.log_softmax(scores, -1)  # float64
    chunk = scores.to(dtype, copy=True)  # overwritten by the softmax
    rescored = []

    def rescore(rows):
        rescored.append(rows.tolist())
        return scores[rows].to(dtype)

    probs, target_log_probs = softmax_and_target_log_probs(chunk, picked, rescore, sync_free=sync_free)
    assert probs.data_ptr() == chunk.data_ptr()  # in place: one (n, V) buffer a chunk
    underflowing = [2, 3] if dtype == torch.float32 else [3]
    assert rescored == ([] if sync_free else [underflowing])  # only those rows are scored again
    expected = reference.gather(1, picked).squeeze(1)
    assert torch.isfinite(target_log_probs).all()
    assert torch.allclose(target_log_probs.double(), expected, rtol=1e-6 if dtype == torch.float32 else 1e-13, atol=0)
    assert torch.allclose(probs.double(), reference.exp(), rtol=1e-5, atol=1e-12)


def test_a_loss_whose_targets_underflow_equals_plain_cross_entropy():
    # Logits spread over hundreds of nats: some targets' float32 probabilities are 0 or subnormal.
    x, weight, targets = head_inputs(torch.float32)
    with torch.no_grad():
        x.mul_(40.0)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits64 = x64 @ w64.t()
    picked = logits64.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    gaps = (logits64.max(1).values - picked)[targets != -100]
    assert (gaps > 104).any() and gaps.max() < 1e4  # exp(-gap) is 0 in float32 for some rows
    reference = F.cross_entropy(logits64, targets, ignore_index=-100)
    grads = torch.autograd.grad(reference, (x64, w64))
    loss = lm_head_cross_entropy(x, weight, targets, HeadPlan("aten", 16, 16))
    ours = torch.autograd.grad(loss, (x, weight))
    assert abs(loss.item() - reference.item()) < 1e-6 * reference.item()
    for a, b in zip(ours, grads):
        assert torch.allclose(a.double(), b, atol=1e-6, rtol=1e-4)


def test_plan_strings_round_trip_and_bad_plans_are_clear_errors():
    plan = HeadPlan("onednn", 64, 256)
    assert HeadPlan.parse(str(plan)) == plan
    for bad in ("onednn:64", "mkl:64:64", "aten:64:96", "aten:0:0", "aten:x:64"):
        with pytest.raises(ConfigError, match="lm_head plan"):
            HeadPlan.parse(bad)


@pytest.fixture
def head_cache(tmp_path, monkeypatch):
    """The measured plan goes to a private cache, never the user's."""
    from gpt2 import kernels
    monkeypatch.setattr(kernels, "default_cache_path", lambda: tmp_path / "cache" / "kernels.json")
    return tmp_path / "cache" / "lm_head.json"


def test_the_plan_is_measured_once_cached_reused_and_a_corrupt_cache_is_measured_again(head_cache, caplog):
    shape = dict(rows=ROWS, n_embd=WIDTH, vocab_size=VOCAB, dtype="float32")
    plan, why = choose_head_plan(**shape)
    assert why.startswith("measured")
    (entry,) = json.loads(head_cache.read_text())["entries"].values()
    assert HeadPlan.parse(entry["plan"]) == plan
    assert entry["plan"] == min(entry["step_ms"], key=entry["step_ms"].get)  # the fastest timed plan
    assert set(entry["step_ms"]) >= {str(p) for p in candidate_plans(ROWS, WIDTH)}
    # Read back, not measured again: an edited entry is what the next run gets.
    other = HeadPlan("aten", 7, 14)
    entries = {k: {**v, "plan": str(other)} for k, v in json.loads(head_cache.read_text())["entries"].items()}
    head_cache.write_text(json.dumps({"version": MEASUREMENT_CACHE_VERSION, "entries": entries}))
    assert choose_head_plan(**shape)[0] == other and choose_head_plan(**shape)[1].startswith("cache")
    # Another shape or dtype is another entry.
    assert choose_head_plan(**{**shape, "dtype": "bfloat16"})[1].startswith("measured")
    # A corrupt cache: one warning, measured again, rewritten.
    head_cache.write_text('{"version": %d, "entries": {"x": {"plan": "mkl:1"}}}' % MEASUREMENT_CACHE_VERSION)
    with caplog.at_level(logging.WARNING, logger="gpt2.kernels"):
        plan, why = choose_head_plan(**shape)
    assert why.startswith("measured") and len([r for r in caplog.records if "ignoring" in r.message]) == 1
    assert choose_head_plan(**shape)[1].startswith("cache")
