"""The architecture sheet against the real model: shapes observed by hooks, FLOPs by FlopCounterMode.

    .venv/bin/pytest tests/test_inspect.py -q

The sheet's tests run a real GPT.forward (on CPU for a tiny config, on the meta device for the 124M preset,
which propagates shapes without allocating weights) in the mode the sheet describes, records what
each module and each torch function inside it received and returned, and compares with the sheet.
The capture tests compare inspect.capture with a forward written out op by op, with Transformers'
output_attentions, and a head ablation by patch with the same ablation by hand; the slow test renders
a prompt's page in headless Chromium.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

import gpt2.model
from gpt2 import GPT, ConfigError, ContextLengthError, GPTConfig, KVCache
from gpt2.cli import main
from gpt2.config import ACTIVATIONS
from gpt2.inspect import (ACTIVATION_OPS, COLORS, CROSS_ENTROPY_FLOPS, InspectConfig, architecture_sheet, capture,
                          capture_points, format_html, format_markdown, format_text, inspect_model, lens_logits,
                          logit_lens, model_for_sheet, prompt_sheet, render_sheet)
from gpt2.weights import save_native

TINY = GPTConfig(n_layer=2, n_head=4, n_embd=32, n_positions=32, vocab_size=101)
MATMUL_OPS = ("qkv projection", "c_proj", "c_fc", "scores", "weighted sum")  # sheet ops that are GEMMs
# (mode, B, T, P): prefill into an empty cache, and a chunk after 3 cached positions
CASES = [("full", 2, 5, 0), ("training", 2, 5, 0), ("prefill", 2, 5, 0), ("prefill", 2, 4, 3), ("decode", 2, 1, 6)]


def _shape(x):
    return list(x.shape) if isinstance(x, torch.Tensor) else None


class Recorder(TorchFunctionMode):
    """Every torch function called directly inside each module (innermost), and every module's in/out."""

    def __init__(self, model):
        super().__init__()
        self.stack, self.calls, self.modules, self.order = [""], [], {}, []
        for name, module in model.named_modules():
            module.register_forward_pre_hook(lambda m, a, name=name: self.stack.append(name))
            module.register_forward_hook(lambda m, a, out, name=name: self._done(name, a, out))

    def _done(self, name, args, out):
        self.stack.pop()
        self.modules.setdefault(name, []).append(([_shape(a) for a in args if _shape(a) is not None], _shape(out)))
        self.order.append(name)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [a for a in args if isinstance(a, torch.Tensor)]
        outs = [_shape(o) for o in out] if isinstance(out, (tuple, list)) else _shape(out)
        self.calls.append((self.stack[-1], getattr(func, "__name__", str(func)), [_shape(a) for a in flat], outs))
        return out

    def in_module(self, name, func):
        return [(ins, out) for where, f, ins, out in self.calls if where == name and f == func]


def run_recorded(model, mode, B, T, P):
    """One real forward in `mode`, explicit attention (so scores, mask and softmax are separate calls)."""
    for block in model.transformer.h:
        block.attn.use_sdpa = False
    model.train(mode == "training")
    device = model.transformer.wte.weight.device
    idx = torch.randint(0, model.config.vocab_size, (B, T), device=device) if device.type != "meta" \
        else torch.empty(B, T, dtype=torch.long, device="meta")
    rec, cache_updates = Recorder(model), []
    fused_head = gpt2.model.lm_head_cross_entropy

    def recording_head(x, weight, targets, **options):  # training's fused lm_head + loss is a function
        rec.fused_head = ([_shape(x), _shape(targets)], [])
        return fused_head(x, weight, targets, **options)
    with rec, mock.patch("gpt2.model.lm_head_cross_entropy", recording_head):
        if mode in ("full", "training"):
            out = model(idx, targets=idx if mode == "training" else None)
        else:
            cache = KVCache.for_model(model, batch_size=B, capacity=min(P + T + 2, model.config.n_positions))
            cache.advance(P)  # P positions already cached (their values do not matter for shapes)
            update = cache.update

            def recording_update(layer, k, v):
                keys, values = update(layer, k, v)
                cache_updates.append(([_shape(k), _shape(v)], [2] + _shape(keys), _shape(values)))
                return keys, values
            cache.update = recording_update
            out = model(idx, cache=cache, last_logits_only=mode == "prefill")
            assert cache.pos == P + T
    return rec, cache_updates, out


