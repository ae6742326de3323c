"""native_ops: gpt2's ops in C++, built into the session's cache, against the ops they stand for."""

import gc
import logging

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


def packed_fp16(n: int, k: int, seed: int) -> quantize._Packed:
    torch.manual_seed(seed)
    return quantize._Packed(torch.ops.quantized.linear_prepack_fp16(torch.randn(n, k) * 0.05, None))


@fbgemm_fp16
def test_linear_fp16_in_cpp_is_fbgemms_gemm_on_the_weight_named(built):
    """The op in C++ returns what quantized::linear_dynamic_fp16 returns on the packed weight its key names,
    bit for bit, at 1, 8 and 64 rows; two weights of other keys are not confused."""
    a, b = packed_fp16(96, 64, 0), packed_fp16(96, 64, 1)
    a.rename("test native a")
    b.rename("test native b")
    for rows in (1, 8, 64):
        x = torch.randn(rows, 64)
        for packed in (a, b):
            expected = torch.ops.quantized.linear_dynamic_fp16(x, packed.obj)
            assert torch.equal(torch.ops.gpt2_native.linear_fp16(x, packed.key, 96), expected)
            assert torch.equal(quantize.linear_fp16_op(x, packed.key, 96), expected)  # the Python op, the same
    assert not torch.equal(torch.ops.gpt2_native.linear_fp16(x, a.key, 96), torch.ops.gpt2_native.linear_fp16(x, b.key, 96))


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
    assert torch.equal(torch.ops.gpt2_native.linear_fp16(x, "test native shared", 32), expected)
    second.rename("test native renamed")
    assert torch.equal(torch.ops.gpt2_native.linear_fp16(x, "test native renamed", 32), expected)
    with pytest.raises(RuntimeError, match="no packed fp16 weight named test native shared"):
        torch.ops.gpt2_native.linear_fp16(x, "test native shared", 32)
    del second
    gc.collect()
    with pytest.raises(RuntimeError, match="no packed fp16 weight named test native renamed"):
        torch.ops.gpt2_native.linear_fp16(x, "test native renamed", 32)
    third = packed_fp16(32, 64, 3)
    third.rename("test native width")
    with pytest.raises(RuntimeError, match="has 32 outputs, not 48"):
        torch.ops.gpt2_native.linear_fp16(x, "test native width", 48)


@fbgemm_fp16
def test_the_fp16_path_gives_the_same_numbers_with_and_without_the_op_in_cpp(built, monkeypatch):
    """quantize._fp16, eagerly, through the op in C++ and (where it could not be built) through fbgemm's own
    op from Python: the same bits, with the bias and GELU after."""
    packed = {"packed": packed_fp16(64, 32, 4), "out_features": quantize._Packed(64)}
    args, x, bias = quantize.path_args(packed), torch.randn(5, 32), torch.randn(64)
    through_cpp = quantize._fp16(x, args, bias, "gelu_tanh")
    monkeypatch.setattr(native_ops, "_loaded", None)
    assert torch.equal(quantize._fp16(x, args, bias, "gelu_tanh"), through_cpp)


def test_a_library_that_cannot_be_built_warns_once_and_leaves_the_python_op(monkeypatch, tmp_path, caplog):
    """No working compiler: load() returns None with one warning naming why, nothing is left in the cache
    (no partial file), and what this process loaded before stays as it was."""
    monkeypatch.setattr(native_ops, "native_directory", lambda: tmp_path / "native")
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    monkeypatch.setattr(native_ops, "_loaded", None)
    native_ops.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="gpt2.native_ops"):
            assert native_ops.load() is None
            assert native_ops.load() is None  # once a process
        warnings = [r for r in caplog.records if r.name == "gpt2.native_ops"]
        assert len(warnings) == 1 and "false failed" in warnings[0].getMessage(), warnings
        assert native_ops.loaded() is None
        assert not any((tmp_path / "native").iterdir())
    finally:
        native_ops.load.cache_clear()


def test_gpt2_native_ops_0_leaves_the_library_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(native_ops, "native_directory", lambda: tmp_path / "native")
    monkeypatch.setenv("GPT2_NATIVE_OPS", "0")
    monkeypatch.setattr(native_ops, "_loaded", None)
    native_ops.load.cache_clear()
    try:
        assert native_ops.load() is None and not (tmp_path / "native").exists()
    finally:
        native_ops.load.cache_clear()
