"""atomic.py: a write replaces the file whole or not at all, with the mode a plain open() would give."""

import os
import stat

import pytest

from gpt2.atomic import atomic_write_bytes, atomic_write_json


def test_write_replaces_whole_and_uses_the_umask_mode(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # the reference: what open() creates under this process's umask
    path = tmp_path / "meta.json"
    atomic_write_json(path, {"step": 1})
    atomic_write_json(path, {"step": 2})
    assert path.read_text() == '{\n  "step": 2\n}\n'
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert set(os.listdir(tmp_path)) == {"plain.txt", "meta.json"}  # no temporary left behind


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"old")

    def half_then_fail(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, half_then_fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["weights.bin"]