def observed(op, rec, cache_updates, block_seen):
    """(input shapes, output shape) of one sheet op, as the real forward produced them."""
    name, i = op["name"], op["block"]
    h = f"transformer.h.{i}"
    k = block_seen.setdefault((name, i), 0)
    block_seen[(name, i)] += 1

    def module(fqn):
        (ins, out), = rec.modules[fqn]
        return ins, out
    if name == "embedding":
        return [module("transformer.wte")[0][0], module("transformer.wpe")[0][0]], module("transformer.drop")[0][0]
    if name == "embedding dropout":
        return module("transformer.drop")
    if name in ("ln_1", "ln_2"):
        return module(f"{h}.{name}")
    if name == "qkv projection":
        return module(f"{h}.attn.c_attn")
    attn = lambda f: rec.in_module(f"{h}.attn", f)  # noqa: E731
    if name == "head split":
        (_, outs), = attn("unbind")  # q, k, v: one unbind of the (3, B, nh, T, hs) view of c_attn's output
        assert len(outs) == 3 and outs[0] == outs[1] == outs[2]
        return [module(f"{h}.attn.c_attn")[1]], [3] + outs[0]
    if name == "kv cache append":
        ins, keys, values = cache_updates[i]
        assert keys[1:] == values
        return ins, keys
    if name == "scores":
        (q, kt), out = attn("matmul")[0]
        (_, scaled), = [(ins, o) for ins, o in attn("mul")]
        assert scaled == out
        return [q, kt[:-2] + [kt[-1], kt[-2]]], out
    if name == "causal mask":
        (scores, mask), out = attn("masked_fill")[0]
        if mask is None:  # mask built by the explicit path itself: ~tril(...)
            mask = attn("__invert__")[0][1]
        return [scores, mask], out
    if name == "softmax":
        return attn("softmax")[0]
    if name == "attention-weight dropout":
        return module(f"{h}.attn.attn_dropout")
    if name == "weighted sum":
        return attn("matmul")[1]
    if name == "head merge":
        merge_in = attn("transpose")[-1][0]
        return merge_in, attn("view")[-1][1]
    if name == "c_proj":
        return module(f"{h}.attn.c_proj" if k == 0 else f"{h}.mlp.c_proj")
    if name == "residual dropout":
        return module(f"{h}.attn.resid_dropout")
    if name == "residual add":
        return rec.in_module(h, "add")[k]
    if name == "c_fc":
        return module(f"{h}.mlp.c_fc")
    if name in ("GELU", "ReLU"):
        return rec.in_module(f"{h}.mlp", "gelu" if name == "GELU" else "relu")[0]
    if name == "MLP dropout":
        return module(f"{h}.mlp.dropout")
    if name == "ln_f":
        return module("transformer.ln_f")
    if name == "lm_head":
        return module("lm_head")
    if name == "lm_head + loss":
        return rec.fused_head
    raise AssertionError(f"the test does not know op {name!r}")


def check_shapes(model, mode, B, T, P):
    sheet = architecture_sheet(model, mode, batch=B, seq=T, past=P)
    rec, cache_updates, out = run_recorded(model, mode, B, T, P)
    seen = {}
    for op in sheet["ops"]:
        ins, out_shape = observed(op, rec, cache_updates, seen)
        where = f"{mode} op {op['name']!r} block {op['block']}"
        assert op["output_shape"] == out_shape, where
        assert op["input_shapes"] == ins, where
        assert len(op["axes"]) == len(op["output_shape"]), where
    # every module with a forward ran, in the sheet's order
    module_order = [op["module"] for op in sheet["ops"] if op["module"] in rec.modules and "." in op["module"]
                    and not op["module"].endswith(("attn", "mlp")) and not op["module"].split(".")[-1].isdigit()]
    ran = [m for m in rec.order if m in set(module_order) and m != "transformer.wpe"]
    assert [m for m in module_order if m != "transformer.wpe"] == ran
    # a training-only op is exactly a dropout or the loss, and in eval modes dropout is the identity
    for op in sheet["ops"]:
        assert op["training_only"] == (op["kind"] in ("dropout", "loss"))
        assert op["identity"] == (op["kind"] == "dropout" and mode != "training")
    if mode == "training":
        assert out.shape == torch.Size([]) and sheet["ops"][-1]["name"] == "lm_head + loss"
    return sheet


