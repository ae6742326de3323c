"""OpenAI's original GPT-2 release (TensorFlow checkpoints), read in pure Python: TensorFlow is never needed.

    model = GPT.from_pretrained("models/124M")      # hparams.json, model.ckpt.index, model.ckpt.data-00000-of-00001
    gpt2 convert models/124M hf_dir                 # the directory openai/gpt-2's download_model.py writes

The files (facts from TensorFlow's tensor_bundle.proto and table/table_format.txt, LevelDB's table_format.md):
  hparams.json     {"n_vocab", "n_ctx", "n_embd", "n_head", "n_layer"}
  model.ckpt.index a LevelDB-format table (sorted string keys -> values):
                     data blocks: entries [shared varint][non_shared varint][value_len varint][key delta][value],
                       the key stored as its difference from the previous one, full keys at "restart points";
                       then the restart offsets (uint32 each) and their count (uint32);
                     after each block a 5-byte trailer: compression type (0 = none) + masked crc32c;
                     a 48-byte footer: metaindex handle, index handle (varint offset + size each), zero
                       padding, magic 0xdb4775248b80fb57; the index block maps keys to data-block handles.
                   Values are protocol buffers: under the empty key a BundleHeaderProto (num_shards,
                   endianness), under each tensor name a BundleEntryProto (dtype, shape, shard_id, offset,
                   size, crc32c of the tensor's bytes).
  model.ckpt.data-00000-of-00001   the raw little-endian tensors, one after another.

Every block's and every tensor's crc32c is checked. Names map onto ours: model/wte -> transformer.wte.weight,
model/h{i}/attn/c_attn/w -> transformer.h.{i}.attn.c_attn.weight, g/b -> weight/bias; the conv1d weights are
stored [1, in, out] and become nn.Linear's (out, in).
"""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import numpy as np
import torch

from gpt2.config import GPTConfig
from gpt2.errors import CheckpointError, ConfigError
from gpt2.formats import ForeignCheckpoint

NAME = "openai_tf"
HPARAMS = "hparams.json"
TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
BLOCK_TRAILER_BYTES = 5
# TensorFlow's DataType enum values (types.proto) for the dtypes a checkpoint of weights can hold.
TF_DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.int32, 9: torch.int64, 14: torch.bfloat16,
             19: torch.float16}


# ---------------------------------------------------------------------------------------------
# crc32c (Castagnoli), as TensorFlow and LevelDB compute and mask it
# ---------------------------------------------------------------------------------------------

CRC32C_POLY = 0x82F63B78  # the Castagnoli polynomial, bit-reflected
CRC_MASK_DELTA = 0xA282EAD8


@functools.lru_cache(maxsize=1)
def _crc_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (CRC32C_POLY if c & 1 else 0)
        table[i] = c
    return table


def _crc_bytes(state: int, data: memoryview | bytes) -> int:
    """The raw CRC register after feeding `data` byte by byte (no initial or final inversion)."""
    table = _crc_table().tolist()
    for b in bytes(data):
        state = table[(state ^ b) & 0xFF] ^ (state >> 8)
    return state


@functools.lru_cache(maxsize=8)
def _zero_shift_tables(n: int) -> list[list[int]]:
    """Four byte tables of the linear map "feed n zero bytes into the CRC register" (a GF(2) 32x32 matrix)."""
    table = _crc_table()
    images = np.array([1 << i for i in range(32)], dtype=np.uint32)  # the register's 32 basis states
    for _ in range(n):
        images = table[images & 0xFF] ^ (images >> 8)
    tables = []
    for p in range(4):
        t = np.zeros(256, dtype=np.uint32)
        for bit in range(8):
            t[1 << bit: 2 << bit] = t[: 1 << bit] ^ images[8 * p + bit]
        tables.append(t.tolist())
    return tables


def crc32c(data, lane_bytes: int = 4096) -> int:
    """crc32c of `data` (bytes-like). Large inputs run as parallel lanes in numpy, then are combined.

    The CRC register is linear over GF(2): the register after lanes A then B is shift(reg_A, len(B)) ^
    reg_B(started at 0). So the data is cut into K lanes of `lane_bytes`, every lane is fed one byte
    column at a time (vectorized over the K lanes), and the lanes are folded left to right with the
    "feed lane_bytes zeros" map. Same value as the byte-by-byte loop, ~6x faster (100 vs 16 MB/s here).
    """
    view = memoryview(data).cast("B")
    lanes = len(view) // lane_bytes
    if lanes < 16:
        return _crc_bytes(0xFFFFFFFF, view) ^ 0xFFFFFFFF
    table = _crc_table()
    columns = np.frombuffer(view[: lanes * lane_bytes], dtype=np.uint8).reshape(lanes, lane_bytes).T.copy()
    registers = np.zeros(lanes, dtype=np.uint32)
    registers[0] = 0xFFFFFFFF  # the initial inversion belongs to the first lane only
    for column in columns:     # (lanes,) bytes at one offset in every lane
        registers = table[(registers ^ column) & 0xFF] ^ (registers >> 8)
    t0, t1, t2, t3 = _zero_shift_tables(lane_bytes)
    state = 0
    for r in registers.tolist():
        state = t0[state & 0xFF] ^ t1[(state >> 8) & 0xFF] ^ t2[(state >> 16) & 0xFF] ^ t3[state >> 24] ^ r
    return _crc_bytes(state, view[lanes * lane_bytes:]) ^ 0xFFFFFFFF


