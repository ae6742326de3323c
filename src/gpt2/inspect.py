"""The architecture sheet: every operation of GPT-2 in order, with shapes, parameters, FLOPs and memory.

    gpt2 inspect gpt2 --mode decode --batch 1 --past 1023
    gpt2 inspect gpt2-xl --mode training --batch 8 --seq 1024 --format html > sheet.html
    gpt2 inspect path/to/model --mode prefill --seq 128 --format json

    from gpt2.inspect import architecture_sheet, inspect_model, render_sheet, InspectConfig
    sheet = architecture_sheet(model, mode="prefill", batch=1, seq=16)   # a JSON-ready dict
    sheet = inspect_model("gpt2-xl", mode="decode")                      # a preset or directory, no weights read
    text = render_sheet(InspectConfig(model="gpt2", mode="decode"))      # what `gpt2 inspect` prints

and what a model computes on real tokens (forward hooks, registered only for that one call):

    gpt2 inspect gpt2 --prompt "The cat sat on the" --format html --head 5.1 > cat.html
    acts = capture(model, idx)                                     # every point: embedding, h.3.attn.probs, ...
    acts = capture(model, idx, ["logits"], patch={"h.5.attn.probs": zero_head})   # an ablation
    probs, ids = logit_lens(model, acts, top_k=5)                  # (n_layer, B, T, 5) each

It presents GPT-2 as the seeds do: each operation with its formula, its input and output shapes on
named axes ([B batch, 12 heads, T queries, T keys]), its parameter tensors, whether it acts only in
training, plus its forward FLOPs and the bytes of its output. The sheet is built from the model's
real module tree (parameter tensors and counts come from the nn.Parameters; the attention mask from
GPT.attention_mask_for); tests/test_inspect.py runs real forwards with hooks in all four modes and
checks every shape listed here against the shape observed.

With a prompt (prompt_sheet), each op also shows the mean, standard deviation and max |x| of the
tensor it produced, the page adds every head's attention map and the logit lens, and the JSON
carries the same numbers under "prompt" and each op's "stats".

The four modes are the four ways GPT.forward is called:
    full      model(idx): T positions, logits for all of them, dropout is the identity
    training  model.train(); model(idx, targets): dropout acts, the loss is computed
    prefill   model(idx, cache, last_logits_only=True): T new tokens written after P cached ones
              (P = 0: a prompt into an empty cache); logits for the last position only
    decode    model(idx, cache): one new token, one query against P+1 keys; the cache grows by one

FLOP conventions (forward only; backward costs about twice the forward, so training is about 3x):
a matmul (M, K) @ (K, N) is 2*M*N*K, as torch.utils.flop_counter counts it; a bias add, a residual
add, the score scaling and a dropout in training are 1 per output element; LayerNorm is 7 per element
(mean, centre, square, variance, normalize, gain, bias); softmax 5 (max, subtract, exp, sum, divide);
the activation's ACTIVATION_OPS entry below; cross-entropy 4 per logit; views, copies, the embedding
lookup and the causal mask (a select) are 0.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from gpt2.config import ACTIVATIONS, GPTConfig
from gpt2.errors import ConfigError, ContextLengthError
from gpt2.weights import parse_dtype, resolve_config

MODES = ("full", "training", "prefill", "decode")
FORMATS = ("text", "markdown", "json", "html")
LAYERNORM_FLOPS = 7
SOFTMAX_FLOPS = 5
CROSS_ENTROPY_FLOPS = 4


class ActivationOp(NamedTuple):
    label: str              # the op's name on the sheet
    formula: str
    flops_per_element: int


# How the sheet shows each of config.ACTIVATIONS (model.py holds the functions themselves).
ACTIVATION_OPS = {
    "gelu_new": ActivationOp("GELU", "GELU(h) = 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3)))", 9),
    "gelu_pytorch_tanh": ActivationOp("GELU", "GELU(h) = 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3)))", 9),
    "gelu": ActivationOp("GELU", "GELU(h) = 0.5 h (1 + erf(h / sqrt 2))", 5),
    "relu": ActivationOp("ReLU", "ReLU(h) = max(h, 0)", 1),
}
if set(ACTIVATION_OPS) != set(ACTIVATIONS):  # a new activation in config.py needs its row here
    raise RuntimeError(f"inspect.ACTIVATION_OPS covers {sorted(ACTIVATION_OPS)}, "
                       f"config.ACTIVATIONS is {sorted(ACTIVATIONS)}")


@dataclass
class InspectConfig:
    """`gpt2 inspect`: which model, which call of forward (see MODES), and how to print the sheet."""
    model: str = "gpt2"              # a preset (no weights needed), a model directory or a hub name
    mode: str = "full"
    batch: int = 1                   # B sequences
    seq: int | None = None           # T new positions (default: n_positions; decode: 1)
    past: int | None = None          # P cached positions (default: 0; decode: n_positions - 1)
    dtype: str = "float32"           # activation and KV-cache dtype, for the byte counts
    format: str = "text"             # one of FORMATS
    prompt: str | None = None        # run the model on this text: activations, attention maps, logit lens
    head: str | None = None          # "LAYER.HEAD" drawn large (default 0.0); with a prompt
    top_k: int = 5                   # logit lens: next tokens shown per layer
    seed: int = 0                    # a preset with a prompt runs at random init from this seed

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.top_k < 1:
            raise ConfigError(f"--top-k must be >= 1, got {self.top_k}")
        if self.prompt is None and self.head is not None:
            raise ConfigError("--head picks an attention map: it needs --prompt")


@dataclass
class Op:
    name: str
    block: int | None
    kind: str                        # embedding, layernorm, attention, mlp, dropout, add, head, loss: the colour
    formula: str
    input_shapes: list[list[int]]
    output_shape: list[int]
    axes: list[str]                  # the output's named axes, e.g. ["B batch", "12 heads", "T queries", "T keys"]
    input_axes: list[list[str]]
    parameters: int                  # new parameters (a tied tensor counts once, at its first use)
    parameter_tensors: list[dict]    # [{"name", "shape", "count"}], tied ones with "tied_to"
    flops: int
    activation_bytes: int            # bytes of the output at the activation dtype
    training_only: bool
    identity: bool = False           # dropout outside training: returns its input unchanged
    allocates: bool = True           # False for views and identities: no new memory
    module: str | None = None        # the nn.Module (name in model.named_modules()) that runs it
    note: str = ""


@dataclass
class _Axes:
    """Named axes of one sheet: (label, size) pairs, labels as the seeds write them."""
    config: GPTConfig
    mode: str
    B: int
    T: int
    P: int

    def __post_init__(self):
        c, decode = self.config, self.mode == "decode"
        S = self.P + self.T
        self.batch = ("B batch", self.B)
        self.pos = ("1 position" if decode else "T positions", self.T)
        self.queries = ("1 query" if decode else "T queries", self.T)
        self.keys = ("P+1 keys" if decode else ("P+T keys" if self.P else "T keys"), S)
        self.cached = ("P+1 positions" if decode else ("P+T positions" if self.P else "T positions"), S)
        self.d = (f"{c.n_embd} d", c.n_embd)
        self.qkv = (f"{3 * c.n_embd} q,k,v", 3 * c.n_embd)
        self.heads = (f"{c.n_head} heads", c.n_head)
        self.hs = (f"{c.head_size} head dims", c.head_size)
        self.ff = (f"{c.mlp_width} hidden", c.mlp_width)
        self.vocab = (f"{c.vocab_size} vocab", c.vocab_size)
        self.resid = [self.batch, self.pos, self.d]  # the residual stream x, (B, T, C)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _tensors(model: nn.Module, module_name: str, seen: dict) -> tuple[list[dict], int]:
    """Parameter tensors of one module, from the real nn.Parameters; tied tensors count at first use."""
    module = model.get_submodule(module_name)
    tensors, new = [], 0
    for pname, p in module.named_parameters(recurse=False):
        full = f"{module_name}.{pname}"
        count = p.numel()
        if full == "transformer.wte.weight":
            count = model.config.vocab_size * p.shape[1]  # padded vocabulary rows are not parameters of GPT-2
        entry = {"name": full, "shape": list(p.shape), "count": count}
        if id(p) in seen:
            entry["tied_to"] = seen[id(p)]
        else:
            seen[id(p)] = full
            new += count
        tensors.append(entry)
    return tensors, new


def architecture_sheet(model: nn.Module, mode: str = "full", batch: int = 1, seq: int | None = None,
                       past: int | None = None, dtype: str | torch.dtype = "float32",
                       source: str | None = None) -> dict:
    """The sheet of `model` (a GPT, any device including meta) for one call of forward in `mode`.

    source: where the model came from, printed in the sheet's first line (inspect_model sets it).
    """
    config: GPTConfig = model.config
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    dtype = parse_dtype(dtype)
    seq = seq if seq is not None else (1 if mode == "decode" else config.n_positions)
    past = past if past is not None else (config.n_positions - 1 if mode == "decode" else 0)
    if batch < 1 or seq < 1 or past < 0:
        raise ConfigError(f"need --batch >= 1, --seq >= 1 and --past >= 0, got {batch}, {seq}, {past}")
    if mode == "decode" and seq != 1:
        raise ConfigError("decode adds one token per step: use --seq 1 and --past P for the cached positions")
    if mode in ("full", "training") and past:
        raise ConfigError(f"{mode} mode has no KV cache: --past must be 0 (use prefill or decode)")
    if past + seq > config.n_positions:
        raise ContextLengthError(f"{past} cached + {seq} new positions exceed the context length of {config.n_positions}")

    ax = _Axes(config, mode, batch, seq, past)
    ops = _ops(model, ax, dtype)
    return _with_totals(model, ax, dtype, ops, source)


# ---------------------------------------------------------------------------------------------
# the ops, in the order GPT.forward runs them
# ---------------------------------------------------------------------------------------------

def _ops(model: nn.Module, ax: _Axes, dtype: torch.dtype) -> list[Op]:
    sheet = _OpList(model, ax, dtype)
    _embedding_ops(sheet)
    mask = _mask(model, ax)
    for i in range(len(model.transformer.h)):
        _attention_ops(sheet, i, mask)
        _mlp_ops(sheet, i)
    _head_ops(sheet)
    return sheet.ops


class _OpList:
    """The ops of one sheet as they are added, and what adding one needs (sizes, tied tensors seen)."""

    def __init__(self, model: nn.Module, ax: _Axes, dtype: torch.dtype):
        self.model, self.config, self.ax = model, model.config, ax
        self.train = ax.mode == "training"
        self.size = torch.empty(0, dtype=dtype).element_size()
        self.score_size = 4 if self.config.reorder_and_upcast_attn else self.size  # scores, softmax upcast to float32
        self.seen: dict = {}  # id(parameter) -> the name it was first counted under
        self.ops: list[Op] = []

    def add(self, name, block, kind, formula, inputs, output, flops, module=None, params_of=None,
            training_only=False, allocates=True, note="", elem_size=None):
        tensors, count = _tensors(self.model, params_of, self.seen) if params_of else ([], 0)
        identity = training_only and not self.train and kind == "dropout"
        self.ops.append(Op(
            name=name, block=block, kind=kind, formula=formula,
            input_shapes=[[s for _, s in shape] for shape in inputs],
            output_shape=[s for _, s in output], axes=[label for label, _ in output],
            input_axes=[[label for label, _ in shape] for shape in inputs],
            parameters=count, parameter_tensors=tensors,
            flops=0 if identity else flops,
            activation_bytes=_numel([s for _, s in output]) * (elem_size or self.size),
            training_only=training_only, identity=identity, allocates=allocates and not identity,
            module=module, note="identity outside training" if identity else note))

    def add_parameters(self, module_name: str) -> None:
        """Count one more module's parameter tensors in the last op."""
        tensors, count = _tensors(self.model, module_name, self.seen)
        self.ops[-1].parameter_tensors += tensors
        self.ops[-1].parameters += count

    def dropout(self, name, block, module, p_name, x, formula):
        p = getattr(self.config, p_name)
        self.add(name, block, "dropout", f"{formula}, r ~ Bernoulli(1 - {p_name}={p})", [x], x,
                 _numel([s for _, s in x]), module=module, training_only=True)


