"""Tests for the inference weight formats (quantize.py) and the measured kernel choice (kernels.py).

    .venv/bin/pytest tests/test_kernels.py -q

References: F.linear on the float32 weight for every float32 path (within 1e-5); for quantized paths,
a float64 product with weights dequantized here, independently of quantize.py's own reference
(within the rounding of the precision); the uncached `generate_naive` token for token at every precision.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time

import pytest
import torch
import torch.nn.functional as F

from gpt2 import GPT, GPTConfig
from gpt2.engine import generate, generate_naive
from gpt2.quantize import (CPU_FORMATS, INT4_GROUP, PRECISIONS, FastLinear, add_compile_weights, apply_plan,
                           format_named, formats_for, linear_layers,
                           quantize_int4_groups, quantize_per_channel)
from gpt2 import engine, kernels, native_ops, quantize
from gpt2.kv_cache import KVCache
from conftest import measure_busy_machines_as_gpt2_does


MEASURE_EFFECTIVE_CACHE = kernels.effective_cache_bytes


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path, monkeypatch):
    """Every test measures into its own cache file, never the user's. The cache the decode copies must
    exceed is set, not measured (a second per test; a tiny model's copies stop at 64 anyway)."""
    path = tmp_path / "kernels.json"
    monkeypatch.setattr(kernels, "default_cache_path", lambda: path)
    monkeypatch.setattr(kernels, "effective_cache_bytes", lambda: 32 * 1024 ** 2)
    return path


CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=300, n_positions=96)  # 300: not a multiple of 16
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [12, 13], [201, 2, 2, 40]]


def format_object(precision: str, name: str):
    """The format by name, whether or not this CPU offers it (format_named raises where it does not)."""
    return next(f for f in CPU_FORMATS if f.precision == precision and f.name == name)


def fake_clock(monkeypatch, seconds):
    """Every timing made up: seconds(path, copies, x), for a call of the path on those copies with rows x,
    for each layer _time_in_turn times (over cold copies, or over one warm copy)."""
    monkeypatch.setattr(kernels, "_time_in_turn", lambda path, turn, best_so_far, first_samples=None, readers=():
                        [seconds(path, copies, x) for copies, b, activation, x in turn])


# int8's u8s8 engines offered here (each alone, not the combined format): one that saturates is not
U8S8_ENGINES = [f.name for f in CPU_FORMATS if f.name.startswith("dynamic ") and not f.parts and f.available()]
# fbgemm's u8s8 engine, which some tests force: not offered where it saturates (no VNNI: an AVX2-only CPU)
FBGEMM_SATURATES = "fbgemm's u8s8 GEMM saturates on this CPU (quantize._u8s8_sums_exactly)"
FBGEMM_OFFERED = "dynamic fbgemm" in U8S8_ENGINES
needs_fbgemm = pytest.mark.skipif(not FBGEMM_OFFERED, reason=FBGEMM_SATURATES)
needs_a_u8s8_engine = pytest.mark.skipif(
    not U8S8_ENGINES, reason="no u8s8 engine sums exactly on this CPU (quantize._u8s8_sums_exactly)")


def tiny_model(seed=0, n_layer: int = CONFIG.n_layer):
    torch.manual_seed(seed)
    model = GPT(dataclasses.replace(CONFIG, n_layer=n_layer)).eval()
    with torch.no_grad():  # wider logits than the 0.02 init: greedy decoding has no near-ties
        for p in model.parameters():
            p.mul_(8) if p.dim() == 2 else None
    return model


def dequantized(precision: str, w: torch.Tensor) -> torch.Tensor:
    """The weights a quantized format computes with, in float64, from the quantizers' outputs."""
    if precision == "int8":
        q, s = quantize_per_channel(w)
        return q.double() * s.double()[:, None]
    q, sz = quantize_int4_groups(w)
    sz = sz.to(torch.bfloat16).double()  # the kernels read scales and zeros in bf16
    N, K = w.shape
    s = sz[..., 0].t().repeat_interleave(INT4_GROUP, dim=1)  # (N, K)
    z = sz[..., 1].t().repeat_interleave(INT4_GROUP, dim=1)
    return (q.double() - 8) * s + z


# --- quantizers ------------------------------------------------------------------------------

def test_int8_per_channel_error_is_half_a_step():
    w = torch.randn(64, 48) * torch.linspace(0.01, 3, 64)[:, None]  # very different row scales
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()


def test_int8_engines_pack_on_threads_at_once_and_leave_the_process_engine_alone():
    """Packing for fbgemm and for oneDNN sets the process-wide quantized engine for one call: two threads
    doing it at once (a model and its draft loading) must each pack what they asked for, and leave the
    engine as it was (unlocked, one thread restored its "previous" engine after the other had set its own),
    and Python's warning filters too (catch_warnings on two threads at once left a filter behind)."""
    import warnings
    from concurrent.futures import ThreadPoolExecutor
    engines = U8S8_ENGINES
    if len(engines) < 2:
        pytest.skip("needs both u8s8 engines (one saturates on this CPU: quantize._u8s8_sums_exactly)")
    w = torch.randn(96, 64) * 0.02
    x = torch.randn(3, 64)
    before, filters = torch.backends.quantized.engine, list(warnings.filters)

    def pack(name):
        fmt = format_named("int8", name)
        return [fmt.pack(w, None) for _ in range(100)]

    with ThreadPoolExecutor(len(engines)) as pool:
        packed = dict(zip(engines, pool.map(pack, engines)))
    assert torch.backends.quantized.engine == before
    assert warnings.filters == filters
    for name, copies in packed.items():  # each copy computes what one packed alone on this thread does
        alone = torch.ops.quantized.linear_dynamic(x, format_named("int8", name).pack(w, None)["packed"].obj)
        assert all(torch.equal(torch.ops.quantized.linear_dynamic(x, t["packed"].obj), alone) for t in copies), name


def _int4_min_max_groups(w: torch.Tensor) -> torch.Tensor:
    """The plain int4 quantizer, in float64: 16 levels over each group's [min, max], nearest level."""
    g = w.double().view(w.size(0), -1, INT4_GROUP)
    lo, s = g.amin(-1, keepdim=True), (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
    return (((g - lo) / s).round() * s + lo).view(w.shape)


def test_int4_groups_search_their_levels_and_round_to_the_nearest():
    """Each weight sits at its nearest level of its group (within half a step, where it lies among the
    levels); no group's |w|-weighted squared error exceeds the plain [min, max] levels' (the search
    includes them), and over Gaussian weights the search lowers it below 0.86x (the unweighted search
    gave 0.91x) and the plain squared error below 0.9x. Rows are quantized on their own."""
    torch.manual_seed(0)
    w = torch.randn(40, 4 * INT4_GROUP) * torch.linspace(0.01, 3, 40)[:, None]
    q, sz = quantize_int4_groups(w)
    assert q.min() >= 0 and q.max() <= 15 and sz.shape == (4, 40, 2)
    step = sz[..., 0].t().double().repeat_interleave(INT4_GROUP, dim=1)  # (N, K)
    zero = sz[..., 1].t().double().repeat_interleave(INT4_GROUP, dim=1)
    exact = (q.double() - 8) * step + zero
    among_levels = ((w.double() - zero) / step + 8 - 7.5).abs() <= 8  # within [-0.5, 15.5] levels
    assert ((exact - w).abs() <= step / 2 * (1 + 1e-6))[among_levels].all()
    searched = (w.abs() * (exact - w).pow(2)).view(40, 4, INT4_GROUP).sum(-1)
    plain = (w.abs() * (_int4_min_max_groups(w) - w).pow(2)).view(40, 4, INT4_GROUP).sum(-1)
    assert (searched <= plain * 1.01).all()  # 1%: s and z rounded to bf16
    gaussian = torch.randn(256, 768) * 0.02
    q, sz = quantize_int4_groups(gaussian)
    s, z = (sz[..., i].t().double().repeat_interleave(INT4_GROUP, dim=1) for i in (0, 1))
    error, min_max_error = (q.double() - 8) * s + z - gaussian, _int4_min_max_groups(gaussian) - gaussian
    weighted = (gaussian.abs() * error.pow(2)).sum() / (gaussian.abs() * min_max_error.pow(2)).sum()
    assert weighted < 0.86, weighted
    assert error.pow(2).sum() / min_max_error.pow(2).sum() < 0.9
    q_rows, sz_rows = quantize_int4_groups(gaussian[100:103])
    assert q_rows.equal(q[100:103]) and sz_rows.equal(sz[:, 100:103])


def test_int4_cache_returns_the_search_and_recovers_from_a_damaged_entry(tmp_path, monkeypatch, caplog):
    """quantize_int4_groups_cached gives quantize_int4_groups' q and scales_zeros bit for bit, from one
    entry per distinct weight; it reads that entry back on the next call (an entry of other values
    written there is what it returns); a truncated entry, a flipped byte, another shape's entry or an
    unwritable directory each cost one warning and give the search's own result, the entry rewritten."""
    directory = tmp_path / "int4"
    monkeypatch.setattr(quantize, "int4_cache_directory", lambda: directory)
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.02
    expected = quantize_int4_groups(w)
    got = quantize.quantize_int4_groups_cached(w)
    assert got[0].equal(expected[0]) and got[1].equal(expected[1])
    [entry] = directory.rglob("*.safetensors")
    assert quantize.quantize_int4_groups_cached(w.clone())[0].equal(expected[0])
    assert list(directory.rglob("*.safetensors")) == [entry]
    quantize.quantize_int4_groups_cached(w * 2)  # other weights, another entry
    assert len(list(directory.rglob("*.safetensors"))) == 2

    planted = torch.full_like(expected[0], 3), expected[1] * 2
    quantize._write_int4_entry(entry, *planted)
    got = quantize.quantize_int4_groups_cached(w)
    assert got[0].equal(planted[0]) and got[1].equal(planted[1]), "the entry is read, not the search rerun"

    good = entry.read_bytes()
    flipped = bytearray(good)
    flipped[-100] ^= 0x10  # inside the payload: the file still parses
    damaged = {"truncated": good[: len(good) // 2], "flipped byte": bytes(flipped)}
    for why, content in damaged.items():
        entry.write_bytes(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gpt2.quantize"):
            got = quantize.quantize_int4_groups_cached(w)
        assert got[0].equal(expected[0]) and got[1].equal(expected[1]), why
        assert sum("ignoring the int4 cache entry" in r.message for r in caplog.records) == 1, why
        assert quantize._read_int4_entry(entry, 64, 128)[0].equal(expected[0]), why  # rewritten
    quantize._write_int4_entry(entry, *quantize_int4_groups(w[:32]))  # a 32-row weight's entry in its place
    with pytest.raises(ValueError, match="not an int4 entry for a 64x128 weight"):
        quantize._read_int4_entry(entry, 64, 128)
    assert quantize.quantize_int4_groups_cached(w)[0].equal(expected[0])

    monkeypatch.setattr(quantize, "int4_cache_directory", lambda: tmp_path / "a file")
    (tmp_path / "a file").write_text("not a directory")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpt2.quantize"):
        got = quantize.quantize_int4_groups_cached(w)
    assert got[0].equal(expected[0]) and any("could not write the int4 cache" in r.message for r in caplog.records)


def test_an_int4_model_loads_again_from_the_cache_with_the_same_logits(tmp_path, monkeypatch):
    """Loading at int4 writes one entry per block weight; the second load adds none and computes the same
    logits; a checkpoint with one weight changed adds one entry."""
    directory = tmp_path / "int4"
    monkeypatch.setattr(quantize, "int4_cache_directory", lambda: directory)
    model = tiny_model()
    model.save_pretrained(tmp_path / "model")
    ids = torch.tensor([PROMPTS[0]])
    kernels.plan_for(model, "int4")  # the measurement's own (random) weights' entries first
    measured = set(directory.rglob("*.safetensors"))
    with torch.inference_mode():
        first = quantize.load_for_inference(tmp_path / "model", "int4")(ids)
        entries = sorted(directory.rglob("*.safetensors"))
        assert len(set(entries) - measured) == 4 * CONFIG.n_layer  # c_attn, c_proj, c_fc, c_proj (lm_head: int8)
        second = quantize.load_for_inference(tmp_path / "model", "int4")(ids)
        assert sorted(directory.rglob("*.safetensors")) == entries
        assert second.equal(first)
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, 0] += 0.5
        model.save_pretrained(tmp_path / "model")
        quantize.load_for_inference(tmp_path / "model", "int4")
        assert len(list(directory.rglob("*.safetensors"))) == len(entries) + 1


def test_an_int4_load_drops_the_least_recently_used_entries_but_its_own(tmp_path, monkeypatch):
    """Each int4 load keeps the cache within INT4_CACHE_BYTES, dropping the entries used longest ago; the
    entries it reads count as used (their mtime touched), so its own stay even above the budget."""
    import os
    directory = tmp_path / "int4"
    monkeypatch.setattr(quantize, "int4_cache_directory", lambda: directory)
    tiny_model().save_pretrained(tmp_path / "model")
    tiny_model(seed=2).save_pretrained(tmp_path / "other")
    kernels.plan_for(tiny_model(), "int4")  # the measurement's own (random) weights' entries first
    measured = set(directory.rglob("*.safetensors"))
    quantize.load_for_inference(tmp_path / "model", "int4")
    own = set(directory.rglob("*.safetensors")) - measured
    for path in own:  # used long ago
        os.utime(path, (1e9, 1e9))
    quantize.load_for_inference(tmp_path / "other", "int4")  # within the budget: nothing dropped
    others = set(directory.rglob("*.safetensors")) - own - measured
    assert len(others) == len(own) and all(path.stat().st_mtime > 1e9 for path in others)
    for path in others | measured:  # used a while ago (the last seconds count as in use: MTIME_SLACK_SECONDS)
        os.utime(path, (1.5e9, 1.5e9))
    monkeypatch.setattr(quantize, "INT4_CACHE_BYTES", 1)
    quantize.load_for_inference(tmp_path / "model", "int4")  # reads its entries back, drops the rest
    assert set(directory.rglob("*.safetensors")) == own
    assert all(path.stat().st_mtime > 1e9 for path in own)


def test_int4pack_dequantize_reads_the_kernels_own_layout_exactly():
    """The bf16 weight read back from _weight_int4pack_mm_for_cpu's packed form is (q - 8) s + z of
    every element (computed independently here), and the kernel's own product with the identity
    agrees with it: the layout assumption is the kernel's. Read back in float32 ("dequant fp32"), it is
    (q - 8) s + z within one float32 rounding: (q - 8) s, a 4-bit integer times a bf16, is exact. Written
    into a (K, N) buffer (out=, as the dequant paths call it: from a buffer of levels the thread keeps), it
    is the same weight bit for bit, twice over (the levels' buffer reused)."""
    from gpt2.quantize import int4pack_dequantize
    torch.manual_seed(0)
    N, K = 192, 128
    w = torch.randn(N, K)
    fmt = format_named("int4", "int4pack")
    t_packed = fmt.pack(w, None)
    t = quantize.path_args(t_packed)
    back = int4pack_dequantize(t["int4pack"], t["scales_zeros_padded"])
    assert back.dtype == torch.bfloat16
    torch.testing.assert_close(back.double(), dequantized("int4", w).to(torch.bfloat16).double(), rtol=0, atol=0)
    back32 = int4pack_dequantize(t["int4pack"], t["scales_zeros_padded"], torch.float32)
    assert back32.dtype == torch.float32
    exact = dequantized("int4", w)
    assert ((back32.double() - exact).abs() <= 2 ** -24 * exact.abs()).all()
    for dtype, whole in ((torch.bfloat16, back), (torch.float32, back32)):
        for _ in range(2):
            buffer = torch.full((K, whole.size(0)), float("nan"), dtype=dtype)
            into = int4pack_dequantize(t["int4pack"], t["scales_zeros_padded"], dtype, out=buffer)
            assert into.data_ptr() == buffer.data_ptr() and torch.equal(into, whole)
    eye = torch.eye(K, dtype=torch.bfloat16)
    kernel_view = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, t["int4pack"], INT4_GROUP, t["scales_zeros_padded"])
    torch.testing.assert_close(kernel_view.t().double(), back.double(), rtol=2 ** -8, atol=1e-6)


def test_a_call_takes_the_path_of_its_regime():
    """FastLinear dispatches on the rows of a call: 1 decode, 2-32 batch, 33-127 short (timed at 64),
    128-255 prefill (timed at 128), from 256 long (timed at 512); each row count the regime is timed at
    falls inside it."""
    from gpt2 import quantize
    ran = []

    def path_for(regime):
        def path(x, t, b, a):
            ran.append(regime)
            return F.linear(x, t["weight"], b)
        return path
    fmt = quantize.WeightFormat("probe", "float32", lambda w, b: {"weight": w}, quantize._plain_reference,
                                {r: path_for(r) for r in quantize.REGIMES})
    layer = FastLinear(fmt, torch.randn(8, 4), None, {r: r for r in quantize.REGIMES})
    expected = {1: "decode", 2: "batch", 32: "batch", 33: "short", 127: "short", 128: "prefill", 255: "prefill",
                256: "long", 600: "long"}
    for rows, regime in expected.items():
        layer(torch.randn(1, rows, 4))
        assert ran[-1] == regime, f"{rows} rows ran {ran[-1]}, not {regime}"
    assert all(quantize.regime_of(n) == r for r, n in kernels.ROWS.items())


def test_a_path_that_cannot_read_a_shape_is_rejected_with_its_reason():
    """int4pack's dequant path reads blocks of 64 rows (32 on an AVX2 CPU); for 80 rows measure_shape
    rejects it, names why, and keeps the int4 kernel for every regime."""
    from gpt2.quantize import int4pack_layout
    choice = kernels.measure_shape("int4", 80, 64, None)
    assert f"blocks of {int4pack_layout()[0]} rows" in choice.rejected["int4pack/dequant bf16"]
    assert set(choice.paths.values()) == {"int4pack_mm"}



CPU_LIMITS = {  # environment -> what the probes must find: the ISA libraries see is narrowed, not emulated
    "ATEN_CPU_CAPABILITY=avx2": "int4pack_layout() == (32, 'halves')",
    "ATEN_CPU_CAPABILITY=default": "int4pack_layout() == (32, 'pairs')",
    "ONEDNN_MAX_CPU_ISA=AVX2": ("not onednn_runs(torch.bfloat16) and onednn_runs(torch.float32) "
                                "and not _u8s8_sums_exactly('onednn') "
                                "and 'onednn' not in {f.name for f in formats_for('bfloat16', 'cpu')} "
                                "and 'dynamic onednn' not in {f.name for f in formats_for('int8', 'cpu')}"),
}


@pytest.mark.parametrize("limit", CPU_LIMITS)
def test_what_a_cpu_without_avx512_can_run_is_probed_not_assumed(limit):
    """On an AVX2 CPU ATen packs int4 in blocks of 32 rows (without AVX2, in pairs of rows), oneDNN has
    no bf16 linear, and oneDNN's u8s8 kernel saturates (quantize._u8s8_sums_exactly): each is probed,
    so such a CPU reads its own int4 layout exactly and is never offered a kernel it cannot run right.
    Each runs in a process whose ISA is narrowed, with the layout test of this file where it applies."""
    import os
    import subprocess
    import sys
    name, value = limit.split("=")
    env = {**os.environ, name: value}
    probe = ("import torch; from gpt2.quantize import _u8s8_sums_exactly, formats_for, int4pack_layout, onednn_runs; "
             f"assert {CPU_LIMITS[limit]}")
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    if name == "ATEN_CPU_CAPABILITY":
        test = f"{__file__}::test_int4pack_dequantize_reads_the_kernels_own_layout_exactly"
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                                env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-2000:]

# --- every path against its reference ---------------------------------------------------------

ROWS = (1, 8, 40, 150, 300)  # decode, batch, short, prefill and long regimes


@pytest.mark.parametrize("fmt", [f for f in CPU_FORMATS if f.available()], ids=lambda f: f"{f.precision}-{f.name}")
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_every_path_matches_its_reference(fmt, activation):
    torch.manual_seed(0)
    N, K = 128, 64  # N a multiple of 64: int4pack's "dequant bf16" reads the kernel's blocks of 64 rows
    w, b = torch.randn(N, K) * 0.1, torch.randn(N) * 0.1
    tensors_packed = fmt.pack(w, b)
    tensors = quantize.path_args(tensors_packed)
    for name, path in fmt.paths.items():
        for rows in (1,) if name in fmt.one_row_paths else ROWS:
            if fmt.precision == "float32":  # fused or packed float32: the plain product within 1e-5
                x = torch.randn(rows, K)
                ref = F.linear(x, w, b)
                if activation:
                    ref = F.gelu(ref, approximate="tanh")
                out = path(x, tensors, b, activation)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"{name} at {rows} rows")
                continue
            x = torch.randn(rows, K).to(torch.bfloat16)
            wq = w.double() if fmt.precision == "bfloat16" else dequantized(fmt.precision, w)
            if fmt.precision == "bfloat16":
                wq = w.to(torch.bfloat16).double()
            bb = b.to(torch.bfloat16)
            exact = x.double() @ wq.t() + bb.double()
            # bf16 output rounding (2^-8 relative) of a sum of products; the dynamic paths also round x
            # to levels over each row's range, at most [-max, max].
            bound = 2 ** -7 * (x.double().abs() @ wq.abs().t() + bb.double().abs())
            if name in fmt.activation_levels:  # per token: half a step of each row's levels
                levels = fmt.activation_levels[name]
                bound += x.double().abs().amax(dim=1, keepdim=True) / (levels - 1) * wq.abs().sum(1)
            if activation:
                exact = F.gelu(exact, approximate="tanh")
                bound = 1.13 * bound + 2 ** -7 * exact.abs()
            out = path(x, tensors, bb, activation).double()
            assert out.shape == exact.shape
            excess = ((out - exact).abs() - bound).max().item()
            assert excess <= 1e-6, f"{fmt.name}/{name} at {rows} rows: error exceeds the bound by {excess}"


