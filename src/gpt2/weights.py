"""Weights in and out: Hugging Face directories, the hub, our own checkpoints, and (through formats/) GGUF,
llm.c and OpenAI's TensorFlow release.

    from gpt2 import GPT
    model = GPT.from_pretrained("gpt2")                       # hub name -> openai-community/gpt2
    model = GPT.from_pretrained("path/to/hf_dir", dtype=torch.bfloat16)
    model = GPT.from_pretrained("gpt2.gguf")                  # or an llm.c .bin, or OpenAI's models/124M
    model.save_pretrained("out_dir")                          # transformers.GPT2LMHeadModel loads it
    gpt2 convert runs/quickstart hf_dir                       # ours <-> Hugging Face, on the CLI
    gpt2 convert gpt2 gpt2.gguf --dtype q8_0                  # --to hf|ours|gguf|llmc, default from DST

A path is first offered to the foreign formats (`formats.detect`: a .gguf file, an llm.c .bin, a
directory with hparams.json and model.ckpt.index); their readers hand back our names and layout, and
the same strict loader below fills the model from them.

Our parameter names are GPT-2's own, so Hugging Face's checkpoints map by name. The one difference is
orientation: Transformers' GPT-2 stores its four projection matrices as Conv1D, (in, out), while we use
nn.Linear, (out, in). The table below is therefore a single list of transposed keys, used in both
directions. Old files may lack the "transformer." prefix (the official hub checkpoints do) or carry
the attn.bias / attn.masked_bias mask buffers, which are skipped.

`gpt2 info` and `gpt2 inspect` read only a config: `resolve_config` is the one rule for "a preset
name, or a model directory, run directory or hub name".

Two on-disk layouts:
  Hugging Face: config.json + model.safetensors (or a sharded index, or pytorch_model.bin)
  ours:         gpt2.json (config and metadata) + model.safetensors in nn.Linear orientation

Safetensors files are read with plain file reads into preallocated tensors, one tensor at a time, on a
model built on the meta device: nothing is memory-mapped and no second copy of the weights exists, so
peak memory stays near the size of the weights. pytorch_model.bin is read with weights_only=True: no
code in a checkpoint is ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.atomic import atomic_write_bytes, atomic_write_json
from gpt2.config import GPT2_EOT, GPT2_VOCAB_SIZE, PRESETS, GPTConfig
from gpt2.errors import CheckpointError, ConfigError, TokenizerError
from gpt2.formats import detect as detect_format
from gpt2.model import GPT

# Conv1D weights in Transformers, nn.Linear here: the only difference between the two layouts.
TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Causal-mask buffers that old Transformers versions saved; they carry no learned values.
SKIPPED = (".attn.bias", ".attn.masked_bias")
TIED = "lm_head.weight"  # the same tensor as transformer.wte.weight

HUB_ALIASES = {name: f"openai-community/{name}" for name in PRESETS}
NATIVE_META = "gpt2.json"
NATIVE_FORMAT = "gpt2-checkpoint"
LATEST_POINTER = "LATEST"  # a training run directory names its newest checkpoint in this file

# The one table of weight and activation dtypes by name: the CLI's --dtype choices, inspect's byte
# counts and training's autocast all read it.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype) -> torch.dtype | None:
    """A torch.dtype from its name in DTYPES (or a torch.dtype, or None, unchanged); ConfigError otherwise."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def canonical_key(key: str) -> str:
    """Our parameter name for a key from any supported file; the one place prefixes are stripped."""
    key = key.replace("_orig_mod.", "")  # torch.compile wrapper
    key = key.removeprefix("module.")    # DDP wrapper
    if not key.startswith(("transformer.", "lm_head.")):
        key = "transformer." + key       # files saved from GPT2Model rather than GPT2LMHeadModel
    return key


def is_transposed(key: str) -> bool:
    return key.endswith(TRANSPOSED)


