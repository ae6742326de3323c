"""GPU generation figures: decode and prefill in bfloat16 for GPT-2 124M and 1558M (random weights).

    .venv/bin/python benchmarks/gpu_generate.py                  # needs CUDA; prints a table
    .venv/bin/python benchmarks/gpu_generate.py --presets gpt2 --rounds 3

The generation part of benchmarks/gpu.sh. On a machine without CUDA it prints one line and exits 0,
so it is safe to import or run anywhere. Models are built at random init directly in bf16 on the GPU
(no files). Every round runs every case once, in turn; the table shows medians.

  decode  batch B, N new tokens after a 16-token prompt, EOS ignored: tok/s = B * N / wall time
  prefill a P-token prompt and 1 new token: tok/s = P / wall time
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def cuda_timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_preset(preset: str, rounds: int, new_tokens: int, prefill: int, batches: list[int]) -> list[tuple]:
    from gpt2 import GPT, GPTConfig
    from gpt2.engine import generate

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTConfig.preset(preset)).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    cases = {}
    for B in batches:
        prompts = torch.randint(0, 50000, (B, 16), generator=g).tolist()
        cases[f"decode b{B}"] = (lambda p=prompts: generate(model, p, max_new_tokens=new_tokens, ignore_eos=True),
                                 B * new_tokens)
    long = torch.randint(0, 50000, (1, prefill), generator=g).tolist()
    cases[f"prefill {prefill}"] = (lambda: generate(model, long, max_new_tokens=1), prefill)
    for fn, _ in cases.values():
        fn()  # warm-up: cuBLAS handles, allocator
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, _) in cases.items():
            times[name].append(cuda_timed(fn))
    rows = [(preset, name, n / statistics.median(times[name])) for name, (_, n) in cases.items()]
    del model
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["gpt2", "gpt2-xl"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=1000)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_generate: no CUDA device; skipped")
        return 0
    rows = []
    for preset in args.presets:
        rows += bench_preset(preset, args.rounds, args.new_tokens, args.prefill, args.batches)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, random weights, "
          f"{args.rounds} rounds, medians")
    print(f"{'model':10s} {'case':14s} {'tok/s':>10s}")
    for preset, name, rate in rows:
        print(f"{preset:10s} {name:14s} {rate:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