@pytest.mark.parametrize("fmt", [f for f in CPU_FORMATS if f.available() and f.precision == "int8"
                                 and any(name.endswith("per row") for name in f.paths)], ids=lambda f: f.name)
def test_int8_per_token_paths_quantize_each_row_by_its_own_range(fmt):
    """A per-token u8s8 path quantizes each row of a many-row call by the row's own min and max: a row's
    output does not depend on the rows beside it (a sequence's logits, on the batch it decodes in), and
    is within half a step of its own range's 255 levels. Rows scaled to max |x| = 1 shared one range,
    which the other rows set."""
    torch.manual_seed(0)
    N, K = 128, 64
    w, b = torch.randn(N, K) * 0.1, torch.randn(N) * 0.1
    tensors_packed = fmt.pack(w, b)
    tensors = quantize.path_args(tensors_packed)
    row = torch.randn(1, K) * 0.3 + 1.5  # all positive
    beside = [torch.randn(7, K) * 0.3 + 1.5, torch.randn(7, K) - 1.5]  # the same kind; mostly negative
    exact = row.double() @ dequantized("int8", w).t() + b.double()
    bound = (row.max() - row.min()).item() / 2 / 255 * dequantized("int8", w).abs().sum(1)
    for name in [name for name in fmt.paths if name.endswith("per row")]:
        path = fmt.paths[name]
        first, second = (path(torch.cat([row, rows]), tensors, b, None)[0] for rows in beside)
        assert torch.equal(first, second), name
        excess = ((first.double() - exact).abs() - 1.001 * bound).max().item()
        assert excess <= 1e-5, f"{name}: error exceeds half a step of the row's range by {excess}"


@pytest.mark.skipif(not format_object("bfloat16", "fbgemm fp16").available(), reason="no fbgemm fp16 GEMM here")
def test_fp16_format_holds_the_bf16_weights_and_refuses_what_float16_cannot():
    """fbgemm's fp16 format: bf16 weights of magnitude 2^-14 to 65,504 are held exactly (read back from the
    packing, as engine.quantized_copy reads a layer), the tiniest round to float16's subnormal grid, and a
    weight float16 cannot hold is refused with an error naming the format, not packed as inf."""
    from gpt2.errors import ConfigError
    fmt = format_object("bfloat16", "fbgemm fp16")
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.05
    # 65,280: bf16's largest value below float16's 65,504
    w[0, :8] = torch.tensor([2.0 ** -14, -(2.0 ** -14), 1000.0, 3e-6, 1e-9, 0.0, 65280.0, -1.5])
    tensors_packed = fmt.pack(w, None)
    tensors = quantize.path_args(tensors_packed)  # as a layer's paths read them: the objects and their keys
    read_back, bf16 = fmt.reference_weight(None, tensors), w.to(torch.bfloat16).double()
    assert torch.equal(read_back, fmt.reference_weight(w, tensors))
    normal = bf16.abs() >= 2.0 ** -14
    assert torch.equal(read_back[normal], bf16[normal]) and (read_back - bf16).abs().max() <= 2.0 ** -25
    x = torch.randn(3, 64)
    torch.testing.assert_close(fmt.paths["fbgemm fp16"](x, tensors, None, None).double(), x.double() @ read_back.t(),
                               rtol=1e-5, atol=1e-4)
    w[1, 1] = 70000.0
    with pytest.raises(ConfigError, match="float16's range"):
        fmt.pack(w, None)


@pytest.mark.skipif(not quantize._u8s8_sums_exactly("fbgemm", reduce_range=True),
                    reason="fbgemm's u8s8 GEMM saturates even at 7 bits on this CPU")
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_split_path_quantizes_each_row_to_14_bits(rows):
    """_int8_split (the "fbgemm 7-bit" format's path, offered where 8 bits saturate; tested wherever 7 bits
    do not) is within half a step of 2^14 - 1 levels over each row's own range, with an outlier column as
    GPT-2's activations have, and with the bias and GELU. The bound is tight enough to fail if the low 7
    bits were lost (x to 7 bits a row)."""
    torch.manual_seed(0)
    N, K = 96, 256
    w, b = torch.randn(N, K) * 0.1, torch.randn(N) * 0.1
    tensors_packed = quantize._pack_int8_engine("fbgemm")(w, b)
    tensors = quantize.path_args(tensors_packed)
    x = torch.randn(rows, K)
    x[:, 7] *= 40  # an outlier column: a wide range per row
    wq = dequantized("int8", w)
    span = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)).double()
    half_step = span / 2 / quantize.SPLIT_LEVELS * wq.abs().sum(1) + 1e-6 * (x.double().abs() @ wq.abs().t())
    for activation in (None, "gelu_tanh"):
        exact = x.double() @ wq.t() + b.double()
        y = quantize._int8_split(x, tensors, b, activation).double()
        bound = half_step if activation is None else 1.13 * half_step
        if activation:
            exact = F.gelu(exact, approximate="tanh")
        assert ((y - exact).abs() - bound).max() <= 1e-6, activation
    # the same rows to 7 bits: outside the bound
    low = x.amin(1, keepdim=True)
    coarse = low + (x - low).mul(127 / span.float()).round() * (span.float() / 127)
    assert ((coarse.double() @ wq.t() + b.double() - (x.double() @ wq.t() + b.double())).abs() - half_step).max() > 0


@pytest.mark.parametrize("path, dtype", [("dequant bf16", torch.bfloat16), ("dequant fp32", torch.float32)])
def test_int4_dequantized_in_blocks_of_rows_equals_the_whole(monkeypatch, path, dtype):
    """int4pack's "dequant bf16" and "dequant fp32" dequantize DEQUANT_BLOCK[dtype] weights at a time into
    one buffer a thread keeps (quantize._dequant_buffer), then run one GEMM. Three blocks of 64 rows give
    the weight one block over the whole does, element by element: the same outputs, bit for bit, with
    the bias and GELU. The buffer, refilled in between by another layer of the same shape (which gets its
    own outputs: no kernel keeps a weight by its address), computes the first one's outputs again; and
    they are the float64 product of the weights it dequantized (int4pack_dequantize, checked against the
    kernel's own in the test above) within bf16's rounding of each output."""
    from gpt2 import quantize
    torch.manual_seed(0)
    N, K = 192, 64  # read in 3 blocks of 64 rows (a width that is not a multiple of 64 rejects the path)
    w, b = torch.randn(N, K) * 0.1, (torch.randn(N) * 0.1).to(torch.bfloat16)
    fmt = format_named("int4", "int4pack")
    t_packed = fmt.pack(w, b.float())
    t = quantize.path_args(t_packed)
    other_packed = fmt.pack(torch.randn(N, K), None)
    other = quantize.path_args(other_packed)  # same shape, same buffer
    x = torch.randn(300, K).to(torch.bfloat16)
    for activation in (None, "gelu_tanh"):
        whole = fmt.paths[path](x, t, b, activation)
        monkeypatch.setitem(quantize.DEQUANT_BLOCK, dtype, 64 * K)
        blocks = fmt.paths[path](x, t, b, activation)
        monkeypatch.undo()
        other_y = fmt.paths[path](x, other, None, None)  # another layer through the same buffer
        again = fmt.paths[path](x, t, b, activation)
        other_w = quantize.int4pack_dequantize(other["int4pack"], other["scales_zeros_padded"], dtype)
        torch.testing.assert_close(other_y.double(), x.double() @ other_w.double().t(), rtol=2 ** -7, atol=1e-3)
        assert whole.dtype == blocks.dtype == again.dtype == torch.bfloat16
        assert blocks.shape == whole.shape == (300, N)
        assert torch.equal(blocks, whole) and torch.equal(again, whole)
        weight = quantize.int4pack_dequantize(t["int4pack"], t["scales_zeros_padded"], dtype)  # (N, K)
        exact = x.double() @ weight.double().t() + b.double()  # (300, N)
        if activation:
            exact = F.gelu(exact, approximate="tanh")
        torch.testing.assert_close(whole.double(), exact, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("path", ["dequant bf16", "dequant fp32"])
def test_int4_dequant_paths_export_for_a_packaged_step_of_many_rows(path):
    """A packaged decode step of 33+ rows (engine.PackagedDecodeStep) takes a layer's "short" path, which a
    plan may make int4's dequant path: torch.export traces it, its decompositions run (functionalized, as
    AOTInductor runs them), and the exported layer computes what the eager one does. Eagerly the path writes
    into a buffer its thread keeps, through a permuted view; a graph may not mutate a tensor from outside it
    (AOTInductor: "mutating a non-functional tensor"), so there it dequantizes into its own, without out=.
    torch.compile's graph (the engine's fallback) too: the packing's layout, probed eagerly, is a constant."""
    from gpt2.quantize import FastLinear
    torch.manual_seed(0)
    w, b = torch.randn(192, 64) * 0.1, torch.randn(192) * 0.1
    layer = FastLinear(format_named("int4", "int4pack"), w, b, dict.fromkeys(kernels.REGIMES, path), "gelu_tanh")
    x = torch.randn(40, 64)
    with torch.inference_mode():  # as the engine exports a step (engine.PackagedDecodeStep)
        eager = layer(x)
        traced = torch.export.export(layer, (x,), strict=False).run_decompositions().module()(x)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)(x)  # the engine's fallback: the layout read as a constant
    for y in (traced, compiled):
        assert y.dtype == eager.dtype
        torch.testing.assert_close(y.float(), eager.float(), rtol=2 ** -7, atol=1e-3)  # bf16 outputs


def test_int4_pads_an_output_width_that_is_not_a_multiple_of_16():
    fmt = next(f for f in formats_for("int4") if f.name == "int4pack")
    w = torch.randn(50, 64)
    tensors_packed = fmt.pack(w, None)
    tensors = quantize.path_args(tensors_packed)
    out = fmt.paths["int4pack_mm"](torch.randn(3, 64).to(torch.bfloat16), tensors, None, None)
    assert out.shape == (3, 50)


# --- whole models ------------------------------------------------------------------------------

def test_float32_plan_matches_the_plain_model():
    model = tiny_model()
    fast = apply_plan(tiny_model(), kernels.plan_for(model, "float32"))
    assert all(isinstance(fast.transformer.h[0].mlp.c_fc, FastLinear) for _ in [0])
    ids = torch.tensor([PROMPTS[0] * 8])  # 56 rows: the prefill regime; decode below
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert generate(fast, PROMPTS, max_new_tokens=20) == generate(model, PROMPTS, max_new_tokens=20)