def _embedding_ops(sheet: _OpList) -> None:
    ax, x = sheet.ax, sheet.ax.resid
    B, T, P, C = ax.B, ax.T, ax.P, sheet.config.n_embd
    cached = ax.mode in ("prefill", "decode")
    sheet.add("embedding", None, "embedding", "x0 = W_te[idx] + W_pe[pos]", [[ax.batch, ax.pos], [("1", 1), ax.pos]],
              x, B * T * C, module="transformer.wte",
              note=(f"position {P}" if T == 1 else f"positions {P}..{P + T - 1}") if cached else "")
    # wte and wpe both belong to this one op; count them here from the real tensors
    sheet.add_parameters("transformer.wte")
    sheet.add_parameters("transformer.wpe")
    sheet.dropout("embedding dropout", None, "transformer.drop", "embd_pdrop", x, "x0~ = r * x0 / (1 - p)")


def _mask(model: nn.Module, ax: _Axes) -> tuple[list, str]:
    """(shape, note) of the attention mask the real model builds: None from it means plain causal."""
    mask = type(model).attention_mask_for(None, ax.P, ax.T, "meta")
    shape = [ax.queries, ax.keys] if mask is None else [("1", 1), ("1", 1), ax.queries, ax.keys]
    note = ""
    if ax.mode == "decode":
        note = "no-op: the one query sees all P+1 keys"
    elif ax.mode == "prefill" and ax.P:
        note = "query i (position P+i) sees keys 0..P+i"
    return shape, note


