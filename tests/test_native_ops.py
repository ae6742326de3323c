"""native_ops: gpt2's ops in C++, built into the session's cache, against the ops they stand for."""

import gc
import os
import subprocess
import sys

import pytest
import torch

from gpt2 import native_ops, quantize

fbgemm_fp16 = pytest.mark.skipif(not quantize._fp16_available(), reason="no fbgemm fp16 GEMM here")


@pytest.fixture(scope="module")
def built():
    path = native_ops.load()
    if path is None:
        pytest.skip("gpt2's C++ ops cannot be built here (no C++ compiler)")
    return path


def native(x, key, out_features, reduce_range=False):
    return torch.ops.gpt2_native.linear_dynamic(x, key, out_features, reduce_range)


def packed_fp16(n: int, k: int, seed: int) -> quantize._Packed:
    torch.manual_seed(seed)
    return quantize._Packed(torch.ops.quantized.linear_prepack_fp16(torch.randn(n, k) * 0.05, None))


@fbgemm_fp16
def test_the_op_in_cpp_is_fbgemms_fp16_gemm_on_the_weight_named(built):
    """The op in C++ returns what quantized::linear_dynamic_fp16 returns on the packed weight its key names,
    bit for bit, at 1, 8 and 64 rows, as the Python op of a compiled graph does; two weights of other keys
    are not confused."""
    a, b = packed_fp16(96, 64, 0), packed_fp16(96, 64, 1)
    a.rename("test native a")
    b.rename("test native b")
    for rows in (1, 8, 64):
        x = torch.randn(rows, 64)
        for packed in (a, b):
            expected = torch.ops.quantized.linear_dynamic_fp16(x, packed.obj)
            assert torch.equal(native(x, packed.key, 96), expected)
            assert torch.equal(quantize.linear_fp16_op(x, packed.key, 96), expected)  # the Python op, the same
    assert not torch.equal(native(x, a.key, 96), native(x, b.key, 96))


@pytest.mark.parametrize("engine", ["fbgemm", "onednn"])
def test_the_op_in_cpp_is_the_u8s8_engines_dynamic_linear(built, engine):
    """int8's u8s8 weights (quantize's own packing for each engine): the op in C++ returns what
    quantized::linear_dynamic returns, bit for bit, with reduce_range off and on (_int8_split's)."""
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"no {engine} engine here")
    torch.manual_seed(5)
    w, b = torch.randn(48, 64) * 0.05, torch.randn(48)
    packed = quantize._pack_int8_engine(engine)(w, b)
    args = quantize.path_args(packed)
    for rows in (1, 8):
        x = torch.rand(rows, 64)
        for reduce_range in (False, True):
            expected = torch.ops.quantized.linear_dynamic(x, args["packed"], reduce_range)
            assert torch.equal(native(x, args["packed_key"], 48, reduce_range), expected)


@fbgemm_fp16
def test_the_op_in_cpp_finds_a_weight_while_its_holder_lives_under_its_current_name(built):
    """Two holders of one key (two models of the same weights): the op reads either while one lives. A
    renamed holder is found under its new name only, and once every holder of a name is collected, the
    name is gone (the registry keeps no weight past its holder). An unknown key and a wrong output width
    are errors that say so."""
    x = torch.randn(2, 64)
    first, second = packed_fp16(32, 64, 2), packed_fp16(32, 64, 2)
    first.rename("test native shared")
    second.rename("test native shared")
    expected = torch.ops.quantized.linear_dynamic_fp16(x, second.obj)
    del first
    gc.collect()
    assert torch.equal(native(x, "test native shared", 32), expected)
    second.rename("test native renamed")
    assert torch.equal(native(x, "test native renamed", 32), expected)
    with pytest.raises(RuntimeError, match="no packed weight named test native shared"):
        native(x, "test native shared", 32)
    del second
    gc.collect()
    with pytest.raises(RuntimeError, match="no packed weight named test native renamed"):
        native(x, "test native renamed", 32)
    third = packed_fp16(32, 64, 3)
    third.rename("test native width")
    with pytest.raises(RuntimeError, match="has 32 outputs, not 48"):
        native(x, "test native width", 48)


@fbgemm_fp16
def test_the_fp16_path_gives_the_same_numbers_with_and_without_the_op_in_cpp(built, monkeypatch):
    """quantize._fp16, eagerly, through the op in C++ and (where it could not be built) through fbgemm's own
    op from Python: the same bits, with the bias and GELU after."""
    packed = {"packed": packed_fp16(64, 32, 4), "out_features": quantize._Packed(64)}
    args, x, bias = quantize.path_args(packed), torch.randn(5, 32), torch.randn(64)
    through_cpp = quantize._fp16(x, args, bias, "gelu_tanh")
    monkeypatch.setattr(native_ops, "_loaded", None)
    assert torch.equal(quantize._fp16(x, args, bias, "gelu_tanh"), through_cpp)


def load_in_a_new_process(tmp_path, **env) -> subprocess.CompletedProcess:
    """native_ops.load() twice in a process of its own (one loads one library: this one's is loaded), with
    XDG_CACHE_HOME=tmp_path: prints what it returned and what the cache holds."""
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
            "from gpt2 import native_ops\n"
            "print(native_ops.load(), native_ops.load(), native_ops.loaded())\n"
            "d = native_ops.native_directory(); print(sorted(p.name for p in d.iterdir()) if d.exists() else None)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env})


def test_a_library_that_cannot_be_built_warns_once_and_leaves_the_python_op(tmp_path):
    """No working compiler: load() returns None with one warning naming why, and nothing is left in the
    cache (no partial file)."""
    done = load_in_a_new_process(tmp_path, CXX="false")  # a "compiler" that fails
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["None None None", "[]"], done.stdout
    warnings = [line for line in done.stderr.splitlines() if "C++ ops are not available" in line]
    assert len(warnings) == 1 and "false failed" in warnings[0], done.stderr


def test_gpt2_native_ops_0_leaves_the_library_alone(tmp_path):
    done = load_in_a_new_process(tmp_path, GPT2_NATIVE_OPS="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["None None None", "None"] and "not available" not in done.stderr
