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
and a few sampled lines. With --hellaswag FILE, every hellaswag_interval steps (a multiple of
eval_interval) the same line also gets hellaswag_acc_norm (lm-eval-harness's, per character) and
hellaswag_acc_token_norm (llm.c's "acc_norm", per token), scored by gpt2.evaluate.hellaswag; under
torchrun each rank scores its share of the examples and the hits are summed (FSDP: every rank scores
all, since a sharded forward needs every rank). --wandb PROJECT and --tensorboard DIR send the same
numbers (as eval/*, and each step's loss, lr and grad norm as train/*) to Weights & Biases (WANDB_MODE=offline needs no
network) and TensorBoard from rank 0 (`Trackers`); both are optional extras, loss.png needs neither. Every checkpoint_interval steps (and at the end): a checkpoint (checkpoint.py)
holding weights, optimizer, schedule step, data-iterator position and RNG states, so that `--resume`
continues exactly where the newest checkpoint left off: with --deterministic (the default on CPU) the
losses after a resume equal those of an uninterrupted run, bit for bit.

A time budget (max_minutes) ends the run when the training time is spent, and the schedule's progress
follows the clock instead of the step count, so the learning rate decays to min_lr exactly at the end.
Such a run depends on the machine's speed and so is not reproducible step for step.

The loop (_train) reads as its sections: train_step, log_step, evaluate_and_log, save_checkpoint,
over a LoopState (step, elapsed time, tokens, last val loss: what a checkpoint's meta records and a
resume restores). train() sets torch's process-wide settings (threads, deterministic algorithms, TF32)
for the run only (torch_settings). Messages go through logging (the gpt2.train logger, rank 0 only);
where no logging is configured, as under the CLI, train() shows them on stdout above the progress bar.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from gpt2 import checkpoint
from gpt2.atomic import atomic_write_bytes, atomic_write_json
from gpt2.config import GPT2_EOT, GPT2_VOCAB_SIZE, GPTConfig
from gpt2.data import DataLoader
from gpt2.distributed import (DistInfo, all_reduce_mean, barrier, broadcast_object, full_model, full_optimizer_state,
                              gather_object, grad_sync, init_distributed, load_optimizer_state, teardown, wrap_model)
from gpt2.errors import CheckpointError, ConfigError, DataError, GPT2Error
from gpt2.lm_head import HeadPlan
from gpt2.model import GPT
from gpt2.weights import load_model, parse_dtype

log = logging.getLogger(__name__)  # rank 0 only; train() shows it on stdout when logging is not configured

SCHEDULES = ("cosine", "wsd")
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
    vocab_multiple: int = 64             # pad wte/lm_head rows (logits stay vocab_size): 50,257 -> 50,304 suits
                                         # GEMM kernels; bf16 on a CPU gains 1.4-1.5x from it (BENCHMARKS.md, Training)
    # evaluation, checkpoints, logging
    eval_interval: int = 100
    eval_batches: int = 20
    checkpoint_interval: int = 500
    keep_last: int = 3                   # checkpoints kept; 0 keeps all
    hellaswag: str | None = None         # HellaSwag jsonl (hellaswag_val.jsonl): acc_norm logged during training
    hellaswag_interval: int | None = None  # steps between HellaSwag evals (None: every eval_interval)
    hellaswag_limit: int | None = None   # score only the first N examples (None: all 10,042 of the val split)
    wandb: str | None = None             # Weights & Biases project (optional `track` extra; WANDB_MODE=offline works)
    tensorboard: str | None = None       # TensorBoard log directory (optional `track` extra)
    num_samples: int = 2                 # sampled lines printed at each eval (0 disables)
    sample_tokens: int = 48
    sample_prompt: str = "\n"
    progress: bool = True                # tqdm progress bar (rank 0)
    peak_tflops: float | None = None     # the device's peak for the MFU estimate; None: a known GPU's, or on a CPU
                                         # its GEMM rate in the training dtype, measured once (cpu_gemm_flops)
    # execution
    seed: int = 1337
    device: str = "cpu"
    dtype: str = "auto"                  # autocast dtype: float32 (none), bfloat16, float16 (CUDA, with GradScaler);
                                         # auto: the fastest here, measured once (choose_dtype)
    lm_head: str = "auto"                # the fused loss's plan, LIBRARY:CHUNK_ROWS:WEIGHT_GRAD_ROWS (lm_head.HeadPlan);
                                         # auto: the fastest here, measured once (lm_head.py)
    compile: bool = False
    activation_checkpointing: bool = False
    parallel: str = "ddp"                # under torchrun: ddp or fsdp (FSDP2 fully_shard)
    deterministic: bool | None = None    # torch.use_deterministic_algorithms; None: on for CPU
    threads: int | None = None           # torch.set_num_threads; None leaves PyTorch's default

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} is not supported; choose one of {', '.join(SCHEDULES)}")
        if self.dtype != "auto":
            parse_dtype(self.dtype)  # a ConfigError naming the supported dtypes
        if self.lm_head != "auto":
            HeadPlan.parse(self.lm_head)  # a ConfigError naming the expected form
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ConfigError("float16 training needs CUDA (a GradScaler); use --dtype bfloat16 on CPU")
        for name in ("batch_size", "seq_len", "max_steps", "eval_interval", "eval_batches", "checkpoint_interval",
                     "vocab_multiple", "hellaswag_interval", "hellaswag_limit"):
            if getattr(self, name) is None:
                continue
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
        if self.hellaswag_interval is not None and self.hellaswag_interval % self.eval_interval:
            raise ConfigError(f"hellaswag_interval {self.hellaswag_interval} must be a multiple of eval_interval "
                              f"{self.eval_interval}: HellaSwag runs at an eval and goes into its metrics line")

    @property
    def budget_s(self) -> float | None:
        """The time budget in seconds (None: the run is bounded by max_steps only)."""
        return self.max_minutes * 60 if self.max_minutes else None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype; float32 means no autocast at all (not an autocast to float32)."""
        if self.dtype == "auto":
            raise ConfigError("dtype 'auto' is resolved when the run starts (choose_dtype)")
        return None if self.dtype == "float32" else parse_dtype(self.dtype)


# Training presets: TrainConfig fields plus the model (a GPTConfig preset name or GPTConfig fields).
PRESETS: dict[str, dict] = {
    # 2 CPU cores, 5 minutes, Shakespeare. The tied 50257-wide lm_head is most of the FLOPs at these
    # widths, so a narrow model sees more tokens: width 96 reaches a lower val loss in 5 minutes than
    # 128 or 256 (4.94 vs 5.05 vs 5.37), and 8 layers lose to 4 (BENCHMARKS.md, Training). Small
    # batches (1K tokens/step: B=8 beats 4 and 16), lr 1e-3 (2e-3 is worse), wte/wpe at 15x the lr
    # (10x: 0.035 worse on average over 3 seeds at 978 steps, an Ice Lake Xeon's budget; 7x worse still),
    # beta2 0.99, and warmup-stable-decay with the last 40% decaying to 0 exactly at the time budget
    # (0.05 better than cosine). dtype auto: bf16 where a CPU's bf16 GEMMs win (an AMD EPYC: 5,160 vs
    # 3,300 tok/s, val 4.86 vs 5.08); with lm_head auto (the fused loss's measured plan) 5,790 tok/s,
    # val 4.83. No dropout: the run sees under one epoch. Context 128 = seq_len, so no position
    # embedding goes untrained (prompt + generated tokens <= 128). One eval, at the end, on 32K val
    # tokens: a mid-run eval would spend the budget's seconds on forward passes.
    "quickstart": dict(
        model=dict(n_layer=4, n_head=4, n_embd=96, n_positions=128, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0),
        batch_size=8, seq_len=128, lr=1e-3, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_fraction=0.4,
        weight_decay=0.1, beta2=0.99, embedding_lr_scale=15.0, max_steps=100_000, max_minutes=4.5,
        eval_interval=100_000, eval_batches=32, checkpoint_interval=100_000, keep_last=2, dtype="auto"),
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
    return cpu_gemm_flops(cfg.dtype)


def cpu_gemm_flops(dtype: str) -> float:
    """FLOP/s of a (1024 x 768) @ (768 x 3072) GEMM (a GPT-2 block's shape) in the training dtype on this
    CPU, all threads: the MFU denominator (bf16 and float32 GEMM rates differ 2x either way across CPUs).
    Measured once per machine (kernels.cached_measurement); the fastest of 5."""
    from gpt2.kernels import cached_measurement

    def measure() -> dict:
        dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        a, b = torch.randn(1024, 768).to(dt), torch.randn(3072, 768).to(dt)
        torch.nn.functional.linear(a, b)
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            best = min(best, time.perf_counter() - start)
        return {"flops": 2 * 1024 * 768 * 3072 / best}

    return cached_measurement("gemm", {"kind": "GEMM peak", "dtype": dtype}, measure,
                              validate=lambda entry: float(entry["flops"]))[0]["flops"]


# ---------------------------------------------------------------------------------------------
# process-wide settings, logging
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def torch_settings(cfg: TrainConfig, device: str):
    """Set the run's process-wide torch settings (threads, deterministic algorithms, TF32); restore them on exit.

    Restored on any exit, an exception included, so a caller's process (a test session, a notebook)
    keeps its own settings after train() returns.
    """
    saved_threads = torch.get_num_threads()
    saved_deterministic = (torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled())
    saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.use_deterministic_algorithms(cfg.deterministic if cfg.deterministic is not None
                                           else not device.startswith("cuda"))
        if device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        yield
    finally:
        torch.set_num_threads(saved_threads)
        torch.use_deterministic_algorithms(saved_deterministic[0], warn_only=saved_deterministic[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32


class _ProgressBarHandler(logging.Handler):
    """Writes each record to stdout above the progress bar (tqdm.write), as print would without a bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm
        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def rank_zero_logging(info: DistInfo):
    """Only rank 0's records pass; they go to stdout when no logging is configured (the CLI), else to the
    application's handlers. Both are undone on exit."""
    handler = None
    saved_level = log.level
    if not log.hasHandlers():
        handler = _ProgressBarHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    rank_filter = lambda record: info.is_main  # noqa: E731
    log.addFilter(rank_filter)
    try:
        yield
    finally:
        log.removeFilter(rank_filter)
        if handler is not None:
            log.removeHandler(handler)
            log.setLevel(saved_level)


# ---------------------------------------------------------------------------------------------
# model, optimizer
# ---------------------------------------------------------------------------------------------

def set_dropout(model: GPT, p: float) -> None:
    """Set all three GPT-2 dropout rates of a built model (the config records them too)."""
    model.config = dataclasses.replace(model.config, embd_pdrop=p, attn_pdrop=p, resid_pdrop=p)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p  # attention reads attn_dropout.p for SDPA's dropout_p


def build_training_model(cfg: TrainConfig, model_config: GPTConfig | None) -> GPT:
    """Random init (seeded) from model_config, or pretrained weights from cfg.init_from; float32, in train mode."""
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


# Fused AdamW (one kernel for all parameters) has CPU and CUDA kernels for floating-point tensors
# (torch >= 2.4, the floor in pyproject.toml); other devices and FSDP2's DTensors take foreach.
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def make_optimizer(cfg: TrainConfig, model: nn.Module, sharded: bool) -> torch.optim.Optimizer:
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
    fused = not sharded and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params)
    if fused:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


# ---------------------------------------------------------------------------------------------
# evaluation, samples, logs
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def estimate_val_loss(model: nn.Module, loader: DataLoader, batches: int, info: DistInfo, autocast) -> float:
    """Mean loss over the loader's first `batches` batches, averaged over ranks.

    The loader is rewound first (its state with no batch drawn yet), so every eval of a run sees the
    same windows. autocast: a zero-argument callable returning the forward's autocast context.
    """
    loader.load_state_dict(dict(loader.state_dict(), step=0, epoch=0, offset=0))
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=info.device)
    for _ in range(batches):
        x, y = loader.next_batch()
        with autocast():
            total += model(x.to(info.device), targets=y.to(info.device)).float()
    model.train(was_training)
    return all_reduce_mean(total / batches, info).item()


def hellaswag_accuracy(run: Run, model: nn.Module) -> dict:
    """{"hellaswag_acc_norm", "hellaswag_acc_token_norm"} over cfg.hellaswag (gpt2.evaluate.hellaswag), the
    examples split over ranks and the hits summed (FSDP: every rank scores them all, see the docstring)."""
    from gpt2.evaluate import hellaswag
    from gpt2.tokenizer import Tokenizer
    cfg, info = run.cfg, run.info
    rank, world_size = (0, 1) if run.sharded else (info.rank, info.world_size)
    was_training = model.training
    model.eval()
    with run.autocast():
        result = hellaswag(model, Tokenizer.gpt2(), cfg.hellaswag, batch_size=cfg.batch_size,
                           limit=cfg.hellaswag_limit, rank=rank, world_size=world_size)
    model.train(was_training)
    n = result["examples"]
    hits = torch.tensor([result["acc_norm"] * n, result["acc_token_norm"] * n, n], dtype=torch.float64,
                        device=info.device)
    if world_size > 1:
        hits = all_reduce_mean(hits, info) * world_size  # sums of hit counts (exact in float64)
    return {"hellaswag_acc_norm": float(hits[0] / hits[2]), "hellaswag_acc_token_norm": float(hits[1] / hits[2])}


class Trackers:
    """Optional metric sinks on rank 0: Weights & Biases (cfg.wandb, a project) and TensorBoard (cfg.tensorboard,
    a log directory). Each needs its package (the `track` extra); neither is ever required."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, model_config: dict):
        self.wandb_run, self.tensorboard = None, None
        if not info.is_main:
            return
        if cfg.wandb:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)  # wandb writes its run files under OUT/wandb
            try:
                import wandb
            except ImportError:
                raise ConfigError("--wandb needs the wandb package. Fix: pip install 'gpt2[track]'.") from None
            self.wandb_run = wandb.init(project=cfg.wandb, dir=cfg.out, config={"train": dataclasses.asdict(cfg),
                                                                                  "model": model_config})
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--tensorboard needs the tensorboard package. Fix: pip install 'gpt2[track]'.") from None
            self.tensorboard = SummaryWriter(cfg.tensorboard)

    def log(self, record: dict, step: int, section: str) -> None:
        """The record's numbers as SECTION/key ("train": each step's; "eval": a metrics.jsonl line's)."""
        scalars = {f"{section}/{k}": v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
                   and math.isfinite(v)}
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


@torch.no_grad()
def sample_lines(model: GPT, cfg: TrainConfig) -> list[str]:
    """A few sampled continuations of sample_prompt (engine.generate), decoded; [] for a toy vocabulary."""
    if model.config.vocab_size != GPT2_VOCAB_SIZE:
        return []  # not GPT-2's vocabulary: nothing readable to show
    from gpt2.engine import generate
    from gpt2.tokenizer import Tokenizer
    tok = Tokenizer.gpt2()
    prompt = tok.encode(cfg.sample_prompt) or [GPT2_EOT]
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):  # sampling never disturbs the training RNG stream
        outs = generate(model, [list(prompt) for _ in range(cfg.num_samples)], max_new_tokens=cfg.sample_tokens,
                        temperature=0.8, top_k=200, seed=cfg.seed)
    model.train(was_training)
    return [cfg.sample_prompt + tok.decode(out) for out in outs]  # generate returns the new ids only


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
    ax.legend(loc="upper left")
    hellaswag = [r for r in evals if "hellaswag_acc_norm" in r]
    if hellaswag:  # accuracy on its own axis, on the right
        acc = ax.twinx()
        acc.plot([r["step"] for r in hellaswag], [r["hellaswag_acc_norm"] for r in hellaswag], "s--", color="tab:green",
                 label="HellaSwag acc_norm")
        acc.set_ylabel("HellaSwag acc_norm")
        acc.legend(loc="upper right")
    fig.tight_layout()
    path = out / "loss.png"
    atomic_write_bytes(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# the run: its built pieces, and the state that crosses iterations
# ---------------------------------------------------------------------------------------------

@dataclass
class LoopState:
    """What crosses iterations of the loop. A checkpoint's meta holds it (to_meta); a resumed run starts from it."""
    step: int = 0                  # optimizer steps taken
    elapsed_s: float = 0.0         # training seconds over all processes of the run (a resume continues the count)
    tokens: int = 0                # tokens trained on, all ranks together
    val_loss: float | None = None  # the latest eval's
    clock_start: float = field(default=0.0, repr=False)  # time.time() at which elapsed_s was 0 (start_clock)

    @classmethod
    def from_meta(cls, meta: dict) -> "LoopState":
        return cls(step=meta["step"], elapsed_s=meta["elapsed_s"], tokens=meta["tokens"], val_loss=meta.get("val_loss"))

    def to_meta(self) -> dict:
        return {"step": self.step, "elapsed_s": self.elapsed_s, "tokens": self.tokens, "val_loss": self.val_loss}

    def start_clock(self) -> None:
        """This process's loop starts now; elapsed_s keeps counting from its saved value."""
        self.clock_start = time.time() - self.elapsed_s

    def tick(self) -> float:
        """Bring elapsed_s up to now; returns it."""
        self.elapsed_s = time.time() - self.clock_start
        return self.elapsed_s


@dataclass
class Meter:
    """Train losses and throughput since the last eval: what one metrics.jsonl line averages."""
    started: float = field(default_factory=time.time)
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0      # over the window, as of the latest step
    mfu: float = 0.0

    def add(self, loss: float, tokens: int, flops_per_token: float, peak_flops: float) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        dt = time.time() - self.started
        self.tokens_per_s = self.tokens / dt if dt > 0 else 0.0
        self.mfu = flops_per_token * self.tokens_per_s / peak_flops

    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses)


@dataclass
class Run:
    """The built pieces of one training run, as the loop's sections use them."""
    cfg: TrainConfig
    info: DistInfo
    out: Path
    model: nn.Module                # what a step calls: DDP- or FSDP-wrapped, maybe compiled
    raw_model: GPT                  # the GPT itself (FSDP2 shards its parameters in place)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler    # float16 only; a no-op otherwise
    loader: DataLoader              # this rank's train batches
    val_loader: DataLoader          # this rank's val batches, rewound at each eval
    grad_accum: int                 # micro-batches per optimizer step
    tokens_per_step: int            # all ranks, all micro-batches
    flops_per_token: float
    peak_flops: float               # all ranks together
    trackers: Trackers              # wandb / TensorBoard (rank 0; empty when neither is asked for)
    lm_head_why: str                # how cfg.lm_head was chosen (the first log line shows it)

    @property
    def sharded(self) -> bool:
        return self.info.enabled and self.cfg.parallel == "fsdp"

    def autocast(self):
        """The forward's autocast context (none for float32)."""
        if self.cfg.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda" if self.info.device.startswith("cuda") else "cpu", dtype=self.cfg.autocast_dtype)

    def out_of_time(self, state: LoopState) -> bool:
        return self.cfg.budget_s is not None and state.elapsed_s >= self.cfg.budget_s


# TrainConfig fields a resumed run must share with its checkpoint: they change the computation.
RESUME_MUST_MATCH = ("batch_size", "seq_len", "total_batch_tokens", "data_mode", "lr", "min_lr", "warmup_steps",
                     "schedule", "decay_fraction", "weight_decay", "beta1", "beta2", "embedding_lr_scale", "grad_clip",
                     "seed", "dtype",
                     "vocab_multiple")  # max_steps and max_minutes may grow: the run continues


def choose_dtype(cfg: TrainConfig, model: GPT, info: DistInfo, ckpt: checkpoint.Checkpoint | None) -> tuple[str, str]:
    """cfg.dtype, or for "auto": (the training dtype, why). A resumed run keeps its checkpoint's dtype;
    CUDA takes bf16 where supported, else float16 with a GradScaler; a CPU times one forward + backward
    of this model at this micro-batch in float32 and in bf16 autocast and takes the faster (whether bf16
    wins depends on the CPU: BENCHMARKS.md, Training), cached per machine and shape."""
    if cfg.dtype != "auto":
        return cfg.dtype, "as configured"
    if ckpt is not None:
        saved = ckpt.meta.get("train_config", {}).get("dtype")
        if saved:
            return saved, "the resumed checkpoint's"
    if info.device.startswith("cuda"):
        return ("bfloat16", "CUDA with bf16") if torch.cuda.is_bf16_supported() else ("float16", "CUDA without bf16")
    from gpt2.kernels import cached_measurement
    key = {"kind": "training step", "model": model.config.to_dict(), "batch_size": cfg.batch_size,
           "seq_len": cfg.seq_len, "vocab_multiple": cfg.vocab_multiple}
    if info.is_main:
        result, source = cached_measurement("training", key, lambda: _time_training_dtypes(model, cfg),
                                            validate=lambda entry: entry["dtype"])
    result, source = broadcast_object((result, source) if info.is_main else None, info)
    times = ", ".join(f"{d} {t * 1e3:.0f} ms" for d, t in result["step_s"].items())
    return result["dtype"], f"{source}: one forward + backward took {times}"


def choose_lm_head(cfg: TrainConfig, model: GPT, info: DistInfo, ckpt: checkpoint.Checkpoint | None
                   ) -> tuple[HeadPlan, str]:
    """The fused loss's plan (cfg.lm_head), or for "auto": (the fastest plan for this micro-batch and
    cfg.dtype on this machine, why), measured once (lm_head.py). A resumed run keeps its
    checkpoint's plan, so that it continues bit for bit."""
    if cfg.lm_head != "auto":
        return HeadPlan.parse(cfg.lm_head), "as configured"
    saved = ckpt.meta.get("train_config", {}).get("lm_head") if ckpt is not None else None
    if saved and saved != "auto":
        return HeadPlan.parse(saved), "the resumed checkpoint's"
    from gpt2.lm_head import choose_head_plan
    if info.is_main:
        c = model.config
        plan, why = choose_head_plan(cfg.batch_size * cfg.seq_len, c.n_embd, c.vocab_size, cfg.dtype, info.device,
                                     padded_vocab_size=model.padded_vocab_size)
    spec, why = broadcast_object((str(plan), why) if info.is_main else None, info)
    return HeadPlan.parse(spec), why


def _time_training_dtypes(model: GPT, cfg: TrainConfig) -> dict:
    """Seconds of one forward + backward per candidate dtype (fastest of 3, alternating); no optimizer
    step, and a private generator for the tokens, so the run itself is untouched."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    x, y = idx[:, :-1].to(model.transformer.wte.weight.device), idx[:, 1:].to(model.transformer.wte.weight.device)

    def step(dtype: str) -> float:
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16"
                    else contextlib.nullcontext())
        start = time.perf_counter()
        with autocast:
            loss = model(x, targets=y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    candidates = ("float32", "bfloat16")
    for dtype in candidates:
        step(dtype)  # warm up
    best = {dtype: math.inf for dtype in candidates}
    for _ in range(3):  # alternating, so a burst of other work on the machine hits both
        for dtype in candidates:
            best[dtype] = min(best[dtype], step(dtype))
    return {"dtype": min(best, key=best.get), "step_s": best}


def _check_inputs(cfg: TrainConfig, device: str) -> None:
    """Fail before any model is built: no CUDA for --device cuda, or no data (train or val split)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA device is available")
    if not Path(cfg.data).exists():
        raise DataError(f"{cfg.data}: no such data directory. Fix: run `gpt2 prepare shakespeare --out {cfg.data}` "
                        "(or `gpt2 prepare FILES --out DIR`) first.")
    if cfg.hellaswag and not Path(cfg.hellaswag).is_file():
        raise DataError(f"--hellaswag {cfg.hellaswag}: no such file. Fix: give HellaSwag's hellaswag_val.jsonl.")


def _resume_checkpoint(cfg: TrainConfig, out: Path) -> checkpoint.Checkpoint | None:
    """The checkpoint --resume continues from (None: a new run); refuses to start a new run over an old one."""
    path = checkpoint.latest(out)
    if not cfg.resume:
        if path is not None:
            raise CheckpointError(f"{out} already holds a run (LATEST exists). Pass --resume to continue it, "
                                  "or choose a new --out.")
        return None
    if path is None:
        log.info(f"--resume: no checkpoint in {out} yet; starting from step 0")
        return None
    return checkpoint.load(path)


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


def build_run(cfg: TrainConfig, model_config: GPTConfig | None, info: DistInfo,
              ckpt: checkpoint.Checkpoint | None) -> Run:
    """Loaders, the model (with the checkpoint's weights when resuming), its wrappers and the optimizer."""
    tokens_per_micro = cfg.batch_size * cfg.seq_len * info.world_size
    grad_accum = max(1, round((cfg.total_batch_tokens or tokens_per_micro) / tokens_per_micro))
    loader = DataLoader(cfg.data, split="train", batch_size=cfg.batch_size, seq_len=cfg.seq_len, mode=cfg.data_mode,
                        seed=cfg.seed, rank=info.rank, world_size=info.world_size)
    val_loader = DataLoader(cfg.data, split="val", batch_size=cfg.batch_size, seq_len=cfg.seq_len, mode="random",
                            seed=cfg.seed + 1, rank=info.rank, world_size=info.world_size)

    model = build_training_model(cfg, model_config)
    if cfg.seq_len > model.config.n_positions:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's context length {model.config.n_positions}")
    if cfg.hellaswag and model.config.vocab_size != GPT2_VOCAB_SIZE:
        raise ConfigError(f"--hellaswag needs GPT-2's vocabulary ({GPT2_VOCAB_SIZE} tokens); this model has "
                          f"{model.config.vocab_size}")
    dtype, why = choose_dtype(cfg, model.to(info.device), info, ckpt)
    if cfg.dtype == "auto":
        log.info(f"dtype auto -> {dtype} ({why})")
        cfg = dataclasses.replace(cfg, dtype=dtype)
    plan, lm_head_why = choose_lm_head(cfg, model, info, ckpt)
    cfg = dataclasses.replace(cfg, lm_head=str(plan))
    model.lm_head_plan = plan
    if ckpt is not None:
        _check_resume(ckpt, cfg, model, info.world_size)
        saved = load_model(ckpt.path, dtype=torch.float32, vocab_multiple=cfg.vocab_multiple)
        model.load_state_dict(saved.state_dict())
        del saved
    model.to(info.device)
    raw_model = model
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    model = wrap_model(model, info, cfg.parallel)
    optimizer = make_optimizer(cfg, model, sharded=info.enabled and cfg.parallel == "fsdp")
    if cfg.compile:
        model = torch.compile(model)
    return Run(cfg=cfg, info=info, out=Path(cfg.out), model=model, raw_model=raw_model, optimizer=optimizer,
               scaler=torch.amp.GradScaler("cuda", enabled=cfg.dtype == "float16"), loader=loader,
               val_loader=val_loader, grad_accum=grad_accum, tokens_per_step=tokens_per_micro * grad_accum,
               flops_per_token=flops_per_token(raw_model, cfg.seq_len),
               peak_flops=peak_flops(cfg, info.device) * info.world_size,
               trackers=Trackers(cfg, info, raw_model.config.to_dict()), lm_head_why=lm_head_why)


def start_state(run: Run, ckpt: checkpoint.Checkpoint | None) -> LoopState:
    """Seed the RNGs (a new run), or restore optimizer, scaler, data position and RNGs (a resumed run)."""
    cfg, info = run.cfg, run.info
    torch.manual_seed(cfg.seed + info.rank)  # dropout masks differ per rank, reproducibly
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    if ckpt is None:
        return LoopState()
    saved = ckpt.trainer_state
    load_optimizer_state(run.optimizer, saved["optimizer"], info, cfg.parallel)
    if saved.get("scaler"):
        run.scaler.load_state_dict(saved["scaler"])
    run.loader.load_state_dict(checkpoint.from_storable(saved["data"][info.rank]))
    checkpoint.set_rng_state(saved["rng"][info.rank])
    state = LoopState.from_meta(ckpt.meta)
    if info.is_main:
        for name in ("metrics.jsonl", "steps.jsonl"):
            _truncate_jsonl(run.out / name, state.step)
    log.info(f"resumed from {ckpt.path} at step {state.step}")
    return state


# ---------------------------------------------------------------------------------------------
# the loop's sections: one step, log, evaluate, save
# ---------------------------------------------------------------------------------------------

def scheduled_lr(cfg: TrainConfig, state: LoopState) -> float:
    """The next step's learning rate; under a time budget the schedule follows the clock, if that is further."""
    progress = step_progress(cfg, state.step)
    if cfg.budget_s:
        progress = max(progress, state.tick() / cfg.budget_s)
    return learning_rate(cfg, state.step, progress)


def train_step(run: Run, state: LoopState) -> tuple[float, float, float]:
    """One optimizer step over grad_accum micro-batches: (train loss averaged over ranks, lr, grad norm)."""
    cfg, info, model, optimizer, scaler = run.cfg, run.info, run.model, run.optimizer, run.scaler
    lr = scheduled_lr(cfg, state)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    loss_sum = torch.zeros((), device=info.device)
    for micro in range(run.grad_accum):
        x, y = run.loader.next_batch()
        x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
        with grad_sync(model, info, cfg.parallel, sync=micro == run.grad_accum - 1), run.autocast():
            loss = model(x, targets=y) / run.grad_accum
        scaler.scale(loss).backward()
        loss_sum += loss.detach()
    train_loss = all_reduce_mean(loss_sum, info).item()
    if not math.isfinite(train_loss):
        optimizer.zero_grad(set_to_none=True)
        last = checkpoint.latest(run.out) if info.is_main else None
        raise TrainingDiverged(f"the training loss is {train_loss} at step {state.step + 1}; stopped before applying "
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
    state.step += 1
    state.tokens += run.tokens_per_step
    return train_loss, lr, grad_norm


def progress_bar(cfg: TrainConfig, info: DistInfo, state: LoopState):
    """tqdm on stderr (rank 0). With a time budget it counts the budget's seconds (so the ETA is the real
    one; the run also stops at max_steps, if that comes first), and the step goes into the postfix."""
    from tqdm import tqdm
    timed = cfg.budget_s is not None
    return tqdm(total=round(cfg.budget_s) if timed else cfg.max_steps,
                initial=round(state.elapsed_s) if timed else state.step,
                disable=not (cfg.progress and info.is_main), unit="s" if timed else "step", dynamic_ncols=True,
                # redraw in place on a terminal; in a log file every redraw is appended, so redraw rarely there
                mininterval=0.1 if sys.stderr.isatty() else 15.0,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}{postfix}]" if timed else None)


def log_step(run: Run, state: LoopState, meter: Meter, bar, train_loss: float, lr: float, grad_norm: float) -> None:
    """A line in steps.jsonl (rank 0) and the progress bar's position and postfix."""
    if run.info.is_main:
        step_record = {"step": state.step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm}
        _append_jsonl(run.out / "steps.jsonl", step_record)
        run.trackers.log(step_record, state.step, "train")
    timed = run.cfg.budget_s is not None
    bar.update(min(round(state.elapsed_s), bar.total) - bar.n if timed else 1)
    bar.set_postfix_str(f"{f'step {state.step} | ' if timed else ''}loss {train_loss:.3f} | "
                        f"{meter.tokens_per_s:,.0f} tok/s | MFU {100 * meter.mfu:.1f}%", refresh=False)


def evaluate_and_log(run: Run, state: LoopState, meter: Meter, lr: float, show_samples: bool, final: bool) -> None:
    """Val loss into state (and HellaSwag when due); a metrics.jsonl line, loss.png, the trackers and a log
    line (rank 0); a few samples if asked."""
    eval_model = run.model if run.sharded else run.raw_model  # FSDP2's forward gathers the shards
    state.val_loss = estimate_val_loss(eval_model, run.val_loader, run.cfg.eval_batches, run.info, run.autocast)
    record = {"step": state.step, "train_loss": meter.mean_loss(), "val_loss": state.val_loss,
              "val_ppl": math.exp(min(state.val_loss, 50.0)), "lr": lr, "tokens": state.tokens,
              "tokens_per_s": meter.tokens_per_s, "mfu": meter.mfu, "elapsed_s": round(state.elapsed_s, 3)}
    hellaswag_every = run.cfg.hellaswag_interval or run.cfg.eval_interval
    if run.cfg.hellaswag and (state.step % hellaswag_every == 0 or final):
        record.update(hellaswag_accuracy(run, eval_model))
    if not run.info.is_main:
        return
    _append_jsonl(run.out / "metrics.jsonl", record)
    plot_losses(run.out)
    run.trackers.log(record, state.step, "eval")
    hs = f" | hellaswag {record['hellaswag_acc_norm']:.4f}" if "hellaswag_acc_norm" in record else ""
    log.info(f"step {state.step}: train {record['train_loss']:.4f} | val {state.val_loss:.4f} "
             f"(ppl {record['val_ppl']:.1f}){hs} | {meter.tokens_per_s:,.0f} tok/s | MFU {100 * meter.mfu:.1f}% | "
             f"{state.elapsed_s:.0f}s")
    if show_samples and run.cfg.num_samples and not run.sharded:
        for line in sample_lines(run.raw_model, run.cfg):
            log.info("  > " + line.replace("\n", " ")[:200])


def save_checkpoint(run: Run, state: LoopState) -> Path | None:
    """Every rank calls this (FSDP gathers); rank 0 writes, with the loop state in the checkpoint's meta.

    Returns the checkpoint's path on rank 0 (None elsewhere); raises CheckpointError on I/O failure.
    """
    cfg, info = run.cfg, run.info
    model = full_model(run.model, info, cfg.parallel)
    trainer_state = {"optimizer": full_optimizer_state(run.optimizer, info, cfg.parallel),
                     "rng": gather_object(checkpoint.rng_state(), info),
                     "data": gather_object(checkpoint.to_storable(run.loader.state_dict()), info),
                     "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else {}}
    path = None
    if info.is_main:
        state.tick()
        meta = {"train_config": dataclasses.asdict(cfg), "world_size": info.world_size, **state.to_meta()}
        try:
            path = checkpoint.save(run.out, state.step, model, trainer_state, meta, keep_last=cfg.keep_last)
        except OSError as e:
            last = checkpoint.latest(run.out)
            raise CheckpointError(f"could not write the checkpoint for step {state.step} in {run.out} "
                                  f"({e.strerror or e}); nothing partial was left behind; the last good checkpoint "
                                  f"is {last or 'none'}") from None
    barrier(info)
    return path


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------

def train(cfg: TrainConfig, model_config: GPTConfig | None = None) -> dict:
    """Run training; returns a summary (final step, losses, checkpoint path, tokens/s).

    Torch's process-wide settings and the logging setup are restored when it returns or raises.
    """
    info = init_distributed(cfg.device)
    try:
        with torch_settings(cfg, info.device), rank_zero_logging(info):
            return _train(cfg, model_config, info)
    finally:
        teardown(info)


def _train(cfg: TrainConfig, model_config: GPTConfig | None, info: DistInfo) -> dict:
    out = Path(cfg.out)
    _check_inputs(cfg, info.device)
    ckpt = _resume_checkpoint(cfg, out)
    run = build_run(cfg, model_config, info, ckpt)
    cfg = run.cfg  # with dtype "auto" resolved
    state = start_state(run, ckpt)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "train_config.json", {"train": dataclasses.asdict(cfg),
                                                      "model": run.raw_model.config.to_dict()})
    c = run.raw_model.config
    log.info(f"model: {run.raw_model.num_parameters():,} parameters ({c.n_layer} layers, width {c.n_embd}); "
             f"{run.tokens_per_step:,} tokens/step = {cfg.batch_size} x {cfg.seq_len} x {info.world_size} rank(s) "
             f"x {run.grad_accum} accumulation; dtype {cfg.dtype}; lm_head {cfg.lm_head} ({run.lm_head_why}); "
             f"device {info.device}")

    last_path = None
    done = state.step >= cfg.max_steps or run.out_of_time(state)
    with progress_bar(cfg, info, state) as bar, contextlib.closing(run.trackers):
        state.start_clock()
        meter = Meter()
        while not done:
            train_loss, lr, grad_norm = train_step(run, state)
            state.tick()  # once per step: the bar, the budget and the metrics line read the same time
            meter.add(train_loss, run.tokens_per_step, run.flops_per_token, run.peak_flops)
            log_step(run, state, meter, bar, train_loss, lr, grad_norm)
            done = state.step >= cfg.max_steps or broadcast_object(run.out_of_time(state), info)
            if state.step % cfg.eval_interval == 0 or done:
                evaluate_and_log(run, state, meter, lr, show_samples=not done, final=done)
                meter = Meter()
            if state.step % cfg.checkpoint_interval == 0 or done:
                last_path = save_checkpoint(run, state)
    return _finish(run, state, meter, last_path)


def _finish(run: Run, state: LoopState, meter: Meter, last_path: Path | None) -> dict:
    """The final samples and log lines; the run's summary."""
    cfg, out = run.cfg, run.out
    samples = []
    if run.info.is_main and cfg.num_samples and not run.sharded:
        samples = sample_lines(run.raw_model, cfg)
        for line in samples:
            log.info("sample: " + line)
    if last_path is not None:
        log.info(f"checkpoint: {last_path}  (GPT.from_pretrained('{out}') or gpt2 generate --model {out})")
        log.info(f"loss curve: {out / 'loss.png'}   metrics: {out / 'metrics.jsonl'}")
    return {"step": state.step, "val_loss": state.val_loss, "tokens_per_s": meter.tokens_per_s, "mfu": meter.mfu,
            "elapsed_s": state.tick(), "checkpoint": str(last_path) if last_path else None, "out": str(out),
            "loss_png": str(out / "loss.png"), "samples": samples}
