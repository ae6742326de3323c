"""A compiled decode step over the KV cache kv_dtype="auto" takes for it against over a float32 cache, in one
process, alternating.

    flock -x /tmp/gpt2-bench.lock .venv/bin/python benchmarks/ab_kv_dtype.py --precisions bfloat16 int8 int4
    ... --rounds 6 --steps 32 --rows 1 8 --prompt-length 16 520 --model /tmp/benchwd/hf

Two models per precision, each loaded once: A with kv_dtype="auto", whose compiled steps read the cache
dtype timed for them (kernels.kv_cache_dtype(model, compiled=True), bf16 where the keys are bf16 numbers
and Inductor's attention over bf16 measures no slower); B with kv_dtype="float32". Each has its own
compiled step (a package per cache dtype and row count), built before the rounds. Each round times A and B
back to back at every row count and prompt length, the order swapped every round (greedy steps, ms a
step over the steps only); the report gives the medians and the median of the round-by-round ratios B / A.
The attention's share of a step grows with the prompt, so a long prompt shows the cache's effect best.
"""

from __future__ import annotations

from bench_cpu_inference import alternate, in_process_ab_main, time_decode


def compare(model_dir: str, precision: str, args) -> None:
    import torch

    from gpt2.kv_cache import cache_dtype
    from gpt2.quantize import load_for_inference

    auto = load_for_inference(model_dir, precision, "cpu")
    chosen = cache_dtype(auto, compiled=True)
    print(f"\n{precision}: a compiled step's cache as kv_dtype='auto' takes it: {chosen}; eager steps': "
          f"{auto.kv_dtype}", flush=True)
    if chosen == torch.float32:
        print(f"{precision}: float32 either way here, nothing to compare", flush=True)
        return
    float32 = load_for_inference(model_dir, precision, "cpu", kv_dtype="float32")
    for prompt_length in args.prompt_length:
        alternate(f"{precision}, a {prompt_length}-token prompt",
                  lambda rows, steps: 1e3 * time_decode(auto, rows, steps, True, prompt_length) / steps,
                  lambda rows, steps: 1e3 * time_decode(float32, rows, steps, True, prompt_length) / steps,
                  args, (f"{str(chosen).removeprefix('torch.')} cache", "float32 cache"))


if __name__ == "__main__":
    in_process_ab_main(__doc__, compare, ["bfloat16", "int8", "int4"],
                       lambda ap: ap.add_argument("--prompt-length", nargs="+", type=int, default=[16, 520]))
