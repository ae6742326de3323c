"""llm.c's token shard format: one file of uint16 tokens behind a 1024-byte header, and a split as a list of them.

    from gpt2.shards import read_shard, write_shard, load_split
    write_shard("data/mine/mine_val_000000.bin", ids)   # ids < 65536, written atomically
    tokens = read_shard("data/mine/mine_val_000000.bin")  # read-only uint16 memmap, header and size checked
    val = load_split("data/mine", "val")                 # every val shard, concatenated (for evaluation)

The format (llm.c's dev/data/data_common.py): a header of 256 little-endian int32 (magic 20240520,
version 1, token count, then zeros), followed by the tokens as little-endian uint16. A file whose
magic, version or size disagrees with its header raises DataError naming the file.

A prepared directory (see gpt2.data.prepare) holds {name}_{split}_{k:06d}.bin files and a manifest.json
listing them; `shard_files` reads the list from the manifest, else by that name pattern, and also
accepts a glob pattern or a list of paths. `ShardWriter` writes one split as numbered shards, streaming
and resumable.
"""

from __future__ import annotations

import glob as globlib
import json
import os
from pathlib import Path

import numpy as np

from gpt2.atomic import atomic_write_bytes, durable_replace
from gpt2.errors import DataError

MAGIC = 20240520  # llm.c's magic for GPT-2 uint16 shards
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMAT = {"name": "llm.c", "magic": MAGIC, "version": VERSION, "header_bytes": HEADER_BYTES, "dtype": "uint16"}


def shard_filename(name: str, split: str, index: int) -> str:
    return f"{name}_{split}_{index:06d}.bin"


def shard_pattern(split: str, name: str = "*") -> str:
    """The glob that matches shard_filename(name, split, any index)."""
    return f"{name}_{split}_*.bin"


# ---------------------------------------------------------------------------------------------
# one shard
# ---------------------------------------------------------------------------------------------