@pytest.mark.parametrize("mode,B,T,P", CASES)
def test_tiny_shapes_match_hooks(mode, B, T, P):
    torch.manual_seed(0)
    check_shapes(GPT(TINY), mode, B, T, P)


@pytest.mark.parametrize("mode,B,T,P", [("full", 1, 16, 0), ("training", 2, 8, 0), ("prefill", 1, 9, 0),
                                        ("decode", 2, 1, 1023)])
def test_gpt2_preset_shapes_match_hooks_on_meta(mode, B, T, P):
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2"))
    sheet = check_shapes(model, mode, B, T, P)
    if mode == "decode":
        scores = next(op for op in sheet["ops"] if op["name"] == "scores")
        assert scores["output_shape"] == [2, 12, 1, 1024]
        assert scores["axes"] == ["B batch", "12 heads", "1 query", "P+1 keys"]
        cache = next(op for op in sheet["ops"] if op["name"] == "kv cache append")
        assert cache["output_shape"] == [2, 2, 12, 1024, 64]
        assert sheet["kv_cache_bytes_after"] - sheet["kv_cache_bytes_before"] == 2 * sheet["kv_cache_bytes_per_token"]


def test_preset_totals():
    sheet = inspect_model("gpt2", "full", batch=1, seq=1024)
    assert sheet["total_parameters"] == 124_439_808
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2"))
    assert sum(op["parameters"] for op in sheet["ops"]) == model.num_parameters()
    # every parameter tensor of the module tree is named by exactly one op (lm_head as tied to wte)
    named = [t["name"] for op in sheet["ops"] for t in op["parameter_tensors"] if "tied_to" not in t]
    assert sorted(named) == sorted(n for n, _ in model.named_parameters())
    assert sheet["kv_cache_bytes_per_token"] == 2 * 12 * 768 * 4
    assert inspect_model("gpt2", "decode", dtype="bfloat16")["kv_cache_bytes_per_token"] == 2 * 12 * 768 * 2
    # forward FLOPs per token are about 2 per parameter plus attention over the context (Kaplan et al.)
    n_non_embedding = 12 * 12 * 768 ** 2
    approx = 2 * n_non_embedding + 2 * 12 * 1024 * 768 + 2 * 768 * 50257
    assert 0.95 < sheet["forward_flops_per_token"] / approx < 1.1
    training = inspect_model("gpt2", "training", batch=1, seq=1024)
    assert training["training_flops_per_token"] == 3 * training["forward_flops"] // 1024
    assert training["peak_activation_bytes"] > sheet["peak_activation_bytes"]
    for big in ("gpt2-medium", "gpt2-large", "gpt2-xl"):
        with torch.device("meta"):
            assert inspect_model(big, "decode")["total_parameters"] == GPT(GPTConfig.preset(big)).num_parameters()


