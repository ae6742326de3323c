"""Speculative decoding against plain decoding of the same target, batch 1, greedy, in one run.

    flock -x /tmp/gpt2-bench.lock .venv/bin/python benchmarks/bench_speculative.py            # both cases
    ... bench_speculative.py --skip-pair        # only gpt2-xl;  --skip-xl: only the trained pair
    ... bench_speculative.py --skip-xl --compile   # the pair, each contender also with compile=True

Cases:
  xl    gpt2-xl (1558M) with random weights, target in bfloat16 and in float32, drafted by its own
        weights in int4 (engine.quantized_copy). One float32 model is built once: the bf16 target and the
        int4 draft are packed from it, then it is packed in place as the float32 target (one at a time:
        gpt2-xl is 6.2 GB in float32).
  pair  a small draft (the quickstart recipe, 4 x 96, for its 4.5 minutes) and a wider target (6 x 384,
        --target-minutes, at half the lr) trained on the same Shakespeare data (cached under the kernel
        cache's folder, keyed by shape, minutes and lr; trained if missing, ~17 minutes once): random
        weights make a separate draft's acceptance meaningless. The target needs its longer budget to
        predict as well as the draft (a wide model sees fewer tokens per second): in 3 minutes at the
        quickstart's lr it only repeated " the". Target float32, draft --pair-draft-dtype (int8), three
        Shakespeare prompts (PAIR_PROMPTS) per call. Then the same pair through `gpt2 serve`'s scheduler
        (batching.Scheduler, no HTTP): one lone greedy request at a time on the first prompt, without
        and with --draft (the server speculates for a lone request), and engine.generate beside it.

Every round runs each contender once, in turn (plain; speculative with adaptive k; speculative with each
--fixed-k), so load from other processes hits them alike; the table reports medians over rounds (and
"by round": the median of each round's own speed-up), tok/s =
new tokens / wall time of the whole generate calls (the prompts' prefill included), the draft's
acceptance rate, target forwards per token, the speed-up over plain, and whether the output equals
plain greedy token for token (it must).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from gpt2.engine import SpeculationStats, Stream, draft_costs, make_config, quantized_copy
from gpt2.kernels import cpu_features, cpu_model, default_cache_path, memory_bandwidth_gbs


def run(model, prompts, n, **options):
    """(new ids per prompt, seconds, speculation stats summed, or None) of one greedy generate call per prompt."""
    t = time.perf_counter()
    outs, total = [], None
    for prompt in prompts:
        steps = Stream(model, [prompt], make_config(max_new_tokens=n, ignore_eos=True, **options))
        outs.append([s[0] for s in steps if s[0] is not None])
        if steps.speculation is not None:
            total = (total or SpeculationStats()) + steps.speculation
    return outs, time.perf_counter() - t, total


def compare(name: str, target, draft, prompts, n: int, rounds: int, k: int, fixed_k: list[int],
            compiled: bool = False) -> None:
    contenders = {"plain": {}, f"speculative, adaptive k from {k}": dict(draft=draft, draft_tokens=k)}
    contenders.update({f"speculative, k = {f} fixed": dict(draft=draft, draft_tokens=f, adaptive_draft=False)
                       for f in fixed_k})
    if compiled:  # the same, each with compile=True: plain compiles the target's step, speculation the draft's
        contenders.update({f"{c}, compiled": {**options, "compile": True} for c, options in list(contenders.items())})
    for options in ({}, {"compile": True}) if compiled else ({},):
        run(target, prompts[:1], 4, **options)  # warm-up: allocation, kernel setup (and compiling)
        run(target, prompts[:1], 4, draft=draft, draft_tokens=k, **options)  # and adaptive k's costs (once)
    costs = draft_costs(target, draft)
    times = {c: [] for c in contenders}
    results = {}
    for _ in range(rounds):
        for c, options in contenders.items():
            out, seconds, stats = run(target, prompts, n, **options)
            times[c].append(seconds)
            results[c] = (out, stats)
    plain_ids, _ = results["plain"]
    plain_s = statistics.median(times["plain"])
    tokens = n * len(prompts)
    print(f"\n{name}: {n} new tokens after each of {len(prompts)} prompts ({', '.join(str(len(p)) for p in prompts)}"
          f" tokens), median of {rounds} rounds; a draft step costs {costs.draft_step:.3f} target steps and each"
          f" verified position {costs.verify_position:.3f} (measured for adaptive k)")
    print(f"  {'contender':44s} {'tok/s':>7s} {'speed-up':>8s} {'by round':>8s} {'accepted':>8s} {'tokens/fwd':>10s}"
          f"  equals plain")
    for c in contenders:
        s = statistics.median(times[c])
        out, stats = results[c]
        acc = f"{stats.acceptance_rate:8.1%}" if stats else f"{'-':>8s}"
        per = f"{stats.tokens_per_round:10.2f}" if stats else f"{1.0:10.2f}"
        print(f"  {c:44s} {tokens / s:7.2f} {plain_s / s:7.2f}x {median_of_rounds(times['plain'], times[c]):7.2f}x"
              f" {acc} {per}  {out == plain_ids}")
    if compiled:  # speculation with a compiled draft against the compiled target alone
        print("  compiled speculation / compiled plain, by round: " + ", ".join(
            f"{c.removesuffix(', compiled')}: {median_of_rounds(times['plain, compiled'], times[c]):.2f}x"
            for c in contenders if c.endswith("compiled") and c != "plain, compiled"))


def median_of_rounds(plain: list[float], other: list[float]) -> float:
    """The median of each round's speed-up: in a round the contenders run back to back, in one state of
    the machine, whose memory bandwidth drifts by tens of percent over minutes here."""
    return statistics.median(p / o for p, o in zip(plain, other))


# ---------------------------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------------------------

def xl_case(args) -> None:
    from gpt2 import GPT, GPTConfig
    from gpt2.kernels import plan_for
    from gpt2.quantize import apply_plan
    torch.manual_seed(0)
    t = time.perf_counter()
    model = GPT(GPTConfig.preset("gpt2-xl")).eval()  # float32, random weights (GPT-2's init)
    draft = quantized_copy(model, "int4")
    print(f"\ngpt2-xl random weights built and the int4 draft packed in {time.perf_counter() - t:.0f} s")
    prompt = torch.randint(0, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    target = quantized_copy(model, "bfloat16")
    compare("gpt2-xl bfloat16, int4 self-draft", target, draft, [prompt], args.tokens, args.rounds, args.k, args.fixed_k)
    del target
    gc.collect()
    target = apply_plan(model, plan_for(model, "float32"))  # in place: no second float32 copy
    compare("gpt2-xl float32, int4 self-draft", target, draft, [prompt], args.tokens, args.rounds, args.k, args.fixed_k)
    del target, model, draft
    gc.collect()


PAIR = {"draft": dict(n_layer=4, n_head=4, n_embd=96),    # the quickstart recipe
        "target": dict(n_layer=6, n_head=6, n_embd=384)}  # the same recipe, wider and deeper
TARGET_LR = 5e-4
# Each greedy continuation settles into its own stretch of easy and hard tokens: three of them.
PAIR_PROMPTS = ["ROMEO:\nWhat light through yonder window breaks? It is",
                "KING HENRY:\nOnce more unto the breach, dear friends,",
                "First Citizen:\nBefore we proceed any further, hear me speak."]


def trained(role: str, args) -> Path:
    """The run directory of the pair's `role`, trained on args.data if not cached: the draft for the
    quickstart preset's own budget, the target for args.target_minutes."""
    import dataclasses

    from gpt2.train import preset_configs, train
    # The wider target learns faster at half the quickstart's lr: 3.5-minute probes of 6 x 384 reached
    # val 5.41 at lr 5e-4 against 5.69 at 1e-3 (embeddings at 2x) and a slower curve at 1e-3 (BENCHMARKS.md).
    overrides = dict(max_minutes=args.target_minutes, lr=TARGET_LR) if role == "target" else {}
    cfg = preset_configs("quickstart", **overrides)[0]
    shape = PAIR[role]
    out = (default_cache_path().parent / "bench_speculative"
           / f"{role}-{shape['n_layer']}x{shape['n_embd']}-{cfg.max_minutes:g}min-lr{cfg.lr:g}")
    if (out / "LATEST").exists():
        return out
    data = Path(args.data)
    if not data.exists():
        from gpt2.data import PrepareConfig, prepare
        prepare(PrepareConfig(inputs=["shakespeare"], out_dir=str(data)))
    cfg, model_config = preset_configs("quickstart", data=str(data), out=str(out), progress=False, **overrides)
    model_config = dataclasses.replace(model_config, **shape)
    print(f"training the {role} ({shape}) for {cfg.max_minutes:g} min at lr {cfg.lr:g} into {out}", flush=True)
    summary = train(cfg, model_config)
    print(f"  {role}: {summary}", flush=True)
    return out


