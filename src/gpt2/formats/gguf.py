"""GGUF, the file format of llama.cpp and Ollama, for architecture `gpt2`: read and written with the `gguf` package.

    model = GPT.from_pretrained("gpt2-q8_0.gguf")                  # F32, F16, BF16 or Q8_0, dequantized
    gpt2 convert gpt2 gpt2-q8_0.gguf --dtype q8_0                  # --dtype float32|float16|bfloat16|q8_0
    gpt2 convert gpt2 gpt2.gguf --no-output-tensor                 # without the output.weight copy
    llama-cli -m gpt2-q8_0.gguf -p "Hello"                         # what the file is for

What is written is what llama.cpp's convert_hf_to_gguf.py writes for GPT-2 (its GPT2Model class, the
names in gguf-py's constants.py / tensor_mapping.py, the loader in src/llama-model.cpp, LLM_ARCH_GPT2):
  tensors    token_embd, position_embd, blk.N.{attn_norm, attn_qkv, attn_output, ffn_norm, ffn_up, ffn_down},
             output_norm (.weight / .bias), each 2-D weight as numpy (out, in), i.e. ggml ne = (in, out);
             output.weight, a copy of token_embd, unless output_tensor=False: llama.cpp builds from before
             March 2025 require it, newer ones fall back to token_embd.
  types      the 2-D weights (token_embd, the projections, output) in the chosen type; norms, biases
             and position_embd stay F32, as the converter keeps them. Q8_0 quantizes blocks of 32 along
             a row; a row whose length is not a multiple of 32 falls back to F16, as the converter does.
  metadata   general.architecture/type/name/size_label/file_type/quantization_version;
             gpt2.context_length, embedding_length, feed_forward_length, block_count,
             attention.head_count, attention.layer_norm_epsilon;
             tokenizer.ggml.model = "gpt2", pre = "gpt-2", tokens, token_type, merges,
             bos_token_id = eos_token_id = 50256, add_bos_token = false.
Reading takes F32, F16, BF16 and Q8_0 tensors (anything else is refused by name), checks that
output.weight, if present, equals token_embd (our lm_head is tied), and returns float32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpt2.atomic import atomic_write_bytes
from gpt2.config import GPT2_EOT, GPTConfig
from gpt2.errors import CheckpointError, ConfigError
from gpt2.formats import BLOCK_PARAMETERS, ForeignCheckpoint, require_plain_gpt2

NAME = "gguf"
ARCH = "gpt2"
GGUF_MAGIC = b"GGUF"

# Our name <-> llama.cpp's, the one table used in both directions (block names relative to h.{i} / blk.{i}).
GLOBAL_NAMES = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
                "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias"}
BLOCK_NAMES = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
               "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
OUTPUT = "output.weight"  # llama.cpp's lm_head: in our tied model, token_embd itself

# --dtype name -> the GGML type of the 2-D weights (and the file type that announces it).
WEIGHT_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "q8_0": "Q8_0"}
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}
READABLE_TYPES = ("F32", "F16", "BF16", "Q8_0")


def gguf_name(name: str) -> str:
    """transformer.h.3.attn.c_attn.weight -> blk.3.attn_qkv.weight"""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{BLOCK_NAMES[module]}.{kind}"


def our_names(config: GPTConfig) -> dict[str, str]:
    """llama.cpp's name -> ours, for every parameter of a model of this config."""
    names = [*GLOBAL_NAMES, *(f"transformer.h.{i}.{p}" for i in range(config.n_layer) for p in BLOCK_PARAMETERS)]
    return {gguf_name(n): n for n in names}


