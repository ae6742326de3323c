"""Atomic, durable file writes, the one implementation every module uses: write a temporary, then rename.

    atomic_write_bytes(path, lambda tmp: save_file(tensors, tmp))
    atomic_write_json(path, {"step": 10})
    durable_replace(staging_dir, final_dir)      # a folder written in full (a checkpoint), renamed into place

Readers never see a half-written file: a crash or a full disk leaves the old file (or none) in place.
Durable: the temporary's bytes reach the disk (fsync) before the rename, and the rename (its folder
fsynced) before the call returns, so that a power cut or a killed VM cannot leave a renamed file whose
blocks were never written (zero-length or zero-filled: the rename is metadata, which the filesystem may
commit first). Kept free of torch so that tokenizer and data workers import it cheaply.
"""

import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path, write) -> None:
    """Call write(tmp_path), then rename tmp_path over path; the temporary is removed on any failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the mode a plain open() would
        durable_replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def durable_replace(source, target) -> None:
    """os.replace(source, target), source a file or a folder of them, once source's bytes are on the disk;
    the rename itself is on the disk when this returns (the folder holding target fsynced)."""
    _fsync_tree(Path(source))
    os.replace(source, target)
    _fsync_folder(Path(target).parent)


def _fsync_tree(path: Path) -> None:
    if path.is_dir():
        for child in path.iterdir():
            _fsync_tree(child)
        _fsync_folder(path)
    else:
        _fsync(path)


def _fsync_folder(path: Path) -> None:
    """A folder's entries (a rename into it) to the disk. POSIX only: Windows cannot open a folder."""
    if os.name == "posix":
        _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # fsync flushes a file's pages whatever descriptor wrote them
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask, read without setting it (os.umask would, racing other threads' writes)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
