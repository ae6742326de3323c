"""Two kernel plans side by side in the whole model: which one decodes faster on this machine.

    flock -x /tmp/gpt2-bench.lock .venv/bin/python benchmarks/ab_plans.py --dtype int8 \\
        --edit "50257x768@int8=dynamic onednn" --rows 1 8 --pairs 5
    ... --plans A/kernels.json B/kernels.json     # two kernel caches (kernels.json files) instead
    ... --dtype bfloat16 --compile --env-b GPT2_HUGE_PAGES=0   # one plan; B's processes in this environment

kernels.py ranks the paths of one block's layers, or of the lm_head, timed apart from the model; this
checks a choice where it counts, in a decode step. Plan A is the kernel cache as it is (measured first
if the model's shapes are missing: `gpt2 info --kernels` shows it); plan B is A with the layers named
by --edit ("SHAPE_KEY=FORMAT", the entry's key as `gpt2 info --kernels` prints it, with "@PRECISION"
for a layer kept at another precision than the model's) in another format, each regime taking that
format's fastest path in the entry's own timings. Or --plans gives both. --env-b sets variables in B's
processes only (alone, B's plan is A's): what a setting read from the environment gains.

Each plan runs in its own process (XDG_CACHE_HOME pointing at a directory holding only that plan, the
machine's cache size and attention timings copied beside it, so nothing is measured there), A and B
alternating and the order swapped every pair. A process loads the model with load_for_inference and,
for each --rows, decodes N greedy steps after a 16-token prompt three times and keeps the fastest (ms
a step over the steps only). The report: each pair's times, the medians, and in how many pairs B was
slower. Random GPT-2 weights unless --model names a directory (speed does not depend on them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_cpu_inference import ROOT, export_model, machine_report, time_decode

MEASUREMENTS = ("cpu_cache.json", "attention.json")  # cached_measurement files a plan's process reuses
# Cache parts named by what they hold (a hash of the weights, the plan and the code): both plans' processes
# share the user's, so that neither searches int4's weights or compiles a package another run already made
SHARED_PARTS = ("int4", "compiled", "native")


def _env(**extra) -> dict:
    """The environment of a subprocess: this checkout's package first, and `extra`."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra}


def worker(args) -> dict:
    """In a process whose XDG_CACHE_HOME holds one plan: ms a step at each row count (best of 3)."""
    from gpt2.kernels import default_cache_path
    from gpt2.quantize import load_for_inference
    plan = default_cache_path().read_bytes()
    model = load_for_inference(args.model_dir, args.dtype, "cpu")
    if default_cache_path().read_bytes() != plan:  # load_for_inference measured what the plan lacked
        raise SystemExit(f"the plan lacks some of the model's {args.dtype} layers: it is not the plan given")

    def ms_per_step(rows: int) -> float:
        return 1e3 * time_decode(model, rows, args.steps, args.compile) / args.steps

    times = {}
    for rows in args.rows:
        ms_per_step(rows)  # warm-up: oneDNN's primitive caches, first-touch pages, a compiled graph
        times[rows] = min(ms_per_step(rows) for _ in range(3))
    return times


def edited(entries: dict, edits: list[str], dtype: str) -> dict:
    """The cache entries with each edited layer ("SHAPE_KEY=FORMAT", this machine's entry for a layer of a
    `dtype` model) in that format, every regime on the format's fastest path in the entry's timings (a
    combined format's read off its parts'). ValueError for a layer the cache lacks, or a format without
    a timing at every regime."""
    from gpt2.kernels import REGIMES, _combined_paths, _entry_key, _fastest, machine_key, runs_at
    from gpt2.quantize import formats_for
    out = dict(entries)
    for edit in edits:
        key, _, fmt_name = edit.partition("=")
        shape, _, precision = key.partition("@")
        precision = precision or dtype
        prefix = _entry_key(machine_key(), precision, 1, 1, None).rsplit("|", 1)[0]  # this machine, these candidates
        entry = entries.get(f"{prefix}|{shape}@{precision}")
        if entry is None:
            raise ValueError(f"--edit {edit!r}: no entry for {shape} at {precision} on this machine")
        fmt = next((f for f in formats_for(precision, "cpu") if f.name == fmt_name), None)
        if fmt is None:
            raise ValueError(f"--edit {edit!r}: {precision} has no format {fmt_name!r} here")
        timings = entry["timings_us"]
        paths = _combined_paths(fmt, timings) if fmt.parts else timings.get(fmt_name, {})
        chosen = {}
        for r in REGIMES:
            if any(r in t for t in paths.values()):
                chosen[r] = _fastest(paths, r)
            else:  # a format that stopped after decode (kernels._choose): the entry's path there, if it has it
                runs_here = [p for p in [entry["paths"][r], *fmt.paths] if p in fmt.paths and runs_at(fmt, p, r)]
                if not runs_here:
                    raise ValueError(f"--edit {edit!r}: {fmt_name!r} has no path for {r}")
                chosen[r] = runs_here[0]
        out[f"{prefix}|{shape}@{precision}"] = {**entry, "format": fmt_name, "paths": chosen}
    return out


