"""Distributed training from the outside: torchrun's environment -> a small DistInfo; DDP/FSDP2 wrapping,
gradient sync under accumulation, and the collectives the loop and its checkpoints need.

    torchrun --nproc_per_node=2 -m gpt2 train --preset quickstart --data data/shakespeare --out runs/ddp
    torchrun --nproc_per_node=2 -m gpt2 train ... --parallel fsdp      # FSDP2 (fully_shard) per block

model.py never imports torch.distributed: this file wraps the model. Without torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK) everything here is a no-op and the run is a single process. Backends:
gloo on CPU, NCCL on CUDA. Only rank 0 logs and writes checkpoints; checkpoints are always the
full, unsharded state (full_model, full_optimizer_state), so they load in a single process. train.py
never imports torch.distributed: every collective it needs is a function here.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from gpt2.errors import ConfigError
from gpt2.model import GPT

PARALLEL_MODES = ("ddp", "fsdp")


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "cpu") -> DistInfo:
    """Read torchrun's environment, join the process group and pick this rank's device.

    torchrun's variables are the launcher's protocol, not configuration: everything else comes from flags.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistInfo(device=device)
    import torch.distributed as dist
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def teardown(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist
        dist.barrier()


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Average a tensor over ranks (losses for logging); identity on one process."""
    if info.enabled:
        import torch.distributed as dist
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value


def broadcast_object(obj, info: DistInfo):
    """Rank 0's Python object on every rank (e.g. a stop decision)."""
    if not info.enabled:
        return obj
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap_model(model: nn.Module, info: DistInfo, mode: str = "ddp") -> nn.Module:
    """DDP or FSDP2 around the model; the model itself is returned on one process."""
    if mode not in PARALLEL_MODES:
        raise ConfigError(f"parallel mode {mode!r} is not supported; choose one of {', '.join(PARALLEL_MODES)}")
    if not info.enabled:
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[info.local_rank] if info.device.startswith("cuda") else None)
    from torch.distributed.fsdp import fully_shard
    # One FSDP unit per block, then the root (wte/wpe/ln_f; lm_head is tied to wte and stays with it).
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside a torch.compile wrapper (the model itself when not compiled).

    The one place the `_orig_mod` attribute is read. The loop compiles after wrapping, so the
    order is compile(DDP(GPT)) or compile(FSDP-GPT): the compile wrapper is always the outermost.
    """
    return getattr(model, "_orig_mod", model)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside the torch.compile and DDP wrappers (FSDP2 modifies the module in place)."""
    model = uncompiled(model)
    return getattr(model, "module", model)  # DDP


def grad_sync(model: nn.Module, info: DistInfo, mode: str, sync: bool):
    """A context for one micro-batch's backward: the gradient all-reduce runs only when sync is True.

    Gradient accumulation syncs on the last micro-batch only; on one process this does nothing.
    """
    if not info.enabled:
        return contextlib.nullcontext()
    wrapped = uncompiled(model)  # DDP, or the FSDP2 module
    if mode == "ddp":
        return contextlib.nullcontext() if sync else wrapped.no_sync()
    wrapped.set_requires_gradient_sync(sync)  # FSDP2: a flag, not a context
    return contextlib.nullcontext()


def gather_object(obj, info: DistInfo) -> list:
    """Every rank's Python object, as a list in rank order (on every rank); [obj] on one process."""
    if not info.enabled:
        return [obj]
    import torch.distributed as dist
    objects = [None] * info.world_size
    dist.all_gather_object(objects, obj)
    return objects


def full_model(model: nn.Module, info: DistInfo, mode: str) -> GPT | None:
    """The whole GPT with unsharded parameters, for saving: on rank 0 (others get None). Every rank must call it.

    One process or DDP: the GPT inside the wrappers, as it is. FSDP2: a new GPT on CPU holding the
    gathered full parameters (the collective runs on every rank).
    """
    inner = unwrap(model)
    if not (info.enabled and mode == "fsdp"):
        return inner if info.is_main else None
    from torch.distributed.tensor import DTensor
    params = {}
    for name, p in inner.named_parameters():  # the tied lm_head is listed once, as wte
        t = p.detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        params[name] = t.cpu() if info.is_main else None
    if not info.is_main:
        return None
    with torch.device("meta"):
        # vocab_multiple = the padded width itself: exactly the padded rows of the trained wte
        shell = GPT(inner.config, vocab_multiple=inner.padded_vocab_size)
    params["lm_head.weight"] = params["transformer.wte.weight"]
    shell.load_state_dict(params, assign=True)
    shell.lm_head.weight = shell.transformer.wte.weight  # assign=True replaced the tied parameter: tie again
    return shell


def full_optimizer_state(optimizer: torch.optim.Optimizer, info: DistInfo, mode: str) -> dict | None:
    """The optimizer's state_dict with full (unsharded) tensors, on rank 0; every rank must call it.

    Under FSDP2 the state tensors are DTensors sharded like their parameters: each is gathered with
    full_tensor(), so the saved state has the single-process layout (and loads in one process).
    """
    state = optimizer.state_dict()
    if info.enabled and mode == "fsdp":
        from torch.distributed.tensor import DTensor
        for per_param in state["state"].values():
            for key, value in per_param.items():
                if isinstance(value, DTensor):
                    full = value.full_tensor()  # a collective: every rank, same order
                    per_param[key] = full.cpu() if info.is_main else None
    return state if info.is_main else None


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, info: DistInfo, mode: str) -> None:
    """Load a full optimizer state saved by full_optimizer_state (sharding it again like the parameters under FSDP2)."""
    if info.enabled and mode == "fsdp":
        from torch.distributed.tensor import DTensor, distribute_tensor
        params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's index order
        for index, per_param in state["state"].items():
            p = params[int(index)]
            for key, value in per_param.items():
                if isinstance(p, DTensor) and torch.is_tensor(value) and value.shape == p.shape:
                    per_param[key] = distribute_tensor(value.to(p.device), p.device_mesh, p.placements)
    optimizer.load_state_dict(state)
