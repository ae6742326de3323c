"""Tests for the inference engine (engine.py, sampling.py, quantize.py) against references.

    .venv/bin/pytest tests/test_engine.py -q

References: Transformers' greedy `generate` on the same random model loaded through our loader; our own
uncached `generate_naive` for every sampler; each prompt run alone for batched rows; the tokenizer's
one-shot decode for streamed text; float32 logits for int8 quantization.
"""

from __future__ import annotations

import pytest
import torch

from gpt2 import GPT, ContextLengthError
from gpt2.engine import generate, generate_naive, stream
from gpt2.tokenizer import TextStream
from gpt2.errors import ConfigError

import conftest

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [12, 13], [301, 2, 2, 40]]  # different lengths: left padding


def save_hf_model(tmp_path, vocab_size=400, n_positions=160, seed=0, n_layer=2, n_embd=32):
    """A random-init Transformers GPT-2 saved to disk, and the same weights through our loader."""
    # initializer_range 0.2 spreads the logits so that greedy argmax has no near-ties at fp32 noise level.
    hf = conftest.save_hf_model(tmp_path, seed=seed, vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd,
                                n_layer=n_layer, n_head=4, initializer_range=0.2,
                                bos_token_id=None, eos_token_id=None)
    return hf, GPT.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_hf_model(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def model(models):
    return models[1]


def hf_greedy(hf, prompts, n):
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[:, P:].tolist()


# --- reference: Transformers --------------------------------------------------------------------

def test_greedy_matches_transformers_single_prompt(models):
    hf, model = models
    ours = generate(model, [PROMPTS[0]], max_new_tokens=120)
    assert len(ours[0]) == 120
    assert ours == hf_greedy(hf, [PROMPTS[0]], 120)


def test_greedy_matches_transformers_left_padded_batch(models):
    hf, model = models
    assert generate(model, PROMPTS, max_new_tokens=110) == hf_greedy(hf, PROMPTS, 110)


# --- reference: the uncached path, every sampler -----------------------------------------------------

SAMPLERS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.9, seed=1),
    "top_k": dict(temperature=1.0, top_k=8, seed=2),
    "top_p": dict(temperature=1.0, top_p=0.6, seed=3),
    "min_p": dict(temperature=1.2, min_p=0.1, seed=4),
    "repetition": dict(temperature=0.8, repetition_penalty=1.5, seed=5),
    "frequency_presence": dict(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.4, seed=6),
    "logit_bias": dict(temperature=0.0, logit_bias={7: 3.0, 11: -100.0}),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2),
    "all": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                frequency_penalty=0.1, presence_penalty=0.1, logit_bias={3: 1.0}, seed=7),
    "per_row_seeds": dict(temperature=1.0, top_k=20, seed=[10, 11, 12]),
}


@pytest.mark.parametrize("name", SAMPLERS)
def test_cached_equals_naive(model, name):
    kw = SAMPLERS[name]
    fast = generate(model, PROMPTS, max_new_tokens=40, **kw)
    assert fast == generate_naive(model, PROMPTS, max_new_tokens=40, **kw)
    assert all(len(r) == 40 for r in fast)


def test_samplers_change_the_output(model):
    """The reference comparison above would pass for a sampler that did nothing; these must not."""
    greedy = generate(model, PROMPTS, max_new_tokens=30)
    assert generate(model, PROMPTS, max_new_tokens=30, temperature=1.0, seed=0) != greedy
    biased = generate(model, PROMPTS, max_new_tokens=30, logit_bias={7: 100.0})
    assert all(set(r) == {7} for r in biased)
    rep = generate(model, PROMPTS, max_new_tokens=30, repetition_penalty=100.0)
    assert all(len(set(r)) == len(r) for r in rep)  # a huge penalty forbids any repeat (vocab 400 >> 30)
    assert generate(model, PROMPTS, max_new_tokens=30, temperature=5.0, top_k=1, seed=0) == greedy