def unmask_crc(masked: int) -> int:
    """LevelDB/TensorFlow store crc32c "masked" (rotated and offset) so a CRC of CRCs stays well behaved."""
    rotated = (masked - CRC_MASK_DELTA) & 0xFFFFFFFF
    return ((rotated >> 17) | (rotated << 15)) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# protocol buffer wire format (just what the two bundle messages need)
# ---------------------------------------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def proto_fields(buf: bytes) -> dict[int, list]:
    """field number -> its values (ints for varint/fixed fields, bytes for length-delimited ones)."""
    fields, pos = {}, 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(buf, pos)
        elif wire_type == 1:
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire_type == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire_type == 5:
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        if pos > len(buf):
            raise ValueError("truncated field")
        fields.setdefault(number, []).append(value)
    return fields


def _one(fields: dict, number: int, default=0):
    return fields.get(number, [default])[-1]


# ---------------------------------------------------------------------------------------------
# the LevelDB-format table in .index
# ---------------------------------------------------------------------------------------------

def _block_handle(buf: bytes, pos: int) -> tuple[tuple[int, int], int]:
    offset, pos = _varint(buf, pos)
    size, pos = _varint(buf, pos)
    return (offset, size), pos


def _read_block(data: bytes, handle: tuple[int, int], path: Path) -> bytes:
    offset, size = handle
    end = offset + size + BLOCK_TRAILER_BYTES
    if end > len(data):
        raise CheckpointError(f"{path}: truncated: a table block ends at byte {end}, the file has {len(data)}")
    contents, compression = data[offset:offset + size], data[offset + size]
    (masked,) = struct.unpack_from("<I", data, offset + size + 1)
    if unmask_crc(masked) != crc32c(data[offset:offset + size + 1]):
        raise CheckpointError(f"{path}: crc32c mismatch in the table block at byte {offset}: the file is corrupt")
    if compression != 0:
        raise CheckpointError(f"{path}: table block at byte {offset} is compressed (type {compression}); "
                              "only uncompressed tables (what TensorFlow writes for checkpoints) are supported")
    return contents


def _block_entries(block: bytes) -> list[tuple[bytes, bytes]]:
    """(key, value) pairs of one block, undoing the prefix compression."""
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * num_restarts  # entries stop where the restart array begins
    entries, key, pos = [], b"", 0
    while pos < end:
        shared, pos = _varint(block, pos)
        non_shared, pos = _varint(block, pos)
        value_len, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + non_shared]
        pos += non_shared
        entries.append((key, block[pos:pos + value_len]))
        pos += value_len
    return entries