def pair_case(args) -> None:
    from gpt2.quantize import load_for_inference
    from gpt2.tokenizer import Tokenizer
    paths = {role: trained(role, args) for role in PAIR}
    for role, path in paths.items():
        last = json.loads((path / "metrics.jsonl").read_text().splitlines()[-1])
        print(f"  {role} {PAIR[role]}: step {last['step']}, val loss {last['val_loss']:.3f} ({path})")
    target = load_for_inference(paths["target"], "float32", device="cpu")
    draft = load_for_inference(paths["draft"], args.pair_draft_dtype, device="cpu")
    tok = Tokenizer.gpt2()
    prompts = [tok.encode(text) for text in PAIR_PROMPTS]
    n = min(args.tokens * 2, target.config.n_positions - max(len(p) for p in prompts))
    compare(f"trained pair: target {PAIR['target']} float32, draft {PAIR['draft']} {args.pair_draft_dtype}",
            target, draft, prompts, n, args.rounds, args.k, args.fixed_k, args.compile)
    serve_case(target, draft, prompts[0], n, args)


def serve_scheduled(scheduler, prompt, n: int) -> tuple[list[int], float]:
    """(new ids, seconds) of one lone greedy request through the server's scheduler."""
    from gpt2.batching import Continuation
    ids, done = [], threading.Event()

    def on_event(event):
        if event[0] == "token":
            ids.append(event[1])
        elif event[0] == "done":
            done.set()
    seq = Continuation(prompt=prompt, max_new_tokens=n, stop_token_ids=frozenset(), emit=on_event)
    t = time.perf_counter()
    scheduler.submit([seq])
    done.wait()
    return ids, time.perf_counter() - t