def packed_state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, oneDNN's packed tensors read back to plain ones, and MKL's as the weight
    it holds: read back whole, its packing's padding is bytes left unset, which differ from pack to pack."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    state = {name: t.to_dense() if t.is_mkldnn else t for name, t in tensors.items() if t is not None}
    for name, module in model.named_modules():
        if isinstance(module, FastLinear) and "mkl" in module.tensors:
            state[f"{name}.mkl"] = module.reference_weight()
    return state


@pytest.mark.parametrize("precision", PRECISIONS)
def test_loading_packs_each_layer_as_it_is_read_as_apply_plan_packs_a_loaded_model(tmp_path, precision):
    """load_for_inference packs each linear as soon as the loader has read it; apply_plan packs a model
    loaded whole. Under one plan both must hold the same layers and tensors, and give the same logits."""
    from conftest import save_hf_model
    from gpt2.quantize import load_for_inference
    save_hf_model(tmp_path / "m", n_embd=64, n_head=4)  # int4 groups of 32 along n_embd
    streamed = load_for_inference(tmp_path / "m", precision, "cpu")
    whole = GPT.from_pretrained(tmp_path / "m")
    whole = apply_plan(whole, kernels.plan_for(whole, precision))  # the plan streamed measured: cached
    assert repr(streamed) == repr(whole)  # formats, paths, fused GELU and the MLP's act made Identity
    assert not streamed.training and streamed.lm_head.format.precision == whole.lm_head.format.precision
    a, b = packed_state(streamed), packed_state(whole)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ids = torch.tensor([PROMPTS[0] * 4]) % streamed.config.vocab_size
    with torch.inference_mode():
        assert torch.equal(streamed(ids), whole(ids))


@pytest.mark.parametrize("fmt", [f for f in formats_for("bfloat16") if f.name in ("onednn", "plain")],
                         ids=lambda f: f.name)
def test_bf16_logits_around_a_large_offset_are_as_exact_as_the_weights_allow(fmt):
    """GPT-2's logits share a large negative offset; a bf16 kernel rounds its output to bf16: by up to
    0.125 at |logit| 32-64. A centered lm_head (quantize.CENTERED_LOGITS) computes each row around an
    estimate of its largest logit and adds that back in float32. Against the float64 product of the bf16
    weights and inputs, at every regime and path: the logits within 4 of their row's largest (those
    that carry the probability) within 0.02, all within 0.07, where the plain kernel is off by more
    than 0.06. Its weight reads back without the offset column."""
    torch.manual_seed(0)
    N, K = 4096, 64
    w = torch.randn(N, K) * 0.3
    w[:, 0] = -60.0  # with x[:, 0] = 1 below: every logit near -60, as GPT-2's are
    for rows in (1, 8, 64, 128, 512):
        x = torch.randn(rows, K)
        x[:, 0] = 1.0
        exact = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()  # (rows, N)
        for path in fmt.paths:
            centered = FastLinear(fmt, w, None, {r: path for r in kernels.REGIMES}, centers_logits=True)
            plain = FastLinear(fmt, w, None, {r: path for r in kernels.REGIMES})
            with torch.inference_mode():
                y, y_plain = centered(x), plain(x)
            assert y.dtype == torch.float32 and y.shape == (rows, N)
            error, plain_error = (y.double() - exact).abs(), (y_plain.double() - exact).abs()
            top = exact >= exact.amax(dim=1, keepdim=True) - 4  # the logits that carry the probability
            assert error[top].max() < 0.02 and error.max() < 0.07, (rows, path)
            if path != "fp32 GEMM":  # a bf16 kernel rounds its output to bf16: what centering fixes
                assert plain_error[top].max() > 0.06, (rows, path)
    assert torch.equal(centered.reference_weight(), w.to(torch.bfloat16).double())


@pytest.mark.autotune
@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="Inductor's bf16 GEMM template")
def test_a_compiled_bf16_lm_head_gives_its_float32_accumulator():
    """A bf16 model compiles without emulating roundings (engine.compile_options: no layer rounds on
    purpose), so where Inductor's own GEMM computes the centered lm_head, its logits come from the float32
    accumulator: within 1e-6 of the float64 product of the bf16 weights and inputs, where eager's are
    bf16 numbers around the offset. The offset added back is the one the kernel took (it had added the
    unrounded estimate back: each row shifted by up to 2^-9 of it). Only Inductor's GEMM here: autotuning
    may pick oneDNN's, which rounds as eager does. int8, whose c_attn rounds on purpose, still emulates."""
    torch.manual_seed(0)
    N, K = 4096, 64
    w = torch.randn(N, K) * 0.3
    w[:, 0] = -60.0  # with x[:, 0] = 1 below: every logit near -60, as GPT-2's are

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = FastLinear(format_named("bfloat16", "onednn"), w, None,
                                      {r: "onednn" for r in kernels.REGIMES}, centers_logits=True)

        def forward(self, x):
            return self.lm_head(x)
    head = Head().eval()
    options = {**engine.compile_options(head, "cpu"), "max_autotune_gemm_backends": "CPP"}
    assert not options["emulate_precision_casts"]
    int8 = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "int8"))
    assert engine.compile_options(int8, "cpu")["emulate_precision_casts"]
    for rows in (1, 8):
        x = torch.randn(rows, K)
        x[:, 0] = 1.0
        exact = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()  # (rows, N)
        torch._dynamo.reset()
        with torch.inference_mode(), engine._inductor_config().patch(options):
            compiled, eager = torch.compile(head)(x), head(x)
        assert ((compiled.double() - exact).abs().max() / exact.abs().max()).item() < 1e-6, rows
        assert ((eager.double() - exact).abs().max() / exact.abs().max()).item() > 1e-4, rows  # rounded


@pytest.mark.autotune
@pytest.mark.slow
def test_a_float32_gemm_feeding_a_bf16_kernel_compiles_to_eagers_tokens():
    """A bf16 plan that multiplies c_fc in float32 at batch (bfloat16's "fp32 GEMM": an AMD EPYC Zen 3's,
    AVX2 only) and in bf16 at decode, as the bf16 c_proj after it always does. The cast to bf16 between
    them, fused into Inductor's own GEMM (torch 2.13), had the GEMM's float32 result stored into the bf16
    output's buffer: past its end (heap corruption: the process aborted) and over the other thread's
    columns. engine.compile_options turns epilogue fusion off for the regimes where a layer takes such a
    path, and only there; package_rows gives such a model a package per row count, so that 1 row takes
    the decode path. Without the first, this test's process aborted."""
    model = tiny_model()
    plan = kernels.plan_for(model, "bfloat16")
    mixed = {**dict.fromkeys(kernels.REGIMES, "fp32 GEMM"), "decode": "F.linear"}
    for key in plan.choices:
        plan.choices[key] = kernels.Choice("plain", mixed if key.startswith(f"{4 * model.config.n_embd}x")
                                           else dict.fromkeys(kernels.REGIMES, "F.linear"), {})
    model = apply_plan(model, plan)
    assert "epilogue_fusion" not in engine.compile_options(model, "cpu", ("decode",))
    assert engine.compile_options(model, "cpu", ("batch",))["epilogue_fusion"] is False
    assert engine.package_rows(model, 1) == 1 and engine.package_rows(model, 8) == 8
    assert generate(model, PROMPTS, max_new_tokens=12, compile=True) == generate(model, PROMPTS, max_new_tokens=12)


@pytest.mark.skipif(not format_named("float32", "mkl").available(), reason="needs MKL's packed GEMM")
def test_mkls_format_holds_each_weight_once_and_gives_it_back_exactly_for_compiling():
    """MKL's packed float32 weight is the only copy a layer keeps (a plain one beside it held a float32
    model's weights twice): it computes at every row count without one, reads back bit for bit, and
    add_compile_weights gives each layer its plain weight back for Inductor, the tied lm_head wte's table."""
    fmt = format_named("float32", "mkl")
    model = apply_plan(tiny_model(), forced_plan(fmt, "mkl"))
    ref = tiny_model()
    layers = [(getattr(p, a), getattr(r, a)) for (p, a, _, _), (r, _, _, _)
              in zip(linear_layers(model), linear_layers(ref))]
    for layer, plain in layers:
        assert set(layer.tensors) == {"mkl", "shape"}  # no plain (N, K) float32 weight
        assert torch.equal(layer.reference_weight(), plain.weight.double())
        for rows in (1, 3, 8, 64, 130):
            x = torch.randn(rows, layer.in_features)
            with torch.inference_mode():
                y = plain(x) if layer.activation is None else F.gelu(plain(x), approximate="tanh")  # c_fc's fused
                assert ((layer(x) - y).abs().max() / y.abs().max()).item() <= kernels.TOLERANCE["float32"]
    add_compile_weights(model)
    for layer, plain in layers:
        assert torch.equal(layer.tensors["weight"], plain.weight)
    assert model.lm_head.tensors["weight"].data_ptr() == model.transformer.wte.weight.data_ptr()  # shared


@pytest.mark.slow
@pytest.mark.parametrize("precision, fmt", [("float32", "mkl"), ("bfloat16", "onednn")])
def test_where_memory_is_short_packed_layers_compile_as_their_own_gemm(precision, fmt, monkeypatch, caplog):
    """Where Inductor's own weights would not fit (add_compile_weights), MKL's and oneDNN's layers
    get no plain weight back and compile as their library's GEMM (no package either: engine.PackagedDecodeStep
    checks its larger need first): the compiled step equals eager and decodes the same tokens."""
    if not any(f.name == fmt for f in formats_for(precision)):
        pytest.skip(f"no {precision} {fmt} format on this machine")
    monkeypatch.setattr(quantize, "available_memory_bytes", lambda: 1.0)
    model = apply_plan(tiny_model(), forced_plan(format_named(precision, fmt), fmt))
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])  # (1, 11)
    with caplog.at_level(logging.WARNING, logger="gpt2"):
        compiled, eager = compiled_and_eager_logits(model, ids, prompt_length=4)
    assert any("compile as their own library's GEMM" in r.getMessage() for r in caplog.records)
    assert any("could not package" in r.getMessage() for r in caplog.records)
    assert all("weight" not in layer.tensors for _, _, layer, _ in linear_layers(model))
    # bf16: Inductor fuses the ops around the GEMM and rounds the outputs elsewhere: each within one tolerance
    bound = (1 if precision == "float32" else 2) * kernels.TOLERANCE[precision]
    assert ((compiled - eager).abs().max() / eager.abs().max()).item() <= bound
    assert generate(model, PROMPTS, max_new_tokens=12, compile=True) == generate(model, PROMPTS, max_new_tokens=12)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_below_float32_wte_is_the_float32_table_rounded_to_bf16_and_no_float32_table_is_kept(precision):
    """Below float32, apply_plan makes wte a bf16 table, each row the float32 one rounded to bf16, and
    the model holds no float32 (V, C) tensor beside it. The embedding is
    the bf16 rows made float32, and the logits equal, bit for bit, those of the same model whose wte
    is a float32 table of those rounded values. A float32 model keeps its float32 table. The KV cache's
    dtype follows the activations (wpe's dtype), not the bf16 table."""
    from gpt2.kv_cache import KVCache
    model = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), precision))
    table = model.transformer.wte.weight
    expected = tiny_model().transformer.wte.weight.detach()  # (V padded, C) float32
    assert KVCache.for_model(model, 1, 8).k[0].dtype == torch.float32  # apply_plan sets no kv_dtype
    if precision == "float32":
        assert table.dtype == torch.float32 and torch.equal(table, expected)
        return
    assert table.dtype == torch.bfloat16 and torch.equal(table, expected.to(torch.bfloat16))
    V, C = expected.shape
    tensors = list(model.parameters()) + list(model.buffers())
    assert not [t for t in tensors if t is not None and t.shape == (V, C) and t.dtype == torch.float32]
    ids = torch.tensor([PROMPTS[0] * 4])
    reference = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), precision))
    reference.transformer.wte = torch.nn.Embedding.from_pretrained(expected.to(torch.bfloat16).float())  # float32
    with torch.inference_mode():
        assert torch.equal(model.transformer.wte(ids), expected[ids].to(torch.bfloat16).float())
        assert torch.equal(model(ids), reference(ids))


@pytest.mark.slow
def test_loading_at_int4_holds_one_float32_layer_not_the_float32_model(tmp_path):
    """Twelve GPT-2 124M blocks (340 MB of float32 weights, vocabulary 1,024) loaded at int4 in a fresh
    process, its plan measured first: the peak RSS of the load itself stays near the packed model
    (about 70 MB of int4 weights and their scales), where loading the float32 model whole, as before,
    peaked at 430-790 MB (BENCHMARKS.md)."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import save_file
    config = GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=1024, n_positions=128)
    with torch.device("meta"):
        shapes = GPT(config)
    tensors = {name: torch.randn(p.shape[::-1] if name.endswith(".weight") and ".h." in name and "ln_" not in name
                                 else p.shape) * 0.02 for name, p in shapes.named_parameters()}
    weight_bytes = sum(t.numel() * 4 for t in tensors.values())
    (tmp_path / "m").mkdir()
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "m" / "config.json").write_text(json.dumps(config.to_hf_dict()))
    del tensors
    script = """
import re, sys, torch
from gpt2 import GPT
from gpt2.kernels import plan_for
from gpt2.quantize import load_for_inference
from gpt2.weights import resolve_config
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
with torch.device("meta"):
    shapes = GPT(resolve_config(sys.argv[1]).config)
plan_for(shapes, "int4", "cpu")  # read from the cache the first run wrote: this one measures nothing
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM counts from here
load_for_inference(sys.argv[1], "int4", "cpu")
print(status("VmHWM") - before)
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # never the user's kernel cache
    # The first run measures the plan (its copies, freed, would stay in the heap for the load to reuse)
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m")], capture_output=True, text=True,
                             env=env)
        assert run.returncode == 0, run.stderr
    peak = int(run.stdout.split()[-1])
    print(f"loading at int4 peaked {peak / 1e6:.0f} MB above the process for {weight_bytes / 1e6:.0f} MB of float32")
    assert peak < 0.5 * weight_bytes


def assert_equal_up_to_ties(model, fast: list[list[int]], naive: list[list[int]]):
    """Rows agree token for token, except at a near-tie, where the cached and the naive forward may pick
    different tokens; the rows may then go apart and are compared no further. The two run different
    kernels (a decode step's 1-3 rows against all rows) and a bf16 KV cache attends in bf16, rounding each
    layer's attention output at other places than the naive forward does: measured up to 1.1% of the
    largest logit on this model. So at the step where a row first differs, the cached logits are replayed
    (the prompt prefilled, then one token at a time) beside the naive ones, and
    - the two paths' logits differ by at most 2^-5 of the largest |logit| (a few bf16 roundings; a wrong
      cache entry moves them by far more), and
    - the naive logits of the two tokens are closer than bf16's rounding (2^-7 of the largest |logit|) or
      than twice the paths' measured difference: the flip is that difference, not a bug."""
    for row, (a, b) in enumerate(zip(fast, naive)):
        t = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)
        if t is None:
            assert len(a) == len(b), row
            continue
        prompt = PROMPTS[row]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + b[:t]]))[0, -1].double()
            cache = KVCache.for_model(model, 1, len(prompt) + t)
            replayed = model(torch.tensor([prompt]), cache=cache)[0, -1]
            for token in b[:t]:
                replayed = model(torch.tensor([[token]]), cache=cache)[0, -1]
        largest = logits.abs().max().item()
        difference = (replayed.double() - logits).abs().max().item()
        assert difference <= 2 ** -5 * largest, f"row {row} step {t}: cached and naive logits {difference:.4g} apart"
        gap = (logits[b[t]] - logits[a[t]]).abs().item()
        assert gap <= max(2 ** -7 * largest, 2 * difference), (
            f"row {row} step {t}: cached {a[t]} vs naive {b[t]}, logits {gap:.4g} apart: not a near-tie")


@pytest.mark.parametrize("precision,bf16_cache", [(p, False) for p in PRECISIONS]
                         + [(p, True) for p in ("int8", "int4")])