def plan_dirs(args, work: Path) -> list[Path]:
    """Two XDG_CACHE_HOME directories, plan A's and plan B's, each with the machine's measurements."""
    from gpt2.kernels import default_cache_path
    cache = default_cache_path()
    if args.plans:
        sources = [json.loads(Path(p).read_text()) for p in args.plans]
    else:
        measure = [sys.executable, "-m", "gpt2", "info", "--kernels", str(args.model_dir),
                   "--kernels-dtype", args.dtype]
        subprocess.run(measure, check=True, capture_output=True, env=_env())
        a = json.loads(cache.read_text())
        sources = [a, {**a, "entries": edited(a["entries"], args.edit, args.dtype)}]
    dirs = []
    for name, plan in zip("AB", sources):
        d = work / name / "gpt2"
        d.mkdir(parents=True, exist_ok=True)
        (d / "kernels.json").write_text(json.dumps(plan))
        for measured in MEASUREMENTS:
            if (cache.parent / measured).exists():
                shutil.copy(cache.parent / measured, d / measured)
        for part in SHARED_PARTS:
            (cache.parent / part).mkdir(parents=True, exist_ok=True)
            (d / part).symlink_to(cache.parent / part, target_is_directory=True)
        dirs.append(d.parent)
    return dirs


def run(args, xdg: Path, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", str(args.model_dir), "--dtype", args.dtype,
           "--steps", str(args.steps), "--rows", *map(str, args.rows)] + ["--compile"] * args.compile
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(XDG_CACHE_HOME=str(xdg), **env))
    if done.returncode != 0:
        raise SystemExit(f"a plan's process failed:\n{done.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="int8", choices=["float32", "bfloat16", "int8", "int4"])
    ap.add_argument("--edit", nargs="+", default=[], metavar="SHAPE_KEY=FORMAT", help="plan B: plan A with these")
    ap.add_argument("--plans", nargs=2, metavar=("A", "B"), help="two kernel caches (kernels.json) instead")
    ap.add_argument("--env-b", nargs="+", default=[], metavar="NAME=VALUE", help="B's processes in this environment")
    ap.add_argument("--rows", nargs="+", type=int, default=[1], help="batch sizes decoded (default 1)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--compile", action="store_true", help="decode through the compiled step (compiles first)")
    ap.add_argument("--model", dest="model_dir", help="an HF directory (default: random GPT-2 124M weights)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if not args.plans and not args.edit and not args.env_b:
        ap.error("give --edit (plan B = the cache with those layers changed), --plans A B, or --env-b")
    env_b = dict(setting.partition("=")[::2] for setting in args.env_b)
    work = Path(tempfile.mkdtemp(prefix="ab_plans_"))
    try:
        machine_report()
        args.model_dir = args.model_dir or str(export_model(None, "gpt2", work / "hf"))
        try:
            a_dir, b_dir = plan_dirs(args, work)
        except ValueError as e:  # an --edit the cache cannot take
            raise SystemExit(f"ab_plans.py: {e}") from None
        print(f"{args.dtype}, rows {args.rows}, {args.steps} steps, best of 3 a process; B: "
              + " ".join([*args.edit, *(args.plans[1:] if args.plans else []), *args.env_b]))
        times = {"A": [], "B": []}
        for pair in range(args.pairs):
            order = [("A", a_dir, {}), ("B", b_dir, env_b)][:: 1 if pair % 2 == 0 else -1]
            for name, xdg, env in order:
                times[name].append(run(args, xdg, env))
            print(f"  pair {pair + 1}: " + "   ".join(
                f"{rows} rows A {times['A'][-1][rows]:.3f} B {times['B'][-1][rows]:.3f} ms" for rows in args.rows),
                flush=True)
        for rows in args.rows:
            a = [t[rows] for t in times["A"]]
            b = [t[rows] for t in times["B"]]
            slower = sum(y > x for x, y in zip(a, b))
            print(f"{rows} rows: A {statistics.median(a):.3f} ms a step, B {statistics.median(b):.3f} "
                  f"(B/A {statistics.median(b) / statistics.median(a):.3f}); B slower in {slower} of {len(a)} pairs")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