def _attention_ops(sheet: _OpList, i: int, mask: tuple[list, str]) -> None:
    ax, x, config = sheet.ax, sheet.ax.resid, sheet.config
    B, T, S = ax.B, ax.T, ax.P + ax.T
    nh, hs, C = config.n_head, config.head_size, config.n_embd
    h = f"transformer.h.{i}"
    q_axes = [ax.batch, ax.heads, ax.queries, ax.hs]
    kv_axes = [ax.batch, ax.heads, ax.keys, ax.hs]
    s_axes = [ax.batch, ax.heads, ax.queries, ax.keys]
    mask_shape, mask_note = mask
    sheet.add("ln_1", i, "layernorm", "Z1 = (x - mean) / sqrt(var + eps) * g + b", [x], x,
              LAYERNORM_FLOPS * B * T * C, module=f"{h}.ln_1", params_of=f"{h}.ln_1")
    sheet.add("qkv projection", i, "attention", "[Q K V] = Z1 W_attn + b_attn", [x], [ax.batch, ax.pos, ax.qkv],
              2 * B * T * C * 3 * C + B * T * 3 * C, module=f"{h}.attn.c_attn", params_of=f"{h}.attn.c_attn")
    sheet.add("head split", i, "attention", "Q, K, V -> (B, nh, T, hs) each", [[ax.batch, ax.pos, ax.qkv]],
              [("3 q,k,v", 3)] + [ax.batch, ax.heads, ax.pos, ax.hs], 0, module=f"{h}.attn", allocates=False)
    if ax.mode in ("prefill", "decode"):
        sheet.add("kv cache append", i, "cache", "K_cache[P:P+T], V_cache[P:P+T] = K, V",
                  [[ax.batch, ax.heads, ax.pos, ax.hs]] * 2, [("2 k,v", 2), ax.batch, ax.heads, ax.cached, ax.hs], 0,
                  module=f"{h}.attn", allocates=False,
                  note=f"cache grows {ax.P} -> {S} positions; returns all keys and values so far")
    sheet.add("scores", i, "attention", f"S = Q K^T / sqrt({hs})", [q_axes, kv_axes], s_axes,
              2 * B * nh * T * S * hs + B * nh * T * S, module=f"{h}.attn", elem_size=sheet.score_size)
    sheet.add("causal mask", i, "attention", "S[i, j] = -inf where key j is after query i",
              [s_axes, mask_shape], s_axes, 0, module=f"{h}.attn", elem_size=sheet.score_size, note=mask_note)
    sheet.add("softmax", i, "attention", "A = softmax(S) over keys", [s_axes], s_axes,
              SOFTMAX_FLOPS * B * nh * T * S, module=f"{h}.attn", elem_size=sheet.score_size)
    sheet.dropout("attention-weight dropout", i, f"{h}.attn.attn_dropout", "attn_pdrop", s_axes, "A~ = r * A / (1 - p)")
    sheet.add("weighted sum", i, "attention", "Y = A~ V", [s_axes, kv_axes], q_axes,
              2 * B * nh * T * S * hs, module=f"{h}.attn")
    sheet.add("head merge", i, "attention", "Y -> (B, T, nh * hs)", [q_axes], x, 0, module=f"{h}.attn")
    sheet.add("c_proj", i, "attention", "D_attn = Y W_proj + b_proj", [x], x, 2 * B * T * C * C + B * T * C,
              module=f"{h}.attn.c_proj", params_of=f"{h}.attn.c_proj")
    sheet.dropout("residual dropout", i, f"{h}.attn.resid_dropout", "resid_pdrop", x, "D_attn~ = r * D_attn / (1 - p)")
    sheet.add("residual add", i, "add", "x' = x + D_attn~", [x, x], x, B * T * C, module=h)


def _mlp_ops(sheet: _OpList, i: int) -> None:
    ax, x, config = sheet.ax, sheet.ax.resid, sheet.config
    B, T, C, W = ax.B, ax.T, config.n_embd, config.mlp_width
    h = f"transformer.h.{i}"
    ff = [ax.batch, ax.pos, ax.ff]
    act = ACTIVATION_OPS[config.activation_function]
    sheet.add("ln_2", i, "layernorm", "Z2 = (x' - mean) / sqrt(var + eps) * g + b", [x], x,
              LAYERNORM_FLOPS * B * T * C, module=f"{h}.ln_2", params_of=f"{h}.ln_2")
    sheet.add("c_fc", i, "mlp", "H = Z2 W_fc + b_fc", [x], ff, 2 * B * T * C * W + B * T * W,
              module=f"{h}.mlp.c_fc", params_of=f"{h}.mlp.c_fc")
    sheet.add(act.label, i, "mlp", act.formula, [ff], ff, act.flops_per_element * B * T * W, module=f"{h}.mlp")
    sheet.add("c_proj", i, "mlp", f"D_mlp = {act.label}(H) W_proj + b_proj", [ff], x, 2 * B * T * W * C + B * T * C,
              module=f"{h}.mlp.c_proj", params_of=f"{h}.mlp.c_proj")
    sheet.dropout("MLP dropout", i, f"{h}.mlp.dropout", "resid_pdrop", x, "D_mlp~ = r * D_mlp / (1 - p)")
    sheet.add("residual add", i, "add", "x_next = x' + D_mlp~", [x, x], x, B * T * C, module=h)


def _head_ops(sheet: _OpList) -> None:
    ax, x, config = sheet.ax, sheet.ax.resid, sheet.config
    B, T, C, V = ax.B, ax.T, config.n_embd, config.vocab_size
    sheet.add("ln_f", None, "layernorm", "Z = (x - mean) / sqrt(var + eps) * g + b", [x], x,
              LAYERNORM_FLOPS * B * T * C, module="transformer.ln_f", params_of="transformer.ln_f")
    if ax.mode == "training":
        # lm_head.lm_head_cross_entropy: the (B*T, V) logits exist one chunk of rows at a time, and the
        # head's gradients are computed in the same pass (backward work, not counted here).
        n = ("B*T tokens", B * T)
        sheet.add("lm_head + loss", None, "loss", "L = mean -log softmax(Z W_te^T)[target]", [[n, ax.d], [n]], [],
                  2 * B * T * C * V + CROSS_ENTROPY_FLOPS * B * T * V, module="",
                  params_of="lm_head", training_only=True, elem_size=4,
                  note="chunked: logits never held whole; cross-entropy in float32; targets == -100 ignored")
        return
    last = ax.mode in ("prefill", "decode")  # the engine asks for the last position's logits only
    rows = [ax.batch, ("1 position", 1) if last else ax.pos]
    sheet.add("lm_head", None, "head", "logits = Z W_te^T (tied to wte)", [rows + [ax.d]], rows + [ax.vocab],
              2 * B * rows[1][1] * C * V, module="lm_head", params_of="lm_head",
              note="last position only" if ax.mode == "prefill" else "")


# ---------------------------------------------------------------------------------------------
# totals, and the sheet of a preset or model directory
# ---------------------------------------------------------------------------------------------