@pytest.mark.parametrize("mode,B,T,P", CASES)
def test_matmul_flops_match_flop_counter(mode, B, T, P):
    """The sheet's matmul FLOPs (minus its bias adds and score scaling) against torch's FlopCounterMode."""
    torch.manual_seed(0)
    model = GPT(TINY)
    for block in model.transformer.h:
        block.attn.use_sdpa = False
    model.train(mode == "training")
    sheet = architecture_sheet(model, mode, batch=B, seq=T, past=P)
    idx = torch.randint(0, TINY.vocab_size, (B, T))
    counter = FlopCounterMode(display=False)
    with counter:
        if mode in ("full", "training"):
            model(idx, targets=idx if mode == "training" else None)
        else:
            cache = KVCache.for_model(model, batch_size=B, capacity=P + T)
            cache.advance(P)
            model(idx, cache=cache, last_logits_only=mode == "prefill")
    counts = {name: sum(per_op.values()) for name, per_op in counter.get_flop_counts().items()}
    ops = sheet["ops"]

    def bias_adds(op):
        return sum(1 for t in op["parameter_tensors"] if t["name"].endswith("bias")) * \
            torch.Size(op["output_shape"]).numel() if op["kind"] in ("attention", "mlp") else 0

    for i in range(TINY.n_layer):
        block = [op for op in ops if op["block"] == i]
        by_module = {}
        for op in block:
            if op["name"] in ("qkv projection", "c_proj", "c_fc"):
                by_module[op["module"]] = op["flops"] - bias_adds(op)
        for module, flops in by_module.items():
            assert counts[f"GPT.{module}"] == flops, module
        attention = [op for op in block if op["name"] in ("scores", "weighted sum")]
        scaling = torch.Size(attention[0]["output_shape"]).numel()
        inner = counts[f"GPT.transformer.h.{i}.attn"] - counts[f"GPT.transformer.h.{i}.attn.c_attn"] \
            - counts[f"GPT.transformer.h.{i}.attn.c_proj"]
        assert inner == sum(op["flops"] for op in attention) - scaling
    if mode == "training":
        # The fused head runs its logits GEMM and, in the same pass, the two GEMMs of its backward
        # (B*T rows are one chunk here, so grad_weight is one plain mm, which FlopCounterMode counts).
        head = next(op for op in ops if op["name"] == "lm_head + loss")
        logits_gemm = head["flops"] - CROSS_ENTROPY_FLOPS * B * T * TINY.vocab_size
        blocks = sum(counts[f"GPT.transformer.h.{i}"] for i in range(TINY.n_layer))
        assert counts["GPT"] - blocks == 3 * logits_gemm
        matmul = sum(op["flops"] for op in ops if op["name"] in MATMUL_OPS) + 3 * logits_gemm
    else:
        lm_head = next(op for op in ops if op["name"] == "lm_head")
        assert counts["GPT.lm_head"] == lm_head["flops"]
        matmul = sum(op["flops"] for op in ops if op["name"] in MATMUL_OPS + ("lm_head",))
    assert counter.get_total_flops() <= matmul


def test_errors():
    with pytest.raises(ConfigError):
        inspect_model("gpt2", "decode", seq=4)
    with pytest.raises(ConfigError):
        inspect_model("gpt2", "full", seq=4, past=2)
    with pytest.raises(ContextLengthError):
        inspect_model("gpt2", "prefill", seq=1000, past=100)
    with pytest.raises(ConfigError):
        inspect_model("gpt2", "sideways")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_has_its_op(activation):
    """inspect.ACTIVATION_OPS is keyed by config.ACTIVATIONS: each shows its own op, formula and FLOPs."""
    config = GPTConfig(n_layer=1, n_head=2, n_embd=8, n_positions=8, vocab_size=11, activation_function=activation)
    sheet = architecture_sheet(model_for_sheet(config), "full", batch=2, seq=3)
    act = ACTIVATION_OPS[activation]
    op = next(op for op in sheet["ops"] if op["name"] == act.label)
    assert op["formula"] == act.formula and op["flops"] == act.flops_per_element * 2 * 3 * config.mlp_width
    assert act.label in next(op for op in sheet["ops"] if op["module"] == "transformer.h.0.mlp.c_proj")["formula"]


def test_inspect_config_is_what_the_cli_runs(capsys):
    cfg = InspectConfig(model="gpt2", mode="prefill", seq=16, format="markdown")
    assert main(["inspect", "gpt2", "--mode", "prefill", "--seq", "16", "--format", "markdown"]) == 0
    assert capsys.readouterr().out == render_sheet(cfg) + "\n"
    with pytest.raises(ConfigError, match="format must be one of"):
        InspectConfig(format="pdf")
    with pytest.raises(ConfigError, match="dtype 'int3' is not supported"):
        render_sheet(InspectConfig(dtype="int3"))