def test_batched_rows_equal_each_prompt_alone(model):
    batched = generate(model, PROMPTS, max_new_tokens=50)
    assert batched == [generate(model, [p], max_new_tokens=50)[0] for p in PROMPTS]
    kw = dict(temperature=1.0, top_p=0.9)  # per-row generators: a row's draws ignore its batch mates
    batched = generate(model, PROMPTS, max_new_tokens=30, seed=[1, 2, 3], **kw)
    assert batched == [generate(model, [p], max_new_tokens=30, seed=[s], **kw)[0] for p, s in zip(PROMPTS, [1, 2, 3])]


def test_seed_determinism(model):
    kw = dict(max_new_tokens=30, temperature=1.0, top_k=50)
    assert generate(model, PROMPTS, seed=123, **kw) == generate(model, PROMPTS, seed=123, **kw)
    assert generate(model, PROMPTS, seed=123, **kw) != generate(model, PROMPTS, seed=124, **kw)
    greedy = generate(model, PROMPTS, max_new_tokens=20)
    assert generate(model, PROMPTS, max_new_tokens=20, seed=5) == greedy == generate(model, PROMPTS, max_new_tokens=20, seed=9)


# --- stopping ---------------------------------------------------------------------------------

def test_stop_token_ids_stop_each_row_on_its_own(model):
    full = generate(model, PROMPTS, max_new_tokens=30)
    stop = full[0][10]
    first = full[0].index(stop)
    out = generate(model, PROMPTS, max_new_tokens=30, stop_token_ids=[stop])
    assert out[0] == full[0][:first]  # the stop token itself is not output
    for o, f in zip(out[1:], full[1:]):
        assert o == (f[: f.index(stop)] if stop in f else f)
    assert generate_naive(model, PROMPTS, max_new_tokens=30, stop_token_ids=[stop]) == out


def test_eos_is_endoftext_for_gpt2_vocab(tmp_path):
    _, model = save_hf_model(tmp_path, vocab_size=50257, n_positions=64, n_embd=16, n_layer=1)
    favour_eot = {50256: 100.0}
    assert generate(model, [[1, 2]], max_new_tokens=5, logit_bias=favour_eot) == [[]]
    steps = stream(model, [[1, 2]], max_new_tokens=5, logit_bias=favour_eot)
    assert list(steps) == [[None]] and steps.finish_reasons == ["stop"]
    assert generate(model, [[1, 2]], max_new_tokens=5, ignore_eos=True, logit_bias=favour_eot) == [[50256] * 5]


def test_stream_yields_each_step_and_finish(model):
    steps = stream(model, PROMPTS, max_new_tokens=12)
    seen = []
    for i, step in enumerate(steps):
        assert len(step) == len(PROMPTS)
        assert not torch.is_inference_mode_enabled()  # the engine's inference mode never leaks into the caller
        seen.append(step)
        if i == 3:
            steps.finish(1)  # as an edge does on a stop string
    assert [[s[r] for s in seen if s[r] is not None] for r in (0, 2)] == [
        g for i, g in enumerate(generate(model, PROMPTS, max_new_tokens=12)) if i != 1]
    assert sum(s[1] is not None for s in seen) == 4
    assert steps.finish_reasons == ["length", "stop", "length"]


class CharDecoder:
    """A stand-in incremental decoder: id -> chr, so the expected text is obvious."""
    def push(self, ids):
        return "".join(chr(i) for i in ids)

    def flush(self):
        return ""


def test_text_stream_trims_stop_strings_and_holds_back_prefixes():
    text = TextStream(CharDecoder(), stop=["END", "\n\n"])
    chunks = [text.push([ord(c)]) for c in "hello E"]
    assert "".join(chunks) == "hello " and not text.stopped  # "E" may begin "END": held back
    assert text.push([ord("x")]) == "Ex"                      # it did not
    assert text.push([ord(c) for c in "yz\n"]) == "yz"
    assert text.push([ord("\n"), ord("w")]) == "" and text.stopped
    assert text.text == "hello Exyz" and text.push([ord("q")]) == "" and text.flush() == ""
    plain = TextStream(CharDecoder(), stop=["END"])
    assert plain.push([ord(c) for c in "abEN"]) == "ab" and plain.flush() == "EN"  # no match: all shown


