"""Foreign formats against independent readers: GGUF (gguf-py's GGUFReader, Transformers' GGUF loader),
llm.c (its layout read back with numpy, tiktoken's token bytes), OpenAI's TensorFlow release (a fixture
written and read back by TensorFlow, with TensorFlow's logits), and their bad files.

    .venv/bin/pytest tests/test_formats.py -q

The fixture tests/fixtures/openai_tf was made once by tests/fixtures/make_openai_tf_fixture.py (needs
TensorFlow; never run here).
"""

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from gpt2 import GPT, CheckpointError, GPTConfig
from gpt2.cli import main as cli
from gpt2.formats import detect, llmc, openai_tf
from gpt2.weights import describe_model, resolve_config

gguf = pytest.importorskip("gguf")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# A small model with GPT-2's first 500 ids as its vocabulary (a GGUF then holds those tokens and the merges
# that make them; 500 is not a multiple of 128, so llm.c pads it to 512) and GPT-2's context (Transformers'
# GGUF loader sets n_ctx, not n_positions, so its model always has 1024 positions). Widths are multiples
# of 32 so that every weight row quantizes to Q8_0. The tokenizer fields are checked on a full vocabulary.
SMALL = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=500)
GGUF_DTYPES = ("float32", "float16", "bfloat16", "q8_0")
GGML_TYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "q8_0": "Q8_0"}


def max_diff(a, b):
    return (a - b).abs().max().item()