def _with_totals(model, ax: _Axes, dtype, ops: list[Op], source: str | None) -> dict:
    config = model.config
    size = torch.empty(0, dtype=dtype).element_size()
    forward = sum(op.flops for op in ops)
    tokens = ax.B * ax.T
    kv_per_token = 2 * config.n_layer * config.n_embd * size  # K and V, every layer, per position per sequence
    resid = ax.B * ax.T * config.n_embd * size
    if ax.mode == "training":
        # autograd keeps (roughly) every op's output for the backward pass
        peak = sum(op.activation_bytes for op in ops if op.allocates)
    else:
        # inference frees as it goes: the largest op's inputs and output, plus the residual stream
        peak = resid + max(sum(_numel(s) for s in op.input_shapes) * size + op.activation_bytes
                           for op in ops if op.allocates)
    cached = ax.mode in ("prefill", "decode")
    return {
        "model": source,
        "mode": ax.mode,
        "batch": ax.B,
        "seq": ax.T,
        "past": ax.P,
        "dtype": str(dtype).removeprefix("torch."),
        "config": config.to_dict(),
        "total_parameters": sum(op.parameters for op in ops),
        "ops": [asdict(op) for op in ops],
        "forward_flops": forward,
        "forward_flops_per_token": forward // tokens,
        "training_flops_per_token": 3 * forward // tokens if ax.mode == "training" else None,
        "kv_cache_bytes_per_token": kv_per_token,
        "kv_cache_bytes_before": ax.B * ax.P * kv_per_token if cached else 0,
        "kv_cache_bytes_after": ax.B * (ax.P + ax.T) * kv_per_token if cached else 0,
        "peak_activation_bytes": peak,
    }


def model_for_sheet(config: GPTConfig) -> nn.Module:
    """A GPT on the meta device: the real module tree and parameter shapes, no memory for weights."""
    from gpt2.model import GPT
    with torch.device("meta"):
        return GPT(config)


def inspect_model(model_or_preset: str, mode: str = "full", batch: int = 1, seq: int | None = None,
                  past: int | None = None, dtype: str = "float32") -> dict:
    """The sheet of a preset or a model directory/hub name, without reading any weights."""
    resolved = resolve_config(model_or_preset)
    return architecture_sheet(model_for_sheet(resolved.config), mode, batch, seq, past, dtype, source=resolved.source)


def render_sheet(cfg: InspectConfig) -> str:
    """`gpt2 inspect`: the sheet of cfg.model in cfg.mode (or run on cfg.prompt), formatted as cfg.format."""
    if cfg.prompt is not None:
        sheet = inspect_prompt(cfg)
    else:
        sheet = inspect_model(cfg.model, cfg.mode, cfg.batch, cfg.seq, cfg.past, cfg.dtype)
    return FORMATTERS[cfg.format](sheet)


# ---------------------------------------------------------------------------------------------
# live activations: capture, patching, the logit lens
# ---------------------------------------------------------------------------------------------

# Each capture point: (name, module in model.named_modules() with {i} for the block, which tensor).
# "output" is what the module returns; "input" is its first argument (for points with no module of
# their own: the heads merged are attn.c_proj's input, the activation is mlp.c_proj's input).
# The module "" is the GPT itself: its return value is the logits.
GLOBAL_POINTS = {"embedding": ("transformer.drop", "input"),        # x0 = wte[idx] + wpe[pos], (B, T, C)
                 "ln_f": ("transformer.ln_f", "output"),            # (B, T, C)
                 "logits": ("", "output")}                          # (B, T, V)
BLOCK_POINTS = {
    "ln_1": ("transformer.h.{i}.ln_1", "output"),                   # (B, T, C)
    "attn.qkv": ("transformer.h.{i}.attn.c_attn", "output"),        # (B, T, 3C): q, k, v of all heads
    "attn.scores": ("transformer.h.{i}.attn.scores", "output"),     # (B, nh, T, T), scaled, before the mask
    "attn.probs": ("transformer.h.{i}.attn.probs", "output"),       # (B, nh, T, T), softmax over keys
    "attn.merged": ("transformer.h.{i}.attn.c_proj", "input"),      # (B, T, C): heads merged, nh blocks of hs
    "attn.out": ("transformer.h.{i}.attn.c_proj", "output"),        # (B, T, C): the attention's c_proj
    "resid_mid": ("transformer.h.{i}.resid_mid", "output"),         # (B, T, C): x + attention
    "ln_2": ("transformer.h.{i}.ln_2", "output"),                   # (B, T, C)
    "mlp.fc": ("transformer.h.{i}.mlp.c_fc", "output"),             # (B, T, 4C): before the activation
    "mlp.act": ("transformer.h.{i}.mlp.c_proj", "input"),           # (B, T, 4C): after it
    "mlp.out": ("transformer.h.{i}.mlp.c_proj", "output"),          # (B, T, C): the MLP's c_proj
    "resid_post": ("transformer.h.{i}", "output"),                  # (B, T, C): the block's output
}
EXPLICIT_POINTS = ("attn.scores", "attn.probs")  # exist only on the explicit attention path


def capture_points(n_layer: int) -> dict[str, tuple[str, str]]:
    """Every capture point in the order forward reaches it: name -> (module name, "input" or "output")."""
    points = {"embedding": GLOBAL_POINTS["embedding"]}
    for i in range(n_layer):
        for suffix, (module, side) in BLOCK_POINTS.items():
            points[f"h.{i}.{suffix}"] = (module.format(i=i), side)
    points["ln_f"] = GLOBAL_POINTS["ln_f"]
    points["logits"] = GLOBAL_POINTS["logits"]
    return points


def capture(model: nn.Module, idx: torch.Tensor, names=None, patch: dict | None = None) -> dict[str, torch.Tensor]:
    """Run model(idx) once and return the activations at `names` (default: every capture point).

    names: capture points, e.g. "embedding", "h.3.ln_1", "h.3.attn.scores", "h.3.attn.probs",
    "h.3.attn.out", "h.3.resid_mid", "h.3.mlp.act", "h.3.resid_post", "ln_f", "logits"
    (capture_points lists them all). patch: {name: fn}; fn(tensor) returns the tensor that flows on
    (or edits it in place and returns None): an ablation. A captured tensor is the one after its patch.

    It works through forward hooks, registered for this call only and removed afterwards. Scores and
    probabilities exist on the explicit attention path, so the blocks they name use it for this call
    (it computes what scaled_dot_product_attention does, to float32 rounding) and get use_sdpa back.
    The model's train()/eval() mode is left as it is; gradients flow if enabled (wrap in no_grad).
    """
    points = capture_points(model.config.n_layer)
    names = list(points) if names is None else [names] if isinstance(names, str) else list(names)
    patch = dict(patch or {})
    unknown = [n for n in [*names, *patch] if n not in points]
    if unknown:
        raise ConfigError(f"unknown capture point(s) {', '.join(map(repr, unknown))}; the points are "
                          f"embedding, h.{{i}}.{', h.{i}.'.join(BLOCK_POINTS)}, ln_f and logits "
                          f"(i < n_layer={model.config.n_layer})")
    captured: dict[str, torch.Tensor] = {}
    explicit = sorted({int(n.split(".")[1]) for n in [*names, *patch] if n.endswith(EXPLICIT_POINTS)})
    attns = [model.transformer.h[i].attn for i in explicit]
    saved = [attn.use_sdpa for attn in attns]
    handles = []
    try:
        for attn in attns:
            attn.use_sdpa = False
        for name in dict.fromkeys([*names, *patch]):
            module_name, side = points[name]
            module = model.get_submodule(module_name)  # "" is the model itself
            handles.append(_hook(module, side, name, name in names, patch.get(name), captured))
        model(idx)
    finally:
        for handle in handles:
            handle.remove()
        for attn, use_sdpa in zip(attns, saved):
            attn.use_sdpa = use_sdpa
    return {name: captured[name] for name in names}