def test_cached_generation_equals_naive_at_every_precision(precision, bf16_cache):
    """bf16_cache: the KV cache kv_dtype="auto" takes where the keys are bf16 numbers (and attention over
    it measures no slower): it holds the very keys the naive forward computes. int8's and int4's c_attn
    always return bf16 numbers; bfloat16's do unless its plan takes the "fp32 GEMM" path."""
    from gpt2.quantize import keys_are_bf16
    model = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), precision))
    if bf16_cache:
        assert keys_are_bf16(model)
        model.kv_dtype = torch.bfloat16
    fast, naive = generate(model, PROMPTS, max_new_tokens=16), generate_naive(model, PROMPTS, max_new_tokens=16)
    if precision == "float32":
        assert fast == naive
        sampled = dict(temperature=0.9, top_k=50, seed=[3, 4, 5])
        assert generate(model, PROMPTS, max_new_tokens=16, **sampled) == generate_naive(
            model, PROMPTS, max_new_tokens=16, **sampled)
    else:  # bf16 numbers: the cached path (1-3 rows) and the naive one (all rows) round differently
        assert_equal_up_to_ties(model, fast, naive)


@pytest.mark.parametrize("precision,agreement", [("bfloat16", 0.9), ("int8", 0.9), ("int4", 0.6)])
def test_quantized_logits_track_float32(precision, agreement):
    ref_model = tiny_model()
    model = apply_plan(tiny_model(), kernels.plan_for(ref_model, precision))
    ids = torch.tensor([(PROMPTS[0] * 12)[:80]])
    with torch.inference_mode():
        ref, out = ref_model(ids), model(ids).float()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= agreement


# --- the cache -----------------------------------------------------------------------------------

def test_plan_is_measured_once_then_read_from_the_cache(kernel_cache):
    model = tiny_model()
    first = kernels.plan_for(model, "bfloat16")
    assert first.source == "measured" and kernel_cache.exists()
    second = kernels.plan_for(model, "bfloat16")
    assert second.source == "cache" and second.choices == first.choices
    text = second.describe()
    for key, choice in first.choices.items():
        assert key in text and choice.format in text


def test_a_plan_measured_under_an_isa_limit_serves_that_limit_only(kernel_cache, monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 (or ATEN_CPU_CAPABILITY, ...) makes the libraries another machine: a plan
    measured without it must not serve a process run with it, nor the other way round."""
    for name in kernels.ISA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    plain = kernels.machine_key()
    assert kernels.plan_for(tiny_model(), "float32").source == "measured"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernels.machine_key() == {**plain, "isa limits": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
    assert kernels.plan_for(tiny_model(), "float32").source == "measured"
    assert kernels.plan_for(tiny_model(), "float32").source == "cache"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert kernels.machine_key() == plain  # a plain run's key is unchanged: its entries stay valid
    assert kernels.plan_for(tiny_model(), "float32").source == "cache"


@pytest.mark.parametrize("scan_at_entry", [True, False])
def test_other_processes_cpu_time_is_seen_while_kernels_are_measured(scan_at_entry):
    """others_cpu_share counts the CPU time other processes take: busy loops on every core take most of
    it, an idle interval little; this process's own work is not counted, nor that of the processes it
    starts (a compile's C++ compilers and workers), alive or done; read at the end or only when asked."""
    import os
    import signal
    import subprocess
    import sys
    if kernels._cpu_busy_seconds() is None:
        pytest.skip("no /proc/stat here")
    loop = [sys.executable, "-c", "while True: pass"]
    cores = os.cpu_count() or 1
    with kernels.others_cpu_share(scan_at_entry) as own:  # this process busy, then its children: nothing else
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
        children = [subprocess.Popen(loop) for _ in range(cores)]
        time.sleep(1.0)
        burst = "import time\nend = time.time() + 0.3\nwhile time.time() < end: pass"
        waited = subprocess.Popen([sys.executable, "-c", burst])
        waited.wait()
    own_share = own.share  # read at once: a lazy reading scans for the descendants when read
    for child in children:
        child.kill()
        child.wait()
    # Busy loops that are not this process's descendants: started by a shell that exits at once, so that
    # they are handed to init (or the nearest subreaper)
    script = " ".join(f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!;" for _ in range(cores))
    started = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    others = [int(pid) for pid in started.stdout.split()]
    try:
        time.sleep(0.3)  # running
        with kernels.others_cpu_share(scan_at_entry) as busy:
            time.sleep(1.0)
    finally:
        for pid in others:
            os.kill(pid, signal.SIGKILL)
    # own_share: ~0 here; counting the children as others gives ~0.65 (their loops ran most of the interval)
    assert busy.share > 0.6 and own_share < busy.share - 0.5, (own_share, busy.share)


def test_a_plan_measured_on_a_busy_machine_is_measured_again_when_quiet(kernel_cache, monkeypatch, caplog):
    """Read from /proc/stat: every CPU busy while the plan was measured, then idle the next time."""
    measure_busy_machines_as_gpt2_does(monkeypatch)
    clock = iter([0.0, 1e6])  # /proc/stat: every CPU busy for a long time while it measured
    monkeypatch.setattr(kernels, "_cpu_busy_seconds", lambda: next(clock))
    with caplog.at_level(logging.WARNING, logger="gpt2.kernels"):
        plan = kernels.plan_for(tiny_model(), "float32")
    assert plan.source == "measured" and plan.busy_share == 1.0
    assert any("100% of the CPUs while the float32 kernels were measured" in r.getMessage()
               and "measured again at the next load" in r.getMessage() for r in caplog.records)
    assert "while other processes took 100% of the CPUs (measured again at the next load)" in plan.describe()
    monkeypatch.setattr(kernels, "_cpu_busy_seconds", lambda: 0.0)  # no other process: a quiet machine
    again = kernels.plan_for(tiny_model(), "float32")
    assert again.source == "measured" and again.busy_share == 0.0 and "other processes" not in again.describe()
    assert json.loads(kernel_cache.read_text())["busy"] == {}
    third = kernels.plan_for(tiny_model(), "float32")
    assert third.source == "cache" and third.choices == again.choices and third.busy_share is None


def busy_machine(monkeypatch, shares):
    """others_cpu_share reporting each of `shares` in turn as the share other processes took."""
    measure_busy_machines_as_gpt2_does(monkeypatch)
    shares = iter(shares)

    class Reported:
        def __init__(self, **options):
            pass

        def __enter__(self):
            self.share = next(shares)
            return self

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(kernels, "others_cpu_share", Reported)


def test_a_machine_never_quiet_measures_a_few_times_and_keeps_the_quietest(kernel_cache, monkeypatch, caplog):
    busy_machine(monkeypatch, [0.9, 0.5, 0.8])
    plans = [kernels.plan_for(tiny_model(), "float32") for _ in range(kernels.BUSY_MEASUREMENTS)]
    assert [p.source for p in plans] == ["measured"] * 3 and [p.busy_share for p in plans] == [0.9, 0.5, 0.5]
    assert plans[0].choices != plans[1].choices  # each measured anew (their timings differ)
    assert plans[2].choices == plans[1].choices  # the third, busier, did not replace the second
    assert any("the quietest is kept" in r.getMessage() for r in caplog.records)
    kept = kernels.plan_for(tiny_model(), "float32")  # no fourth measurement
    assert kept.source == "cache" and kept.choices == plans[1].choices and kept.busy_share == 0.5
    assert "took 50% of the CPUs (the quietest of 3 such measurements" in kept.describe()


def test_a_measurement_taken_busy_is_taken_again_and_a_quiet_one_replaces_it(kernel_cache, monkeypatch):
    results = iter(range(1, 10))

    def measure():
        return {"n": next(results)}
    busy_machine(monkeypatch, [0.9, 0.95, 0.1])
    assert kernels.cached_measurement("probe", {"k": 1}, measure) == ({"n": 1}, "measured")
    assert kernels.cached_measurement("probe", {"k": 1}, measure) == ({"n": 1}, "measured")  # busier: kept n=1
    assert kernels.cached_measurement("probe", {"k": 1}, measure) == ({"n": 3}, "measured")  # quiet: replaces
    assert kernels.cached_measurement("probe", {"k": 1}, measure) == ({"n": 3}, "cache")
    assert json.loads(kernel_cache.with_name("probe.json").read_text())["busy"] == {}


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 999, "entries": {}}),
                                     json.dumps({"version": kernels.CACHE_VERSION, "entries": {"k": {"x": 1}}}),
                                     json.dumps([1, 2])])
def test_a_corrupt_or_foreign_cache_is_ignored_with_one_warning(kernel_cache, content, caplog):
    kernel_cache.write_text(content)
    with caplog.at_level(logging.WARNING, logger="gpt2.kernels"):
        plan = kernels.plan_for(tiny_model(), "float32")
    assert plan.source == "measured"
    assert len([r for r in caplog.records if "ignoring the kernel cache" in r.getMessage()]) == 1
    assert kernels.plan_for(tiny_model(), "float32").source == "cache"  # rewritten whole


def test_choice_takes_the_format_nearest_the_best_of_each_regime():
    timings = {"a": {"p": {"decode": 10.0, "batch": 50.0, "short": 60.0, "prefill": 100.0, "long": 400.0}},
               "b": {"p": {"decode": 12.0, "batch": 20.0, "short": 70.0, "prefill": 100.0, "long": 400.0},
                     "q": {"decode": 10.4, "batch": 90.0, "short": 60.0, "prefill": 300.0, "long": 350.0}}}
    choice = kernels._choose(timings, {})
    assert choice.format == "b"
    assert choice.paths == {"decode": "q", "batch": "p", "short": "q", "prefill": "p", "long": "q"}


def test_choice_keeps_no_format_much_slower_at_decode():
    """b is nearer the best of the five regimes summed, but 10% slower at decode, which every generated
    token pays: a is kept (the rule that picks MKL over oneDNN's 8-row layout for float32 on a Xeon)."""
    timings = {"a": {"p": {"decode": 10.0, "batch": 50.0, "short": 60.0, "prefill": 100.0, "long": 400.0}},
               "b": {"p": {"decode": 11.0, "batch": 20.0, "short": 50.0, "prefill": 90.0, "long": 380.0}}}
    assert kernels._choose(timings, {}).format == "a"
    assert kernels._why_not(kernels._choose(timings, {})) == ["not kept: b, 1.10x the fastest decode"]
    timings["b"]["p"]["decode"] = 10.4  # within DECODE_SLACK: the sum decides
    assert kernels._choose(timings, {}).format == "b"
    assert kernels._why_not(kernels._choose(timings, {})) == [
        "not kept: a, within 5% at decode (0.96x b's) but further from the best of the other regimes"]
    fixed = kernels.plan_for(tiny_model(), "int8", device_type="cuda")  # nothing measured off the CPU
    assert fixed.source == "fixed" and "not kept" not in fixed.describe()


def test_a_combined_format_is_kept_where_its_second_engine_gains_enough():
    """int8's two-engine format holds fbgemm's and oneDNN's packings of one weight: kept where oneDNN's
    kernel makes some regime COMBINED_GAIN faster than fbgemm's format alone (each regime then takes the
    faster engine), not for less: it costs one more packed copy of the weight."""
    combined = format_object("int8", "dynamic fbgemm+onednn")  # its rule only: no kernel runs
    fbgemm = {"u8s8 per row": {"decode": 10.0, "batch": 30.0, "short": 60.0, "prefill": 100.0, "long": 400.0}}
    for onednn_batch, kept in [(20.0, True), (25.0, False)]:  # 1.5x: kept; 1.2x: not
        timings = {"dynamic fbgemm": fbgemm,
                   "dynamic onednn": {"u8s8 per row": {"decode": 13.0, "batch": onednn_batch}}}  # 1.3x slower at 1 row
        choice = kernels._choose_combined(kernels._choose(timings, {}), [combined])
        if kept:
            assert choice.format == combined.name
            assert choice.paths == {"decode": "u8s8 per row", "batch": "onednn u8s8 per row", "short": "u8s8 per row",
                                    "prefill": "u8s8 per row", "long": "u8s8 per row"}
            assert kernels._why_not(choice) == [
                "kept: dynamic fbgemm+onednn, 1.50x dynamic fbgemm's speed at batch (at least 1.25x for one "
                "more packed copy of the weight)"]
        else:
            assert choice.format == "dynamic fbgemm"
            assert kernels._why_not(choice) == ["not kept: dynamic onednn, 1.30x the fastest decode"]


def test_a_combined_format_takes_every_regime_from_the_part_kept_alone():
    """Where oneDNN's format is kept (the faster at 1 row) and fbgemm's was timed at 1 and 8 rows only,
    the combined format still has a path for every regime: oneDNN's own, its int8pack_mm and dequant bf16
    among them (paths both parts have are one kernel on the same tensors)."""
    combined = format_object("int8", "dynamic fbgemm+onednn")  # its rule only: no kernel runs
    timings = {"dynamic onednn": {"u8s8 per row": {"decode": 10.0, "batch": 30.0, "short": 60.0},
                                  "dequant bf16": {"short": 70.0, "prefill": 90.0, "long": 300.0}},
               "dynamic fbgemm": {"u8s8 per row": {"decode": 13.0, "batch": 15.0}}}
    choice = kernels._choose_combined(kernels._choose(timings, {}), [combined])
    assert choice.format == combined.name
    assert choice.paths == {"decode": "onednn u8s8 per row", "batch": "u8s8 per row", "short": "onednn u8s8 per row",
                            "prefill": "dequant bf16", "long": "dequant bf16"}


@pytest.mark.skipif(not format_object("bfloat16", "plain+fbgemm fp16").available(), reason="no fbgemm fp16 GEMM here")
def test_bf16_keeps_both_weights_where_f_linear_wins_one_row_and_fbgemm_eight(monkeypatch):
    """bf16's combined format: where F.linear is the faster at 1 row and fbgemm's fp16 GEMM at 8 (an AVX2 CPU,
    BENCHMARKS.md), the layer holds both and each regime takes the faster; a real pack of it computes every
    path within bf16's rounding of the plain weight, and its compiled path needs no engine (it packages)."""
    fake_clock(monkeypatch, lambda path, copies, x: {"_plain": 10.0 if x.size(0) == 1 else 100.0,
                                                     "_fp16": 11.0 if x.size(0) == 1 else 20.0}.get(path.__name__,
                                                                                              1000.0) * 1e-6)
    choice = kernels.measure_shape("bfloat16", 96, 64, None)
    assert choice.format == "plain+fbgemm fp16", choice
    assert choice.paths["decode"] == "F.linear" and choice.paths["batch"] == "fbgemm fp16"
    model = apply_plan(tiny_model(), forced_plan(format_object("bfloat16", "plain+fbgemm fp16"), "fbgemm fp16"))
    assert engine.PackagedDecodeStep.applies(model)
    head, x = model.lm_head, torch.randn(5, model.config.n_embd)
    with torch.inference_mode():
        logits = head(x).double()
    exact = x.double() @ head.reference_weight().t()
    assert ((logits - exact).abs().max() / exact.abs().max()).item() <= kernels.TOLERANCE["bfloat16"]


@pytest.mark.skipif(not format_object("bfloat16", "plain+fbgemm fp16").available(), reason="no fbgemm fp16 GEMM here")
def test_bf16_keeps_both_weights_where_fbgemm_wins_decode_and_f_linear_prompts(monkeypatch):
    """An AMD EPYC Zen 4's case (BENCHMARKS.md): fbgemm's fp16 GEMM twice as fast as F.linear at 1 and 8 rows,
    F.linear's bf16 GEMM 2x as fast for prompts. F.linear, dropped after decode, is still timed at the
    prompts' row counts as a part of the combined format, which is kept: decode and batch on fbgemm,
    prompts on F.linear."""
    fake_clock(monkeypatch, lambda path, copies, x: {"_plain": 20.0 if x.size(0) <= 8 else x.size(0),
                                                     "_fp16": 10.0 if x.size(0) <= 8 else 2.0 * x.size(0)}.get(
                                                         path.__name__, 1000.0 * x.size(0)) * 1e-6)
    choice = kernels.measure_shape("bfloat16", 96, 64, None)
    assert choice.format == "plain+fbgemm fp16", choice
    assert choice.paths == {"decode": "fbgemm fp16", "batch": "fbgemm fp16", "short": "F.linear",
                            "prefill": "F.linear", "long": "F.linear"}