def logits(model, idx):
    with torch.no_grad():
        return model.float()(idx)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(model, its Hugging Face directory, token ids): the source of every conversion below."""
    directory = tmp_path_factory.mktemp("formats") / "hf"
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL)).eval()
    model.save_pretrained(directory)
    idx = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    return model, directory, idx


@pytest.fixture(scope="module")
def gguf_files(small):
    """dtype -> a GGUF written by `gpt2 convert SRC DST.gguf --dtype dtype`."""
    _, directory, _ = small
    files = {}
    for dtype in GGUF_DTYPES:
        files[dtype] = directory.parent / f"small-{dtype}.gguf"
        assert cli(["convert", str(directory), str(files[dtype]), "--dtype", dtype]) == 0
    return files


def rounded_like_gguf(model: GPT, dtype: str) -> GPT:
    """A copy of `model` whose 2-D weights (not position_embd) went through `dtype` and back, computed here
    from the types' definitions (Q8_0: blocks of 32 along a row, scale max|x|/127 stored as float16)."""
    copy = GPT(model.config).eval()
    copy.load_state_dict(model.state_dict())
    for name, p in copy.named_parameters():
        if p.ndim != 2 or name == "transformer.wpe.weight":
            continue
        if dtype in ("float16", "bfloat16"):
            p.data = p.data.to(getattr(torch, dtype)).float()
        elif dtype == "q8_0":
            blocks = p.data.reshape(-1, 32)
            scale = blocks.abs().amax(dim=1, keepdim=True) / 127
            q = blocks * torch.where(scale == 0, 0, 1 / scale)  # ggml multiplies by the reciprocal
            q = torch.sign(q) * torch.floor(q.abs() + 0.5)      # C roundf: halves away from zero
            p.data = (q * scale.half().float()).reshape(p.shape)
    return copy


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", GGUF_DTYPES)
def test_gguf_names_types_and_shapes_read_by_gguf_py(small, gguf_files, dtype):
    model, _, _ = small
    reader = gguf.GGUFReader(gguf_files[dtype])
    tensors = {t.name: t for t in reader.tensors}
    C, L, V = model.config.n_embd, model.config.n_layer, model.config.vocab_size
    expected = {"token_embd.weight": [C, V], "output.weight": [C, V], "position_embd.weight": [C, 1024],
                "output_norm.weight": [C], "output_norm.bias": [C]}
    for i in range(L):
        expected |= {f"blk.{i}.attn_norm.weight": [C], f"blk.{i}.attn_norm.bias": [C],
                     f"blk.{i}.attn_qkv.weight": [C, 3 * C], f"blk.{i}.attn_qkv.bias": [3 * C],
                     f"blk.{i}.attn_output.weight": [C, C], f"blk.{i}.attn_output.bias": [C],
                     f"blk.{i}.ffn_norm.weight": [C], f"blk.{i}.ffn_norm.bias": [C],
                     f"blk.{i}.ffn_up.weight": [C, 4 * C], f"blk.{i}.ffn_up.bias": [4 * C],
                     f"blk.{i}.ffn_down.weight": [4 * C, C], f"blk.{i}.ffn_down.bias": [C]}
    assert {n: [int(s) for s in t.shape] for n, t in tensors.items()} == expected  # ggml order: ne = (in, out)
    for name, t in tensors.items():
        kept_f32 = len(expected[name]) == 1 or name == "position_embd.weight"
        assert t.tensor_type.name == ("F32" if kept_f32 else GGML_TYPE[dtype]), name
    file_type = {"float32": "ALL_F32", "float16": "MOSTLY_F16", "bfloat16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType[file_type[dtype]]


def test_gguf_metadata_and_tokenizer_fields(tmp_path):
    directory, path = tmp_path / "hf", tmp_path / "full.gguf"
    GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, n_positions=16, n_inner=96)).save_pretrained(directory)
    assert cli(["convert", str(directory), str(path)]) == 0
    reader = gguf.GGUFReader(path)
    field = lambda key: reader.get_field(key).contents()
    assert field("general.architecture") == "gpt2"
    assert field("general.quantization_version") == gguf.GGML_QUANT_VERSION
    assert (field("gpt2.context_length"), field("gpt2.embedding_length"), field("gpt2.feed_forward_length"),
            field("gpt2.block_count"), field("gpt2.attention.head_count")) == (16, 32, 96, 1, 2)
    assert field("gpt2.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    assert field("tokenizer.ggml.bos_token_id") == field("tokenizer.ggml.eos_token_id") == 50256
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    assert field("tokenizer.ggml.tokens") == hf_tokenizer.convert_ids_to_tokens(list(range(50257)))
    types = field("tokenizer.ggml.token_type")
    assert types[50256] == gguf.TokenType.CONTROL and set(types[:50256]) == {gguf.TokenType.NORMAL}
    merges = (directory / "merges.txt").read_text().splitlines()[1:]
    assert field("tokenizer.ggml.merges") == merges and len(merges) == 50000
    assert GPT.from_pretrained(path).config.n_inner == 96


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q8_0"])
def test_gguf_logits_equal_transformers_gguf_loader(small, gguf_files, dtype):
    model, _, idx = small
    path = gguf_files[dtype]
    hf = transformers.GPT2LMHeadModel.from_pretrained(path.parent, gguf_file=path.name).eval()
    ours = GPT.from_pretrained(path)
    with torch.no_grad():
        hf_logits = hf(idx).logits
    assert max_diff(logits(ours, idx), hf_logits) <= 1e-5
    # ... and both are the source model with its weights rounded as the type defines.
    assert max_diff(logits(rounded_like_gguf(model, dtype), idx), hf_logits) <= 1e-5
    if dtype == "float32":
        assert max_diff(logits(model, idx), hf_logits) <= 1e-5


def test_gguf_float16_round_trip_and_output_tensor(small, gguf_files, tmp_path):
    model, directory, idx = small
    assert max_diff(logits(GPT.from_pretrained(gguf_files["float16"]), idx),
                    logits(rounded_like_gguf(model, "float16"), idx)) <= 1e-5
    path = tmp_path / "no-output.gguf"
    assert cli(["convert", str(directory), str(path), "--no-output-tensor"]) == 0
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    back = GPT.from_pretrained(path)
    assert back.config == model.config
    assert max_diff(logits(back, idx), logits(model, idx)) == 0


def test_gguf_row_not_divisible_by_32_falls_back_to_f16_like_llama_cpp(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=8, vocab_size=64)).eval()  # rows of 16
    path = tmp_path / "narrow.gguf"
    model.save_pretrained(tmp_path / "hf")
    assert cli(["convert", str(tmp_path / "hf"), str(path), "--dtype", "q8_0"]) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_qkv.weight"] == "F16" and types["blk.0.ffn_down.weight"] == "Q8_0"  # 64 per row


