"""Atomic file writes, the one implementation every module uses: write a temporary file, then rename.

    atomic_write_bytes(path, lambda tmp: save_file(tensors, tmp))
    atomic_write_json(path, {"step": 10})

Readers never see a half-written file: a crash or a full disk leaves the old file (or none) in place.
Kept free of torch so that tokenizer and data workers import it cheaply.
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
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
