"""Which fused lm_head plan training uses on this machine: measured once per shape, cached, shown in the log.

    from gpt2.head_tuning import choose_head_plan
    plan, why = choose_head_plan(rows=1024, n_embd=96, vocab_size=50257, dtype="bfloat16")
    model.lm_head_plan = plan                     # GPT.forward's training loss then runs this plan

The training loss (model.lm_head_cross_entropy) is most of a small model's step, and its best kernels
differ by CPU: on an AMD EPYC oneDNN's float32 GEMMs run 2-3x MKL's at the head's shapes, on an Intel
Xeon MKL is oneDNN's equal. So, like the training dtype (train.choose_dtype), the plan is measured:
each candidate (GEMM library x rows per chunk x rows per weight-gradient GEMM) runs the head's
forward + backward on random inputs of the run's shape, alternating, fastest of 3 (one run for a plan
whose first run was 1.5x the fastest). A candidate
that fails or disagrees with torch.mm's plan (a broken library) is skipped. The choice is cached in
lm_head.json beside the kernel cache (kernels.cached_measurement), keyed by machine and shape.
Every plan computes the same loss and gradients up to float rounding (tests/test_head_tuning.py).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from gpt2.model import HeadPlan, lm_head_cross_entropy, onednn_available

CHUNK_ROWS = (32, 64, 128, 256, 512)
WEIGHT_GRAD_GROUPS = (2, 4, 8)   # weight-gradient GEMM every 2, 4 or 8 chunks (tried for the best chunk size)
MAX_WEIGHT_GRAD_ROWS = 1024      # bounds the held dlogits: 1024 x 50257 in bf16 is 103 MB
ROUNDS = 3
PRUNE = 1.5                      # a plan whose first run is 1.5x the fastest first run is not timed again
VERSION = 4  # in the cache key: a change to the head's implementation makes old timings stale


def candidate_plans(rows: int, n_embd: int) -> list[HeadPlan]:
    """Plans worth timing for `rows` rows: HeadPlan.default, and each library x each chunk size up to
    the rows, with a weight-gradient GEMM per chunk (grouped_plans tries fewer, longer ones)."""
    libraries = ["aten"] + (["onednn"] if onednn_available() else [])
    chunks = [c for c in CHUNK_ROWS if c < rows] + [min(rows, CHUNK_ROWS[-1])]
    default = HeadPlan.default(n_embd)
    plans = [HeadPlan(lib, c, c) for lib in libraries for c in chunks]
    return list(dict.fromkeys(plans + ([default] if default.chunk_rows <= rows else [])))


def grouped_plans(best: HeadPlan, rows: int) -> list[HeadPlan]:
    """The best single-chunk plan with its weight-gradient GEMM run every few chunks instead."""
    groups = [best.chunk_rows * g for g in WEIGHT_GRAD_GROUPS]
    return [HeadPlan(best.library, best.chunk_rows, r) for r in groups if r <= min(rows, MAX_WEIGHT_GRAD_ROWS)]


def choose_head_plan(rows: int, n_embd: int, vocab_size: int, dtype: str, device: str = "cpu",
                     padded_vocab_size: int | None = None) -> tuple[HeadPlan, str]:
    """(the fastest plan for this shape and training dtype, why); CUDA keeps HeadPlan.default.
    padded_vocab_size: the lm_head's rows (GPT.padded_vocab_size), of which vocab_size are scored."""
    if not device.startswith("cpu"):
        return HeadPlan.default(n_embd), "the default (measured on CPUs only)"
    from gpt2.kernels import cached_measurement
    padded = padded_vocab_size or vocab_size
    key = {"kind": "lm_head", "version": VERSION, "rows": rows, "n_embd": n_embd, "vocab_size": vocab_size,
           "padded_vocab_size": padded, "dtype": dtype}
    result, source = cached_measurement(
        "lm_head", key, lambda: measure_head_plans(rows, n_embd, vocab_size, padded, dtype),
        validate=lambda entry: HeadPlan.parse(entry["plan"]))
    plan = HeadPlan.parse(result["plan"])
    times = {p: f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms" for p, ms in result["step_ms"].items()}
    default = str(HeadPlan.default(n_embd))
    shown = [f"{p} {times[p]}" for p in dict.fromkeys([str(plan), default]) if p in times]
    return plan, f"{source}: forward + backward {', '.join(shown) or '?'} ({len(times)} plans timed)"


def measure_head_plans(rows: int, n_embd: int, vocab_size: int, padded_vocab_size: int, dtype: str) -> dict:
    """Time the candidates, then the best one's grouped variants: {"plan": str, "step_ms": {plan: ms}}.
    A plan whose first run takes over PRUNE x the fastest first run of its round is not run again."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_embd, generator=g).requires_grad_()
    weight = (torch.randn(padded_vocab_size, n_embd, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab_size, (rows,), generator=g)

    def run(plan: HeadPlan) -> tuple[float, list[torch.Tensor]]:
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext())
        start = time.perf_counter()
        with autocast:
            loss = lm_head_cross_entropy(x, weight, targets, plan, vocab_size)
        grads = torch.autograd.grad(loss, (x, weight))
        return time.perf_counter() - start, [loss.detach(), *grads]

    reference = run(HeadPlan("aten", min(64, rows), min(64, rows)))[1]
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-4  # relative to each output's largest entry

    def agrees(outputs) -> bool:
        return all((a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max().clamp(min=1e-30)
                   for a, b in zip(outputs, reference))

    best_s: dict[HeadPlan, float] = {}

    def time_plans(plans: list[HeadPlan]) -> None:
        usable, first_s = [], {}
        for plan in plans:  # warm-up, and the check against torch.mm's plan
            try:
                seconds, outputs = run(plan)
            except RuntimeError:  # e.g. a oneDNN build without this dtype: not a candidate here
                continue
            if agrees(outputs):
                first_s[plan] = seconds
        fastest = min(first_s.values(), default=math.inf)
        for plan, seconds in first_s.items():
            if seconds > PRUNE * fastest:
                best_s[plan] = seconds  # clearly slower: its one run is its time
            else:
                usable.append(plan)
                best_s[plan] = math.inf
        for _ in range(ROUNDS):  # alternating, so a burst of other work on the machine hits all alike
            for plan in usable:
                best_s[plan] = min(best_s[plan], run(plan)[0])

    time_plans(candidate_plans(rows, n_embd))
    time_plans(grouped_plans(min(best_s, key=best_s.get), rows))
    best = min(best_s, key=best_s.get)
    return {"plan": str(best), "step_ms": {str(p): s * 1e3 for p, s in best_s.items()}}
