"""atomic.py: a write replaces the file whole or not at all, with the mode a plain open() would give, and
reaches the disk before its rename."""

import os
import stat

import pytest

from gpt2.atomic import atomic_write_bytes, atomic_write_json, durable_replace


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


@pytest.fixture
def disk_events(monkeypatch):
    """Every fsync (the path its descriptor names) and rename, in order."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(source, target):
        events.append(("replace", str(source), str(target)))
        replace(source, target)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return events


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc")


@needs_proc
def test_a_write_is_on_the_disk_before_its_rename_and_the_rename_before_it_returns(tmp_path, disk_events):
    """A power cut after a rename whose file's blocks were not yet written leaves a zero-length or
    zero-filled file under the new name: the temporary is fsynced first, the folder after the rename."""
    path = tmp_path / "meta.json"
    atomic_write_json(path, {"step": 1})
    (flushed, temporary), (renamed, source, target), (flushed_after, folder) = disk_events
    assert (flushed, renamed, flushed_after) == ("fsync", "replace", "fsync")
    assert temporary == source != target == str(path)
    assert folder == str(tmp_path)


@needs_proc
def test_a_folder_renamed_into_place_has_every_file_on_the_disk_first(tmp_path, disk_events):
    """A checkpoint is a folder written in full, then renamed (checkpoint.save): each of its files and the
    folder itself are fsynced before the rename, the parent after it."""
    staging, final = tmp_path / ".step_000010.tmp", tmp_path / "step_000010"
    (staging / "sub").mkdir(parents=True)
    for name in ("model.safetensors", "trainer.pt", "sub/extra.json"):
        (staging / name).write_bytes(b"x")
    durable_replace(staging, final)
    renamed = disk_events.index(("replace", str(staging), str(final)))
    before = {path for _, path in disk_events[:renamed]}
    assert before == {str(staging / name) for name in ("model.safetensors", "trainer.pt", "sub/extra.json", "sub")} | {str(staging)}
    assert disk_events[renamed + 1:] == [("fsync", str(tmp_path))]
    assert (final / "sub/extra.json").read_bytes() == b"x" and not staging.exists()
