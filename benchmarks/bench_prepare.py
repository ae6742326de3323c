"""Prepare throughput (MB of text per second, text to shards): `gpt2 prepare` against llm.c's approach.

    .venv/bin/python benchmarks/bench_prepare.py [--mb 24] [--repeats 3] [--workers 2]

llm.c's approach (dev/data/fineweb.py, re-implemented here): a multiprocessing pool maps a function
that returns [<|endoftext|>] + tiktoken's encode_ordinary(doc) as a uint16 numpy array over the
documents (imap, chunksize 16), copies them into a shard-sized uint16 buffer and writes each full
buffer as an llm.c shard with numpy. Ours: gpt2.data.prepare. Both read the same parquet file (a
FineWeb-like corpus: Shakespeare's works cut into paragraphs of documents, repeated to --mb MB, row
groups of 1,000 rows) with pyarrow, write 10M-token shards, and produce the same tokens (checked
before anything is timed). Contenders alternate (ABBA); medians of --repeats; ratios over one run.
Also: each side with 1 worker, for the 1 -> N worker scaling.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_tokenizer import tiktoken_reference  # noqa: E402  (tiktoken built offline, as the tests build it)

SHARD_TOKENS = 10_000_000
_enc = None  # llm.c side: the tiktoken Encoding, inherited by forked workers


def make_corpus(path: Path, megabytes: float) -> tuple[int, int]:
    """A parquet file of documents (~2-6 KB each); returns (documents, UTF-8 bytes of text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpt2.datasets import fetch_shakespeare
    paragraphs = [p for f in fetch_shakespeare() for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    docs, cur, size, k = [], [], 0, 0
    target = megabytes * 1e6
    while size < target:
        cur.append(paragraphs[k % len(paragraphs)])
        k += 1
        if sum(map(len, cur)) > 2000 + 4000 * (k % 7) / 7:
            doc = "\n\n".join(cur)
            docs.append(doc)
            size += len(doc.encode())
            cur = []
    pq.write_table(pa.table({"text": docs}), path, row_group_size=1000)
    return len(docs), size


def _llmc_tokenize(doc: str) -> np.ndarray:
    tokens = [_enc.eot_token]
    tokens.extend(_enc.encode_ordinary(doc))
    return np.array(tokens).astype(np.uint16)


def _llmc_write(path: Path, toks: np.ndarray) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(toks)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.tobytes())


def llmc_prepare(parquet: Path, out: Path, workers: int) -> None:
    """llm.c fineweb.py's loop: pool.imap(tokenize, docs, chunksize=16) into a shard-sized buffer."""
    import pyarrow.parquet as pq
    pf = pq.ParquetFile(parquet)
    docs = (t for i in range(pf.num_row_groups) for t in pf.read_row_group(i, columns=["text"]).column(0).to_pylist())
    out.mkdir(parents=True, exist_ok=True)
    with mp.get_context("fork").Pool(workers) as pool:
        shard, count, buf = 0, 0, np.empty(SHARD_TOKENS, dtype=np.uint16)
        for tokens in pool.imap(_llmc_tokenize, docs, chunksize=16):
            while count + len(tokens) >= SHARD_TOKENS:  # fill, write, carry the remainder over
                take = SHARD_TOKENS - count
                buf[count:] = tokens[:take]
                _llmc_write(out / f"llmc_{'val' if shard == 0 else 'train'}_{shard:06d}.bin", buf)
                shard, count, tokens = shard + 1, 0, tokens[take:]
            buf[count: count + len(tokens)] = tokens
            count += len(tokens)
        if count:
            _llmc_write(out / f"llmc_{'val' if shard == 0 else 'train'}_{shard:06d}.bin", buf[:count])


def ours_prepare(parquet: Path, out: Path, workers: int) -> None:
    from gpt2.data import PrepareConfig, prepare
    prepare(PrepareConfig(inputs=[str(parquet)], out_dir=str(out), name="ours", val_fraction=0.0,
                          shard_size=SHARD_TOKENS, workers=workers))


def all_tokens(out: Path) -> np.ndarray:
    from gpt2.shards import read_shard
    files = sorted(out.glob("*.bin"), key=lambda f: f.name.rsplit("_", 1)[1])  # by shard index
    return np.concatenate([np.asarray(read_shard(f)) for f in files])


def main(argv=None) -> int:
    global _enc
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=24.0, help="corpus size in MB of UTF-8 text")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)

    from gpt2.kernels import cpu_features, cpu_model, memory_bandwidth_gbs
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        parquet = tmp / "corpus.parquet"
        n_docs, n_bytes = make_corpus(parquet, args.mb)
        _enc = tiktoken_reference()
        mb = n_bytes / 1e6
        print(f"CPU: {cpu_model()}; flags: {' '.join(cpu_features()) or 'none of bf16/VNNI/AMX'}; "
              f"{os.cpu_count()} CPUs; memory bandwidth {memory_bandwidth_gbs():.1f} GB/s; python {sys.version.split()[0]}")
        print(f"corpus: {n_docs:,} documents, {mb:.1f} MB of text in one parquet file; shards of {SHARD_TOKENS:,} "
              f"tokens; median of {args.repeats}; load average {os.getloadavg()[0]:.2f}")

        contenders = {}
        for w in sorted({1, args.workers}):
            contenders[f"llm.c approach, {w} worker(s)"] = (llmc_prepare, w)
            contenders[f"gpt2 prepare,   {w} worker(s)"] = (ours_prepare, w)
        for name, (fn, w) in contenders.items():  # same tokens from every contender, before any timing
            fn(parquet, tmp / "check", w)
            toks = all_tokens(tmp / "check")
            shutil.rmtree(tmp / "check")
            if "reference" not in locals():
                reference = toks
            assert np.array_equal(toks, reference), f"{name}: tokens differ from the first contender's"
        print(f"all contenders wrote the same {len(reference):,} tokens")

        times = {name: [] for name in contenders}
        order = list(contenders)
        for k in range(args.repeats):
            for name in (order if k % 2 == 0 else order[::-1]):  # ABBA: drift in load hits every side alike
                fn, w = contenders[name]
                out = tmp / "out"
                t = time.perf_counter()
                fn(parquet, out, w)
                times[name].append(time.perf_counter() - t)
                shutil.rmtree(out)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name, t in med.items():
            print(f"{name}   {t:6.2f} s   {mb / t:6.2f} MB/s   {len(reference) / t / 1e6:5.2f} M tok/s")
        n = args.workers
        ours_n, llmc_n = med[f"gpt2 prepare,   {n} worker(s)"], med[f"llm.c approach, {n} worker(s)"]
        print(f"ours vs llm.c's approach at {n} workers: {llmc_n / ours_n:.2f}x (above 1: ours is faster)")
        if n > 1:
            print(f"scaling 1 -> {n} workers: ours {med['gpt2 prepare,   1 worker(s)'] / ours_n:.2f}x, "
                  f"llm.c's approach {med['llm.c approach, 1 worker(s)'] / llmc_n:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
