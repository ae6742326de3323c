"""Foreign checkpoint formats: one module per format, its reader and its writer side by side.

    from gpt2.formats import detect
    fmt = detect("model.gguf")            # the module that reads this path (gguf, llmc, openai_tf), or None
    checkpoint = fmt.read("model.gguf")   # ForeignCheckpoint: GPTConfig + tensors in our names and layout

Users never call these directly: `GPT.from_pretrained(PATH)` and `gpt2 convert SRC DST` (weights.py)
detect the format and dispatch here.

  gguf.py       llama.cpp / Ollama GGUF, architecture gpt2 (F32, F16, BF16, Q8_0), through the `gguf` package
  llmc.py       llm.c's model .bin (version 3 fp32, version 5 bf16) and gpt2_tokenizer.bin
  openai_tf.py  OpenAI's original TensorFlow release (hparams.json + model.ckpt.*), read in pure Python

Every module has the same small interface:
  NAME                      its name in `gpt2 convert --to` and in messages
  matches(path) -> bool     a cheap sniff (extension, magic number, directory layout); never raises
  read_header(path) -> ForeignCheckpoint   the config and metadata (incl. "dtype"), without the weights
  read(path) -> ForeignCheckpoint          ... and every tensor
  write(path, config, tensors, ...)   (gguf and llmc) from our unpadded tensors, nn.Linear layout
A reader returns our parameter names ("transformer.h.0.attn.c_attn.weight") in nn.Linear orientation
(out, in), with no vocabulary padding, so weights.py loads them with its one strict loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpt2.config import GPTConfig
from gpt2.errors import ConfigError

# The parameter names inside one block, in the order GPT-2 uses them (our names, relative to transformer.h.{i}.).
BLOCK_PARAMETERS = (
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
)


@dataclass
class ForeignCheckpoint:
    """What a reader found: the architecture and every parameter, in our names and layout."""
    config: GPTConfig
    tensors: dict[str, torch.Tensor]   # "transformer.wte.weight" -> (vocab_size, n_embd), ...
    path: Path
    format: str                        # a module's NAME
    metadata: dict = field(default_factory=dict)   # what the file says beyond the config (version, types)


def require_plain_gpt2(config: GPTConfig, fmt: str, fixed_mlp_width: bool = False) -> None:
    """ConfigError unless a `fmt` file can describe this architecture: OpenAI's GPT-2 block, tanh GELU.

    These formats name no activation or attention scaling, so their readers assume GPT-2's; llm.c also
    fixes the MLP width at 4 * n_embd and the LayerNorm epsilon at 1e-5.
    """
    problems = []
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={config.activation_function!r} (only the tanh GELU)")
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        problems.append("attention scaling other than 1/sqrt(head_size)")
    if fixed_mlp_width and config.mlp_width != 4 * config.n_embd:
        problems.append(f"n_inner={config.n_inner} (the MLP width must be 4 * n_embd)")
    if fixed_mlp_width and config.layer_norm_epsilon != 1e-5:
        problems.append(f"layer_norm_epsilon={config.layer_norm_epsilon} (must be 1e-5)")
    if problems:
        raise ConfigError(f"a {fmt} file cannot describe this model: " + "; ".join(problems))


def formats() -> dict:
    """NAME -> module, for every foreign format (imported on first use: gguf is only needed for GGUF)."""
    from gpt2.formats import gguf, llmc, openai_tf
    return {m.NAME: m for m in (gguf, llmc, openai_tf)}


def detect(path) -> object | None:
    """The format module whose reader takes `path`, or None (a Hugging Face or our own directory, a hub name)."""
    path = Path(path).expanduser()
    if not path.exists():
        return None
    return next((m for m in formats().values() if m.matches(path)), None)
