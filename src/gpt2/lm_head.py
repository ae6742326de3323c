"""The training loss: GPT-2's lm_head fused with cross-entropy, its plans, and measuring them here.

    from gpt2.lm_head import lm_head_cross_entropy, choose_head_plan
    loss = lm_head_cross_entropy(x, weight, targets, plan)       # x (N, C) ln_f's output, weight (V, C)
    plan, why = choose_head_plan(rows=1024, n_embd=96, vocab_size=50257, dtype="bfloat16")
    model.lm_head_plan = plan                     # GPT.forward's training loss then runs this plan

The loss never holds all (N, V) logits: it computes them a chunk of rows at a time and computes both
gradients in the same pass (lm_head_cross_entropy's docstring). A HeadPlan says how its three GEMMs
run (library, rows per chunk, rows per weight-gradient GEMM); every plan computes the same loss and
gradients up to float rounding (tests/test_lm_head.py).

The plan is most of a small model's step, and the best one differs by CPU: on an AMD EPYC oneDNN's
float32 GEMMs run 2-3x MKL's at the head's shapes, on an Intel Xeon MKL is oneDNN's equal. So, like
the training dtype (train.choose_dtype), it is measured: each candidate (GEMM library x rows per
chunk x rows per weight-gradient GEMM) runs the head's forward + backward on random inputs of the
run's shape, alternating, fastest of 3 (one run for a plan whose first run was 1.5x the fastest). A
candidate that fails or disagrees with torch.mm's plan (a broken library) is skipped. The choice is
cached in lm_head.json beside the kernel cache (kernels.cached_measurement), keyed by machine and shape.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from gpt2.errors import ConfigError
from gpt2.quantize import onednn_runs


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadPlan:
    """How lm_head_cross_entropy runs its three GEMMs; every plan computes the same loss and gradients.

    Which plan is fastest depends on the CPU (on an AMD EPYC oneDNN's float32 GEMMs run 2-3x MKL's at
    these shapes), so training measures them once per machine and shape (below).
    """
    library: str = "aten"      # aten: torch.mm (MKL for float32, oneDNN for bf16); onednn: oneDNN's linear for all
    chunk_rows: int = 64       # rows of logits computed at a time (a chunk's (rows, V) logits should stay in cache)
    weight_grad_rows: int = 64  # rows per weight-gradient GEMM, a multiple of chunk_rows: (V, rows) @ (rows, C)
                                # has a short inner dimension, so fewer, longer GEMMs can win

    LIBRARIES = ("aten", "onednn")

    def __post_init__(self):
        if self.library not in self.LIBRARIES:
            raise ConfigError(f"lm_head plan: library {self.library!r} is not one of {', '.join(self.LIBRARIES)}")
        if self.chunk_rows < 1 or self.weight_grad_rows < self.chunk_rows or self.weight_grad_rows % self.chunk_rows:
            raise ConfigError(f"lm_head plan: weight_grad_rows {self.weight_grad_rows} must be a positive multiple "
                              f"of chunk_rows {self.chunk_rows}")

    def __str__(self) -> str:
        return f"{self.library}:{self.chunk_rows}:{self.weight_grad_rows}"

    @classmethod
    def parse(cls, spec: str) -> "HeadPlan":
        """'LIBRARY:CHUNK_ROWS:WEIGHT_GRAD_ROWS', as str() writes it (train_config.json, --lm-head)."""
        parts = spec.split(":")
        if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
            raise ConfigError(f"lm_head plan {spec!r}: expected LIBRARY:CHUNK_ROWS:WEIGHT_GRAD_ROWS, "
                              "e.g. onednn:64:256")
        return cls(parts[0], int(parts[1]), int(parts[2]))

    @classmethod
    def default(cls, n_embd: int) -> "HeadPlan":
        # Fastest with torch.mm on an Intel Xeon (V=50257, N=1024): 64 rows at C=128, 128 at C=256.
        rows = max(64, n_embd // 2)
        return cls("aten", rows, rows)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN's matmul (float32 stays float32: no reduced-precision mode)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def lm_head_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          plan: HeadPlan | int | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """mean cross_entropy(x @ weight.T, targets) (float32, targets == -100 ignored), chunk by chunk.

    x (N, C) is ln_f's output, weight (V, C) the lm_head. Materializing all (N, V) logits
    (N=1024, V=50257: 206 MB in float32, written and read several times by softmax and its
    backward) costs more than the small models' blocks; chunks of rows stay in cache. When a
    gradient is needed it is computed in the same pass (softmax - one_hot is the gradient of the
    logits), so backward only scales it: no recomputation and no more FLOPs than the plain head.
    Held from forward to backward: grad_x (N, C) and grad_weight (V, C), far less than the logits.
    plan: a HeadPlan (choose_head_plan measures one), an int (rows per chunk, torch.mm), or None
    (HeadPlan.default). vocab_size: score only the first vocab_size of weight's rows (a padded
    vocabulary); the padding columns' logits are -inf, so they add exactly 0 to the softmax and their
    rows' gradient is exactly 0. Slicing the weight instead would cost a zeroed (V_padded, C) copy
    of its gradient in backward (48 ms in GPT-2 124M's step).
    """
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if plan is None:
        plan = HeadPlan.default(x.size(1))
    elif isinstance(plan, int):
        plan = HeadPlan("aten", plan, plan)
    return _ChunkedLMHeadLoss.apply(x, weight, targets, plan, vocab_size or weight.size(0), needs_grad)


def softmax_and_target_log_probs(scores: torch.Tensor, picked: torch.Tensor,
                                 rescore: Callable[[torch.Tensor], torch.Tensor],
                                 sync_free: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(scores), written over scores; (n,) log_softmax(scores) at each row's picked column).

    scores (n, V), picked (n, 1). In place, a chunk occupies one (n, V) buffer instead of two, which
    keeps more of it in cache (the quickstart's head on an Ice Lake Xeon: 5-10% faster). On a CPU:
    softmax, then the log of each target's probability, a pass over the chunk fewer than log_softmax
    followed by exp (the gradient needs the probabilities): 15-30 ms of the quickstart's ~270 ms step
    there. log(p) is as exact as log_softmax while p is a normal float; a row whose target's
    probability is subnormal or 0 (its logit ~87 or more below the row's largest, in float32) takes
    log_softmax of its scores again, from rescore(rows) -> (k, V) (the softmax overwrote them).
    Finding those rows reads a value on the host, which would stall a GPU's queue once per chunk, so
    there (sync_free, the default off a CPU) it is log_softmax and exp, as one path for every row.
    """
    if sync_free is None:
        sync_free = scores.device.type != "cpu"
    if sync_free:
        log_probs = torch.ops.aten._log_softmax.out(scores, -1, False, out=scores)
        target_log_probs = log_probs.gather(1, picked).squeeze(1)
        return log_probs.exp_(), target_log_probs
    probs = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    target_probs = probs.gather(1, picked).squeeze(1)  # (n,)
    target_log_probs = target_probs.log()
    underflowed = (target_probs < torch.finfo(probs.dtype).tiny).nonzero().squeeze(1)  # (k,): rare
    if underflowed.numel():
        again = torch.log_softmax(rescore(underflowed), -1)  # (k, V)
        target_log_probs[underflowed] = again.gather(1, picked[underflowed]).squeeze(1)
    return probs, target_log_probs


class _ChunkedLMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, plan: HeadPlan, vocab_size: int, needs_grad: bool):
        # GEMMs run in the autocast dtype if autocast is on, else in the weight's; the weight is cast
        # once here, not once per chunk. Softmax, loss and the weight gradient accumulate in float32.
        device = x.device.type
        autocast = device in ("cpu", "cuda") and torch.is_autocast_enabled(device)
        gemm = torch.get_autocast_dtype(device) if autocast else weight.dtype
        accumulate = torch.promote_types(gemm, torch.float32)  # float32, or float64 for float64 inputs
        # oneDNN has no float64, and no bf16 on a CPU without AVX-512: the plan then falls back to torch.mm
        onednn = (plan.library == "onednn" and device == "cpu" and gemm in (torch.float32, torch.bfloat16)
                  and onednn_runs(gemm))
        w = weight.to(gemm)  # (V, C)
        # oneDNN computes a @ b.T: grad_x = dlogits @ w needs w transposed, copied once for all chunks
        w_t = w.t().contiguous() if onednn and needs_grad else None  # (C, V)
        n_scored = (targets != -100).sum().clamp(min=1)  # the mean is over the scored tokens
        loss = torch.zeros((), dtype=accumulate, device=x.device)
        grad_x = torch.empty_like(x) if needs_grad else None
        # Every chunk reuses the same (chunk_rows, V) buffers: a fresh tensor above glibc's 32 MB mmap
        # threshold is new pages each time, and their first-touch faults cost more than the softmax
        # (384 x 50257 float32: 28 ms fresh, 5 ms reused).
        chunk = min(plan.chunk_rows, x.size(0))
        logits_buf = torch.empty(chunk, w.size(0), dtype=gemm, device=x.device)  # logits, then bf16 dlogits
        # float32 scores, then softmax, then softmax - one_hot, in place
        scores_buf = torch.empty_like(logits_buf, dtype=accumulate) if gemm != accumulate else logits_buf
        grad_w = WeightGradient(plan, x.size(0), onednn, accumulate, logits_buf) if needs_grad else None
        # every dtype below is explicit: autocast would only add dispatch work
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            for start in range(0, x.size(0), plan.chunk_rows):
                rows = slice(start, start + plan.chunk_rows)
                xc, tc = x[rows].to(gemm), targets[rows]  # (n, C), (n,)
                n = xc.size(0)
                scored = tc != -100
                picked = tc.clamp(min=0).unsqueeze(1)  # (n, 1); ignored rows pick 0 and are masked out
                # softmax works row by row (a 50257-wide row fits in L2); every extra pass over the
                # (n, V) chunk costs memory traffic, so the 1/n_scored scaling goes on the small operands.
                if onednn:
                    logits = _onednn_linear(xc, w)  # (n, V); oneDNN has no out=
                else:
                    logits = torch.mm(xc, w.t(), out=logits_buf[:n])
                scores = scores_buf[:n].copy_(logits) if gemm != accumulate else logits  # to float32
                scores[:, vocab_size:] = -math.inf  # padding columns (none unless the vocabulary is padded)

                def rescore(rows: torch.Tensor) -> torch.Tensor:  # (k,) rows -> their (k, V) scores again
                    again = (xc[rows] @ w.t()).to(accumulate)
                    again[:, vocab_size:] = -math.inf
                    return again

                probs, target_log_probs = softmax_and_target_log_probs(scores, picked, rescore)
                loss -= torch.where(scored, target_log_probs, 0.0).sum()
                if not needs_grad:
                    continue
                dlogits = probs  # (n, V): minus one_hot, in place, next
                dlogits.scatter_add_(1, picked, -scored.to(accumulate).unsqueeze(1))  # minus one_hot(target)
                row_scale = (scored.to(accumulate) / n_scored).unsqueeze(1)  # (n, 1); 0 for ignored rows
                # The GEMM-dtype copy goes to the weight gradient's buffer when chunks are grouped, else
                # over the logits (no longer needed); in float32 ungrouped it is dlogits itself.
                held = grad_w.slot(n) if grad_w.grouped_rows else (logits if gemm != accumulate else None)
                dlogits = held.copy_(dlogits) if held is not None else dlogits
                grad_w.hold(dlogits, (xc * row_scale).to(gemm))
                grad_x[rows] = (_onednn_linear(dlogits, w_t) if onednn else dlogits @ w) * row_scale
                if grad_w.held_rows >= plan.weight_grad_rows or start + plan.chunk_rows >= x.size(0):
                    grad_w.flush()
        if needs_grad:
            ctx.save_for_backward(grad_x, grad_w.total().to(weight.dtype))
        return loss / n_scored

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight = ctx.saved_tensors  # already d loss / d input; the loss is linear in them
        return grad_x * grad_loss, grad_weight * grad_loss, None, None, None, None


