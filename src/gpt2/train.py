"""The training loop: from scratch or from pretrained weights, one CPU to many GPUs, with exact resume.

    gpt2 prepare shakespeare --out data/shakespeare
    gpt2 train --preset quickstart --data data/shakespeare --out runs/quickstart          # ~5 min, 2 CPU cores
    gpt2 train --preset quickstart --data data/shakespeare --out runs/quickstart --resume
    torchrun --nproc_per_node=8 -m gpt2 train --preset gpt2-124M --data data/fineweb --out runs/124M

    from gpt2.train import TrainConfig, train
    train(TrainConfig(data="data/shakespeare", out="runs/x", max_steps=100), GPTConfig(n_layer=2, n_embd=128, n_head=2))

One step: grad_accum micro-batches (forward under autocast, backward; DDP syncs gradients on the last
one only), then the gradient norm is clipped and AdamW (betas 0.9/0.95, weight decay on 2-D weights
only) takes a step at the scheduled learning rate: linear warmup, then cosine or warmup-stable-decay
(WSD) down to min_lr. Parameters (master weights) and optimizer state stay float32 in every precision.

Every eval_interval steps: val loss and perplexity, a line in OUT/metrics.jsonl, OUT/loss.png redrawn,
and a few sampled lines. Every checkpoint_interval steps (and at the end): a checkpoint (checkpoint.py)
holding weights, optimizer, schedule step, data-iterator position and RNG states, so that `--resume`
continues exactly where the newest checkpoint left off: with --deterministic (the default on CPU) the
losses after a resume equal those of an uninterrupted run, bit for bit.

A time budget (max_minutes) ends the run when the training time is spent, and the schedule's progress
follows the clock instead of the step count, so the learning rate decays to min_lr exactly at the end.
Such a run depends on the machine's speed and so is not reproducible step for step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from gpt2 import checkpoint
from gpt2.config import GPTConfig
from gpt2.data import DataLoader
from gpt2.distributed import (DistInfo, all_reduce_mean, barrier, broadcast_object, full_optimizer_state,
                              full_state_dict, init_distributed, load_optimizer_state, teardown, wrap_model)
from gpt2.errors import CheckpointError, ConfigError, DataError, GPT2Error
from gpt2.model import GPT
from gpt2.atomic import atomic_write_bytes
from gpt2.weights import load_model

AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCHEDULES = ("cosine", "wsd")
# Assumed peak FLOP/s of the CPU device (all its cores) for the MFU estimate: the float32 GEMM rate
# measured on the 2-core development machine (~0.3 TFLOP/s). An assumption, hence --peak-tflops.
DEFAULT_CPU_PEAK_TFLOPS = 0.3
# Dense bf16 peaks (TFLOP/s) of common GPUs, matched by name; others need --peak-tflops.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0,
                   "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0, "T4": 65.0}


class TrainingDiverged(GPT2Error, RuntimeError):
    """The loss became NaN or infinite; the run stopped and the last good checkpoint was kept."""


@dataclass
class TrainConfig:
    data: str = "data/shakespeare"       # a prepared directory (gpt2 prepare) with train and val shards
    out: str = "runs/train"              # run directory: checkpoints, LATEST, metrics.jsonl, loss.png
    init_from: str | None = None         # fine-tune: a checkpoint, Hugging Face directory or hub name
    resume: bool = False                 # continue from OUT's newest checkpoint
    # batch
    batch_size: int = 8                  # sequences per micro-batch per rank
    seq_len: int = 256
    total_batch_tokens: int | None = None  # accumulate gradients up to this many tokens per step
    data_mode: str = "random"            # DataLoader mode: random windows or sequential epochs
    # optimizer and schedule
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 100
    schedule: str = "cosine"             # cosine | wsd (warmup-stable-decay)
    decay_fraction: float = 0.2          # wsd: the last fraction of the run decays linearly to min_lr
    weight_decay: float = 0.1            # on 2-D weights only (matmuls and embeddings)
    beta1: float = 0.9
    beta2: float = 0.95
    embedding_lr_scale: float = 1.0      # lr multiplier for wte (tied with lm_head) and wpe
    grad_clip: float = 1.0               # max global gradient norm; 0 disables
    max_steps: int = 1000
    max_minutes: float | None = None     # time budget for the training loop (the schedule follows it)
    # model options
    dropout: float | None = None         # all three GPT-2 dropout rates; None keeps the model config's
    vocab_multiple: int | None = None    # pad wte/lm_head rows (logits stay vocab_size); None: 64 on CUDA, 1 on CPU,
                                         # where the sliced-logits copy costs more than padding saves (BENCHMARKS.md)
    # evaluation, checkpoints, logging
    eval_interval: int = 100
    eval_batches: int = 20
    checkpoint_interval: int = 500
    keep_last: int = 3                   # checkpoints kept; 0 keeps all
    num_samples: int = 2                 # sampled lines printed at each eval (0 disables)
    sample_tokens: int = 48
    sample_prompt: str = "\n"
    progress: bool = True                # tqdm progress bar (rank 0)
    peak_tflops: float | None = None     # the device's peak for the MFU estimate; None: a known GPU or the CPU default
    # execution
    seed: int = 1337
    device: str = "cpu"
    dtype: str = "float32"               # autocast dtype: float32 (none), bfloat16, float16 (CUDA, with GradScaler)
    compile: bool = False
    activation_checkpointing: bool = False
    parallel: str = "ddp"                # under torchrun: ddp or fsdp (FSDP2 fully_shard)
    deterministic: bool | None = None    # torch.use_deterministic_algorithms; None: on for CPU
    threads: int | None = None           # torch.set_num_threads; None leaves PyTorch's default

    def __post_init__(self):
        if self.vocab_multiple is None:
            self.vocab_multiple = 64 if self.device.startswith("cuda") else 1
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} is not supported; choose one of {', '.join(SCHEDULES)}")
        if self.dtype not in AUTOCAST_DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(AUTOCAST_DTYPES)}")
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ConfigError("float16 training needs CUDA (a GradScaler); use --dtype bfloat16 on CPU")
        for name in ("batch_size", "seq_len", "max_steps", "eval_interval", "eval_batches", "checkpoint_interval",
                     "vocab_multiple"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= min_lr <= lr and lr > 0 (lr={self.lr}, min_lr={self.min_lr})")
        if self.warmup_steps < 0 or self.keep_last < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("warmup_steps, keep_last, grad_clip and weight_decay must not be negative")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ConfigError(f"max_minutes must be positive, got {self.max_minutes}")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")


# Training presets: TrainConfig fields plus the model (a GPTConfig preset name or GPTConfig fields).
PRESETS: dict[str, dict] = {
    # 2 CPU cores, 5 minutes, Shakespeare. The tied 50257-wide lm_head is most of the FLOPs at these
    # widths, so a narrow model sees more tokens: width 96 reaches a lower val loss in 5 minutes than
    # 128 or 256 (4.94 vs 5.05 vs 5.37), and 8 layers lose to 4 (BENCHMARKS.md, Training). Small
    # batches (1K tokens/step: B=8 beats 4 and 16), lr 1e-3 (2e-3 is worse), wte/wpe at 10x the lr,
    # beta2 0.99, and warmup-stable-decay with the last 40% decaying to 0 exactly at the time budget
    # (0.05 better than cosine). No dropout: the run sees under one epoch. Context 128 = seq_len, so
    # no position embedding goes untrained (prompt + generated tokens <= 128). One eval, at the end, on
    # 32K val tokens: a mid-run eval would spend the budget's seconds on forward passes.
    "quickstart": dict(
        model=dict(n_layer=4, n_head=4, n_embd=96, n_positions=128, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0),
        batch_size=8, seq_len=128, lr=1e-3, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_fraction=0.4,
        weight_decay=0.1, beta2=0.99, embedding_lr_scale=10.0, max_steps=100_000, max_minutes=4.5,
        eval_interval=100_000, eval_batches=32, checkpoint_interval=100_000, keep_last=2, dtype="float32",
        vocab_multiple=1),
    # The published 124M reproduction (nanoGPT / llm.c): ~0.5M tokens per step, lr 6e-4 with 715 warmup
    # steps, cosine to 6e-5 over 19,073 steps = 10B tokens. For GPUs: bf16, compile, flash attention (SDPA).
    "gpt2-124M": dict(
        model="gpt2", batch_size=16, seq_len=1024, total_batch_tokens=524_288, lr=6e-4, min_lr=6e-5,
        warmup_steps=715, schedule="cosine", weight_decay=0.1, max_steps=19_073, dropout=0.0,
        eval_interval=250, eval_batches=20, checkpoint_interval=2000, keep_last=3, device="cuda",
        dtype="bfloat16", compile=True),
}


def preset_configs(name: str, **overrides) -> tuple[TrainConfig, GPTConfig]:
    """(TrainConfig, GPTConfig) of a training preset, with TrainConfig field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown training preset {name!r}; presets are {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    model = fields.pop("model")
    model_config = GPTConfig.preset(model) if isinstance(model, str) else GPTConfig(**model)
    return TrainConfig(**{**fields, **overrides}), model_config


# ---------------------------------------------------------------------------------------------
# schedule, FLOPs
# ---------------------------------------------------------------------------------------------

def learning_rate(cfg: TrainConfig, step: int, progress: float) -> float:
    """lr for optimizer step `step` (0-based); progress in [0, 1] is how far past warmup the run is."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    if cfg.schedule == "cosine":
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    stable = 1.0 - cfg.decay_fraction  # wsd
    if progress < stable:
        return cfg.lr
    return cfg.lr - (cfg.lr - cfg.min_lr) * (progress - stable) / cfg.decay_fraction


def step_progress(cfg: TrainConfig, step: int) -> float:
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    return (step - cfg.warmup_steps) / span


def flops_per_token(model: GPT, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward + backward) plus 12 L C T for attention."""
    c = model.config
    n = model.num_parameters() - c.n_positions * c.n_embd  # wpe is a lookup, not a matmul; wte is lm_head
    return 6 * n + 12 * c.n_layer * c.n_embd * seq_len


def peak_flops(cfg: TrainConfig, device: str) -> float:
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return 312e12  # unknown GPU: an A100's bf16 peak, as an assumption
    return DEFAULT_CPU_PEAK_TFLOPS * 1e12


# ---------------------------------------------------------------------------------------------
# model, optimizer
# ---------------------------------------------------------------------------------------------

def set_dropout(model: GPT, p: float) -> None:
    """Set all three GPT-2 dropout rates of a built model (the config records them too)."""
    model.config = dataclasses.replace(model.config, embd_pdrop=p, attn_pdrop=p, resid_pdrop=p)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p  # attention reads attn_dropout.p for SDPA's dropout_p


def build_model(cfg: TrainConfig, model_config: GPTConfig | None) -> GPT:
    """Random init (seeded) from model_config, or pretrained weights from cfg.init_from; float32."""
    if cfg.init_from:
        model = load_model(cfg.init_from, dtype=torch.float32, vocab_multiple=cfg.vocab_multiple)
    else:
        if model_config is None:
            raise ConfigError("no model: give a model config (preset or sizes) or init_from")
        torch.manual_seed(cfg.seed)
        model = GPT(model_config, vocab_multiple=cfg.vocab_multiple)
        with torch.no_grad():
            # Padding rows are never looked up and their logits are sliced off; zero, they get zero
            # gradients and stay exactly zero, so a checkpoint (which drops them) loses nothing.
            model.transformer.wte.weight[model.config.vocab_size:].zero_()
    if cfg.dropout is not None:
        set_dropout(model, cfg.dropout)
    return model.train()


def apply_activation_checkpointing(model: GPT) -> None:
    """Recompute each block's activations in backward; set on the instances, so parameter names stay."""
    from torch.utils.checkpoint import checkpoint as ckpt
    for block in model.transformer.h:
        forward = block.forward
        block.forward = lambda *args, _f=forward, **kw: ckpt(_f, *args, use_reentrant=False, **kw)


def make_optimizer(cfg: TrainConfig, model: nn.Module, device: str, sharded: bool) -> torch.optim.Optimizer:
    """AdamW; weight decay on 2-D tensors (matmul weights, embeddings), not on biases and LayerNorms."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied lm_head is listed once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if cfg.embedding_lr_scale != 1.0:
        # Embedding rows of rare tokens see few, sparse updates; a larger step size lets a short run
        # learn them (measured on the quickstart: BENCHMARKS.md, Training). The loop multiplies the
        # scheduled lr by each group's lr_scale.
        embeddings = [p for name, p in model.named_parameters() if name.endswith(("wte.weight", "wpe.weight"))]
        ids = {id(p) for p in embeddings}
        groups[0]["params"] = [p for p in groups[0]["params"] if id(p) not in ids]
        groups.append({"params": embeddings, "weight_decay": cfg.weight_decay, "lr_scale": cfg.embedding_lr_scale})
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if not sharded:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)  # one kernel for all parameters (CPU and CUDA)
        except (RuntimeError, TypeError):
            pass
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


# ---------------------------------------------------------------------------------------------
# evaluation, samples, logs
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: nn.Module, cfg: TrainConfig, info: DistInfo, autocast) -> float:
    """Mean val loss over eval_batches fixed batches (the same windows at every eval), averaged over ranks."""
    loader = DataLoader(cfg.data, split="val", batch_size=cfg.batch_size, seq_len=cfg.seq_len, mode="random",
                        seed=cfg.seed + 1, rank=info.rank, world_size=info.world_size)
    model.eval()
    total = torch.zeros((), device=info.device)
    for _ in range(cfg.eval_batches):
        x, y = loader.next_batch()
        with autocast():
            total += model(x.to(info.device), targets=y.to(info.device)).float()
    model.train()
    return all_reduce_mean(total / cfg.eval_batches, info).item()


@torch.no_grad()
def sample_lines(model: GPT, cfg: TrainConfig, device: str) -> list[str]:
    """A few sampled continuations of sample_prompt (engine.generate when present), decoded."""
    from gpt2.tokenizer import Tokenizer
    tok = Tokenizer.gpt2()
    if model.config.vocab_size != tok.n_vocab:
        return []  # a toy vocabulary: nothing readable to show
    prompt = tok.encode(cfg.sample_prompt) or [tok.eot_token]
    prompts = [list(prompt) for _ in range(cfg.num_samples)]
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):  # sampling never disturbs the training RNG stream
        try:
            from gpt2.engine import generate
        except ImportError:
            generate = _naive_generate
        outs = generate(model, prompts, max_new_tokens=cfg.sample_tokens, temperature=0.8, top_k=200, seed=cfg.seed)
    model.train(was_training)
    return [cfg.sample_prompt + tok.decode(out) for out in outs]  # generate returns the new ids only


def _naive_generate(model, prompts, max_new_tokens, temperature, top_k, seed):
    """The fallback when engine.py is absent: no cache, one prompt at a time."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    outs = []
    for prompt in prompts:
        idx = torch.tensor([prompt], device=device)
        for _ in range(max_new_tokens):
            logits = model(idx[:, -model.config.n_positions:])[:, -1, :] / temperature
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
            nxt = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=gen)
            idx = torch.cat([idx, nxt], dim=1)
        outs.append(idx[0, len(prompt):].tolist())
    return outs


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the lines a killed run wrote after its newest checkpoint; the resumed run writes them again."""
    if path.exists():
        kept = [r for r in _read_jsonl(path) if r["step"] <= last_step]
        atomic_write_bytes(path, lambda tmp: Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in kept)))


def plot_losses(out: Path) -> Path:
    """OUT/loss.png from steps.jsonl and metrics.jsonl, written atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps, evals = _read_jsonl(out / "steps.jsonl"), _read_jsonl(out / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if steps:
        ax.plot([r["step"] for r in steps], [r["train_loss"] for r in steps], lw=0.8, alpha=0.7, label="train")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "loss.png"
    atomic_write_bytes(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------

# TrainConfig fields a resumed run must share with its checkpoint: they change the computation.
RESUME_MUST_MATCH = ("batch_size", "seq_len", "total_batch_tokens", "data_mode", "lr", "min_lr", "warmup_steps",
                     "schedule", "decay_fraction", "weight_decay", "beta1", "beta2", "embedding_lr_scale", "grad_clip",
                     "seed", "dtype",
                     "vocab_multiple")  # max_steps and max_minutes may grow: the run continues


def _check_resume(ckpt: checkpoint.Checkpoint, cfg: TrainConfig, model: GPT, world_size: int) -> None:
    problems = []
    saved_model = ckpt.meta.get("config", {})
    for key, value in model.config.to_dict().items():
        if saved_model.get(key) != value:
            problems.append(f"model {key}: checkpoint {saved_model.get(key)!r}, now {value!r}")
    saved = ckpt.meta.get("train_config", {})
    for key in RESUME_MUST_MATCH:
        if saved.get(key) != getattr(cfg, key):
            problems.append(f"{key}: checkpoint {saved.get(key)!r}, now {getattr(cfg, key)!r}")
    if ckpt.meta.get("world_size") != world_size:
        problems.append(f"world size: checkpoint {ckpt.meta.get('world_size')}, now {world_size}")
    if problems:
        raise CheckpointError(f"cannot resume from {ckpt.path}: it was written by a different configuration: "
                              + "; ".join(problems) + ". Use the same flags, or a new --out.")


def train(cfg: TrainConfig, model_config: GPTConfig | None = None) -> dict:
    """Run training; returns a summary (final step, losses, checkpoint path, tokens/s)."""
    info = init_distributed(cfg.device)
    try:
        return _train(cfg, model_config, info)
    finally:
        teardown(info)


def _train(cfg: TrainConfig, model_config: GPTConfig | None, info: DistInfo) -> dict:
    device = info.device
    out = Path(cfg.out)
    log = print if info.is_main else (lambda *a, **k: None)  # only rank 0 prints
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.deterministic if cfg.deterministic is not None else not device.startswith("cuda"):
        torch.use_deterministic_algorithms(True)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but no CUDA device is available")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # Data first: a missing or empty directory fails before any model is built.
    if not Path(cfg.data).exists():
        raise DataError(f"{cfg.data}: no such data directory. Fix: run `gpt2 prepare shakespeare --out {cfg.data}` "
                        "(or `gpt2 prepare FILES --out DIR`) first.")
    tokens_per_micro = cfg.batch_size * cfg.seq_len * info.world_size
    grad_accum = max(1, round((cfg.total_batch_tokens or tokens_per_micro) / tokens_per_micro))
    tokens_per_step = tokens_per_micro * grad_accum
    loader = DataLoader(cfg.data, split="train", batch_size=cfg.batch_size, seq_len=cfg.seq_len, mode=cfg.data_mode,
                        seed=cfg.seed, rank=info.rank, world_size=info.world_size)
    DataLoader(cfg.data, split="val", batch_size=cfg.batch_size, seq_len=cfg.seq_len, mode="random", seed=0)  # val exists?

    model = build_model(cfg, model_config)
    if cfg.seq_len > model.config.n_positions:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's context length {model.config.n_positions}")
    ckpt = None
    if cfg.resume:
        path = checkpoint.latest(out)
        if path is None:
            log(f"--resume: no checkpoint in {out} yet; starting from step 0")
        else:
            ckpt = checkpoint.load(path)
            _check_resume(ckpt, cfg, model, info.world_size)
            saved = load_model(path, dtype=torch.float32, vocab_multiple=cfg.vocab_multiple)
            model.load_state_dict(saved.state_dict())
            del saved
    elif checkpoint.latest(out) is not None:
        raise CheckpointError(f"{out} already holds a run (LATEST exists). Pass --resume to continue it, "
                              "or choose a new --out.")
    model.to(device)
    raw_model = model  # the GPT itself: evaluation, sampling and checkpoints use it
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    model = wrap_model(model, info, cfg.parallel)
    sharded = info.enabled and cfg.parallel == "fsdp"
    optimizer = make_optimizer(cfg, model, device, sharded)
    if cfg.compile:
        model = torch.compile(model)

    autocast_dtype = AUTOCAST_DTYPES[cfg.dtype]
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    autocast = (lambda: torch.autocast(device_type, dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.dtype == "float16")

    step, elapsed_before, tokens_seen = 0, 0.0, 0
    torch.manual_seed(cfg.seed + info.rank)  # dropout masks differ per rank, reproducibly
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    if ckpt is not None:
        state = ckpt.trainer_state
        load_optimizer_state(optimizer, model, state["optimizer"], info, cfg.parallel)
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        loader.load_state_dict(checkpoint.from_storable(state["data"][info.rank]))
        checkpoint.set_rng_state(state["rng"][info.rank])
        step, elapsed_before, tokens_seen = ckpt.meta["step"], ckpt.meta["elapsed_s"], ckpt.meta["tokens"]
        if info.is_main:
            for name in ("metrics.jsonl", "steps.jsonl"):
                _truncate_jsonl(out / name, step)
        log(f"resumed from {ckpt.path} at step {step}")
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(
            {"train": dataclasses.asdict(cfg), "model": raw_model.config.to_dict()}, indent=2) + "\n")

    flops_token = flops_per_token(raw_model, cfg.seq_len)
    peak = peak_flops(cfg, device) * info.world_size
    budget_s = cfg.max_minutes * 60 if cfg.max_minutes else None
    log(f"model: {raw_model.num_parameters():,} parameters ({raw_model.config.n_layer} layers, width "
        f"{raw_model.config.n_embd}); {tokens_per_step:,} tokens/step = {cfg.batch_size} x {cfg.seq_len} x "
        f"{info.world_size} rank(s) x {grad_accum} accumulation; dtype {cfg.dtype}; device {device}")

    def save(step: int, val_loss: float | None) -> Path | None:
        """Every rank calls this (FSDP gathers); rank 0 writes. Raises CheckpointError on I/O failure."""
        params = full_state_dict(model, info, cfg.parallel)
        opt_state = full_optimizer_state(optimizer, model, info, cfg.parallel)
        data_states = _gather(checkpoint.to_storable(loader.state_dict()), info)
        rng_states = _gather(checkpoint.rng_state(), info)
        path = None
        if info.is_main:
            if sharded:
                with torch.device("meta"):
                    shell = GPT(raw_model.config, vocab_multiple=cfg.vocab_multiple)
                params["lm_head.weight"] = params["transformer.wte.weight"]  # tied: listed once
                shell.load_state_dict(params, assign=True)
                shell.lm_head.weight = shell.transformer.wte.weight
            else:
                shell = raw_model
            trainer_state = {"optimizer": opt_state, "rng": rng_states, "data": data_states,
                             "scaler": scaler.state_dict() if scaler.is_enabled() else {}}
            meta = {"train_config": dataclasses.asdict(cfg), "elapsed_s": elapsed_before + (time.time() - t_start),
                    "tokens": tokens_seen, "world_size": info.world_size, "val_loss": val_loss}
            try:
                path = checkpoint.save(out, step, shell, trainer_state, meta, keep_last=cfg.keep_last)
            except OSError as e:
                last = checkpoint.latest(out)
                raise CheckpointError(f"could not write the checkpoint for step {step} in {out} ({e.strerror or e}); "
                                      f"nothing partial was left behind; the last good checkpoint is "
                                      f"{last or 'none'}") from None
        barrier(info)
        return path

    from tqdm import tqdm
    # Redraw in place on a terminal; in a log file every redraw is appended, so redraw rarely there.
    # With a time budget the bar counts its seconds (so the ETA is the real one; the run also stops at
    # max_steps, if that comes first), and the step goes into the postfix.
    timed = budget_s is not None
    bar = tqdm(total=round(budget_s) if timed else cfg.max_steps, initial=round(elapsed_before) if timed else step,
               disable=not (cfg.progress and info.is_main), unit="s" if timed else "step", dynamic_ncols=True,
               mininterval=0.1 if sys.stderr.isatty() else 15.0,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}{postfix}]" if timed else None)
    t_start = time.time()
    t_window, tokens_window, losses_window = time.time(), 0, []
    last_val, last_path, tok_s, mfu = None, None, 0.0, 0.0
    done = step >= cfg.max_steps or (budget_s is not None and elapsed_before >= budget_s)
    while not done:
        # --- one optimizer step ------------------------------------------------------------------
        elapsed_train = elapsed_before + time.time() - t_start
        progress = step_progress(cfg, step)
        if budget_s:
            progress = max(progress, elapsed_train / budget_s)
        lr = learning_rate(cfg, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = loader.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last = micro == grad_accum - 1
            with _grad_sync(model, info, cfg.parallel, last), autocast():
                loss = model(x, targets=y) / grad_accum
            scaler.scale(loss).backward()
            loss_sum += loss.detach()
        train_loss = all_reduce_mean(loss_sum, info).item()
        if not math.isfinite(train_loss):
            optimizer.zero_grad(set_to_none=True)
            bar.close()
            last = checkpoint.latest(out) if info.is_main else None
            raise TrainingDiverged(f"the training loss is {train_loss} at step {step + 1}; stopped before applying "
                                   f"this update. The last good checkpoint is {last or 'none (none was written yet)'}; "
                                   "resume from it with --resume and a lower --lr or a longer --warmup-steps.")
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        else:
            grad_norm = float("nan")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        tokens_window += tokens_per_step
        losses_window.append(train_loss)
        if info.is_main:
            _append_jsonl(out / "steps.jsonl", {"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm})

        dt = time.time() - t_window
        tok_s = tokens_window / dt if dt > 0 else 0.0
        mfu = flops_token * tok_s / peak
        elapsed_train = elapsed_before + time.time() - t_start
        bar.update(min(round(elapsed_train), bar.total) - bar.n if timed else 1)
        bar.set_postfix_str(f"{f'step {step} | ' if timed else ''}loss {train_loss:.3f} | {tok_s:,.0f} tok/s | "
                            f"MFU {100 * mfu:.1f}%", refresh=False)

        out_of_time = budget_s is not None and elapsed_train >= budget_s
        done = step >= cfg.max_steps or broadcast_object(out_of_time, info)

        # --- eval, checkpoint -----------------------------------------------------------------
        if step % cfg.eval_interval == 0 or done:
            last_val = evaluate(raw_model if not sharded else model, cfg, info, autocast)
            record = {"step": step, "train_loss": sum(losses_window) / len(losses_window), "val_loss": last_val,
                      "val_ppl": math.exp(min(last_val, 50.0)), "lr": lr, "tokens": tokens_seen,
                      "tokens_per_s": tok_s, "mfu": mfu, "elapsed_s": round(elapsed_train, 3)}
            if info.is_main:
                _append_jsonl(out / "metrics.jsonl", record)
                plot_losses(out)
                bar.write(f"step {step}: train {record['train_loss']:.4f} | val {last_val:.4f} "
                          f"(ppl {record['val_ppl']:.1f}) | {tok_s:,.0f} tok/s | MFU {100 * mfu:.1f}% | "
                          f"{elapsed_train:.0f}s")
                if cfg.num_samples and not sharded and not done:
                    for line in sample_lines(raw_model, cfg, device):
                        bar.write("  > " + line.replace("\n", " ")[:200])
            t_window, tokens_window, losses_window = time.time(), 0, []
        if step % cfg.checkpoint_interval == 0 or done:
            last_path = save(step, last_val)
    bar.close()

    samples = []
    if info.is_main and cfg.num_samples and not sharded:
        samples = sample_lines(raw_model, cfg, device)
        for line in samples:
            log("sample: " + line)
    summary = {"step": step, "val_loss": last_val, "tokens_per_s": tok_s, "mfu": mfu,
               "elapsed_s": elapsed_before + time.time() - t_start, "checkpoint": str(last_path) if last_path else None,
               "out": str(out), "loss_png": str(out / "loss.png"), "samples": samples}
    if info.is_main and last_path is not None:
        log(f"checkpoint: {last_path}  (GPT.from_pretrained('{out}') or gpt2 generate --model {out})")
        log(f"loss curve: {out / 'loss.png'}   metrics: {out / 'metrics.jsonl'}")
    return summary


def _grad_sync(model: nn.Module, info: DistInfo, mode: str, sync: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if not info.enabled:
        return contextlib.nullcontext()
    inner = getattr(model, "_orig_mod", model)
    if mode == "ddp":
        return contextlib.nullcontext() if sync else inner.no_sync()
    inner.set_requires_gradient_sync(sync)  # FSDP2
    return contextlib.nullcontext()


def _gather(obj, info: DistInfo) -> list:
    """Every rank's object, as a list on rank 0 (one per rank); [obj] on one process."""
    if not info.enabled:
        return [obj]
    import torch.distributed as dist
    objects = [None] * info.world_size
    dist.all_gather_object(objects, obj)
    return objects