def _hook(module: nn.Module, side: str, name: str, keep: bool, fn, captured: dict):
    def apply(x):
        if fn is not None:
            y = fn(x)
            x = x if y is None else y
        if keep:
            captured[name] = x.detach()
        return x
    if side == "input":
        return module.register_forward_pre_hook(lambda m, args: (apply(args[0]), *args[1:]))
    return module.register_forward_hook(lambda m, args, out: apply(out))


def lens_logits(model: nn.Module, resid: torch.Tensor) -> torch.Tensor:
    """ln_f + lm_head applied to a residual stream (B, T, C): the logits (B, T, V) it would give if it were the last."""
    return model.lm_head(model.transformer.ln_f(resid))[..., : model.config.vocab_size]


def logit_lens(model: nn.Module, captured: dict[str, torch.Tensor], top_k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, token ids), each (n_layer, B, T, top_k): each layer's resid_post read by ln_f + lm_head.

    captured holds h.{i}.resid_post for every layer (capture's default). The last layer's row is the
    model's own next-token distribution.
    """
    probs, ids = [], []
    with torch.no_grad():
        for i in range(model.config.n_layer):
            p, t = lens_logits(model, captured[f"h.{i}.resid_post"]).float().softmax(-1).topk(top_k, dim=-1)
            probs.append(p)
            ids.append(t)
    return torch.stack(probs), torch.stack(ids)


def activation_stats(x: torch.Tensor) -> dict:
    """mean, standard deviation and max |x| of one activation, in float32."""
    x = x.detach().float()
    return {"mean": x.mean().item(), "std": x.std(unbiased=False).item(), "max_abs": x.abs().max().item()}


def _point_of_op(op: dict, adds_seen: dict) -> str | None:
    """The capture point whose tensor is this sheet op's output (dropout: its input, as in eval); None: not captured."""
    name, i, module = op["name"], op["block"], op["module"] or ""
    if i is None:
        return {"embedding": "embedding", "embedding dropout": "embedding", "ln_f": "ln_f",
                "lm_head": "logits"}.get(name)
    if name == "residual add":
        adds_seen[i] = adds_seen.get(i, 0) + 1
        return f"h.{i}.{'resid_mid' if adds_seen[i] == 1 else 'resid_post'}"
    if name == "c_proj":
        return f"h.{i}.{'attn.out' if '.attn.' in module else 'mlp.out'}"
    suffix = {"ln_1": "ln_1", "qkv projection": "attn.qkv", "head split": "attn.qkv", "scores": "attn.scores",
              "softmax": "attn.probs", "attention-weight dropout": "attn.probs", "weighted sum": "attn.merged",
              "head merge": "attn.merged", "residual dropout": "attn.out", "ln_2": "ln_2", "c_fc": "mlp.fc",
              "MLP dropout": "mlp.out"}.get(name)
    if suffix is None and op["kind"] == "mlp" and module.endswith(".mlp"):
        suffix = "mlp.act"  # the activation's op (GELU, ReLU)
    return None if suffix is None else f"h.{i}.{suffix}"


def parse_head(head: str | None, config: GPTConfig) -> tuple[int, int]:
    """"LAYER.HEAD" (e.g. "5.1") -> (5, 1), checked against the config; None -> (0, 0)."""
    if head is None:
        return 0, 0
    try:
        layer, h = (int(part) for part in head.split("."))
    except ValueError:
        raise ConfigError(f"--head is LAYER.HEAD, e.g. 5.1; got {head!r}") from None
    if not (0 <= layer < config.n_layer and 0 <= h < config.n_head):
        raise ConfigError(f"--head {head}: this model has layers 0..{config.n_layer - 1} and heads 0..{config.n_head - 1}")
    return layer, h


def prompt_sheet(model: nn.Module, ids: list[int], token_text=str, head: tuple[int, int] = (0, 0), top_k: int = 5,
                 source: str | None = None, text: str | None = None) -> dict:
    """The sheet of one full forward over `ids` (batch 1), with what the model computed on them.

    Every op gains "capture" (its capture point, or None) and "stats" (mean, std, max |x| of its output);
    the sheet gains "prompt": the tokens, every layer's attention probabilities (n_layer, n_head, T, T),
    the head to draw large, and the logit lens (top_k next tokens per layer and position).
    token_text(id) -> str labels a token (the tokenizer's decode of that one id).
    """
    config = model.config
    if not ids:
        raise ConfigError("the prompt encodes to no tokens")
    if max(ids) >= config.vocab_size:
        raise ConfigError(f"token id {max(ids)} is outside this model's vocabulary of {config.vocab_size}")
    layer, h = head
    parameter = model.transformer.wte.weight
    sheet = architecture_sheet(model, "full", batch=1, seq=len(ids), dtype=parameter.dtype, source=source)
    with torch.no_grad():
        acts = capture(model, torch.tensor([ids], device=parameter.device))
    adds: dict = {}
    for op in sheet["ops"]:
        op["capture"] = _point_of_op(op, adds)
        op["stats"] = activation_stats(acts[op["capture"]]) if op["capture"] else None
    probs, top = logit_lens(model, acts, top_k)  # (n_layer, 1, T, k)
    attention = torch.stack([acts[f"h.{i}.attn.probs"][0] for i in range(config.n_layer)])  # (n_layer, nh, T, T)
    sheet["prompt"] = {
        "text": text,
        "ids": list(ids),
        "tokens": [token_text(t) for t in ids],
        "head": [layer, h],
        "attention": attention.float().round(decimals=4).tolist(),
        "logit_lens": {"top_k": top_k, "layers": [
            [[{"id": t, "token": token_text(t), "p": float(f"{p:.4g}")} for t, p in zip(ts, ps)]
             for ts, ps in zip(top[i, 0].tolist(), probs[i, 0].tolist())]
            for i in range(config.n_layer)]},
    }
    return sheet


def load_for_prompt(name_or_path: str, dtype: str = "float32", seed: int = 0):
    """(model, tokenizer, source) for `gpt2 inspect --prompt`: a preset at random init, or the weights of a directory."""
    from gpt2.model import GPT
    from gpt2.tokenizer import Tokenizer
    resolved = resolve_config(name_or_path)
    if resolved.directory is None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = GPT(resolved.config)
        return model.to(parse_dtype(dtype)).eval(), Tokenizer.gpt2(), f"{resolved.source} at random init (seed {seed})"
    model = GPT.from_pretrained(str(resolved.directory), dtype=dtype)
    return model.eval(), Tokenizer.from_pretrained(resolved.directory), resolved.source


def inspect_prompt(cfg: "InspectConfig") -> dict:
    """`gpt2 inspect MODEL --prompt TEXT`: prompt_sheet of cfg.model on cfg.prompt."""
    if cfg.mode != "full" or cfg.batch != 1 or cfg.seq is not None or cfg.past:
        raise ConfigError("--prompt runs one full forward over the prompt's tokens: "
                          "leave --mode (full), --batch, --seq and --past unset")
    model, tokenizer, source = load_for_prompt(cfg.model, cfg.dtype, cfg.seed)
    ids = tokenizer.encode(cfg.prompt)
    return prompt_sheet(model, ids, lambda t: tokenizer.decode([t]), parse_head(cfg.head, model.config), cfg.top_k,
                        source, text=cfg.prompt)


# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------

def shape_str(shape: list[int], axes: list[str]) -> str:
    """[B=2 batch, 12 heads, T=5 queries, T=5 keys]: symbolic axes get their value, fixed ones are numbers."""
    parts = []
    for size, label in zip(shape, axes):
        symbol, _, name = label.partition(" ")
        parts.append(label if symbol.isdigit() else f"{symbol}={size} {name}")
    return "[" + ", ".join(parts) + "]"


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def _bytes(n: int) -> str:
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n} B"