class WeightGradient:
    """The lm_head's weight gradient, the sum over chunks of dlogits.T @ x_scaled, as one GEMM per
    plan.weight_grad_rows rows.

    hold() keeps a chunk's dlogits in the GEMM dtype (when chunks are grouped, the caller casts them
    straight into slot(n) of one (rows, V) buffer) and its scaled x; flush() runs (V, rows) @ (rows, C)
    over what is held. The first flush's product is the sum itself, so a single flush needs no zeroed
    (V, C) buffer and no add. oneDNN computes a @ b.T, so it sums the transpose, (C, V) = x_scaled.T @ dlogits.
    """

    def __init__(self, plan: HeadPlan, rows: int, onednn: bool, accumulate: torch.dtype,
                 like: torch.Tensor):
        self.grouped_rows = min(plan.weight_grad_rows, rows) if plan.weight_grad_rows > plan.chunk_rows else 0
        self.onednn, self.accumulate = onednn, accumulate
        self.sum: torch.Tensor | None = None  # (V, C), or (C, V) for oneDNN
        # (grouped_rows, V) in the GEMM dtype (like's dtype and device), for grouped chunks' dlogits
        self.buffer = like.new_empty(self.grouped_rows, like.size(1)) if self.grouped_rows else None
        self.dlogits: list[torch.Tensor] = []  # ungrouped: the one held chunk's dlogits
        self.xs: list[torch.Tensor] = []  # the held chunks' (n, C) x_scaled
        self.held_rows = 0

    def slot(self, n: int) -> torch.Tensor:
        """Where the next grouped chunk's (n, V) dlogits go, in the GEMM dtype."""
        return self.buffer[self.held_rows: self.held_rows + n]

    def hold(self, dlogits: torch.Tensor, xs: torch.Tensor) -> None:
        """Keep a chunk: (n, V) dlogits in the GEMM dtype (in slot(n) when grouped), (n, C) x_scaled."""
        if not self.grouped_rows:
            self.dlogits = [dlogits]
        self.held_rows += dlogits.size(0)
        self.xs.append(xs)

    def flush(self) -> None:
        dlogits = self.buffer[: self.held_rows] if self.grouped_rows else self.dlogits[0]  # (rows, V)
        xs = self.xs[0] if len(self.xs) == 1 else torch.cat(self.xs)  # (rows, C)
        self.held_rows, self.xs, self.dlogits = 0, [], []
        if self.onednn:
            product = _onednn_linear(xs.t().contiguous(), dlogits.t())  # (C, rows) @ (rows, V)
        elif self.sum is not None and self.sum.dtype == dlogits.dtype == self.accumulate:
            self.sum.addmm_(dlogits.t(), xs)  # float32: in place, no (V, C) temporary
            return
        else:
            product = dlogits.t() @ xs  # (V, rows) @ (rows, C); CPU PyTorch has no mixed-dtype addmm
        if self.sum is None:
            self.sum = product  # rounded to the GEMM dtype once per flush, like every later product
        else:
            self.sum = self.sum.to(self.accumulate)  # bf16 products are summed in float32
            self.sum += product

    def total(self) -> torch.Tensor:
        """(V, C) in the accumulation dtype."""
        total = self.sum.to(self.accumulate)
        return total.t().contiguous() if self.onednn else total


# ---------------------------------------------------------------------------------------------
# measuring the plans
# ---------------------------------------------------------------------------------------------

CHUNK_ROWS = (32, 64, 128, 256, 512)
WEIGHT_GRAD_GROUPS = (2, 4, 8)   # weight-gradient GEMM every 2, 4 or 8 chunks (tried for the best chunk size)
MAX_WEIGHT_GRAD_ROWS = 1024      # bounds the held dlogits: 1024 x 50257 in bf16 is 103 MB
ROUNDS = 3
PRUNE = 1.5                      # a plan whose first run is 1.5x the fastest first run is not timed again
VERSION = 6  # in the cache key: a change to the head's implementation makes old timings stale


def candidate_plans(rows: int, n_embd: int) -> list[HeadPlan]:
    """Plans worth timing for `rows` rows: HeadPlan.default, and each library x each chunk size up to
    the rows, with a weight-gradient GEMM per chunk (grouped_plans tries fewer, longer ones)."""
    libraries = ["aten"] + (["onednn"] if onednn_runs(torch.float32) else [])
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
