"""A preallocated key/value cache for every layer, with one explicit position.

    cache = KVCache.for_model(model, batch_size=1, capacity=1024)
    logits = model(prompt_ids, cache=cache)        # prefill: writes positions [0, T)
    logits = model(next_ids, cache=cache)          # decode: writes position T, attends to [0, T]

The engine allocates it once per request batch; nothing is reallocated per step. Attention layers
write their new keys and values at `pos` through `update`, and the model calls `advance` exactly once
per forward, after the last layer, so every layer of one forward sees the same `pos`. Speculative
decoding (engine.py) takes back the positions of rejected draft tokens with `rewind`.

BatchKV is the continuous-batching scheduler's cache (batching.py): sequences of different lengths,
joining and leaving between decode steps, in one storage with one write position.

    kv = BatchKV.for_model(model, max_batch=16)
    kv.insert(prefilled)                     # a batch-1 KVCache after its prefill becomes the last row
    mask = kv.decode_mask()                  # room for column pos, marked for every row: (rows, pos + 1)
    logits = model(ids, cache=kv, attention_mask=mask)   # ids (rows, 1): writes column pos, advances pos
    kv.remove(i)                             # row i leaves; the last row moves into slot i
    kv.max_bytes = budget                    # growth stays within it; kv.release() frees the storage when idle
"""

from __future__ import annotations

import torch

from gpt2.errors import ContextLengthError, KVLimitExceeded


def cache_dtype(model, compiled: bool = False) -> torch.dtype:
    """The dtype of model's KV caches: GPT.kv_dtype (load_for_inference's kv_dtype), else its activations':
    wpe's dtype (wte's is no guide: a model packed below float32 looks tokens up in a bf16 table,
    quantize.embedding_to_bf16, and computes in float32).

    compiled: of the caches a compiled decode step reads (engine.StaticDecode), GPT.compiled_kv_dtype where
    set. Its attention is Inductor's own loops, not the eager step's SDPA, so kv_dtype="auto" times it apart
    (kernels.kv_cache_dtype), here, the first time a compiled step needs a cache."""
    if compiled and getattr(model, "compiled_kv_dtype", None) == "auto":
        from gpt2.kernels import kv_cache_dtype
        model.compiled_kv_dtype = kv_cache_dtype(model, compiled=True)[0]
    if compiled and getattr(model, "compiled_kv_dtype", None) is not None:
        return model.compiled_kv_dtype
    return getattr(model, "kv_dtype", None) or model.transformer.wpe.weight.dtype


