"""The engines' dynamic linears called through native_ops' op in C++ against through Python, eagerly, in one
process, alternating.

    flock -x /tmp/gpt2-bench.lock .venv/bin/python benchmarks/ab_native_ops.py --precisions bfloat16 int8
    ... --rounds 10 --steps 64 --rows 1 8 --model /tmp/benchwd/hf

One model per precision, loaded once (its fbgemm fp16 and u8s8 weights named for the op in C++, as
always where it builds). A decodes with native_ops as loaded: each such linear through
gpt2_native::linear_dynamic, by key; B with native_ops switched off for the round
(native_ops.loaded() None): the same linears through the engines' own ops from Python
(quantized::linear_dynamic_fp16, quantized::linear_dynamic), as before native_ops. Same weights,
same kernels, same numbers. Each round times A and B back to back, the order swapped every round
(greedy steps after a 16-token prompt, ms a step over the steps only); the report gives the medians
and the median of the round-by-round ratios B / A. A precision with no such linear in its plan (float32
here, or int4 but for its lm_head) shows what nothing changed looks like.

The compiled step bakes its op into the package, so it is compared across processes:
`ab_plans.py --compile --env-b GPT2_NATIVE_OPS=0`.
"""

from __future__ import annotations

from bench_cpu_inference import alternate, in_process_ab_main, time_decode


def compare(model_dir: str, precision: str, args) -> None:
    from gpt2 import native_ops
    from gpt2.quantize import linear_layers, load_for_inference

    model = load_for_inference(model_dir, precision, "cpu")
    library = native_ops.loaded()
    if library is None:
        raise SystemExit("native_ops is not available here (its warning says why): nothing to compare")
    engine_layers = sum("packed" in layer.tensors for _, _, layer, _ in linear_layers(model))
    print(f"\n{precision}: {engine_layers} linears hold an engine's packed weight", flush=True)

    def ms_per_step(native: bool, rows: int, steps: int) -> float:
        native_ops._loaded = library if native else None
        try:
            return 1e3 * time_decode(model, rows, steps, False) / steps
        finally:
            native_ops._loaded = library

    alternate(precision, lambda rows, steps: ms_per_step(True, rows, steps),
              lambda rows, steps: ms_per_step(False, rows, steps), args, ("C++", "Python"))


if __name__ == "__main__":
    in_process_ab_main(__doc__, compare, ["bfloat16", "int8"])
