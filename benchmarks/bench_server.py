"""Server throughput: continuous batching vs one request at a time, 16 concurrent clients.

    flock /tmp/gpt2-bench.lock .venv/bin/python benchmarks/bench_server.py            # ~2-3 min on 2 cores
    .venv/bin/python benchmarks/bench_server.py --model gpt2 --clients 16 --max-tokens 32

Starts `gpt2 serve` twice on a free loopback port: with --max-batch 16 (continuous batching) and with
--max-batch 1 (the same server forced to one request at a time). Each run: one warm-up request, then
`--clients` threads each send `--requests` greedy completions of `--max-tokens` new tokens (EOS is
banned with logit_bias so every request makes exactly that many) for short prompts of varied length.
Prints aggregate completion tokens/s, p50/p99 request latency, and the throughput ratio.
Default model: GPT-2 124M with random weights (the speed is the same as the real weights').
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

PROMPTS = ["Hello, my dog", "The meaning of life is", "In a shocking finding, scientists discovered a herd of",
           "Once upon a time", "The quick brown fox jumps over the lazy dog because", "Python is",
           "My favourite food is", "The history of the Roman Empire began when"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def run(model: str, max_batch: int, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "gpt2", "serve", "--model", model, "--port", str(port),
                             "--max-batch", str(max_batch), "--max-queue", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": "bench", "max_tokens": args.max_tokens, "temperature": 0, "logit_bias": {"50256": -100}}
        httpx.post(f"{url}/v1/completions", json={**body, "prompt": "warm up"}, timeout=300).raise_for_status()

        latencies, tokens, errors = [], [], []
        lock = threading.Lock()

        def client(i):
            with httpx.Client(timeout=600) as http:
                for r in range(args.requests):
                    t = time.perf_counter()
                    resp = http.post(f"{url}/v1/completions",
                                     json={**body, "prompt": PROMPTS[(i + r) % len(PROMPTS)]})
                    with lock:
                        if resp.status_code != 200:
                            errors.append(resp.status_code)
                        else:
                            latencies.append(time.perf_counter() - t)
                            tokens.append(resp.json()["usage"]["completion_tokens"])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed: {errors[:5]}")
        return {"max_batch": max_batch, "requests": len(latencies), "tokens": sum(tokens), "wall_s": wall,
                "tokens_per_s": sum(tokens) / wall, "p50_s": percentile(latencies, 50),
                "p99_s": percentile(latencies, 99)}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model to serve (default: GPT-2 124M, random weights, in a tmp dir)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16, help="the batching server's --max-batch")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    args = p.parse_args(argv)

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            import torch

            from gpt2 import GPT, GPTConfig
            torch.manual_seed(0)
            model = os.path.join(tmp, "gpt2-124M-random")
            GPT(GPTConfig.preset("gpt2")).save_pretrained(model)
        batched = run(model, args.max_batch, args)
        serial = run(model, 1, args)

    ratio = batched["tokens_per_s"] / serial["tokens_per_s"]
    print(f"{args.clients} clients x {args.requests} request(s) x {args.max_tokens} tokens, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'server':28s} {'tokens':>7s} {'wall s':>8s} {'tokens/s':>9s} {'p50 s':>7s} {'p99 s':>7s}")
    for name, r in [(f"continuous (--max-batch {args.max_batch})", batched), ("one at a time (--max-batch 1)", serial)]:
        print(f"{name:28s} {r['tokens']:7d} {r['wall_s']:8.1f} {r['tokens_per_s']:9.1f} {r['p50_s']:7.2f} {r['p99_s']:7.2f}")
    print(f"throughput ratio: {ratio:.2f}x")
    print(f"load average (1 min) at the start {load_start[0]:.2f}, at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps({"batched": batched, "serial": serial, "ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
