"""The model against transformers.GPT2LMHeadModel at random init, loaded through the production loader.

    .venv/bin/pytest tests/test_model.py -q

Compared: eval logits, the loss, every parameter's gradient, dropout placement (train-mode outputs
replayed draw for draw against Transformers' eager attention), KV-cache decoding against the full
sequence, left-padded batches, parameter counts of the four presets, and the init.
"""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from gpt2 import GPT, ContextLengthError, GPTConfig, KVCache
from gpt2.config import PRESETS
from gpt2.errors import ConfigError
from gpt2.model import lm_head_cross_entropy
from gpt2.weights import is_transposed

from conftest import TINY, make_hf_model

TINY_CONFIGS = {
    "base": {},
    "odd_heads_3": dict(n_head=3, n_embd=24),
    "odd_heads_5": dict(n_layer=3, n_head=5, n_embd=40),
    "n_inner": dict(n_inner=40),
    "inverse_layer_idx": dict(n_layer=3, scale_attn_by_inverse_layer_idx=True),
    "reorder_and_upcast": dict(reorder_and_upcast_attn=True),
    "no_scale": dict(scale_attn_weights=False),
    "gelu_exact": dict(activation_function="gelu"),
}


def load_pair(hf_model_dir, seed=0, **config):
    hf, directory = hf_model_dir(seed=seed, **config)
    return hf, GPT.from_pretrained(directory)


def shifted_targets(idx):
    """targets[t] = idx[t+1], the last position ignored: the loss Transformers computes from labels=idx."""
    return torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], dim=1)


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_logits_loss_and_gradients_match_transformers(hf_model_dir, name):
    hf, model = load_pair(hf_model_dir, **TINY_CONFIGS[name])
    idx = torch.randint(0, TINY["vocab_size"], (3, 33), generator=torch.Generator().manual_seed(1))

    logits = model(idx)
    assert logits.shape == (3, 33, TINY["vocab_size"])
    hf_out = hf(idx, labels=idx)
    assert (logits - hf_out.logits).abs().max().item() <= 1e-5

    loss = model(idx, targets=shifted_targets(idx))
    assert abs(loss.item() - hf_out.loss.item()) <= 1e-6
    loss.backward()
    hf_out.loss.backward()
    hf_params = dict(hf.named_parameters())
    ours = dict(model.named_parameters())
    assert set(ours) == set(hf_params)  # same names: loading needs a transpose, never a rename
    for key, param in ours.items():
        expected = hf_params[key].grad
        grad = param.grad.t() if is_transposed(key) else param.grad
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=f"gradient of {key}")


def test_gpt2_124m_preset_matches_transformers(tmp_path):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(attn_implementation="eager")).eval()
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(tmp_path)
    assert model.config == GPTConfig.preset("gpt2")
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_out = hf(idx, labels=idx)
        diff = (model(idx) - hf_out.logits).abs().max().item()
        loss = model(idx, targets=shifted_targets(idx)).item()
    assert diff <= 1e-4, diff
    assert abs(loss - hf_out.loss.item()) <= 1e-5


@pytest.mark.parametrize("preset,count", [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
                                          ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_preset_parameter_counts(preset, count):
    with torch.device("meta"):
        ours = GPT(GPTConfig.preset(preset)).num_parameters()
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**PRESETS[preset])).num_parameters()
    assert ours == theirs == count


# --- dropout -------------------------------------------------------------------------------------

DROPOUT_SITES = {
    "embedding": dict(embd_pdrop=0.5, attn_pdrop=0.0, resid_pdrop=0.0),
    "attention_probs": dict(embd_pdrop=0.0, attn_pdrop=0.5, resid_pdrop=0.0),
    "residual_attn_and_mlp": dict(embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.5),
    "all": dict(embd_pdrop=0.3, attn_pdrop=0.2, resid_pdrop=0.4),
}


def use_explicit_attention(model):
    for block in model.transformer.h:
        block.attn.use_sdpa = False