def test_cli_json_contract(capsys):
    assert main(["inspect", "gpt2", "--mode", "decode", "--batch", "1", "--past", "1023", "--format", "json"]) == 0
    sheet = json.loads(capsys.readouterr().out)
    assert sheet["total_parameters"] == 124_439_808 and sheet["mode"] == "decode"
    assert len(sheet["ops"]) == 2 + 12 * 19 + 2  # the 18 ops of a block, plus the KV-cache append in decode
    for op in sheet["ops"]:
        assert isinstance(op["name"], str) and (op["block"] is None or isinstance(op["block"], int))
        assert all(isinstance(s, list) and all(isinstance(n, int) for n in s) for s in op["input_shapes"])
        assert all(isinstance(n, int) for n in op["output_shape"]) and all(isinstance(a, str) for a in op["axes"])
        assert isinstance(op["parameters"], int) and isinstance(op["flops"], int)
        assert isinstance(op["training_only"], bool)
    for key in ("forward_flops_per_token", "kv_cache_bytes_per_token", "peak_activation_bytes"):
        assert isinstance(sheet[key], int)
    assert main(["inspect", "gpt2", "--mode", "decode", "--seq", "3"]) == 2
    assert "decode adds one token" in capsys.readouterr().err


def test_cli_reads_a_model_directory_config(tmp_path, capsys):
    config = GPTConfig(n_layer=3, n_head=2, n_embd=16, n_positions=64, vocab_size=77)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    assert main(["inspect", str(tmp_path), "--mode", "prefill", "--seq", "7", "--format", "json"]) == 0
    sheet = json.loads(capsys.readouterr().out)
    assert sheet["config"]["n_layer"] == 3 and sheet["total_parameters"] == GPT(config).num_parameters()


def test_text_and_markdown_list_every_op():
    sheet = inspect_model("gpt2", "training", batch=2, seq=64)
    text, markdown = format_text(sheet), format_markdown(sheet)
    assert "124,439,808" in text and "training FLOPs per token" in text
    assert len(markdown.splitlines()) >= len(sheet["ops"]) + 2
    assert "[B=2 batch, 12 heads, T=64 queries, T=64 keys]" in text


def _png_pixels(path):
    import matplotlib.image
    return (matplotlib.image.imread(path)[..., :3] * 255).round().astype(int)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
def _screenshot(page, png, height: int, width: int = 1400):
    """Headless Chromium's screenshot of a local page (offline: no network features), as pixels."""
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={png.parent / 'profile'}", f"--screenshot={png}",
                    f"--window-size={width},{height}", page.as_uri()], check=True, capture_output=True, timeout=90)
    return _png_pixels(png)


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian package: chromium)")
def test_html_renders_block_diagram_in_chromium(tmp_path):
    page = tmp_path / "sheet.html"
    html_text = format_html(inspect_model("gpt2", "decode", past=1023))
    assert "http://" not in html_text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in html_text and "<script" not in html_text
    page.write_text(html_text)
    pixels = _screenshot(page, tmp_path / "out.png", height=1000)
    assert pixels.shape[:2] == (1000, 1400)

    def count(color):
        rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
        return int((abs(pixels - rgb).sum(-1) <= 6).sum())
    # the block diagram's boxes: LayerNorm x2, Attention, MLP, residual adds, all drawn as solid fills
    for kind in ("layernorm", "attention", "mlp", "add", "embedding"):
        assert count(COLORS[kind]) > 2000, kind
    # LayerNorm 1 | Attention | Dropout | + | LayerNorm 2 | MLP: the boxes appear left to right in this order
    hits = {kind: abs(pixels - [int(COLORS[kind][i:i + 2], 16) for i in (1, 3, 5)]).sum(-1) <= 6
            for kind in ("layernorm", "attention", "mlp")}
    row = next(y for y in range(pixels.shape[0]) if all(hit[y].any() for hit in hits.values()))  # the block's row
    first = {kind: hit[row].nonzero()[0].min() for kind, hit in hits.items()}
    assert first["layernorm"] < first["attention"] < first["mlp"]
    assert hits["layernorm"][row, first["attention"]:first["mlp"]].any()  # LayerNorm 2, between them



# ---------------------------------------------------------------------------------------------
# capture, patching, the logit lens, the prompt's sheet
# ---------------------------------------------------------------------------------------------