def _flags(op: dict) -> str:
    flags = []
    if op["training_only"]:
        flags.append("training only" + (" (identity here)" if op["identity"] else ""))
    if op["note"] and not op["identity"]:
        flags.append(op["note"])
    return "; ".join(flags)


def _summary_lines(sheet: dict) -> list[str]:
    c = sheet["config"]
    lines = [
        f"model: {sheet['model'] or 'GPT'}  (n_layer={c['n_layer']}, n_head={c['n_head']}, n_embd={c['n_embd']}, "
        f"vocab_size={c['vocab_size']}, n_positions={c['n_positions']})",
        f"mode: {sheet['mode']}  B={sheet['batch']}  T={sheet['seq']}  P={sheet['past']}  dtype={sheet['dtype']}",
        f"parameters: {sheet['total_parameters']:,}",
        f"forward FLOPs: {sheet['forward_flops']:,} ({_human(sheet['forward_flops'], 'FLOP')}); "
        f"per token: {sheet['forward_flops_per_token']:,}",
    ]
    if sheet["training_flops_per_token"]:
        lines.append(f"training FLOPs per token (forward + backward, about 3x): {sheet['training_flops_per_token']:,}")
    lines.append(f"KV cache per token: {sheet['kv_cache_bytes_per_token']:,} bytes (2 * n_layer * n_embd * "
                 f"{sheet['kv_cache_bytes_per_token'] // (2 * c['n_layer'] * c['n_embd'])})")
    if sheet["mode"] in ("prefill", "decode"):
        lines.append(f"KV cache: {sheet['past']} -> {sheet['past'] + sheet['seq']} positions, "
                     f"{_bytes(sheet['kv_cache_bytes_before'])} -> {_bytes(sheet['kv_cache_bytes_after'])}")
    lines.append(f"peak activation memory (estimate): {_bytes(sheet['peak_activation_bytes'])}")
    return lines


def _tensor_names(op: dict) -> str:
    """weight[2304,768] bias[2304]: the op's parameter tensors, short names, tied ones marked."""
    names = []
    for t in op["parameter_tensors"]:
        short = t["name"].removeprefix("transformer.") if op["block"] is None else t["name"].rsplit(".", 1)[-1]
        names.append(short + "[" + ",".join(map(str, t["shape"])) + "]" + ("=wte" if "tied_to" in t else ""))
    return " ".join(names)


def _stats_str(op: dict) -> str:
    st = op.get("stats")
    return "" if not st else f"{st['mean']:.3g} / {st['std']:.3g} / {st['max_abs']:.3g}"


def _rows(sheet: dict) -> list[list[str]]:
    rows = []
    for n, op in enumerate(sheet["ops"]):
        name = op["name"] + (f" ({op['module'].split('.')[-2]})" if op["name"] == "c_proj" else "")  # attn or mlp
        rows.append([str(n), "" if op["block"] is None else str(op["block"]), name,
                     shape_str(op["output_shape"], op["axes"])]
                    + ([_stats_str(op)] if "prompt" in sheet else [])
                    + [_tensor_names(op), f"{op['parameters']:,}" if op["parameters"] else "",
                       f"{op['flops']:,}", _bytes(op["activation_bytes"]), _flags(op)])
    return rows


HEADER = ["#", "block", "op", "output shape", "parameter tensors", "params", "FLOPs", "output bytes", "notes"]
STATS_HEADER = "mean / std / max|x|"  # with a prompt, beside the output shape


def _header(sheet: dict) -> list[str]:
    return HEADER[:4] + [STATS_HEADER] + HEADER[4:] if "prompt" in sheet else HEADER


def _visible(token: str) -> str:
    """A token as a label: spaces and newlines made visible."""
    return token.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")


def _prompt_lines(sheet: dict) -> list[str]:
    """The prompt's tokens and, for its last position, every layer's logit-lens top-k."""
    prompt = sheet["prompt"]
    tokens = prompt["tokens"]
    lines = ["prompt tokens: " + " ".join(f"{i}:{_visible(t)}" for i, t in enumerate(tokens)), "",
             f"logit lens at position {len(tokens) - 1} ({_visible(tokens[-1])}): the top {prompt['logit_lens']['top_k']} "
             "next tokens from each layer's resid_post through ln_f + lm_head"]
    for i, positions in enumerate(prompt["logit_lens"]["layers"]):
        lines.append(f"  layer {i:>2}: " + "  ".join(f"{_visible(e['token'])} {e['p']:.3g}" for e in positions[-1]))
    return lines


