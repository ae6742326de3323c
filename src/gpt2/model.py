"""GPT-2 in one file, in reading order: LayerNorm, CausalSelfAttention, MLP, Block, GPT.

    from gpt2 import GPT, GPTConfig
    model = GPT(GPTConfig.preset("gpt2"))            # random init
    logits = model(idx)                              # (B, T) -> (B, T, vocab_size)
    loss = model(idx, targets=targets)               # mean cross-entropy; targets == -100 are ignored

It computes what the maintained Transformers GPT2LMHeadModel computes: pre-LN blocks, tanh-GELU,
a final ln_f and an lm_head tied to wte. Parameter names are GPT-2's own (wte, wpe, h.{i}.ln_1,
attn.c_attn, ...), so Hugging Face weights load with a transpose of the Conv1D matrices, never a rename.

One `forward` serves training, full-sequence evaluation, prefill and decode. With a KV cache
(kv_cache.py) the new tokens' positions continue from the cache; with an attention mask (left padding)
the positions are cumsum(mask) - 1, as Transformers' generate computes them.

Dropout sits at GPT-2's four places: after wte + wpe (embd_pdrop), on the attention probabilities
(attn_pdrop), after attn.c_proj and after mlp.c_proj (resid_pdrop). train()/eval() alone switch it.

This file never reads files and never imports torch.distributed: weights.py loads and saves,
distributed.py wraps the model from outside.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2.config import ACTIVATIONS, GPTConfig
from gpt2.errors import ConfigError, ContextLengthError
from gpt2.kv_cache import KVCache


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), fused by PyTorch."""
    return F.gelu(x, approximate="tanh")


