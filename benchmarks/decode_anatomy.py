"""Where an eager decode step's time goes, at each precision: its linears, and the rest around them.

    flock -x /tmp/gpt2-bench.lock .venv/bin/python benchmarks/decode_anatomy.py
    ... --model /tmp/benchwd/hf --precisions bfloat16 int4 --steps 128   # an HF directory; default random 124M

One process, one model per precision (load_for_inference, plans from the kernel cache), batch 1, greedy
steps after a 16-token prompt (bench_cpu_inference.time_decode), best of --repeats runs each, in ms a step:
  step        the eager decode step as `generate` runs it;
  linears     inside that step, the time of each linear's kernel call (its decode path), summed;
  alone       the model's linears called back to back on random rows, nothing between them;
  no-op       the step with every decode path returning a precomputed output: the rest of the step when
              no weight is read, so its code and data stay in cache;
  stand-in    the step with every decode path replaced by a sum over as many bytes of a large buffer as
              the weight it stands for, less the time those sums take alone: the rest of the step when
              the calls between its ops stream as much memory as the real ones.
step - linears is what the rest costs in the real step; no-op against stand-in splits it into the ops'
own cost and what the weight streaming costs them (they find their code and data evicted).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

from gpt2.quantize import (OFFSET_COLUMNS, PRECISIONS, WEIGHT_BYTES,  # a weight's bytes as stored, as decode reads it
                           layer_precision, linear_layers, load_for_inference)

from bench_cpu_inference import export_model, machine_report, time_decode


def best_ms(model, steps: int, repeats: int) -> float:
    time_decode(model, 1, 8, False)  # warm-up after the paths changed
    return min(time_decode(model, 1, steps, False) for _ in range(repeats)) / steps * 1e3


def anatomy(model_dir: str, precision: str, steps: int, repeats: int) -> dict:
    model = load_for_inference(model_dir, precision, "cpu")
    layers = [(getattr(parent, attr), attr) for parent, attr, _, _ in linear_layers(model)]
    decode = [layer.paths["decode"] for layer, _ in layers]  # the plan's paths, restored between measurements
    result = {"step": best_ms(model, steps, repeats)}

    spent = [0.0]
    for layer, path in zip((layer for layer, _ in layers), decode):
        def timed(x, args, bias, activation, path=path):
            start = time.perf_counter()
            y = path(x, args, bias, activation)
            spent[0] += time.perf_counter() - start
            return y
        layer.paths["decode"] = timed
    time_decode(model, 1, 8, False)
    runs = []
    for _ in range(repeats):
        spent[0] = 0.0
        time_decode(model, 1, steps, False)
        runs.append(spent[0] / steps * 1e3)  # the prefill (16 rows) calls the batch paths, not these
    result["linears"] = min(runs)

    # a path reads K columns, and a centering lm_head's its extra ones (quantize.OFFSET_COLUMNS)
    widths = [layer.in_features + (OFFSET_COLUMNS if layer.centers_logits else 0) for layer, _ in layers]
    rows = [torch.randn(1, width) for width in widths]
    with torch.inference_mode():
        def all_alone():
            for (layer, _), path, x in zip(layers, decode, rows):
                path(x, layer.kernel_args, layer.bias, layer.activation)
        all_alone()
        result["alone"] = min(_timed(all_alone, steps) for _ in range(repeats))

        outputs = [path(torch.zeros(1, width), layer.kernel_args, layer.bias, layer.activation)
                   for (layer, _), path, width in zip(layers, decode, widths)]
        for (layer, _), y in zip(layers, outputs):
            layer.paths["decode"] = lambda x, args, bias, activation, y=y: y
        result["no-op"] = best_ms(model, steps, repeats)

        # float32 elements a stand-in sums: the weight's bytes at its layer's precision (int4's lm_head is int8)
        floats = [int(layer.in_features * layer.out_features * WEIGHT_BYTES[layer_precision(precision, attr)]) // 4
                  for layer, attr in layers]
        buffer = torch.ones(3 * sum(floats))  # read in rotation: a slice is read again after twice the model
        at = [0]

        def stream(n: int):
            start = at[0] if at[0] + n <= buffer.numel() else 0
            buffer[start:start + n].sum()
            at[0] = start + n
        for (layer, _), y, n in zip(layers, outputs, floats):
            layer.paths["decode"] = lambda x, args, bias, activation, y=y, n=n: (stream(n), y)[1]
        streamed = best_ms(model, steps, repeats)
        sums = min(_timed(lambda: [stream(n) for n in floats], steps) for _ in range(repeats))
        result["stand-in"] = streamed - sums
        result["sums"] = sums
    for (layer, _), path in zip(layers, decode):
        layer.paths["decode"] = path
    return result


def _timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", dest="model_dir", help="an HF directory (default: random GPT-2 124M weights)")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    machine_report()
    work = tempfile.TemporaryDirectory()
    model_dir = args.model_dir or str(export_model(None, "gpt2", Path(work.name) / "hf"))
    print(f"batch 1, {args.steps} steps, best of {args.repeats}, ms a step")
    print("| precision | step | linears in it | rest (step - linears) | linears alone | rest, no-op linears "
          "| rest, stand-in linears (their sums alone) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for precision in args.precisions:
        r = anatomy(model_dir, precision, args.steps, args.repeats)
        print(f"| {precision} | {r['step']:.2f} | {r['linears']:.2f} | {r['step'] - r['linears']:.2f} | "
              f"{r['alone']:.2f} | {r['no-op']:.2f} | {r['stand-in']:.2f} ({r['sums']:.2f}) |", flush=True)
        gc.collect()


if __name__ == "__main__":
    main()
