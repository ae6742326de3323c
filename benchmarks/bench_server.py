"""The server under load, over HTTP: throughput, time to first token, inter-token latency; chunked
prefill and the prefix cache against their baselines.

    flock -x /tmp/gpt2-bench.lock .venv/bin/python benchmarks/bench_server.py                 # every part
    .venv/bin/python benchmarks/bench_server.py --part load --clients 16 64 --max-tokens 16
    .venv/bin/python benchmarks/bench_server.py --part chunked     # a 900-token prompt while 8 streams decode
    .venv/bin/python benchmarks/bench_server.py --part prefix      # the same 900-token prompt twice
    .venv/bin/python benchmarks/bench_server.py --part load --clients 8 --max-tokens 64 --dtype int4 --compile

Each part starts `gpt2 serve` on a free loopback port, once per contender, and drives it with streaming
requests (server-sent events; the arrival time of each event is a token's time):
  load     `--clients` concurrent clients, one request each, token-id prompts of lengths spread evenly
           over 10..900 (shuffled), `--max-tokens` new tokens each. Contenders: the server as shipped
           (chunked prefill, prefix cache), the same with --prefill-chunk 0 --no-prefix-cache, and the
           one-at-a-time server (--max-batch 1). Figures: completion tokens/s, p50/p99 of time to first
           token (TTFT) and of inter-token latency (ITL).
  chunked  8 streams decode; once each has 10 tokens, one 900-token prompt arrives. Figures: the streams'
           ITL p99 while it is prefilled, and the time of one chunk alone (TTFT of a --prefill-chunk-token
           prompt on the idle server). The issue's bar: p99 <= 2 x one chunk. Against --prefill-chunk 0.
  prefix   the same 900-token prompt twice, one after the other (max_tokens 1): TTFT of each; the bar:
           the second >= 5x sooner. Against --no-prefix-cache.
Every token is forced to " the" with logit_bias (+100 on one id), so each step emits one event of text
and no request stops early; the arithmetic is the same as for unforced tokens.
Default model: GPT-2 124M with random weights (the speed is the same as the real weights').
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import httpx

FORCED = {"262": 100.0}  # " the": every step emits one visible token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))] if values else float("nan")


@contextmanager
def server(model: str, flags: list[str]):
    """`gpt2 serve` with these flags on a free port, warmed up; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "gpt2", "serve", "--model", model, "--port", str(port),
                             "--max-queue", "256", "--alias", "bench", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start ({flags})")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        stream_request(url, [464] * 40, 4)  # warm up
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def stream_request(url: str, prompt: list[int], max_tokens: int, on_token=None) -> dict:
    """One streaming completion: its start time, each token event's arrival time (perf_counter)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": FORCED}
    start, times = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
                if on_token is not None:
                    on_token(len(times))
    return {"start": start, "times": times}


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def summary(results: list[dict], wall: float) -> dict:
    ttft = [r["times"][0] - r["start"] for r in results]
    itl = [g for r in results for g in gaps(r["times"])]
    tokens = sum(len(r["times"]) for r in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99)}


def concurrent(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    results = [None] * len(prompts)

    def client(i):
        results[i] = stream_request(url, prompts[i], max_tokens)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(results, time.perf_counter() - start)


def mixed_prompts(clients: int, seed: int) -> list[list[int]]:
    """Prompt lengths spread evenly over 10..900, shuffled; random token ids."""
    rng = random.Random(seed)
    lengths = [10 + round(i * 890 / max(1, clients - 1)) for i in range(clients)]
    rng.shuffle(lengths)
    return [[rng.randrange(50000) for _ in range(n)] for n in lengths]


def part_load(model: str, args) -> list[str]:
    contenders = [("chunked + prefix cache", [f"--prefill-chunk={args.prefill_chunk}"]),
                  ("whole prompts, no prefix cache", ["--prefill-chunk=0", "--no-prefix-cache"]),
                  ("one at a time (--max-batch 1)", ["--max-batch=1"])]
    if args.compile:  # the shipped server against itself with --compile
        contenders = [contenders[0], ("chunked + prefix cache, --compile", [f"--prefill-chunk={args.prefill_chunk}",
                                                                           "--compile"])]
    lines = [f"{'server':32s} {'clients':>7s} {'tokens':>6s} {'wall s':>7s} {'tok/s':>6s} "
             f"{'TTFT p50':>8s} {'TTFT p99':>8s} {'ITL p50':>8s} {'ITL p99':>8s}"]
    for clients in args.clients:
        prompts = mixed_prompts(clients, seed=clients)
        for name, flags in contenders:
            with server(model, ["--max-batch", str(args.max_batch), f"--dtype={args.dtype}", *flags]) as url:
                if args.compile:  # the compiled server's graphs (one per batch-row count) compile on first use:
                    # both servers first run the load untimed on other prompts (the same ones would hit the prefix cache)
                    concurrent(url, mixed_prompts(clients, seed=clients + 1), args.max_tokens)
                r = concurrent(url, prompts, args.max_tokens)
            lines.append(f"{name:32s} {clients:7d} {r['tokens']:6d} {r['wall_s']:7.1f} {r['tokens_per_s']:6.1f} "
                         f"{r['ttft_p50']:8.2f} {r['ttft_p99']:8.2f} {r['itl_p50']:8.3f} {r['itl_p99']:8.3f}")
            print(lines[-1], flush=True)
    return lines


def part_chunked(model: str, args) -> list[str]:
    rng = random.Random(1)
    long_prompt = [rng.randrange(50000) for _ in range(900)]
    lines = []
    for name, chunk in [(f"--prefill-chunk {args.prefill_chunk}", args.prefill_chunk), ("--prefill-chunk 0", 0)]:
        with server(model, ["--max-batch", "16", f"--prefill-chunk={chunk}", "--no-prefix-cache"]) as url:
            # one chunk alone: a prompt of exactly one chunk on the idle server (median of 3)
            chunk_times = []
            for _ in range(3):
                r = stream_request(url, long_prompt[:args.prefill_chunk], 1)
                chunk_times.append(r["times"][0] - r["start"])
            one_chunk = percentile(chunk_times, 50)
            streaming = [threading.Event() for _ in range(8)]  # set at a stream's 10th token (never blocks it)
            streams = [None] * 8

            def stream(i):
                streams[i] = stream_request(url, [464 + i] * 10, 120,
                                            on_token=lambda n: n == 10 and streaming[i].set())
            threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for e in streaming:
                e.wait(600)
            long = stream_request(url, long_prompt, 1)
            for t in threads:
                t.join()
        window = (long["start"], long["times"][0])
        # gaps that overlap the prefill (the one a whole-prompt prefill stalls ends just after it)
        during = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:]) if a < window[1] and b > window[0]]
        before = [g for s in streams for g in gaps(s["times"][:10])]
        p99 = percentile(during, 99)
        lines.append(f"{name}: 900-token prompt TTFT {window[1] - window[0]:.2f} s; the 8 streams' ITL p50 before "
                     f"{percentile(before, 50) * 1e3:.0f} ms, p99 during its prefill {p99 * 1e3:.0f} ms "
                     f"({len(during)} gaps); one {args.prefill_chunk}-token chunk alone {one_chunk * 1e3:.0f} ms; "
                     f"p99 / chunk = {p99 / one_chunk:.2f} (bar: <= 2)")
        print(lines[-1], flush=True)
    return lines


def part_prefix(model: str, args) -> list[str]:
    rng = random.Random(2)
    prompt = [rng.randrange(50000) for _ in range(900)]
    lines = []
    for name, flags in [("prefix cache", []), ("--no-prefix-cache", ["--no-prefix-cache"])]:
        with server(model, flags) as url:
            ttft = []
            for _ in range(2):
                r = stream_request(url, prompt, 1)
                ttft.append(r["times"][0] - r["start"])
        lines.append(f"{name}: TTFT of a 900-token prompt {ttft[0]:.3f} s, the same prompt again {ttft[1]:.3f} s: "
                     f"{ttft[0] / ttft[1]:.1f}x sooner (bar: >= 5x with the cache)")
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model to serve (default: GPT-2 124M, random weights, in a tmp dir)")
    p.add_argument("--part", choices=["load", "chunked", "prefix", "all"], default="all")
    p.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request in the load part")
    p.add_argument("--max-batch", type=int, default=16, help="the batching servers' --max-batch")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "int8", "int4"], default="float32",
                   help="the load part's servers' --dtype")
    p.add_argument("--compile", action="store_true",
                   help="load part: the shipped server against the same with --compile (each first runs the load "
                        "untimed on other prompts: the compiled one's graphs compile then)")
    args = p.parse_args(argv)

    import torch

    from gpt2.kernels import cpu_features, cpu_model, memory_bandwidth_gbs
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores; {' '.join(cpu_features()) or 'no bf16/VNNI/AMX flags'}); "
          f"memory bandwidth {memory_bandwidth_gbs():.1f} GB/s; torch {torch.__version__}")
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from gpt2 import GPT, GPTConfig
            torch.manual_seed(0)
            model = os.path.join(tmp, "gpt2-124M-random")
            GPT(GPTConfig.preset("gpt2")).save_pretrained(model)
        for part, fn in [("prefix", part_prefix), ("chunked", part_chunked), ("load", part_load)]:
            if args.part in (part, "all"):
                print(f"-- {part}", flush=True)
                fn(model, args)
    print(f"load average (1 min) at the start {load_start:.2f}, at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
