"""Training loop tests against references: a plain Transformers + torch.optim loop, a stored golden
loss curve, an uninterrupted run (for SIGKILL + resume), and clear errors for bad inputs.

    pytest tests/test_train.py -q
    python tests/test_train.py --regenerate-golden     # rewrite tests/assets/train_golden_losses.json

All runs use a tiny model on a tiny synthetic corpus (a random Markov chain over 128 tokens, written
as llm.c shards with data.write_shard), one thread and deterministic algorithms.
"""

import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2 import GPT, GPTConfig
from gpt2.data import DataLoader, write_shard
from gpt2.errors import CheckpointError, ConfigError, DataError
from gpt2.kernels import MEASUREMENT_CACHE_VERSION
from gpt2.train import LoopState, TrainConfig, TrainingDiverged, learning_rate, preset_configs, train
from gpt2.weights import save_native

ASSETS = Path(__file__).parent / "assets"
GOLDEN = ASSETS / "train_golden_losses.json"
VOCAB = 128
TINY_MODEL = dict(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=VOCAB)


def make_corpus(directory: Path, n_train=40_000, n_val=4_000, seed=0) -> Path:
    """A Markov chain with a few likely successors per token: learnable, loss floor well below ln(128)."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, VOCAB, size=(VOCAB, 4))
    def chain(n):
        toks = np.empty(n, dtype=np.int64)
        toks[0] = 0
        choice = rng.integers(0, 4, size=n)
        for i in range(1, n):
            toks[i] = successors[toks[i - 1], choice[i]]
        return toks
    directory.mkdir(parents=True, exist_ok=True)
    write_shard(directory / "tiny_train_000000.bin", chain(n_train))
    write_shard(directory / "tiny_val_000000.bin", chain(n_val))
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def tiny_config(data, out, **overrides) -> TrainConfig:
    fields = dict(data=str(data), out=str(out), batch_size=4, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=5,
                  max_steps=30, eval_interval=10, eval_batches=4, checkpoint_interval=10, keep_last=2,
                  num_samples=0, progress=False, dropout=0.0, threads=1, seed=7, dtype="float32")
    return TrainConfig(**{**fields, **overrides})


def cli_args(data, out, **overrides) -> list[str]:
    fields = dict(data=data, out=out, n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=VOCAB,
                  batch_size=4, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=5, max_steps=30, eval_interval=10,
                  eval_batches=4, checkpoint_interval=10, keep_last=2, num_samples=0, dropout=0.0, threads=1, seed=7,
                  dtype="float32")
    fields.update(overrides)
    args = ["train", "--no-progress"]
    for k, v in fields.items():
        if v is True:
            args.append(f"--{k.replace('_', '-')}")
        elif v is not None:
            args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def step_losses(out) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (Path(out) / "steps.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# the loop learns, and computes what a plain reference loop computes
# ---------------------------------------------------------------------------------------------

def test_loss_falls_and_outputs(corpus, tmp_path):
    out = tmp_path / "run"
    summary = train(tiny_config(corpus, out, max_steps=60, eval_interval=20), GPTConfig(**TINY_MODEL))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [20, 40, 60]
    for key in ("step", "train_loss", "val_loss", "tokens_per_s", "elapsed_s"):
        assert key in metrics[0]
    assert metrics[0]["val_loss"] < math.log(VOCAB) - 0.15      # below uniform
    assert metrics[-1]["val_loss"] < metrics[0]["val_loss"] - 0.4  # and still falling
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # The run directory loads as a model (LATEST -> the final checkpoint), with the trained weights.
    model = GPT.from_pretrained(out)
    assert summary["checkpoint"].endswith("step_000060")
    x, y = DataLoader(corpus, split="val", batch_size=4, seq_len=16, seed=8).next_batch()
    with torch.no_grad():
        assert model(x, targets=y).item() < math.log(VOCAB) - 0.5
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000050", "step_000060"]  # keep_last=2


def test_matches_plain_transformers_loop(corpus, tmp_path):
    """Our loop vs GPT2LMHeadModel + torch.optim.AdamW written out by hand: same losses step by step."""
    import transformers
    from gpt2.train import build_training_model
    cfg = tiny_config(corpus, tmp_path / "ours", max_steps=6, eval_interval=100, checkpoint_interval=100,
                      grad_clip=0.5)
    # The same initial weights, written through the production converter, loaded by Transformers.
    build_training_model(cfg, GPTConfig(**TINY_MODEL)).save_pretrained(tmp_path / "init")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "init", attn_implementation="eager")
    hf.config.embd_pdrop = hf.config.attn_pdrop = hf.config.resid_pdrop = 0.0
    hf.train()
    train(cfg, GPTConfig(**TINY_MODEL))
    ours = step_losses(cfg.out)

    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            foreach=False)
    loader = DataLoader(corpus, split="train", batch_size=4, seq_len=16, mode="random", seed=cfg.seed)
    reference = []
    for step in range(cfg.max_steps):
        if step < cfg.warmup_steps:
            lr = cfg.lr * (step + 1) / cfg.warmup_steps
        else:
            p = (step - cfg.warmup_steps) / (cfg.max_steps - cfg.warmup_steps)
            lr = cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * p))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = loader.next_batch()
        logits = hf(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        reference.append(loss.item())
    assert abs(ours[0] - reference[0]) < 1e-5          # same init, same batch: the first loss agrees
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-4)  # and the updates agree


GOLDEN_RUN = dict(max_steps=20, eval_interval=10, checkpoint_interval=20, lr=1e-2, warmup_steps=4, seed=11)


def golden_losses(tmp_path) -> list[float]:
    corpus = make_corpus(Path(tmp_path) / "golden_corpus", seed=3)
    train(tiny_config(corpus, Path(tmp_path) / "golden", **GOLDEN_RUN), GPTConfig(**TINY_MODEL))
    return step_losses(Path(tmp_path) / "golden")


def test_golden_loss_curve(tmp_path):
    """A tiny deterministic CPU run reproduces the stored curve (generated by this code, checked above)."""
    expected = json.loads(GOLDEN.read_text())
    assert expected["config"] == {**TINY_MODEL, **GOLDEN_RUN}, "regenerate: python tests/test_train.py --regenerate-golden"
    losses = golden_losses(tmp_path)
    np.testing.assert_allclose(losses, expected["losses"], rtol=0, atol=1e-4)
    assert losses[-1] < losses[0] - 0.3


def test_schedule_shapes():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110, schedule="cosine")
    assert learning_rate(cfg, 0, 0.0) == pytest.approx(0.1)
    assert learning_rate(cfg, 9, 0.0) == pytest.approx(1.0)
    assert learning_rate(cfg, 60, 0.5) == pytest.approx(0.55)
    assert learning_rate(cfg, 110, 1.0) == pytest.approx(0.1)
    wsd = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=100, schedule="wsd", decay_fraction=0.2)
    assert learning_rate(wsd, 50, 0.5) == 1.0 and learning_rate(wsd, 80, 0.8) == 1.0
    assert learning_rate(wsd, 90, 0.9) == pytest.approx(0.5)


def test_presets_build():
    cfg, model = preset_configs("quickstart", data="d", out="o")
    assert model.n_embd == 96 and cfg.schedule == "wsd" and cfg.max_minutes and cfg.seq_len <= model.n_positions
    cfg, model = preset_configs("gpt2-124M")
    assert model.n_layer == 12 and cfg.total_batch_tokens == 524_288 and cfg.lr == 6e-4


def test_gradient_accumulation_matches_reference_step(corpus, tmp_path):
    """B=2 with 2 accumulation steps: the parameters after one step equal a hand-written update."""
    cfg = tiny_config(corpus, tmp_path / "acc", batch_size=2, total_batch_tokens=64, max_steps=1, warmup_steps=0)
    train(cfg, GPTConfig(**TINY_MODEL))
    trained = GPT.from_pretrained(cfg.out).state_dict()

    torch.manual_seed(cfg.seed)  # build_training_model's seed: the same initial weights
    model = GPT(GPTConfig(**{**TINY_MODEL, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0}), vocab_multiple=64)
    loader = DataLoader(corpus, split="train", batch_size=2, seq_len=16, seed=cfg.seed)
    for _ in range(2):  # two micro-batches, each loss scaled by 1/2
        x, y = loader.next_batch()
        (model(x, targets=y) / 2).backward()
    params = list(model.parameters())
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), foreach=False)
    opt.step()
    expected = model.state_dict()
    for k, v in trained.items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6)


def test_activation_checkpointing_and_bf16_autocast(corpus, tmp_path):
    """Recomputing activations changes no number; bf16 autocast trains with float32 master weights."""
    plain = tiny_config(corpus, tmp_path / "plain", max_steps=5, checkpoint_interval=5)
    recompute = tiny_config(corpus, tmp_path / "recompute", max_steps=5, checkpoint_interval=5,
                            activation_checkpointing=True)
    train(plain, GPTConfig(**TINY_MODEL))
    train(recompute, GPTConfig(**TINY_MODEL))
    assert step_losses(plain.out) == pytest.approx(step_losses(recompute.out), abs=1e-6)
    bf16 = tiny_config(corpus, tmp_path / "bf16", max_steps=5, checkpoint_interval=5, dtype="bfloat16")
    train(bf16, GPTConfig(**TINY_MODEL))
    losses = step_losses(bf16.out)
    assert losses == pytest.approx(step_losses(plain.out), abs=0.05)  # bf16 rounding, same trajectory
    assert all(p.dtype == torch.float32 for p in GPT.from_pretrained(bf16.out).parameters())


def test_time_budget_ends_the_run_and_the_bar_counts_its_seconds(corpus, tmp_path, capsys):
    cfg = tiny_config(corpus, tmp_path / "timed", max_steps=1_000_000, max_minutes=0.05, eval_interval=1_000_000,
                      checkpoint_interval=1_000_000, progress=True)
    train(cfg, GPTConfig(**TINY_MODEL))
    (record,) = [json.loads(line) for line in (tmp_path / "timed" / "metrics.jsonl").read_text().splitlines()]
    assert 3.0 <= record["elapsed_s"] < 6.0 and 0 < record["step"] < 1_000_000
    assert record["lr"] == pytest.approx(cfg.min_lr, rel=1e-3)  # the schedule followed the clock to its end
    bar = capsys.readouterr().err
    assert "3/3 s [" in bar and f"step {record['step']} |" in bar  # seconds of the budget; the step in the postfix


@pytest.mark.slow
def test_compiled_training_follows_eager(corpus, tmp_path):
    """--compile (torch.compile of the model, the fused head loss included) takes the same steps."""
    eager = tiny_config(corpus, tmp_path / "eager", max_steps=4, checkpoint_interval=4, eval_interval=4)
    compiled = tiny_config(corpus, tmp_path / "compiled", max_steps=4, checkpoint_interval=4, eval_interval=4,
                           compile=True)
    train(eager, GPTConfig(**TINY_MODEL))
    train(compiled, GPTConfig(**TINY_MODEL))
    assert step_losses(compiled.out) == pytest.approx(step_losses(eager.out), abs=1e-4)
    # the checkpoint has plain parameter names (no torch.compile prefix) and the trained weights
    a, b = GPT.from_pretrained(eager.out).state_dict(), GPT.from_pretrained(compiled.out).state_dict()
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


def test_torch_settings_hold_during_train_and_are_restored_after_it_returns_or_raises(corpus, tmp_path,
                                                                                     monkeypatch):
    """threads and deterministic algorithms are the run's inside train() and the caller's again afterwards."""
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    inside, forward, fail = [], GPT.forward, {"now": False}

    def observing(self, *args, **kwargs):
        inside.append((torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()))
        if fail["now"]:
            raise RuntimeError("boom")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", observing)
    overrides = dict(max_steps=2, eval_interval=2, checkpoint_interval=2, threads=before[0] + 1,
                     deterministic=not before[1])
    train(tiny_config(corpus, tmp_path / "returns", **overrides), GPTConfig(**TINY_MODEL))
    assert set(inside) == {(before[0] + 1, not before[1])}
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before
    fail["now"] = True
    with pytest.raises(RuntimeError, match="boom"):
        train(tiny_config(corpus, tmp_path / "raises", **overrides), GPTConfig(**TINY_MODEL))
    assert inside[-1] == (before[0] + 1, not before[1])
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before


def test_the_cli_shows_the_log_lines_on_stdout(corpus, tmp_path):
    """The library logs (rank 0 only); `gpt2 train` shows those lines on stdout, as prints did."""
    r = subprocess.run([sys.executable, "-m", "gpt2"] + cli_args(str(corpus), str(tmp_path / "run"), max_steps=2,
                                                                 eval_interval=2, checkpoint_interval=2),
                       env=_env(), capture_output=True, text=True, check=True)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("model: ") and "tokens/step" in lines[0]
    assert any(line.startswith("step 2: train ") and "| val " in line for line in lines)
    assert any(line.startswith("checkpoint: ") and line.rstrip().endswith(")") for line in lines)


def test_the_library_logs_through_logging_and_checkpoints_hold_the_loop_state(corpus, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gpt2.train")
    summary = train(tiny_config(corpus, tmp_path / "run", max_steps=2, eval_interval=2, checkpoint_interval=2),
                    GPTConfig(**TINY_MODEL))
    messages = [r.getMessage() for r in caplog.records if r.name == "gpt2.train"]
    assert messages[0].startswith("model: ") and any(m.startswith("step 2: train ") for m in messages)
    meta = json.loads((Path(summary["checkpoint"]) / "gpt2.json").read_text())
    state = LoopState.from_meta(meta)
    assert (state.step, state.tokens, state.val_loss) == (2, 2 * 4 * 16, summary["val_loss"])
    assert 0 < state.elapsed_s <= summary["elapsed_s"]


# ---------------------------------------------------------------------------------------------
# exact resume after SIGKILL
# ---------------------------------------------------------------------------------------------

def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact(corpus, tmp_path):
    args = dict(max_steps=120, checkpoint_interval=20, eval_interval=40, n_embd=64, n_layer=2, seq_len=32,
                batch_size=8)
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    cmd = [sys.executable, "-m", "gpt2"]
    proc = subprocess.Popen(cmd + cli_args(str(corpus), killed, **args), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = Path(killed) / "LATEST"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() in ("step_000040", "step_000060"):
            break
        time.sleep(0.005)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved_step = int(latest.read_text().strip().removeprefix("step_"))
    assert saved_step < 120 and len(step_losses(killed)) > 0
    subprocess.run(cmd + cli_args(str(corpus), killed, resume=True, **args), env=_env(), check=True,
                   capture_output=True)
    subprocess.run(cmd + cli_args(str(corpus), whole, **args), env=_env(), check=True, capture_output=True)
    a, b = step_losses(whole), step_losses(killed)
    assert len(a) == len(b) == 120
    assert a == b  # bit for bit
    ma = [json.loads(x)["val_loss"] for x in (Path(whole) / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x)["val_loss"] for x in (Path(killed) / "metrics.jsonl").read_text().splitlines()]
    assert ma == mb
    wa, wb = GPT.from_pretrained(whole).state_dict(), GPT.from_pretrained(killed).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------

def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="gpt2 prepare"):
        train(tiny_config(tmp_path / "nope", tmp_path / "run"), GPTConfig(**TINY_MODEL))
    r = subprocess.run([sys.executable, "-m", "gpt2"] + cli_args(str(tmp_path / "nope"), str(tmp_path / "r")),
                       env=_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "gpt2 train: error:" in r.stderr and "Traceback" not in r.stderr


def test_bad_config_values():
    with pytest.raises(ConfigError):
        TrainConfig(schedule="linear")
    with pytest.raises(ConfigError):
        TrainConfig(dtype="float16", device="cpu")
    with pytest.raises(ConfigError):
        TrainConfig(lr=1e-3, min_lr=1e-2)


def test_resume_with_a_different_config_is_refused(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(corpus, out, max_steps=10), GPTConfig(**TINY_MODEL))
    with pytest.raises(CheckpointError, match="n_embd"):
        train(tiny_config(corpus, out, max_steps=20, resume=True), GPTConfig(**{**TINY_MODEL, "n_embd": 64}))
    with pytest.raises(CheckpointError, match="batch_size"):
        train(tiny_config(corpus, out, max_steps=20, resume=True, batch_size=8), GPTConfig(**TINY_MODEL))
    with pytest.raises(CheckpointError, match="--resume"):
        train(tiny_config(corpus, out, max_steps=20), GPTConfig(**TINY_MODEL))  # would overwrite a run
    # A longer max_steps is fine: the run continues.
    assert train(tiny_config(corpus, out, max_steps=20, resume=True), GPTConfig(**TINY_MODEL))["step"] == 20


def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    forward, calls = GPT.forward, {"n": 0}

    def poisoned(self, idx, targets=None, **kw):
        result = forward(self, idx, targets=targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] == 15:
                return result * float("nan")
        return result

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(TrainingDiverged, match="nan at step 15.*step_000010"):
        train(tiny_config(corpus, out, max_steps=30), GPTConfig(**TINY_MODEL))
    assert (out / "LATEST").read_text().strip() == "step_000010"
    model = GPT.from_pretrained(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_disk_full_while_saving_leaves_no_corrupt_checkpoint(corpus, tmp_path, monkeypatch):
    import gpt2.weights
    out = tmp_path / "run"
    train(tiny_config(corpus, out, max_steps=10), GPTConfig(**TINY_MODEL))
    before = GPT.from_pretrained(out).state_dict()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gpt2.weights, "_save_safetensors", full_disk)  # fails after trainer.pt was written
    with pytest.raises(CheckpointError, match="No space left on device.*step_000010"):
        train(tiny_config(corpus, out, max_steps=20, resume=True), GPTConfig(**TINY_MODEL))
    assert (out / "LATEST").read_text().strip() == "step_000010"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".step_", "step_"))) == ["step_000010"]
    after = GPT.from_pretrained(out).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    monkeypatch.undo()
    assert train(tiny_config(corpus, out, max_steps=20, resume=True), GPTConfig(**TINY_MODEL))["step"] == 20


def test_fine_tune_from_pretrained(corpus, tmp_path):
    """--init-from loads weights (here a Hugging Face directory) and trains them with the given dropout."""
    torch.manual_seed(0)
    GPT(GPTConfig(**TINY_MODEL)).save_pretrained(tmp_path / "hf")
    summary = train(tiny_config(corpus, tmp_path / "ft", init_from=str(tmp_path / "hf"), max_steps=10, dropout=0.1),
                    None)
    meta = json.loads((Path(summary["checkpoint"]) / "gpt2.json").read_text())
    assert meta["config"]["attn_pdrop"] == 0.1 and meta["step"] == 10


if __name__ == "__main__":
    if sys.argv[1:] == ["--regenerate-golden"]:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            losses = golden_losses(tmp)
        ASSETS.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"config": {**TINY_MODEL, **GOLDEN_RUN}, "losses": losses}, indent=1) + "\n")
        print(f"wrote {GOLDEN}: {len(losses)} losses, {losses[0]:.4f} -> {losses[-1]:.4f}")
    else:
        sys.exit(pytest.main([__file__, "-q"]))


def test_embedding_lr_scale_multiplies_the_first_adam_step(corpus, tmp_path):
    """Adam's first update is lr * g / (|g| + eps) ~ lr per element: the embedding's must be `scale` times larger."""
    init = GPT(GPTConfig(**TINY_MODEL))
    initial = {k: v.clone() for k, v in init.state_dict().items()}
    save_native(init, tmp_path / "init")

    def largest_updates(scale):
        out = tmp_path / f"run_{scale}"
        train(tiny_config(corpus, out, max_steps=1, warmup_steps=0, weight_decay=0.0, grad_clip=0.0,
                          init_from=str(tmp_path / "init"), embedding_lr_scale=scale, eval_interval=1), None)
        trained = GPT.from_pretrained(out).state_dict()
        return {k: (trained[k] - initial[k]).abs().max().item() for k in ("transformer.wte.weight",
                                                                         "transformer.h.0.mlp.c_fc.weight")}

    plain, scaled = largest_updates(1.0), largest_updates(4.0)
    assert plain["transformer.wte.weight"] == pytest.approx(1e-2, rel=1e-3)   # lr
    assert scaled["transformer.wte.weight"] == pytest.approx(4e-2, rel=1e-3)  # 4 * lr
    assert scaled["transformer.h.0.mlp.c_fc.weight"] == pytest.approx(plain["transformer.h.0.mlp.c_fc.weight"])


# --- dtype auto ----------------------------------------------------------------------------------

@pytest.fixture
def training_cache(tmp_path, monkeypatch):
    """The measured dtype choice goes to a private cache, never the user's."""
    from gpt2 import kernels
    monkeypatch.setattr(kernels, "default_cache_path", lambda: tmp_path / "cache" / "kernels.json")
    return tmp_path / "cache" / "training.json"