ACTIVATION_FUNCTIONS = {
    "gelu_new": new_gelu,
    "gelu_pytorch_tanh": new_gelu,
    "gelu": F.gelu,
    "relu": F.relu,
}
if set(ACTIVATION_FUNCTIONS) != set(ACTIVATIONS):  # config.ACTIVATIONS is the one list of names
    raise RuntimeError(f"model.ACTIVATION_FUNCTIONS covers {sorted(ACTIVATION_FUNCTIONS)}, "
                       f"config.ACTIVATIONS lists {sorted(ACTIVATIONS)}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.scale = (1.0 / math.sqrt(config.head_size)) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= float(layer_idx + 1)
        self.upcast = config.reorder_and_upcast_attn
        # scaled_dot_product_attention computes the same function; the explicit path is kept for
        # float32 upcasting and for tests that replay Transformers' dropout masks draw for draw.
        self.use_sdpa = True
        # Hook points for inspect.capture on the explicit path (identities: nothing runs but a call):
        # the scaled scores before the mask and the probabilities before dropout, both (B, nh, T, S).
        self.scores = nn.Identity()
        self.probs = nn.Identity()

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, mask: torch.Tensor | None = None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, nh, P + T, hs), P = positions already cached

        # mask: None means plain causal (top-left aligned, valid without a cache); otherwise a
        # boolean (B or 1, 1, T, P + T) that is True where a query may attend to a key.
        if self.use_sdpa and not self.upcast:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                dropout_p=self.attn_dropout.p if self.training else 0.0, scale=self.scale)
        else:
            y = self._explicit_attention(q, k, v, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads merged
        return self.resid_dropout(self.c_proj(y))

    def _explicit_attention(self, q, k, v, mask):
        T, S = q.size(2), k.size(2)
        if self.upcast:
            q, k = q.float(), k.float()
        scores = self.scores((q @ k.transpose(-2, -1)) * self.scale)  # (B, nh, T, S)
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = self.probs(F.softmax(scores, dim=-1).to(v.dtype))
        probs = self.attn_dropout(probs)
        return probs @ v  # (B, nh, T, hs)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_width)
        self.act = ACTIVATION_FUNCTIONS[config.activation_function]
        self.c_proj = nn.Linear(config.mlp_width, config.n_embd)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self.resid_mid = nn.Identity()  # hook point for inspect.capture: x after the attention's residual add

    def forward(self, x, cache=None, mask=None):
        x = self.resid_mid(x + self.attn(self.ln_1(x), cache, mask))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass(frozen=True)
class HeadPlan:
    """How lm_head_cross_entropy runs its three GEMMs; every plan computes the same loss and gradients.

    Which plan is fastest depends on the CPU (on an AMD EPYC oneDNN's float32 GEMMs run 2-3x MKL's at
    these shapes), so training measures them once per machine and shape (head_tuning.py).
    """
    library: str = "aten"      # aten: torch.mm (MKL for float32, oneDNN for bf16); onednn: oneDNN's linear for all
    chunk_rows: int = 64       # rows of logits computed at a time (a chunk's (rows, V) logits should stay in cache)
    weight_grad_rows: int = 64  # rows per weight-gradient GEMM, a multiple of chunk_rows: (V, rows) @ (rows, C)
                                # has a short inner dimension, so fewer, longer GEMMs can win

    LIBRARIES = ("aten", "onednn")

    def __post_init__(self):
        if self.library not in self.LIBRARIES:
            raise ConfigError(f"lm_head plan: library {self.library!r} is not one of {', '.join(self.LIBRARIES)}")
        if self.chunk_rows < 1 or self.weight_grad_rows < self.chunk_rows or self.weight_grad_rows % self.chunk_rows:
            raise ConfigError(f"lm_head plan: weight_grad_rows {self.weight_grad_rows} must be a positive multiple "
                              f"of chunk_rows {self.chunk_rows}")

    def __str__(self) -> str:
        return f"{self.library}:{self.chunk_rows}:{self.weight_grad_rows}"

    @classmethod
    def parse(cls, spec: str) -> "HeadPlan":
        """'LIBRARY:CHUNK_ROWS:WEIGHT_GRAD_ROWS', as str() writes it (train_config.json, --lm-head)."""
        parts = spec.split(":")
        if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
            raise ConfigError(f"lm_head plan {spec!r}: expected LIBRARY:CHUNK_ROWS:WEIGHT_GRAD_ROWS, "
                              "e.g. onednn:64:256")
        return cls(parts[0], int(parts[1]), int(parts[2]))

    @classmethod
    def default(cls, n_embd: int) -> "HeadPlan":
        # Fastest with torch.mm on an Intel Xeon (V=50257, N=1024): 64 rows at C=128, 128 at C=256.
        rows = max(64, n_embd // 2)
        return cls("aten", rows, rows)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN's matmul (float32 stays float32: no reduced-precision mode)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def lm_head_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          plan: HeadPlan | int | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """mean cross_entropy(x @ weight.T, targets) (float32, targets == -100 ignored), chunk by chunk.

    x (N, C) is ln_f's output, weight (V, C) the lm_head. Materializing all (N, V) logits
    (N=1024, V=50257: 206 MB in float32, written and read several times by softmax and its
    backward) costs more than the small models' blocks; chunks of rows stay in cache. When a
    gradient is needed it is computed in the same pass (softmax - one_hot is the gradient of the
    logits), so backward only scales it: no recomputation and no more FLOPs than the plain head.
    Held from forward to backward: grad_x (N, C) and grad_weight (V, C), far less than the logits.
    plan: a HeadPlan (head_tuning.py measures one), an int (rows per chunk, torch.mm), or None
    (HeadPlan.default). vocab_size: score only the first vocab_size of weight's rows (a padded
    vocabulary); the padding columns' logits are -inf, so they add exactly 0 to the softmax and their
    rows' gradient is exactly 0. Slicing the weight instead would cost a zeroed (V_padded, C) copy
    of its gradient in backward (48 ms in GPT-2 124M's step).
    """
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if plan is None:
        plan = HeadPlan.default(x.size(1))
    elif isinstance(plan, int):
        plan = HeadPlan("aten", plan, plan)
    return _ChunkedLMHeadLoss.apply(x, weight, targets, plan, vocab_size or weight.size(0), needs_grad)


class _ChunkedLMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, plan: HeadPlan, vocab_size: int, needs_grad: bool):
        # GEMMs run in the autocast dtype if autocast is on, else in the weight's; the weight is cast
        # once here, not once per chunk. Softmax, loss and the weight gradient accumulate in float32.
        device = x.device.type
        autocast = device in ("cpu", "cuda") and torch.is_autocast_enabled(device)
        gemm = torch.get_autocast_dtype(device) if autocast else weight.dtype
        accumulate = torch.promote_types(gemm, torch.float32)  # float32, or float64 for float64 inputs
        onednn = (plan.library == "onednn" and device == "cpu" and gemm in (torch.float32, torch.bfloat16)
                  and onednn_available())  # oneDNN has no float64: the plan then falls back to torch.mm
        w = weight.to(gemm)  # (V, C)
        # oneDNN computes a @ b.T: grad_x = dlogits @ w needs w transposed, copied once for all chunks
        w_t = w.t().contiguous() if onednn and needs_grad else None  # (C, V)
        n_scored = (targets != -100).sum().clamp(min=1)  # the mean is over the scored tokens
        loss = torch.zeros((), dtype=accumulate, device=x.device)
        grad_x = torch.empty_like(x) if needs_grad else None
        # Every chunk reuses the same (chunk_rows, V) buffers: a fresh tensor above glibc's 32 MB mmap
        # threshold is new pages each time, and their first-touch faults cost more than log_softmax
        # (384 x 50257 float32: 28 ms fresh, 5 ms reused).
        chunk = min(plan.chunk_rows, x.size(0))
        logits_buf = torch.empty(chunk, w.size(0), dtype=gemm, device=x.device)  # logits, then bf16 dlogits
        scores_buf = torch.empty_like(logits_buf, dtype=accumulate) if gemm != accumulate else logits_buf
        log_probs_buf = torch.empty_like(scores_buf)  # log_softmax, then softmax - one_hot in place
        grad_w = WeightGradient(plan, x.size(0), onednn, accumulate, logits_buf) if needs_grad else None
        # every dtype below is explicit: autocast would only add dispatch work
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            for start in range(0, x.size(0), plan.chunk_rows):
                rows = slice(start, start + plan.chunk_rows)
                xc, tc = x[rows].to(gemm), targets[rows]  # (n, C), (n,)
                n = xc.size(0)
                scored = tc != -100
                picked = tc.clamp(min=0).unsqueeze(1)  # (n, 1); ignored rows pick 0 and are masked out
                # log_softmax works row by row (a 50257-wide row fits in L2); every extra pass over the
                # (n, V) chunk costs memory traffic, so the 1/n_scored scaling goes on the small operands.
                if onednn:
                    logits = _onednn_linear(xc, w)  # (n, V); oneDNN has no out=
                else:
                    logits = torch.mm(xc, w.t(), out=logits_buf[:n])
                scores = scores_buf[:n].copy_(logits) if gemm != accumulate else logits  # to float32
                scores[:, vocab_size:] = -math.inf  # padding columns (none unless the vocabulary is padded)
                log_probs = torch.ops.aten._log_softmax.out(scores, -1, False, out=log_probs_buf[:n])
                loss -= torch.where(scored, log_probs.gather(1, picked).squeeze(1), 0.0).sum()
                if not needs_grad:
                    continue
                dlogits = log_probs.exp_()  # softmax, in place
                dlogits.scatter_add_(1, picked, -scored.to(accumulate).unsqueeze(1))  # minus one_hot(target)
                row_scale = (scored.to(accumulate) / n_scored).unsqueeze(1)  # (n, 1); 0 for ignored rows
                # The GEMM-dtype copy goes to the weight gradient's buffer when chunks are grouped, else
                # over the logits (no longer needed); in float32 ungrouped it is dlogits itself.
                held = grad_w.slot(n) if grad_w.grouped_rows else (logits if gemm != accumulate else None)
                dlogits = held.copy_(dlogits) if held is not None else dlogits
                grad_w.hold(dlogits, (xc * row_scale).to(gemm))
                grad_x[rows] = (_onednn_linear(dlogits, w_t) if onednn else dlogits @ w) * row_scale
                if grad_w.held_rows >= plan.weight_grad_rows or start + plan.chunk_rows >= x.size(0):
                    grad_w.flush()
        if needs_grad:
            ctx.save_for_backward(grad_x, grad_w.total().to(weight.dtype))
        return loss / n_scored

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight = ctx.saved_tensors  # already d loss / d input; the loss is linear in them
        return grad_x * grad_loss, grad_weight * grad_loss, None, None, None, None


class WeightGradient:
    """The lm_head's weight gradient, the sum over chunks of dlogits.T @ x_scaled, as one GEMM per
    plan.weight_grad_rows rows.

    hold() keeps a chunk's dlogits in the GEMM dtype (when chunks are grouped, the caller casts them
    straight into slot(n) of one (rows, V) buffer) and its scaled x; flush() runs (V, rows) @ (rows, C)
    over what is held. The first flush's product is the sum itself, so a single flush needs no zeroed
    (V, C) buffer and no add. oneDNN computes a @ b.T, so it sums the transpose, (C, V) = x_scaled.T @ dlogits.
    """

    def __init__(self, plan: HeadPlan, rows: int, onednn: bool, accumulate: torch.dtype,
                 like: torch.Tensor):
        self.grouped_rows = min(plan.weight_grad_rows, rows) if plan.weight_grad_rows > plan.chunk_rows else 0
        self.onednn, self.accumulate = onednn, accumulate
        self.sum: torch.Tensor | None = None  # (V, C), or (C, V) for oneDNN
        # (grouped_rows, V) in the GEMM dtype (like's dtype and device), for grouped chunks' dlogits
        self.buffer = like.new_empty(self.grouped_rows, like.size(1)) if self.grouped_rows else None
        self.dlogits: list[torch.Tensor] = []  # ungrouped: the one held chunk's dlogits
        self.xs: list[torch.Tensor] = []  # the held chunks' (n, C) x_scaled
        self.held_rows = 0

    def slot(self, n: int) -> torch.Tensor:
        """Where the next grouped chunk's (n, V) dlogits go, in the GEMM dtype."""
        return self.buffer[self.held_rows: self.held_rows + n]

    def hold(self, dlogits: torch.Tensor, xs: torch.Tensor) -> None:
        """Keep a chunk: (n, V) dlogits in the GEMM dtype (in slot(n) when grouped), (n, C) x_scaled."""
        if not self.grouped_rows:
            self.dlogits = [dlogits]
        self.held_rows += dlogits.size(0)
        self.xs.append(xs)

    def flush(self) -> None:
        dlogits = self.buffer[: self.held_rows] if self.grouped_rows else self.dlogits[0]  # (rows, V)
        xs = self.xs[0] if len(self.xs) == 1 else torch.cat(self.xs)  # (rows, C)
        self.held_rows, self.xs, self.dlogits = 0, [], []
        if self.onednn:
            product = _onednn_linear(xs.t().contiguous(), dlogits.t())  # (C, rows) @ (rows, V)
        elif self.sum is not None and self.sum.dtype == dlogits.dtype == self.accumulate:
            self.sum.addmm_(dlogits.t(), xs)  # float32: in place, no (V, C) temporary
            return
        else:
            product = dlogits.t() @ xs  # (V, rows) @ (rows, C); CPU PyTorch has no mixed-dtype addmm
        if self.sum is None:
            self.sum = product  # rounded to the GEMM dtype once per flush, like every later product
        else:
            self.sum = self.sum.to(self.accumulate)  # bf16 products are summed in float32
            self.sum += product

    def total(self) -> torch.Tensor:
        """(V, C) in the accumulation dtype."""
        total = self.sum.to(self.accumulate)
        return total.t().contiguous() if self.onednn else total


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, vocab_multiple: int = 1):
        """vocab_multiple > 1 pads wte's rows to a multiple (64 suits GEMM kernels); logits stay vocab_size wide."""
        super().__init__()
        self.config = config
        self.padded_vocab_size = math.ceil(config.vocab_size / vocab_multiple) * vocab_multiple
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(self.padded_vocab_size, config.n_embd),
            wpe=nn.Embedding(config.n_positions, config.n_embd),
            drop=nn.Dropout(config.embd_pdrop),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(config.n_embd, self.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.lm_head_plan: HeadPlan | None = None  # the training loss's kernel plan (train.py sets a measured one)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)
        if isinstance(module, (CausalSelfAttention, MLP)):
            # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer): two per block.
            torch.nn.init.normal_(module.c_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
        # nn.LayerNorm already starts at weight 1, bias 0.

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                last_logits_only: bool = False) -> torch.Tensor:
        """Logits (B, T, vocab_size), or the mean loss when targets (B, T) are given.

        cache: continue from cache.pos and append this call's keys and values (prefill and decode).
        attention_mask: (B, P + T), 1 for tokens and 0 for (left) padding, covering cached positions too.
        position_ids: (B, T); by default they continue from the cache, or follow attention_mask.
        last_logits_only: compute the lm_head for the last position only (prefill): logits (B, 1, V).
        """
        B, T = idx.shape
        # past: positions already cached. A compiled decode step's cache holds it in a tensor (engine.py),
        # so that one graph serves every step; its queries then attend over the cache's whole capacity.
        past = cache.pos if cache is not None else 0
        static = torch.is_tensor(past)
        if not static and past + T > self.config.n_positions:
            raise ContextLengthError(
                f"sequence of {past + T} tokens exceeds the context length of {self.config.n_positions}")
        if position_ids is None:
            if attention_mask is not None:
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids = position_ids.masked_fill(attention_mask == 0, 1)[:, -T:]  # (B, T)
            else:
                position_ids = (past + torch.arange(T, device=idx.device)).unsqueeze(0)  # (1, T)

        x = self.transformer.wte(idx) + self.transformer.wpe(position_ids)  # (B, T, C)
        x = self.transformer.drop(x)
        keys = cache.capacity if static else past + T
        mask = self.attention_mask_for(attention_mask, past, T, idx.device, keys)
        for block in self.transformer.h:
            x = block(x, cache, mask)
        if cache is not None:
            cache.advance(T)  # the one place the cache position moves
        x = self.transformer.ln_f(x)

        if targets is None:
            if last_logits_only:
                x = x[:, -1:, :]
            return self.lm_head(x)[..., : self.config.vocab_size]  # (B, T, V): padding columns never leak
        return lm_head_cross_entropy(x.reshape(B * T, -1), self.lm_head.weight, targets.reshape(B * T),
                                     plan=self.lm_head_plan, vocab_size=self.config.vocab_size)

    @staticmethod
    def attention_mask_for(attention_mask, past, T: int, device, keys: int | None = None) -> torch.Tensor | None:
        """None for plain causal attention from position 0; else a boolean (B or 1, 1, T, S).

        S = keys, by default past + T. past is an int, or a (1,) tensor for a compiled step whose S is
        the cache's capacity: causality then also hides the slots not yet written (after the query).
        """
        S = past + T if keys is None else keys
        if attention_mask is None and not torch.is_tensor(past) and (past == 0 or T == 1):
            return None  # causal from 0 (SDPA's is_causal), or one query that sees every cached key
        query_pos = (past + torch.arange(T, device=device)).view(T, 1)
        key_pos = torch.arange(S, device=device).view(1, S)
        causal = key_pos <= query_pos  # (T, S)
        if attention_mask is None:
            return causal.view(1, 1, T, S)
        if attention_mask.shape[-1] != S:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, expected {S} (cached + new)")
        keys = attention_mask.bool().view(-1, 1, 1, S)
        # A padding query would see no key at all (NaN softmax); let every query see itself.
        # Real tokens are unaffected: their own position is never padding.
        return (causal & keys) | (key_pos == query_pos)

    # --- conveniences --------------------------------------------------------------------------

    def num_parameters(self) -> int:
        """Parameters counted once (the tied lm_head is wte); padded vocabulary rows excluded."""
        n = sum(p.numel() for p in self.parameters())
        return n - (self.padded_vocab_size - self.config.vocab_size) * self.config.n_embd

    @classmethod
    def from_pretrained(cls, name_or_path: str, device=None, dtype=None, **kwargs) -> "GPT":
        """Load a Hugging Face directory, a hub name (gpt2, openai-community/gpt2-xl, ...) or our checkpoint."""
        from gpt2.weights import load_model
        return load_model(name_or_path, device=device, dtype=dtype, **kwargs)

    def save_pretrained(self, directory: str, tokenizer=None) -> str:
        """Write a Hugging Face directory (config.json + model.safetensors) that transformers loads."""
        from gpt2.weights import save_hf
        return save_hf(self, directory, tokenizer=tokenizer)