def write_shard(path: str | os.PathLike, tokens) -> Path:
    """Write `tokens` (ints < 65536) as one llm.c shard, atomically."""
    toks = np.asarray(tokens)
    if toks.size and (toks.min() < 0 or toks.max() > 65535):
        raise DataError(f"{path}: token ids must be in [0, 65535] to be stored as uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, toks.size

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(toks.astype("<u2", copy=False).tobytes())

    atomic_write_bytes(path, write)
    return Path(path)


def read_shard_header(path: str | os.PathLike) -> int:
    """Token count of a shard after checking magic, version and the file size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e})") from None
    if header.size != HEADER_INTS:
        raise DataError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte llm.c header")
    if header[0] != MAGIC:
        raise DataError(f"{path}: magic {header[0]} is not llm.c's {MAGIC}; not a token shard")
    if header[1] != VERSION:
        raise DataError(f"{path}: version {header[1]} is not supported (only {VERSION}: GPT-2, uint16)")
    n = int(header[2])
    if n < 0 or size != HEADER_BYTES + 2 * n:
        raise DataError(f"{path}: the header says {n} tokens ({HEADER_BYTES + 2 * n} bytes) but the file has "
                        f"{size} bytes: truncated or corrupt. Fix: prepare the data again.")
    return n


def read_shard(path: str | os.PathLike) -> np.memmap | np.ndarray:
    """The tokens of a shard as a read-only uint16 memmap (header and size checked)."""
    n = read_shard_header(path)
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


# ---------------------------------------------------------------------------------------------
# a split: numbered shards
# ---------------------------------------------------------------------------------------------

def shard_files(source, split: str = "train") -> list[Path]:
    """A split's shard paths: from DIR/manifest.json, else DIR/*_{split}_*.bin, a glob, or a list."""
    if isinstance(source, (list, tuple)):
        files = [Path(p) for p in source]
    else:
        p = Path(source)
        if p.is_dir():
            man = p / "manifest.json"
            if man.is_file():
                m = json.loads(man.read_text())
                files = [p / s["file"] for s in m["shards"].get(split, [])]
            else:
                files = sorted(p.glob(shard_pattern(split)))
        else:
            files = sorted(Path(f) for f in globlib.glob(str(source)))
    if not files:
        raise DataError(f"{source}: no {split} shards found. Fix: run `gpt2 prepare ... --out DIR` first, "
                        "or check the split name and path.")
    for f in files:
        if not f.is_file():
            raise DataError(f"{f}: shard listed but missing. Fix: prepare the data again.")
    return files


def load_split(source, split: str = "val") -> np.ndarray:
    """All tokens of a split concatenated into one uint16 array (for evaluation)."""
    return np.concatenate([np.asarray(read_shard(f)) for f in shard_files(source, split)])


class ShardWriter:
    """Writes one split as numbered shards of exactly shard_size tokens (the last may be shorter), streaming:
    tokens go straight into the open shard's partial file, so memory holds no shard, however large.

        w = ShardWriter(Path("data/mine"), "mine", "train", shard_size=100_000_000)
        w.add(ids); ...; w.close()          # w.shards: [{"file": ..., "tokens": ...}], w.tokens: the total
        position = w.flush()                # on disk now; ShardWriter(..., resume=position) continues from it

    The open shard is DIR/.{file}.partial (hidden: no shard glob matches it); a full shard gets its
    header's token count, is fsynced and renamed into place, so a reader never sees half a shard (the
    write-then-rename of gpt2.atomic, spread over many add() calls). Resuming truncates the partial file
    to the flushed position: tokens added after the last flush are dropped, to be added again.
    """

    def __init__(self, out_dir: Path, name: str, split: str, shard_size: int, resume: dict | None = None):
        self.out_dir, self.name, self.split, self.shard_size = Path(out_dir), name, split, shard_size
        self.shards: list[dict] = [dict(s) for s in (resume or {}).get("shards", [])]
        self.n_open = int((resume or {}).get("open_tokens", 0))   # tokens in the open shard
        self.tokens = sum(s["tokens"] for s in self.shards) + self.n_open
        self._file = None
        if self.n_open:
            path = self._partial_path()
            if not path.is_file() or path.stat().st_size < HEADER_BYTES + 2 * self.n_open:
                raise DataError(f"{path}: the partial shard to resume is missing or shorter than its recorded "
                                f"{self.n_open} tokens. Fix: delete {self.out_dir / 'prepare_state.json'} to start over.")
            self._file = open(path, "r+b")
            self._file.truncate(HEADER_BYTES + 2 * self.n_open)
            self._file.seek(0, os.SEEK_END)

    def add(self, toks: np.ndarray) -> None:
        """Append uint16 tokens; full shards are finished as they fill."""
        toks = np.asarray(toks, dtype="<u2")
        self.tokens += toks.size
        while toks.size:
            if self._file is None:
                self._file = open(self._partial_path(), "w+b")
                self._file.write(bytes(HEADER_BYTES))  # the token count is written when the shard is finished
            take = min(toks.size, self.shard_size - self.n_open)
            self._file.write(toks[:take].tobytes())
            self.n_open += take
            toks = toks[take:]
            if self.n_open == self.shard_size:
                self._finish()

    def flush(self) -> dict:
        """Everything added so far on disk; returns the position to resume from (JSON-able)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return {"shards": [dict(s) for s in self.shards], "open_tokens": self.n_open}

    def close(self) -> None:
        """Finish the last, shorter shard."""
        if self._file is not None:
            self._finish()

    def abandon(self) -> None:
        """Close the open file without finishing its shard (an interrupted prepare keeps it to resume)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _partial_path(self) -> Path:
        return self.out_dir / f".{shard_filename(self.name, self.split, len(self.shards))}.partial"

    def _finish(self) -> None:
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[0], header[1], header[2] = MAGIC, VERSION, self.n_open
        f, self._file = self._file, None
        f.seek(0)
        f.write(header.tobytes())
        f.close()
        fname = shard_filename(self.name, self.split, len(self.shards))
        durable_replace(self._partial_path(), self.out_dir / fname)
        self.shards.append({"file": fname, "tokens": self.n_open})
        self.n_open = 0