@pytest.mark.parametrize("site", DROPOUT_SITES)
def test_dropout_sites_replay_transformers_draw_for_draw(hf_model_dir, site):
    """In training, the same seed must give Transformers' exact output: every mask is drawn at the same
    place, in the same order, with the same shape. A missing, extra or moved dropout breaks this."""
    hf, model = load_pair(hf_model_dir, **DROPOUT_SITES[site])
    use_explicit_attention(model)
    hf.train()
    model.train()
    idx = torch.randint(0, TINY["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(1234)
    ours = model(idx)
    torch.manual_seed(1234)
    theirs = hf(idx).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    # The comparison is meaningful only if dropout changed something.
    with torch.no_grad():
        assert (ours - model.eval()(idx)).abs().max().item() > 1e-3


def test_dropout_is_identity_in_eval(hf_model_dir):
    hf, model = load_pair(hf_model_dir, embd_pdrop=0.5, attn_pdrop=0.5, resid_pdrop=0.5)
    idx = torch.randint(0, TINY["vocab_size"], (2, 17))
    with torch.no_grad():
        first, second = model(idx), model(idx)
        assert torch.equal(first, second)
        assert (first - hf(idx).logits).abs().max().item() <= 1e-5


def test_dropout_modules_sit_at_the_four_places():
    model = GPT(GPTConfig(**TINY, embd_pdrop=0.1, attn_pdrop=0.2, resid_pdrop=0.3))
    found = {name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    expected = {"transformer.drop": 0.1}
    for i in range(TINY["n_layer"]):
        expected |= {f"transformer.h.{i}.attn.attn_dropout": 0.2, f"transformer.h.{i}.attn.resid_dropout": 0.3,
                     f"transformer.h.{i}.mlp.dropout": 0.3}
    assert found == expected


def test_sdpa_attention_dropout_is_active_and_unbiased_in_training():
    """The fused path draws its own masks, so check the law instead: E[dropout(A) V] = A V."""
    torch.manual_seed(0)
    config = GPTConfig(**TINY, attn_pdrop=0.5, resid_pdrop=0.0, embd_pdrop=0.0)
    attn = GPT(config).transformer.h[0].attn
    x = torch.randn(1, 6, config.n_embd).expand(4000, -1, -1)
    with torch.no_grad():
        expected = attn.eval()(x[:1])
        samples = attn.train()(x)
    assert (samples[0] - samples[1]).abs().max() > 1e-3  # masks differ per row: dropout is on
    error = (samples.mean(0, keepdim=True) - expected).abs().max() / expected.abs().max()
    assert error < 0.05, error


# --- KV cache, padding, positions ----------------------------------------------------------------

@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("name", ["base", "inverse_layer_idx", "reorder_and_upcast"])
def test_cached_decoding_equals_full_sequence(hf_model_dir, name, explicit):
    _, model = load_pair(hf_model_dir, **TINY_CONFIGS[name])
    if explicit:
        use_explicit_attention(model)
    idx = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, batch_size=2, capacity=32)
        chunks = [model(idx[:, :7], cache=cache), model(idx[:, 7:12], cache=cache)]  # prefill, then a chunk
        chunks += [model(idx[:, t:t + 1], cache=cache) for t in range(12, 24)]        # decode one at a time
    assert cache.pos == 24
    assert (torch.cat(chunks, dim=1) - full).abs().max().item() <= 1e-5


def left_padded(rows, pad_id=0):
    width = max(len(r) for r in rows)
    idx = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return idx, mask


def test_left_padded_batch_matches_rows_alone_and_transformers(hf_model_dir):
    hf, model = load_pair(hf_model_dir)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(1, TINY["vocab_size"], (n,), generator=g).tolist() for n in (12, 7, 3)]
    idx, mask = left_padded(rows)
    with torch.no_grad():
        batched = model(idx, attention_mask=mask)
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        theirs = hf(idx, attention_mask=mask, position_ids=position_ids).logits
        for b, row in enumerate(rows):
            alone = model(torch.tensor([row]))[0]
            real = batched[b, -len(row):]
            assert (real - alone).abs().max().item() <= 1e-5
            assert (real - theirs[b, -len(row):]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("explicit", [False, True])
def test_left_padded_batch_with_cache_matches_rows_alone(hf_model_dir, explicit):
    _, model = load_pair(hf_model_dir)
    if explicit:
        use_explicit_attention(model)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, TINY["vocab_size"], (n,), generator=g).tolist() for n in (9, 4, 1)]
    continuation = torch.randint(1, TINY["vocab_size"], (3, 6), generator=g)
    idx, mask = left_padded(rows)
    with torch.no_grad():
        cache = KVCache.for_model(model, batch_size=3, capacity=20)
        steps = [model(idx, cache=cache, attention_mask=mask, last_logits_only=True)]
        for t in range(continuation.size(1)):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
            steps.append(model(continuation[:, t:t + 1], cache=cache, attention_mask=mask))
        for b, row in enumerate(rows):
            alone = model(torch.tensor([row + continuation[b].tolist()]))[0]
            expected = alone[len(row) - 1:]  # the prompt's last position, then each continuation position
            got = torch.cat([s[b] for s in steps])
            assert (got - expected).abs().max().item() <= 1e-5


