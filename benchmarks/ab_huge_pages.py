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

import os

from bench_cpu_inference import alternate, in_process_ab_main, time_decode


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
    label = f"{precision}{' compiled' * args.compile}"
    print(f"\n{label}: B's {len(new) * HUGE_PAGE >> 20} MiB of new resident memory, {collapsed >> 20} MiB of it "
          "collapsed into 2 MiB pages", flush=True)
    alternate(label, lambda rows, steps: ms_per_step(a, rows, steps, args.compile),
              lambda rows, steps: ms_per_step(b, rows, steps, args.compile), args, ("4 KB", "2 MiB"))


if __name__ == "__main__":
    in_process_ab_main(__doc__, compare, ["float32", "bfloat16", "int8", "int4"], lambda ap: ap.add_argument(
        "--compile", action="store_true", help="decode through the compiled step"))