def manual_forward(model, idx, zero_head=None):
    """GPT.forward written out op by op (explicit attention, eval mode): every capture point's tensor.

    zero_head=(layer, head) ablates that head by hand: its slice of the merged heads is set to zero.
    """
    t, c = model.transformer, model.config
    B, T = idx.shape
    C, nh, hs = c.n_embd, c.n_head, c.head_size
    acts = {}
    x = t.wte(idx) + t.wpe(torch.arange(T).unsqueeze(0))
    acts["embedding"] = x
    x = t.drop(x)
    for i, block in enumerate(t.h):
        a, p = block.attn, f"h.{i}."
        z = acts[p + "ln_1"] = block.ln_1(x)
        qkv = acts[p + "attn.qkv"] = a.c_attn(z)
        q, k, v = (u.view(B, T, nh, hs).transpose(1, 2) for u in qkv.split(C, dim=2))  # (B, nh, T, hs)
        scores = acts[p + "attn.scores"] = (q @ k.transpose(-2, -1)) * a.scale
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        probs = acts[p + "attn.probs"] = torch.softmax(scores.masked_fill(~causal, torch.finfo(scores.dtype).min), -1)
        y = (probs @ v).transpose(1, 2).contiguous().view(B, T, C)
        if zero_head is not None and zero_head[0] == i:
            y = y.clone()
            y[:, :, zero_head[1] * hs:(zero_head[1] + 1) * hs] = 0
        acts[p + "attn.merged"] = y
        out = acts[p + "attn.out"] = a.c_proj(y)
        x = acts[p + "resid_mid"] = x + out
        z2 = acts[p + "ln_2"] = block.ln_2(x)
        fc = acts[p + "mlp.fc"] = block.mlp.c_fc(z2)
        act = acts[p + "mlp.act"] = torch.nn.functional.gelu(fc, approximate="tanh")
        acts[p + "mlp.out"] = block.mlp.c_proj(act)
        x = acts[p + "resid_post"] = x + acts[p + "mlp.out"]
    acts["ln_f"] = t.ln_f(x)
    acts["logits"] = model.lm_head(acts["ln_f"])[..., :c.vocab_size]
    return acts


def tiny_model(seed=0, **config):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY.to_dict(), **config}) if config else TINY).eval()


