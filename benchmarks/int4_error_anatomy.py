"""Why two int4 quantizers of about the same KL divergence raise perplexity by different amounts.

    .venv/bin/python benchmarks/int4_error_anatomy.py runs/quickstart --data data/shakespeare
    ... --windows 256 --splits val train

Each transformer block's linear weights are replaced by their dequantized int4 values, one quantizer at a
time (the embedding, lm_head and every activation stay float64, so only the block weights' rounding is
seen); the model runs in float64 over each split's first windows of 128 tokens (for val, the windows
`bench_cpu_inference.py --quality` scores). Quantizers:
  ours        quantize.quantize_int4_groups (groups of 32, 16 levels, span and offset searched);
  [min, max]  the same groups, 16 levels laid over exactly each group's range (ours before the search);
  Q4_0        llama.cpp's Q4_0, through gguf-py (groups of 32, symmetric: scale = the group's
              largest-magnitude weight / -8, kept in fp16; q = min(15, trunc(w / scale + 8.5))).
For each: the perplexity increase over float64 (± its standard error over the windows, paired), the mean
KL divergence from float64, and the increase's first-order part: the gradient of the split's mean loss
with respect to the block weights, dotted with what the quantizer changed (g . δ, in perplexity). A
perturbation δ changes the loss by g . δ + ½ δᵀ H δ + ...: the second-order part is what the KL
divergence measures and is positive; the first-order part is a random sign, set by how a quantizer's
roundings happen to line up with this split's gradient. Where it differs between quantizers, one split
can rank them one way and another split the other way.
"""

from __future__ import annotations

import argparse
import copy

import gguf
import numpy as np
import torch

from gpt2.quantize import INT4_GROUP, int4_values, quantize_int4_groups
from gpt2.shards import load_split
from gpt2.weights import load_model


def ours(w: torch.Tensor) -> torch.Tensor:
    return int4_values(*quantize_int4_groups(w.float())).to(w.dtype)


def min_max(w: torch.Tensor) -> torch.Tensor:
    g = w.view(w.size(0), -1, INT4_GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp(min=1e-12)
    return (((g - lo) / step).round().clamp(0, 15) * step + lo).view_as(w)


def q4_0(w: torch.Tensor) -> torch.Tensor:
    """Through gguf-py's Q4_0, which rounds as llama.cpp's reference quantizer (llama_model_quantize's)."""
    qtype = gguf.GGMLQuantizationType.Q4_0
    blocks = gguf.quants.quantize(w.float().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).to(w.dtype)


QUANTIZERS = {"ours": ours, "[min, max]": min_max, "Q4_0": q4_0}


def windows_of(data: str, split: str, count: int, length: int) -> np.ndarray:
    """The split's first count windows (count, length + 1), end to end: for val, the windows
    `bench_cpu_inference.py --quality` scores."""
    tokens = load_split(data, split)
    count = min(count, len(tokens) // (length + 1))
    return np.stack([tokens[i * (length + 1): (i + 1) * (length + 1)] for i in range(count)]).astype(np.int64)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids.view(1, -1))
    return (out if isinstance(out, torch.Tensor) else out[0]).view(ids.numel(), -1)


def block_weights(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.dim() == 2 and ".h." in n}


def measure(reference, windows: np.ndarray) -> None:
    # The gradient of the split's mean loss at float64 (for the first-order part), and each window's loss.
    weights = block_weights(reference)
    reference.zero_grad()
    reference_nll = []
    for row in windows:
        ids = torch.from_numpy(row)
        loss = torch.nn.functional.cross_entropy(logits_of(reference, ids[:-1]), ids[1:])
        (loss / len(windows)).backward()
        reference_nll.append(loss.item())
    reference_nll = np.array(reference_nll)
    ppl = float(np.exp(reference_nll.mean()))
    quantized, first = {}, {}
    with torch.no_grad():
        for name, quantize in QUANTIZERS.items():
            quantized[name] = model = copy.deepcopy(reference)
            first[name] = 0.0
            for key, p in block_weights(model).items():
                p.copy_(quantize(weights[key].detach()))
                first[name] += float((weights[key].grad * (p - weights[key])).sum())
        nll, kl = {name: [] for name in quantized}, {name: [] for name in quantized}
        for row in windows:  # the reference's log-probabilities once a window, for every quantizer
            ids = torch.from_numpy(row)
            ref = torch.log_softmax(logits_of(reference, ids[:-1]), -1)
            for name, model in quantized.items():
                logp = torch.log_softmax(logits_of(model, ids[:-1]), -1)
                nll[name].append(-logp[torch.arange(len(ids) - 1), ids[1:]].mean().item())
                kl[name].append((ref.exp() * (ref - logp)).sum(-1).mean().item())
    print(f"float64 perplexity {ppl:.3f}\n")
    print("| quantizer | Δ ppl | first-order part (g . δ) | the rest | KL vs float64 |")
    print("| --- | --- | --- | --- | --- |")
    for name in quantized:
        diff = np.array(nll[name]) - reference_nll
        delta = float(np.exp(np.mean(nll[name]))) - ppl
        error = ppl * diff.std(ddof=1) / np.sqrt(len(diff))
        print(f"| {name} | {delta:+.3f} ± {error:.3f} | {ppl * first[name]:+.3f} | {delta - ppl * first[name]:+.3f} "
              f"| {np.mean(kl[name]):.6f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a trained model (a run directory or checkpoint)")
    ap.add_argument("--data", default="data/shakespeare", help="a `gpt2 prepare` output")
    ap.add_argument("--splits", nargs="+", default=["val", "train"])
    ap.add_argument("--windows", type=int, default=256)
    ap.add_argument("--length", type=int, default=128)
    args = ap.parse_args()
    reference = load_model(args.model, dtype=torch.float32).double().eval()
    for split in args.splits:
        print(f"\n{split}: {args.windows} windows x {args.length} tokens")
        measure(reference, windows_of(args.data, split, args.windows, args.length))


if __name__ == "__main__":
    main()
