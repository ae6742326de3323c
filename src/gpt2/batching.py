"""Continuous batching: one decode loop, on one background thread, shared step by step by many requests.

    from gpt2.batching import Scheduler, Sequence
    scheduler = Scheduler(model, max_batch=16, max_queue=64).start()
    seq = Sequence(prompt=[464, 3290], max_new_tokens=32, emit=on_event)   # on_event(("token", id, lp) | ("done", why))
    scheduler.submit([seq])          # QueueFull when too many sequences wait; cancel(seq) stops it early
    scheduler.stop()                 # finish (or, after `timeout`, cancel) the work in flight; join the thread

It knows only token ids (server.py is the text and HTTP edge). Each Sequence samples with its own
SamplingConfig and its own torch.Generator, so a seeded sequence draws the same tokens whether it runs
alone or in a busy batch, and exactly what `engine.generate(model, [prompt], seed=s)` draws.

How rows share one KV cache (k, v storage (L, max_batch, nh, C, hs), live rows packed at [0, B)):
  * All rows share one write position P (the cache's `pos`). A row's tokens sit right-aligned in
    columns [P - len, P), and a per-row attention mask (max_batch, C) is 1 there and 0 to the left,
    exactly like left padding; the model derives positions as cumsum(mask) - 1, so they stay correct.
  * A new sequence is prefilled alone (its own small cache, the engine's exact prefill), its first
    token sampled, then its keys and values are copied into row B, right-aligned to end at P. A prompt
    longer than P first shifts the whole batch right.
  * One decode step feeds every row's last token at column P: model(ids (B, 1), attention_mask (B, P + 1)).
  * A finished or cancelled row leaves: the last row moves into its slot.
  * When column P would pass the storage: drop the leading columns no live row uses (compaction), or
    grow the storage (doubling, up to n_positions). A row never spans more than its prompt plus
    max_new_tokens - 1 <= n_positions - 1 columns, so compaction always frees a column.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from gpt2.config import GPT2_EOT
from gpt2.errors import ContextLengthError, GPT2Error
from gpt2.kv_cache import KVCache
from gpt2.sampling import SamplingConfig, SamplingState, make_generators, next_tokens


class QueueFull(GPT2Error):
    """Too many sequences are waiting for a slot; try again later."""


class SchedulerClosed(GPT2Error):
    """The scheduler is shutting down and takes no new work."""


@dataclass(eq=False)
class Sequence:
    """One generated continuation of one prompt. Events go to `emit`, called from the scheduler thread:

    ("token", id, logprobs) for each new id (stop ids are not emitted), then one ("done", reason) with
    reason "stop" (a stop id, or cancel(seq, "stop")), "length" (max_new_tokens) or "cancelled".
    logprobs is None unless `logprobs` is set: then (logprob of id, [(id, logprob)] of the top `logprobs`),
    from the model's distribution (log_softmax of the raw logits).
    """
    prompt: list[int]
    max_new_tokens: int
    emit: object = None                              # callable(event); None: events are dropped
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None
    stop_token_ids: frozenset = frozenset({GPT2_EOT})
    logprobs: int | None = None
    # scheduler state
    generated: int = 0
    finish_reason: str | None = None
    _cancel: str | None = None
    _next: int | None = None                         # the sampled id the next decode step feeds
    _state: SamplingState | None = None
    _generator: torch.Generator | None = None


@torch.inference_mode()
def prompt_logprobs(model, prompt: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each prompt token after the first: (its logprob given the tokens before it, the top `top` (id, logprob))."""
    device = model.transformer.wte.weight.device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    logp = torch.log_softmax(model(idx)[0, :-1].float(), dim=-1)   # (T - 1, V)
    chosen = logp.gather(1, idx[0, 1:].view(-1, 1)).view(-1).tolist()
    if top == 0:
        return [(c, []) for c in chosen]
    values, ids = torch.topk(logp, top, dim=-1)  # (T - 1, top)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