def matches(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC or path.suffix == ".gguf"


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------

def gpt2_vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) as the converter writes GPT-2's tokenizer, for `vocab_size` ids.

    Tokens are vocab.json's strings (bytes through GPT-2's printable stand-ins). A padded vocabulary
    gets "[PAD{i}]" tokens of type UNUSED, as the converter writes them; a smaller one (a toy model)
    keeps GPT-2's first ids and the merges that make them, which is still a consistent BPE.
    """
    import gguf

    from gpt2.tokenizer import Tokenizer, bytes_to_unicode
    tok = Tokenizer.gpt2()
    stand_in = bytes_to_unicode()
    special = {i: s for s, i in tok.special_tokens.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in special:
            tokens.append(special[i]); types.append(gguf.TokenType.CONTROL)
        elif i < tok.n_vocab:
            tokens.append("".join(stand_in[b] for b in tok.token_bytes(i))); types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]"); types.append(gguf.TokenType.UNUSED)
    merges = [f"{a} {b}" for a, b in tok.merges[: max(0, vocab_size - 256)]]
    return tokens, [int(t) for t in types], merges


def write(path, config: GPTConfig, tensors: dict[str, torch.Tensor], dtype: str = "float32",
          output_tensor: bool = True, name: str = "gpt2") -> Path:
    """A GGUF file at `path` from our unpadded tensors (nn.Linear layout); `dtype` is a WEIGHT_TYPES name."""
    import gguf
    require_plain_gpt2(config, "GGUF")
    if dtype not in WEIGHT_TYPES:
        raise ConfigError(f"GGUF weights can be {', '.join(WEIGHT_TYPES)}, not {dtype!r}")
    weight_type = gguf.GGMLQuantizationType[WEIGHT_TYPES[dtype]]
    path = Path(path)
    writer = gguf.GGUFWriter(None, ARCH)
    n_parameters = sum(t.numel() for t in tensors.values())

    # Metadata, in the converter's order.
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_size_label(gguf.size_label(n_parameters, 0, 0, 0))
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.mlp_width)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[weight_type.name]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types, merges = gpt2_vocabulary(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if config.vocab_size > GPT2_EOT:
        writer.add_bos_token_id(GPT2_EOT)
        writer.add_eos_token_id(GPT2_EOT)
    writer.add_add_bos_token(False)

    for our_name, tensor in tensors.items():
        data = tensor.detach().to("cpu", torch.float32).numpy()
        add_tensor(writer, gguf_name(our_name), data, weight_type)
        if output_tensor and our_name == "transformer.wte.weight":
            add_tensor(writer, OUTPUT, data, weight_type)

    def write_to(tmp):
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, write_to)
    return path


def add_tensor(writer, name: str, data: np.ndarray, weight_type) -> None:
    """One tensor in the converter's type: F32 for norms, biases and position_embd, else `weight_type`."""
    import gguf
    qtype = weight_type
    if data.ndim <= 1 or name == "position_embd.weight":
        qtype = gguf.GGMLQuantizationType.F32
    try:
        quantized = gguf.quants.quantize(data, qtype)
    except gguf.QuantError:  # a row length Q8_0's blocks of 32 do not divide
        qtype = gguf.GGMLQuantizationType.F16
        quantized = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, quantized, raw_dtype=qtype)  # a uint8 block shape is turned back into (out, in)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------

def open_reader(path: Path):
    """gguf.GGUFReader over the file; CheckpointError for a wrong magic or a truncated file."""
    import gguf
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: magic {magic!r} is not {GGUF_MAGIC!r}; not a GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, OverflowError, KeyError) as e:  # what the reader raises on short or bad files
        raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{path}: truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, "
                                  f"the file has {size} bytes")
    return reader


def _field(reader, key: str, path: Path, required: bool = True):
    field = reader.get_field(key)
    if field is None:
        if required:
            raise CheckpointError(f"{path}: metadata key {key!r} is missing")
        return None
    return field.contents()


def read_header(path) -> ForeignCheckpoint:
    """The config and the tensor types, without the weights."""
    path = Path(path)
    return _header(open_reader(path), path)


def _header(reader, path: Path) -> ForeignCheckpoint:
    arch = _field(reader, "general.architecture", path)
    if arch != ARCH:
        raise CheckpointError(f"{path}: architecture {arch!r}, only {ARCH!r} (GPT-2) is supported")
    tensors_by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors_by_name:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")
    n_embd = int(_field(reader, f"{ARCH}.embedding_length", path))
    mlp_width = int(_field(reader, f"{ARCH}.feed_forward_length", path))
    try:
        config = GPTConfig(
            n_layer=int(_field(reader, f"{ARCH}.block_count", path)),
            n_head=int(_field(reader, f"{ARCH}.attention.head_count", path)),
            n_embd=n_embd,
            n_positions=int(_field(reader, f"{ARCH}.context_length", path)),
            vocab_size=int(tensors_by_name["token_embd.weight"].shape[1]),  # ggml ne = (n_embd, n_vocab)
            n_inner=None if mlp_width == 4 * n_embd else mlp_width,
            # stored as float32: the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)
            layer_norm_epsilon=float(str(np.float32(_field(reader, f"{ARCH}.attention.layer_norm_epsilon", path)))))
    except ConfigError as e:
        raise CheckpointError(f"{path}: metadata: {e}") from None
    types = {name: t.tensor_type.name for name, t in tensors_by_name.items()}
    for name, qtype in types.items():
        if qtype not in READABLE_TYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has type {qtype}; only "
                                  f"{', '.join(READABLE_TYPES)} can be read")
    metadata = {"dtype": types["token_embd.weight"], "types": types, "output_tensor": OUTPUT in types}
    return ForeignCheckpoint(config, {}, path, NAME, metadata)


def read(path) -> ForeignCheckpoint:
    """Config and every tensor, dequantized to float32, in our names (output.weight checked, then dropped)."""
    import gguf
    path = Path(path)
    reader = open_reader(path)
    checkpoint = _header(reader, path)
    names = our_names(checkpoint.config)
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]  # numpy order: (out, in)
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # a private copy
        checkpoint.tensors[names.get(t.name, t.name)] = torch.from_numpy(values).reshape(shape)  # unknown names
        # pass through unchanged: the strict loader names them
    output = checkpoint.tensors.pop(OUTPUT, None)
    if output is not None and not torch.equal(output, checkpoint.tensors["transformer.wte.weight"]):
        raise CheckpointError(f"{path}: output.weight differs from token_embd.weight; only GPT-2's tied "
                              "output matrix is supported")
    return checkpoint