def format_text(sheet: dict) -> str:
    header = _header(sheet)
    rows = [header] + _rows(sheet)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {header.index(h) for h in ("#", "block", "params", "FLOPs", "output bytes")}
    lines = _summary_lines(sheet) + [""]
    if "prompt" in sheet:
        lines += _prompt_lines(sheet) + [""]
    for r in rows:
        lines.append("  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)


def format_markdown(sheet: dict) -> str:
    header = _header(sheet)
    lines = [f"- {line}" for line in _summary_lines(sheet)] + [""]
    if "prompt" in sheet:
        lines += ["```"] + _prompt_lines(sheet) + ["```", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(" --- " for _ in header) + "|")
    for r in _rows(sheet):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |")
    return "\n".join(lines)


def format_json(sheet: dict) -> str:
    return json.dumps(sheet)


# Distinctive colours: the diagram and the table rows share them (the HTML test looks for them).
COLORS = {
    "embedding": "#8e44ad", "layernorm": "#f1a208", "attention": "#1f6fd1", "mlp": "#d7263d",
    "dropout": "#8a8a8a", "add": "#1b998b", "head": "#5b5f97", "loss": "#333333", "cache": "#1f6fd1",
}


def _box(x, y, w, h, kind, title, sub="", dashed=False) -> str:
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    fill = "#ececec" if kind == "dropout" else COLORS[kind]
    color = "#333" if kind == "dropout" else "#fff"
    return (f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" stroke="{COLORS[kind]}" '
            f'stroke-width="2"{dash}/>'
            f'<text x="{x + w / 2}" y="{y + h / 2 - (6 if sub else -5)}" fill="{color}" text-anchor="middle" '
            f'font-size="15" font-weight="600">{html.escape(title)}</text>'
            + (f'<text x="{x + w / 2}" y="{y + h / 2 + 14}" fill="{color}" text-anchor="middle" '
               f'font-size="12">{html.escape(sub)}</text>' if sub else ""))


_ARROW = '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#444" stroke-width="2" marker-end="url(#arrow)"/>'


def _block_diagram(sheet: dict) -> str:
    """One block with its residual bypasses, and below it the whole model as a strip: one SVG."""
    block, block_width, block_bottom = _block_row(sheet, y=90, h=64)
    strip, strip_width = _model_strip(sheet["config"], y=block_bottom + 70, h=46)
    height = block_bottom + 70 + 46 + 20
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{max(block_width, strip_width + 20)}" height="{height}" '
            f'font-family="sans-serif"><defs><marker id="arrow" markerWidth="10" markerHeight="10" refX="9" '
            f'refY="5" orient="auto" markerUnits="userSpaceOnUse"><path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker></defs>'
            + "".join(block + strip) + "</svg>")


def _block_row(sheet: dict, y: int, h: int) -> tuple[list[str], int, int]:
    """x -> LayerNorm 1 -> Attention -> Dropout -> + -> LayerNorm 2 -> MLP -> Dropout -> +: (parts, width, bottom)."""
    c = sheet["config"]
    train = sheet["mode"] == "training"
    ops = {op["name"]: op for op in sheet["ops"] if op["block"] == 0}
    xs = shape_str(ops["ln_1"]["input_shapes"][0], ops["ln_1"]["input_axes"][0])
    w, gap = 118, 22
    parts, x = [], 20
    parts.append(f'<text x="{x}" y="{y + h / 2 + 5}" font-size="16" font-weight="600">x</text>')
    x += 24
    items = [("layernorm", "LayerNorm 1", "gain, bias"),
             ("attention", "Attention", f"{c['n_head']} heads"),
             ("dropout", "Dropout", "p_resid" if train else "identity"),
             ("add", "+", ""),
             ("layernorm", "LayerNorm 2", "gain, bias"),
             ("mlp", "MLP", f"{c['n_embd']}->{c['n_inner'] or 4 * c['n_embd']}->{c['n_embd']}"),
             ("dropout", "Dropout", "p_resid" if train else "identity"),
             ("add", "+", "")]
    centers = []  # x of each +
    for kind, title, sub in items:
        parts.append(_ARROW.format(x, y + h / 2, x + gap - 2, y + h / 2))
        x += gap
        if kind == "add":
            parts.append(f'<circle cx="{x + 20}" cy="{y + h / 2}" r="20" fill="{COLORS["add"]}"/>'
                         f'<text x="{x + 20}" y="{y + h / 2 + 7}" fill="#fff" text-anchor="middle" '
                         f'font-size="22" font-weight="700">+</text>')
            centers.append(x + 20)
            x += 40
        else:
            parts.append(_box(x, y, w, h, kind, title, sub, dashed=kind == "dropout"))
            x += w
    parts.append(_ARROW.format(x, y + h / 2, x + gap, y + h / 2))
    parts.append(f'<text x="{x + gap + 6}" y="{y + h / 2 + 5}" font-size="16" font-weight="600">x next</text>')
    # residual bypasses: from before LayerNorm 1 to the first +, from after it to the second +
    for start, end in ((44 + 10, centers[0]), (centers[0] + 10, centers[1])):
        parts.append(f'<path d="M {start} {y + h / 2} V {y - 40} H {end} V {y + h / 2 - 20}" fill="none" '
                     f'stroke="{COLORS["add"]}" stroke-width="3" marker-end="url(#arrow)"/>'
                     f'<text x="{(start + end) / 2}" y="{y - 46}" text-anchor="middle" font-size="12" '
                     f'fill="{COLORS["add"]}">residual bypass</text>')
    parts.append(f'<text x="20" y="{y + h + 40}" font-size="13" fill="#444">one block, repeated '
                 f'{c["n_layer"]}x; x is {html.escape(xs)}</text>')
    return parts, x + gap + 80, y + h


def _model_strip(c: dict, y: int, h: int) -> tuple[list[str], int]:
    """wte + wpe -> Dropout -> n_layer x block -> ln_f -> lm_head: (parts, right edge)."""
    w = 150
    strip = [("embedding", "wte + wpe"), ("dropout", "Dropout"), ("attention", f"{c['n_layer']} x block"),
             ("layernorm", "ln_f"), ("head", "lm_head")]
    parts, x = [], 20
    for kind, title in strip:
        parts.append(_box(x, y, w, h, kind, title, dashed=kind == "dropout"))
        x += w
        if title != "lm_head":
            parts.append(_ARROW.format(x, y + h / 2, x + 28, y + h / 2))
            x += 30
    return parts, x


def _html_row(n: int, op: dict) -> str:
    """One op as a table row, its colour on the left edge; training-only ops shaded."""
    inputs = "<br>".join(html.escape(shape_str(s, a)) for s, a in zip(op["input_shapes"], op["input_axes"]))
    params = "<br>".join(
        html.escape(f"{t['name']} {t['shape']}" + (f" (tied to {t['tied_to']})" if "tied_to" in t else ""))
        for t in op["parameter_tensors"]) or "none"
    cls = " class=\"train\"" if op["training_only"] else ""
    return (f'<tr{cls}><td style="border-left:6px solid {COLORS[op["kind"]]}">{n}</td>'
            f'<td>{"" if op["block"] is None else op["block"]}</td><td><b>{html.escape(op["name"])}</b></td>'
            f'<td class="f">{html.escape(op["formula"])}</td><td class="s">{inputs}</td>'
            f'<td class="s">{html.escape(shape_str(op["output_shape"], op["axes"]))}</td>'
            + (f'<td class="s stats">{html.escape(_stats_str(op))}</td>' if "stats" in op else "") +
            f'<td class="s">{params}</td><td class="n">{op["parameters"]:,}</td><td class="n">{op["flops"]:,}</td>'
            f'<td class="n">{_bytes(op["activation_bytes"])}</td><td>{html.escape(_flags(op))}</td></tr>')


