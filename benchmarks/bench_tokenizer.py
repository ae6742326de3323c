"""Tokenizer speed against tiktoken on the Shakespeare corpus, both run alternately in one process.

    .venv/bin/python benchmarks/bench_tokenizer.py [--repeats 9] [--threads N] [--scale 4]

Prints the median time of each side per case and the ratio tiktoken_time / our_time (above 1: we
are faster). Outputs are checked to be identical before anything is timed. tiktoken is built through
its own loader (tiktoken_ext.openai_public) from a TIKTOKEN_CACHE_DIR laid out offline with OpenAI's
files, exactly as the tests build their reference.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time


def tiktoken_reference():
    import tiktoken
    import tiktoken_ext.openai_public as openai_public
    from gpt2 import tokenizer as T

    cache = tempfile.mkdtemp(prefix="tiktoken-cache-")
    enc_json, vocab_bpe = T._wheel_files()
    for name, url in T.TIKTOKEN_URLS.items():
        shutil.copy(enc_json if name == "encoder.json" else vocab_bpe, os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()))
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = cache
    try:
        return tiktoken.Encoding(**openai_public.gpt2())
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR")
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def bench(name, ref_fn, our_fn, repeats, size_mb):
    assert ref_fn() == our_fn(), f"{name}: outputs differ"
    ref_t, our_t = [], []
    for k in range(repeats):  # alternate (ABBA order), so drift in machine load hits both sides alike
        for fn, times in ([(ref_fn, ref_t), (our_fn, our_t)] if k % 2 == 0 else [(our_fn, our_t), (ref_fn, ref_t)]):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    r, o = statistics.median(ref_t), statistics.median(our_t)
    print(f"{name:52s} tiktoken {r * 1e3:8.1f} ms ({size_mb / r:5.1f} MB/s)   ours {o * 1e3:8.1f} ms "
          f"({size_mb / o:5.1f} MB/s)   ratio {r / o:5.2f}x")
    return r / o


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--scale", type=int, default=4, help="the 'large input' case repeats the corpus this many times")
    args = p.parse_args(argv)

    from gpt2.data import fetch_shakespeare
    from gpt2.tokenizer import Tokenizer

    docs = [f.read_text(encoding="utf-8") for f in fetch_shakespeare()]
    corpus = "".join(docs)
    big = corpus * args.scale
    mb, big_mb = len(corpus.encode()) / 1e6, len(big.encode()) / 1e6
    ref, tok = tiktoken_reference(), Tokenizer.gpt2()
    n = args.threads
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, threads={n}; Shakespeare {len(docs)} works, "
          f"{mb:.2f} MB, {len(ref.encode_ordinary(corpus)):,} tokens; median of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.2f}")
    bench("corpus, one string, 1 thread", lambda: ref.encode_ordinary(corpus),
          lambda: tok.encode_ordinary(corpus, num_threads=1), args.repeats, mb)
    bench("corpus, one string, encode() with special check", lambda: ref.encode(corpus),
          lambda: tok.encode(corpus, num_threads=1), args.repeats, mb)
    bench(f"corpus, one string, ours on {n} threads", lambda: ref.encode_ordinary(corpus),
          lambda: tok.encode_ordinary(corpus, num_threads=n), args.repeats, mb)
    bench("corpus, one string, ours default (idle-CPU threads)", lambda: ref.encode_ordinary(corpus),
          lambda: tok.encode_ordinary(corpus), args.repeats, mb)
    bench(f"corpus x{args.scale} ({big_mb:.0f} MB), ours on {n} threads", lambda: ref.encode_ordinary(big),
          lambda: tok.encode_ordinary(big, num_threads=n), max(3, args.repeats // 2), big_mb)
    bench(f"42 documents, batch on {n} threads (both)", lambda: ref.encode_ordinary_batch(docs, num_threads=n),
          lambda: tok.encode_batch(docs, num_threads=n), args.repeats, mb)
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