def test_the_second_engine_is_timed_after_decode_on_the_paths_a_combined_format_takes(monkeypatch):
    """oneDNN's int8 format, 1.3x slower at 1 row, would stop after decode; as a part of the two-engine
    format its per-row path is also timed at 8 rows and the prompts' row counts (and nothing else of it),
    so the lm_head's faster 8-row kernel is found. The times are set here (a fake clock per format and rows); the checks are real."""
    if not format_object("int8", "dynamic fbgemm+onednn").available():
        pytest.skip("needs both u8s8 engines (one saturates on this CPU: quantize._u8s8_sums_exactly)")
    format_of = {}  # id of a candidate copy's q -> its format (each copy's q is its own clone)
    real_candidates = kernels._candidates

    def candidates(*args, **kwargs):
        found = real_candidates(*args, **kwargs)
        format_of.update({id(copy["q"]): c.format.name for c in found for copy in c.copies if "q" in copy})
        return found

    fake_us = {("dynamic fbgemm", 1): 10.0, ("dynamic fbgemm", 8): 30.0, ("dynamic onednn", 1): 13.0,
               ("dynamic onednn", 8): 15.0}
    timed = []

    def fake_time(path, copies, x):
        fmt = format_of[id(copies[0]["q"])]
        timed.append((fmt, path.__name__, x.size(0)))
        one_scale = 0.5 if path.__name__ == "_int8_dynamic" else 0.0  # one scale per call: a little slower here
        return (fake_us.get((fmt, x.size(0)), 40.0 * x.size(0)) + one_scale) / 1e6

    monkeypatch.setattr(kernels, "_candidates", candidates)
    fake_clock(monkeypatch, fake_time)
    choice = kernels.measure_shape("int8", 96, 64, None)
    assert choice.format == "dynamic fbgemm+onednn"
    assert choice.paths["decode"] == "u8s8 per row" and choice.paths["batch"] == "onednn u8s8 per row"
    # int8pack_mm's decode time is the weight-only format's (the same kernel on the same q): not timed again
    assert {(path, rows) for fmt, path, rows in timed if fmt == "dynamic onednn"} == {
        ("_int8_dynamic", 1), *(("_int8_dynamic_rows", rows) for rows in kernels.ROWS.values())}


def test_a_regime_is_timed_unless_the_one_before_proves_it_cannot_win():
    """At k times the rows the best path takes at most k times as long, so only a path more than k times
    the best at the regime before is skipped; a format's first path is always timed, so every format
    covers every regime."""
    timings = {"a": {"p": {"decode": 10.0, "prefill": 100.0}}}
    assert kernels._may_win("long", {"prefill": 400.0}, timings)
    assert not kernels._may_win("long", {"prefill": 401.0}, timings)
    assert kernels._may_win("long", {"prefill": 5000.0}, timings, always=True)  # a format's first path
    assert not kernels._may_win("long", {}, timings)  # never timed before: slower still
    assert not kernels._may_win("batch", {"decode": 81.0}, timings)  # 8 rows: at most 8x the best
    assert kernels._may_win("batch", {"decode": 80.0}, timings)
    assert kernels._may_win("short", {"decode": 10000.0}, timings)  # cold copies vs one warm: never pruned
    timings["a"]["p"]["short"] = 60.0
    assert kernels._may_win("prefill", {"short": 120.0}, timings)  # 128 rows: at most 2x the best at 64
    assert not kernels._may_win("prefill", {"short": 121.0}, timings)
    # skipped at prefill, the bound still holds from short at 8x its rows: a path that dequantizes its whole
    # weight per call loses at 128 rows and wins at 512 (int4's "dequant fp32" on a Xeon without AVX512_BF16)
    assert kernels._may_win("long", {"short": 480.0}, timings)
    assert not kernels._may_win("long", {"short": 481.0}, timings)


@needs_a_u8s8_engine
def test_each_format_times_a_path_at_every_regime_however_slow_its_others_look(monkeypatch):
    """int8's dynamic formats list a one-row path first, which runs at decode only. If their other paths
    look more than 8x slower at 1 row (a noisy sample on a busy machine), pruning may skip them at 8
    rows, but not all of them: the first path that runs at a regime is always timed there, so the format
    still covers batch (before, on a busy machine, no format covered it and the measurement raised)."""
    fake_clock(monkeypatch, lambda path, copies, x: (10.0 if path.__name__ == "_int8_dynamic" else
                                                     1000.0 if x.size(0) == 1 else 40.0 * x.size(0)) / 1e6)
    choice = kernels.measure_shape("int8", 96, 64, None)
    dynamic = U8S8_ENGINES
    assert dynamic
    for name in dynamic:
        timed = {regime for path in choice.timings_us[name].values() for regime in path}
        assert timed == set(kernels.REGIMES), (name, choice.timings_us[name])


@pytest.mark.parametrize("fmt", [f for f in CPU_FORMATS if f.available()], ids=lambda f: f"{f.precision}-{f.name}")
def test_a_reference_of_some_rows_is_those_rows_of_the_whole(fmt):
    """kernels.py builds the float64 reference of the checked outputs only (the lm_head's first and last
    2,048): row for row it must be the whole weight's."""
    torch.manual_seed(0)
    w, b = torch.randn(160, 64) * 0.1, torch.randn(160) * 0.1
    tensors = fmt.pack(w, b)
    rows = kernels._edges(160, 48)  # rows 0-47 and 112-159
    some = fmt.reference_weight(w, tensors, rows)
    assert some.dtype == torch.float64 and torch.equal(some, fmt.reference_weight(w, tensors)[rows])


@pytest.mark.parametrize("fmt", [f for f in CPU_FORMATS if f.available() and "onednn" in f.paths],
                         ids=lambda f: f"{f.precision}-{f.name}")
def test_onednn_packing_keeps_the_values_the_reference_takes_from_w(fmt):
    """The oneDNN formats' reference is w in the packed dtype (no read-back of the whole packed weight):
    oneDNN's own read-back of its packed layout must give exactly that, at shapes with partial blocks."""
    torch.manual_seed(0)
    for shape in [(160, 64), (50, 33), (2304, 768)]:
        w = torch.randn(*shape) * 0.1
        tensors = fmt.pack(w, None)
        assert torch.equal(fmt.reference_weight(w, tensors), fmt.reference_weight(None, tensors))


def test_a_path_outside_its_rounding_is_rejected(monkeypatch):
    from gpt2 import quantize
    broken = quantize.WeightFormat("broken", "float32", lambda w, b: {"weight": w}, quantize._plain_reference,
                                   {"off by one": lambda x, t, b, a: F.linear(x, t["weight"], b) + 1})
    monkeypatch.setattr(quantize, "CPU_FORMATS", quantize.CPU_FORMATS + [broken])
    choice = kernels.measure_shape("float32", 32, 64, None)
    assert "broken/off by one" in choice.rejected and choice.format != "broken"


def test_a_wide_layer_is_checked_on_its_edge_outputs(monkeypatch):
    """A layer wider than 2 x CHECKED_COLUMNS (the lm_head) is compared on its first and last outputs: a
    path wrong only in the very last output column is still rejected."""
    from gpt2 import quantize
    N = 2 * kernels.CHECKED_COLUMNS + 100

    def last_column_off(x, t, b, a):
        y = F.linear(x, t["weight"], b)
        y[:, -1] += 1
        return y
    broken = quantize.WeightFormat("broken", "float32", lambda w, b: {"weight": w}, quantize._plain_reference,
                                   {"last column off": last_column_off})
    monkeypatch.setattr(quantize, "CPU_FORMATS", quantize.CPU_FORMATS + [broken])
    choice = kernels.measure_shape("float32", N, 16, None)
    assert "broken/last column off" in choice.rejected and choice.format != "broken"


def test_a_wide_layers_prefill_is_timed_on_its_leading_outputs_and_scaled(monkeypatch):
    """Wider than WIDE_OUTPUTS, short, prefill and long run on the first WIDE_OUTPUTS + N % 64 outputs (still
    checked there: a path wrong only at many rows is rejected) and their times are scaled by the width;
    decode and batch run on the whole layer."""
    from gpt2 import quantize
    monkeypatch.setattr(kernels, "WIDE_OUTPUTS", 64)
    N = 3 * 64 + 5
    widths = {}

    def wrong_at_many_rows(x, t, b, a):
        widths.setdefault(x.size(0), set()).add(t["weight"].size(0))  # rows -> widths called with
        y = F.linear(x, t["weight"], b)
        return y + 1 if x.size(0) >= 128 else y
    broken = quantize.WeightFormat("broken", "float32", lambda w, b: {"weight": w}, quantize._plain_reference,
                                   {"wrong at many rows": wrong_at_many_rows})
    monkeypatch.setattr(quantize, "CPU_FORMATS", quantize.CPU_FORMATS + [broken])
    fake_clock(monkeypatch, lambda path, copies, x: 1e-6)  # every call "takes" 1 us
    choice = kernels.measure_shape("float32", N, 16, None)
    assert "broken/wrong at many rows" in choice.rejected and choice.format != "broken"
    assert widths == {1: {N}, 8: {N}, 64: {64 + 5}, 128: {64 + 5}}  # rejected at 128 rows: never called at 512
    plain = choice.timings_us["plain"]["F.linear"]
    assert plain["decode"] == plain["batch"] == pytest.approx(1.0)
    assert plain["short"] == plain["prefill"] == plain["long"] == pytest.approx(N / (64 + 5))


def test_a_path_outside_its_rounding_at_many_rows_is_still_taken_where_it_passed(monkeypatch):
    """On an AVX2-only AMD EPYC, int8pack_mm fell outside its rounding on a narrow lm_head at 512 rows only,
    and int8 had no other path at 1 row there: the layer was left with no decode path and the measurement
    raised. A path that fails its check at a regime is not taken from that regime on, and still is at the
    regimes before, where it passed."""
    from gpt2.quantize import _int8pack
    real = kernels._check

    def check(path, tensors, b, activation, expected, x, levels):
        if path is _int8pack and x.size(0) >= quantize.LONG_ROWS:
            return f"outside its rounding at {x.size(0)} rows (forced here)", 0.0
        return real(path, tensors, b, activation, expected, x, levels)
    monkeypatch.setattr(kernels, "_check", check)
    fake_clock(monkeypatch, lambda path, copies, x: (10.0 if path is _int8pack else 1000.0) * x.size(0) / 1e6)
    choice = kernels.measure_shape("int8", 96, 64, None)
    assert choice.paths["decode"] == "int8pack_mm" and choice.paths["long"] != "int8pack_mm", choice.paths
    assert all("not taken from long on" in why for what, why in choice.rejected.items()), choice.rejected
    assert any(what.endswith("/int8pack_mm") for what in choice.rejected)


@needs_a_u8s8_engine
def test_int8_paths_shared_by_formats_are_measured_once(monkeypatch):
    """The three int8 formats quantize the weight alike, so int8pack_mm (in all three) is checked and timed
    once per regime and its timings reused; dequantizing paths are not timed at 1 or 8 rows. The times are
    set here (int8pack_mm the fastest, so every format goes on past decode); the checks are real."""
    from gpt2.quantize import _int8pack
    checked = []
    real_check = kernels._check
    monkeypatch.setattr(kernels, "_check", lambda path, *a: checked.append(path) or real_check(path, *a))
    fake_clock(monkeypatch, lambda path, copies, x: (10.0 if path is _int8pack else 12.0) * x.size(0) ** 0.5 / 1e6)
    choice = kernels.measure_shape("int8", 96, 64, None)
    engines = [f.name for f in formats_for("int8") if f.same_weights_as == "weight-only"]
    assert engines and checked.count(_int8pack) <= len(kernels.REGIMES)
    for name in engines:
        assert choice.timings_us[name]["int8pack_mm"] == choice.timings_us["weight-only"]["int8pack_mm"]
    for paths in choice.timings_us.values():
        if "dequant bf16" in paths:
            assert not {"decode", "batch"} & set(paths["dequant bf16"])


def test_int8_formats_build_one_float64_reference(monkeypatch):
    """The engines' weights are packed from the weight-only format's q and scales, so its float64
    reference serves all three (the lm_head's checked rows: 4,096 x 768 float64); the checks still run per path."""
    import dataclasses

    from gpt2 import quantize
    built = []
    formats = [dataclasses.replace(f, reference_weight=lambda w, t, rows=None, real=f.reference_weight: built.append(1) or real(w, t, rows))
               if f.precision == "int8" else f for f in quantize.CPU_FORMATS]
    monkeypatch.setattr(quantize, "CPU_FORMATS", formats)
    choice = kernels.measure_shape("int8", 96, 64, None)
    measured = [f for f in formats_for("int8") if not f.parts]  # a combined format is measured through its parts
    assert len(built) == 1 and len(choice.timings_us) == len(measured)


def test_an_int4_plan_reuses_the_int8_lm_head_an_int8_plan_measured(monkeypatch):
    measured = []
    real = kernels.measure_shapes
    monkeypatch.setattr(kernels, "measure_shapes", lambda precision, shapes: measured.extend(
        (precision, *shape) for shape in shapes) or real(precision, shapes))
    kernels.plan_for(tiny_model(), "int8")
    assert ("int8", CONFIG.vocab_size, CONFIG.n_embd, None) in measured
    measured.clear()
    plan = kernels.plan_for(tiny_model(), "int4")
    assert measured and all(p == "int4" for p, *_ in measured)  # the lm_head (int8) came from the cache
    assert plan.choice_for(CONFIG.vocab_size, CONFIG.n_embd, None, "int8").format


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [f for f in CPU_FORMATS if f.available()], ids=lambda f: f"{f.precision}-{f.name}")
def test_decode_timing_copies_own_their_storage(fmt, monkeypatch):
    """Decode is timed over copies spanning the cache; copies that alias one buffer would be timed cache-hot.
    (oneDNN's opaque tensors are new allocations by construction; the plain ones are checked here.)"""
    monkeypatch.setattr(kernels, "effective_cache_bytes", lambda: 4 * 1024 ** 2)
    w, b = torch.randn(64, 256), torch.randn(64)
    copies = kernels._copies(fmt, w, b, fmt.pack(w, b))
    strided = [[t.data_ptr() for t in quantize.path_args(c).values()
                if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() >= 64] for c in copies]
    pointers = [p for ptrs in strided for p in ptrs]
    assert len(copies) > 1 and len(set(pointers)) == len(pointers)
    assert len(pointers) >= len(copies) or not strided[0]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [f for f in CPU_FORMATS if f.available()], ids=lambda f: f"{f.precision}-{f.name}")
def test_decode_copies_span_twice_the_cache_at_the_precisions_width(fmt, monkeypatch):
    """However a format stores its weight (MKL's keeps the plain one beside a packed tensor that claims
    2.6x the bytes), its copies hold as many weights as the plain format's would at that precision, at
    the bytes a weight is stored in (int4: half a byte and its group's scale and zero, 0.625 B):
    sized by their tensors, MKL's spanned under the cache and timed cache-hot at 47 GB/s."""
    monkeypatch.setattr(kernels, "effective_cache_bytes", lambda: 4 * 1024 ** 2)
    w, b = torch.randn(512, 1024), torch.randn(512)
    copies = kernels._copies(fmt, w, b, fmt.pack(w, b))
    # 2 x 4 MiB / (512K weights x 4, 2, 1 and 0.625 bytes), rounded up
    expected = {"float32": 4, "bfloat16": 8, "int8": 16, "int4": 26}[fmt.precision]
    assert len(copies) == expected


def test_decode_copies_span_twice_the_cache_over_the_layers_timed_in_turn(monkeypatch):
    """Timed in turn with other layers, a layer needs copies for its share of the span only: a round
    reads every layer once."""
    monkeypatch.setattr(kernels, "effective_cache_bytes", lambda: 4 * 1024 ** 2)
    fmt = format_object("int8", "weight-only")
    w, b = torch.randn(512, 1024), torch.randn(512)
    packed = fmt.pack(w, b)
    assert len(kernels._copies(fmt, w, b, packed)) == 16  # 2 x 4 MiB / 512 KiB
    assert len(kernels._copies(fmt, w, b, packed, round_weights=4 * w.numel())) == 4
    assert len(kernels._copies(fmt, w, b, packed, round_weights=64 * w.numel())) == 1


def test_decode_calls_a_blocks_layers_in_turn_one_copy_of_each_a_round():
    """As a decode step calls a block's linears: layer 0's copy 0, layer 1's copy 0, layer 0's copy 1, ...;
    each layer's time is its own calls' mean."""
    calls = []

    def path(x, tensors, b, activation):
        calls.append(tensors["id"])
        time.sleep(0.001 * (1 + tensors["id"][0]))  # layer 1's calls take twice layer 0's

    turn = [([{"id": (layer, copy)} for copy in range(3)], None, None, torch.zeros(1)) for layer in range(2)]
    seconds = kernels._time_in_turn(path, turn, [math.inf, math.inf])
    assert calls[:6] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]  # the warm-up round, then as many more
    assert len(calls) % 6 == 0 and calls[6:12] == calls[:6]
    assert 0.001 <= seconds[0] < seconds[1] and seconds[1] >= 0.002


