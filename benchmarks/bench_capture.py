"""What activation capture's hook points cost when no capture runs: GPT-2 124M forwards, side by side.

    .venv/bin/python benchmarks/bench_capture.py --rounds 7

Three variants of the same random-init model, alternating within every round (medians over rounds):
  now           GPT as it is: Block.resid_mid is an nn.Identity on the hot path (the attention hook
                points sit on the explicit path only, which SDPA skips); no hooks registered
  before        the same weights with Block.forward as it was before the hook points (no resid_mid call)
  capturing     inspect.capture of every point (hooks registered, explicit attention): the price of looking
Each round times a prefill-sized forward (B=1, T=128) and a decode step (T=1 after 127 cached tokens).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import types

import torch

from gpt2 import GPT, GPTConfig
from gpt2.inspect import capture
from gpt2.kernels import cpu_model
from gpt2.kv_cache import KVCache


def block_forward_before(self, x, cache=None, mask=None):
    x = x + self.attn(self.ln_1(x), cache, mask)
    x = x + self.mlp(self.ln_2(x))
    return x


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5, help="forwards per timing")
    args = ap.parse_args()
    torch.manual_seed(0)
    now = GPT(GPTConfig.preset("gpt2")).eval()
    before = copy.deepcopy(now)
    for block in before.transformer.h:
        block.forward = types.MethodType(block_forward_before, block)
    idx = torch.randint(0, 50257, (1, 128))
    step = idx[:, -1:]

    def prefill(model):
        return lambda: model(idx)

    def decode(model):
        cache = KVCache.for_model(model, 1, 128)
        model(idx[:, :-1], cache=cache)

        def run():
            cache.pos = 127  # rewrite the same slot every time
            model(step, cache=cache)
        return run

    variants = {"now": now, "before": before}
    cases = {f"{kind} {name}": make(model) for kind, make in (("prefill T=128", prefill), ("decode T=1", decode))
             for name, model in variants.items()}
    cases["prefill T=128 capturing"] = lambda: capture(now, idx)
    results = {name: [] for name in cases}
    print(f"cpu: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, fn in cases.items():
                results[name].append(timed(fn, args.repeats))
    print(f"\n{'case':32s} {'ms (median)':>12s}  vs before")
    for name, times in results.items():
        base = statistics.median(results[name.replace(" now", " before").replace(" capturing", " before")])
        med = statistics.median(times)
        print(f"{name:32s} {med * 1e3:12.2f}  {med / base:8.3f}x")


if __name__ == "__main__":
    main()
