"""llm.c's GPT-2 checkpoints: the model .bin (version 3 fp32, version 5 bf16) and gpt2_tokenizer.bin.

    model = GPT.from_pretrained("gpt2_124M.bin")                 # either version; padding rows dropped
    gpt2 convert runs/mine gpt2_124M_bf16.bin --dtype bfloat16   # version 5, gpt2_tokenizer.bin beside

The layout (llm.c's train_gpt2.py, write_model and write_tokenizer):
  model:     256 little-endian int32: magic 20240326, version, max_seq_len, vocab_size, n_layer, n_head,
             n_embd, padded_vocab_size, then zeros; then the tensors, fp32 (version 3) or bf16 (version 5):
             wte (padded to a multiple of 128 with zero rows), wpe, then for each parameter of a block
             (BLOCK_PARAMETERS' order) that parameter of every layer, then ln_f weight and bias.
             Weights are nn.Linear's (out, in), as ours. llm.c fixes the MLP at 4 * n_embd and
             LayerNorm epsilon at 1e-5, so the header needs no more.
  tokenizer: 256 little-endian uint32: magic 20240328, version 2, n_tokens, eot id; then each token as
             a uint8 length and its bytes.
Our token shards are llm.c's too (gpt2.shards); the same 256-int header convention.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from gpt2.atomic import atomic_write_bytes
from gpt2.config import GPTConfig
from gpt2.errors import CheckpointError, ConfigError
from gpt2.formats import BLOCK_PARAMETERS, ForeignCheckpoint, require_plain_gpt2

NAME = "llmc"
MODEL_MAGIC = 20240326
TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2        # version 2 stores the eot id
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSIONS = {3: torch.float32, 5: torch.bfloat16}   # llm.c's checkpoint versions with a padded vocabulary
VERSION_OF_DTYPE = {str(dtype).removeprefix("torch."): version for version, dtype in VERSIONS.items()}
VOCAB_MULTIPLE = 128
TOKENIZER_FILENAME = "gpt2_tokenizer.bin"


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def tensor_order(config: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(our name, shape in the file) of every tensor, in file order; wte has padded_vocab_size rows."""
    C, L, T = config.n_embd, config.n_layer, config.n_positions
    shapes = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (3 * C, C), "attn.c_attn.bias": (3 * C,),
              "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
              "mlp.c_fc.weight": (4 * C, C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (C, 4 * C),
              "mlp.c_proj.bias": (C,)}
    order = [("transformer.wte.weight", (padded_vocab_size(config.vocab_size), C)),
             ("transformer.wpe.weight", (T, C))]
    for param in BLOCK_PARAMETERS:  # one parameter of every layer, then the next parameter
        order += [(f"transformer.h.{i}.{param}", shapes[param]) for i in range(L)]
    return order + [("transformer.ln_f.weight", (C,)), ("transformer.ln_f.bias", (C,))]


def matches(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) == 4 and struct.unpack("<i", head)[0] == MODEL_MAGIC:
        return True
    # Any other .bin but PyTorch's (a zip, or named pytorch_model.bin): read() then says what is wrong with it.
    return path.suffix == ".bin" and path.name != "pytorch_model.bin" and not head.startswith(b"PK")


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------

def read_header(path) -> ForeignCheckpoint:
    """The config and version from the header, checked against the file size; no weights."""
    path = Path(path)
    size = path.stat().st_size
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header.size != HEADER_INTS:
        raise CheckpointError(f"{path}: {size} bytes is shorter than llm.c's {HEADER_BYTES}-byte header")
    magic, version, max_seq_len, vocab_size, n_layer, n_head, n_embd, padded_vocab = (int(v) for v in header[:8])
    if magic != MODEL_MAGIC:
        hint = " (it is llm.c's tokenizer file)" if magic == TOKENIZER_MAGIC else ""
        raise CheckpointError(f"{path}: magic {magic} is not llm.c's {MODEL_MAGIC}; not an llm.c checkpoint{hint}")
    if version not in VERSIONS:
        raise CheckpointError(f"{path}: llm.c checkpoint version {version} is not supported "
                              f"(only 3: fp32 and 5: bf16, both with a padded vocabulary)")
    try:
        config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=max_seq_len,
                           vocab_size=vocab_size)
    except ConfigError as e:
        raise CheckpointError(f"{path}: header: {e}") from None
    if padded_vocab < vocab_size:
        raise CheckpointError(f"{path}: header: padded_vocab_size {padded_vocab} < vocab_size {vocab_size}")
    dtype = VERSIONS[version]
    order = tensor_order(config)
    order[0] = (order[0][0], (padded_vocab, n_embd))  # the file's own padding, whatever multiple it used
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = HEADER_BYTES + sum(int(np.prod(shape)) for _, shape in order) * itemsize
    if size != expected:
        raise CheckpointError(f"{path}: the header ({n_layer} layers, width {n_embd}, vocabulary {padded_vocab}, "
                              f"context {max_seq_len}, version {version}) needs {expected} bytes, the file has "
                              f"{size}: truncated or not this model")
    metadata = {"dtype": str(dtype).removeprefix("torch."), "version": version, "padded_vocab_size": padded_vocab}
    return ForeignCheckpoint(config, {}, path, NAME, metadata)


