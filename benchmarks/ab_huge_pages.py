"""Weights in 4 KB pages against the same weights in 2 MiB pages, in one process, alternating.

    flock -x /tmp/gpt2-bench.lock .venv/bin/python benchmarks/ab_huge_pages.py --precisions bfloat16 int8 --compile
    ... --rounds 10 --steps 64 --rows 1 8 --model /tmp/benchwd/hf

This VM's memory bandwidth drifts 2x from minute to minute, more than huge pages change a step, so
processes run one after another (ab_plans.py --env-b GPT2_HUGE_PAGES=0) compare two states of the
machine as much as two page sizes. Here one process holds two copies of the model, loaded with
GPT2_HUGE_PAGES=0: A's memory stays in 4 KB pages, and B's (the chunks that became resident while B
loaded and ran its first steps, its compiled step's package among them) is then collapsed into 2 MiB
pages (huge_pages.py). Each round times A and B back to back, the order swapped every round (greedy
steps after a 16-token prompt, ms a step over the steps only); the report gives each round's times,
the medians of the round-by-round ratios B / A, and in how many rounds B was faster. Random GPT-2
weights unless --model names a directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench_cpu_inference import export_model, machine_report, time_decode


def ms_per_step(model, rows: int, steps: int, compile: bool) -> float:
    return 1e3 * time_decode(model, rows, steps, compile) / steps


def compare(model_dir: str, precision: str, args) -> None:
    from gpt2.huge_pages import HUGE_PAGE, collapse_into_huge_pages, resident_chunks
    from gpt2.quantize import load_for_inference

    os.environ["GPT2_HUGE_PAGES"] = "0"  # nothing collapses on its own
    a = load_for_inference(model_dir, precision, "cpu")
    for rows in args.rows:
        ms_per_step(a, rows, 8, args.compile)  # its package loaded, its first-touch pages in
    before = set(resident_chunks())
    b = load_for_inference(model_dir, precision, "cpu")
    for rows in args.rows:
        ms_per_step(b, rows, 8, args.compile)
    os.environ["GPT2_HUGE_PAGES"] = "1"
    new = [chunk for chunk in resident_chunks() if chunk not in before]
    collapsed = collapse_into_huge_pages(new)
    print(f"\n{precision}{' compiled' * args.compile}: B's {len(new) * HUGE_PAGE >> 20} MiB of new resident "
          f"memory, {collapsed >> 20} MiB of it collapsed into 2 MiB pages", flush=True)
    times = {rows: {"A": [], "B": []} for rows in args.rows}
    for r in range(args.rounds):
        order = [("A", a), ("B", b)][:: 1 if r % 2 == 0 else -1]
        for rows in args.rows:
            for name, model in order:
                times[rows][name].append(ms_per_step(model, rows, args.steps, args.compile))
        print(f"  round {r + 1}: " + "   ".join(
            f"{rows} rows A {t['A'][-1]:.2f} B {t['B'][-1]:.2f} ms" for rows, t in times.items()), flush=True)
    for rows, t in times.items():
        ratios = [y / x for x, y in zip(t["A"], t["B"])]
        faster = sum(ratio < 1 for ratio in ratios)
        print(f"{precision}{' compiled' * args.compile}, {rows} rows: A (4 KB) {statistics.median(t['A']):.2f} ms "
              f"a step, B (2 MiB) {statistics.median(t['B']):.2f}; B / A by round: median "
              f"{statistics.median(ratios):.3f}, B faster in {faster} of {len(ratios)} rounds", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=["float32", "bfloat16", "int8", "int4"],
                    choices=["float32", "bfloat16", "int8", "int4"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help="decode through the compiled step")
    ap.add_argument("--model", dest="model_dir", help="an HF directory (default: random GPT-2 124M weights)")
    args = ap.parse_args()
    machine_report()
    with tempfile.TemporaryDirectory() as work:
        model_dir = args.model_dir or str(export_model(None, "gpt2", Path(work) / "hf"))
        for precision in args.precisions:
            compare(model_dir, precision, args)


if __name__ == "__main__":
    main()