# ---------------------------------------------------------------------------------------------
# llm.c
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,version", [("float32", 3), ("bfloat16", 5)])
def test_llmc_layout_and_round_trip(small, tmp_path, tik, dtype, version):
    model, directory, idx = small
    path = tmp_path / f"model_{dtype}.bin"
    assert cli(["convert", str(directory), str(path), "--dtype", dtype]) == 0
    # The header and the layout, read back with numpy alone.
    header = np.fromfile(path, dtype="<i4", count=256)
    C, L, V, Vp = 32, 2, 500, 512
    assert header[:8].tolist() == [20240326, version, 1024, V, L, 2, C, Vp] and not header[8:].any()
    n_params = Vp * C + 1024 * C + L * (12 * C * C + 13 * C) + 2 * C
    assert path.stat().st_size == 1024 + n_params * (4 if version == 3 else 2)
    raw = torch.from_numpy(np.fromfile(path, dtype="<i2" if version == 5 else "<f4", offset=1024).copy())
    values = raw.view(torch.bfloat16).float() if version == 5 else raw
    wte = values[: Vp * C].view(Vp, C)
    assert torch.equal(wte[:V], model.transformer.wte.weight.detach().to(getattr(torch, dtype)).float())
    assert not wte[V:].any()  # zero padding rows
    stacked_ln1 = values[Vp * C + 1024 * C:][: L * C].view(L, C)  # then ln_1.weight of every layer
    assert torch.equal(stacked_ln1[1], model.transformer.h[1].ln_1.weight.detach().to(getattr(torch, dtype)).float())
    # Back: padding dropped, logits equal (bf16: the source with every weight rounded to bf16).
    back = GPT.from_pretrained(path, dtype=torch.float32)
    assert back.config == model.config
    reference = GPT(model.config).eval()
    reference.load_state_dict({k: v.to(getattr(torch, dtype)).float() for k, v in model.state_dict().items()})
    assert max_diff(logits(back, idx), logits(reference, idx)) <= (0 if version == 3 else 1e-5)
    # gpt2_tokenizer.bin beside it: tiktoken's bytes for every id.
    tokens, eot = llmc.read_tokenizer(tmp_path / "gpt2_tokenizer.bin")
    assert eot == 50256 and tokens == [tik.decode_single_token_bytes(i) for i in range(50257)]


def test_llmc_to_hf_through_the_cli(small, tmp_path):
    model, directory, idx = small
    assert cli(["convert", str(directory), str(tmp_path / "m.bin")]) == 0     # .bin -> llm.c
    assert cli(["convert", str(tmp_path / "m.bin"), str(tmp_path / "hf")]) == 0  # foreign -> Hugging Face
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert max_diff(hf(idx).logits, logits(model, idx)) <= 1e-5


