"""Measure exactness and loading memory: max |logit difference| against transformers, and peak RSS.

    .venv/bin/python benchmarks/measure_parity.py              # tiny configs + the 124M preset
    .venv/bin/python benchmarks/measure_parity.py --rss-774m   # also: peak RSS loading a random 774M directory

Every model is a transformers.GPT2LMHeadModel at random init (eager attention), written with
save_pretrained and read back through our production loader, GPT.from_pretrained.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from gpt2 import GPT, GPTConfig

TINY = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=97, n_positions=64)
CONFIGS = {
    "tiny": TINY,
    "tiny, 3 heads": {**TINY, "n_head": 3, "n_embd": 24},
    "tiny, 5 heads, 3 layers": {**TINY, "n_layer": 3, "n_head": 5, "n_embd": 40},
    "tiny, n_inner=40": {**TINY, "n_inner": 40},
    "tiny, scale_attn_by_inverse_layer_idx": {**TINY, "scale_attn_by_inverse_layer_idx": True},
    "tiny, reorder_and_upcast_attn": {**TINY, "reorder_and_upcast_attn": True},
    "gpt2 (124M)": {},
}


def max_logit_diff(config: dict, seq_len: int) -> tuple[float, float]:
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config, attn_implementation="eager")).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = GPT.from_pretrained(d)
    vocab = hf.config.vocab_size
    idx = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], dim=1)
    with torch.no_grad():
        theirs = hf(idx, labels=idx)
        logit_diff = (ours(idx) - theirs.logits).abs().max().item()
        loss_diff = abs(ours(idx, targets=targets).item() - theirs.loss.item())
    return logit_diff, loss_diff


def peak_rss_774m() -> tuple[int, int]:
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2-large"))
    from safetensors.torch import save_file
    with tempfile.TemporaryDirectory() as d:
        tensors = {}
        for name, param in model.named_parameters():
            shape = list(param.shape)
            if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
                shape = shape[::-1]
            tensors[name] = torch.randn(shape) * 0.02
        weight_bytes = sum(t.numel() * 4 for t in tensors.values())
        save_file(tensors, Path(d) / "model.safetensors", metadata={"format": "pt"})
        del tensors
        (Path(d) / "config.json").write_text(json.dumps(GPTConfig.preset("gpt2-large").to_hf_dict()))
        script = ("import re, sys; from gpt2 import GPT; GPT.from_pretrained(sys.argv[1]); "
                  "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))")
        out = subprocess.run([sys.executable, "-c", script, d], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1]) * 1024, weight_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rss-774m", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    print(f"{'config':40s} {'max |dlogit|':>14s} {'|dloss|':>10s}")
    for name, config in CONFIGS.items():
        logit_diff, loss_diff = max_logit_diff(config, seq_len=64 if config else 128)
        print(f"{name:40s} {logit_diff:14.3e} {loss_diff:10.3e}")
    if args.rss_774m:
        peak, weights = peak_rss_774m()
        print(f"peak RSS loading random gpt2-large: {peak / 2**30:.2f} GiB for {weights / 2**30:.2f} GiB "
              f"of float32 weights = {peak / weights:.3f}x (includes the interpreter and torch)")


if __name__ == "__main__":
    main()
