"""Inference weight formats (float32, bfloat16, int8, int4) and loading a model for inference.

    from gpt2.quantize import load_for_inference
    model = load_for_inference("gpt2", "int8")        # kernels measured on this CPU (kernels.py), then cached

    gpt2 generate --model gpt2 --dtype int4 "Hello" --verbose     # --verbose shows the chosen kernels

Decoding one token reads every weight once, so on a CPU its speed is set by the bytes of weights per
token (float32 4, bfloat16 2, int8 1, int4 0.5 + scales) and by how close a kernel reads them to the
memory bandwidth. Prefill is a GEMM over hundreds of rows, bound by FLOPs instead. Which kernel is
fastest for each differs from CPU to CPU, so this file only says what each format stores and which
kernels (paths) can compute with it; kernels.py measures them on the machine and picks.

A WeightFormat packs a linear's float32 weight (N, K) once into its tensors, and offers paths:
functions (x (M, K), tensors) -> y (M, N). Every path of a format computes with the same weights, so
`reference_weight` (those weights dequantized to float64) is the reference each path is checked against.

  float32   plain (F.linear), onednn (weight reordered for oneDNN), mkl (weight packed for MKL)
  bfloat16  plain (F.linear), onednn; either multiplied in float32 for many rows, where bf16 GEMMs are
            slow (no AVX512_BF16: the weight made float32 per call, from its packed copy for onednn);
            fbgemm fp16 (the bf16 weights held as float16, exactly but for the tiniest, for fbgemm's GEMM)
  int8      per output channel, w = q * s (symmetric):
              weight-only: _weight_int8pack_mm (bf16 activations), or dequantize + bf16/fp32 GEMM;
              dynamic: fbgemm's / oneDNN's u8s8 GEMM (VNNI) with the activations quantized per token,
              as llama.cpp's Q8_0 does (the kernel takes one scale per call: for several rows each row
              is first mapped onto [0, 1] by its own min and max, "u8s8 per row"); or both engines'
              packings of one q and s in one layer, each regime taking the faster engine (kernels.py
              keeps it only where it gains enough for its second packed copy); a compiled step computes
              the same integers from q and s through PT2E's quantize/dequantize ops (_u8s8_from_tensors);
              where u8s8 saturates at 8 bits (AVX2 without VNNI): fbgemm's GEMM at 7 bits, x quantized per
              row to 14 bits in two 7-bit halves, rows of one call ("u8s8 14-bit per row", _int8_split)
  int4      per group of 32 along K, w = (q - 8) * s + z (asymmetric, PyTorch's tinygemm convention; s and
            z searched per group for the least |w|-weighted squared error, the result cached on disk):
              _weight_int4pack_mm_for_cpu (bf16 activations) on CPU, or for long prefills its packed
              weight dequantized to bf16 or float32 once per call, a block of rows at a time, for GEMMs;
              elsewhere the nibbles are dequantized for a bf16 GEMM

The lm_head is quantized too; an int4 model keeps it at int8 (HEAD_PRECISION); a bf16 one computes its
logits around an estimate of each row's largest (CENTERED_LOGITS). Below float32 the token embedding
(wte, tied to the lm_head) is a bf16 table (embedding_to_bf16). Activations around the linears
stay float32 at every precision (kernel_dtype); int8's c_attn rounds q, k and v to bf16 (ROUNDS_KEYS_TO),
as the bf16 and int4 kernels return them.
The activation of c_fc (GELU) is fused into the GEMM as a oneDNN post-op where the path allows.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import itertools
import logging
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import xxhash

from gpt2.atomic import atomic_write_bytes
from gpt2.errors import ConfigError
from gpt2 import native_ops
from gpt2.huge_pages import collapsing_what_loads
from gpt2.user_cache import default_cache_dir, drop_least_recently_used, mark_used

log = logging.getLogger(__name__)

PRECISIONS = ("float32", "bfloat16", "int8", "int4")
INT4_GROUP = 32  # Q4_0's block size; 4 bytes of scale + zero per 32 weights: 5 bits per weight in all

# A path: (x (M, K) in the compute dtype, tensors, bias or None, activation or None) -> y (M, N).
Path = Callable[[torch.Tensor, dict, "torch.Tensor | None", "str | None"], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# quantizers: float weights -> integers and scales
# ---------------------------------------------------------------------------------------------

def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> q (N, K) int8, scales (N,) float32 with w ~= q * scales[:, None]."""
    w = w.detach().float()
    # max |w| without making |w|: a temporary as large as w, whose fresh pages cost 3.4 s of gpt2-xl's load
    scales = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg()).clamp(min=1e-12) / 127.0  # (N,)
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for rows in row_blocks(w):  # no float32 temporary as large as w (the lm_head's: 154 MB for gpt2)
        q[rows] = (w[rows] / scales[rows, None]).round_().clamp_(-127, 127)  # in place: 2.3x faster
    return q, scales