def read_table(path: Path) -> dict[bytes, bytes]:
    """Every key -> value of a LevelDB-format table file (footer -> index block -> data blocks)."""
    data = path.read_bytes()
    if len(data) < FOOTER_BYTES:
        raise CheckpointError(f"{path}: {len(data)} bytes is too short for a table (48-byte footer)")
    (magic,) = struct.unpack_from("<Q", data, len(data) - 8)
    if magic != TABLE_MAGIC:
        raise CheckpointError(f"{path}: magic {magic:#x} is not the table magic {TABLE_MAGIC:#x}; "
                              "not a TensorFlow checkpoint index")
    try:
        footer = data[-FOOTER_BYTES:]
        _metaindex, pos = _block_handle(footer, 0)
        index_handle, _ = _block_handle(footer, pos)
        table = {}
        for _, handle in _block_entries(_read_block(data, index_handle, path)):
            for key, value in _block_entries(_read_block(data, _block_handle(handle, 0)[0], path)):
                table[key] = value
    except (ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: corrupt table ({e})") from None
    return table


# ---------------------------------------------------------------------------------------------
# reading a checkpoint directory
# ---------------------------------------------------------------------------------------------

def checkpoint_prefix(directory: Path) -> Path:
    """directory/model.ckpt, or the one *.index the directory holds."""
    if (directory / "model.ckpt.index").is_file():
        return directory / "model.ckpt"
    indexes = sorted(directory.glob("*.index"))
    if len(indexes) != 1:
        raise CheckpointError(f"{directory}: expected one TensorFlow checkpoint (*.index), found {len(indexes)}")
    return indexes[0].with_suffix("")


def matches(path: Path) -> bool:
    return path.is_dir() and (path / HPARAMS).is_file() and any(path.glob("*.index"))


def our_name(tf_name: str) -> str:
    """model/h3/attn/c_attn/w -> transformer.h.3.attn.c_attn.weight (names not under model/ pass unchanged)."""
    parts = tf_name.split("/")
    if parts[0] != "model":
        return tf_name
    parts[0] = "transformer"
    parts = [f"h.{p[1:]}" if p[:1] == "h" and p[1:].isdigit() else p for p in parts]
    parts[-1] = {"g": "weight", "b": "bias", "w": "weight"}.get(parts[-1], parts[-1])
    if parts[1] in ("wte", "wpe"):
        parts.append("weight")
    return ".".join(parts)


def read_config(directory: Path) -> GPTConfig:
    path = directory / HPARAMS
    try:
        h = json.loads(path.read_text())
        return GPTConfig(n_layer=h["n_layer"], n_head=h["n_head"], n_embd=h["n_embd"], n_positions=h["n_ctx"],
                         vocab_size=h["n_vocab"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    except KeyError as e:
        raise CheckpointError(f"{path}: missing field {e.args[0]!r}") from None
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def read_header(path) -> ForeignCheckpoint:
    """hparams.json as a config; no weights."""
    directory = Path(path)
    return ForeignCheckpoint(read_config(directory), {}, directory, NAME, {"dtype": "float32"})


def read(path) -> ForeignCheckpoint:
    directory = Path(path)
    config = read_config(directory)
    prefix = checkpoint_prefix(directory)
    index_path = prefix.with_name(prefix.name + ".index")
    table = read_table(index_path)
    if b"" not in table:
        raise CheckpointError(f"{index_path}: no bundle header (the entry under the empty key)")
    try:
        header = proto_fields(table.pop(b""))
        num_shards, endianness = _one(header, 1, 1), _one(header, 2)
    except ValueError as e:
        raise CheckpointError(f"{index_path}: corrupt bundle header ({e})") from None
    if endianness != 0:
        raise CheckpointError(f"{index_path}: a big-endian bundle; only little-endian is supported")
    shards = [prefix.with_name(f"{prefix.name}.data-{i:05d}-of-{num_shards:05d}") for i in range(num_shards)]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"{directory}: checkpoint data file(s) missing: {', '.join(missing)}")
    tensors = {}
    handles = [open(s, "rb") for s in shards]
    try:
        for key, value in table.items():
            tf_name = key.decode("utf-8", errors="replace")
            tensor = _read_tensor(tf_name, value, handles, index_path)
            name = our_name(tf_name)
            if tensor.ndim == 3 and tensor.shape[0] == 1:  # conv1d weight [1, in, out] -> nn.Linear (out, in)
                tensor = tensor[0].t().contiguous()
            tensors[name] = tensor
    finally:
        for h in handles:
            h.close()
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return ForeignCheckpoint(config, tensors, directory, NAME, {"dtype": "/".join(dtypes), "checkpoint": str(prefix)})


def _read_tensor(name: str, entry_bytes: bytes, shards: list, index_path: Path) -> torch.Tensor:
    """One tensor from its BundleEntryProto: dtype, shape, shard, offset, size, crc32c (checked)."""
    try:
        entry = proto_fields(entry_bytes)
        dims = proto_fields(_one(entry, 2, b"")).get(2, [])           # TensorShapeProto.dim
        shape = [_one(proto_fields(d), 1) for d in dims]                # Dim.size
        dtype_id, shard, offset, size = _one(entry, 1), _one(entry, 3), _one(entry, 4), _one(entry, 5)
        masked_crc = _one(entry, 6)
    except ValueError as e:
        raise CheckpointError(f"{index_path}: corrupt entry for tensor {name!r} ({e})") from None
    if 7 in entry:
        raise CheckpointError(f"{index_path}: tensor {name!r} is stored in slices (partitioned); not supported")
    if dtype_id not in TF_DTYPES:
        raise CheckpointError(f"{index_path}: tensor {name!r} has TensorFlow dtype {dtype_id}, not supported")
    if shard >= len(shards):
        raise CheckpointError(f"{index_path}: tensor {name!r} is in shard {shard}, the bundle has {len(shards)}")
    dtype = TF_DTYPES[dtype_id]
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    if size != nbytes:
        raise CheckpointError(f"{index_path}: tensor {name!r} has {size} bytes, its shape {shape} needs {nbytes}")
    f = shards[shard]
    f.seek(offset)
    raw = bytearray(f.read(size))
    if len(raw) != size:
        raise CheckpointError(f"{f.name}: truncated: tensor {name!r} needs bytes {offset}..{offset + size}")
    if crc32c(raw) != unmask_crc(masked_crc):
        raise CheckpointError(f"{f.name}: crc32c mismatch for tensor {name!r}: the data file is corrupt")
    return torch.frombuffer(raw, dtype=dtype).reshape(shape) if size else torch.zeros(shape, dtype=dtype)
