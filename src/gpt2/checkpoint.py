"""Training checkpoints: weights + JSON meta + optimizer, RNG and data-iterator state; atomic; resumable.

    from gpt2 import checkpoint
    path = checkpoint.save(run_dir, step, model, trainer_state, meta, keep_last=3)
    state = checkpoint.load(checkpoint.latest(run_dir))      # -> Checkpoint(path, meta, trainer_state)
    GPT.from_pretrained(run_dir)                               # the newest checkpoint's weights, via LATEST

A run directory holds one subdirectory per checkpoint and a LATEST file naming the newest:

    OUT/step_000200/gpt2.json           model config + meta (step, train config, ...): weights.save_native
    OUT/step_000200/model.safetensors   float32 master weights
    OUT/step_000200/trainer.pt          optimizer, RNG states, data-iterator state (tensors and plain
                                        Python values only; read back with torch.load(weights_only=True))
    OUT/LATEST                          "step_000200"

Writes are atomic: everything goes into a hidden temporary directory first, which is renamed into place
only when complete; LATEST is then replaced atomically. A failure half way (a full disk) leaves the
previous checkpoints and LATEST untouched, and the temporary directory is removed.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2.errors import CheckpointError
from gpt2.atomic import atomic_write_bytes, durable_replace
from gpt2.weights import LATEST_POINTER, NATIVE_META, newest_checkpoint, read_json, save_native

TRAINER_STATE = "trainer.pt"
STEP_DIR = re.compile(r"step_(\d+)")


@dataclass
class Checkpoint:
    path: Path
    meta: dict            # the gpt2.json contents: config, step, train_config, ...
    trainer_state: dict   # optimizer, rng, data


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first (a directory without gpt2.json is skipped)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir()
             if (m := STEP_DIR.fullmatch(p.name)) and (p / NATIVE_META).exists()]
    return [p for _, p in sorted(found)]


def latest(run_dir) -> Path | None:
    """The checkpoint LATEST names, or None when the run has none yet."""
    path = newest_checkpoint(Path(run_dir))
    if path == Path(run_dir):
        return None
    if not (path / NATIVE_META).exists() or not (path / TRAINER_STATE).exists():
        raise CheckpointError(f"{Path(run_dir) / LATEST_POINTER} names {path.name}, which is not a complete checkpoint")
    return path


def save(run_dir, step: int, model, trainer_state: dict, meta: dict, keep_last: int = 3) -> Path:
    """Write OUT/step_NNNNNN atomically, point LATEST at it, and keep only the newest keep_last."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / step_dirname(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=run_dir))
    try:
        # trainer.pt first, gpt2.json (inside save_native) last: its presence marks a complete checkpoint.
        atomic_write_bytes(tmp / TRAINER_STATE, lambda f: torch.save(trainer_state, f))
        save_native(model, tmp, meta={"step": step, **meta})
        if final.exists():  # re-saving a step (a resumed run): move the old one aside, then drop it
            old = run_dir / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            durable_replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            durable_replace(tmp, final)
        atomic_write_bytes(run_dir / LATEST_POINTER, lambda f: Path(f).write_text(final.name + "\n"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(run_dir, keep_last, keep=final)
    return final


def _prune(run_dir: Path, keep_last: int, keep: Path) -> None:
    if keep_last <= 0:
        return  # keep everything
    for path in list_checkpoints(run_dir)[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


def load(path) -> Checkpoint:
    """The meta and trainer state of one checkpoint directory (the weights load with weights.load_model)."""
    path = Path(path)
    meta = read_json(path / NATIVE_META)
    try:
        trainer_state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {TRAINER_STATE}; not a training checkpoint (cannot resume from it)") from None
    except Exception as e:  # corrupt zip, or an object weights_only refuses to unpickle
        raise CheckpointError(f"{path / TRAINER_STATE}: cannot be loaded ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})") from None
    return Checkpoint(path, meta, trainer_state)


# ---------------------------------------------------------------------------------------------
# RNG states, as tensors and plain values (weights_only-loadable)
# ---------------------------------------------------------------------------------------------

def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))


def to_storable(obj):
    """Numpy arrays and scalars -> tensors and Python numbers, recursively, so weights_only can load them."""
    if isinstance(obj, dict):
        return {k: to_storable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_storable(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.ascontiguousarray(obj)), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def from_storable(obj):
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            return obj["__ndarray__"].numpy().astype(obj["dtype"])
        return {k: from_storable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_storable(v) for v in obj)
    return obj