def test_readers_follow_each_round_of_timed_calls_untimed():
    """The other formats' copies are read after each round (a reader's copy i % its copies), and their
    time is not the timed path's."""
    calls = []
    path = lambda x, t, b, activation: calls.append(t["id"])

    def reader(x, t, b, activation):
        calls.append(t["id"])
        time.sleep(0.002)
    turn = [([{"id": ("timed", copy)} for copy in range(2)], None, None, torch.zeros(1))]
    readers = [(reader, [{"id": ("read", 0)}], None, None, torch.zeros(1))]
    seconds = kernels._time_in_turn(path, turn, [math.inf], readers=readers)
    assert calls[:4] == [("timed", 0), ("read", 0), ("timed", 1), ("read", 0)]
    assert seconds[0] < 0.001


@pytest.mark.parametrize("cache", [1 << 20, 256 << 10])  # float32's 4 formats: 2 copies, all read; 1, some
def test_every_formats_copies_share_the_span_a_round_reads(monkeypatch, cache):
    """Cold copies are made for a round that reads every layer in every format: with F formats each
    needs 1/F of the copies it would alone. A timed path's round reads its own layers plus other
    formats' readers until the round spans 2 x cache / copies (no reader past that), and never its own
    timed copies twice."""
    monkeypatch.setattr(kernels, "effective_cache_bytes", lambda: cache)
    rounds = []
    monkeypatch.setattr(kernels, "_time_in_turn", lambda path, turn, best_so_far, first_samples=None, readers=():
                        rounds.append((turn, readers)) or [1e-6] * len(turn))
    shapes = [(256, 128, None), (128, 256, None)]  # 128 KiB each in float32
    formats = [f for f in formats_for("float32", "cpu") if not f.parts]
    layers = [kernels._layer("float32", shape) for shape in shapes]
    kernels._add_cold_copies(layers)
    readable = sum(c.reader is not None for layer in layers for c in layer.whole.values())
    assert readable == len(formats) * len(shapes)  # every float32 format runs here
    copies = max(1, math.ceil(2 * cache / (readable * 128 * 1024)))
    assert {len(c.copies) for layer in layers for c in layer.whole.values()} == {copies}

    kernels.measure_shapes("float32", shapes)
    cold = [(turn, readers) for turn, readers in rounds if turn and turn[0][3].size(0) in (1, 8)]
    assert cold
    for turn, readers in cold:
        n = len(turn[0][0])
        read = sum(4 * b.numel() * x.size(1) for _, b, _, x in turn)
        read += sum(4 * b.numel() * x.size(1) for _, _, b, _, x in readers)
        assert read >= 2 * cache / n
        if readers:  # the last reader was needed: without it the round would fall short
            _, _, b, _, x = readers[-1]
            assert read - 4 * b.numel() * x.size(1) < 2 * cache / n
        timed = {id(copies) for copies, *_ in turn}
        assert not any(id(copies) in timed for _, copies, *_ in readers)


def test_a_plan_measures_a_precisions_layers_in_turn_in_the_models_order(monkeypatch):
    """A block's four linears and then the lm_head are measured together, in the model's order (decode
    calls them one after another); a layer kept at another precision (int4's int8 lm_head) in a turn
    of its own."""
    monkeypatch.setattr(kernels, "WIDE_OUTPUTS", 512)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=32)
    with torch.device("meta"):
        model = GPT(config)
    turns = []
    real = kernels.measure_shapes
    monkeypatch.setattr(kernels, "measure_shapes", lambda precision, shapes: turns.append((precision, shapes))
                        or real(precision, shapes))
    fake_clock(monkeypatch, lambda path, copies, x: 1e-6 * x.size(0))
    plan = kernels.plan_for(model, "float32", "cpu")
    block = [(192, 64, None), (64, 64, None), (256, 64, "gelu_tanh"), (64, 256, None)]
    assert turns == [("float32", block + [(1000, 64, None)])]
    assert plan.source == "measured" and len(plan.choices) == 5
    keys = ["192x64", "64x64", "256x64+gelu_tanh", "64x256", "1000x64"]
    assert all(plan.choices[key].turn == keys for key in keys)
    assert ("timed in turn, as a decode step calls them: 192x64 -> 64x64 -> 256x64+gelu_tanh -> 64x256 -> 1000x64 "
            "(each round also reads the other formats' copies, untimed)" in plan.describe())
    assert kernels.plan_for(model, "float32", "cpu").choices == plan.choices  # read back from the cache
    turns.clear()
    kernels.plan_for(model, "int4", "cpu")
    assert turns == [("int4", block), ("int8", [(1000, 64, None)])]


def test_a_path_wrong_on_one_layer_of_a_turn_is_rejected_there_only(monkeypatch):
    """Layers measured in turn are checked one by one: a path wrong at one shape is rejected for that
    layer and still checked, timed and kept where it is right."""
    from gpt2 import quantize

    def wrong_at_32_outputs(x, t, b, a):
        y = F.linear(x, t["weight"], b)
        return y + 1 if y.size(-1) == 32 else y
    wrong = quantize.WeightFormat("wrong at 32", "float32", lambda w, b: {"weight": w}, quantize._plain_reference,
                                  {"F.linear": wrong_at_32_outputs})
    monkeypatch.setattr(quantize, "CPU_FORMATS", [wrong])  # the only candidate
    fake_clock(monkeypatch, lambda path, copies, x: 1e-6 * x.size(0))
    with pytest.raises(RuntimeError, match="no float32 kernel passed its check for 32x64"):
        kernels.measure_shapes("float32", [(48, 64, None), (32, 64, None)])
    monkeypatch.setattr(quantize, "CPU_FORMATS", [wrong, format_object("float32", "plain")])
    right, wrong_there = kernels.measure_shapes("float32", [(48, 64, None), (32, 64, None)])
    assert set(right.timings_us["wrong at 32"]["F.linear"]) == set(kernels.REGIMES)  # timed where it is right
    assert "wrong at 32/F.linear" in wrong_there.rejected and wrong_there.format == "plain"


def test_a_slow_first_call_is_never_the_only_sample():
    """The check's call is a path's first at that shape, which may include one-time work (oneDNN
    generating kernels: 129 ms against 3.9 ms after, seen on an Intel Xeon): another call is always timed."""
    calls = []
    path = lambda x, t, b, activation: calls.append(x)
    assert kernels._time_in_turn(path, [([{}], None, None, torch.zeros(1))], [math.inf], [10.0])[0] < 10.0
    assert len(calls) >= 1


def test_the_effective_cache_is_the_largest_buffer_read_faster_than_memory(monkeypatch):
    """A VM's sysfs names the whole socket's L3 (480 MiB on a Xeon here) while the process finds far less
    of it: the cache that decode's copies must exceed is measured, on a curve made up here (fast up to 32
    MiB, memory speed from 64 MiB), then cached."""
    MiB = 1024 ** 2
    read = []
    monkeypatch.setattr(kernels, "last_level_cache_bytes", lambda: 480 * MiB)
    monkeypatch.setattr(kernels, "_read_rate", lambda n: read.append(n) or (50e9 if n <= 32 * MiB else 20e9))
    assert MEASURE_EFFECTIVE_CACHE() == 32 * MiB
    assert read[0] == 960 * MiB and max(read[1:]) == 64 * MiB  # one cold reference, then 4 .. 64 MiB
    read.clear()
    assert MEASURE_EFFECTIVE_CACHE() == 32 * MiB and not read  # from the cache
    monkeypatch.setattr(kernels, "machine_key", lambda: {"cpu": "another"})
    monkeypatch.setattr(kernels, "_read_rate", lambda n: 20e9)  # no cache at all: the floor
    assert MEASURE_EFFECTIVE_CACHE() == 4 * MiB


def test_info_kernels_prints_the_plan(capsys):
    from gpt2.cli import main
    assert main(["info", "gpt2", "--kernels", "--kernels-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "kernels for int8" in out and "768x3072" in out and "50257x768" in out


@needs_fbgemm
def test_a_deep_copy_of_a_packed_model_decodes_without_the_original(monkeypatch):
    """copy.deepcopy of an int8 model whose u8s8 engine weights are TorchScript objects: the copy's
    keys (what a compiled graph's custom op looks them up by) name its own, so it decodes alone.
    The compiled step calls the engines through that op (where oneDNN sums exactly it would compute
    from q and its scales instead, and look nothing up: quantize.u8s8_compiles_from_tensors)."""
    import copy
    import gc
    monkeypatch.setattr(quantize, "u8s8_compiles_from_tensors", lambda: False)
    plan = kernels.plan_for(tiny_model(), "int8")
    plan.choices = {k: kernels.Choice("dynamic fbgemm", {r: "u8s8 dynamic" for r in kernels.REGIMES}, {})
                    for k in plan.choices}
    model = apply_plan(tiny_model(), plan)
    expected = generate(model, PROMPTS, max_new_tokens=6)
    twin = copy.deepcopy(model)
    assert twin.lm_head.kernel_args["packed_key"] != model.lm_head.kernel_args["packed_key"]
    del model
    gc.collect()
    assert generate(twin, PROMPTS, max_new_tokens=6) == expected
    assert generate(twin, PROMPTS, max_new_tokens=6, compile=True) == expected


@pytest.mark.parametrize("precision, fmt", [("float32", "onednn"), ("float32", "onednn b8"), ("float32", "mkl"),
                                           ("bfloat16", "onednn")])
def test_a_deep_copy_of_a_model_with_opaque_packed_weights_computes_the_same_alone(precision, fmt):
    """oneDNN's and MKL's packed weights have the mkldnn layout, without a storage for copy.deepcopy to
    copy (it raised "Cannot access storage of OpaqueTensorImpl"): a copy clones them. It shares no
    buffer with the original and computes the same logits after the original is gone."""
    import copy
    import gc
    if not any(f.name == fmt for f in formats_for(precision)):
        pytest.skip(f"no {precision} {fmt} format on this machine")
    model = apply_plan(tiny_model(), forced_plan(format_named(precision, fmt), fmt if fmt != "onednn b8" else "onednn"))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = model(ids)
    twin = copy.deepcopy(model)
    originals = {id(t) for t in model.buffers()}
    assert not any(id(t) in originals for t in twin.buffers())
    del model
    gc.collect()
    with torch.no_grad():
        assert torch.equal(twin(ids), expected)


def compiled_and_eager_logits(model, ids: torch.Tensor, prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (T - P, V) of each decode step over ids (1, T) after a prompt of P of them, teacher-forced:
    the same ids into the compiled step (engine.StaticDecode) and into the eager model."""
    from gpt2.engine import StaticDecode
    from gpt2.kv_cache import KVCache
    T = ids.size(1)
    with torch.inference_mode():
        eager_cache, compiled_cache = KVCache.for_model(model, 1, T + 1), KVCache.for_model(model, 1, T + 1)
        for cache in (eager_cache, compiled_cache):
            model(ids[:, :prompt_length], cache=cache)
        step = StaticDecode(model, [ids[0, :prompt_length].tolist()], torch.ones(1, T + 1), T + 1)
        eager = [model(ids[:, t:t + 1], cache=eager_cache)[0, -1] for t in range(prompt_length, T)]
        compiled = [step(ids[0, t:t + 1], compiled_cache)[0] for t in range(prompt_length, T)]
    return torch.stack(compiled), torch.stack(eager)


def int4_lm_head_on(fmt: str, path: str) -> kernels.Plan:
    """tiny_model's int4 plan with its lm_head (int8 in an int4 model, the "@int8" key) in fmt, on path at
    every regime: which the measurement picks depends on the timing."""
    plan = kernels.plan_for(tiny_model(), "int4")
    plan.choices = {key: dataclasses.replace(choice, format=fmt, paths=dict.fromkeys(kernels.REGIMES, path))
                    if "@int8" in key else choice for key, choice in plan.choices.items()}
    assert sum("@int8" in key for key in plan.choices) == 1  # the lm_head
    return plan


@pytest.mark.slow
def test_compiled_decode_of_a_second_model_or_machine_uses_its_own_graph(tmp_path, monkeypatch):
    """Inductor's on-disk graph cache keyed a frozen graph by its shapes and kept the int4 constants it
    derived from the first model by value: the second model decoded with the first one's weights. Nor
    does it key on the CPU: a graph compiled on one CPU (or under an ISA limit) would be served to
    another (engine.cache_key_pass). A fresh cache directory, so the first compile writes the entry."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engine, "PACKAGE_DECODE_STEPS", False)  # Inductor's graph cache: torch.compile's
    from torch._dynamo.utils import counters
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])  # (1, 11)
    this_machine = kernels.machine_key()
    # The lm_head (int8 in an int4 model) pinned to weight-only int8: a graph names a u8s8 engine's packed
    # weight by a key (quantize._Packed), which holds the weights' digest (engine.name_engine_objects);
    # pinned, the graph is the same whichever path the measurement picks for the decode regime.
    plan = int4_lm_head_on("weight-only", "int8pack_mm")
    hits = []
    for seed, machine in [(1, this_machine), (2, this_machine), (1, this_machine), (1, {"cpu": "another CPU"})]:
        # the third: model 1's weights again, in a model of its own, reuse the entry; the fourth: elsewhere
        model = apply_plan(tiny_model(seed), plan)
        monkeypatch.setattr(kernels, "machine_key", lambda: machine)
        before = counters["inductor"]["fxgraph_cache_hit"]
        compiled, eager = compiled_and_eager_logits(model, ids, prompt_length=4)
        hits.append(counters["inductor"]["fxgraph_cache_hit"] - before)
        difference = ((compiled - eager).abs().max() / eager.abs().max()).item()
        assert difference <= 2 * kernels.TOLERANCE["int4"], f"model {seed}: {difference:.1e}"
    assert hits == [0, 0, 1, 0], dict(counters["inductor"])  # the bypasses and misses, if it fails


@pytest.mark.autotune
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_packaged_decode_step_decodes_as_eager_and_a_later_model_loads_it(precision, monkeypatch):
    """A model load_for_inference would prepare compiles its decode step into a package file
    (engine.PackagedDecodeStep): its logits are the eager step's within the precision's tolerance and it
    decodes the same tokens, left-padded prompts included (bf16: up to near-ties, which its float32
    accumulators may break the other way). A second model with the same weights (a later process)
    loads the file, compiles nothing and decodes what the first did; other weights get another file."""
    from conftest import assert_greedy_up_to_near_ties
    plan = kernels.plan_for(tiny_model(), precision)
    model = apply_plan(tiny_model(), plan)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])  # (1, 11)
    before = set(engine.package_directory().glob("decode-*.pt2"))  # the other precision's, run before
    compiled, eager = compiled_and_eager_logits(model, ids, prompt_length=4)
    assert isinstance(engine._compiled_decode_steps[model], engine.PackagedDecodeStep)
    assert ((compiled - eager).abs().max() / eager.abs().max()).item() <= 2 * kernels.TOLERANCE[precision]
    expected = generate(model, PROMPTS, max_new_tokens=12, compile=True)
    if precision == "float32":
        assert expected == generate(model, PROMPTS, max_new_tokens=12)
    assert_greedy_up_to_near_ties(model, PROMPTS, expected, 2 * kernels.TOLERANCE[precision])
    packages = set(engine.package_directory().glob("decode-*.pt2")) - before
    # one for every batch size, 1 row above and 3 here (engine.PACKAGE_ROWS), unless the plan takes other
    # paths at 1 row than at several (engine.package_rows: then one for each)
    assert len(packages) == (1 if engine.package_rows(model, 1) is None else 2)
    layers = [layer for _, _, layer, _ in linear_layers(model)]
    assert not any("weight" in layer.tensors for layer in layers if layer.format.compile_weight)  # let go

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
    if native_ops.loaded():  # the package calls the op in C++: the Python op's lookup is never reached
        monkeypatch.setattr(quantize, "_packed_object", lambda key: pytest.fail(f"{key} looked up in Python"))
    again = apply_plan(tiny_model(), plan)
    assert generate(again, PROMPTS, max_new_tokens=12, compile=True) == expected
    assert set(engine.package_directory().glob("decode-*.pt2")) - before == packages
    other = apply_plan(tiny_model(seed=2), plan)
    add_compile_weights(other)
    with torch.inference_mode():
        inputs = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), torch.tensor([2]),
                  torch.ones(1, 3, dtype=torch.bool), *[list(KVCache.for_model(model, 1, 4).k)] * 2)
    assert engine.package_path(other, inputs) not in packages and engine.package_path(again, inputs) in packages