def _heatmap(probs: list[list[float]], cell: float, cls: str, labels: list[str] | None = None,
             outline: bool = False, data: str = "") -> str:
    """One head's attention (T queries x T keys) as an SVG of squares, opacity = probability.

    With labels: the query tokens down the left, the key tokens along the top, a tooltip per square.
    """
    T = len(probs)
    left, top = (96, 84) if labels else (0, 0)
    size = cell * T
    right = 64 if labels else 0  # room for the last key label, rotated up to the right
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}"{data} width="{left + size + right + 2:.0f}" '
             f'height="{top + size + 2:.0f}" font-family="monospace" font-size="{min(12, max(8, cell * 0.6)):.0f}">',
             f'<rect x="{left}" y="{top}" width="{size:.1f}" height="{size:.1f}" fill="#fff" '
             f'stroke="{"#d7263d" if outline else "#bbb"}" stroke-width="{2 if outline else 1}"/>',
             f'<g fill="{COLORS["attention"]}">']
    for q, row in enumerate(probs):
        for k, p in enumerate(row):
            if p < 0.005 and not labels:
                continue  # invisible anyway; keeps a grid of many heads small
            tip = (f'<title>{html.escape(_visible(labels[q]))} -> {html.escape(_visible(labels[k]))}: {p:.3f}</title>'
                   if labels else "")
            parts.append(f'<rect x="{left + k * cell:.1f}" y="{top + q * cell:.1f}" width="{cell:.1f}" '
                         f'height="{cell:.1f}" fill-opacity="{p:.3f}">{tip}</rect>' if tip else
                         f'<rect x="{left + k * cell:.1f}" y="{top + q * cell:.1f}" width="{cell:.1f}" '
                         f'height="{cell:.1f}" fill-opacity="{p:.3f}"/>')
    parts.append("</g>")
    if labels:
        for i, token in enumerate(labels):
            label = html.escape(_visible(token)[:12])
            c = (i + 0.5) * cell
            parts.append(f'<text x="{left - 4}" y="{top + c + 4:.1f}" text-anchor="end">{label}</text>'
                         f'<text transform="translate({left + c + 4:.1f},{top - 4}) rotate(-60)">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _attention_html(prompt: dict) -> str:
    """The layer x head grid of small maps, and the chosen head drawn large with its tokens."""
    attention, tokens = prompt["attention"], prompt["tokens"]
    layer, head = prompt["head"]
    T = len(tokens)
    small = max(1.0, min(8.0, 64 / T))
    head_cells = "".join(f"<th>head {h}</th>" for h in range(len(attention[0])))
    rows = []
    for i, heads in enumerate(attention):
        cells = "".join("<td>" + _heatmap(p, small, "attn-small", outline=(i, h) == (layer, head),
                                          data=f' data-head="{i}.{h}"') + "</td>" for h, p in enumerate(heads))
        rows.append(f"<tr><th>layer {i}</th>{cells}</tr>")
    big = max(6.0, min(28.0, 640 / T))
    return (f'<h2>Attention</h2><p class="note">Each square: how much a query (row) attends to a key (column), '
            f'after the softmax; each row sums to 1 and keys after the query get 0 (the causal mask). '
            f'Outlined: layer {layer}, head {head}, drawn large below.</p>'
            f'<table class="grid"><tr><th></th>{head_cells}</tr>{"".join(rows)}</table>'
            f'<h3>layer {layer}, head {head}</h3>'
            + _heatmap(attention[layer][head], big, "attn-large", labels=tokens, data=f' data-head="{layer}.{head}"'))


def _lens_html(prompt: dict) -> str:
    """Logit lens: per layer and position the top next token (shade = probability, tooltip: top k),
    then the last position's top k per layer."""
    lens, tokens = prompt["logit_lens"], prompt["tokens"]
    k = lens["top_k"]
    head = "".join(f"<th>{html.escape(_visible(t))}</th>" for t in tokens)

    def cell(entries):
        top = entries[0]
        tip = html.escape(", ".join(f"{_visible(e['token'])} {e['p']:.3g}" for e in entries))
        return (f'<td title="{tip}" style="background: rgba(91,95,151,{top["p"]:.3f})">'
                f'{html.escape(_visible(top["token"]))}<br><small>{top["p"]:.3g}</small></td>')
    grid = "".join(f"<tr><th>layer {i}</th>{''.join(cell(e) for e in positions)}</tr>"
                   for i, positions in enumerate(lens["layers"]))
    last = "".join(f"<tr><th>layer {i}</th>" + "".join(
        f'<td style="background: rgba(91,95,151,{e["p"]:.3f})">{html.escape(_visible(e["token"]))} '
        f'<small>{e["p"]:.3g}</small></td>' for e in positions[-1]) + "</tr>"
        for i, positions in enumerate(lens["layers"]))
    return (f'<h2>Logit lens</h2><p class="note">Each layer\'s residual stream (resid_post) read through ln_f and '
            f'lm_head, as if it were the last layer: the most likely next token after each position (hover: top {k}). '
            f'The last layer\'s row is the model\'s own prediction.</p>'
            f'<table class="lens"><tr><th>after</th>{head}</tr>{grid}</table>'
            f'<h3>top {k} after the last token, {html.escape(_visible(tokens[-1]))}</h3>'
            f'<table class="lens-last"><tr><th></th>{"".join(f"<th>{r + 1}</th>" for r in range(k))}</tr>{last}</table>')


def format_html(sheet: dict) -> str:
    """One self-contained page: inline CSS and SVG, no external resources."""
    rows = [_html_row(n, op) for n, op in enumerate(sheet["ops"])]
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in _summary_lines(sheet))
    title = f"GPT-2 architecture sheet: {sheet['model'] or 'GPT'}, {sheet['mode']}"
    prompt = sheet.get("prompt")
    live = ""
    if prompt:
        tokens = "".join(f'<span class="tok">{html.escape(_visible(t))}</span>' for t in prompt["tokens"])
        live = f'<h2>Prompt</h2><p>{tokens}</p>' + _attention_html(prompt) + _lens_html(prompt) + "<h2>Every op</h2>"
    stats_th = f"<th>{STATS_HEADER}</th>" if prompt else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 18px; margin-top: 28px; }} h3 {{ font-size: 15px; }} ul {{ font-size: 14px; }}
table {{ border-collapse: collapse; font-size: 12px; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 3px 8px; vertical-align: top; text-align: left; }}
th {{ background: #f4f4f4; position: sticky; top: 0; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
td.s, td.f {{ font-family: monospace; }}
tr.train td {{ background: #fff6e0; }}
table.grid td, table.grid th {{ padding: 2px; border: none; font-size: 11px; }}
table.lens td, table.lens-last td {{ font-family: monospace; border: 1px solid #eee; }}
span.tok {{ font-family: monospace; background: #eef3fb; border: 1px solid #c9d8ef; padding: 1px 3px; margin: 1px; }}
p.note {{ font-size: 13px; color: #444; max-width: 900px; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{summary}</ul>
{_block_diagram(sheet)}
{live}
<table><thead><tr><th>#</th><th>block</th><th>op</th><th>formula</th><th>in</th><th>out</th>{stats_th}
<th>parameter tensors</th><th>params</th><th>FLOPs</th><th>output bytes</th><th>notes</th></tr></thead>
<tbody>{"".join(rows)}</tbody></table>
</body></html>
"""


FORMATTERS = {"text": format_text, "markdown": format_markdown, "json": format_json, "html": format_html}