def serve_case(target, draft, prompt, n: int, args) -> None:
    """The pair through `gpt2 serve`'s scheduler (batching.Scheduler; no HTTP): a lone greedy request,
    with and without --draft."""
    from gpt2.batching import Scheduler
    schedulers = {"serve, no draft": Scheduler(target).start(),
                  f"serve --draft, adaptive k from {args.k}": Scheduler(target, draft=draft, draft_tokens=args.k).start()}
    schedulers.update({f"serve --draft, k = {k} fixed": Scheduler(target, draft=draft, draft_tokens=k,
                                                                  adaptive_draft=False).start() for k in args.fixed_k})
    try:
        for s in schedulers.values():
            serve_scheduled(s, prompt, 4)  # warm-up
        times, outputs = {name: [] for name in schedulers}, {}
        engine_times = []  # the engine's own plain generate, in the same rounds: what the scheduler adds
        for _ in range(args.rounds):
            _, seconds, _ = run(target, [prompt], n)
            engine_times.append(seconds)
            for name, s in schedulers.items():
                outputs[name], seconds = serve_scheduled(s, prompt, n)
                times[name].append(seconds)
    finally:
        for s in schedulers.values():
            s.stop()
    plain_s = statistics.median(times["serve, no draft"])
    print(f"\nthe same pair through gpt2 serve's scheduler, one request at a time: {n} new tokens, median of {args.rounds}"
          f" (engine.generate, no scheduler, in the same rounds: {n / statistics.median(engine_times):.2f} tok/s)")
    for name, s in schedulers.items():
        stats = s.speculation
        acc = f"{stats.acceptance_rate:8.1%}" if stats.proposed else f"{'-':>8s}"
        print(f"  {name:40s} {n / statistics.median(times[name]):7.2f} tok/s {plain_s / statistics.median(times[name]):5.2f}x"
              f" (by round {median_of_rounds(times['serve, no draft'], times[name]):.2f}x)"
              f" {acc}  equals no draft: {outputs[name] == outputs['serve, no draft']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per gpt2-xl call (twice that for the pair)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-k", type=int, default=4, help="draft tokens per round (the adaptive one's start)")
    parser.add_argument("--fixed-k", type=int, nargs="+", default=[2, 3, 4], help="fixed draft lengths to time")
    # The 4 x 96 draft's step is per-op overhead and its 50,257-wide lm_head: int8 halves the bytes that
    # lm_head reads and proposes the same greedy ids here (acceptance equal to float32's).
    parser.add_argument("--pair-draft-dtype", default="int8", choices=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--data", default="data/shakespeare", help="token shards (gpt2 prepare shakespeare)")
    parser.add_argument("--target-minutes", type=float, default=12.0,
                        help="the pair's target's training budget (the draft takes the quickstart preset's)")
    parser.add_argument("--compile", action="store_true",
                        help="also time each contender with compile=True (the pair only: xl steps are kernel-bound)")
    parser.add_argument("--skip-xl", action="store_true")
    parser.add_argument("--skip-pair", action="store_true")
    args = parser.parse_args()
    features = ", ".join(cpu_features()) or "no bf16/VNNI/AMX flags"
    print(f"CPU: {cpu_model()} ({features}), {torch.get_num_threads()} threads, "
          f"memory bandwidth {memory_bandwidth_gbs():.1f} GB/s, torch {torch.__version__}")
    if not args.skip_pair:
        pair_case(args)
    if not args.skip_xl:
        xl_case(args)


if __name__ == "__main__":
    main()
