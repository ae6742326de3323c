"""Training speed, ours vs Transformers' GPT2LMHeadModel: tokens/s of full optimizer steps, same batch.

    python benchmarks/bench_train.py                       # GPT-2 124M, B=4, T=256, CPU, fp32 and bf16 autocast
    python benchmarks/bench_train.py --rounds 5 --batch-size 4 --seq-len 256 --threads 2
    python benchmarks/bench_train.py --dtypes bfloat16 --rounds 1 --profile   # the top ops of one step

Each step: forward with targets, backward, gradient clipping to 1.0, AdamW (lr 6e-4, betas (0.9, 0.95),
weight decay 0.1, fused where available: the same optimizer for both), zero_grad. Both models start
from the same random weights (ours, converted with save_pretrained), run with dropout 0 (the 124M
recipe's) and train on the same random batch. The variants (ours with the measured lm_head plan,
ours with HeadPlan.default, HF; each in float32 and bf16 autocast) take turns within every round, so a
change in machine load hits them alike; the report is the median step time per variant over the
rounds (after one warm-up step each) and the ratios to HF float32. "ours" pads the vocabulary to
50,304 rows (the training default). Our loss is the fused, chunked lm_head + cross-entropy
(lm_head.lm_head_cross_entropy) with the plan `gpt2 train` would measure here (lm_head.py, cached);
Transformers materializes the B*T*V logits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from gpt2 import GPT, GPTConfig
from gpt2.lm_head import choose_head_plan
from gpt2.kernels import cpu_features, cpu_model, memory_bandwidth_gbs
from gpt2.lm_head import HeadPlan


def make_optimizer(model):
    params = list(model.parameters())
    kwargs = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, foreach=True, **kwargs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="GPTConfig preset")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--profile", action="store_true",
                    help="afterwards, torch.profiler's top ops (self CPU time) of one step of ours per dtype")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()

    config = GPTConfig.preset(args.model, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(0)
    ours = GPT(config, vocab_multiple=64).train()
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp)
        hf = transformers.GPT2LMHeadModel.from_pretrained(tmp, attn_implementation="sdpa").train()
    B, T = args.batch_size, args.seq_len
    x = torch.randint(0, config.vocab_size, (B, T))
    y = torch.randint(0, config.vocab_size, (B, T))

    def ours_loss(plan):
        def loss():
            ours.lm_head_plan = plan
            return ours(x, targets=y)
        return loss

    def hf_loss():
        # x, y are already shifted: compute the same mean cross-entropy from HF's logits
        logits = hf(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    print(f"CPU {cpu_model()} ({', '.join(cpu_features()) or 'no bf16/VNNI/AMX flags'}), "
          f"memory {memory_bandwidth_gbs():.1f} GB/s")
    variants = {}
    for dtype in args.dtypes.split(","):
        plan, why = choose_head_plan(B * T, config.n_embd, config.vocab_size, dtype,
                                     padded_vocab_size=ours.padded_vocab_size)
        print(f"lm_head {dtype}: {plan} ({why})")
        for name, model, loss_fn in ((f"ours {plan}", ours, ours_loss(plan)),
                                     ("ours default head", ours, ours_loss(HeadPlan.default(config.n_embd))),
                                     ("hf", hf, hf_loss)):
            variants[f"{name} {dtype}"] = (model, make_optimizer(model), loss_fn, getattr(torch, dtype))

    def step(model, opt, loss_fn, dtype):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    print(f"{args.model}: B={B} T={T}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    times = {k: [] for k in variants}
    for k, v in variants.items():
        step(*v)  # warm-up (allocator, oneDNN kernels)
    for r in range(args.rounds):
        for k, v in variants.items():
            times[k].append(step(*v))
        print(f"round {r + 1}: " + ", ".join(f"{k} {B * T / times[k][-1]:.0f}" for k in variants) + " tok/s")
    tok_s = {k: B * T / statistics.median(v) for k, v in times.items()}
    base = tok_s.get("hf float32")
    print(f"\n{'variant':32s} {'tokens/s':>9s} {'vs HF fp32':>11s}")
    for k, v in tok_s.items():
        print(f"{k:32s} {v:9.1f} {v / base if base else float('nan'):10.2f}x")
    print("load average at the end:", os.getloadavg())
    if args.profile:
        from torch.profiler import profile
        for name, variant in variants.items():
            if name.startswith("ours") and "default head" not in name:
                with profile() as prof:
                    step(*variant)
                print(f"\n{name}: one step\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
