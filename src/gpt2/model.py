"""GPT-2 in one file, in reading order: LayerNorm, CausalSelfAttention, MLP, Block, GPT.

    from gpt2 import GPT, GPTConfig
    model = GPT(GPTConfig.preset("gpt2"))            # random init
    logits = model(idx)                              # (B, T) -> (B, T, vocab_size)
    loss = model(idx, targets=targets)               # mean cross-entropy (-100 ignored), lm_head fused: lm_head.py

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

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2.config import ACTIVATIONS, GPTConfig
from gpt2.errors import ContextLengthError
from gpt2.kv_cache import KVCache
from gpt2.lm_head import HeadPlan, lm_head_cross_entropy


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
        # (B, T, 3, nh, hs), in c_attn's dtype: float32, or bf16 from a layer packed below float32
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nh, T, hs): 2 ops, not 7 (decode pays per op)
        if cache is not None:
            # (B, nh, P + T, hs), P = positions already cached, in the cache's dtype (GPT.kv_dtype: a bfloat16
            # cache halves the bytes each step reads, and takes a bf16 c_attn's keys as they are)
            k, v = cache.update(self.layer_idx, k, v)
        # Attention runs in x's dtype, except eagerly over a cache of another dtype: in the cache's (upcasting
        # would copy the cache every step). A compiled step fuses the upcast into its attention loops.
        dtype = k.dtype if cache is not None and not torch.compiler.is_compiling() else x.dtype
        if not q.dtype == k.dtype == dtype:  # (k and v share theirs) a decode step pays per op, even a no-op
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

        # mask: None means plain causal (top-left aligned, valid without a cache); otherwise a
        # boolean (B or 1, 1, T, P + T) that is True where a query may attend to a key.
        # A compiled decode step (one query over the cache, its length symbolic) attends explicitly: Inductor
        # fuses the product, mask and softmax into its own loops, where SDPA's CPU kernel costs
        # ~100 us a layer at 192 keys (BENCHMARKS.md).
        if self.use_sdpa and not self.upcast and not (T == 1 and torch.compiler.is_compiling()):
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                dropout_p=self.attn_dropout.p if self.training else 0.0, scale=self.scale)
        else:
            y = self._explicit_attention(q, k, v, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C).to(x.dtype)  # (B, T, C): heads merged
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


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, but on the meta device (a shell to load weights into) without its own N(0, 1) init:
    normal_ there costs ~1 s once per process (it imports torch._dynamo), for values that do not exist."""
    if torch.empty(0).is_meta:  # built under torch.device("meta")
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, vocab_multiple: int = 1):
        """vocab_multiple > 1 pads wte's rows to a multiple (64 suits GEMM kernels); logits stay vocab_size wide."""
        super().__init__()
        self.config = config
        self.padded_vocab_size = math.ceil(config.vocab_size / vocab_multiple) * vocab_multiple
        self.transformer = nn.ModuleDict(dict(
            wte=_embedding(self.padded_vocab_size, config.n_embd),
            wpe=_embedding(config.n_positions, config.n_embd),
            drop=nn.Dropout(config.embd_pdrop),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(config.n_embd, self.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.lm_head_plan: HeadPlan | None = None  # the training loss's kernel plan (train.py sets a measured one)
        self.kv_dtype: torch.dtype | None = None  # its KV caches' dtype (kv_cache.py); None: the weights'
        # the dtype of the caches a compiled decode step reads: None as kv_dtype; "auto" chosen when one first
        # needs it (kv_cache.cache_dtype: the choice compiles and times its attention once per machine)
        self.compiled_kv_dtype: torch.dtype | str | None = None
        if not self.lm_head.weight.is_meta:  # a shell on the meta device (to be loaded into) has no values to set
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
        # so that one graph serves every step; its keys are the written slots (engine._SlotCache).
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