def test_dtype_auto_measures_records_and_a_resumed_run_keeps_it(corpus, tmp_path, training_cache, caplog):
    cfg = tiny_config(corpus, tmp_path / "auto", dtype="auto", max_steps=10)
    with caplog.at_level(logging.INFO, logger="gpt2.train"):
        train(cfg, GPTConfig(**TINY_MODEL))
    cached = json.loads(training_cache.read_text())["entries"]
    (entry,) = cached.values()
    chosen = entry["dtype"]
    assert chosen in ("float32", "bfloat16") and set(entry["step_s"]) == {"float32", "bfloat16"}
    assert chosen == min(entry["step_s"], key=entry["step_s"].get)  # the faster one
    assert f"dtype auto -> {chosen} (measured" in caplog.text
    recorded = json.loads((tmp_path / "auto" / "train_config.json").read_text())["train"]["dtype"]
    assert recorded == chosen
    # The cache now says the other dtype is faster; a resumed run still keeps the one it started with.
    other = "float32" if chosen == "bfloat16" else "bfloat16"
    training_cache.write_text(json.dumps({"version": MEASUREMENT_CACHE_VERSION, "entries": {
        k: {**v, "dtype": other} for k, v in cached.items()}}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpt2.train"):
        train(dataclasses.replace(cfg, max_steps=15, resume=True), GPTConfig(**TINY_MODEL))
    assert f"dtype auto -> {chosen} (the resumed checkpoint's)" in caplog.text
    # A new run reads the (edited) cache instead of measuring again.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpt2.train"):
        train(dataclasses.replace(cfg, out=str(tmp_path / "auto2")), GPTConfig(**TINY_MODEL))
    assert f"dtype auto -> {other} (cache" in caplog.text


def test_lm_head_auto_measures_records_and_a_resumed_run_keeps_it(corpus, tmp_path, training_cache, caplog):
    """The fused loss's plan (lm_head.py): measured for this micro-batch, shown in the first log line,
    recorded in train_config.json; a resumed run keeps it even when the cache now says otherwise."""
    head_cache = training_cache.with_name("lm_head.json")
    cfg = tiny_config(corpus, tmp_path / "auto", max_steps=10)
    with caplog.at_level(logging.INFO, logger="gpt2.train"):
        train(cfg, GPTConfig(**TINY_MODEL))
    cached = json.loads(head_cache.read_text())["entries"]
    (key, entry), = cached.items()
    assert json.loads(key)["rows"] == cfg.batch_size * cfg.seq_len and json.loads(key)["dtype"] == "float32"
    chosen = entry["plan"]
    assert f"lm_head {chosen} (measured" in caplog.text.split("model: ", 1)[1].splitlines()[0]
    assert json.loads((tmp_path / "auto" / "train_config.json").read_text())["train"]["lm_head"] == chosen
    other = "aten:3:6"
    head_cache.write_text(json.dumps({"version": MEASUREMENT_CACHE_VERSION,
                                      "entries": {key: {**entry, "plan": other}}}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpt2.train"):
        train(dataclasses.replace(cfg, max_steps=15, resume=True), GPTConfig(**TINY_MODEL))
    assert f"lm_head {chosen} (the resumed checkpoint's)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpt2.train"):  # a new run reads the edited cache
        train(dataclasses.replace(cfg, out=str(tmp_path / "auto2")), GPTConfig(**TINY_MODEL))
    assert f"lm_head {other} (cache" in caplog.text
    with pytest.raises(ConfigError, match="lm_head plan"):
        TrainConfig(lm_head="onednn:64")


def test_bf16_reaches_the_float32_loss_per_token(corpus, tmp_path):
    """Same tokens, same steps: bf16 autocast's val loss is within 1% of float32's."""
    fp32 = tiny_config(corpus, tmp_path / "fp32", max_steps=60, eval_interval=60, checkpoint_interval=60)
    bf16 = dataclasses.replace(fp32, out=str(tmp_path / "bf16"), dtype="bfloat16")
    a = train(fp32, GPTConfig(**TINY_MODEL))["val_loss"]
    b = train(bf16, GPTConfig(**TINY_MODEL))["val_loss"]
    assert abs(a - b) <= 0.01 * a, (a, b)


# ---------------------------------------------------------------------------------------------
# in the loop: HellaSwag, Weights & Biases, TensorBoard
# ---------------------------------------------------------------------------------------------

def _hellaswag_file(path: Path) -> Path:
    rows = [{"ctx": "The man opens the door and", "endings": [" walks in.", " sings.", " it rains.", " a cat."], "label": 0},
            {"ctx": "She picks up the pen", "endings": [" and writes.", " then.", " blue sky.", " swims."], "label": 1},
            {"ctx": "A dog runs", "endings": [" fast.", " to the park quickly.", " up.", " on the moon."], "label": 2},
            {"ctx": "Water boils at", "endings": [" 100 degrees.", " night.", " home.", " the end of the road."],
             "label": 3},
            {"ctx": "He reads", "endings": [" a book.", " the sun.", " loudly in bed.", " shoes."], "label": 0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hellaswag_in_the_loop_logs_acc_norm_and_the_plot(corpus, tmp_path):
    from gpt2 import evaluate
    from gpt2.config import GPT2_VOCAB_SIZE
    from gpt2.tokenizer import Tokenizer
    hs = _hellaswag_file(tmp_path / "hellaswag.jsonl")
    out = tmp_path / "run"
    train(tiny_config(corpus, out, max_steps=10, eval_interval=5, checkpoint_interval=10, hellaswag=str(hs),
                      hellaswag_interval=10), GPTConfig(**{**TINY_MODEL, "vocab_size": GPT2_VOCAB_SIZE}))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [5, 10] and "hellaswag_acc_norm" not in metrics[0]
    # The reference: gpt2.evaluate.hellaswag on the final checkpoint, outside the loop.
    model, tok = GPT.from_pretrained(out).eval(), Tokenizer.gpt2()
    expected = evaluate.hellaswag(model, tok, hs)
    assert metrics[1]["hellaswag_acc_norm"] == pytest.approx(expected["acc_norm"], abs=1e-12)
    assert metrics[1]["hellaswag_acc_token_norm"] == pytest.approx(expected["acc_token_norm"], abs=1e-12)
    # Ranks' shares (as the loop splits them under torchrun) add up to the whole.
    shares = [evaluate.hellaswag(model, tok, hs, rank=r, world_size=2) for r in (0, 1)]
    assert [s["examples"] for s in shares] == [3, 2]
    assert sum(s["acc_norm"] * s["examples"] for s in shares) == pytest.approx(expected["acc_norm"] * 5)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match="multiple of eval_interval"):
        tiny_config(corpus, out, hellaswag=str(hs), hellaswag_interval=7, eval_interval=5)
    with pytest.raises(ConfigError, match="GPT-2's vocabulary"):
        train(tiny_config(corpus, tmp_path / "run2", hellaswag=str(hs)), GPTConfig(**TINY_MODEL))


def test_tensorboard_gets_the_metrics(corpus, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, tb = tmp_path / "run", tmp_path / "tb"
    train(tiny_config(corpus, out, max_steps=10, eval_interval=5, tensorboard=str(tb)), GPTConfig(**TINY_MODEL))
    events = EventAccumulator(str(tb))
    events.Reload()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [e.step for e in events.Scalars("eval/val_loss")] == [m["step"] for m in metrics] == [5, 10]
    assert [e.value for e in events.Scalars("eval/val_loss")] == pytest.approx([m["val_loss"] for m in metrics],
                                                                               rel=1e-6)  # TensorBoard stores float32
    assert [e.step for e in events.Scalars("train/train_loss")] == list(range(1, 11))
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([s["lr"] for s in steps], rel=1e-6)


@pytest.mark.slow  # wandb starts its service process
def test_wandb_offline_run_is_written_without_network(corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(tiny_config(corpus, out, max_steps=10, eval_interval=5, wandb="gpt2-test"), GPTConfig(**TINY_MODEL))
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and b"val_loss" in runs[0].read_bytes() and b"train_loss" in runs[0].read_bytes()


def test_trackers_without_their_packages_are_a_clear_error(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ConfigError, match=r"wandb package.*gpt2\[track\]"):
        train(tiny_config(corpus, tmp_path / "run", max_steps=2, wandb="p"), GPTConfig(**TINY_MODEL))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"tensorboard package"):
        train(tiny_config(corpus, tmp_path / "run3", max_steps=2, tensorboard=str(tmp_path / "tb")),
              GPTConfig(**TINY_MODEL))
