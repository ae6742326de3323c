"""Continuous batching: one decode loop, on one background thread, shared step by step by many requests.

    from gpt2.batching import Continuation, Scheduler
    scheduler = Scheduler(model, max_batch=16, max_queue=64).start()
    seq = Continuation(prompt=[464, 3290], max_new_tokens=32, emit=on_event)   # on_event(("token", id, lp) | ...)
    scheduler.submit([seq])          # QueueFull when too many sequences wait; cancel(seq) stops it early
    scheduler.stop()                 # finish (or, after `timeout`, cancel) the work in flight; join the thread

It knows only token ids (server.py is the text and HTTP edge). Each Continuation samples with its own
SamplingConfig and its own torch.Generator, so a seeded sequence draws the same tokens whether it runs
alone or in a busy batch, and exactly what `engine.generate(model, [prompt], seed=s)` draws.

The scheduler thread is the only one that runs the model. A new sequence is prefilled alone (its own
small KVCache, the engine's exact prefill; with `echo_logprobs` the same forward also gives the prompt's
own logprobs), its first token sampled, then its keys and values join the shared batch: a BatchKV
(kv_cache.py), which owns the storage geometry (rows right-aligned at one write position, masked to
the left like left padding; shifts, compaction, growth). One decode step feeds every row's last token.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from gpt2.config import GPT2_EOT
from gpt2.errors import ContextLengthError, GPT2Error
from gpt2.kv_cache import BatchKV, KVCache
from gpt2.sampling import SamplingConfig, SamplingState, make_generators, next_tokens


class QueueFull(GPT2Error):
    """Too many sequences are waiting for a slot; try again later."""


class SchedulerClosed(GPT2Error):
    """The scheduler is shutting down and takes no new work."""


class KVLimitExceeded(GPT2Error):
    """A sequence needs more KV memory than max_kv_mb allows, even alone (the server answers 429)."""


@dataclass(eq=False)
class Continuation:
    """One generated continuation of one prompt. Events go to `emit`, called from the scheduler thread:

    ("prompt", entries) first, only with `echo_logprobs`: one entry per prompt token after the first;
    ("token", id, entry) for each new id; a stop id is not a token of the output, but with `logprobs` set
    it comes as ("stop_token", id, entry) just before ("done", "stop"), so a client that wants one
    logprob entry per generated token (lm-eval) gets its score too; then one ("done", reason) with
    reason "stop" (a stop id, or cancel(seq, "stop")), "length" (max_new_tokens) or "cancelled".
    An entry is (logprob of the token, [(id, logprob)] of the top `logprobs`) from the model's
    distribution (log_softmax of the raw logits); a token's entry is None unless `logprobs` is set.
    """
    prompt: list[int]
    max_new_tokens: int
    emit: object = None                              # callable(event); None: events are dropped
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None
    stop_token_ids: frozenset = frozenset({GPT2_EOT})
    logprobs: int | None = None
    echo_logprobs: bool = False                      # also the prompt's own logprobs, from the prefill
    # scheduler state
    generated: int = 0
    finish_reason: str | None = None
    _cancel: str | None = None
    _next: int | None = None                         # the sampled id the next decode step feeds
    _state: SamplingState | None = None
    _generator: torch.Generator | None = None


def logprob_entries(logits: torch.Tensor, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row i of logits (N, V): (logprob of ids[i], the top `top` (id, logprob)), from log_softmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    chosen = logp.gather(1, torch.tensor(ids, dtype=torch.long, device=logp.device).view(-1, 1)).view(-1).tolist()
    if top == 0:
        return [(c, []) for c in chosen]
    values, top_ids = torch.topk(logp, top, dim=-1)  # (N, top)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, top_ids.tolist(), values.tolist())]


class Scheduler:
    def __init__(self, model, max_batch: int = 16, max_queue: int = 64, initial_capacity: int = 128, *,
                 prefill_chunk: int = 256, prefix_cache: bool = True, max_kv_mb: float | None = None,
                 idle_shrink_s: float = 5.0):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.model = model.eval()
        self.prefill_chunk, self.use_prefix_cache, self.idle_shrink_s = prefill_chunk, prefix_cache, idle_shrink_s
        self.kv_limit_bytes = None if max_kv_mb is None else int(max_kv_mb * (1 << 20))
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.n_positions = model.config.n_positions
        self.device = model.transformer.wte.weight.device
        self.kv = BatchKV.for_model(model, max_batch, initial_capacity)
        self._cond = threading.Condition()
        self._waiting: deque[Continuation] = deque()
        self._rows: list[Continuation] = []         # row i of self.kv is self._rows[i]
        self._admitting: list[Continuation] = []    # taken from the queue, being prefilled
        self._thread: threading.Thread | None = None
        self._closing = False                       # no new work
        self._stopped = False                       # the loop exits
        self._paused = False
        self.steps = 0                              # decode steps run (shared by all rows)
        self.tokens = 0                             # tokens generated, all sequences
        self.error: BaseException | None = None

    # -- public, thread-safe -------------------------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="gpt2-scheduler", daemon=True)
        self._thread.start()
        return self

    def submit(self, seqs: list[Continuation]) -> None:
        """Queue sequences (all or none). Raises QueueFull or SchedulerClosed."""
        for s in seqs:
            if not s.prompt or len(s.prompt) + s.max_new_tokens > self.n_positions:
                raise ContextLengthError(f"a prompt of {len(s.prompt)} tokens plus max_new_tokens="
                                         f"{s.max_new_tokens} does not fit in the context of {self.n_positions}")
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the server is shutting down")
            # A free batch slot takes a sequence at once, so only the excess has to queue.
            free = self.max_batch - len(self._rows) - len(self._admitting)
            if len(self._waiting) + len(seqs) - max(free, 0) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} sequences are waiting; the queue holds {self.max_queue}")
            self._waiting.extend(seqs)
            self._cond.notify_all()

    def cancel(self, seq: Continuation, reason: str = "cancelled") -> None:
        """Stop a sequence at the next step ("stop" when the edge found a stop string)."""
        with self._cond:
            if seq.finish_reason is None and seq._cancel is None:
                seq._cancel = reason
                self._cond.notify_all()

    def pause(self) -> None:
        """Hold admission and decoding after the current step (maintenance, tests); resume() continues."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Take no new work; let running and queued sequences finish for up to `timeout` s, then cancel them.

        With timeout=0 nothing more is admitted: the loop cancels everything at its next step.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._paused = False
            self._cond.notify_all()
            # The loop notifies after every step, so this wakes when the load falls.
            while self._thread is not None and self._thread.is_alive() and self._busy():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            self._stopped = True  # the loop cancels whatever is left and exits
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(10.0)

    def stats(self) -> dict:
        """Gauges for /metrics (thread-safe): sequences waiting and decoding, KV bytes held and allowed."""
        with self._cond:
            return {"queue_depth": len(self._waiting), "running": len(self._rows),
                    "kv_bytes": self.kv.nbytes, "kv_limit_bytes": self.kv_limit_bytes, "prefix_cache_bytes": 0}

    @property
    def busy(self) -> int:
        """Sequences decoding plus sequences waiting."""
        with self._cond:
            return self._busy()

    def _busy(self) -> int:
        return len(self._rows) + len(self._waiting) + len(self._admitting)

    # -- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while self._take_work():
                    for s in self._admitting:
                        self._admit(s)
                    with self._cond:
                        self._admitting = []
                    self._drop_finished()
                    if self._rows:
                        self._decode_step()
                        self._drop_finished()
        except BaseException as e:  # a bug, or out of memory: fail every sequence rather than hang them
            self.error = e
            self._fail_all()
            raise
        self._fail_all()  # stopped

    def _take_work(self) -> bool:
        """Wait for work; move what fits into the batch to _admitting, finish cancelled waiters. False: stop."""
        with self._cond:
            self._cond.notify_all()  # the load may have fallen since the last step: stop() waits on it
            while (self._paused or (not self._waiting and not self._rows)) and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return False
            while self._waiting and len(self._rows) + len(self._admitting) < self.max_batch:
                self._admitting.append(self._waiting.popleft())
            cancelled = [s for s in self._waiting if s._cancel is not None]
            for s in cancelled:
                self._waiting.remove(s)
        for s in cancelled:
            self._finish(s, s._cancel)
        return True

    def _fail_all(self) -> None:
        """Every sequence still here gets ("done", "cancelled"), and no new work is taken."""
        with self._cond:
            self._closing = True
            left = self._admitting + self._rows + list(self._waiting)
            self._waiting.clear()
        for s in left:
            self._finish(s, "cancelled")
        with self._cond:
            self._admitting, self._rows = [], []
            self.kv.clear()
            self._cond.notify_all()

    def _emit(self, seq: Continuation, event) -> None:
        if seq.emit is None:
            return
        try:
            seq.emit(event)
        except Exception:  # the receiver is gone (event loop closed): nobody listens any more
            seq._cancel = seq._cancel or "cancelled"

    def _finish(self, seq: Continuation, reason: str) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
            self._emit(seq, ("done", reason))

    def _sample(self, seq: Continuation, logits: torch.Tensor) -> int | None:
        """Sample seq's next id from its logits (1, V), emit it; None (and finished) on a stop id or the limit."""
        state = seq._state
        ids = next_tokens(logits, seq.sampling, seq._generator, state.seen, state.counts, state.bias)  # (1,)
        state.record(ids)
        t = int(ids[0])
        entry = None if seq.logprobs is None else logprob_entries(logits, [t], seq.logprobs)[0]
        if t in seq.stop_token_ids:
            if entry is not None:
                self._emit(seq, ("stop_token", t, entry))
            self._finish(seq, "stop")
            return None
        seq.generated += 1
        self.tokens += 1
        self._emit(seq, ("token", t, entry))
        if seq.generated >= seq.max_new_tokens:
            self._finish(seq, "length")
            return None
        return t

    def _admit(self, seq: Continuation) -> None:
        """Prefill alone, sample the first token, and move the keys and values into a new row."""
        if seq._cancel is not None:
            self._finish(seq, seq._cancel)
            return
        if seq.max_new_tokens == 0 and not seq.echo_logprobs:
            self._finish(seq, "length")
            return
        cache = KVCache.for_model(self.model, 1, len(seq.prompt))
        logits = self._prefill(seq, cache)  # (1, V)
        if seq.max_new_tokens == 0:
            self._finish(seq, "length")
            return
        seq._state = SamplingState([seq.prompt], seq.sampling, self.model.config.vocab_size, self.device)
        seq._generator = None if seq.sampling.greedy else make_generators(seq.seed, 1, self.device)
        seq._next = self._sample(seq, logits)
        if seq._next is not None:
            self.kv.insert(cache)
            self._rows.append(seq)

    def _prefill(self, seq: Continuation, cache: KVCache) -> torch.Tensor:
        """Run seq's prompt into `cache`; the last position's logits (1, V). With echo_logprobs the same
        forward keeps every position's logits and emits ("prompt", entries) first."""
        idx = torch.tensor([seq.prompt], dtype=torch.long, device=self.device)  # (1, T)
        if not seq.echo_logprobs:
            return self.model(idx, cache=cache, last_logits_only=True)[:, -1]
        logits = self.model(idx, cache=cache)  # (1, T, V)
        self._emit(seq, ("prompt", logprob_entries(logits[0, :-1], seq.prompt[1:], seq.logprobs or 0)))
        return logits[:, -1]

    def _decode_step(self) -> None:
        """Every row's last token at column pos: model(ids (B, 1), attention_mask (B, pos + 1))."""
        mask = self.kv.decode_mask()
        ids = torch.tensor([[s._next] for s in self._rows], dtype=torch.long, device=self.device)  # (B, 1)
        logits = self.model(ids, cache=self.kv, attention_mask=mask)[:, -1]  # (B, V)
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
            self.kv.remove(i)
            self._rows[i] = self._rows[-1]
            self._rows.pop()