def test_context_length_is_enforced():
    model = GPT(GPTConfig(**{**TINY, "n_positions": 8}))
    with pytest.raises(ContextLengthError, match="context length of 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    cache = KVCache.for_model(model, batch_size=1)
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ContextLengthError):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_last_logits_only_equals_last_position():
    model = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(0, TINY["vocab_size"], (2, 10))
    with torch.no_grad():
        assert torch.allclose(model(idx, last_logits_only=True)[:, 0], model(idx)[:, -1], atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 64])
def test_chunked_head_loss_equals_plain_cross_entropy(chunk_rows):
    """lm_head_cross_entropy (the training loss) against logits -> F.cross_entropy: value and both
    gradients, with ignored targets, a ragged last chunk, a chunk that ignores every row, and a
    non-unit upstream gradient (backward only scales what forward computed)."""
    torch.manual_seed(0)
    x = torch.randn(23, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (23,))
    targets[[0, 5, 6]] = -100
    targets[7:14] = -100  # with chunk_rows 7 one whole chunk is ignored
    reference = F.cross_entropy(x @ weight.t(), targets, ignore_index=-100)
    grads = torch.autograd.grad(2.5 * reference, (x, weight))
    loss = lm_head_cross_entropy(x, weight, targets, chunk_rows)  # an int plan: rows per chunk
    ours = torch.autograd.grad(2.5 * loss, (x, weight))
    assert loss.dtype == torch.float64 and abs(loss.item() - reference.item()) < 1e-12
    for a, b in zip(ours, grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)
    with torch.no_grad():  # evaluation: no gradient work, same value
        assert abs(lm_head_cross_entropy(x, weight, targets, chunk_rows).item() - reference.item()) < 1e-12


def test_chunked_head_loss_under_bf16_autocast_matches_plain_autocast():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()  # no dropout: the two forwards must see the same activations
    idx = torch.randint(0, TINY["vocab_size"], (3, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx[:, :-1], targets=idx[:, 1:])
        x = model.transformer.ln_f(model.transformer.h[1](model.transformer.h[0](
            model.transformer.wte(idx[:, :-1]) + model.transformer.wpe.weight[:11])))
        reference = F.cross_entropy(model.lm_head(x).float().reshape(-1, TINY["vocab_size"]), idx[:, 1:].reshape(-1))
    assert abs(loss.item() - reference.item()) < 1e-5
    (grad,) = torch.autograd.grad(loss, model.transformer.wte.weight)
    (ref_grad,) = torch.autograd.grad(reference, model.transformer.wte.weight)
    assert (grad - ref_grad).abs().max().item() < 2e-2 * ref_grad.abs().max().item()  # bf16 GEMMs both ways


# --- vocabulary padding, init, config ------------------------------------------------------------

def test_vocab_padding_never_leaks(hf_model_dir, tmp_path):
    hf, directory = hf_model_dir()
    padded = GPT.from_pretrained(directory, vocab_multiple=64)
    assert padded.transformer.wte.weight.shape[0] == 128
    assert not padded.transformer.wte.weight[TINY["vocab_size"]:].any()  # the rows no file holds: zeros
    idx = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        logits = padded(idx)
        assert logits.shape[-1] == TINY["vocab_size"]
        assert (logits - hf(idx).logits).abs().max().item() <= 1e-5
    assert padded.num_parameters() == hf.num_parameters()
    padded.save_pretrained(tmp_path / "out")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (reloaded(idx).logits - logits).abs().max().item() <= 1e-6


def test_init_follows_gpt2():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=6, n_head=4, n_embd=256, vocab_size=1000, n_positions=128)
    model = GPT(config)
    block = model.transformer.h[0]
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.02 * 0.03
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.02 * 0.03
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)
    for weight in (block.attn.c_proj.weight, block.mlp.c_proj.weight):
        assert abs(weight.std().item() - residual_std) < residual_std * 0.03
    assert torch.all(block.attn.c_attn.bias == 0) and torch.all(block.ln_1.weight == 1)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("field,value", [("add_cross_attention", True), ("tie_word_embeddings", False),
                                         ("some_new_flag", 1), ("n_ctx", 512)])
def test_unsupported_transformers_config_values_are_rejected(field, value):
    hf_dict = transformers.GPT2Config(**TINY).to_dict() | {field: value}
    with pytest.raises(ConfigError, match=field):
        GPTConfig.from_hf_dict(hf_dict)


def test_transformers_config_round_trips():
    config = GPTConfig(**TINY, n_inner=40, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)
    hf_config = transformers.GPT2Config(**config.to_hf_dict())
    assert GPTConfig.from_hf_dict(hf_config.to_dict()) == config