@pytest.mark.slow
@pytest.mark.parametrize("case", ["int8", "int4", "int4, u8s8 through its engine"])
def test_a_decode_step_with_u8s8_layers_is_packaged(case, monkeypatch):
    """int8's layers, and int4's int8 lm_head, run eagerly on u8s8 engines, whose packed weights are TorchScript
    objects a package cannot hold. Where oneDNN's u8s8 sums exactly, their compiled paths compute from q and
    its scales (quantize.u8s8_compiles_from_tensors): the whole step packages. Elsewhere (the last case,
    forced) int4's lm_head runs eagerly after the package's ln_f, and int8 goes through torch.compile.
    The logits are the eager step's within the precision's tolerance at 1 row, greedy tokens up to near-ties
    at 1 row and at 3 (the per-row path maps each row onto its own range, the one-scale path all three onto
    one: int8's model holds both, its layer shapes alternating), a later model loads the file and decodes the
    same, and each row count gets a package of its own (engine.ROWS_STATIC_PRECISIONS)."""
    from conftest import assert_greedy_up_to_near_ties
    if case.endswith("through its engine"):
        monkeypatch.setattr(quantize, "u8s8_compiles_from_tensors", lambda: False)
    elif not quantize.u8s8_compiles_from_tensors():
        pytest.skip("oneDNN's u8s8 GEMM does not sum exactly on this CPU: u8s8 layers compile through their engine")
    if not FBGEMM_OFFERED:
        pytest.skip(FBGEMM_SATURATES)
    precision = case[:4]
    if precision == "int8":
        plan = forced_plan(format_object("int8", "dynamic fbgemm"), "u8s8 per row")
        for key in sorted(plan.choices)[::2]:
            plan.choices[key] = kernels.Choice("dynamic fbgemm", dict.fromkeys(kernels.REGIMES, "u8s8 dynamic"), {})
        assert {path for c in plan.choices.values() for path in c.paths.values()} == {"u8s8 per row", "u8s8 dynamic"}
    else:
        plan = int4_lm_head_on("dynamic fbgemm", "u8s8 per row")
    model = apply_plan(tiny_model(), plan)
    outside = case.endswith("through its engine")
    assert engine.lm_head_outside(model) == outside and engine.PackagedDecodeStep.applies(model)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])  # (1, 11)
    compiled, eager = compiled_and_eager_logits(model, ids, prompt_length=4)
    step = engine._compiled_decode_steps[model]
    assert isinstance(step, engine.PackagedDecodeStep)
    tolerance = 2 * kernels.TOLERANCE[precision]
    assert ((compiled - eager).abs().max() / eager.abs().max()).item() <= tolerance
    expected = generate(model, PROMPTS[:3], max_new_tokens=12, compile=True)  # 1 row, then 3
    assert_greedy_up_to_near_ties(model, PROMPTS[:3], expected, tolerance)
    expected = generate(model, PROMPTS[:1], max_new_tokens=12, compile=True)
    assert_greedy_up_to_near_ties(model, PROMPTS[:1], expected, tolerance)
    assert {rows for rows, _ in step.runners} == {1, 3}  # a package for 1 row and one for 3
    assert engine.package_rows(model, 1) == 1 and engine.package_rows(model, 3) == 3
    # a bf16 model whose layers take one path at every regime: one package for 1-32 rows
    bf16 = apply_plan(tiny_model(), forced_plan(format_named("bfloat16", "plain"), "F.linear"))
    assert engine.package_rows(bf16, 1) is None and engine.package_rows(bf16, 3) is None

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
    assert generate(apply_plan(tiny_model(), plan), PROMPTS[:1], max_new_tokens=12, compile=True) == expected


def test_a_corrupt_package_is_compiled_again(monkeypatch, tmp_path, caplog):
    """A package file that does not load (truncated, overwritten) is compiled again, with a warning, and
    the new one replaces it atomically. AOTInductor stands in here for speed: its package is a marker
    file, its runner the eager step (the real one: the test above)."""
    from types import SimpleNamespace
    monkeypatch.setattr(engine, "package_directory", lambda: tmp_path)
    compiled = []

    def compile_package(program, package_path, inductor_configs):
        assert package_path.endswith(".pt2") and not (tmp_path / package_path).name.startswith("decode-")
        compiled.append(package_path)
        (tmp_path / package_path).write_bytes(b"a package")

    def load_package(path):
        if (tmp_path / path).read_bytes() != b"a package":
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        return lambda ids, positions, slot, keys, k, v: engine.decode_step(
            loaded, ids, positions, slot, keys, SimpleNamespace(k=k, v=v))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_package)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", load_package)
    loaded = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "bfloat16"))
    expected = generate(loaded, [PROMPTS[0]], max_new_tokens=8)
    assert generate(loaded, [PROMPTS[0]], max_new_tokens=8, compile=True) == expected
    (package,) = tmp_path.glob("*decode-*")
    package.write_bytes(b"trunc")
    loaded = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "bfloat16"))
    with caplog.at_level(logging.WARNING, logger="gpt2.engine"):
        assert generate(loaded, [PROMPTS[0]], max_new_tokens=8, compile=True) == expected
    assert any("does not load" in r.getMessage() for r in caplog.records) and len(compiled) == 2
    assert list(tmp_path.glob("*decode-*")) == [package] and package.read_bytes() == b"a package"


@pytest.mark.autotune  # the warning names autotuning: only a step whose GEMMs were timed gives it
def test_a_decode_step_compiled_on_a_busy_machine_says_so(monkeypatch, tmp_path, caplog):
    """Compiling the decode step autotunes its GEMMs, which a busy machine times wrong, and the package (or
    Inductor's cache, for torch.compile's graphs) keeps the choice: a warning says so and how to build it
    again. Only where it compiled: a graph taken from Inductor's cache (no miss counted) says nothing.
    AOTInductor and torch.compile stand in here (their packages and graphs: the tests around this one)."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters
    monkeypatch.setattr(engine, "package_directory", lambda: tmp_path)
    def compile_package(program, package_path, inductor_configs):
        (tmp_path / package_path).write_bytes(b"a package")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_package)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: lambda ids, positions, slot, keys, k, v:
                        engine.decode_step(model, ids, positions, slot, keys, SimpleNamespace(k=k, v=v)))
    model = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "bfloat16"))
    expected = generate(model, [PROMPTS[0]], max_new_tokens=6)
    busy_machine(monkeypatch, itertools.repeat(0.9))
    with caplog.at_level(logging.WARNING, logger="gpt2.kernels"):
        assert generate(model, [PROMPTS[0]], max_new_tokens=6, compile=True) == expected
    (warning,) = [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()]
    assert "90% of the CPUs while the decode step was compiled" in warning and "gpt2 cache --clear compiled" in warning

    monkeypatch.setattr(engine, "PACKAGE_DECODE_STEPS", False)  # torch.compile's graph, compiled or from its cache
    for compiles in (1, 0):
        def step(*args):
            counters["inductor"]["fxgraph_cache_miss"] += compiles
            return engine.decode_step(*args)
        model = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "bfloat16"))
        monkeypatch.setitem(engine._compiled_decode_steps, model, step)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gpt2.kernels"):
            assert generate(model, [PROMPTS[0]], max_new_tokens=6, compile=True) == expected
        warnings = [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()]
        assert len(warnings) == compiles and all("Inductor's cache keeps what was chosen" in w for w in warnings)


@pytest.mark.parametrize("precision, fmt, path", [("float32", "mkl", "mkl"), ("float32", "onednn", "onednn"),
                                                   ("bfloat16", "fbgemm fp16", "fbgemm fp16")])
def test_the_weights_digest_names_packed_weights_and_not_their_plain_copies(precision, fmt, path):
    """engine.weights_digest keys packages and cached graphs. The plain copies a compiled step reads
    (add_compile_weights) come and go, so they leave it unchanged; MKL's packed bytes differ between
    two packs of one weight, so its weights are hashed as its GEMM reads them back, as are fbgemm's fp16
    weights, held in no tensor; a model with one other weight (its biases the same) gets another digest."""
    if not any(f.name == fmt for f in formats_for(precision)):
        pytest.skip(f"no {precision} {fmt} format on this machine")

    def packed(nudged: bool = False):
        model = tiny_model()
        if nudged:
            with torch.no_grad():
                model.transformer.h[0].mlp.c_fc.weight[0, 0] += 0.5
        return apply_plan(model, forced_plan(format_named(precision, fmt), path))
    model, again, other = packed(), packed(), packed(nudged=True)
    digest = engine.weights_digest(model)
    add_compile_weights(again)
    assert engine.weights_digest(again) == digest != engine.weights_digest(other)
    quantize.drop_compile_weights(again)
    engine._weights_digests.pop(again)
    assert engine.weights_digest(again) == digest


@pytest.mark.slow
@pytest.mark.parametrize("cause", ["export fails", "memory is short"])
def test_a_step_that_cannot_be_packaged_compiles_through_torch_compile(cause, monkeypatch, tmp_path, caplog):
    """Where export or AOTInductor fails (a format its lowering does not take), or building the package
    would not fit in the memory available (engine.PACKAGE_BUILD_BYTES_PER_WEIGHT_BYTE), the step compiles
    through torch.compile instead, with a warning, and decodes as eager."""
    monkeypatch.setattr(engine, "package_directory", lambda: tmp_path)

    def export(*args, **kwargs):
        raise RuntimeError("an op export does not take")
    if cause == "export fails":
        monkeypatch.setattr(torch.export, "export", export)
    else:  # the bf16 weights need ~6.5x their bytes; 1 MB is less, and the float32 check in add_compile_weights passes
        monkeypatch.setattr(quantize, "available_memory_bytes", lambda: 1e6)
    model = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "bfloat16"))
    with caplog.at_level(logging.WARNING, logger="gpt2.engine"):
        assert generate(model, [PROMPTS[0]], max_new_tokens=8, compile=True) == generate(model, [PROMPTS[0]],
                                                                                        max_new_tokens=8)
    message = "an op export does not take" if cause == "export fails" else "MemoryError: building it needs"
    assert any("could not package" in r.getMessage() and message in r.getMessage() for r in caplog.records)
    assert not isinstance(engine._compiled_decode_steps[model], engine.PackagedDecodeStep)
    assert not list(tmp_path.glob("*decode-*"))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_package_that_would_not_fit_is_not_built_at_any_precision(precision, monkeypatch, tmp_path):
    """The memory a package build needs counts every linear at the bytes it is stored at, int8 and int4 too
    (engine.package_build_bytes: an int8 gpt2-xl's build peaks far above its 1.6 GB of weights); below it,
    nothing is exported and the step goes to torch.compile (the test above)."""
    model = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), precision))
    stored = quantize.linear_weight_bytes(model)
    per_weight = {"float32": 4, "bfloat16": 2, "int8": 1, "int4": 5 / 8}  # int4: 4 bits + 4 bytes a group of 32
    reference = {}
    for _, _, layer, _ in linear_layers(model):
        at = quantize.HEAD_PRECISION.get(precision, precision) if layer is model.lm_head else precision
        reference[at] = reference.get(at, 0) + layer.out_features * layer.in_features * per_weight[at]
    assert stored == pytest.approx(reference)
    needed = engine.package_build_bytes(model)
    assert needed == pytest.approx(sum(engine.PACKAGE_BUILD_BYTES_PER_WEIGHT_BYTE[p] * b for p, b in reference.items()))
    assert needed > 0

    def export(*args, **kwargs):
        raise AssertionError("exported although it would not fit")
    monkeypatch.setattr(torch.export, "export", export)
    monkeypatch.setattr(engine, "package_path", lambda model, inputs: tmp_path / "decode-test.pt2")
    monkeypatch.setattr(quantize, "available_memory_bytes", lambda: 0.99 * needed)
    with pytest.raises(MemoryError, match="building it needs"):
        engine._load_or_build_package(model, None)  # refused before the inputs are read


@needs_fbgemm
def test_u8s8_engines_through_their_custom_op_and_plain_models_compile_through_torch_compile(monkeypatch):
    """Where the u8s8 paths compile through the engine (quantize.u8s8_compiles_from_tensors false), its packed
    weights are TorchScript objects its custom op calls (engine._holds_engine_objects); a plain GPT's weights
    are not packed for inference: neither is packaged."""
    monkeypatch.setattr(quantize, "u8s8_compiles_from_tensors", lambda: False)
    plan = forced_plan(format_object("int8", "dynamic fbgemm"), "u8s8 dynamic")
    assert not engine.PackagedDecodeStep.applies(apply_plan(tiny_model(), plan))
    assert not engine.PackagedDecodeStep.applies(tiny_model())
    bf16 = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "bfloat16"))
    add_compile_weights(bf16)  # the plain weights its compiled paths read, as compiled_decode_step gives them
    assert engine.PackagedDecodeStep.applies(bf16)


@pytest.mark.skipif(not format_object("int8", "fbgemm 7-bit").available(),
                    reason="fbgemm 7-bit is offered where u8s8 saturates at 8 bits only (quantize._engine_available)")
def test_the_7_bit_format_compiles_from_tensors_and_packages(monkeypatch):
    """The "fbgemm 7-bit" layers hold fbgemm's packed object, but their compiled path is int8pack_mm on q and
    its scales (quantize._int8_split), so an int8 model of them packages, its lm_head inside, and its
    compiled path gives int8pack_mm's outputs."""
    monkeypatch.setattr(quantize, "u8s8_compiles_from_tensors", lambda: False)
    model = apply_plan(tiny_model(), forced_plan(format_object("int8", "fbgemm 7-bit"), "u8s8 14-bit per row"))
    assert engine.PackagedDecodeStep.applies(model) and not engine.lm_head_outside(model)
    head = model.lm_head
    x = torch.randn(3, head.in_features)
    compiled = torch.compile(lambda x: quantize._int8_split(x, head.kernel_args, None, None), fullgraph=True)
    assert torch.equal(compiled(x).float(), quantize._int8pack(x, head.kernel_args, None, None).float())


@pytest.mark.slow
def test_a_step_of_fbgemm_fp16_layers_packages_and_a_later_model_finds_their_objects(monkeypatch):
    """fbgemm's fp16 layers compile to fbgemm's GEMM through its op, which names each packed weight by a key
    (quantize._Packed); engine.name_engine_objects keys them by the weights' digest and the layer's name, as
    any process does. The step packages with no plain weight kept, its logits are eager's within bf16's
    tolerance, and a later model of the same weights, whose own objects are the only ones of those names
    (the first model's renamed away, as in another process), loads the package without compiling and
    decodes the same tokens, through the op in C++ (native_ops) where it could be built."""
    from conftest import assert_greedy_up_to_near_ties
    if not any(f.name == "fbgemm fp16" for f in formats_for("bfloat16")):
        pytest.skip("no fbgemm fp16 format on this machine")
    plan = forced_plan(format_named("bfloat16", "fbgemm fp16"), "fbgemm fp16")
    model = apply_plan(tiny_model(), plan)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])  # (1, 11)
    compiled, eager = compiled_and_eager_logits(model, ids, prompt_length=4)
    assert isinstance(engine._compiled_decode_steps[model], engine.PackagedDecodeStep)
    tolerance = 2 * kernels.TOLERANCE["bfloat16"]
    assert ((compiled - eager).abs().max() / eager.abs().max()).item() <= tolerance
    layers = [layer for _, _, layer, _ in linear_layers(model)]
    assert all(layer.format.name == "fbgemm fp16" and "weight" not in layer.tensors for layer in layers)
    expected = generate(model, PROMPTS, max_new_tokens=12, compile=True)
    assert_greedy_up_to_near_ties(model, PROMPTS, expected, tolerance)
    keys = {layer.kernel_args["packed_key"] for layer in layers}
    assert all(key.startswith(engine.weights_digest(model)) for key in keys)
    for layer in layers:
        layer.name_engine_objects("renamed away")

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
    if native_ops.loaded():  # the package calls the op in C++: the Python op's lookup is never reached
        monkeypatch.setattr(quantize, "_packed_object", lambda key: pytest.fail(f"{key} looked up in Python"))
    again = apply_plan(tiny_model(), plan)
    assert generate(again, PROMPTS, max_new_tokens=12, compile=True) == expected
    assert {layer.kernel_args["packed_key"] for _, _, layer, _ in linear_layers(again)} == keys