def row_blocks(t: torch.Tensor, elements: int = 1 << 20) -> list[slice]:
    """t (N, K)'s rows as slices of about `elements` each: a pass one block at a time holds no temporary
    the size of t."""
    rows = max(1, elements // max(1, t.size(1)))
    return [slice(start, start + rows) for start in range(0, t.size(0), rows)]


# The spans searched per int4 group, as fractions of its [min, max] (quantize_int4_groups). 16 levels over
# exactly [min, max] spend two on the group's extremes; over a span a little narrower or wider, refitted by
# least squares to the levels the weights round to, the error falls, as llama.cpp's k-quants search their
# scales. Plain squared error (0.83x [min, max]'s on Gaussian weights) moved the predictions less than the
# weights: three quickstart models' block KL divergence from float32 by -7% to +7%. Each weight's error
# weighted by its |w| (k-quants weight by rms + |w| without an importance matrix): a large weight's error
# moves the outputs more: block KL 2-15% below [min, max]'s, 1-16% below the plain search's and 9-36% below
# llama.cpp's Q4_0 on all three, val and train (BENCHMARKS.md, int4_error_anatomy.py). ~13 ns a weight at load
# (GPT-2 124M 0.6 -> 2.5 s, gpt2-xl ~12 -> 32-49 s), paid once per weight: the result is cached (below).
INT4_SPANS = torch.linspace(0.85, 1.15, 7).tolist()
INT4_SEARCH_BLOCK = 1 << 18  # weights searched at a time


def quantize_int4_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> q (N, K) int32 in [0, 15], scales_zeros (K/group, N, 2) with w ~= (q - 8) * s + z.

    Per group, 16 levels s L + m (L = 0..15): for each span of INT4_SPANS, the levels are laid from the
    group's min over that fraction of its range, each weight takes its nearest, and (s, m) is refitted by
    least squares to the levels taken, each weight's squared error weighted by |w|; the fit of least
    weighted error is kept. s and z = m + 8 s are
    rounded to bf16 (what the kernels read) before each weight is rounded to its nearest level. Each row is
    quantized on its own: the same rows give the same q and scales_zeros in any batch of rows.
    """
    N, K = w.shape
    if K % group:
        raise ConfigError(f"int4 needs in_features divisible by {group}, got {K}")
    q = torch.empty(N, K, dtype=torch.int32, device=w.device)
    scales_zeros = torch.empty(K // group, N, 2, device=w.device)
    for rows in row_blocks(w, INT4_SEARCH_BLOCK):  # a block at a time: its passes over the spans stay in cache
        q[rows], scales_zeros[:, rows] = _int4_search(w[rows].detach().float().view(-1, K // group, group))
    return q, scales_zeros


def _int4_search(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g (n, K/group, group) float32 -> q (n, K) int32, scales_zeros (K/group, n, 2): quantize_int4_groups."""
    lo = g.amin(-1, keepdim=True)  # (n, K/group, 1)
    span = (g.amax(-1, keepdim=True) - lo).clamp_(min=1e-12)
    # Each weight's squared error counts |w| times (above INT4_SPANS): the fit favours the large weights.
    importance = g.abs().add_(span * 1e-6)  # (n, K/group, group), > 0 so every group has weight
    sum_c = importance.sum(-1, keepdim=True)
    sum_cw = torch.linalg.vecdot(importance, g).unsqueeze(-1)
    unit = (g - lo).div_(span)  # each weight's place in its group's [min, max], in [0, 1]
    levels, weighted = torch.empty_like(g), torch.empty_like(g)
    fits = []
    for fraction in INT4_SPANS:
        torch.mul(unit, 15 / fraction, out=levels).round_()  # L (n, K/group, group)
        if fraction < 1:  # the span narrower than the range: the top weights clip to the top level
            levels.clamp_(max=15)
        torch.mul(levels, importance, out=weighted)  # c L
        sum_cl = weighted.sum(-1, keepdim=True)
        sum_cll = torch.linalg.vecdot(weighted, levels).unsqueeze(-1)
        sum_clw = torch.linalg.vecdot(weighted, g).unsqueeze(-1)
        # Weighted least squares of w ~ s L + m. The determinant is 0 where every weight took one level
        # (then s = 0 and m is their weighted mean); below 1e-6 of its scale it is that case's rounding.
        determinant = sum_c * sum_cll - sum_cl * sum_cl
        s = (sum_c * sum_clw - sum_cl * sum_cw).div_(determinant.clamp(min=1e-30))
        s.masked_fill_(determinant <= 1e-6 * sum_c * sum_cll, 0)
        m = (sum_cw - s * sum_cl).div_(sum_c)
        fits.append((s, m, s * sum_clw + m * sum_cw))  # sum c w^2 less the fit's weighted squared error
    s, m, explained = (torch.cat(parts, dim=-1) for parts in zip(*fits))  # (n, K/group, spans)
    best = explained.argmax(-1, keepdim=True)
    s = s.gather(-1, best).clamp_(min=1e-12).to(torch.bfloat16).float()  # (n, K/group, 1)
    z = (m.gather(-1, best) + 8 * s).to(torch.bfloat16).float()
    q = torch.sub(g, z, out=levels).div_(s).add_(8).round_().clamp_(0, 15)
    return q.flatten(1).to(torch.int32), torch.cat([s, z], dim=-1).transpose(0, 1)


def int4_values(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """q (N, K) in [0, 15], scales_zeros (K/group, N, 2) -> the weights (q - 8) s + z (N, K), in float64."""
    N, K = q.shape
    sz = scales_zeros.transpose(0, 1).double()  # (N, K/group, 2)
    return ((q.view(N, K // INT4_GROUP, -1).double() - 8) * sz[..., :1] + sz[..., 1:]).view(N, K)


def int4_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) in [0, 15] -> (N, K/2) uint8, q[:, 2j] in the low nibble and q[:, 2j+1] in the high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def int4_from_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """int4_nibbles' inverse: (N, K/2) uint8 -> q (N, K) uint8."""
    return torch.stack((nibbles & 15, nibbles >> 4), dim=-1).view(nibbles.size(0), -1)


# int4's search costs ~13 ns a weight and depends only on the weight: _pack_int4 keeps its result in the
# user's cache, named by a hash of the weight's bytes, and a later load of the same checkpoint reads it
# back instead of searching again (0.625 B a weight on disk, gpt2-xl's 0.9 GB; loading at int4, GPT-2 124M
# 2.4-2.6 -> 1.3 s, gpt2-xl 32-49 -> 11 s). Each int4 load then drops the least recently used entries
# beyond INT4_CACHE_BYTES (user_cache.py). Delete the directory at any time; loads refill it.
INT4_CACHE_BYTES = 4 << 30  # about four gpt2-xl models' entries (0.93 GB each)


def int4_cache_directory() -> Path:
    """Where quantize_int4_groups_cached keeps its results: $XDG_CACHE_HOME/gpt2/int4 (~/.cache/gpt2/int4)."""
    return default_cache_dir() / "int4"


def prune_int4_cache(used_since: float) -> int:
    """Drop the least recently used int4 entries beyond INT4_CACHE_BYTES, none read or written since
    used_since (time.time()); the bytes dropped."""
    return drop_least_recently_used(int4_cache_directory().glob("*/*.safetensors"), INT4_CACHE_BYTES, used_since)


@functools.cache
def _int4_quantizer_key() -> str | None:
    """What a cached result depends on besides the weight: the quantizer's code and spans, torch and the
    CPU (its kernels round: a result from another machine could differ at a tie). None, and nothing is
    cached, where the quantizer's source cannot be read (then an edit to it could not be noticed)."""
    import inspect
    from gpt2.kernels import machine_key
    try:
        source = "".join(inspect.getsource(f) for f in (quantize_int4_groups, _int4_search))
    except OSError:
        return None
    machine = {k: v for k, v in machine_key().items() if k != "threads"}  # each group is one thread's
    return xxhash.xxh3_128_hexdigest(f"{source}|{INT4_SPANS}|{INT4_GROUP}|{sorted(machine.items())}".encode())


def quantize_int4_groups_cached(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int4_groups(w), read from int4_cache_directory() where these very weights were quantized
    before by this quantizer on this machine, else computed and written there (atomically). An entry that
    does not read back as written (truncated, corrupt, another shape) is ignored with a warning, then
    recomputed and replaced; a cache that cannot be written costs only the next load's time."""
    quantizer = _int4_quantizer_key()
    if w.device.type != "cpu" or quantizer is None:
        return quantize_int4_groups(w)
    w = w.detach().float().contiguous()
    digest = xxhash.xxh3_128(f"{quantizer}|{tuple(w.shape)}|".encode())
    digest.update(w.numpy().data.cast("B"))  # (N, K) float32: ~12 GB/s, 3% of the search's cost
    key = digest.hexdigest()
    path = int4_cache_directory() / key[:2] / f"{key}.safetensors"
    if path.exists():
        try:
            entry = _read_int4_entry(path, *w.shape)
            mark_used(path)
            return entry
        except Exception as e:  # noqa: BLE001 - whatever a damaged file raises, the weight is quantized again
            log.warning("ignoring the int4 cache entry %s (%s); quantizing again", path, e)
    q, scales_zeros = quantize_int4_groups(w)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_int4_entry(path, q, scales_zeros)
    except OSError as e:
        log.warning("could not write the int4 cache entry %s: %s", path, e)
    return q, scales_zeros


def _int4_entry_checksum(nibbles: torch.Tensor, scales_zeros: torch.Tensor) -> str:
    digest = xxhash.xxh3_128(nibbles.numpy().data.cast("B"))
    digest.update(scales_zeros.view(torch.int16).numpy().data.cast("B"))  # bf16's bits
    return digest.hexdigest()


def _write_int4_entry(path: Path, q: torch.Tensor, scales_zeros: torch.Tensor) -> None:
    """q (N, K) in [0, 15] as nibbles (N, K/2) uint8, scales_zeros (bf16 numbers) as bf16, and a checksum."""
    from safetensors.torch import save_file
    sz = scales_zeros.to(torch.bfloat16).contiguous()  # exact: quantize_int4_groups rounds s and z to bf16
    tensors = {"nibbles": int4_nibbles(q).contiguous(), "scales_zeros": sz}
    checksum = _int4_entry_checksum(*tensors.values())
    atomic_write_bytes(path, lambda tmp: save_file(tensors, tmp, metadata={"checksum": checksum}))


def _read_int4_entry(path: Path, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, K) int32, scales_zeros (K/group, N, 2) float32) from an entry _write_int4_entry wrote; raises
    ValueError for anything else."""
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        checksum = (f.metadata() or {}).get("checksum")
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    nibbles, sz = tensors.get("nibbles"), tensors.get("scales_zeros")
    if (set(tensors) != {"nibbles", "scales_zeros"} or nibbles.dtype != torch.uint8 or sz.dtype != torch.bfloat16
            or nibbles.shape != (N, K // 2) or sz.shape != (K // INT4_GROUP, N, 2)):
        found = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        raise ValueError(f"not an int4 entry for a {N}x{K} weight: {found}")
    if checksum != _int4_entry_checksum(nibbles, sz):
        raise ValueError("checksum mismatch")
    return int4_from_nibbles(nibbles).to(torch.int32), sz.float()


def _int4_dequantize(nibbles: torch.Tensor, scales_zeros: torch.Tensor, dtype) -> torch.Tensor:
    """nibbles (N, K/2) uint8 (q[:, 2j] low, q[:, 2j+1] high) -> w (N, K) in dtype."""
    N = nibbles.size(0)
    q = int4_from_nibbles(nibbles)  # (N, K)
    G = scales_zeros.size(0)
    sz = scales_zeros.to(dtype).transpose(0, 1)  # (N, K/group, 2)
    w = (q.view(N, G, -1).to(dtype) - 8) * sz[..., :1] + sz[..., 1:]
    return w.view(N, -1)


# ---------------------------------------------------------------------------------------------
# paths: the kernels, each (x, tensors, bias, activation) -> y
# A path casts x for its kernel (a no-op when it already is) and returns y in the kernel's own dtype:
# FastLinear does no casting of its own, so a float32 x meets a u8s8 kernel (which quantizes float32)
# with no round trip through bf16, and the lm_head's float32 logits are never rounded to bf16.
# ---------------------------------------------------------------------------------------------

def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.gelu(y, approximate="tanh")


def _plain(x, t, bias, activation):
    return _act(F.linear(x.to(t["weight"].dtype), t["weight"], bias), activation)


def _upcast(x, t, bias, activation):
    """bf16 weights multiplied in float32: faster where a CPU's bf16 GEMM is slow (no native bf16)."""
    return _float32_gemm(x, t["weight"].float(), bias, activation)


def _float32_gemm(x, w, bias, activation):
    """x and the bias made float32, times w (N, K) float32: the float32-GEMM paths of the bf16 formats."""
    return _act(F.linear(x.float(), w, None if bias is None else bias.float()), activation)


def _onednn(x, t, bias, activation):
    if torch.compiler.is_compiling() and "weight" in t:  # the plain weight, given back for compiling:
        # Inductor packs it its own way (oneDNN's, or its GEMM template's); torch.export cannot trace
        # oneDNN's opaque packed tensor (engine.PackagedDecodeStep)
        return _plain(x, t, bias, activation)
    x = x.to(t["onednn"].dtype)
    if activation is None:
        return torch.ops.mkldnn._linear_pointwise(x, t["onednn"], bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x, t["onednn"], bias, "gelu", [], "tanh")  # fused post-op


def _onednn_upcast(x, t, bias, activation):
    """The packed bf16 weight read back as float32 (one reorder a call, exact) and multiplied in float32:
    for many rows where bf16 GEMMs are slow. On an Intel Xeon without AVX512_BF16 (Ice Lake), 512 rows of
    3072x768 took 42 ms through oneDNN's bf16 kernel and 11.4 ms this way, the reorder 0.6 ms of it."""
    if torch.compiler.is_compiling() and "weight" in t:  # the plain weight, given back for compiling
        return _upcast(x, t, bias, activation)
    return _float32_gemm(x, t["onednn"].to_dense(torch.float32), bias, activation)


def _mkl(x, t, bias, activation):
    if torch.compiler.is_compiling():  # Inductor lowers _mkl_linear only for weights it packed itself:
        if "weight" in t:  # the plain weight, given back for compiling (add_compile_weights)
            return _plain(x, t, bias, activation)
        return _act(mkl_linear_op(x, t["mkl"], list(t["shape"].shape), bias), activation)  # where it would not fit
    return _act(_mkl_linear(x, t["mkl"], t["shape"], bias), activation)


def _mkl_linear(x: torch.Tensor, packed: torch.Tensor, shape: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """MKL's GEMM on its packed weight, at any row count. _mkl_linear falls back to a plain weight when x's
    rows differ from the batch size it is told; told x's own, it never does, so the format keeps no plain
    copy (a float32 model would hold every such weight twice) and hands it the weight's shape only: shape
    is an (N, K) tensor with no storage (_shape_only), made once when the weight is packed."""
    return torch.ops.mkl._mkl_linear(x, packed, shape, bias, x.size(0))


def _shape_only(out_features: int, in_features: int) -> torch.Tensor:
    return torch.empty(()).expand(out_features, in_features)  # one element's storage, whatever the shape


def _int8pack(x, t, bias, activation):
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), t["q"], t["scales_bf16"])  # (M, N) bf16
    return _act(y if bias is None else y.add_(bias), activation)


def _int8_dequant(dtype):
    def path(x, t, bias, activation):
        w = t["q"].to(dtype) * t["scales"].to(dtype)[:, None]  # (N, K): one pass, far below the GEMM's cost
        return _act(F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype)), activation)
    return path


# one function each for every int8 format: kernels.py sees the same path
_int8_dequant_bf16, _int8_dequant_fp32 = _int8_dequant(torch.bfloat16), _int8_dequant(torch.float32)


def _linear_dynamic(x: torch.Tensor, t: dict, packed: str = "packed", unit_range: bool = False) -> torch.Tensor:
    """fbgemm's / oneDNN's u8s8 GEMM: x (M, K) float32 quantized with one scale, (M, N) float32 out.
    packed: the tensors' key of the engine's packed weight (a two-engine format keeps two). unit_range: x
    spans [0, 1] (_int8_dynamic_rows maps every row there), which the engine quantizes with scale 1/255 and
    zero point 0."""
    if torch.compiler.is_compiling() and unit_range and u8s8_compiles_from_tensors():
        return _u8s8_from_tensors(x, t)
    return linear_dynamic(x, t, packed)


def linear_dynamic(x: torch.Tensor, t: dict, packed: str = "packed", reduce_range: bool = False,
                   fp16: bool = False) -> torch.Tensor:
    """An engine's dynamic linear of x (M, K) float32 on the packed weight t[packed], (M, N) float32: fbgemm's
    or oneDNN's u8s8 GEMM, or with fp16 fbgemm's fp16 GEMM. Through native_ops' op in C++, which finds the
    weight by its key, where that was built; else through Python: the engine's own op eagerly, a custom op
    in a compiled graph (Dynamo cannot trace the packed object; a u8s8 one's reduce_range is False there)."""
    key = t[f"{packed}_key"]
    n_out = t["out_features"] if fp16 else t["q"].size(0)
    if native_ops.loaded():
        return torch.ops.gpt2_native.linear_dynamic(x, key, n_out, reduce_range)
    if torch.compiler.is_compiling():
        return linear_fp16_op(x, key, n_out) if fp16 else linear_dynamic_op(x, key, n_out)
    if fp16:
        return torch.ops.quantized.linear_dynamic_fp16(x, t[packed])
    return torch.ops.quantized.linear_dynamic(x, t[packed], reduce_range)


def _u8s8_from_tensors(x: torch.Tensor, t: dict) -> torch.Tensor:
    """The u8s8 GEMM of x (M, K) in [0, 1] as PT2E's quantize and dequantize ops over q and its scales, for a
    compiled step: Inductor's freezing passes match them to an int8 GEMM of its own, packing q itself (its
    AMX or VNNI template, autotuned against oneDNN's qlinear). The same integers as the engine's kernel,
    and a graph of tensors only, which a package holds (engine.PackagedDecodeStep). Measured on an Intel
    Xeon with AMX (BENCHMARKS.md): 2304x768, 12 copies, 43 against 80 us a call at 1 row (fbgemm, eager,
    with the per-row ops), 49 against 137 at 8; outputs bit for bit the same."""
    qd = torch.ops.quantized_decomposed  # registered by u8s8_compiles_from_tensors' import
    x = qd.dequantize_per_tensor(qd.quantize_per_tensor(x, 1 / 255, 0, 0, 255, torch.uint8), 1 / 255, 0, 0, 255,
                                 torch.uint8)
    return F.linear(x, qd.dequantize_per_channel(t["q"], t["scales"], t["zero_points"], 0, -128, 127, torch.int8))


@torch.compiler.assume_constant_result  # Dynamo calls it and keeps the answer, instead of tracing the probe
def u8s8_compiles_from_tensors() -> bool:
    """Whether a compiled graph computes the u8s8 paths from q and its scales (_u8s8_from_tensors): where
    oneDNN's u8s8 GEMM adds its products exactly on this CPU (_u8s8_sums_exactly; Inductor's own int8 GEMM
    needs AMX or VNNI, and falls back to oneDNN's qlinear), and the decomposed ops exist. Elsewhere the
    graph calls the engine's kernel through a custom op, whose packed object no package can hold."""
    return _u8s8_from_tensors_probed()


@functools.cache
def _u8s8_from_tensors_probed() -> bool:
    try:
        import torch.ao.quantization.fx._decomposed  # noqa: F401  registers torch.ops.quantized_decomposed
    except ImportError:
        return False
    return _engine_available("onednn")()


@torch.library.custom_op("gpt2::linear_dynamic", mutates_args=())
def linear_dynamic_op(x: torch.Tensor, key: str, out_features: int) -> torch.Tensor:
    """A u8s8 linear_dynamic as one op of a compiled graph, through Python, the packed weight named by its key
    (_Packed): where native_ops' gpt2_native::linear_dynamic is not available."""
    return torch.ops.quantized.linear_dynamic(x, _packed_object(key), False)


@torch.library.custom_op("gpt2::linear_fp16", mutates_args=())
def linear_fp16_op(x: torch.Tensor, key: str, out_features: int) -> torch.Tensor:
    """fbgemm's fp16 linear_dynamic as one op of a compiled graph, likewise."""
    return torch.ops.quantized.linear_dynamic_fp16(x, _packed_object(key))


@linear_dynamic_op.register_fake
@linear_fp16_op.register_fake
def _(x, key, out_features):
    return x.new_empty(x.size(0), out_features)


def _int8_dynamic(x, t, bias, activation, packed="packed"):
    # x is quantized to uint8 per call (one scale for the whole call: kernels.py offers this path for
    # decode only, where a call is one token); the GEMM runs u8 x s8 with int32 accumulation.
    x = x.float()
    if torch.compiler.is_compiling() and u8s8_compiles_from_tensors():
        y = _unit_range_u8s8(x, *_engine_range(x), t, packed)  # the engine's one scale, as a range
    else:
        y = _linear_dynamic(x, t, packed)  # (M, N) float32
    return _act(y if bias is None else y.add_(bias), activation)


def _int8_dynamic_rows(x, t, bias, activation, packed="packed"):
    # Per-token quantization through the same per-call kernel, each row as a one-row call quantizes it:
    # every row is mapped onto [0, 1] by its own min and max, so the call's one scale (1/255, zero point
    # 0) spans each row's own range, and y = span (x' W^T) + low rowsum(W); a row's output does not depend
    # on the rows beside it. (Rows scaled to max |x| = 1 instead shared a range of about [-1, 1], 1.5-2x a
    # positive row's own steps: with every layer on this path, the quickstart model's KL divergence from
    # float32 over a prefill was 0.000247, now 0.000181.)
    if x.size(0) == 1:  # one row already has its own range
        return _int8_dynamic(x, t, bias, activation, packed)
    x = x.float()
    low = x.amin(dim=1, keepdim=True)  # (M, 1)
    y = _unit_range_u8s8(x, low, (x.amax(dim=1, keepdim=True) - low).clamp_(min=1e-12), t, packed)
    return _act(y if bias is None else y.add_(bias), activation)


def _unit_range_u8s8(x, low, span, t, packed):
    """x W^T, x (M, K) float32 quantized over [low, low + span] ((M, 1) each, or one for all rows): mapped onto
    [0, 1], which the engine quantizes with scale 1/255 and zero point 0; y = span (x' W^T) + low rowsum(W)."""
    y = _linear_dynamic((x - low).div_(span), t, packed, unit_range=True)  # (M, N) float32: x' W^T
    return y.mul_(span).addcmul_(low, t["row_sums"])  # (M, 1) x (N,): faster here than addr_'s outer product


# _int8_split: each row of x to 2^14 levels, as two halves of 7 bits each (0..127)
SPLIT_HALF_LEVELS = 128
SPLIT_LEVELS = SPLIT_HALF_LEVELS ** 2 - 1


def _int8_split(x, t, bias, activation):
    """A u8s8 GEMM where the engine saturates at 8 bits, with x quantized per row to 14 bits. Without VNNI a
    u8s8 kernel adds pairs of u8 x s8 products in int16 (AVX2's vpmaddubsw), which 0..255 overflows but
    0..127 does not (2 x 127 x 127 < 32,767: the engine's reduce_range). Each row is mapped onto its own
    [min, max] in SPLIT_LEVELS steps, and the step counts, high * 128 + low, go to the engine as two rows of
    integers 0..127 (quantized exactly: the call's range is 0..127, so its scale is 1): one GEMM of 2M rows
    reads the weight once. y = low_x rowsum(W) + step (128 (high W^T) + (low W^T)). Measured on an AVX2-only
    AMD EPYC (`gpt2 info --kernels`; BENCHMARKS.md): the lm_head at 1 row in 2.0 ms against int8pack_mm's 3.9,
    at 8 rows 4.3 against 9.7; x's error 10x below int8pack_mm's bf16 rounding of it (2^-14 of a row's range
    against 2^-9 of each value). A compiled step computes int8pack_mm instead, from the same q and scales:
    Inductor's own code for it decoded at 137 and 110 tok/s there (two rounds), this path through its custom
    op at 109 and 104."""
    if torch.compiler.is_compiling():
        return _int8pack(x, t, bias, activation)
    x = x.float()
    rows = x.size(0)
    low, high = torch.aminmax(x, dim=1, keepdim=True)  # (M, 1) each
    step = (high - low).clamp_(min=1e-12).div_(SPLIT_LEVELS)  # (M, 1)
    steps = (x - low).div_(step).round_()  # (M, K): integers 0..SPLIT_LEVELS
    halves = x.new_empty(2 * rows, x.size(1))  # (2M, K): the high halves, then the low ones
    torch.div(steps, SPLIT_HALF_LEVELS, rounding_mode="floor", out=halves[:rows])
    torch.sub(steps, halves[:rows], alpha=SPLIT_HALF_LEVELS, out=halves[rows:])
    y = linear_dynamic(halves, t, reduce_range=True)  # (2M, N) float32: x to 0..127, exactly
    y = torch.add(y[rows:], y[:rows], alpha=SPLIT_HALF_LEVELS).mul_(step).addcmul_(low, t["row_sums"])
    return _act(y if bias is None else y.add_(bias), activation)


def _engine_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The range over which the engine quantizes x to 0..255 with one scale, as (low, span), each (1, 1):
    ATen's choice for a dynamic linear (quant_utils::ChooseQuantizationParams): [min, max] widened to hold
    0, scale = its width / 255 (float32; 0.1 if that is 0), the zero point from the end with the smaller
    error, clamped to 0..255 and rounded to even; low = -zero_point scale, span = 255 scale. Quantizing
    (x - low) / span with scale 1/255 then gives the engine's integers, up to float rounding at a tie."""
    low, high = x.amin().clamp(max=0).double(), x.amax().clamp(min=0).double()
    scale = ((high - low) / 255).float().double()
    scale = torch.where((scale == 0) | torch.isinf(1 / scale.float()), torch.full_like(scale, 0.1), scale)
    from_min, from_max = -low / scale, 255 - high / scale
    zero_point = torch.where(low.abs() / scale < 255 + high.abs() / scale, from_min, from_max).clamp(0, 255).round()
    return (-zero_point * scale).float().view(1, 1), (255 * scale).float().view(1, 1)


def _int8_dynamic_onednn(x, t, bias, activation):  # the two-engine format's oneDNN packing
    return _int8_dynamic(x, t, bias, activation, "packed_onednn")


def _int8_dynamic_rows_onednn(x, t, bias, activation):
    return _int8_dynamic_rows(x, t, bias, activation, "packed_onednn")


def _int4pack(x, t, bias, activation):
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), t["int4pack"], INT4_GROUP,
                                                   t["scales_zeros_padded"])  # (M, N padded to 16) bf16
    if y.size(1) != t["out_features"]:
        y = y[:, : t["out_features"]]
    return _act(y if bias is None else y.add_(bias), activation)