def read(path) -> ForeignCheckpoint:
    checkpoint = read_header(path)
    config, meta = checkpoint.config, checkpoint.metadata
    dtype = VERSIONS[meta["version"]]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size = checkpoint.path.stat().st_size
    raw = torch.from_file(str(checkpoint.path), shared=False, size=size, dtype=torch.uint8)  # private memory
    order = tensor_order(config)
    order[0] = (order[0][0], (meta["padded_vocab_size"], config.n_embd))  # the file's own padding
    offset = HEADER_BYTES
    for name, shape in order:
        n = int(np.prod(shape)) * itemsize
        checkpoint.tensors[name] = raw[offset:offset + n].view(dtype).view(shape)
        offset += n
    wte = checkpoint.tensors["transformer.wte.weight"]
    checkpoint.tensors["transformer.wte.weight"] = wte[: config.vocab_size]  # drop the padding rows
    return checkpoint


def write(path, config: GPTConfig, tensors: dict[str, torch.Tensor], dtype: str = "float32") -> Path:
    """Version 3 (dtype "float32") or 5 ("bfloat16") at `path`, and gpt2_tokenizer.bin in the same directory."""
    require_plain_gpt2(config, "llm.c", fixed_mlp_width=True)
    if dtype not in VERSION_OF_DTYPE:
        raise ConfigError(f"llm.c checkpoints are float32 (version 3) or bfloat16 (version 5), not {dtype!r}")
    version = VERSION_OF_DTYPE[dtype]
    path = Path(path)
    padded = padded_vocab_size(config.vocab_size)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = [MODEL_MAGIC, version, config.n_positions, config.vocab_size, config.n_layer,
                  config.n_head, config.n_embd, padded]

    def write_to(tmp):
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            for name, shape in tensor_order(config):
                tensor = tensors[name].detach().to("cpu", VERSIONS[version])
                if name == "transformer.wte.weight":
                    tensor = torch.cat([tensor, tensor.new_zeros(padded - config.vocab_size, config.n_embd)])
                if tuple(tensor.shape) != shape:
                    raise CheckpointError(f"{name} has shape {list(tensor.shape)}, llm.c's layout needs {list(shape)}")
                f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, write_to)
    write_tokenizer(path.parent / TOKENIZER_FILENAME)
    return path


# ---------------------------------------------------------------------------------------------
# gpt2_tokenizer.bin
# ---------------------------------------------------------------------------------------------

def write_tokenizer(path, tokenizer=None) -> Path:
    """GPT-2's vocabulary (or `tokenizer`'s) as llm.c's tokenizer file: every token's bytes, by id."""
    from gpt2.tokenizer import Tokenizer
    tokenizer = tokenizer or Tokenizer.gpt2()
    header = np.zeros(HEADER_INTS, dtype="<u4")
    header[:4] = [TOKENIZER_MAGIC, TOKENIZER_VERSION, tokenizer.n_vocab, tokenizer.eot_token]
    body = bytearray()
    for i in range(tokenizer.n_vocab):
        token = tokenizer.token_bytes(i)
        if len(token) > 255:
            raise ConfigError(f"token {i} is {len(token)} bytes; llm.c's tokenizer file holds at most 255")
        body += bytes([len(token)]) + token
    atomic_write_bytes(path, lambda tmp: Path(tmp).write_bytes(header.tobytes() + bytes(body)))
    return Path(path)


def read_tokenizer(path) -> tuple[list[bytes], int]:
    """(the bytes of every token by id, the eot id) from an llm.c tokenizer file (version 2)."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < HEADER_BYTES:
        raise CheckpointError(f"{path}: {len(data)} bytes is shorter than llm.c's {HEADER_BYTES}-byte header")
    magic, version, n_tokens, eot = struct.unpack_from("<4I", data)
    if magic != TOKENIZER_MAGIC:
        raise CheckpointError(f"{path}: magic {magic} is not llm.c's tokenizer magic {TOKENIZER_MAGIC}")
    if version != TOKENIZER_VERSION:
        raise CheckpointError(f"{path}: tokenizer version {version} is not supported (only {TOKENIZER_VERSION})")
    tokens, pos = [], HEADER_BYTES
    for i in range(n_tokens):
        if pos >= len(data) or pos + 1 + data[pos] > len(data):
            raise CheckpointError(f"{path}: truncated at token {i} of {n_tokens}")
        tokens.append(data[pos + 1:pos + 1 + data[pos]])
        pos += 1 + data[pos]
    if pos != len(data):
        raise CheckpointError(f"{path}: {len(data) - pos} bytes after the last of {n_tokens} tokens")
    return tokens, eot