# ---------------------------------------------------------------------------------------------
# safetensors, read without memory-mapping
# ---------------------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class SafetensorsReader:
    """Validates a .safetensors header up front, then reads one tensor at a time into fresh memory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            file_size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file ({file_size} bytes)")
                (header_size,) = struct.unpack("<Q", prefix)
                if header_size > min(file_size - 8, 100 * 2**20):
                    raise CheckpointError(f"{self.path}: corrupt safetensors header (declares {header_size} bytes)")
                header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_size
        self.entries = {}
        for name, entry in header.items():
            try:
                dtype = SAFETENSORS_DTYPES[entry["dtype"]]
                shape = [int(s) for s in entry["shape"]]
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: corrupt or unsupported header entry for {name!r}") from None
            nbytes = math.prod(shape) * _itemsize(dtype)
            if end - begin != nbytes or begin < 0:
                raise CheckpointError(f"{self.path}: tensor {name!r} has {end - begin} bytes, its shape needs {nbytes}")
            if self.data_start + end > file_size:
                raise CheckpointError(f"{self.path}: truncated: tensor {name!r} ends at byte {self.data_start + end}, "
                                      f"the file has {file_size} bytes")
            self.entries[name] = (dtype, shape, begin)

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> list[int]:
        return self.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def read_into(self, name: str, out: torch.Tensor, buffer: torch.Tensor) -> None:
        """Copy tensor `name` into `out` (same shape; any dtype or strides) through `buffer` (uint8).

        Rows are streamed through one reused buffer, so a transposed or dtype-converted destination
        never needs a full-size temporary. Reusing the buffer across tensors also matters: freeing a
        large block per tensor makes glibc raise its mmap threshold and fragment the heap (~20% RSS).
        """
        dtype, shape, begin = self.entries[name]
        if out.numel() == 0:
            return
        rows = out.reshape(-1, 1) if len(shape) <= 1 else out  # (rows, ...); 1-D tensors stream per element
        row_bytes = math.prod(rows.shape[1:]) * _itemsize(dtype)
        rows_per_chunk = max(1, buffer.numel() // row_bytes)
        if rows_per_chunk * row_bytes > buffer.numel():
            buffer = torch.empty(row_bytes, dtype=torch.uint8)  # a single row larger than the buffer
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            for start in range(0, rows.size(0), rows_per_chunk):
                n = min(rows_per_chunk, rows.size(0) - start)
                chunk = buffer[: n * row_bytes]
                if f.readinto(chunk.numpy()) != n * row_bytes:
                    raise CheckpointError(f"{self.path}: truncated while reading {name!r}")
                rows[start:start + n].copy_(chunk.view(dtype).view(n, *rows.shape[1:]))


class TensorDictReader:
    """Tensors already in memory (a pytorch_model.bin, or a foreign format's reader) behind the reader interface."""

    def __init__(self, path: Path, state: dict[str, torch.Tensor]):
        self.path = Path(path)
        self.state = state
        self.metadata = {}

    def keys(self):
        return self.state.keys()

    def shape(self, name):
        return list(self.state[name].shape)

    def dtype(self, name):
        return self.state[name].dtype

    def read_into(self, name, out, buffer=None):
        out.copy_(self.state[name])


class TorchBinReader(TensorDictReader):
    """pytorch_model.bin, loaded with weights_only=True (no arbitrary unpickling)."""

    def __init__(self, path: Path):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many types for corrupt zips and forbidden pickles
            raise CheckpointError(f"{path}: not a loadable weights-only PyTorch checkpoint "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path}: expected a dict of tensors")
        super().__init__(path, state)


# ---------------------------------------------------------------------------------------------
# where the files are: local directories, our run directories, the hub
# ---------------------------------------------------------------------------------------------

def newest_checkpoint(path: Path) -> Path:
    """A training run directory -> the checkpoint its LATEST file names; any other path unchanged.
    The one place that reads LATEST (checkpoint.save writes it)."""
    pointer = Path(path) / LATEST_POINTER
    if pointer.is_file() and not (Path(path) / NATIVE_META).exists():
        return Path(path) / pointer.read_text().strip()
    return Path(path)


def resolve_directory(name_or_path: str | os.PathLike) -> Path:
    """A local directory holding the model: the path itself, a run's LATEST checkpoint, or a hub snapshot."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        path = path.parent  # model.safetensors or config.json given directly
    if path.is_dir():
        path = newest_checkpoint(path)
        if not ((path / NATIVE_META).exists() or (path / "config.json").exists()):
            raise CheckpointError(f"{path}: no config.json (Hugging Face) or {NATIVE_META} (gpt2 checkpoint) here")
        return path
    name = str(name_or_path)
    repo_id = HUB_ALIASES.get(name, name)
    if str(name_or_path).startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        raise CheckpointError(f"{name_or_path}: no such directory, and not a hub model name "
                              f"(e.g. gpt2, openai-community/gpt2-medium)")
    return download_from_hub(repo_id)


def download_from_hub(repo_id: str) -> Path:
    """Fetch (or find in the hub cache, with HF_HUB_OFFLINE=1) config.json, the weights and tokenizer files."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    def fetch(filename: str) -> Path | None:
        try:
            return Path(hf_hub_download(repo_id, filename))
        except EntryNotFoundError:
            return None
        except LocalEntryNotFoundError:
            # Offline or unreachable, and this file is not in the cache.
            return None
        except HfHubHTTPError as e:
            raise CheckpointError(f"hub model {repo_id!r}: {str(e).splitlines()[0]}") from None

    config = fetch("config.json")
    if config is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        hint = ("HF_HUB_OFFLINE is set and it is not in the hub cache" if offline else
                "it could not be downloaded and is not in the hub cache")
        raise CheckpointError(f"hub model {repo_id!r}: {hint}; download it, or pass a local directory")
    if fetch("model.safetensors") is None:
        index = fetch("model.safetensors.index.json")
        if index is not None:
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                if fetch(shard) is None:
                    raise CheckpointError(f"hub model {repo_id!r}: shard {shard} is missing")
        elif fetch("pytorch_model.bin") is None:
            raise CheckpointError(f"hub model {repo_id!r}: no model.safetensors or pytorch_model.bin available")
    for optional in ("generation_config.json", "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
        fetch(optional)
    return config.parent


def _open_readers(directory: Path) -> list:
    """Readers for the weight files of a directory, safetensors first."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    binary = directory / "pytorch_model.bin"
    if single.exists():
        return [SafetensorsReader(single)]
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: corrupt shard index ({e})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).exists()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {', '.join(missing)}")
        return [SafetensorsReader(directory / s) for s in shards]
    if binary.exists():
        return [TorchBinReader(binary)]
    raise CheckpointError(f"{directory}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_config(directory: Path) -> tuple[GPTConfig, str]:
    """(config, layout) of a model directory; layout is 'gpt2' (ours) or 'hf'."""
    native = directory / NATIVE_META
    try:
        if native.exists():
            meta = read_json(native)
            if meta.get("format") != NATIVE_FORMAT:
                raise CheckpointError(f"{native}: not a gpt2 checkpoint description")
            return GPTConfig(**meta["config"]), "gpt2"
        return GPTConfig.from_hf_dict(read_json(directory / "config.json"), source=str(directory / "config.json")), "hf"
    except (ConfigError, TypeError, KeyError) as e:
        raise CheckpointError(f"{directory}: unusable model config: {e}") from None


@dataclass(frozen=True)
class ResolvedConfig:
    """What a preset name or a model directory/hub name stands for, before any weights are read."""
    config: GPTConfig
    source: str              # "preset gpt2", or the directory / file
    directory: Path | None   # where the weights are: a directory, or a foreign format's file; None for a preset
    layout: str | None       # "gpt2" (ours), "hf", or a foreign format's NAME (gguf, llmc, openai_tf); None for a preset


def preset_name(name_or_path) -> str | None:
    """The preset a name means (gpt2, gpt2-xl, openai-community/gpt2-medium, ...), or None.

    A local path of that name wins over the preset, so a directory called "gpt2" is read as one.
    """
    key = str(name_or_path).removeprefix("openai-community/")
    return key if key in PRESETS and not Path(name_or_path).exists() else None


def resolve_config(name_or_path) -> ResolvedConfig:
    """A preset's config, or the config of a model directory, run directory or hub name (`gpt2 info`, `gpt2 inspect`)."""
    preset = preset_name(name_or_path)
    if preset is not None:
        return ResolvedConfig(GPTConfig.preset(preset), f"preset {preset}", None, None)
    fmt = detect_format(name_or_path)
    if fmt is not None:
        header = fmt.read_header(Path(name_or_path).expanduser())
        return ResolvedConfig(header.config, str(header.path), header.path, fmt.NAME)
    directory = resolve_directory(name_or_path)
    config, layout = read_config(directory)
    return ResolvedConfig(config, str(directory), directory, layout)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

def open_weights(name_or_path) -> tuple[Path, GPTConfig, str, list]:
    """(where, config, layout, readers) of any model path or hub name; a foreign format is read here whole."""
    fmt = detect_format(name_or_path)
    if fmt is not None:
        checkpoint = fmt.read(Path(name_or_path).expanduser())
        return checkpoint.path, checkpoint.config, fmt.NAME, [TensorDictReader(checkpoint.path, checkpoint.tensors)]
    directory = resolve_directory(name_or_path)
    config, layout = read_config(directory)
    return directory, config, layout, _open_readers(directory)


def load_model(name_or_path, device=None, dtype=None, vocab_multiple: int = 1, replace_linear=None) -> GPT:
    """Build the model on the meta device, then fill it tensor by tensor, strictly.

    replace_linear(model, name, weight, bias), if given, is called for each nn.Linear as soon as its
    tensors are read (the tied lm_head last, with wte's weight and no bias) and puts a layer of its own
    at `name` (quantize.load_for_inference packs it): the float32 weights of a model loaded that way
    are never all held at once, only one layer's beside the packed ones.
    """
    where, config, layout, readers = open_weights(name_or_path)
    with torch.device("meta"):
        model = GPT(config, vocab_multiple=vocab_multiple)
    # a linear's name -> the names of its parameters still to come (the tied lm_head: none come)
    awaited = {} if replace_linear is None else {
        name: {p for p, _ in module.named_parameters(recurse=False)}
        for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    read = {}  # a linear's name -> its tensors read so far
    for name, tensor in _read_tensors(where, readers, model, layout, parse_dtype(dtype), device):
        module_name, _, attr = name.rpartition(".")
        if module_name in awaited:
            read.setdefault(module_name, {})[attr] = tensor
            if read[module_name].keys() == awaited[module_name]:
                tensors = read.pop(module_name)
                replace_linear(model, module_name, tensors["weight"], tensors.get("bias"))
            continue
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(tensor))
    model.lm_head.weight = model.transformer.wte.weight  # re-tie after replacing wte's parameter
    if replace_linear is not None:
        replace_linear(model, "lm_head", model.lm_head.weight, None)
    return model.eval()


def _read_tensors(where: Path, readers: list, model: GPT, layout: str, dtype, device):
    """Yields (name, tensor) for every parameter of the (meta) model, read from `readers` one at a time,
    then raises CheckpointError listing what is off: a load that fails returns nothing it read."""
    config = model.config
    expected = {name: p for name, p in model.named_parameters()}  # the tied lm_head is listed once, as wte
    seen, problems = set(), []
    buffer = torch.empty(4 * 2**20, dtype=torch.uint8)  # the one staging buffer for every tensor
    for reader in readers:
        for key in reader.keys():
            name = canonical_key(key)
            if name.endswith(SKIPPED) or name == TIED:
                continue
            if name not in expected:
                problems.append(f"unexpected key {key!r} in {reader.path.name}")
                continue
            transpose = layout == "hf" and is_transposed(name)
            file_shape = reader.shape(key)
            shape = file_shape[::-1] if transpose else file_shape
            want = list(expected[name].shape)
            if name == "transformer.wte.weight":
                want[0] = config.vocab_size  # files never hold vocabulary padding
            if shape != want:
                problems.append(f"{key!r} in {reader.path.name} has shape {file_shape}, expected "
                                f"{want[::-1] if transpose else want}")
                continue
            # Allocate the final tensor once and stream the file into it (transposed view if needed).
            file_dtype = reader.dtype(key)
            tensor = torch.empty(expected[name].shape, dtype=dtype or (  # read_into fills every element
                file_dtype if file_dtype.is_floating_point else torch.float32))
            destination = tensor
            if name == "transformer.wte.weight":
                destination = tensor[: config.vocab_size]
                tensor[config.vocab_size:].zero_()  # the padding rows no file holds
            reader.read_into(key, destination.t() if transpose else destination, buffer)
            seen.add(name)
            yield name, (tensor.to(device) if device is not None else tensor)
    problems += [f"missing key {name!r}" for name in expected if name not in seen and not any(
        p.startswith(f"{name!r} ") for p in problems)]
    if problems:
        raise CheckpointError(f"{where}: weights do not match the config "
                              f"({config.n_layer} layers, width {config.n_embd}): " + "; ".join(problems[:10])
                              + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------

def _unpadded_state(model: GPT, layout: str, dtype=None) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, param in model.named_parameters():  # tied lm_head appears once, as wte
        name = canonical_key(name)
        tensor = param.detach()
        if name == "transformer.wte.weight":
            tensor = tensor[: model.config.vocab_size]
        if layout == "hf" and is_transposed(name):
            tensor = tensor.t()
        tensors[name] = tensor.to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
    return tensors


def _save_safetensors(path: Path, tensors: dict, metadata: dict) -> None:
    from safetensors.torch import save_file
    atomic_write_bytes(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def save_hf(model: GPT, directory, tokenizer=None, dtype=None) -> str:
    """config.json + model.safetensors (+ tokenizer files): loadable by transformers.GPT2LMHeadModel."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    tensors = _unpadded_state(model, "hf", dtype)
    _save_safetensors(directory / "model.safetensors", tensors, {"format": "pt"})
    config = model.config.to_hf_dict()
    config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    atomic_write_json(directory / "config.json", config)
    if model.config.vocab_size > GPT2_EOT:
        atomic_write_json(directory / "generation_config.json", {"bos_token_id": GPT2_EOT, "eos_token_id": GPT2_EOT})
    _save_tokenizer(directory, model.config, tokenizer)
    return str(directory)


def save_native(model: GPT, directory, meta: dict | None = None, dtype=None) -> str:
    """Our layout: model.safetensors in nn.Linear orientation + gpt2.json (config and metadata)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _unpadded_state(model, "gpt2", parse_dtype(dtype))
    _save_safetensors(directory / "model.safetensors", tensors, {"format": NATIVE_FORMAT})
    _save_tokenizer(directory, model.config, None)  # self-contained: the vocabulary travels with the weights
    # gpt2.json is written last: its presence marks a complete checkpoint.
    atomic_write_json(directory / NATIVE_META, {"format": NATIVE_FORMAT, "version": 1,
                                                "config": model.config.to_dict(), **(meta or {})})
    return str(directory)


def _save_tokenizer(directory: Path, config: GPTConfig, tokenizer) -> None:
    """Tokenizer files beside the weights: the given tokenizer, or GPT-2's when the vocabulary is GPT-2's."""
    if tokenizer is None and config.vocab_size == GPT2_VOCAB_SIZE:
        from gpt2.tokenizer import Tokenizer
        try:
            tokenizer = Tokenizer.gpt2()
        except TokenizerError as e:
            # The weights are complete without the vocabulary, so saving goes on, but says what is missing.
            warnings.warn(f"{directory}: saved without tokenizer files: {e}", stacklevel=3)
            return
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


# `gpt2 convert --to`: what each target is written by. "gpt2" is the old name of "ours".
CONVERT_TARGETS = ("hf", "ours", "gguf", "llmc")


def default_target(dst) -> str:
    """DST's suffix decides: .gguf gives gguf, .bin gives llmc, anything else a Hugging Face directory."""
    return {".gguf": "gguf", ".bin": "llmc"}.get(Path(dst).suffix, "hf")


def convert(src, dst, to: str | None = None, dtype=None, output_tensor: bool = True) -> str:
    """Any model we read (Hugging Face, ours, GGUF, llm.c, OpenAI TF) -> `to` (default_target).

    dtype: a DTYPES name for hf/ours; float32|float16|bfloat16|q8_0 for gguf; float32|bfloat16 for llmc.
    By default the source's dtype (float32 where the target cannot hold it). output_tensor: GGUF only.
    """
    from gpt2.formats import gguf, llmc
    fmt = detect_format(src)
    source = Path(src).expanduser() if fmt is not None else resolve_directory(src)  # a hub name downloads here
    to = "ours" if to == "gpt2" else (to or default_target(dst))
    if to not in CONVERT_TARGETS:
        raise ConfigError(f"convert target {to!r} is not one of {', '.join(CONVERT_TARGETS)}")
    if to in ("hf", "ours"):
        model = load_model(source, dtype=parse_dtype(dtype))
        return save_hf(model, dst) if to == "hf" else save_native(model, dst)
    model = load_model(source)
    source_dtype = str(model.transformer.wte.weight.dtype).removeprefix("torch.")
    tensors = _unpadded_state(model, "gpt2")
    if to == "gguf":
        name = Path(str(src).rstrip("/")).name
        return str(gguf.write(dst, model.config, tensors, dtype or source_dtype, output_tensor=output_tensor, name=name))
    default = source_dtype if source_dtype in llmc.VERSION_OF_DTYPE else "float32"  # llm.c has no float16
    return str(llmc.write(dst, model.config, tensors, dtype or default))


# ---------------------------------------------------------------------------------------------
# gpt2 info
# ---------------------------------------------------------------------------------------------

def describe_model(name_or_path: str) -> dict:
    """Config, parameter count, dtype and bytes, without loading any weights."""
    resolved = resolve_config(name_or_path)
    if resolved.directory is None:
        weights, dtype = "none (a preset: random init)", torch.float32
    elif resolved.layout not in ("gpt2", "hf"):
        return _describe_foreign(resolved)
    else:
        readers = _open_readers(resolved.directory)
        dtypes = {reader.dtype(k) for reader in readers for k in reader.keys() if not canonical_key(k).endswith(SKIPPED)}
        dtype = torch.float32 if len(dtypes) != 1 else dtypes.pop()
        layout = "gpt2 checkpoint" if resolved.layout == "gpt2" else "Hugging Face"
        weights = ", ".join(str(r.path.name) for r in readers) + f" ({layout})"
    with torch.device("meta"):
        parameters = GPT(resolved.config).num_parameters()
    return {
        "source": resolved.source,
        "weights": weights,
        "parameters": parameters,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": parameters * torch.empty(0, dtype=dtype).element_size(),
        "config": resolved.config.to_dict(),
    }


def _describe_foreign(resolved: ResolvedConfig) -> dict:
    """describe_model for a GGUF, llm.c or OpenAI TF checkpoint: its header; bytes are the files' sizes."""
    fmt = detect_format(resolved.directory)
    header = fmt.read_header(resolved.directory)
    files = sorted(resolved.directory.iterdir()) if resolved.directory.is_dir() else [resolved.directory]
    with torch.device("meta"):
        parameters = GPT(resolved.config).num_parameters()
    return {
        "source": resolved.source,
        "weights": f"{resolved.directory.name} ({fmt.NAME})",
        "parameters": parameters,
        "dtype": header.metadata["dtype"],
        "bytes": sum(f.stat().st_size for f in files if f.is_file()),
        "config": resolved.config.to_dict(),
    }
