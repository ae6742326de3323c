"""user_cache.py: the cache directory, and its rebuildable parts kept within a size."""

import os

from gpt2.user_cache import default_cache_dir, drop_least_recently_used, mark_used


def test_least_recently_used_files_are_dropped_until_the_rest_fit(tmp_path):
    """drop_least_recently_used deletes oldest-mtime first until the files fit, never one used since the
    given time (even above the budget), and skips a file that vanished (another process pruning)."""
    files = []
    for i in range(5):  # 100 bytes each, used at t = 1000, 2000, ..., 5000
        path = tmp_path / f"entry-{i}"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 * (i + 1), 1000 * (i + 1)))
        files.append(path)
    vanished = tmp_path / "vanished"  # listed, but gone by the time it is read
    assert drop_least_recently_used([*files, vanished], max_bytes=300, used_since=10_000) == 200
    assert [p.exists() for p in files] == [False, False, True, True, True]
    mark_used(files[2])  # read now: the most recent
    assert drop_least_recently_used(files, max_bytes=100, used_since=4500) == 100  # 3 is dropped; 2 and 4 are in use
    assert [p.exists() for p in files] == [False, False, True, False, True]
    assert drop_least_recently_used(files, max_bytes=1000, used_since=0) == 0


def test_the_cache_directory_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "gpt2"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty counts as unset (the XDG spec)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "gpt2"
