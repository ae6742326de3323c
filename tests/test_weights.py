"""Weights interop: round trips with transformers, the hub cache, our checkpoints, and bad files.

    .venv/bin/pytest tests/test_weights.py -q
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from gpt2 import GPT, CheckpointError, GPTConfig
from gpt2.weights import describe_model, preset_name, resolve_config, save_native

from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


def sample_ids(n=11, batch=2, seed=0):
    return torch.randint(0, TINY["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return (a - b).abs().max().item()


def test_save_pretrained_loads_in_transformers_with_the_same_logits(tmp_path):
    model = GPT(GPTConfig(**TINY, n_inner=40)).eval()
    model.save_pretrained(tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = sample_ids()
    with torch.no_grad():
        assert max_diff(hf(idx).logits, model(idx)) <= 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["n_inner"] == 40 and config["model_type"] == "gpt2"


def test_save_pretrained_writes_gpt2_tokenizer_files_for_the_gpt2_vocabulary(tmp_path):
    pytest.importorskip("gpt2.tokenizer")
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8)).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "vocab.json").exists() and (tmp_path / "merges.txt").exists()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode("Hello world") == [15496, 995]


def test_native_checkpoint_round_trip_and_convert_cli(tmp_path, hf_model_dir):
    hf, directory = hf_model_dir(n_head=4, n_embd=32)
    idx = sample_ids()
    with torch.no_grad():
        expected = hf(idx).logits
    run = subprocess.run([sys.executable, "-m", "gpt2", "convert", str(directory), str(tmp_path / "ours"),
                          "--to", "ours"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "ours" / "gpt2.json").exists()
    ours = GPT.from_pretrained(tmp_path / "ours")
    run = subprocess.run([sys.executable, "-m", "gpt2", "convert", str(tmp_path / "ours"), str(tmp_path / "back"),
                          "--dtype", "bfloat16"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    assert back.transformer.wte.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert max_diff(ours(idx), expected) <= 1e-5
        assert max_diff(back.float()(idx).logits, expected) <= 0.1  # bf16 rounding of the weights


def test_run_directory_resolves_its_latest_checkpoint(tmp_path):
    model = GPT(GPTConfig(**TINY)).eval()
    save_native(model, tmp_path / "run" / "step_000010", meta={"step": 10})
    (tmp_path / "run" / "LATEST").write_text("step_000010\n")
    loaded = GPT.from_pretrained(tmp_path / "run")
    idx = sample_ids()
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def test_compile_prefix_is_stripped(tmp_path):
    model = GPT(GPTConfig(**TINY)).eval()
    save_native(model, tmp_path)
    tensors = {f"_orig_mod.{k}": v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(GPT.from_pretrained(tmp_path)(sample_ids()), model(sample_ids()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_option(hf_model_dir, dtype):
    hf, directory = hf_model_dir()
    model = GPT.from_pretrained(directory, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    with torch.no_grad():
        assert max_diff(model(sample_ids()).float(), hf(sample_ids()).logits) < 0.05


def test_sharded_safetensors_index(hf_model_dir, tmp_path):
    hf, _ = hf_model_dir()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert max_diff(GPT.from_pretrained(tmp_path / "sharded")(sample_ids()), hf(sample_ids()).logits) <= 1e-5


def test_pytorch_model_bin_is_loaded_weights_only(hf_model_dir, tmp_path):
    hf, directory = hf_model_dir()
    binary = tmp_path / "bin"
    binary.mkdir()
    shutil.copy(directory / "config.json", binary)
    # Old checkpoints: GPT2Model keys (no "transformer."), with the attn.bias mask buffers.
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    torch.save(state, binary / "pytorch_model.bin")
    with torch.no_grad():
        assert max_diff(GPT.from_pretrained(binary)(sample_ids()), hf(sample_ids()).logits) <= 1e-5


class NotATensor:
    pass


def test_pickled_code_in_a_bin_is_refused(hf_model_dir, tmp_path):
    _, directory = hf_model_dir()
    shutil.copy(directory / "config.json", tmp_path)
    torch.save({"transformer.wte.weight": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*weights-only"):
        GPT.from_pretrained(tmp_path)


def test_hub_name_resolves_through_an_offline_cache(hf_model_dir, tmp_path):
    hf, directory = hf_model_dir()
    snapshot = tmp_path / "hub" / "models--openai-community--gpt2" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(directory / name, snapshot / name)
    (tmp_path / "hub" / "models--openai-community--gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--openai-community--gpt2" / "refs" / "main").write_text("0123abcd")
    torch.save(sample_ids(), tmp_path / "idx.pt")
    script = textwrap.dedent(f"""
        import torch
        from gpt2 import GPT, CheckpointError
        idx = torch.load({str(tmp_path / 'idx.pt')!r})
        a = GPT.from_pretrained("gpt2")(idx)
        b = GPT.from_pretrained("openai-community/gpt2")(idx)
        torch.save(a.detach(), {str(tmp_path / 'out.pt')!r})
        assert torch.equal(a, b)
        try:
            GPT.from_pretrained("gpt2-medium")
        except CheckpointError as e:
            print("ERROR:", e)
    """)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    with torch.no_grad():
        assert max_diff(torch.load(tmp_path / "out.pt"), hf(sample_ids()).logits) <= 1e-5
    assert "ERROR: hub model 'openai-community/gpt2-medium': HF_HUB_OFFLINE is set" in run.stdout


# --- bad files -----------------------------------------------------------------------------------

def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        GPT.from_pretrained(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        GPT.from_pretrained(tmp_path)


def test_truncated_safetensors(hf_model_dir):
    _, directory = hf_model_dir()
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated"):
        GPT.from_pretrained(directory)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated"):
        GPT.from_pretrained(directory)


def test_corrupt_safetensors_header(hf_model_dir):
    _, directory = hf_model_dir()
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"\xff" * 12
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt safetensors header"):
        GPT.from_pretrained(directory)
    path.write_bytes(b"\x00" * 8 + b"\xff" * 8)
    with pytest.raises(CheckpointError, match=r"corrupt safetensors header"):
        GPT.from_pretrained(directory)


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text()) | changes
    (directory / "config.json").write_text(json.dumps(config))


def test_wrong_architecture_names_the_keys(hf_model_dir):
    _, directory = hf_model_dir()
    edit_config(directory, n_layer=3)
    with pytest.raises(CheckpointError, match=r"missing key 'transformer.h.2.ln_1.weight'"):
        GPT.from_pretrained(directory)
    edit_config(directory, n_layer=2, n_embd=32)
    with pytest.raises(CheckpointError, match=r"'transformer.h.0.attn.c_attn.weight' in model.safetensors has shape "
                                              r"\[16, 48\], expected \[32, 96\]"):
        GPT.from_pretrained(directory)


def test_replace_linear_gets_each_linear_once_as_read_and_the_tied_lm_head_last(hf_model_dir):
    """load_model(replace_linear=...) hands over each nn.Linear's weight and bias, as the plain load reads
    them, for the callback to put its own layer in place (quantize.load_for_inference packs them)."""
    hf, directory = hf_model_dir()
    reference = GPT.from_pretrained(directory)
    calls = []

    def replace(model, name, weight, bias):
        calls.append(name)
        expected = reference.get_submodule(name)
        assert torch.equal(weight, expected.weight)
        assert (bias is None) == (expected.bias is None) and (bias is None or torch.equal(bias, expected.bias))
        parent, _, attr = name.rpartition(".")
        layer = torch.nn.Linear(weight.size(1), weight.size(0), bias=bias is not None)
        layer.weight, layer.bias = torch.nn.Parameter(weight), None if bias is None else torch.nn.Parameter(bias)
        setattr(model.get_submodule(parent), attr, layer)

    model = GPT.from_pretrained(directory, replace_linear=replace)
    linears = [name for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(calls) == sorted(linears) and calls[-1] == "lm_head" and len(calls) == len(set(calls))
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # handed over tied
    idx = sample_ids()
    with torch.no_grad():
        assert torch.equal(model(idx), reference(idx))
    edit_config(directory, n_layer=3)  # strict as ever: the missing block is named, whatever was replaced
    with pytest.raises(CheckpointError, match=r"missing key 'transformer.h.2.ln_1.weight'"):
        GPT.from_pretrained(directory, replace_linear=replace)


def test_unexpected_keys_are_named(hf_model_dir):
    _, directory = hf_model_dir()
    edit_config(directory, n_layer=1)
    with pytest.raises(CheckpointError, match=r"unexpected key 'transformer.h.1.attn.c_attn.weight'"):
        GPT.from_pretrained(directory)


def test_bad_config_files(hf_model_dir):
    _, directory = hf_model_dir()
    edit_config(directory, add_cross_attention=True)
    with pytest.raises(CheckpointError, match="add_cross_attention=True"):
        GPT.from_pretrained(directory)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        GPT.from_pretrained(directory)


def test_cli_reports_errors_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "gpt2", "info", str(tmp_path / "missing")], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.startswith("gpt2 info: error: ") and "Traceback" not in run.stderr


# --- gpt2 info -----------------------------------------------------------------------------------

def test_info_on_presets_needs_no_weights():
    run = subprocess.run([sys.executable, "-m", "gpt2", "info", "gpt2-xl"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "1,557,611,200" in run.stdout


def test_info_on_a_directory_reads_only_headers(hf_model_dir):
    hf, directory = hf_model_dir()
    info = describe_model(str(directory))
    assert info["parameters"] == hf.num_parameters()
    assert info["bytes"] == hf.num_parameters() * 4 and info["dtype"] == "float32"


def test_one_rule_for_preset_or_directory(hf_model_dir, tmp_path, monkeypatch):
    """gpt2 info and gpt2 inspect both go through resolve_config: presets by name, anything else by path or hub."""
    assert preset_name("gpt2-xl") == preset_name("openai-community/gpt2-xl") == "gpt2-xl"
    assert preset_name("gpt2-huge") is None
    preset = resolve_config("openai-community/gpt2-medium")
    assert (preset.source, preset.directory, preset.config) == ("preset gpt2-medium", None, GPTConfig.preset("gpt2-medium"))
    hf, directory = hf_model_dir()
    resolved = resolve_config(directory)
    assert (resolved.directory, resolved.layout, resolved.config.n_embd) == (directory, "hf", hf.config.n_embd)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").symlink_to(directory)  # a local directory named like a preset is read as a directory
    assert preset_name("gpt2") is None and resolve_config("gpt2").layout == "hf"


def test_saving_without_a_vocabulary_warns(tmp_path, monkeypatch):
    from gpt2 import Tokenizer, TokenizerError

    def no_vocabulary(*args, **kwargs):
        raise TokenizerError("no GPT-2 vocabulary found")
    monkeypatch.setattr(Tokenizer, "gpt2", no_vocabulary)
    with pytest.warns(UserWarning, match="saved without tokenizer files: no GPT-2 vocabulary found"):
        save_native(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8)), tmp_path / "ckpt")
    assert GPT.from_pretrained(tmp_path / "ckpt").config.n_embd == 8  # the weights are complete without it


# --- memory --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_loading_774m_peaks_below_1_3x_the_weight_bytes(tmp_path):
    """Build a random gpt2-large directory, load it in a fresh process, and read that process's peak RSS."""
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2-large"))
    tensors = {}
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            shape = shape[::-1]  # Conv1D orientation, as transformers writes it
        tensors[name] = torch.full(shape, 0.01)
    weight_bytes = sum(t.numel() * 4 for t in tensors.values())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    del tensors
    (tmp_path / "config.json").write_text(json.dumps(GPTConfig.preset("gpt2-large").to_hf_dict()))
    # VmHWM is this process's own peak; ru_maxrss would inherit the parent's peak across fork + exec.
    script = ("import re, sys; from gpt2 import GPT; m = GPT.from_pretrained(sys.argv[1]); "
              "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) * 1024)")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    peak = int(run.stdout.split()[-1])
    print(f"peak RSS {peak / 2**30:.2f} GiB for {weight_bytes / 2**30:.2f} GiB of weights: {peak / weight_bytes:.3f}x")
    assert peak <= 1.3 * weight_bytes


def test_native_checkpoints_carry_the_gpt2_vocabulary(tmp_path):
    from gpt2 import Tokenizer
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8)).eval()
    save_native(model, tmp_path / "run" / "step_000001")
    (tmp_path / "run" / "LATEST").write_text("step_000001\n")
    assert (tmp_path / "run" / "step_000001" / "vocab.json").exists()
    tok = Tokenizer.from_pretrained(tmp_path / "run")
    text = "Hello world <3 ünïcödé"
    assert tok.encode(text) == Tokenizer.gpt2().encode(text) == transformers.AutoTokenizer.from_pretrained(
        tmp_path / "run" / "step_000001").encode(text)