class BatchCache(KVCache):
    """A KVCache over the first B rows of the scheduler's storage: the model writes at `pos` as usual."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, pos: int):
        self.k, self.v = k, v  # views (L, B, nh, C, hs) of the storage; writes land in the storage
        self.capacity = k.size(3)
        self.pos = pos


class Scheduler:
    def __init__(self, model, max_batch: int = 16, max_queue: int = 64, initial_capacity: int = 128):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.model = model.eval()
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.n_positions = model.config.n_positions
        self.device = model.transformer.wte.weight.device
        self._initial_capacity = min(initial_capacity, self.n_positions)
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._rows: list[Sequence] = []          # live rows, row i of the batch is self._rows[i]
        self._admitting = 0                      # taken from the queue, being prefilled
        self._thread: threading.Thread | None = None
        self._closing = False                    # no new work
        self._stopped = False                    # the loop exits
        self._paused = False
        self._k = self._v = self._mask = None    # storage, allocated on first use
        self.P = 0                               # shared write position
        self.steps = 0                           # decode steps run (shared by all rows)
        self.tokens = 0                          # tokens generated, all sequences
        self.shifts = self.compactions = 0       # batch moved right for a long prompt / left to free columns
        self.error: BaseException | None = None

    # -- public, thread-safe -------------------------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="gpt2-scheduler", daemon=True)
        self._thread.start()
        return self

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences (all or none). Raises QueueFull or SchedulerClosed."""
        for s in seqs:
            if not s.prompt or len(s.prompt) + s.max_new_tokens > self.n_positions:
                raise ContextLengthError(f"a prompt of {len(s.prompt)} tokens plus max_new_tokens="
                                         f"{s.max_new_tokens} does not fit in the context of {self.n_positions}")
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the server is shutting down")
            # A free batch slot takes a sequence at once, so only the excess has to queue.
            free = self.max_batch - len(self._rows) - self._admitting
            if len(self._waiting) + len(seqs) - max(free, 0) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} sequences are waiting; the queue holds {self.max_queue}")
            self._waiting.extend(seqs)
            self._cond.notify()

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Stop a sequence at the next step ("stop" when the edge found a stop string)."""
        with self._cond:
            if seq.finish_reason is None and seq._cancel is None:
                seq._cancel = reason
                self._cond.notify()

    def pause(self) -> None:
        """Hold admission and decoding after the current step (maintenance, tests); resume() continues."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Take no new work; let running and queued sequences finish for up to `timeout` s, then cancel them."""
        with self._cond:
            self._closing = True
            self._paused = False
            self._cond.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        while (self._thread is not None and self._thread.is_alive() and self.busy
               and (deadline is None or time.monotonic() < deadline)):
            self._thread.join(0.05)
        with self._cond:
            self._stopped = True  # the loop cancels whatever is left and exits
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(10.0)

    @property
    def busy(self) -> int:
        """Sequences decoding plus sequences waiting."""
        with self._cond:
            return len(self._rows) + len(self._waiting) + self._admitting

    # -- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        while (self._paused or (not self._waiting and not self._rows)) and not self._stopped:
                            self._cond.wait()
                        if self._stopped:
                            break
                        admit = []
                        while self._waiting and len(self._rows) + len(admit) < self.max_batch:
                            admit.append(self._waiting.popleft())
                        self._admitting = len(admit)
                        cancelled = [s for s in self._waiting if s._cancel is not None]
                        for s in cancelled:
                            self._waiting.remove(s)
                    for s in cancelled:
                        self._finish(s, s._cancel)
                    for s in admit:
                        self._admit(s)
                    with self._cond:
                        self._admitting = 0
                    self._drop_finished()
                    if self._rows:
                        self._decode_step()
                        self._drop_finished()
            # stopped: every sequence still here gets its "done" event
            with self._cond:
                left = list(self._waiting) + self._rows
                self._waiting.clear()
            for s in left:
                self._finish(s, "cancelled")
            self._rows = []
        except BaseException as e:  # a bug, or out of memory: fail every sequence rather than hang them
            self.error = e
            with self._cond:
                self._closing = True
                pending = list(self._waiting) + self._rows
                self._waiting.clear()
            for s in pending:
                self._finish(s, "cancelled")
            self._rows = []
            raise

    def _emit(self, seq: Sequence, event) -> None:
        if seq.emit is None:
            return
        try:
            seq.emit(event)
        except Exception:  # the receiver is gone (event loop closed): nobody listens any more
            seq._cancel = seq._cancel or "cancelled"

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
            self._emit(seq, ("done", reason))

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int | None:
        """Sample seq's next id from its logits (1, V), emit it; None (and finished) on a stop id or the limit."""
        state = seq._state
        ids = next_tokens(logits, seq.sampling, seq._generator, state.seen, state.counts, state.bias)  # (1,)
        state.record(ids)
        t = int(ids[0])
        if t in seq.stop_token_ids:
            self._finish(seq, "stop")
            return None
        lp = None
        if seq.logprobs is not None:
            logp = torch.log_softmax(logits[0].float(), dim=-1)  # (V,)
            top = torch.topk(logp, seq.logprobs) if seq.logprobs > 0 else None
            lp = (float(logp[t]), [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())))
        seq.generated += 1
        self.tokens += 1
        self._emit(seq, ("token", t, lp))
        if seq.generated >= seq.max_new_tokens:
            self._finish(seq, "length")
            return None
        return t

    def _admit(self, seq: Sequence) -> None:
        """Prefill alone, sample the first token, and copy the keys and values into a new row."""
        if seq._cancel is not None:
            self._finish(seq, seq._cancel)
            return
        if seq.max_new_tokens == 0:
            self._finish(seq, "length")
            return
        model, T = self.model, len(seq.prompt)
        seq._state = SamplingState([seq.prompt], seq.sampling, model.config.vocab_size, self.device)
        seq._generator = None if seq.sampling.greedy else make_generators(seq.seed, 1, self.device)
        small = KVCache.for_model(model, 1, T)
        idx = torch.tensor([seq.prompt], dtype=torch.long, device=self.device)
        logits = model(idx, cache=small, last_logits_only=True)[:, -1]  # (1, V)
        seq._next = self._sample(seq, logits)
        if seq._next is None:
            return
        B = len(self._rows)
        if B == 0:
            self.P = 0
        self._ensure_storage(max(T, self.P))
        if T > self.P:  # shift the batch right so the new row fits, ending at P
            self._shift(T - self.P)
        P = self.P
        self._k[:, B, :, P - T:P] = small.k[:, 0]
        self._v[:, B, :, P - T:P] = small.v[:, 0]
        self._mask[B].zero_()
        self._mask[B, P - T:P] = 1
        self._rows.append(seq)

    def _decode_step(self) -> None:
        B = len(self._rows)
        self._make_room()
        P = self.P
        self._mask[:B, P] = 1
        ids = torch.tensor([[s._next] for s in self._rows], dtype=torch.long, device=self.device)  # (B, 1)
        cache = BatchCache(self._k[:, :B], self._v[:, :B], P)
        logits = self.model(ids, cache=cache, attention_mask=self._mask[:B, :P + 1])[:, -1]  # (B, V)
        self.P = cache.pos
        self.steps += 1
        for i, s in enumerate(self._rows):
            if s._cancel is None:
                s._next = self._sample(s, logits[i:i + 1])

    def _drop_finished(self) -> None:
        """Rows that finished or were cancelled leave; the last row moves into each freed slot."""
        i = 0
        while i < len(self._rows):
            s = self._rows[i]
            if s._cancel is not None:
                self._finish(s, s._cancel)
            if s.finish_reason is None:
                i += 1
                continue
            last = len(self._rows) - 1
            if i != last:
                self._k[:, i] = self._k[:, last]
                self._v[:, i] = self._v[:, last]
                self._mask[i] = self._mask[last]
                self._rows[i] = self._rows[last]
            self._rows.pop()
        if not self._rows:
            self.P = 0

    # -- storage -------------------------------------------------------------------------------

    def _ensure_storage(self, columns: int) -> None:
        """Storage with at least `columns` columns (doubling, up to n_positions); contents kept."""
        C = 0 if self._k is None else self._k.size(3)
        if columns <= C:
            return
        new_c = max(self._initial_capacity, C)
        while new_c < columns:
            new_c *= 2
        new_c = min(new_c, self.n_positions)
        config = self.model.config
        shape = (config.n_layer, self.max_batch, config.n_head, new_c, config.head_size)
        dtype = self.model.transformer.wte.weight.dtype
        k = torch.zeros(shape, dtype=dtype, device=self.device)
        v = torch.zeros(shape, dtype=dtype, device=self.device)
        mask = torch.zeros(self.max_batch, new_c, dtype=torch.long, device=self.device)
        if C:
            k[..., :C, :] = self._k
            v[..., :C, :] = self._v
            mask[:, :C] = self._mask
        self._k, self._v, self._mask = k, v, mask

    def _shift(self, d: int) -> None:
        """Move every live row d columns right (the new P is P + d)."""
        B, P = len(self._rows), self.P
        self._ensure_storage(P + d)
        if B and P:
            self._k[:, :B, :, d:P + d] = self._k[:, :B, :, :P].clone()
            self._v[:, :B, :, d:P + d] = self._v[:, :B, :, :P].clone()
            self._mask[:B, d:P + d] = self._mask[:B, :P].clone()
        self._mask[:B, :d] = 0
        self.P = P + d
        self.shifts += B > 0

    def _make_room(self) -> None:
        """Make column P exist: grow the storage, or drop leading columns that every live row masks out."""
        B, P, C = len(self._rows), self.P, self._k.size(3)
        if P < C:
            return
        used = self._mask[:B, :P].any(dim=0).nonzero()
        free = int(used[0]) if len(used) else P  # leading columns no live row uses
        if C < self.n_positions and free < C // 2:
            self._ensure_storage(P + 1)
            return
        if free == 0:  # cannot happen: submit() keeps every row within n_positions - 1 columns
            raise ContextLengthError("no room left in the batch's KV cache")
        keep = P - free
        self._k[:, :B, :, :keep] = self._k[:, :B, :, free:P].clone()
        self._v[:, :B, :, :keep] = self._v[:, :B, :, free:P].clone()
        self._mask[:B, :keep] = self._mask[:B, free:P].clone()
        self._mask[:B, keep:] = 0
        self.P = keep
        self.compactions += 1