def test_convert_to_defaults_from_the_destination(small, tmp_path):
    """.gguf -> GGUF, .bin -> llm.c, anything else -> a Hugging Face directory (even from one)."""
    _, directory, _ = small
    assert cli(["convert", str(directory), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / "out" / "gpt2.json").exists()
    assert detect(tmp_path / "out") is None  # a Hugging Face directory, no foreign format


def test_generate_takes_a_gguf_or_llmc_file_as_its_model(tmp_path, capsys):
    """--model FILE: the tokenizer comes with it (GPT-2's), and the greedy text is the source directory's."""
    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=50257, n_positions=64, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path / "hf")
    for name in ("m.gguf", "m.bin"):
        assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / name)]) == 0
    capsys.readouterr()
    texts = []
    for model in (tmp_path / "hf", tmp_path / "m.gguf", tmp_path / "m.bin"):
        assert cli(["generate", "--model", str(model), "Once upon a time", "--max-new-tokens", "12",
                    "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0].strip() and texts[1] == texts[0] and texts[2] == texts[0]


# ---------------------------------------------------------------------------------------------
# OpenAI's TensorFlow release
# ---------------------------------------------------------------------------------------------

def test_openai_tf_fixture_matches_tensorflow():
    expected = np.load(FIXTURES / "openai_tf_expected.npz", allow_pickle=False)  # what TensorFlow read and computed
    model = GPT.from_pretrained(FIXTURES / "openai_tf")
    assert (model.config.n_layer, model.config.n_embd, model.config.vocab_size, model.config.n_positions) == (2, 8, 16, 8)
    state = model.state_dict()
    for tf_name in expected.files:
        if tf_name.startswith("model/"):
            value = torch.from_numpy(expected[tf_name])
            value = value[0].t() if value.ndim == 3 else value  # conv1d [1, in, out] -> (out, in)
            assert torch.equal(state[openai_tf.our_name(tf_name)], value), tf_name
    out = logits(model, torch.from_numpy(expected["idx"])[None])[0]
    assert max_diff(out, torch.from_numpy(expected["logits"])) <= 1e-5


def test_openai_tf_tampered_data_fails_its_crc(tmp_path):
    with pytest.raises(CheckpointError, match=r"model\.ckpt\.data-00000-of-00001: crc32c mismatch for tensor"):
        GPT.from_pretrained(FIXTURES / "openai_tf_tampered")


def test_crc32c():
    assert openai_tf.crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    data = np.random.default_rng(0).integers(0, 256, 200_003, dtype=np.uint8).tobytes()
    assert openai_tf.crc32c(data) == openai_tf.crc32c(data, lane_bytes=len(data))  # lanes == byte by byte


# ---------------------------------------------------------------------------------------------
# detection, info, inspect, bad files
# ---------------------------------------------------------------------------------------------

def test_every_format_is_detected_by_info_and_resolve_config(small, gguf_files, tmp_path):
    model, directory, _ = small
    llmc.write(tmp_path / "m.bin", model.config, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    for path, name in [(gguf_files["q8_0"], "gguf"), (tmp_path / "m.bin", "llmc"), (FIXTURES / "openai_tf", "openai_tf")]:
        assert detect(path).NAME == name
        assert resolve_config(path).layout == name
    assert describe_model(gguf_files["q8_0"])["dtype"] == "Q8_0"
    assert describe_model(tmp_path / "m.bin")["config"] == model.config.to_dict()
    assert detect(directory) is None


def load_error(path):
    with pytest.raises(CheckpointError) as e:
        GPT.from_pretrained(path)
    assert str(path) in str(e.value)
    return str(e.value)


def test_bad_gguf_files(gguf_files, tmp_path):
    data = gguf_files["float32"].read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
    assert "truncated" in load_error(tmp_path / "truncated.gguf")
    (tmp_path / "short.gguf").write_bytes(data[:1000])  # inside the metadata
    assert "truncated" in load_error(tmp_path / "short.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    assert "not a GGUF file" in load_error(tmp_path / "magic.gguf")
    # A type we do not read (Q4_0), in a file the gguf package writes.
    writer = gguf.GGUFWriter(tmp_path / "q4.gguf", "gpt2")
    for key, value in [("block_count", 1), ("context_length", 8), ("embedding_length", 32),
                       ("feed_forward_length", 128), ("attention.head_count", 2)]:
        writer.add_uint32(f"gpt2.{key}", value)
    writer.add_float32("gpt2.attention.layer_norm_epsilon", 1e-5)
    weights = np.zeros((16, 32), dtype=np.float32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    assert "'token_embd.weight' has type Q4_0" in load_error(tmp_path / "q4.gguf")


def test_bad_llmc_files(small, tmp_path):
    model, directory, _ = small
    good = tmp_path / "good.bin"
    assert cli(["convert", str(directory), str(good), "--dtype", "bfloat16"]) == 0
    data = bytearray(good.read_bytes())
    data[4:8] = np.int32(4).tobytes()
    (tmp_path / "version.bin").write_bytes(data)
    assert "version 4 is not supported" in load_error(tmp_path / "version.bin")
    (tmp_path / "short.bin").write_bytes(good.read_bytes()[:-2])
    assert "needs" in load_error(tmp_path / "short.bin") and "truncated" in load_error(tmp_path / "short.bin")
    assert "tokenizer file" in load_error(tmp_path / "gpt2_tokenizer.bin")


def test_convert_refuses_a_dtype_the_target_cannot_hold(small, tmp_path, capsys):
    _, directory, _ = small
    assert cli(["convert", str(directory), str(tmp_path / "x.bin"), "--dtype", "q8_0"]) == 2
    assert "llm.c checkpoints are float32 (version 3) or bfloat16 (version 5)" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists()