def test_capture_equals_a_manual_forward():
    model = tiny_model()
    idx = torch.randint(0, TINY.vocab_size, (2, 7))
    with torch.no_grad():
        acts = capture(model, idx)
        manual = manual_forward(model, idx)
        plain = model(idx)
    assert list(acts) == list(capture_points(TINY.n_layer)) and set(acts) == set(manual)
    for name, tensor in acts.items():
        assert tensor.shape == manual[name].shape, name
        torch.testing.assert_close(tensor, manual[name], rtol=0, atol=0, msg=name)  # the same ops, bit for bit
    assert acts["h.0.attn.scores"].shape == (2, TINY.n_head, 7, 7)
    assert acts["h.1.attn.scores"][0, 0].triu(1).abs().sum() > 0  # scores before the mask: the future is there
    torch.testing.assert_close(acts["logits"], plain, rtol=1e-5, atol=1e-5)  # explicit path vs SDPA
    # nothing left behind: no hooks, every block back on scaled_dot_product_attention
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(block.attn.use_sdpa for block in model.transformer.h)
    one = capture(model, idx, names=["h.1.mlp.act"])  # no attention point asked for: SDPA stays on
    assert list(one) == ["h.1.mlp.act"]
    torch.testing.assert_close(one["h.1.mlp.act"], acts["h.1.mlp.act"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="unknown capture point"):
        capture(model, idx, names=["h.2.ln_1"])
    assert all(block.attn.use_sdpa for block in model.transformer.h)


def test_attention_probs_equal_transformers_output_attentions(tmp_path):
    from conftest import save_hf_model
    hf = save_hf_model(tmp_path, seed=3, n_layer=3, n_head=4, n_embd=32)
    model = GPT.from_pretrained(str(tmp_path))
    idx = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        ours = capture(model, idx, names=[f"h.{i}.attn.probs" for i in range(3)] + ["logits"])
        ref = hf(idx, output_attentions=True)
    assert len(ref.attentions) == 3
    for i, attentions in enumerate(ref.attentions):  # (B, nh, T, T)
        torch.testing.assert_close(ours[f"h.{i}.attn.probs"], attentions, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["logits"], ref.logits, rtol=1e-4, atol=1e-5)


def test_logit_lens_last_layer_is_the_models_logits():
    model = tiny_model(1)
    idx = torch.randint(0, TINY.vocab_size, (2, 6))
    with torch.no_grad():
        acts = capture(model, idx)
        probs, ids = logit_lens(model, acts, top_k=4)
        last = lens_logits(model, acts[f"h.{TINY.n_layer - 1}.resid_post"])
    assert probs.shape == ids.shape == (TINY.n_layer, 2, 6, 4)
    assert torch.equal(last, acts["logits"])
    want_p, want_ids = acts["logits"].softmax(-1).topk(4, dim=-1)
    assert torch.equal(ids[-1], want_ids) and torch.equal(probs[-1], want_p)
    assert (probs[..., :-1] >= probs[..., 1:]).all()  # sorted, most likely first
    # an earlier layer's lens is ln_f + lm_head on that layer's residual stream
    early = lens_logits(model, acts["h.0.resid_post"]).softmax(-1).topk(4, dim=-1)
    assert torch.equal(ids[0], early.indices)


def test_patch_zeroing_a_head_equals_zeroing_it_by_hand():
    model = tiny_model(2)
    idx = torch.randint(0, TINY.vocab_size, (2, 8))
    layer, head = 1, 2

    def zero_head(probs):  # (B, nh, T, T)
        probs = probs.clone()
        probs[:, head] = 0
        return probs
    with torch.no_grad():
        # asking for every layer's probs puts every block on the explicit path, as the manual forward is
        patched = capture(model, idx, names=["logits"] + [f"h.{i}.attn.probs" for i in range(TINY.n_layer)],
                          patch={f"h.{layer}.attn.probs": zero_head})
        by_hand = manual_forward(model, idx, zero_head=(layer, head))
        clean = manual_forward(model, idx)
    assert patched[f"h.{layer}.attn.probs"][:, head].abs().sum() == 0  # a capture shows the patched tensor
    torch.testing.assert_close(patched["logits"], by_hand["logits"], rtol=0, atol=0)
    assert not torch.allclose(patched["logits"], clean["logits"])
    # an in-place patch (fn returns None) works too, on a point that is a module's input
    with torch.no_grad():
        halved = capture(model, idx, names=["logits"], patch={"h.0.mlp.act": lambda a: a.mul_(0.5)})
    assert not torch.allclose(halved["logits"], clean["logits"])
    assert all(block.attn.use_sdpa for block in model.transformer.h)


def test_prompt_sheet_stats_attention_and_lens():
    model = tiny_model(4)
    ids = [5, 17, 3, 99, 42]
    sheet = prompt_sheet(model, ids, token_text=lambda t: f"<{t}>", head=(1, 3), top_k=3)
    with torch.no_grad():
        acts = capture(model, torch.tensor([ids]))
    prompt = sheet["prompt"]
    assert prompt["tokens"] == [f"<{t}>" for t in ids] and prompt["head"] == [1, 3]
    attention = torch.tensor(prompt["attention"])
    assert attention.shape == (TINY.n_layer, TINY.n_head, 5, 5)
    torch.testing.assert_close(attention[1], acts["h.1.attn.probs"][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(attention.sum(-1), torch.ones(TINY.n_layer, TINY.n_head, 5), atol=1e-3, rtol=0)
    lens = prompt["logit_lens"]["layers"]
    assert len(lens) == TINY.n_layer and len(lens[0]) == 5 and len(lens[0][0]) == 3
    final = acts["logits"][0, -1].softmax(-1).topk(3)
    assert [e["id"] for e in lens[-1][-1]] == final.indices.tolist()
    for op in sheet["ops"]:
        if op["name"] == "causal mask":
            assert op["capture"] is None and op["stats"] is None
            continue
        assert op["stats"] is not None, op["name"]
        x = acts[op["capture"]]
        assert op["stats"]["max_abs"] == pytest.approx(x.abs().max().item())
        assert op["stats"]["std"] == pytest.approx(x.std(unbiased=False).item(), rel=1e-5)
        assert torch.Size(op["output_shape"]).numel() == x.numel(), op["name"]  # the sheet's shape is the tensor's
    text = format_text(sheet)
    assert "mean / std / max|x|" in text and "logit lens at position 4" in text


def test_cli_prompt_json_on_a_hf_directory_and_our_checkpoint(tmp_path, capsys):
    from conftest import save_hf_model
    hf_dir = tmp_path / "hf"
    save_hf_model(hf_dir, seed=0, vocab_size=50257, n_layer=2, n_head=2, n_embd=16)
    native = tmp_path / "ours"
    save_native(GPT.from_pretrained(str(hf_dir)), native)
    sheets = []
    for directory in (hf_dir, native):
        assert main(["inspect", str(directory), "--prompt", "Hello world, hello", "--format", "json",
                     "--head", "1.1", "--top-k", "2"]) == 0
        sheets.append(json.loads(capsys.readouterr().out))
    for sheet in sheets:
        prompt = sheet["prompt"]
        assert prompt["tokens"] == ["Hello", " world", ",", " hello"] and prompt["head"] == [1, 1]
        assert len(prompt["logit_lens"]["layers"][0][0]) == 2
        assert sheet["seq"] == 4 and all("stats" in op for op in sheet["ops"])
    assert sheets[0]["prompt"]["attention"] == sheets[1]["prompt"]["attention"]  # same weights, two layouts
    assert main(["inspect", str(hf_dir), "--prompt", "Hi", "--mode", "decode"]) == 2
    assert "--prompt runs one full forward" in capsys.readouterr().err
    assert main(["inspect", str(hf_dir), "--prompt", "Hi", "--head", "2.0"]) == 2
    assert "layers 0..1" in capsys.readouterr().err
    assert main(["inspect", "gpt2", "--head", "1.0"]) == 2
    assert "needs --prompt" in capsys.readouterr().err


def test_cli_prompt_on_a_preset_at_random_init(capsys):
    assert main(["inspect", "gpt2", "--prompt", "The cat sat", "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "preset gpt2 at random init (seed 0)" in out and "prompt tokens: 0:The 1:\u2423cat 2:\u2423sat" in out
    assert "layer 11:" in out and "mean / std / max|x|" in out


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian package: chromium)")
def test_prompt_page_renders_attention_maps_in_chromium(tmp_path):
    """Run with --basetemp DIR to keep the screenshot (DIR/test_prompt_page_*0/prompt.png) and look at it."""
    from conftest import save_hf_model
    save_hf_model(tmp_path / "hf", seed=0, vocab_size=50257, n_layer=3, n_head=4, n_embd=32)
    html_text = render_sheet(InspectConfig(model=str(tmp_path / "hf"), prompt="The quick brown fox jumps over the dog",
                                           format="html", head="2.1"))
    assert "http://" not in html_text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in html_text and "<script" not in html_text
    assert html_text.count('class="attn-small"') == 3 * 4 and html_text.count('class="attn-large"') == 1
    assert html_text.count('data-head="2.1"') == 2 and "<h2>Logit lens</h2>" in html_text
    assert html_text.count('<td class="s stats">') == sum(1 for _ in architecture_sheet(
        model_for_sheet(GPT.from_pretrained(str(tmp_path / "hf")).config), "full", seq=8)["ops"])
    page = tmp_path / "prompt.html"
    page.write_text(html_text)
    pixels = _screenshot(page, tmp_path / "prompt.png", height=1800)
    assert pixels.shape[:2] == (1800, 1400)
    # the attention squares: the attention blue at full opacity (the diagonal of the first query: p = 1)
    # and lighter shades of it; the block diagram above the maps holds one Attention box of ~118 x 64
    blue = [int(COLORS["attention"][i:i + 2], 16) for i in (1, 3, 5)]
    solid = int((abs(pixels - blue).sum(-1) <= 6).sum())
    assert solid > 118 * 64 + 2 * 3 * 4 * 8  # more than the diagram's box: the maps' p = 1 squares
    below = pixels[450:]  # under the block diagram: the prompt, the maps and the logit lens
    tinted = ((below[..., 2] > below[..., 0] + 30) & (below[..., 2] > 150)).sum()  # blue-ish shades
    assert tinted > 5000
