"""Inference weight formats: int8 weight-only quantization, and oneDNN-packed bfloat16 linears on CPU.

    from gpt2.quantize import quantize_int8, pack_bf16
    model = quantize_int8(GPT.from_pretrained("gpt2"))                       # int8 weights, bf16 compute
    model = pack_bf16(GPT.from_pretrained("gpt2", dtype=torch.bfloat16))     # same numbers, faster on CPU

    gpt2 generate --model gpt2 --dtype int8 "Hello"

Decoding one token reads every weight once, so on a CPU its speed is set by bytes of weights per
token: float32 4, bfloat16 2, int8 1 (+ one scale per output channel).

int8: every nn.Linear (and the lm_head, which gets its own int8 copy of wte; the embedding lookup stays
in bf16) becomes a QuantLinear: w ~= q * s with q int8 (out, in) and s (out,) = max|w[row]| / 127
(symmetric, per output channel). Activations stay in the compute dtype. On CPU the product runs in
PyTorch's `_weight_int8pack_mm` kernel (it dequantizes inside the GEMM); elsewhere q is dequantized on
the fly. Quality cost, measured on real text: see BENCHMARKS.md (## Generation).

pack_bf16: PyTorch's plain bf16 GEMM on CPU is slow for one row (decode); oneDNN with the weight
reordered once into its blocked layout runs at memory speed. Same arithmetic, same results to
bf16 rounding. CPU only; other devices keep nn.Linear.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2.errors import ConfigError


def _int8pack_available(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and hasattr(
        torch.ops.aten, "_weight_int8pack_mm")


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float -> q (out, in) int8, scales (out,) float32 with w ~= q * scales[:, None]."""
    w = w.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (out,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class QuantLinear(nn.Module):
    """nn.Linear with int8 weights and per-output-channel scales; computes in the activations' dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype=torch.bfloat16):
        super().__init__()
        q, scales = quantize_per_channel(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q.to(weight.device))                           # (out, in)
        self.register_buffer("scales", scales.to(device=weight.device, dtype=compute_dtype))  # (out,)
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if x2.size(0) >= PackedLinear.PREFILL_ROWS and x2.device.type == "cpu":
            # Prefill: dequantize once and use the float32 GEMM, far faster than int8pack for many rows.
            w = self.weight_int8.float() * self.scales.float()[:, None]
            y = F.linear(x2.float(), w).to(x.dtype)
        elif _int8pack_available(x2):
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight_int8, self.scales.to(x.dtype))
        else:
            y = F.linear(x2, self.weight_int8.to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class PackedLinear(nn.Module):
    """A bf16 nn.Linear whose weight oneDNN has reordered once for fast CPU GEMV (decode).

    For many rows (prefill) it multiplies in float32 instead: without AMX, PyTorch's bf16 GEMM runs
    below MKL's float32 one (measured: BENCHMARKS.md), and upcasting a weight costs far less than
    the GEMM. The result is rounded back to bf16 (it is the more accurate product).
    """

    PREFILL_ROWS = 64  # from here on, the float32 GEMM wins

    def __init__(self, linear_weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = linear_weight.shape
        self.register_buffer("weight", linear_weight.detach())
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear_weight.detach(), 1))
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= self.PREFILL_ROWS * self.in_features:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return packed_linear(x, self.packed, self.bias)


@torch.library.custom_op("gpt2::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a reordered weight, as an opaque op: torch.compile calls it as it is
    (Inductor cannot lower the pre-packed op itself)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias):
    return x.new_empty(*x.shape[:-1], packed.shape[0])  # (..., out)


def _replace_linears(model: nn.Module, make) -> nn.Module:
    """Swap every nn.Linear in the blocks, and the lm_head, for make(weight, bias)."""
    for block in model.transformer.h:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child.weight, child.bias))
    model.lm_head = make(model.lm_head.weight, None)  # its own copy; wte stays for the lookup
    return model


@torch.no_grad()
def quantize_int8(model: nn.Module, compute_dtype=torch.bfloat16) -> nn.Module:
    """In place: int8 weight-only linears; embeddings, LayerNorms and activations in compute_dtype."""
    model.to(compute_dtype)
    return _replace_linears(model, lambda w, b: QuantLinear(w, b, compute_dtype)).eval()


def can_pack_bf16(model: nn.Module) -> bool:
    w = model.transformer.wte.weight
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@torch.no_grad()
def pack_bf16(model: nn.Module) -> nn.Module:
    """In place, for bf16 models on CPU (a no-op elsewhere): oneDNN-packed linears. Inference only."""
    if not can_pack_bf16(model):
        return model
    return _replace_linears(model, PackedLinear).eval()


def load_for_inference(name_or_path, dtype: str = "float32", device=None):
    """A model ready for generate: float32, bfloat16 (oneDNN-packed linears on CPU) or int8 weight-only."""
    from gpt2.model import GPT
    if dtype not in ("float32", "bfloat16", "int8"):
        raise ConfigError(f"dtype {dtype!r} is not supported for generation; choose float32, bfloat16 or int8")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "int8":
        return quantize_int8(GPT.from_pretrained(name_or_path, device=device, dtype=torch.float32))
    model = GPT.from_pretrained(name_or_path, device=device, dtype=getattr(torch, dtype))
    return pack_bf16(model) if dtype == "bfloat16" else model
