"""GPT-2's architecture config, its four published presets, and the Hugging Face config.json mapping.

    from gpt2 import GPTConfig
    config = GPTConfig.preset("gpt2-medium")
    config = GPTConfig(n_layer=4, n_head=4, n_embd=256)          # a custom size

GPTConfig holds architecture only: no batch size, device or cache capacity. Its field names are the
Hugging Face ones, so a `config.json` maps one to one. Fields that Transformers' GPT2Config knows but
this implementation does not support are rejected by `from_hf_dict` with a clear error instead of
being silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpt2.errors import ConfigError

GPT2_VOCAB_SIZE = 50257  # OpenAI's byte-level BPE: 50,000 merges + 256 bytes + <|endoftext|>
GPT2_EOT = 50256         # <|endoftext|>, GPT-2's only special token (no BOS: documents start after it)

# The one list of supported activation_function names (Transformers' spelling). model.py maps each to
# its function and inspect.py to its op on the sheet, both keyed by these names.
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_positions: int = 1024          # the context length
    vocab_size: int = GPT2_VOCAB_SIZE
    n_inner: int | None = None       # MLP width; None means 4 * n_embd
    activation_function: str = "gelu_new"   # GPT-2 uses the tanh approximation of GELU
    embd_pdrop: float = 0.1          # dropout after wte + wpe
    attn_pdrop: float = 0.1          # dropout on the attention probabilities
    resid_pdrop: float = 0.1         # dropout after attn.c_proj and after mlp.c_proj
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True                 # divide scores by sqrt(head_size)
    scale_attn_by_inverse_layer_idx: bool = False   # and also by (layer_idx + 1)
    reorder_and_upcast_attn: bool = False           # compute scores and softmax in float32

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner < 1):
            raise ConfigError(f"n_inner must be None or a positive integer, got {self.n_inner!r}")
        if self.activation_function not in ACTIVATIONS:
            raise ConfigError(f"activation_function {self.activation_function!r} is not supported; "
                              f"choose one of {', '.join(ACTIVATIONS)}")
        for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {value!r}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        key = name.removeprefix("openai-community/")
        if key not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
        return cls(**{**PRESETS[key], **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # --- Hugging Face config.json -------------------------------------------------------------

    def to_hf_dict(self) -> dict:
        """A config.json that transformers.GPT2LMHeadModel loads as this exact architecture."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            **self.to_dict(),
            "n_ctx": self.n_positions,
            # <|endoftext|> exists only in GPT-2's own vocabulary
            "bos_token_id": GPT2_EOT if self.vocab_size > GPT2_EOT else None,
            "eos_token_id": GPT2_EOT if self.vocab_size > GPT2_EOT else None,
            "tie_word_embeddings": True,
        }

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "config.json") -> "GPTConfig":
        """Map a Transformers GPT-2 config.json to GPTConfig; reject what we can't honour."""
        if hf.get("model_type", "gpt2") != "gpt2":
            raise ConfigError(f"{source}: model_type is {hf.get('model_type')!r}, expected 'gpt2'")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs, unsupported = {}, []
        for key, value in hf.items():
            if key in fields:
                kwargs[key] = value
            elif key in _HF_REQUIRED_VALUES:
                if value != _HF_REQUIRED_VALUES[key]:
                    unsupported.append(f"{key}={value!r} (only {_HF_REQUIRED_VALUES[key]!r} is supported)")
            elif key == "n_ctx":
                pass  # legacy alias of n_positions; checked below
            elif key in _HF_IGNORED or key.startswith("summary_"):
                pass  # metadata, tokenizer ids, or the double-heads classifier: no effect on the LM
            else:
                unsupported.append(f"{key}={value!r} (unknown field)")
        if "n_ctx" in hf and hf["n_ctx"] != hf.get("n_positions", hf["n_ctx"]):
            unsupported.append(f"n_ctx={hf['n_ctx']!r} differs from n_positions={hf.get('n_positions')!r}")
        if unsupported:
            raise ConfigError(f"{source}: unsupported GPT-2 config values: " + "; ".join(unsupported))
        return cls(**kwargs)


PRESETS: dict[str, dict] = {
    "gpt2":        dict(n_layer=12, n_head=12, n_embd=768),    # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),   # 355M
    "gpt2-large":  dict(n_layer=36, n_head=20, n_embd=1280),   # 774M
    "gpt2-xl":     dict(n_layer=48, n_head=25, n_embd=1600),   # 1558M
}

# Transformers fields that must hold exactly this value for the model to be plain GPT-2.
_HF_REQUIRED_VALUES = {
    "add_cross_attention": False,
    "tie_word_embeddings": True,
    "is_encoder_decoder": False,
    "pruned_heads": {},
}

# Transformers fields with no effect on the language model's computation.
_HF_IGNORED = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "task_specific_params", "id2label", "label2id", "num_labels", "problem_type",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "chunk_size_feed_forward",
    "is_decoder", "tokenizer_class", "prefix", "finetuning_task", "cross_attention_hidden_size",
    "_attn_implementation_autoset", "attn_implementation", "_commit_hash", "use_return_dict",
    "tf_legacy_loss", "use_bfloat16",
}


def require_gpt2_vocab(config: GPTConfig, what: str) -> None:
    """Raise ConfigError unless `config` has GPT-2's vocabulary: text in and out needs GPT-2's tokenizer."""
    if config.vocab_size != GPT2_VOCAB_SIZE:
        raise ConfigError(f"{what}: a vocabulary of {config.vocab_size} tokens is not GPT-2's; text in and out "
                          "needs the GPT-2 tokenizer")