# --- context limit ----------------------------------------------------------------------------

def test_context_limit_error_and_left_truncation(model):
    n_pos = model.config.n_positions  # 160
    long = [(i * 7) % 400 for i in range(150)]
    with pytest.raises(ContextLengthError, match="context length"):
        generate(model, [long], max_new_tokens=20)
    out = generate(model, [long], max_new_tokens=20, truncate="left")
    assert out == generate(model, [long[150 + 20 - n_pos:]], max_new_tokens=20)
    with pytest.raises(ConfigError):
        generate(model, [[]], max_new_tokens=5)
    with pytest.raises(ConfigError):
        generate(model, [[400]], max_new_tokens=5)  # outside the vocabulary


# --- text edge: streamed text equals the full decode --------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from gpt2.tokenizer import Tokenizer
    return Tokenizer.gpt2()  # the vocabulary ships with a dependency: a failure here is a bug, not a skip


def test_streamed_text_equals_full_decode(tmp_path, tokenizer):
    _, model = save_hf_model(tmp_path, vocab_size=50257, n_positions=128, n_embd=16, n_layer=1)
    prompts = [tokenizer.encode("Hello, my dog"), tokenizer.encode("Caf\u00e9 \u2603 \U0001f600")]
    kw = dict(max_new_tokens=60, temperature=1.0, seed=0)
    full = generate(model, prompts, **kw)
    texts = [TextStream(tokenizer.stream_decoder()) for _ in prompts]
    chunks = [[] for _ in prompts]
    for step in stream(model, prompts, **kw):
        for i, t in enumerate(step):
            chunks[i].append(texts[i].push(t))
    for i, t in enumerate(texts):
        chunks[i].append(t.flush())
        assert "".join(chunks[i]) == tokenizer.decode(full[i])


