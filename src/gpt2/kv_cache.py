"""A preallocated key/value cache for every layer, with one explicit position.

    cache = KVCache.for_model(model, batch_size=1, capacity=1024)
    logits = model(prompt_ids, cache=cache)        # prefill: writes positions [0, T)
    logits = model(next_ids, cache=cache)          # decode: writes position T, attends to [0, T]

The engine allocates it once per request batch; nothing is reallocated per step. Attention layers
write their new keys and values at `pos` through `update`, and the model calls `advance` exactly once
per forward, after the last layer, so every layer of one forward sees the same `pos`.
"""

from __future__ import annotations

import torch

from gpt2.errors import ContextLengthError


class KVCache:
    def __init__(self, n_layer: int, batch_size: int, n_head: int, capacity: int, head_size: int,
                 device=None, dtype=torch.float32):
        shape = (n_layer, batch_size, n_head, capacity, head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, nh, capacity, hs)
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, nh, capacity, hs)
        self.capacity = capacity
        self.pos = 0  # number of positions already written, for every row

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int | None = None, dtype=None) -> "KVCache":
        config = model.config
        capacity = capacity or config.n_positions
        if capacity > config.n_positions:
            raise ContextLengthError(f"cache capacity {capacity} exceeds the context length {config.n_positions}")
        weight = model.transformer.wte.weight
        return cls(config.n_layer, batch_size, config.n_head, capacity, config.head_size,
                   device=weight.device, dtype=dtype or weight.dtype)

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) at [pos, pos+T); return all keys and values so far (B, nh, pos+T, hs)."""
        end = self.pos + k.size(2)
        if end > self.capacity:
            raise ContextLengthError(f"KV cache is full: {end} positions needed, capacity is {self.capacity}")
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, num_positions: int) -> None:
        self.pos += num_positions

    def reset(self) -> None:
        self.pos = 0
