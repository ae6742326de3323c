"""Ops of our own in C++ (native_ops.cpp), built once per machine and torch: the engines' linears by key.

    from gpt2 import native_ops
    native_ops.load()     # the built library's path (built first, ~7 s, where absent); None where it cannot be

    python -c "from gpt2 import native_ops; print(native_ops.load())"     # build it now, or see why not

The engines' dynamic linears, fbgemm's fp16 GEMM (bf16's decode kernel where it reads fastest:
quantize.py, "fbgemm fp16") and fbgemm's and oneDNN's u8s8 GEMMs (int8's), hold their weights in
TorchScript objects. Called from Python, each call converts the object (~9 us of a 12.6 us call on a
64x64 weight), and a compiled step (AOTInductor's package, or torch.compile's graph), which cannot hold
the object, went through a Python custom op that looks it up by a key (quantize._Packed): ~21 us a call.
A 124M step makes 49 such calls against 150-200 us of GEMM each. gpt2_native::linear_dynamic(x, key,
out_features, reduce_range) does the lookup in C++ and calls the object's apply_dynamic, as
quantized::linear_dynamic and quantized::linear_dynamic_fp16 do: ~2 us a call from a package, 3.4 us
from Python, the same numbers bit for bit. No kernel of our own: the engines', without Python between.
quantize._Packed names each object here for as long as it lives (name_packed, forget_packed).

Built with $CXX (else c++, else g++) against this torch's headers and libraries, into
$XDG_CACHE_HOME/gpt2/native/ under a name holding the torch version and the source's digest, written
atomically (two processes building at once each write their own file, and one replaces the other's).
Where it cannot be built or loaded (no compiler, a torch without these headers), load() warns once and
returns None, and the calls go through Python as before (quantize's custom ops for compiled graphs).
GPT2_NATIVE_OPS=0 leaves the library alone (the Python paths serve).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from gpt2.atomic import durable_replace
from gpt2.user_cache import default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")


def native_directory() -> Path:
    """$XDG_CACHE_HOME/gpt2/native (default ~/.cache): the built libraries."""
    return default_cache_dir() / "native"


def library_path() -> Path:
    """Where this torch's build of SOURCE lives: named by the torch version and the source's digest."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return native_directory() / f"gpt2_native-torch{torch.__version__.replace('+', '-')}-{digest}.so"


_loaded: Path | None = None  # the library this process loaded


def loaded() -> Path | None:
    """The library this process has loaded (load), or None: what a compiled graph may call."""
    return _loaded


_loading = threading.Lock()  # two threads packing their first weights at once (a model and its draft) build once


def load() -> Path | None:
    """Builds (where absent) and loads the library, once per process: its path, or None with one warning."""
    with _loading:
        return _load_once()


@functools.cache
def _load_once() -> Path | None:
    global _loaded
    if os.environ.get("GPT2_NATIVE_OPS") == "0":
        return None
    path = library_path()
    try:
        if not hasattr(torch.ops.gpt2_native, "linear_dynamic"):  # a second library of one namespace aborts
            if not path.exists():
                _build(path)
            torch.ops.load_library(str(path))
        if not torch._C._dispatch_has_kernel_for_dispatch_key("gpt2_native::linear_dynamic", "Meta"):
            # its output's shape, for tracing: once a process
            torch.library.register_fake("gpt2_native::linear_dynamic")(_linear_dynamic_shape)
        _loaded = path
        return path
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("gpt2's C++ ops are not available (%s): the engines' dynamic linears are called through "
                    "Python, 10-20 us more a call", str(error).strip().splitlines()[-1] if str(error).strip() else error)
        return None


def _linear_dynamic_shape(x, key, out_features, reduce_range):
    return x.new_empty(x.size(0), out_features)  # (M, N) float32, as x


def _build(path: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler ($CXX, c++ or g++)")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
    command = [compiler, "-O2", "-std=c++20", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{p}" for p in include_paths()), str(SOURCE),
               *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-o", str(partial)]
    log.info("building gpt2's C++ ops into %s (once per machine and torch)", path)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        durable_replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)