def test_cli_generate_stream_equals_plain(tmp_path, tokenizer, capsys):
    from gpt2.cli import main
    _, model = save_hf_model(tmp_path, vocab_size=50257, n_positions=128, n_embd=16, n_layer=1)
    model.save_pretrained(tmp_path / "m")
    base = ["generate", "--model", str(tmp_path / "m"), "Once upon a time", "--max-new-tokens", "20",
            "--temperature", "0.9", "--seed", "3", "--num-samples", "2", "--device", "cpu"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--stream"]) == 0
    assert capsys.readouterr().out == plain and plain.count("Once upon a time") == 2
    assert main(base + ["--max-new-tokens", "125"]) == 2
    assert "context length" in capsys.readouterr().err
    assert main(base + ["--max-new-tokens", "125", "--truncate", "left"]) == 0
    capsys.readouterr()
    assert main(base + ["--kv-dtype", "bfloat16"]) == 0 and capsys.readouterr().out.count("Once upon a time") == 2


# --- precision --------------------------------------------------------------------------------

def test_a_bfloat16_kv_cache_rounds_keys_and_values_only(model):
    """GPT.kv_dtype (load_for_inference's kv_dtype): every cache the model makes holds bf16; the logits
    of a prefill and of each decode step stay within bf16's rounding of the float32 cache's, and greedy
    decoding of the batch (left padding included) keeps the same tokens, eager and compiled."""
    import copy
    from gpt2.kv_cache import BatchKV, KVCache
    bf = copy.deepcopy(model)
    bf.kv_dtype = torch.bfloat16
    assert KVCache.for_model(bf, 1, 8).k[0].dtype == torch.bfloat16
    assert KVCache.for_model(model, 1, 8).k[0].dtype == torch.float32
    assert BatchKV.for_model(bf, 2).dtype == torch.bfloat16
    ids = torch.tensor([PROMPTS[0] * 3])  # (1, 21)
    with torch.inference_mode():
        logits = []
        for m in (model, bf):
            cache = KVCache.for_model(m, 1, ids.size(1))
            out = [m(ids[:, :12], cache=cache)]  # prefill: attends to the rounded keys as well
            out += [m(ids[:, t:t + 1], cache=cache) for t in range(12, ids.size(1))]
            logits.append(torch.cat(out, dim=1))
    exact, rounded = logits
    torch.testing.assert_close(exact, model(ids))  # the float32 cache is the uncached forward
    difference = (rounded - exact).abs().max()
    assert 0 < difference < 2e-2 * exact.abs().max()  # bf16 keeps 8 bits; measured 0.7% of the range
    reference = generate(model, PROMPTS, max_new_tokens=12)
    assert generate(bf, PROMPTS, max_new_tokens=12) == reference
    assert generate(bf, PROMPTS, max_new_tokens=12, compile=True) == reference


def test_bfloat16_logits_track_float32(model):
    import copy
    ids = torch.tensor([PROMPTS[0] * 3])
    bf = copy.deepcopy(model).to(torch.bfloat16)
    with torch.inference_mode():
        ref, out = model(ids), bf(ids).float()
    assert out.dtype == torch.float32 and bf.lm_head.weight.dtype == torch.bfloat16
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    # Packed, fused and quantized linears (load_for_inference): tests/test_kernels.py.


@pytest.mark.slow
def test_compiled_decode_equals_uncompiled(model):
    """compile=True: one torch.compile'd fixed-shape step (compiling takes a while on CPU; one shape only)."""
    sampled = dict(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=[3, 4, 5])
    for kw in ({}, sampled):  # same batch and capacity: the second run reuses the compiled graph
        assert (generate(model, PROMPTS, max_new_tokens=40, compile=True, **kw)
                == generate(model, PROMPTS, max_new_tokens=40, **kw))


@pytest.mark.slow
def test_one_compiled_graph_serves_every_length(model):
    """The attended length and the cache's capacity are dynamic sizes: requests of any length reuse
    the first request's graph (a recompile under skip_guard_eval_unsafe would raise), and equal eager."""
    import copy
    from torch._dynamo.utils import counters
    own = copy.deepcopy(model)  # its own compiled step, so the count below is this test's alone
    generate(own, [[1, 2, 3]], max_new_tokens=3, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    for prompt, n in (([5] * 20, 40), ([7, 8], 1), ([9], 2), (list(range(30, 90)), 63)):
        assert generate(own, [prompt], max_new_tokens=n, compile=True) == generate(own, [prompt], max_new_tokens=n)
    assert counters["stats"]["unique_graphs"] == graphs


def test_static_decode_step_eager_equals_model_forward(model, monkeypatch):
    """The step compile=True compiles, run eagerly: attends over the written slots of the padded cache."""
    from gpt2 import engine
    from gpt2.engine import StaticDecode, decode_step, left_pad
    monkeypatch.setattr(engine, "compiled_decode_step", lambda model: decode_step)  # eager
    from gpt2.kv_cache import KVCache
    P, N = max(len(p) for p in PROMPTS), 5
    capacity = P + N + 7  # slots to spare: the step must attend to the written ones only
    with torch.inference_mode():
        idx, mask = left_pad(PROMPTS, P + N)
        ref_cache, cache = KVCache.for_model(model, 3, P + N - 1), KVCache.for_model(model, 3, capacity)
        model(idx, cache=ref_cache, attention_mask=mask[:, :P])
        model(idx, cache=cache, attention_mask=mask[:, :P])
        step = StaticDecode(model, PROMPTS, mask, capacity)
        ids = torch.tensor([7, 8, 9])
        for t in range(N - 1):
            ref = model(ids.view(3, 1), cache=ref_cache, attention_mask=mask[:, : P + t + 1])[:, -1]
            torch.testing.assert_close(step(ids, cache), ref, rtol=1e-5, atol=1e-5)
            ids = ref.argmax(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_equals_cpu(models):
    _, model = models
    import copy
    gpu = copy.deepcopy(model).cuda()
    assert generate(gpu, PROMPTS, max_new_tokens=30) == generate(model, PROMPTS, max_new_tokens=30)
