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

import argparse
import statistics
import tempfile
from pathlib import Path

from bench_cpu_inference import export_model, machine_report, time_decode


def compare(model_dir: str, precision: str, args) -> None:
    from gpt2 import native_ops
    from gpt2.quantize import load_for_inference, linear_layers

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

    for rows in args.rows:
        ms_per_step(True, rows, 8), ms_per_step(False, rows, 8)  # warm-up: oneDNN's primitives, first touches
    times = {rows: {"A": [], "B": []} for rows in args.rows}
    for r in range(args.rounds):
        order = [("A", True), ("B", False)][:: 1 if r % 2 == 0 else -1]
        for rows in args.rows:
            for name, native in order:
                times[rows][name].append(ms_per_step(native, rows, args.steps))
        print(f"  round {r + 1}: " + "   ".join(
            f"{rows} rows A {t['A'][-1]:.2f} B {t['B'][-1]:.2f} ms" for rows, t in times.items()), flush=True)
    for rows, t in times.items():
        ratios = [y / x for x, y in zip(t["A"], t["B"])]
        print(f"{precision}, {rows} rows: A (C++) {statistics.median(t['A']):.2f} ms a step, B (Python) "
              f"{statistics.median(t['B']):.2f}; B / A by round: median {statistics.median(ratios):.3f}, "
              f"B slower in {sum(ratio > 1 for ratio in ratios)} of {len(ratios)} rounds", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=["bfloat16", "int8"],
                    choices=["float32", "bfloat16", "int8", "int4"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", dest="model_dir", help="an HF directory (default: random GPT-2 124M weights)")
    args = ap.parse_args()
    machine_report()
    with tempfile.TemporaryDirectory() as work:
        model_dir = args.model_dir or str(export_model(None, "gpt2", Path(work) / "hf"))
        for precision in args.precisions:
            compare(model_dir, precision, args)


if __name__ == "__main__":
    main()