class KVCache:
    def __init__(self, n_layer: int, batch_size: int, n_head: int, capacity: int, head_size: int,
                 device=None, dtype=torch.float32):
        # One tensor per layer, not one (L, ...) tensor: a compiled decode step (engine.py) writes into
        # each layer's cache in place; writes into views of one shared tensor make torch.compile copy
        # the whole cache back on every step (measured 2.7x slower than eager at 124M).
        shape = (batch_size, n_head, capacity, head_size)
        self.k = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer))  # L x (B, nh, capacity, hs)
        self.v = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer))  # L x (B, nh, capacity, hs)
        self.capacity = capacity
        self.pos = 0  # number of positions already written, for every row

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int | None = None, dtype=None,
                  compiled: bool = False) -> "KVCache":
        """compiled: a cache a compiled decode step will read (cache_dtype)."""
        config = model.config
        capacity = capacity or config.n_positions
        if capacity > config.n_positions:
            raise ContextLengthError(f"cache capacity {capacity} exceeds the context length {config.n_positions}")
        weight = model.transformer.wte.weight
        return cls(config.n_layer, batch_size, config.n_head, capacity, config.head_size,
                   device=weight.device, dtype=dtype or cache_dtype(model, compiled))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) at [pos, pos+T); return all keys and values so far (B, nh, pos+T, hs)."""
        end = self.pos + k.size(2)
        if end > self.capacity:
            raise ContextLengthError(f"KV cache is full: {end} positions needed, capacity is {self.capacity}")
        keys, values = self.k[layer], self.v[layer]
        keys.narrow(2, self.pos, k.size(2)).copy_(k)
        values.narrow(2, self.pos, v.size(2)).copy_(v)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def advance(self, num_positions: int) -> None:
        self.pos += num_positions

    def rewind(self, num_positions: int) -> None:
        """Forget the last num_positions (speculative decoding's rejected drafts). The slots stay allocated:
        the next update overwrites them, and nothing reads past pos."""
        if not 0 <= num_positions <= self.pos:
            raise ValueError(f"cannot rewind {num_positions} positions of a cache holding {self.pos}")
        self.pos -= num_positions


class BatchKV:
    """Keys and values of up to max_batch sequences that join and leave between decode steps.

    Storage k, v (L, R, nh, C, hs) with R <= max_batch rows and C <= max_capacity columns allocated;
    live rows packed at [0, rows):
      * All rows share one write position `pos` (P). A row's tokens sit right-aligned in columns
        [P - len, P), and `mask` (R, C) is 1 there and 0 to the left, exactly like left
        padding; the model derives positions as cumsum(mask) - 1, so they stay correct.
      * insert: a prefilled batch-1 KVCache's keys and values are copied into row `rows`, right-aligned
        to end at P. A prompt longer than P first shifts every row right.
      * remove: the last row moves into the freed slot.
      * room (_fit): when a row or column P would pass the storage, drop the leading columns no live
        row uses (compaction) if that frees half of them, else grow (doubling rows and columns). A row
        never spans more than its prompt plus max_new_tokens - 1 <= n_positions - 1 columns, so
        compaction always frees one at max_capacity.
      * max_bytes: growth never allocates more (the scheduler's KV budget); under it the storage
        compacts first and takes only what fits. release() frees everything when no row is live.
      * update/advance: the cache interface the model's forward uses, over the live rows (decode only:
        prefill happens in a KVCache, then insert).
      * lone_row/rewind/mark_lone_row: one live row used as a batch-1 cache for a speculative round.
    """

    def __init__(self, n_layer: int, max_batch: int, n_head: int, head_size: int, max_capacity: int,
                 initial_capacity: int = 128, device=None, dtype=torch.float32):
        self.n_layer, self.max_batch, self.n_head, self.head_size = n_layer, max_batch, n_head, head_size
        self.max_capacity = max_capacity
        self.initial_capacity = min(initial_capacity, max_capacity)
        self.device, self.dtype = device, dtype
        # keys and values of one token of one row, every layer
        self.bytes_per_position = 2 * n_layer * n_head * head_size * torch.empty((), dtype=dtype).element_size()
        self.max_bytes: int | None = None   # set by the scheduler before each insert and decode step
        self.k = self.v = self.mask = None  # allocated on the first insert
        self.rows = 0                       # live rows, packed at [0, rows)
        self.pos = 0                        # the shared write position P
        self.shifts = self.compactions = 0  # rows moved right for a long prompt / left to free columns

    @classmethod
    def for_model(cls, model, max_batch: int, initial_capacity: int = 128, compiled: bool = False) -> "BatchKV":
        """compiled: a storage a compiled decode step will read (cache_dtype)."""
        config = model.config
        weight = model.transformer.wte.weight
        return cls(config.n_layer, max_batch, config.n_head, config.head_size, config.n_positions,
                   initial_capacity, device=weight.device, dtype=cache_dtype(model, compiled))

    @property
    def capacity(self) -> int:
        """Columns allocated."""
        return 0 if self.k is None else self.k.size(3)

    @property
    def row_capacity(self) -> int:
        """Rows allocated."""
        return 0 if self.k is None else self.k.size(1)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values allocated."""
        k = self.k  # one read: another thread may ask while the storage is replaced
        return 0 if k is None else 2 * k.numel() * k.element_size()

    def bytes_for(self, rows: int, columns: int) -> int:
        """Bytes of keys and values a storage of rows x columns takes."""
        return rows * columns * self.bytes_per_position

    # -- rows join and leave -------------------------------------------------------------------

    def insert(self, cache: KVCache) -> int:
        """Copy a batch-1 cache's first cache.pos positions into a new last row, ending at pos; its index."""
        T = cache.pos
        if self.rows == self.max_batch:
            raise ValueError(f"all {self.rows} rows are in use")
        if self.rows == 0:
            self.pos = 0
        end = max(self.pos, T)
        if self.rows + 1 > self.row_capacity or end > self.capacity:
            self._fit(self.rows + 1, end, max(self._span(), T))
        if T > self.pos:  # shift the batch right so the new row fits, ending at pos
            self._shift(T - self.pos)
        i, P = self.rows, self.pos
        for layer, (k, v) in enumerate(zip(cache.k, cache.v)):  # each (1, nh, capacity, hs)
            self.k[layer, i, :, P - T:P] = k[0, :, :T]
            self.v[layer, i, :, P - T:P] = v[0, :, :T]
        self.mask[i].zero_()
        self.mask[i, P - T:P] = 1
        self.rows += 1
        return i

    def remove(self, i: int) -> None:
        """Row i leaves; the last row moves into its slot (a caller's list of rows does the same)."""
        last = self.rows - 1
        if i != last:
            self.k[:, i] = self.k[:, last]
            self.v[:, i] = self.v[:, last]
            self.mask[i] = self.mask[last]
        self.rows = last
        if last == 0:
            self.pos = 0

    def clear(self) -> None:
        """Every row leaves (the storage stays allocated)."""
        self.rows = self.pos = 0

    def release(self) -> None:
        """Free the storage (no row may be live); the next insert allocates again."""
        assert self.rows == 0, "release() with live rows"
        self.k = self.v = self.mask = None
        self.pos = 0

    def shrink(self) -> None:
        """Storage for exactly the live rows and their columns (plus the next one); none if no row is live."""
        if self.rows == 0:
            self.release()
            return
        self._compact()
        self._reallocate(self.rows, min(self.max_capacity, self.pos + 1))

    # -- one decode step -----------------------------------------------------------------------

    def decode_mask(self, spare: int = 0) -> torch.Tensor:
        """Make column pos (and `spare` more, where the context allows) exist and mark pos for every live
        row; the step's attention mask (rows, pos + 1)."""
        need = self.pos + 1 + spare
        if spare and (need > self.max_capacity
                      or self.max_bytes is not None and self.bytes_for(self.row_capacity, need) > self.max_bytes):
            need = self.pos + 1  # no spare column past the context or the KV budget
        if need > self.capacity:
            self._fit(self.rows, need, self._span() + need - self.pos)
        self.mask[:self.rows, self.pos] = 1
        return self.mask[:self.rows, :self.pos + 1]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (rows, nh, T, hs) at [pos, pos+T); return the live rows' keys and values (rows, nh, pos+T, hs)."""
        end = self.pos + k.size(2)
        if end > self.capacity:
            raise ContextLengthError(f"KV cache is full: {end} positions needed, capacity is {self.capacity}")
        B = self.rows
        self.k[layer, :B, :, self.pos:end] = k
        self.v[layer, :B, :, self.pos:end] = v
        return self.k[layer, :B, :, :end], self.v[layer, :B, :, :end]

    def advance(self, num_positions: int) -> None:
        self.pos += num_positions

    # -- a speculative round at batch 1 (batching.Scheduler with a draft) ------------------------

    def lone_row(self, extra: int) -> "BatchKV":
        """The one live row moved to column 0 and `extra` more columns made to exist: the cache then
        works as a batch-1 KVCache with no attention mask (a verify writes extra positions at once,
        rewind drops the rejected ones). mark_lone_row() afterwards."""
        assert self.rows == 1, "lone_row() with more than one live row"
        if not self.lone_row_unpadded():
            self._compact()
        if self.pos + extra > self.capacity:
            self._fit(1, self.pos + extra, self.pos + extra)
        return self

    def lone_row_unpadded(self) -> bool:
        """One live row, starting at column 0: it needs no attention mask (its positions are 0, 1, ...)."""
        return self.rows == 1 and bool(self.mask[0, 0])

    rewind = KVCache.rewind  # one write position for every row: the same bookkeeping as a KVCache's

    def mark_lone_row(self) -> None:
        """After a round on lone_row(): the row's columns are [0, pos)."""
        self.mask[0, :self.pos] = 1
        self.mask[0, self.pos:] = 0

    # -- storage geometry ----------------------------------------------------------------------

    def _span(self) -> int:
        """Columns from the first one a live row uses to pos (what compaction keeps)."""
        if self.rows == 0:
            return 0
        used = self.mask[:self.rows, :self.pos].any(dim=0).nonzero()
        return self.pos - int(used[0]) if len(used) else 0

    def _fit(self, rows: int, end: int, width: int) -> None:
        """Room for `rows` rows and columns [0, end), where `end` becomes `width` once compacted."""
        C = self.capacity
        if end > C and (end - width >= C // 2 or end > self.max_capacity):
            self._compact()  # dropping unused columns frees enough
            end = width
        R, C = self.row_capacity, self.capacity
        if rows <= R and end <= C:
            return
        new_r = R if rows <= R else min(self.max_batch, max(2 * R, rows))
        new_c = C
        if end > C:
            new_c = max(C, self.initial_capacity)
            while new_c < end:
                new_c *= 2
            new_c = min(new_c, self.max_capacity)
        if self.max_bytes is not None and self.bytes_for(new_r, new_c) > self.max_bytes:
            self._compact()  # within the budget: no unused column, no spare row, as many columns as fit
            end = width
            if self.bytes_for(rows, end) > self.max_bytes:
                raise KVLimitExceeded(f"the batch needs {self.bytes_for(rows, end)} bytes of KV cache; "
                                      f"{self.max_bytes} are left under the limit")
            new_r = rows
            new_c = max(end, min(new_c, self.max_bytes // self.bytes_for(rows, 1)))
        self._reallocate(new_r, new_c)

    def _reallocate(self, rows: int, columns: int) -> None:
        """New storage of rows x columns holding the live rows' columns [0, pos)."""
        B, P = self.rows, self.pos
        k = torch.zeros(self.n_layer, rows, self.n_head, columns, self.head_size, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        mask = torch.zeros(rows, columns, dtype=torch.long, device=self.device)
        if B:
            k[:, :B, :, :P] = self.k[:, :B, :, :P]
            v[:, :B, :, :P] = self.v[:, :B, :, :P]
            mask[:B, :P] = self.mask[:B, :P]
        self.k, self.v, self.mask = k, v, mask

    def _compact(self) -> None:
        """Drop the leading columns no live row uses: the rows then start at column 0."""
        B, P = self.rows, self.pos
        keep = self._span()
        free = P - keep
        if free == 0:
            return
        self.k[:, :B, :, :keep] = self.k[:, :B, :, free:P].clone()
        self.v[:, :B, :, :keep] = self.v[:, :B, :, free:P].clone()
        self.mask[:B, :keep] = self.mask[:B, free:P].clone()
        self.mask[:B, keep:] = 0
        self.pos = keep
        self.compactions += 1

    def _shift(self, d: int) -> None:
        """Move every live row d columns right (the new pos is pos + d; the storage has room)."""
        B, P = self.rows, self.pos
        if B and P:
            self.k[:, :B, :, d:P + d] = self.k[:, :B, :, :P].clone()
            self.v[:, :B, :, d:P + d] = self.v[:, :B, :, :P].clone()
            self.mask[:B, d:P + d] = self.mask[:B, :P].clone()
        self.mask[:B, :d] = 0
        self.pos = P + d
        self.shifts += B > 0