@pytest.mark.autotune
@pytest.mark.slow
def test_compiled_decode_of_every_format_equals_eager(monkeypatch):
    """Every format of every precision and each of its decode paths, forced on its own layers (the
    measured plan differs from run to run, and each must compile: MKL-packed weights, oneDNN's, the
    int4 kernel's and the u8s8 engines' TorchScript objects behind their custom op). One model per
    precision holds them all, layer by layer (mixed_model): a compile costs 5-50 s here, one per
    (format, path) took ~20 of them.

    On a CPU the compiled step may compute a GEMM with Inductor's own template instead of the eager
    path's kernel (engine.compile_options), with its own order of summation and its own bf16 rounding
    of the output: each step's logits are then within twice the precision's kernel tolerance of the
    eager ones (each of the two within one of the exact product), and float32's pick the same token at
    every step (its greedy decode compiled and eager: a batch of left-padded prompts compiled another
    graph, ~40 s more here, which test_a_packaged_decode_step... and test_batching's compiled tests do)."""
    monkeypatch.setattr(engine, "PACKAGE_DECODE_STEPS", False)  # torch.compile: packages take longer to build
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2] + [77, 150, 33, 9, 260]])  # (1, 16)
    def parts_kernels(fmt):  # a combined format's paths that are its parts' own: compiled there already
        return {k for part in fmt.parts for k in format_named(fmt.precision, part).paths.values()}
    pairs = [(f, p) for f in CPU_FORMATS if f.available() for p in f.paths
             if p not in f.many_row_paths and f.paths[p] not in parts_kernels(f)]
    for precision in PRECISIONS:
        model, placed = mixed_model([(f, p) for f, p in pairs if f.precision == precision])
        compiled, eager = compiled_and_eager_logits(model, ids, prompt_length=4)
        tolerance = 2 * kernels.TOLERANCE[precision]
        difference = ((compiled - eager).abs().max() / eager.abs().max()).item()
        assert difference <= tolerance, f"{precision} {placed}: {difference:.1e}"
        if precision == "float32":
            assert torch.equal(compiled.argmax(-1), eager.argmax(-1)), placed


def mixed_model(pairs: list[tuple]) -> tuple[GPT, list[str]]:
    """tiny_model, with (format, path) pairs of one precision forced in turn on its linears (each pair on
    at least one: there are more linears than pairs), and what went where, to name in a failure."""
    model = tiny_model(n_layer=max(CONFIG.n_layer, math.ceil((len(pairs) - 1) / 4))).float()
    layers = quantize.linear_layers(model)
    assert len(layers) >= len(pairs)
    plans = [forced_plan(fmt, path, model) for fmt, path in pairs]  # each read from the plan cache once
    placed = []
    for i, (parent, attr, linear, activation) in enumerate(layers):
        (fmt, path), plan = pairs[i % len(pairs)], plans[i % len(pairs)]
        quantize.place_planned_linear(plan, parent, attr, linear.weight, linear.bias, activation, "cpu")
        placed.append(f"{attr}: {fmt.name} {path}")
    quantize.embedding_to_bf16(model)
    return model.eval(), placed


# --- the KV cache's dtype (load_for_inference's kv_dtype="auto") -----------------------------------

def forced_plan(fmt, path: str, model: GPT | None = None) -> kernels.Plan:
    """model's plan (tiny_model's by default) with every linear of fmt's precision in fmt, on path at every
    regime."""
    plan = kernels.plan_for(model or tiny_model(), fmt.precision)
    plan.choices = {k: c if "@" in k else kernels.Choice(fmt.name, {r: path for r in kernels.REGIMES}, {})
                    for k, c in plan.choices.items()}  # "@": int4's int8 lm_head keeps its own
    return plan


def test_keys_are_bf16_exactly_where_every_c_attn_path_returns_bf16():
    """Where keys_are_bf16 says so, every key and value a float32 cache holds, after a prefill (many-row
    paths) and decode steps (one row), is a bf16 number: a bf16 cache would hold them exactly. Where it
    does not, some are not, so the check is what keeps a bf16 cache from rounding them."""
    from gpt2.kv_cache import KVCache
    from gpt2.quantize import keys_are_bf16, plan_keys_are_bf16
    ids = torch.tensor([PROMPTS[0] * 6])  # (1, 42): a prefill of 38 rows, then 4 decode steps
    seen = set()
    for fmt, path in [(f, p) for f in CPU_FORMATS if f.available() for p in f.paths if not f.parts]:
        plan = forced_plan(fmt, path)
        model = apply_plan(tiny_model(), plan)
        cache = KVCache.for_model(model, 1, ids.size(1), dtype=torch.float32)
        with torch.inference_mode():
            model(ids[:, :38], cache=cache)
            for t in range(38, ids.size(1)):
                model(ids[:, t:t + 1], cache=cache)
        lossless = all(torch.equal(x, x.bfloat16().float()) for x in cache.k + cache.v)
        assert keys_are_bf16(model) == lossless, f"{fmt.precision} {fmt.name} {path}"
        # gpt2 info --kernels decides from the plan alone, without the model (on the meta device there)
        assert plan_keys_are_bf16(plan, model.config) == lossless, f"{fmt.precision} {fmt.name} {path}"
        seen.add((fmt.precision, lossless))
    # int8's c_attn rounds to bf16 whatever its path (quantize.ROUNDS_KEYS_TO); float32 keeps its keys
    assert {("int4", True), ("bfloat16", True), ("float32", False), ("int8", True)} <= seen
    assert ("int8", False) not in seen


def test_auto_kv_dtype_is_bf16_only_where_lossless_and_measured_no_slower(monkeypatch, tmp_path):
    calls = []
    costs = {"float32": 10.0, "bfloat16": 6.0}
    monkeypatch.setattr(kernels, "measure_kv_dtypes", lambda *shape: calls.append(shape) or dict(costs))
    int4 = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "int4"))
    assert kernels.kv_cache_dtype(int4)[0] == torch.bfloat16 and calls == [(4, 16)]
    dtype, why = kernels.kv_cache_dtype(int4)
    assert dtype == torch.bfloat16 and why.startswith("cache") and len(calls) == 1  # measured once
    int8 = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "int8"))  # c_attn rounds to bf16
    assert kernels.kv_cache_dtype(int8)[0] == torch.bfloat16 and len(calls) == 1
    model = apply_plan(tiny_model(), kernels.plan_for(tiny_model(), "float32"))  # exact keys: nothing is measured
    dtype, why = kernels.kv_cache_dtype(model)
    assert dtype == torch.float32 and "round" in why and len(calls) == 1
    costs["bfloat16"] = 11.0  # a CPU whose bf16 attention is slower: measured afresh, float32 kept
    monkeypatch.setattr(kernels, "default_cache_path", lambda: tmp_path / "another machine" / "kernels.json")
    assert kernels.kv_cache_dtype(int4)[0] == torch.float32 and len(calls) == 2
    # a compiled step's attention is timed apart (its own measurement and cache entry): the Zen 4's case,
    # eager bf16 SDPA slower and a compiled step's attention over a bf16 cache faster
    compiled_calls = []
    monkeypatch.setattr(kernels, "measure_compiled_kv_dtypes",
                        lambda *shape: compiled_calls.append(shape) or {"float32": 10.0, "bfloat16": 6.0})
    dtype, why = kernels.kv_cache_dtype(int4, compiled=True)
    assert dtype == torch.bfloat16 and why.startswith("measured: compiled") and compiled_calls == [(4, 16)]
    assert kernels.kv_cache_dtype(int4, compiled=True)[0] == torch.bfloat16 and len(compiled_calls) == 1
    assert kernels.kv_cache_dtype(int4)[0] == torch.float32 and len(calls) == 2  # the eager entry unchanged
    assert kernels.kv_cache_dtype(model, compiled=True)[0] == torch.float32 and len(compiled_calls) == 1


def test_info_kernels_shows_the_kv_dtype_load_for_inference_takes(tmp_path, monkeypatch, capsys):
    """gpt2 info --kernels builds its model on the meta device; its KV line must still say what
    load_for_inference's kv_dtype="auto" takes for the same model on this CPU, in text and in JSON."""
    import json

    from conftest import save_hf_model
    from gpt2.cli import main
    from gpt2.kv_cache import cache_dtype
    from gpt2.quantize import load_for_inference
    save_hf_model(tmp_path / "m", n_embd=64, n_head=4)  # int4 groups of 32 along n_embd
    precisions = ["int4", "bfloat16", "float32", "int8"]
    monkeypatch.setattr(kernels, "default_cache_path", lambda: tmp_path / "cache" / "kernels.json")
    for costs in ({"float32": 2.0, "bfloat16": 1.0}, {"float32": 1.0, "bfloat16": 2.0}):  # bf16 faster, slower
        (tmp_path / "cache" / "attention.json").unlink(missing_ok=True)  # measured again; the plans kept
        monkeypatch.setattr(kernels, "measure_kv_dtypes", lambda *shape: dict(costs))
        # a compiled step's attention the other way round (an AMD EPYC Zen 4's case)
        monkeypatch.setattr(kernels, "measure_compiled_kv_dtypes",
                            lambda *shape: {"float32": costs["bfloat16"], "bfloat16": costs["float32"]})
        assert main(["info", str(tmp_path / "m"), "--kernels", "--json"]
                    + [a for p in precisions for a in ("--kernels-dtype", p)]) == 0
        shown = json.loads(capsys.readouterr().out)["kernels"]
        assert main(["info", str(tmp_path / "m"), "--kernels", "--kernels-dtype", "int4"]) == 0
        lines = [x for x in capsys.readouterr().out.splitlines() if "KV cache" in x]
        for precision in precisions:
            model = load_for_inference(tmp_path / "m", precision, "cpu")
            assert shown[precision]["kv_cache"]["dtype"] == str(model.kv_dtype).removeprefix("torch."), precision
            compiled = str(cache_dtype(model, compiled=True)).removeprefix("torch.")  # as a compiled step allocates
            assert shown[precision]["kv_cache_compiled"]["dtype"] == compiled, (precision, costs)
        assert len(lines) == 2 and shown["int4"]["kv_cache"]["dtype"] in lines[0] and "compiled" not in lines[0]
        assert "compiled" in lines[1] and shown["int4"]["kv_cache_compiled"]["dtype"] in lines[1]
        assert shown["int4"]["kv_cache_compiled"]["dtype"] != shown["int4"]["kv_cache"]["dtype"]
        assert shown["int4"]["kv_cache"]["dtype"] == ("bfloat16" if costs["bfloat16"] < costs["float32"] else "float32")
        assert shown["float32"]["kv_cache"]["dtype"] == "float32"


def test_a_compiled_step_reads_a_cache_of_the_dtype_timed_for_it(tmp_path, monkeypatch):
    """kv_dtype="auto" times a compiled step's attention apart from the eager step's. Where they disagree (an
    AMD EPYC Zen 4: eager bf16 SDPA slower, a compiled step's loops faster over bf16), an eager stream's
    cache is float32 and a compiled one's bf16, in generate and in the server's scheduler, and compiled
    generation still equals the naive forward (up to ties: the keys are bf16 numbers either way)."""
    from conftest import save_hf_model
    from gpt2.batching import Scheduler
    from gpt2.quantize import load_for_inference
    save_hf_model(tmp_path / "m", n_embd=64, n_head=4, vocab_size=300)  # int4 groups of 32 along n_embd; PROMPTS' ids
    monkeypatch.setattr(kernels, "measure_kv_dtypes", lambda *shape: {"float32": 1.0, "bfloat16": 2.0})
    compiled_calls = []
    monkeypatch.setattr(kernels, "measure_compiled_kv_dtypes",
                        lambda *shape: compiled_calls.append(shape) or {"float32": 2.0, "bfloat16": 1.0})
    monkeypatch.setattr(engine, "PACKAGE_DECODE_STEPS", False)  # torch.compile's graph: the same cache, built faster
    model = load_for_inference(tmp_path / "m", "int4", "cpu")
    assert model.kv_dtype == torch.float32 and compiled_calls == []  # timed when a compiled step needs a cache
    allocated = []
    for_model = KVCache.for_model.__func__
    monkeypatch.setattr(KVCache, "for_model", classmethod(
        lambda cls, *args, **kw: allocated.append(for_model(cls, *args, **kw)) or allocated[-1]))
    eager = generate(model, PROMPTS, max_new_tokens=8)
    compiled = generate(model, PROMPTS, max_new_tokens=8, compile=True)
    assert [cache.k[0].dtype for cache in allocated] == [torch.float32, torch.bfloat16]
    assert compiled_calls == [(4, 16)] and model.compiled_kv_dtype == torch.bfloat16
    assert_equal_up_to_ties(model, compiled, generate_naive(model, PROMPTS, max_new_tokens=8))
    assert_equal_up_to_ties(model, eager, generate_naive(model, PROMPTS, max_new_tokens=8))
    assert Scheduler(model, compile=True).kv.dtype == torch.bfloat16 and Scheduler(model).kv.dtype == torch.float32
    asked = load_for_inference(tmp_path / "m", "int4", "cpu", kv_dtype="float32")  # as asked, compiled or not
    assert KVCache.for_model(asked, 1, 4, compiled=True).k[0].dtype == torch.float32 and len(compiled_calls) == 1


def test_measuring_kv_dtypes_times_both_caches():
    costs = kernels.measure_kv_dtypes(4, 16)
    assert set(costs) == {"float32", "bfloat16"} and all(0 < us < 1e5 for us in costs.values())


def test_measuring_a_compiled_steps_kv_dtypes_compiles_its_attention():
    """The compiled measurement times a compiled decode step's attention: the model's own explicit attention
    under torch.compile, the float32 query over the cache upcast as it is read. It equals SDPA over the
    float32 keys."""
    import torch.nn.functional as F
    from gpt2.model import CausalSelfAttention, GPTConfig
    attention = CausalSelfAttention(GPTConfig(n_layer=1, n_head=4, n_embd=64), 0).eval()
    attend = kernels.compiled_one_query_attention()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 16, generator=g)
    k, v = (torch.randn(3, 4, 40, 16, generator=g).bfloat16() for _ in range(2))
    mask = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :7] = False  # left padding
    with torch.inference_mode():
        expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        torch.testing.assert_close(attend(attention, q, k, v, mask).double(), expected, rtol=1e-5, atol=1e-6)
    costs = kernels.measure_compiled_kv_dtypes(4, 16)
    assert set(costs) == {"float32", "bfloat16"} and all(0 < us < 1e5 for us in costs.values())
    # 4 graphs a measurement, each in code of its own: Dynamo allows one code object 8
    codes = [kernels.compiled_one_query_attention()._torchdynamo_orig_callable.__code__ for _ in range(3)]
    assert len({id(code) for code in codes}) == 3  # distinct objects (equal code compares equal)



def test_load_for_inference_takes_auto_float32_or_bfloat16_kv(tmp_path, monkeypatch):
    from conftest import save_hf_model
    from gpt2.errors import ConfigError
    from gpt2.quantize import load_for_inference
    save_hf_model(tmp_path / "m", n_embd=64, n_head=4)  # int4 groups of 32 along n_embd
    monkeypatch.setattr(kernels, "measure_kv_dtypes", lambda *shape: {"float32": 2.0, "bfloat16": 1.0})
    assert load_for_inference(tmp_path / "m", "int4", "cpu").kv_dtype == torch.bfloat16  # auto, the default
    assert load_for_inference(tmp_path / "m", "int8", "cpu").kv_dtype == torch.bfloat16  # its keys are rounded
    assert load_for_inference(tmp_path / "m", "float32", "cpu").kv_dtype == torch.float32
    assert load_for_inference(tmp_path / "m", "int4", "cpu", kv_dtype="float32").kv_dtype == torch.float32
    assert load_for_inference(tmp_path / "m", "float32", "cpu", kv_dtype="bfloat16").kv_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="kv_dtype 'float16'"):
        load_for_inference(tmp_path / "m", "int4", "cpu", kv_dtype="float16")