def _probed_once(probe: Callable) -> Callable:
    """functools.cache for a probe of this machine that a compiled path asks too: its answers sit in a
    plain dict, which a graph reads as constants once the probe has run eagerly. Dynamo traces through
    functools.cache's wrapper into the probe itself, whose ops (a data-dependent `equal`, a backend
    check it skips) fail in a graph."""
    answers: dict = {}

    @functools.wraps(probe)
    def answer(*args):
        if args not in answers:
            answers[args] = probe(*args)
        return answers[args]
    return answer


@_probed_once
def int4pack_layout() -> tuple[int, str] | None:
    """How this process's _convert_weight_to_int4pack_for_cpu lays out nibbles: (block, order), or None.
    Probed when the first int4 weight is packed (eagerly), so that a compiled dequant path reads it.

    The packed (N, K/2) uint8 is [N/block][K][block/2]: a block of output rows at a time, and for each
    column k of it, block/2 bytes of two nibbles each. ATen picks the layout by the CPU's vector width:
    with AVX-512, blocks of 64 rows whose byte j holds row j in its low nibble and row 32 + j in its
    high one ("halves"); with AVX2, blocks of 32 and halves of 16; without either, rows 2j and 2j + 1
    ("pairs"). None of this is documented, so it is found by packing a small weight once and comparing
    the bytes with each candidate's; None if none matches (int4pack_dequantize then raises, and
    kernels.py rejects the path that needs it)."""
    N, K = 128, 64
    q = (torch.arange(N).view(N, 1) * 5 + torch.arange(K).view(1, K) * 3 + torch.arange(N).view(N, 1) // 16) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    for block, order in itertools.product((64, 32, 16), ("halves", "pairs")):
        nibbles = _nibbles_in_row_order(packed.view(N // block, K, block // 2), order)  # (N/block, K, block)
        if nibbles.permute(0, 2, 1).reshape(N, K).equal(q.to(torch.uint8)):
            return block, order
    return None


def _nibbles_in_row_order(blocks: torch.Tensor, order: str) -> torch.Tensor:
    """(..., block/2) packed bytes -> (..., block) nibbles, in the order of the rows they belong to."""
    if order == "halves":
        return torch.cat((blocks & 15, blocks >> 4), dim=-1)
    return torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)


def _levels_in_k_order(blocks: torch.Tensor, order: str, out: torch.Tensor) -> torch.Tensor:
    """The nibbles of blocks (N/block, G, K/G, block/2) packed bytes as q - 8, written into out (G, K/G, N) of a
    float dtype in the order of the (K, N) weight: each copy_ casts as it writes (the bytes, a quarter of
    the traffic, are the side read out of order). Exact: q - 8 in [-8, 7]."""
    G, k_per_group, N = out.shape
    by_k = blocks.permute(1, 2, 0, 3)  # (G, K/G, N/block, block/2): each byte where its column falls
    half = blocks.size(-1)
    if order == "halves":  # a block's byte j holds rows j (low nibble) and half + j (high)
        runs = out.view(G, k_per_group, N // (2 * half), 2, half)
        low, high = runs[..., 0, :], runs[..., 1, :]
    else:  # "pairs": rows 2j and 2j + 1
        runs = out.view(G, k_per_group, N // (2 * half), half, 2)
        low, high = runs[..., 0], runs[..., 1]
    low.copy_(by_k & 15)
    high.copy_(by_k >> 4)
    return out.sub_(8)


def int4pack_dequantize(packed: torch.Tensor, scales_zeros: torch.Tensor,
                        dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight (N, K) that _weight_int4pack_mm_for_cpu computes with, from its own packed form: in
    bf16, or in float32 as the kernel itself computes (q - 8) s + z before multiplying.

    packed (N, K/2) uint8 in the kernel's layout (int4pack_layout: blocks of 64 or 32 rows on AVX-512
    and AVX2 CPUs); scales_zeros (K/group, N, 2) bf16. A torch or CPU whose layout is none of the known
    ones raises here, and kernels.py's check rejects the path: never wrong numbers.

    Returned as the transpose of a (K, N): the blocks (N/block, K, block) land in (K, N) as runs of
    `block` values (a contiguous (N, K) would take a transpose element by element, measured 1.3-1.6x
    slower for the whole dequantization); GEMMs read either layout. Given out (K, N) of dtype (its rows
    at any stride: a block of columns of a larger buffer), the weight is written there.
    """
    layout = int4pack_layout()
    if layout is None:
        raise RuntimeError("this torch packs int4 weights in a layout int4pack_dequantize does not know")
    block, order = layout
    N, K = packed.size(0), 2 * packed.size(1)
    if N % block:
        raise RuntimeError(f"the CPU int4 packing is read in blocks of {block} rows; {N} rows are not")
    G = scales_zeros.size(0)
    blocks = packed.view(N // block, G, K // G, block // 2)
    if out is None:  # a new tensor, computed without out= (a traced graph mutates none of its views)
        by_block = scales_zeros.to(dtype).reshape(G, N // block, block, 2).transpose(0, 1)  # (N/block, G, block, 2)
        scale = by_block[..., 0].unsqueeze(2).contiguous()  # (N/block, G, 1, block)
        zero = by_block[..., 1].unsqueeze(2).contiguous()
        q = _nibbles_in_row_order(blocks, order).to(dtype).sub_(8)  # (N/block, G, K/G, block): q - 8, exact
        w = torch.addcmul(zero, q, scale)  # (q - 8) s + z, rounded once to dtype: (N/block, G, K/G, block)
        return w.view(N // block, K, block).permute(1, 0, 2).reshape(K, N).t()  # (N, K), strides (1, N)
    # the same into out, from q - 8 laid out as out is (in a buffer this thread keeps), so that the op that
    # scales them reads and writes both in order: 1.2-3x faster than scaling the blocks' order into out's
    # (2304x768: 0.6-0.7 against 1.0 ms; gpt2-xl's 4800x1600: 3.6 against 10-12 ms; BENCHMARKS.md)
    q = _levels_in_k_order(blocks, order, _dequant_buffer(N * K, dtype, "levels").view(G, K // G, N))
    scale, zero = (scales_zeros[..., i].to(dtype).unsqueeze(1).contiguous() for i in (0, 1))  # (G, 1, N)
    torch.addcmul(zero, q, scale, out=out.view(G, K // G, N))
    return out.t()


# _int4pack_dequant dequantizes DEQUANT_BLOCK[dtype] weights at a time (their intermediates stay small: a
# 6400x1600 weight, gpt2-xl's c_fc, dequantized whole made 10-20 MB of fresh allocations that page-fault on
# every call), into one (K, N) buffer per thread and dtype that lives on (_dequant_buffer), and multiplies
# the whole weight in one GEMM: measured on an Intel Xeon without AVX512_BF16 at 512 rows, 1.15-1.27x
# faster than a float32 GEMM per block of 786K weights (2304x768: 10.9 against 12.9 ms; 768x3072: 16.1
# against 20.3), which had been the fastest block there when each block's weight was a fresh allocation.
DEQUANT_BLOCK = {torch.bfloat16: 1 << 22, torch.float32: 3 << 18}
_dequant_buffers = threading.local()  # (use, dtype) -> the largest buffer this thread's calls have needed


def _dequant_buffer(numel: int, dtype: torch.dtype, use: str = "weight") -> torch.Tensor:
    """A flat buffer of at least numel elements of dtype, this thread's own, kept for its next calls:
    a prefill dequantizes into it layer after layer without allocating (largest layer: 9.4 MB for 124M's
    float32 weights, 41 MB for gpt2-xl's). use: "weight" (the (K, N) weight a GEMM reads) or "levels"
    (a block's q - 8, int4pack_dequantize). One a thread: the server's and a draft's threads never share."""
    buffers = getattr(_dequant_buffers, "by_use", None)
    if buffers is None:
        buffers = _dequant_buffers.by_use = {}
    buffer = buffers.get((use, dtype))
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in place in or out of inference mode
            buffer = buffers[(use, dtype)] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def _int4pack_dequant(dtype: torch.dtype) -> Path:
    """Long prefills: the weight made `dtype` once per call, a block of output rows at a time, into one
    buffer (_dequant_buffer), then multiplied by one GEMM in that dtype. For hundreds of rows this runs
    faster than the int4 kernel's own (measured by kernels.py): bf16 through oneDNN with the bias and GELU
    fused, where bf16 GEMMs are fast (AMX, or an AMD EPYC's AVX512_BF16); float32 through MKL, where bf16
    GEMMs are slow (an Intel Xeon without AMX: half the float32 rate, or without AVX512_BF16 at all). y is
    bf16 either way, as from every int4 path: a bf16 KV cache then holds c_attn's keys as they are
    (keys_are_bf16)."""
    def path(x, t, bias, activation):
        packed, scales_zeros, n_out = t["int4pack"], t["scales_zeros_padded"], t["out_features"]
        x = x.to(dtype)
        b = None if bias is None else bias.to(dtype)
        N, K = packed.size(0), 2 * packed.size(1)  # N padded to a multiple of 16
        if torch.compiler.is_compiling():  # a compiled step of 33+ rows: a graph mutates only its own tensors,
            w = int4pack_dequantize(packed, scales_zeros, dtype)[:n_out]  # and Inductor lowers the GEMM its way
            return _act(F.linear(x, w, b), activation).to(torch.bfloat16)  # (not oneDNN's on a traced weight)
        block = (int4pack_layout() or (64,))[0]  # None: int4pack_dequantize raises below
        rows = max(block, DEQUANT_BLOCK[dtype] // K // block * block)  # whole blocks of its packing
        w = _dequant_buffer(K * N, dtype).view(K, N)
        for start in range(0, N, rows):
            int4pack_dequantize(packed[start:start + rows], scales_zeros[:, start:start + rows], dtype,
                                out=w[:, start:start + rows])
        w = w[:, :n_out].t()  # (n_out, K): padding rows dropped
        if dtype == torch.bfloat16 and onednn_runs(torch.bfloat16):
            post_op = ("none", "") if activation is None else ("gelu", "tanh")
            return torch.ops.mkldnn._linear_pointwise(x, w, b, post_op[0], [], post_op[1])
        # float32 through MKL, or bf16 without oneDNN (AVX2): ATen's bf16 GEMM, slower (kernels.py measures it so)
        return _act(F.linear(x, w, b), activation).to(torch.bfloat16)
    return path


def _int4_dequant(x, t, bias, activation):
    w = _int4_dequantize(t["nibbles"], t["scales_zeros"], torch.float32).to(torch.bfloat16)  # no cancellation in bf16
    y = F.linear(x.to(torch.bfloat16), w, None if bias is None else bias.to(torch.bfloat16))
    return _act(y, activation)


# ---------------------------------------------------------------------------------------------
# formats: what is stored, its reference weights, and the paths that compute with it
# ---------------------------------------------------------------------------------------------

class _Packed:
    """An opaque engine object (a quantized engine's packed weight) kept in a tensors dict; not a tensor.

    Each has a key, a string a compiled graph can hold: its custom ops look the object up by it
    (_packed_object). A new object's key names it in this process only; engine.name_engine_objects gives
    a model's the names any process gives the same weights (its digest and the layer's name), so that a
    package, which holds the keys, finds them again in another process.
    """

    def __init__(self, obj):
        self.obj = obj
        self.key = ""
        # named for native_ops' op in C++ too (built at the first such object), for as long as this holder
        # lives: [its key there]
        self._native_key = [None] if _is_linear_packed_params(obj) and native_ops.load() else None
        if self._native_key is not None:
            weakref.finalize(self, _forget_native, self._native_key, obj).atexit = False
        self.rename(f"unnamed {next(_unnamed)}")

    def rename(self, key: str) -> None:
        _PACKED.get(self.key, set()).discard(self)
        self.key = key
        _PACKED.setdefault(key, weakref.WeakSet()).add(self)  # two models of the same weights share their keys
        if self._native_key is not None:
            _forget_native(self._native_key, self.obj)
            torch.ops.gpt2_native.name_packed(key, self.obj)
            self._native_key[0] = key

    def __deepcopy__(self, memo):  # a copy gets its own key (a copied one would name the original)
        return _Packed(copy.deepcopy(self.obj, memo))


def _forget_native(native_key: list, obj) -> None:
    if native_key[0] is not None:
        torch.ops.gpt2_native.forget_packed(native_key[0], obj)
        native_key[0] = None


_unnamed = itertools.count()
_PACKED: "dict[str, weakref.WeakSet[_Packed]]" = {}  # key -> the objects of that name alive (a layer holds each)


def path_args(tensors: dict) -> dict:
    """What a format's paths read of what it packed: its tensors, each engine object (_Packed) by its name,
    and the object's key by the name + "_key" (for an op that looks the object up by key). Keep the packed
    dict alive while these are used: native_ops forgets a key when its holder is collected."""
    packed = {name: t for name, t in tensors.items() if isinstance(t, _Packed)}
    return {**tensors, **{name: t.obj for name, t in packed.items()}, **{f"{name}_key": t.key for name, t in packed.items()}}


def _is_linear_packed_params(obj) -> bool:
    return isinstance(obj, torch.ScriptObject) and obj._type().name() == "LinearPackedParamsBase"


def _packed_object(key: str):
    """The engine object a compiled graph names by key: any of those of that name (they hold the same weights)."""
    for packed in _PACKED.get(key, ()):
        return packed.obj
    raise KeyError(f"no engine object named {key!r} is alive in this process")


@dataclass
class WeightFormat:
    name: str
    precision: str
    # (w (N, K) float32, bias) -> tensors; a bf16 format's pack also takes w already in bf16 (FastLinear's
    # centered logits pass it so: a float32 copy of a centered lm_head cost 200-370 MB of load peak)
    pack: Callable[[torch.Tensor, "torch.Tensor | None"], dict]
    # (w float32, tensors, rows) -> the weight it computes with, float64: those output rows (an index
    # tensor), or all of them for None. kernels.py checks a wide layer on its first and last outputs only,
    # and the whole lm_head in float64 would take ~0.3 s per format. w is None when a packed layer is read
    # back (engine.quantized_copy); a format that cannot do without it raises ValueError.
    reference_weight: Callable[[torch.Tensor | None, dict, "torch.Tensor | None"], torch.Tensor]
    paths: dict[str, Path]
    # paths that quantize x per token: the levels each row's range gets (a wider tolerance, kernels.Expected)
    activation_levels: dict[str, int] = field(default_factory=dict)
    one_row_paths: tuple[str, ...] = ()   # paths that quantize a whole call with one scale: decode only
    # Paths that dequantize the whole weight on every call: measured for prefill and long only (at 1 or
    # 8 rows they cannot beat a kernel that reads the packed weight once; timing them costs seconds).
    many_row_paths: tuple[str, ...] = ()
    available: Callable[[], bool] = lambda: True
    # Another format whose pack makes the same tensors for the paths both have (the same function):
    # kernels.py checks and times such a path once, in that format, and reuses the result here.
    same_weights_as: str | None = None
    # packed tensors -> a copy with its own storage, without quantizing again (kernels.py's cold copies);
    # None: plain tensors are cloned, anything else is packed again
    repack: Callable[[dict], dict] | None = None
    # A format holding the tensors of several others, so that each regime can take the path of any:
    # {part format: {its path: this format's name for it}} (a name two parts give is the same kernel on
    # the same tensors). It is not measured itself: kernels.py reads its timings off its parts' and
    # keeps it only where it gains enough to pay for its memory.
    parts: dict[str, dict[str, str]] = field(default_factory=dict)
    # Its paths take float32 x at a bf16 precision (fbgemm's fp16 GEMM): a centered lm_head's input
    # (CENTERED_LOGITS) is not rounded to bf16 for it.
    takes_float32: bool = False
    # A package can hold its compiled paths: they read tensors only, or call an engine's packed object by
    # the key engine.name_engine_objects names it with in every process (fbgemm's fp16 GEMM). Not u8s8's
    # engines' (engine._holds_engine_objects).
    packages: bool = False
    # tensors -> the plain (N, K) weight its compiled path reads, for a format that does not keep it (MKL's:
    # Inductor lowers _mkl_linear only for weights it packed itself; oneDNN's: torch.export cannot trace its
    # opaque packed tensor); add_compile_weights, before compiling
    compile_weight: Callable[[dict], torch.Tensor] | None = None
    # tensors -> the (N, K) weight held only in an engine's packed object, read back (exact): what
    # engine.weights_digest hashes for it
    read_back: Callable[[dict], torch.Tensor] | None = None
    # packed tensors whose padding bytes the packing leaves unset (MKL's): one weight packs to other bytes each
    # time, so they are compared and hashed (engine.weights_digest) through the weight they hold, never as bytes
    unset_padding: tuple[str, ...] = ()


def _has(namespace, op: str) -> Callable[[], bool]:
    return lambda: hasattr(getattr(torch.ops, namespace), op)


def _pack_int8(w, bias):
    q, s = quantize_per_channel(w)
    # scales_bf16: the weight-only kernel's own dtype (no cast per call); row_sums (N,): each row's sum as the
    # kernels hold it, q s, which a per-token path needs back (_int8_dynamic_rows). Summed a block of rows at a
    # time: an int8 sum makes an int64 copy of what it sums (q.sum(1) took 297 MB at gpt2's lm_head).
    sums = torch.cat([q[rows].sum(1) for rows in row_blocks(q)])  # (N,) int64: exact
    # zero_points (N,): q's, all 0, as a tensor a compiled graph names (_u8s8_from_tensors: Inductor packs an int8
    # weight for its own GEMM only where its zero points are a constant, not computed in the graph)
    return {"q": q, "scales": s, "scales_bf16": s.to(torch.bfloat16), "row_sums": (sums.double() * s.double()).float(),
            "zero_points": torch.zeros_like(s, dtype=torch.int64)}


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def _plain_reference(w, t, rows=None):
    return _rows(w, rows).double()


@torch.library.custom_op("gpt2::mkl_linear", mutates_args=())
def mkl_linear_op(x: torch.Tensor, packed: torch.Tensor, shape: list[int], bias: torch.Tensor | None) -> torch.Tensor:
    """_mkl_linear as one op of a compiled graph, its packed weight a constant there."""
    return _mkl_linear(x, packed, _shape_only(*shape), bias)


@mkl_linear_op.register_fake
def _(x, packed, shape, bias):
    return x.new_empty(x.size(0), shape[0])


def _mkl_weight(t) -> torch.Tensor:
    """The float32 (N, K) weight MKL's packed copy holds, read back as its GEMM of the identity: I W^T, exact
    (each output is one product by 1). (K, K, N) FLOPs: 0.2 s for GPT-2's lm_head here."""
    return _mkl_linear(torch.eye(t["shape"].size(1)), t["mkl"], t["shape"], None).t().contiguous()


def _mkl_reference(w, t, rows=None):
    return _plain_reference(_mkl_weight(t) if w is None else w, t, rows)  # w None: a packed layer read back


def _pack_fp16(w, bias):
    """bf16's weights as float16 for fbgemm's GEMM, which converts them to float32 as it reads (F16C, on any
    AVX2 CPU) and multiplies float32 activations. float16 holds every bf16 value of magnitude 2^-14 to
    65,280 exactly (8 significant bits within its 11); smaller ones round to its subnormal grid (steps of
    2^-24), and larger ones overflow (float16's largest is 65,504), which no GPT-2 weight does: refused."""
    w16 = w.to(torch.bfloat16).to(torch.float16)
    if not torch.isfinite(w16).all():
        raise ConfigError("a bf16 weight beyond float16's range (65,504): fbgemm's fp16 format cannot hold it")
    packed = torch.ops.quantized.linear_prepack_fp16(w16.float(), None)
    return {"packed": _Packed(packed), "out_features": _Packed(w.size(0))}


def _fp16_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and _has("quantized", "linear_dynamic_fp16")()


def _pack_bf16(w, bias):
    return {"weight": w.to(torch.bfloat16)}


def _fp16_weight(t) -> torch.Tensor:
    """The (N, K) weight fbgemm's fp16 packing holds, read back (exact), as bf16: the reference's and the
    weights digest's. Each float16 value came from a bf16 one, so bf16 holds it again."""
    return torch.ops.quantized.linear_unpack_fp16(t["packed"])[0].to(torch.bfloat16)


def _fp16_reference(w, t, rows=None):
    if w is None:  # a packed layer read back
        return _rows(_fp16_weight(t), rows).double()
    return _rows(w, rows).to(torch.bfloat16).to(torch.float16).double()


def _fp16(x, t, bias, activation):
    """fbgemm's GEMM over the float16 weights: float32 x and output. A compiled step calls the same kernel
    through its op, which names the packed weight by its key: a package holds it (engine.name_engine_objects).
    Inductor's own bf16 GEMM (its template or oneDNN's, autotuned) read the weights slower where the plan
    chose fbgemm's: on an AMD EPYC Zen 4, 124M's compiled batch-8 step in 0.59 of the time (BENCHMARKS.md,
    "A new CPU: an AMD EPYC of family 25 model 17")."""
    y = linear_dynamic(x.float(), t, fp16=True)  # (M, N) float32
    return _act(y if bias is None else y.add_(bias), activation)


def _int8_reference(w, t, rows=None):
    return _rows(t["q"], rows).double() * _rows(t["scales"], rows).double()[:, None]


def _prepack_int8(engine: str):
    """{q, scales, ...} -> the same and the engine's packed u8s8 weight, made from that q and s."""
    def prepack(tensors):
        q, s = tensors["q"], tensors["scales"]
        # linear_prepack packs for the process-wide engine: set it for this call only, under a lock, so
        # that two threads packing for different engines (a model and its draft) never swap them. The
        # lock also covers catch_warnings, which saves and restores Python's global filter list: two
        # threads inside it at once left one's "ignore" filter behind.
        with _QUANTIZED_ENGINE_LOCK:
            with warnings.catch_warnings():
                # torch 2.13 warns that quantized tensor types are deprecated, on every load of an int8 model;
                # the packed u8s8 kernels still take them, and the kernel tests fail if that ever stops.
                warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
                qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros_like(s, dtype=torch.long), 0)
            previous = torch.backends.quantized.engine
            torch.backends.quantized.engine = engine
            try:
                packed = torch.ops.quantized.linear_prepack(qw, None)
            finally:
                torch.backends.quantized.engine = previous
        return {**tensors, "packed": _Packed(packed)}
    return prepack


_QUANTIZED_ENGINE_LOCK = threading.Lock()


def _pack_int8_engine(engine: str):
    prepack = _prepack_int8(engine)
    # the same q and s as _pack_int8, so every path of the format computes with one weight
    return lambda w, bias: prepack(_pack_int8(w, bias))


def _repack_int8_engine(engine: str):
    prepack = _prepack_int8(engine)
    return lambda t: prepack({k: v.clone() for k, v in t.items() if k != "packed"})


def _engine_available(engine: str, bits: int = 8) -> Callable[[], bool]:
    """Whether the engine's u8s8 paths run here: at 8 bits (x to 0..255), or at 7 only (_int8_split's
    format, offered where 8 bits saturate and 7 do not)."""
    def available():
        if not (engine in torch.backends.quantized.supported_engines and _has("quantized", "linear_dynamic")()):
            return False
        return _u8s8_sums_exactly(engine) if bits == 8 else (not _u8s8_sums_exactly(engine)
                                                              and _u8s8_sums_exactly(engine, reduce_range=True))
    return available


@functools.cache
def _u8s8_sums_exactly(engine: str, reduce_range: bool = False) -> bool:
    """Whether the engine's u8s8 GEMM adds its products without saturating on this CPU (probed once), with x
    quantized to 0..255 (or to 0..127: reduce_range).

    Without VNNI, a u8s8 kernel may add pairs of u8 x s8 products in int16 (AVX2's vpmaddubsw): 2 x 255
    x 127 saturates at 32,767. oneDNN limited to AVX2 does (ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 Xeon:
    32.0 came out as 16.2, and random weights were 10x further off), and so do fbgemm and oneDNN on an
    AVX2-only AMD EPYC. The kernel check in kernels.py, on random weights, would not always see it;
    GPT-2's activations have large outliers. So such an engine is not offered at 8 bits: x of ones (u8
    255, or 127) against weights of +-127 must give +-32 exactly."""
    w = torch.full((16, 64), 0.5)
    w[1::2] = -0.5
    try:
        packed = _pack_int8_engine(engine)(w, None)["packed"].obj
        y = torch.ops.quantized.linear_dynamic(torch.ones(1, 64), packed, reduce_range)
    except RuntimeError:
        return False
    return bool(((y - torch.ones(1, 64) @ w.t()).abs() < 1e-3).all())


@_probed_once
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs a linear in dtype on this CPU (probed once on a 16x16 weight): bf16
    needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and raises on an AVX2-only CPU. The inference formats
    and the training loss's lm_head (lm_head.py) both ask, eagerly first (choosing the formats), and
    int4's compiled dequant path after them."""
    if not (torch.backends.mkldnn.is_available() and _has("mkldnn", "_reorder_linear_weight")()):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((y == 16).all())


def _pack_int8_both_engines(w, bias):
    tensors = _pack_int8_engine("fbgemm")(w, bias)
    return {**tensors, "packed_onednn": _prepack_int8("onednn")(tensors)["packed"]}  # the same q and s


def _pack_int4(packed: bool, unpacked: bool):
    def pack(w, bias):
        q, scales_zeros = quantize_int4_groups_cached(w)
        tensors = {"scales_zeros": scales_zeros.to(torch.bfloat16)}
        if packed:  # the CPU kernel's own blocked layout, which needs N % 16 == 0: pad with zero weights
            int4pack_layout()  # probed here, eagerly, for the dequant paths (compiled ones too)
            pad = -q.size(0) % 16  # none in GPT-2's blocks: no padded copy of q then
            padded = F.pad(q, (0, 0, 0, pad), value=8) if pad else q
            tensors["int4pack"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1)
            tensors["scales_zeros_padded"] = F.pad(tensors["scales_zeros"], (0, 0, 0, pad))  # (K/group, N + pad, 2)
            tensors["out_features"] = _Packed(q.size(0))
        if unpacked:
            tensors["nibbles"] = int4_nibbles(q)  # (N, K/2)
        return tensors
    return pack


def _onednn_reference(w, t, rows=None):
    if w is not None:
        # A reorder moves values, never changes them: the packed weight is w in its dtype (float32, or
        # bf16 rounded as .to rounds). Checking the kernel against w itself also checks the packing, and
        # skips reading back the whole packed weight (to_dense: ~0.5 s for gpt2-xl's float32 lm_head).
        return _rows(w, rows).to(t["onednn"].dtype).double()
    return _rows(_onednn_weight(t), rows).double()  # read back (engine.quantized_copy: no w)


def _onednn_weight(t) -> torch.Tensor:
    return t["onednn"].to_dense()  # (N, K) in the packed dtype: a reorder back, exact


def _int4_reference(w, t, rows=None):
    if w is None:
        raise ValueError("int4pack keeps only the kernel's packed nibbles")
    q, _ = quantize_int4_groups(_rows(w, rows))  # deterministic, row by row: the q that pack stored
    scales_zeros = t["scales_zeros"] if rows is None else t["scales_zeros"][:, rows]  # as the kernel reads them (bf16)
    return int4_values(q, scales_zeros)


CPU_FORMATS: list[WeightFormat] = [
    WeightFormat("plain", "float32", lambda w, b: {"weight": w.contiguous()}, _plain_reference,
                 {"F.linear": _plain}),
    WeightFormat("onednn", "float32", lambda w, b: {"onednn": torch.ops.mkldnn._reorder_linear_weight(w, 1)},
                 _onednn_reference, {"onednn": _onednn}, compile_weight=_onednn_weight,
                 available=lambda: onednn_runs(torch.float32)),
    # The same kernel on the weight laid out for 8-row calls (oneDNN's batch-size hint). Measured on an AMD
    # EPYC (Zen 5), this layout was faster for float32 at every row count: 1 row 15-30% (768x3072: 279 vs
    # 196 us), 8 rows 2.5x, 128 rows 15-19%; for bf16 the hint made no difference.
    WeightFormat("onednn b8", "float32", lambda w, b: {"onednn": torch.ops.mkldnn._reorder_linear_weight(w, 8)},
                 _onednn_reference, {"onednn": _onednn}, compile_weight=_onednn_weight,
                 available=lambda: onednn_runs(torch.float32)),
    WeightFormat("mkl", "float32",
                 lambda w, b: {"mkl": torch.ops.mkl._mkl_reorder_linear_weight(w, 1),
                               "shape": _Packed(_shape_only(*w.shape))},
                 _mkl_reference, {"mkl": _mkl}, compile_weight=_mkl_weight, unset_padding=("mkl",),
                 available=lambda: _has("mkl", "_mkl_linear")() and torch.backends.mkl.is_available()),
    WeightFormat("plain", "bfloat16", _pack_bf16,
                 lambda w, t, rows=None: _rows(t["weight"], rows).double(), {"F.linear": _plain, "fp32 GEMM": _upcast}),
    # Only the packed copy is kept (a plain one beside it would hold the weights twice); for many rows it
    # is read back as float32 per call where bf16 GEMMs are slow (_onednn_upcast).
    WeightFormat("onednn", "bfloat16",
                 lambda w, b: {"onednn": torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 1)},
                 _onednn_reference, {"onednn": _onednn, "fp32 GEMM": _onednn_upcast}, compile_weight=_onednn_weight,
                 many_row_paths=("fp32 GEMM",), available=lambda: onednn_runs(torch.bfloat16)),
    # bf16 weights held as float16 for fbgemm's GEMM (_pack_fp16). On an AVX2-only AMD EPYC (`gpt2 info
    # --kernels`), where no oneDNN bf16 linear runs and F.linear's bf16 GEMM is slow: the lm_head at 1 row in
    # 2.6 against F.linear's 4.9 ms, at 8 rows 5.9 against 34.2; 768x3072 at 8 rows 0.38 against 1.88 ms.
    WeightFormat("fbgemm fp16", "bfloat16", _pack_fp16, _fp16_reference, {"fbgemm fp16": _fp16},
                 read_back=_fp16_weight, packages=True, takes_float32=True, available=_fp16_available),
    # Both: F.linear's bf16 weight and fbgemm's, for a layer where F.linear is the faster at 1 row and
    # fbgemm at 8 (an AVX2 EPYC), or fbgemm at 1 and 8 rows and F.linear's bf16 GEMM for prompts (a Zen 4
    # EPYC); kernels.py keeps it only where that gains COMBINED_GAIN. The lm_head's centered input
    # is bf16, as F.linear takes it; fbgemm multiplies those values exactly.
    WeightFormat("plain+fbgemm fp16", "bfloat16", lambda w, b: {**_pack_bf16(w, b), **_pack_fp16(w, b)},
                 lambda w, t, rows=None: _rows(t["weight"], rows).double(),
                 {"F.linear": _plain, "fp32 GEMM": _upcast, "fbgemm fp16": _fp16}, packages=True,
                 available=_fp16_available,
                 parts={"plain": {"F.linear": "F.linear", "fp32 GEMM": "fp32 GEMM"},
                        "fbgemm fp16": {"fbgemm fp16": "fbgemm fp16"}}),
    WeightFormat("weight-only", "int8", _pack_int8, _int8_reference,
                 {"int8pack_mm": _int8pack, "dequant bf16": _int8_dequant_bf16,
                  "dequant fp32": _int8_dequant_fp32}, many_row_paths=("dequant bf16", "dequant fp32"),
                 available=_has("aten", "_weight_int8pack_mm")),
    # Where fbgemm's u8s8 GEMM saturates at 8 bits but not at 7 (AVX2 without VNNI): x to 14 bits per row in
    # two 7-bit halves (_int8_split), beside the weight-only paths on the same q and s.
    WeightFormat("fbgemm 7-bit", "int8", _pack_int8_engine("fbgemm"), _int8_reference,
                 {"u8s8 14-bit per row": _int8_split, "int8pack_mm": _int8pack, "dequant bf16": _int8_dequant_bf16,
                  "dequant fp32": _int8_dequant_fp32},
                 activation_levels={"u8s8 14-bit per row": SPLIT_LEVELS},
                 many_row_paths=("dequant bf16", "dequant fp32"),
                 available=_engine_available("fbgemm", bits=7), same_weights_as="weight-only",
                 repack=_repack_int8_engine("fbgemm"), packages=True),
    WeightFormat("dynamic fbgemm", "int8", _pack_int8_engine("fbgemm"), _int8_reference,
                 {"u8s8 dynamic": _int8_dynamic, "u8s8 per row": _int8_dynamic_rows, "int8pack_mm": _int8pack,
                  "dequant bf16": _int8_dequant_bf16},
                 activation_levels={"u8s8 dynamic": 255, "u8s8 per row": 255}, one_row_paths=("u8s8 dynamic",),
                 many_row_paths=("dequant bf16",),
                 available=_engine_available("fbgemm"), same_weights_as="weight-only",
                 repack=_repack_int8_engine("fbgemm")),
    WeightFormat("dynamic onednn", "int8", _pack_int8_engine("onednn"), _int8_reference,
                 {"u8s8 dynamic": _int8_dynamic, "u8s8 per row": _int8_dynamic_rows, "int8pack_mm": _int8pack,
                  "dequant bf16": _int8_dequant_bf16},
                 activation_levels={"u8s8 dynamic": 255, "u8s8 per row": 255}, one_row_paths=("u8s8 dynamic",),
                 many_row_paths=("dequant bf16",),
                 available=_engine_available("onednn"), same_weights_as="weight-only",
                 repack=_repack_int8_engine("onednn")),
    # Both engines' packings of one q and s: one more packed copy of the weight, for a layer where one
    # engine is faster at 1 row and the other at several. On an Intel Xeon with AMX, the lm_head's
    # fbgemm kernel is the faster at 1 row and oneDNN's (AMX-INT8) at 8 rows: 1.7 against 2.3-3.1 ms.
    WeightFormat("dynamic fbgemm+onednn", "int8", _pack_int8_both_engines, _int8_reference,
                 {"u8s8 dynamic": _int8_dynamic, "u8s8 per row": _int8_dynamic_rows,
                  "onednn u8s8 dynamic": _int8_dynamic_onednn, "onednn u8s8 per row": _int8_dynamic_rows_onednn,
                  "int8pack_mm": _int8pack, "dequant bf16": _int8_dequant_bf16},
                 activation_levels={"u8s8 dynamic": 255, "u8s8 per row": 255, "onednn u8s8 dynamic": 255,
                                    "onednn u8s8 per row": 255},
                 one_row_paths=("u8s8 dynamic", "onednn u8s8 dynamic"), many_row_paths=("dequant bf16",),
                 available=lambda: _engine_available("fbgemm")() and _engine_available("onednn")(),
                 parts={"dynamic fbgemm": {"u8s8 dynamic": "u8s8 dynamic", "u8s8 per row": "u8s8 per row",
                                           "int8pack_mm": "int8pack_mm", "dequant bf16": "dequant bf16"},
                        "dynamic onednn": {"u8s8 dynamic": "onednn u8s8 dynamic", "u8s8 per row": "onednn u8s8 per row",
                                           "int8pack_mm": "int8pack_mm", "dequant bf16": "dequant bf16"}}),
    WeightFormat("int4pack", "int4", _pack_int4(packed=True, unpacked=False), _int4_reference,
                 {"int4pack_mm": _int4pack, "dequant bf16": _int4pack_dequant(torch.bfloat16),
                  "dequant fp32": _int4pack_dequant(torch.float32)},
                 many_row_paths=("dequant bf16", "dequant fp32"),
                 available=_has("aten", "_weight_int4pack_mm_for_cpu")),
]
# Elsewhere (CUDA, MPS) each precision has one format; its GEMM libraries are not chosen from here.
_PLAIN = {f.precision: f for f in CPU_FORMATS if f.name == "plain"}
OTHER_FORMATS: list[WeightFormat] = [
    WeightFormat("plain", "float32", _PLAIN["float32"].pack, _PLAIN["float32"].reference_weight, {"F.linear": _plain}),
    WeightFormat("plain", "bfloat16", _PLAIN["bfloat16"].pack, _PLAIN["bfloat16"].reference_weight,
                 {"F.linear": _plain}),
    WeightFormat("weight-only", "int8", _pack_int8, _int8_reference, {"dequant bf16": _int8_dequant_bf16}),
    WeightFormat("unpacked", "int4", _pack_int4(packed=False, unpacked=True), _int4_reference,
                 {"dequant bf16": _int4_dequant}),
]


def formats_for(precision: str, device_type: str = "cpu") -> list[WeightFormat]:
    if precision not in PRECISIONS:
        raise ConfigError(f"dtype {precision!r} is not supported for inference; choose {', '.join(PRECISIONS)}")
    table = CPU_FORMATS if device_type == "cpu" else OTHER_FORMATS
    return [f for f in table if f.precision == precision and f.available()]


def format_named(precision: str, name: str, device_type: str = "cpu") -> WeightFormat:
    for f in formats_for(precision, device_type):
        if f.name == name:
            return f
    raise ConfigError(f"no {precision} weight format {name!r} on {device_type}")


def kernel_dtype(precision: str) -> torch.dtype:
    """The dtype a precision's kernels take activations in. Around the linears (embeddings, LayerNorm,
    attention, the residual stream, the KV cache, the logits) the model computes in float32 at every
    precision, as llama.cpp does: a bf16 residual stream measurably raises perplexity (BENCHMARKS.md)."""
    return torch.float32 if precision == "float32" else torch.bfloat16


# llama.cpp keeps a Q4_0 file's output matrix at 6 bits (Q6_K): the logits are the most sensitive
# product. Our int4 models keep the lm_head at int8 for the same reason.
HEAD_PRECISION = {"int4": "int8"}

# int8's c_attn rounds q, k and v to bf16, as the bf16 and int4 kernels return them: its keys then fit a
# bf16 KV cache exactly (keys_are_bf16), which halves the bytes a decode step reads over a long context
# (llama.cpp keeps f16 caches). bf16 rounds by at most 2^-9 of a value, finer than the int8 weights do
# (a step of max |w| / 127 per channel); the quality it costs is measured in BENCHMARKS.md.
ROUNDS_KEYS_TO = {"int8": torch.bfloat16}


def layer_precision(precision: str, attr: str) -> str:
    return HEAD_PRECISION.get(precision, precision) if attr == "lm_head" else precision


# ---------------------------------------------------------------------------------------------
# the module: one linear in one format, one path per regime
# ---------------------------------------------------------------------------------------------

REGIMES = ("decode", "batch", "short", "prefill", "long")
BATCH_ROWS = 2      # from here on a call is "batch" (several sequences decoding at once)
SHORT_ROWS = 33     # from here on "short" (a short prompt)
PREFILL_ROWS = 128  # from here on "prefill". A path that dequantizes the weight once per call costs a
                    # fixed 1-2 ms per 2304x768 weight here, one that dequantizes per block of rows
                    # (int4pack_mm) a cost per row: which is faster flips between 64 and 128 rows.
LONG_ROWS = 256     # and from here on "long" (a long prompt, or a server's prefill chunk)


# The paths of a bfloat16, int8 or int4 format that multiply in float32 (the weight read back or dequantized
# to float32): where one feeds a bf16 kernel, its float32 output is cast to bf16 (engine.compile_options).
FLOAT32_GEMM_PATHS = frozenset({"fp32 GEMM", "dequant fp32"})


def regime_of(rows: int) -> str:
    if rows < SHORT_ROWS:
        return "decode" if rows < BATCH_ROWS else "batch"
    if rows < PREFILL_ROWS:
        return "short"
    return "prefill" if rows < LONG_ROWS else "long"


# Centered logits (FastLinear's centers_logits, for the lm_head at these precisions): a bf16 kernel
# returns bf16 logits, whose rounding grows with their size, and GPT-2's logits share a large negative
# offset (around -60 for the released 124M in published examples), where a bf16 step is 0.25-0.5. Each
# row is computed around an estimate of its largest logit, c = the row's mean logit + OFFSET_SPREADS
# standard deviations (logit_offset, from statistics of the weight's rows): the kernel computes
# x w_j - c in float32 (-c an extra input column, against a column of ones in the weight), rounds that
# to bf16, and c is added back in float32. On the quickstart model with an offset of -60 built in, the
# KL divergence from float32 went from 0.0023 to 0.00004, and 0.00005 to 0.00003 without (BENCHMARKS.md).
# A compiled step whose GEMM is Inductor's reads the float32 accumulator instead (engine.compile_options):
# no rounding left, 0.00003 -> 0.000009.
CENTERED_LOGITS = {"bfloat16"}
OFFSET_SPREADS = 4.0
OFFSET_DIRECTIONS = 8
OFFSET_SAMPLE_ROWS = 4096  # rows the mean and directions are estimated from: an estimate needs no more
# Columns added to the weight: ones against the offset, then zeros. One column alone (K 769) decoded 1.6%
# slower eager and 6-8% compiled; 32 (K 800, whole blocks for Inductor's GEMM template) 2.5% and 3.5%.
OFFSET_COLUMNS = 32


def logit_offset_basis(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """w (N, K) -> what logit_offset needs, float32, from every N/4096th row rounded to dtype (the kernel's):
    "offset_basis" (K, 1 + r), the rows' mean and their top r principal directions, and "offset_weights"
    (1 + r,): the rest's mean variance (the variance along the other directions, taken as equal), then
    each top direction's variance minus it."""
    sample = w[:: max(1, w.size(0) // OFFSET_SAMPLE_ROWS)].to(dtype).double()
    variances, directions = torch.linalg.eigh(torch.cov(sample.t()))  # ascending
    variances = variances.clamp(min=0)
    r = min(OFFSET_DIRECTIONS, variances.numel() - 1)
    rest = variances[:-r].mean()
    basis = torch.cat([sample.mean(0, keepdim=True).t(), directions[:, -r:]], dim=1)  # (K, 1 + r)
    weights = torch.cat([rest[None], variances[-r:] - rest])  # (1 + r,)
    return {"offset_basis": basis.float().contiguous(), "offset_weights": weights.float()}


def logit_offset(x: torch.Tensor, basis: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 -> (M,): each row's mean logit + OFFSET_SPREADS standard deviations, the variance
    x^T cov x taken as rest |x|^2 plus, along each top direction, (its variance - rest) (x . direction)^2."""
    projected = x @ basis  # (M, 1 + r): the mean logit, then x along each top direction
    variance = torch.addmv(weights[0] * x.square().sum(1), projected[:, 1:].square(), weights[1:])
    return torch.add(projected[:, 0], variance.clamp_(min=0).sqrt_(), alpha=OFFSET_SPREADS)


class FastLinear(nn.Module):
    """y = act(x W^T + b) with W stored in a WeightFormat and one chosen path per regime. Inference only."""

    def __init__(self, fmt: WeightFormat, weight: torch.Tensor, bias: torch.Tensor | None,
                 paths: dict[str, str], activation: str | None = None, returns_kernel_dtype: bool = False,
                 rounds_to: torch.dtype | None = None, centers_logits: bool = False):
        super().__init__()
        self.format, self.activation = fmt, activation
        # returns_kernel_dtype: y stays in the kernel's dtype (bf16; float32 from a u8s8 kernel) instead of
        # the input's. For layers whose consumer is the next linear (which would cast it back) or the
        # residual add (which promotes to float32 exactly as a cast would): the same numbers, fewer casts.
        self.returns_kernel_dtype = returns_kernel_dtype
        # rounds_to: y is rounded to this dtype whatever the path returns (int8's c_attn: ROUNDS_KEYS_TO)
        self.rounds_to = rounds_to
        self.out_features, self.in_features = weight.shape
        self.path_names = dict(paths)  # regime -> path name, for describe()
        self.paths = {regime: fmt.paths[name] for regime, name in paths.items()}
        self.dtype = kernel_dtype(fmt.precision)
        self.input_dtype = torch.float32 if fmt.takes_float32 else self.dtype  # a centered lm_head's x
        # centers_logits (CENTERED_LOGITS): the weight gains a column of ones, x a column of -offset
        if centers_logits and activation is not None:
            raise ValueError("a layer that centers its outputs cannot fuse an activation")
        self.centers_logits = centers_logits
        weight = weight.detach().float()
        if centers_logits:
            for name, t in logit_offset_basis(weight, self.dtype).items():
                self.register_buffer(name, t, persistent=False)
            centered = weight.new_zeros(weight.size(0), self.in_features + OFFSET_COLUMNS, dtype=self.dtype)
            centered[:, : self.in_features] = weight  # rounded to the kernel's dtype, as its pack would
            centered[:, self.in_features] = 1.0  # against x's column of -offset; the rest pad K to a multiple of 32
            weight = centered  # (N, K + OFFSET_COLUMNS)
        self.tensors = fmt.pack(weight, None if bias is None else bias.detach().float())
        for name, t in self.tensors.items():
            if isinstance(t, torch.Tensor):
                self.register_buffer(name, t, persistent=False)  # moves with the module; never saved
        self.register_buffer("bias", None if bias is None else bias.detach().to(self.dtype), persistent=False)
        self._gather_kernel_args()

    def _gather_kernel_args(self) -> None:
        # What the paths read, gathered once (a decode step calls ~50 linears: per-call lookups add up).
        self.kernel_args = {**path_args(self.tensors),  # the tensors as the buffers are now (after .to())
                            **{name: self._buffers[name] for name in self.tensors if name in self._buffers}}

    def _apply(self, fn, recurse=True):  # .to(), .cpu(), ... replace the buffers: gather them again
        module = super()._apply(fn, recurse)
        self._gather_kernel_args()
        return module

    def __setstate__(self, state):  # copy.deepcopy: the copy's buffers and keys are its own
        super().__setstate__(state)
        self._gather_kernel_args()

    def __deepcopy__(self, memo):
        # oneDNN's and MKL's packed weights (mkldnn layout) have no storage for deepcopy to copy (and a clone
        # of MKL's is not MKL's packing): each is packed again from the weight it reads back, exactly
        opaque = {name: t for name, t in self.tensors.items() if isinstance(t, torch.Tensor) and t.is_mkldnn}
        if opaque:
            repacked = self.format.pack(self.format.compile_weight(self.kernel_args), None)
            for name, t in opaque.items():
                memo.setdefault(id(t), repacked[name])
        copied = memo[id(self)] = self.__class__.__new__(self.__class__)
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()  # (M, K); kernels need contiguous rows; the path casts
        if self.centers_logits:
            return self._centered(x2).view(*x.shape[:-1], self.out_features)
        y = self.paths[regime_of(x2.size(0))](x2, self.kernel_args, self.bias, self.activation)
        if self.rounds_to is not None:
            y = y.to(self.rounds_to)
        if not self.returns_kernel_dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _centered(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 (M, N) logits x W^T + b, each row computed around its offset (CENTERED_LOGITS)."""
        offset = logit_offset(x.float(), self.offset_basis, self.offset_weights)  # (M,), an estimate
        centered = x.new_zeros(x.size(0), self.in_features + OFFSET_COLUMNS, dtype=self.input_dtype)  # (M, K + 32)
        centered[:, : self.in_features] = x
        centered[:, self.in_features] = offset.neg()
        y = self.paths[regime_of(x.size(0))](centered, self.kernel_args, self.bias, None)
        # the offset added back is read from the kernel's input, as it took it: a compiled step keeps no
        # rounding it can skip (engine.compile_options) and would add back the unrounded estimate
        return y.float() - centered[:, self.in_features, None].float()

    def keep_plain_weight(self, weight: torch.Tensor | None = None) -> None:
        """Keep the plain (N, K) weight, read back from the packing unless given, for a compiled path that
        reads it (WeightFormat.compile_weight). Eager paths never read it."""
        if "weight" not in self.tensors:
            weight = self.format.compile_weight(self.kernel_args) if weight is None else weight.detach()
            self.tensors["weight"] = weight
            self.register_buffer("weight", weight, persistent=False)
            self._gather_kernel_args()

    def name_engine_objects(self, prefix: str) -> None:
        """Keys its engine objects prefix + their tensors' names (_Packed.key), for a compiled graph to hold."""
        for name, t in self.tensors.items():
            if isinstance(t, _Packed):
                t.rename(f"{prefix}.{name}")
        self._gather_kernel_args()

    def reference_weight(self) -> torch.Tensor:
        """The (N, K) weight this layer computes with, float64, read back from its packing."""
        args = self.kernel_args
        return self.format.reference_weight(args.get("weight"), args)[:, : self.in_features]

    def output_dtypes(self) -> set[torch.dtype]:
        """The dtypes its paths return (before forward casts back), each path run once on one zero row (CPU)."""
        if self.rounds_to is not None:
            return {self.rounds_to}
        if self.centers_logits:
            return {torch.float32}
        x = torch.zeros(1, self.in_features)
        return {path(x, self.kernel_args, self.bias, self.activation).dtype for path in set(self.paths.values())}

    def extra_repr(self) -> str:
        fused = f", {self.activation} fused" if self.activation else ""
        if self.rounds_to is not None:
            fused += f", rounded to {str(self.rounds_to).removeprefix('torch.')}"
        if self.centers_logits:
            fused += ", logits centered"
        return (f"in={self.in_features}, out={self.out_features}, {self.format.precision} {self.format.name}{fused}, "
                + ", ".join(f"{r}: {p}" for r, p in self.path_names.items()))


def linear_layers(model) -> list[tuple[nn.Module, str, nn.Linear, str | None]]:
    """Every (parent, attribute, nn.Linear, fused activation) the inference formats replace."""
    found = []
    for block in model.transformer.h:
        found += [(block.attn, attr, getattr(block.attn, attr), fused_activation(model.config, attr))
                  for attr in ("c_attn", "c_proj")]
        found += [(block.mlp, attr, getattr(block.mlp, attr), fused_activation(model.config, attr))
                  for attr in ("c_fc", "c_proj")]
    found.append((model, "lm_head", model.lm_head, None))
    return found


def fused_activation(config, attr: str) -> str | None:
    """c_fc takes GPT-2's tanh-GELU along when the MLP uses it (the MLP's act then becomes Identity)."""
    gelu = config.activation_function in ("gelu_new", "gelu_pytorch_tanh")
    return "gelu_tanh" if attr == "c_fc" and gelu else None


def without_dropout(model: nn.Module) -> nn.Module:
    """In place: every nn.Dropout a forward calls becomes nn.Identity, for a model that only infers
    (load_for_inference, apply_plan). In eval mode a Dropout returns its input, yet each of its 25 calls a
    GPT-2 124M decode step still cost a few microseconds (a module call, F.dropout, a dispatch): 0.2-0.6 ms
    a step together (BENCHMARKS.md). Attention's attn_dropout stays, as SDPA reads its p."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Dropout) and name != "attn_dropout":
                setattr(module, name, nn.Identity())
    return model


@torch.no_grad()
def apply_plan(model: nn.Module, plan) -> nn.Module:
    """In place: every linear becomes a FastLinear in the plan's format and paths (kernels.Plan), wte a bf16
    table below float32 (embedding_to_bf16), dropout an identity (without_dropout); everything else stays
    float32."""
    model.float()
    device_type = model.transformer.wte.weight.device.type
    for parent, attr, linear, activation in linear_layers(model):
        place_planned_linear(plan, parent, attr, linear.weight, linear.bias, activation, device_type)
    embedding_to_bf16(model)
    return without_dropout(model).eval()


# Compiling a decode step through torch.compile (freezing, Inductor packing every weight its own way,
# autotuning) took about 3.5x the float32 linear weights' bytes beside the loaded model (1.8 GB for GPT-2
# 124M's 0.5 GB; gpt2-xl was killed at 24 GB), and 3.8x the bf16 ones (12 GB for gpt2-xl's 3.1 GB)
# (BENCHMARKS.md). A packaged step needs more (engine.PACKAGE_BUILD_BYTES_PER_WEIGHT_BYTE).
COMPILE_BYTES_PER_WEIGHT_BYTE = 4.0


def available_memory_bytes() -> float:
    """MemAvailable from /proc/meminfo; infinite where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


@torch.no_grad()
def add_compile_weights(model: nn.Module) -> None:
    """Before a decode step compiles: each layer whose format's compiled path reads a plain weight the format
    does not keep (WeightFormat.compile_weight) gets it back, a float32 model's tied lm_head wte's own
    table. Eager, a model holds each such weight once (MKL's or oneDNN's packing); compiled, twice, as
    Inductor packs its own from the plain one. Where compiling with them would not fit in the memory
    available (COMPILE_BYTES_PER_WEIGHT_BYTE), they are left out: those layers compile as their own
    kernels (mkl_linear_op, oneDNN's op), nothing for Inductor to pack, ~10% slower at 1 row and ~20%
    at 8 for MKL's (GPT-2 124M). A packaged step (engine.PackagedDecodeStep) checks its own, larger need."""
    packed = [(attr, layer) for _, attr, layer, _ in linear_layers(model) if isinstance(layer, FastLinear)]
    layers = [(attr, layer) for attr, layer in packed if layer.format.compile_weight is not None]
    if not layers:
        return
    needed, available = COMPILE_BYTES_PER_WEIGHT_BYTE * compiled_weight_bytes(model), available_memory_bytes()
    if needed > available:
        log.warning("compiling with Inductor's own weights needs ~%.1f GB, %.1f GB available: %d layers "
                    "compile as their own library's GEMM instead (MKL's, oneDNN's)", needed / 1e9,
                    available / 1e9, len(layers))
        return
    table = model.transformer.wte.weight
    for attr, layer in layers:
        tied = attr == "lm_head" and table.dtype == torch.float32 and table.shape == (layer.out_features,
                                                                                       layer.in_features)
        layer.keep_plain_weight(table if tied else None)
    return_freed_memory()


def drop_compile_weights(model: nn.Module) -> None:
    """Undo add_compile_weights: the plain weights let go, once nothing left to compile reads them (a loaded
    package holds its own). The eager paths never read them."""
    for _, _, layer, _ in linear_layers(model):
        if isinstance(layer, FastLinear) and layer.format.compile_weight is not None and "weight" in layer.tensors:
            del layer.tensors["weight"], layer._buffers["weight"]
            layer._gather_kernel_args()
    return_freed_memory()


# A weight's bytes as stored, which is what a decode call reads of it (the kernel measurement's copies, the
# roofline): int8 with a scale per row (negligible), int4 with 4 bytes of scale + zero per group
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1, "int4": 0.5 + 4 / INT4_GROUP}


def linear_weight_bytes(model: nn.Module) -> dict[str, float]:
    """The bytes of the packed linear weights, by the precision each is stored at (an int4 model's lm_head
    under int8: HEAD_PRECISION)."""
    found: dict[str, float] = {}
    for _, _, layer, _ in linear_layers(model):
        if isinstance(layer, FastLinear):
            precision = layer.format.precision
            weights = layer.out_features * layer.in_features
            found[precision] = found.get(precision, 0) + weights * WEIGHT_BYTES[precision]
    return found


def compiled_weight_bytes(model: nn.Module) -> float:
    """The bytes of the float32 and bf16 linear weights, which a compiled step's Inductor packs its own way."""
    found = linear_weight_bytes(model)
    return found.get("float32", 0) + found.get("bfloat16", 0)


@torch.no_grad()
def embedding_to_bf16(model: nn.Module) -> None:
    """In place: if the lm_head is packed below float32, wte becomes a bf16 table: half the bytes of the
    float32 one (77 MB less for GPT-2 124M, 161 MB for gpt2-xl), as llama.cpp's BF16 files keep token_embd.

    The lookup's values are rounded to bf16 once; the sum with wpe and everything after stay float32.
    Measured on the quickstart model (BENCHMARKS.md): the mean KL divergence from float32's predictions
    moved by under 2% at bf16, int8 and int4. Looking tokens up in the int8 lm_head's own rows instead
    (no bytes of its own) raised int8's by 27%. No lm_head weight can serve as the table: a bf16 one
    carries the columns of its centered logits (CENTERED_LOGITS). A float32 model keeps its float32
    table (its lm_head in MKL's format keeps only MKL's packed copy beside it; add_compile_weights hands it
    the table itself when a step compiles).
    """
    head, wte = model.lm_head, model.transformer.wte
    if isinstance(head, FastLinear) and head.format.precision != "float32":
        model.transformer.wte = nn.Embedding.from_pretrained(wte.weight.detach().to(torch.bfloat16), freeze=True)


def place_planned_linear(plan, parent: nn.Module, attr: str, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None, device_type: str) -> None:
    """parent.attr becomes the FastLinear the plan gives it, holding weight (N, K) and bias."""
    # The residual projections feed the float32 residual add, a c_fc with its GELU fused feeds the MLP's
    # c_proj, and attention casts q, k and v itself (a bf16 cache takes c_attn's bf16 keys as they are):
    # each takes the kernel's dtype as it comes, two casts fewer a layer in every decode step. The lm_head
    # (float32 logits) and an unfused c_fc (its GELU in float32) cast back.
    returns_kernel_dtype = attr != "lm_head" and (attr != "c_fc" or activation is not None)
    setattr(parent, attr, planned_linear(plan, attr, weight, bias, activation, device_type,
                                         returns_kernel_dtype=returns_kernel_dtype))
    if activation is not None:
        parent.act = nn.Identity()


def planned_linear(plan, attr: str, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                   device_type: str, returns_kernel_dtype: bool = False) -> FastLinear:
    """The FastLinear the plan gives a layer (attr: its name in linear_layers) holding this weight (N, K)."""
    precision = layer_precision(plan.precision, attr)
    choice = plan.choice_for(weight.size(0), weight.size(1), activation, precision)
    fmt = format_named(precision, choice.format, device_type)
    return FastLinear(fmt, weight, bias, choice.paths, activation, returns_kernel_dtype=returns_kernel_dtype,
                      rounds_to=ROUNDS_KEYS_TO.get(precision) if attr == "c_attn" else None,
                      centers_logits=attr == "lm_head" and precision in CENTERED_LOGITS)


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # load_for_inference's kv_dtype, or "auto"


def keys_are_bf16(model) -> bool:
    """Whether every c_attn returns bf16 from each of its paths. Its keys and values are then bf16 numbers
    (forward casts them to float32 exactly), which a bf16 KV cache holds without rounding anything: at
    bfloat16 and int4, unless a plan multiplies bf16 weights in float32 (bfloat16's "fp32 GEMM" path),
    and at int8, whose c_attn rounds to bf16 (ROUNDS_KEYS_TO)."""
    layers = [block.attn.c_attn for block in model.transformer.h]
    if not all(isinstance(layer, FastLinear) for layer in layers):
        return False
    distinct = {(layer.format.precision, layer.format.name, *sorted(layer.path_names.items())): layer
                for layer in layers}  # one shape, one choice: each distinct plan is probed once
    return all(_returns_bf16(layer) for layer in distinct.values())


def plan_keys_are_bf16(plan, config) -> bool:
    """keys_are_bf16 of a model of this config under the plan, without the model (`gpt2 info --kernels`
    builds it on the meta device): one c_attn in the plan's choice, packed from a random weight of its
    shape, on the CPU. A path's output dtype is its kernel's; the weight's values play no part."""
    C = config.n_embd
    weight = torch.randn(3 * C, C, generator=torch.Generator().manual_seed(0)) * 0.02
    return _returns_bf16(planned_linear(plan, "c_attn", weight, torch.zeros(3 * C), None, "cpu"))


def _returns_bf16(layer: FastLinear) -> bool:
    with torch.inference_mode():
        return layer.output_dtypes() == {torch.bfloat16}


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator is left as it is
        return None


def return_freed_memory() -> None:
    """Hand back to the system the free pages glibc's heap keeps between live allocations (malloc_trim).

    Packing a layer frees its float32 weight and temporaries among the packed tensors already made;
    glibc keeps such holes for later, so loading twelve GPT-2 124M blocks at int4 left 85-390 MB of
    them (it varied from run to run) where the packed blocks hold 70 (BENCHMARKS.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def load_for_inference(name_or_path, dtype: str = "float32", device=None, verbose: bool = False,
                       kv_dtype: str = "auto"):
    """A model ready for generate, its linears in the kernels measured fastest here (kernels.py).

    kv_dtype, its KV caches' dtype (GPT.kv_dtype): "auto" keeps them in bf16 where that rounds nothing
    (keys_are_bf16: bfloat16, int8 and int4) and attention over them measures no slower on this machine
    (kernels.kv_cache_dtype), else float32; for a compiled step's caches (GPT.compiled_kv_dtype) its own
    attention is timed, when one first needs a cache. "bfloat16" always (as llama.cpp keeps f16 ones: half their
    memory; at float32 the keys and values are rounded, so logits move by about bf16's rounding);
    "float32" never."""
    from gpt2.kernels import kv_cache_dtype, plan_for
    from gpt2.model import GPT
    if dtype not in PRECISIONS:
        raise ConfigError(f"dtype {dtype!r} is not supported for generation; choose {', '.join(PRECISIONS)}")
    if kv_dtype != "auto" and kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype {kv_dtype!r} is not supported; choose auto, {', '.join(KV_DTYPES)}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan, started = None, time.time()

    @torch.no_grad()
    def place(model, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # Each linear is packed as the loader reads it, so loading holds one layer's float32 weight beside
        # the packed ones, never the whole float32 model (gpt2-xl at int4: BENCHMARKS.md).
        nonlocal plan
        if plan is None:  # the first layer read: every linear of the (meta) model is still an nn.Linear
            plan = plan_for(model, dtype, device.type)
        parent_name, _, attr = name.rpartition(".")
        place_planned_linear(plan, model.get_submodule(parent_name), attr, weight, bias,
                             fused_activation(model.config, attr), device.type)
        # The layers before this one: their float32 weights and temporaries. Every layer, so the bound
        # holds whatever glibc does (every 256 MB of weights instead loaded gpt2-xl at int4 ~1 s faster)
        return_freed_memory()

    with collapsing_what_loads(device.type == "cpu") as huge_pages:  # after the trim, which would split them
        model = without_dropout(GPT.from_pretrained(name_or_path, device=device, dtype=torch.float32,
                                                    replace_linear=place))
        embedding_to_bf16(model)  # the lm_head comes last: the float32 table goes now
        return_freed_memory()
    if dtype == "int4":
        prune_int4_cache(used_since=started)  # this model's entries stay
    if kv_dtype == "auto":
        model.kv_dtype, why = kv_cache_dtype(model)
        model.compiled_kv_dtype = "auto"  # chosen when a compiled step first needs a cache (kv_cache.cache_dtype)
    else:
        model.kv_dtype = model.compiled_kv_dtype = KV_DTYPES[kv_dtype]
        why = "as asked"
    if verbose:
        print(plan.describe(), flush=True)
        print(f"KV cache: {str(model.kv_dtype).removeprefix('torch.')} ({why})", flush=True)
        if device.type == "cpu":
            print(f"loaded into 2 MiB pages: {huge_pages.bytes / 2**20:.0f} MiB (huge_pages.py)", flush=True)
    return model


def load_draft(draft: str, target_path, dtype: str, device=None, verbose: bool = False, kv_dtype: str = "auto"):
    """A speculative-decoding draft for the model at target_path: "self:int8" / "self:int4" load that same
    checkpoint again at that precision; anything else is a model path or name, loaded at `dtype`."""
    from gpt2.engine import SELF_DRAFTS
    if draft in SELF_DRAFTS:
        return load_for_inference(target_path, dtype=SELF_DRAFTS[draft], device=device, verbose=verbose,
                                  kv_dtype=kv_dtype)
    return load_for_inference(draft, dtype=dtype, device=device, verbose=verbose, kv_dtype=kv_dtype)
