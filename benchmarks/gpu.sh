#!/usr/bin/env bash
# GPU-only: GPT-2 124M training throughput and MFU with bf16 autocast, torch.compile and flash attention
# (SDPA) at T=1024, then a short end-to-end `gpt2 train --preset gpt2-124M` run through the CLI.
#
#   bash benchmarks/gpu.sh                   # PYTHON=python3 by default; B=16 per step, 20 timed steps
#   PYTHON=.venv/bin/python B=32 STEPS=30 bash benchmarks/gpu.sh
#
# Needs a CUDA build of PyTorch; needs no network (the data are random tokens written as llm.c shards).
# MFU = (6N + 12 L C T) * tokens/s / peak, with the peak looked up by device name in gpt2.train
# (H100/H200: 989 TFLOP/s dense bf16) or given as PEAK_TFLOPS.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
B=${B:-16}
STEPS=${STEPS:-20}
OUT=${OUT:-/tmp/gpt2-gpu-bench}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -c "import torch, sys; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

# 1. the training step in isolation: compiled, bf16 autocast, fused AdamW, SDPA (flash) attention
B=$B STEPS=$STEPS PEAK_TFLOPS=${PEAK_TFLOPS:-} "$PY" - <<'EOF'
import os, time, torch
from gpt2 import GPT, GPTConfig
from gpt2.train import TrainConfig, flops_per_token, make_optimizer, peak_flops

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
B, T, steps = int(os.environ["B"]), 1024, int(os.environ["STEPS"])
cfg = TrainConfig(device="cuda", dtype="bfloat16", peak_tflops=float(os.environ["PEAK_TFLOPS"]) if os.environ["PEAK_TFLOPS"] else None)
torch.manual_seed(0)
model = GPT(GPTConfig.preset("gpt2", embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0), vocab_multiple=64).cuda().train()
opt = make_optimizer(cfg, model, sharded=False)
print("optimizer fused:", opt.defaults.get("fused"))
compiled = torch.compile(model)
x = torch.randint(0, 50257, (B, T), device="cuda")
y = torch.randint(0, 50257, (B, T), device="cuda")

def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = compiled(x, targets=y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # fail loudly if flash attention cannot run
    t = time.time()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"compile + warm-up: {time.time() - t:.1f}s")
    times = []
    for _ in range(steps):
        t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
        t0.record(); loss = step(); t1.record(); torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) / 1000)
times.sort()
med = times[len(times) // 2]
tok_s = B * T / med
mfu = flops_per_token(model, T) * tok_s / peak_flops(cfg, "cuda")
print(f"GPT-2 124M train step, B={B} T={T} bf16+compile+flash: median {med * 1000:.1f} ms, "
      f"{tok_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% (loss {loss.item():.3f}, "
      f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)")
EOF

# 2. end to end through the CLI: random-token shards, the gpt2-124M preset, 20 steps of 64K tokens
"$PY" - <<EOF
import numpy as np
from pathlib import Path
from gpt2.data import write_shard
out = Path("$OUT/data"); out.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)
write_shard(out / "rand_train_000000.bin", rng.integers(0, 50257, 20_000_000))
write_shard(out / "rand_val_000000.bin", rng.integers(0, 50257, 1_000_000))
EOF
rm -rf "$OUT/run"
"$PY" -m gpt2 train --preset gpt2-124M --data "$OUT/data" --out "$OUT/run" --batch-size "$B" \
    --total-batch-tokens $((B * 1024 * 4)) --max-steps 20 --warmup-steps 5 --eval-interval 10 --eval-batches 4 \
    --checkpoint-interval 20 --num-samples 0 --no-progress
tail -n 2 "$OUT/run/metrics.jsonl"
