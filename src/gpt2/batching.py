"""Continuous batching: one decode loop, on one background thread, shared step by step by many requests.

    from gpt2.batching import Continuation, Scheduler
    scheduler = Scheduler(model, max_batch=16, max_queue=64, prefill_chunk=256, max_kv_mb=2048).start()
    seq = Continuation(prompt=[464, 3290], max_new_tokens=32, emit=on_event)   # on_event(("token", id, lp) | ...)
    scheduler.submit([seq])          # QueueFull / KVLimitExceeded; cancel(seq) stops it early
    scheduler.stats()                # queue depth, running rows, KV bytes (for /metrics)
    scheduler.stop()                 # finish (or, after `timeout`, cancel) the work in flight; join the thread

It knows only token ids (server.py is the text and HTTP edge). Each Continuation samples with its own
SamplingConfig and its own torch.Generator, so a seeded sequence draws the same tokens whether it runs
alone or in a busy batch, chunked or not, and exactly what `engine.generate(model, [prompt], seed=s)` draws.

The scheduler thread is the only one that runs the model. Each turn of its loop:
  1. take work: waiting sequences move, in order, into prefills while a batch row and KV memory are
     free. Sequences with one prompt taken together (a request's n choices) share one Prefill.
  2. prefill a chunk: at most `prefill_chunk` prompt tokens, oldest prompt first, into the prompt's own
     small KVCache (the engine's exact prefill, split at chunk boundaries; with `echo_logprobs` the same
     forwards give the prompt's own logprobs). So a 900-token prompt costs the running streams a few
     chunk-sized pauses, not one long one. A prompt that starts like a recently prefilled one copies
     those keys and values from the prefix cache (PrefixCache) and runs only the rest. When a prompt
     is done, its sequences sample their first tokens and join the shared batch: a BatchKV
     (kv_cache.py), which owns the storage geometry (rows right-aligned at one write position, masked
     to the left like left padding; shifts, compaction, growth within a byte budget).
  3. decode a step: one forward feeds every row's last token. With a draft model, a sequence decoding
     alone (one row, no prefill, nobody waiting) runs a speculative round instead (engine.Speculation
     over the lone BatchKV row and the sequence's own draft cache): greedy output is the same token for
     token, sampled output follows the same distribution (speculative sampling), and it returns to
     plain steps as soon as another sequence arrives. Seeded sampled sequences never speculate: they
     would draw other tokens alone than in a batch, and a seed promises the same tokens either way.
     The draft's caches are outside `max_kv_mb` (a draft is small; a self-draft's cache is the
     target's size).
  4. drop finished rows and prefills (stop ids, length, cancel).
  5. shrink: after `idle_shrink_s` with nothing to do, the batch's storage is freed.

KV memory (`max_kv_mb`) counts the batch storage, the prefills' caches and the prefix cache. A sequence
is taken from the queue only when the worst case of the batch with it (rows x the longest prompt plus
max_new_tokens) fits besides the prefills, after evicting prefix-cache entries (least recently used
first); until then it waits. One that could not fit even alone is refused at submit (KVLimitExceeded).
Growing or shrinking the batch storage briefly holds the old and the new tensors.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from gpt2.config import GPT2_EOT
from gpt2.engine import (DraftLength, Speculation, SpeculationStats, checked_compiled_step, compiled_step_rows,
                         draft_costs, draft_fits, resolve_draft, unchecked_compiled_step)
from gpt2.errors import ContextLengthError, GPT2Error, KVLimitExceeded
from gpt2.kv_cache import BatchKV, KVCache
from gpt2.sampling import SamplingConfig, SamplingState, accept_drafts, make_generators, next_tokens

__all__ = ["Continuation", "KVLimitExceeded", "PrefixCache", "QueueFull", "Scheduler", "SchedulerClosed"]

log = logging.getLogger(__name__)


def release_openmp_threads() -> bool:
    """Let the calling thread's OpenMP worker threads go (OpenMP 5.0's omp_pause_resource_all, soft);
    they come back at its next parallel region. True if libgomp (PyTorch's OpenMP on Linux) did it.

    The scheduler runs the model on a thread of its own, which gets an OpenMP team of its own. With
    the team of the thread that loaded the model still parked, libgomp manages more threads than there
    are CPUs, and then its workers spin only briefly between parallel regions: each of a decode step's
    hundreds of regions waits for a sleeping thread to wake. Measured on 2 cores (Intel Xeon, int4,
    batch 8, engine.generate): 447 tok/s on the main thread, 300 on a second one, 455 on the second
    one once the main thread's team was let go (BENCHMARKS.md, Server).
    """
    try:
        libgomp = ctypes.CDLL("libgomp.so.1")  # the one already loaded (torch/lib's), found by its soname
        return libgomp.omp_pause_resource_all(1) == 0  # 1: omp_pause_soft
    except (OSError, AttributeError) as e:  # no libgomp (another OpenMP, or none), or before OpenMP 5.0
        log.debug("OpenMP threads not released: %s", e)
        return False


def compiled_row_counts(max_batch: int) -> list[int]:
    """The row counts a compiled scheduler builds a decode graph for: powers of two, and max_batch."""
    return sorted({min(max_batch, 1 << i) for i in range(max_batch.bit_length() + 1)})


class QueueFull(GPT2Error):
    """Too many sequences are waiting for a slot; try again later."""


class SchedulerClosed(GPT2Error):
    """The scheduler is shutting down and takes no new work."""


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
    _speculation: Speculation | None = None          # with a draft, unless seeded sampling (Scheduler._speculation_for)

    @property
    def max_positions(self) -> int:
        """Prompt plus new tokens: the most KV positions this sequence's row can ever need."""
        return len(self.prompt) + self.max_new_tokens


@dataclass(eq=False)
class Prefill:
    """One prompt being prefilled, chunk by chunk, for the sequences that share it."""
    prompt: list[int]
    seqs: list[Continuation]
    cache: KVCache | None = None      # allocated when the first chunk runs
    done: int = 0                     # prompt positions whose keys and values are in `cache`
    entries: list = field(default_factory=list)  # with echo: the prompt's logprob entries so far
    logits: torch.Tensor | None = None           # (1, V) at the last position run

    @property
    def echo(self) -> bool:
        return any(s.echo_logprobs for s in self.seqs)

    @property
    def finished(self) -> bool:
        return self.done == len(self.prompt)


def logprob_entries(logits: torch.Tensor, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row i of logits (N, V): (logprob of ids[i], the top `top` (id, logprob)), from log_softmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    chosen = logp.gather(1, torch.tensor(ids, dtype=torch.long, device=logp.device).view(-1, 1)).view(-1).tolist()
    if top == 0:
        return [(c, []) for c in chosen]
    values, top_ids = torch.topk(logp, top, dim=-1)  # (N, top)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, top_ids.tolist(), values.tolist())]


def common_prefix_length(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The prefilled KVCaches of recent prompts, reused by prompts that start the same way.

    An LRU from a whole prompt to the cache its rows were copied from (kept instead of freed).
    `longest_prefix` finds the entry sharing the most leading tokens with a new prompt; the new prefill
    copies those positions and runs the rest, always at least its last token (whose logits give the
    first new token). An entry that a newer prompt extends is dropped: the newer one holds its positions.
    `nbytes` never passes `max_bytes`; the scheduler also evicts to make room for work.
    """

    def __init__(self, max_bytes: int, bytes_per_position: int):
        self.max_bytes, self.bytes_per_position = max_bytes, bytes_per_position
        self.entries: OrderedDict[tuple[int, ...], KVCache] = OrderedDict()
        self.nbytes = 0
        self.hits = self.reused_tokens = 0

    def longest_prefix(self, prompt: list[int]) -> tuple[KVCache | None, int]:
        """The entry to copy from and how many positions (at most len(prompt) - 1); (None, 0) if none."""
        best, best_key, n = None, None, 0
        for key, cache in self.entries.items():
            m = common_prefix_length(key, prompt)
            if m > n:
                best, best_key, n = cache, key, m
        n = min(n, len(prompt) - 1)
        if n == 0:
            return None, 0
        self.entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += n
        return best, n

    def add(self, prompt: list[int], cache: KVCache) -> None:
        key = tuple(prompt)
        for old in [k for k in self.entries if len(k) <= len(key) and key[:len(k)] == k]:
            self._drop(old)  # a prefix of this prompt (or the same prompt): this entry holds it
        self.entries[key] = cache
        self.nbytes += len(key) * self.bytes_per_position
        self.evict(self.max_bytes)

    def evict(self, max_bytes: int) -> None:
        """Drop least recently used entries until nbytes <= max_bytes."""
        while self.entries and self.nbytes > max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key) -> None:
        del self.entries[key]
        self.nbytes -= len(key) * self.bytes_per_position


class Scheduler:
    """Continuous batching over one model (see the module docstring). prefill_chunk=0 prefills every
    prompt whole; prefix_cache=False turns the prefix cache off; max_kv_mb=None sets no KV limit (the
    prefix cache then holds at most as much as a full batch)."""

    def __init__(self, model, max_batch: int = 16, max_queue: int = 64, initial_capacity: int = 128, *,
                 prefill_chunk: int = 256, prefix_cache: bool = True, max_kv_mb: float | None = None,
                 idle_shrink_s: float = 5.0, draft=None, draft_tokens: int = 4, adaptive_draft: bool = True,
                 compile: bool = False):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 0 or draft_tokens < 1:
            raise ValueError("max_batch and draft_tokens must be >= 1, max_queue >= 0 and prefill_chunk >= 0")
        if max_kv_mb is not None and max_kv_mb <= 0:
            raise ValueError("max_kv_mb must be positive")
        self.model = model.eval()
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.idle_shrink_s = idle_shrink_s
        self.n_positions = model.config.n_positions
        self.device = model.transformer.wte.weight.device
        self.kv = BatchKV.for_model(model, max_batch, initial_capacity, compiled=compile)
        self.kv_limit_bytes = None if max_kv_mb is None else int(max_kv_mb * (1 << 20))
        position_bytes = self.kv.bytes_per_position
        self.prefix = None
        if prefix_cache:
            bound = self.kv_limit_bytes or position_bytes * max_batch * self.n_positions
            self.prefix = PrefixCache(bound, position_bytes)
        self._cond = threading.Condition()
        self._waiting: deque[Continuation] = deque()
        self._prefills: list[Prefill] = []          # taken from the queue, oldest first
        self._rows: list[Continuation] = []         # row i of self.kv is self._rows[i]
        self._thread: threading.Thread | None = None
        self._closing = False                       # no new work
        self._stopped = False                       # the loop exits
        self._paused = False
        self._last_work = time.monotonic()
        self.steps = 0                              # decode steps run (shared by all rows)
        self.tokens = 0                             # tokens generated, all sequences
        self.prefill_tokens = 0                     # prompt tokens run through the model
        # speculation for a lone greedy sequence (the module docstring); draft: a GPT or "self:int8" / "self:int4"
        self.draft = None if draft is None else resolve_draft(self.model, draft)
        self.draft_tokens, self.adaptive_draft = draft_tokens, adaptive_draft
        self.speculation = SpeculationStats()       # rounds run, drafts proposed and kept, all sequences
        self.compile = compile                      # decode steps through the engine's compiled step
        self._checked_storage = None                # (id of the storage, rows) of the last fully checked step
        self.error: BaseException | None = None

    # -- public, thread-safe -------------------------------------------------------------------

    def start(self) -> "Scheduler":
        release_openmp_threads()  # this thread's, typically the one that loaded the model: see there
        self._thread = threading.Thread(target=self._loop, name="gpt2-scheduler", daemon=True)
        self._thread.start()
        return self

    def submit(self, seqs: list[Continuation]) -> None:
        """Queue sequences (all or none). Raises ContextLengthError, KVLimitExceeded, QueueFull or SchedulerClosed."""
        for s in seqs:
            if not s.prompt or s.max_positions > self.n_positions:
                raise ContextLengthError(f"a prompt of {len(s.prompt)} tokens plus max_new_tokens="
                                         f"{s.max_new_tokens} does not fit in the context of {self.n_positions}")
            if self.kv_limit_bytes is not None and self._alone_bytes(s) > self.kv_limit_bytes:
                raise KVLimitExceeded(
                    f"a prompt of {len(s.prompt)} tokens plus max_new_tokens={s.max_new_tokens} needs "
                    f"{self._alone_bytes(s) / 2**20:.1f} MiB of KV cache; the limit (max_kv_mb) is "
                    f"{self.kv_limit_bytes / 2**20:.1f} MiB")
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the server is shutting down")
            # A free batch slot takes a sequence at once, so only the excess has to queue.
            free = self.max_batch - self._seats_taken()
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
        """Gauges for /metrics: sequences waiting and decoding; KV bytes held (batch storage, prefills'
        caches and the prefix cache), the limit (None: none) and the prefix cache's share."""
        with self._cond:
            prefix = self.prefix.nbytes if self.prefix is not None else 0
            return {"queue_depth": len(self._waiting), "running": len(self._rows),
                    "kv_bytes": self.kv.nbytes + self._prefill_bytes(started_only=True) + prefix,
                    "kv_limit_bytes": self.kv_limit_bytes, "prefix_cache_bytes": prefix}

    @property
    def busy(self) -> int:
        """Sequences decoding plus sequences waiting."""
        with self._cond:
            return self._busy()

    def _busy(self) -> int:
        return len(self._waiting) + self._seats_taken()

    def _seats_taken(self) -> int:
        """Batch rows in use or promised to a prefill."""
        return len(self._rows) + sum(len(p.seqs) for p in self._prefills)

    # -- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                if self.compile:
                    self._compile_steps()
                while self._wait_for_work():
                    self._take_work()
                    self._prefill_chunk()
                    self._drop_finished()
                    self._decode_step()
                    self._drop_finished()
                    self._shrink_when_idle()
        except BaseException as e:  # a bug, or out of memory: fail every sequence rather than hang them
            self.error = e
            self._fail_all()
            raise
        self._fail_all()  # stopped

    def _wait_for_work(self) -> bool:
        """Until there is work, or the batch storage has been idle for idle_shrink_s. False: stop."""
        with self._cond:
            self._cond.notify_all()  # the load may have fallen since the last step: stop() waits on it
            while (self._paused or not self._busy()) and not self._stopped:
                if self._paused or self.kv.nbytes == 0:
                    self._cond.wait()
                    continue
                left = self._last_work + self.idle_shrink_s - time.monotonic()
                if left <= 0:
                    break  # idle long enough: the loop shrinks
                self._cond.wait(left)
            if self._busy():
                self._last_work = time.monotonic()
            return not self._stopped

    def _take_work(self) -> None:
        """Waiting sequences move, in order, into prefills while a row and the KV memory allow; the head
        of the queue waits for memory (nothing overtakes it). Cancelled waiters finish."""
        with self._cond:
            finished = [(s, s._cancel) for s in self._waiting if s._cancel is not None]
            for s, _ in finished:
                self._waiting.remove(s)
            while self._waiting and self._seats_taken() < self.max_batch:
                seq = self._waiting[0]
                if seq.max_new_tokens == 0 and not seq.echo_logprobs:
                    finished.append((self._waiting.popleft(), "length"))  # nothing to compute
                    continue
                shared = next((p for p in self._prefills if p.done == 0 and p.prompt == seq.prompt), None)
                if not self._make_room(seq, shared):
                    break
                self._waiting.popleft()
                if shared is not None:
                    shared.seqs.append(seq)
                else:
                    self._prefills.append(Prefill(seq.prompt, [seq]))
        for s, reason in finished:
            self._finish(s, reason)

    def _prefill_chunk(self) -> None:
        """Up to prefill_chunk prompt tokens (0: every prompt whole), oldest prompt first. A prompt whose
        last chunk ran gives its sequences their first tokens, and they join the batch."""
        budget = self.prefill_chunk or self.n_positions * len(self._prefills)
        for p in list(self._prefills):
            if budget <= 0:
                break
            if p.cache is None:
                self._start_prefill(p)
            n = min(len(p.prompt) - p.done, budget)
            self._run_prompt(p, n)
            budget -= n
            if p.finished:
                self._start_decoding(p)

    def _decode_step(self) -> None:
        """Every row's last token at column pos: model(ids (B, 1), attention_mask (B, pos + 1))."""
        if not self._rows or self._speculate_alone():
            return
        self.kv.max_bytes = self._batch_budget()
        # A compiled step's graph holds while its cache has a column beyond the attended ones (engine.StaticDecode)
        mask = self.kv.decode_mask(spare=int(self.compile))
        if self.kv.lone_row_unpadded():
            mask = None  # plain causal attention, the faster path (and the engine's for one unpadded prompt)
        ids = torch.tensor([[s._next] for s in self._rows], dtype=torch.long, device=self.device)  # (B, 1)
        if self.compile:
            logits = self._compiled_step(self.kv, ids)
        else:
            logits = self.model(ids, cache=self.kv, attention_mask=mask)[:, -1]  # (B, V)
        self.steps += 1
        for i, s in enumerate(self._rows):
            if s._cancel is None:
                s._next = self._sample(s, logits[i:i + 1])
                if s._next is not None and s._speculation is not None:
                    s._speculation.extend(s._next)  # committed without the draft: it catches up when alone

    def _compile_steps(self) -> None:
        """Build the compiled step's graphs before any request needs them, on this thread, as the loop
        starts (requests arriving meanwhile wait in the queue): one per row count _compiled_step uses
        (1, 2, 4, ... and max_batch), each a step of that many one-token rows in a storage of its own."""
        one_token = KVCache.for_model(self.model, 1, 2, compiled=True)
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=one_token)
        for rows in compiled_row_counts(self.max_batch):
            start = time.perf_counter()
            kv = BatchKV.for_model(self.model, rows, initial_capacity=8, compiled=True)
            for _ in range(rows):
                kv.insert(one_token)
            kv.decode_mask()
            self._compiled_step(kv, torch.zeros(rows, 1, dtype=torch.long, device=self.device))
            log.info("compiled the decode step for %d rows in %.1f s", rows, time.perf_counter() - start)
        self._checked_storage = None

    def _compiled_step(self, kv: BatchKV, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of ids (B, 1) through the engine's compiled decode step (engine.decode_step), run
        over the storage's first R rows (engine.compiled_step_rows): B for a package, which takes any row
        count; for torch.compile the power of two from B up (at most the rows allocated), each R a graph
        of its own (1, 2, 4, ... max_batch), so rows joining and leaving rarely compile again. Rows no
        sequence holds feed token 0, attend to their own slot only, and their logits are dropped."""
        B = ids.size(0)
        R, P = compiled_step_rows(self.model, B, kv.row_capacity), kv.pos
        keys = kv.mask[:R, :P + 1].bool()  # (R, P + 1): what each row attends to, column P its new token
        keys[B:] = False
        keys[B:, P] = True
        positions = keys.sum(1, keepdim=True) - 1  # (R, 1): a row's tokens count its position, as in eager
        padded_ids = torch.zeros(R, 1, dtype=torch.long, device=self.device)
        padded_ids[:B] = ids
        # One graph input per layer (views of the (L, R, nh, C, hs) storage): in place into a slice of one
        # input, the compiled step would copy that whole input every step.
        layers = SimpleNamespace(k=[k[:R] for k in kv.k.unbind(0)], v=[v[:R] for v in kv.v.unbind(0)])
        args = (self.model, padded_ids, positions, torch.tensor([P], device=self.device), keys, layers)
        storage = (id(kv.k), R)  # an id, not the tensor: a reallocated storage must be freed
        if storage == self._checked_storage:  # the storage and rows of the last checked step
            logits = unchecked_compiled_step(self.model, args)
        else:
            logits = checked_compiled_step(self.model, args)
            self._checked_storage = storage
        kv.advance(1)
        return logits[:B]

    def _speculate_alone(self) -> bool:
        """One speculative round for a lone row, instead of a decode step; False where none applies."""
        if len(self._rows) != 1 or self._prefills or self._waiting:
            return False
        s = self._rows[0]
        spec = s._speculation
        k = 0 if spec is None or s._cancel is not None else spec.draft_length()
        if k < 1:
            return False
        with self._cond:
            self.kv.max_bytes = self._batch_budget()
            try:
                spec.target_cache = self.kv.lone_row(extra=k + 1)  # column 0 on, room for the verify
            except KVLimitExceeded:
                return False
        if spec.draft_cache is None:  # allocated when first alone: a busy server's sequences never need one
            spec.draft_cache = KVCache.for_model(self.draft, 1, s.max_positions - 1)
        drafts, draft_probs = spec.propose(k)                                   # (1, k), (1, k, V) or None
        accepted, next_id = accept_drafts(spec.verify(drafts), draft_probs, drafts, s.sampling, spec.generators)
        kept = spec.keep(drafts, accepted, next_id, torch.ones(1, dtype=torch.bool))     # (1, n + 1)
        spec.commit(kept, proposed=k)  # the target's cache (the row) and the draft's roll back
        self.kv.mark_lone_row()
        self.steps += 1
        for t in kept[0].tolist():
            s._next = self._take_token(s, t, None)
            if s._next is None:
                break
        return True

    def _drop_finished(self) -> None:
        """Rows that finished or were cancelled leave (the last row moves into each freed slot); cancelled
        sequences leave their prefill, and a prefill nobody waits for is dropped."""
        i = 0
        while i < len(self._rows):
            s = self._rows[i]
            if s._cancel is not None:
                self._finish(s, s._cancel)
            if s.finish_reason is None:
                i += 1
                continue
            with self._cond:
                self.kv.remove(i)
                self._rows[i] = self._rows[-1]
                self._rows.pop()
        for p in list(self._prefills):
            for s in [s for s in p.seqs if s._cancel is not None]:
                self._finish(s, s._cancel)
                with self._cond:
                    p.seqs.remove(s)
            if not p.seqs:
                with self._cond:
                    self._prefills.remove(p)

    def _shrink_when_idle(self) -> None:
        """Free the batch storage once nothing has run for idle_shrink_s (the prefix cache stays)."""
        with self._cond:
            if not self._busy() and time.monotonic() - self._last_work >= self.idle_shrink_s:
                self.kv.release()

    # -- prefill ---------------------------------------------------------------------------------

    def _start_prefill(self, p: Prefill) -> None:
        """The prompt's own cache; the keys and values of a cached prefix copied in (not with echo: every
        position's logits are wanted then)."""
        p.cache = KVCache.for_model(self.model, 1, len(p.prompt), compiled=self.compile)  # joins self.kv
        if self.prefix is None or p.echo:
            return
        source, n = self.prefix.longest_prefix(p.prompt)
        if n:
            for layer in range(self.model.config.n_layer):  # written as a forward would write them
                p.cache.update(layer, source.k[layer][:, :, :n], source.v[layer][:, :, :n])
            p.cache.advance(n)
            p.done = n

    def _run_prompt(self, p: Prefill, n: int) -> None:
        """The next n prompt tokens into p.cache; the logits at the last of them (and with echo, the
        logprob entries of the prompt tokens they predict)."""
        idx = torch.tensor([p.prompt[p.done:p.done + n]], dtype=torch.long, device=self.device)  # (1, n)
        if p.echo:
            logits = self.model(idx, cache=p.cache)  # (1, n, V)
            targets = p.prompt[p.done + 1:p.done + n + 1]  # the last position predicts past the prompt
            top = max(s.logprobs or 0 for s in p.seqs if s.echo_logprobs)
            p.entries += logprob_entries(logits[0, :len(targets)], targets, top)
        else:
            logits = self.model(idx, cache=p.cache, last_logits_only=True)  # (1, 1, V)
        p.logits = logits[:, -1]
        p.done += n
        self.prefill_tokens += n

    def _start_decoding(self, p: Prefill) -> None:
        """The prompt is prefilled: echo its logprobs, sample each sequence's first token, add the rows,
        and keep the cache in the prefix cache.

        Every sequence on the prompt (n > 1) samples from the same last-position logits, the ones
        engine.generate's prefill gives, each with its own sampling state and generator.
        """
        for s in p.seqs:
            if s.echo_logprobs:
                self._emit(s, ("prompt", [(lp, top[:s.logprobs or 0]) for lp, top in p.entries]))
        for s in p.seqs:
            if s.max_new_tokens == 0 or s._cancel is not None:
                self._finish(s, s._cancel or "length")
                continue
            s._state = SamplingState([s.prompt], s.sampling, self.model.config.vocab_size, self.device)
            s._generator = None if s.sampling.greedy else make_generators(s.seed, 1, self.device)
            s._next = self._sample(s, p.logits)  # sampling is pure: p.logits is never modified
            if s._next is not None:
                s._speculation = self._speculation_for(s)
                with self._cond:
                    self.kv.max_bytes = self._batch_budget()
                    self.kv.insert(p.cache)
                    self._rows.append(s)
        with self._cond:
            self._prefills.remove(p)
            p.seqs = []
            if self.prefix is not None:
                self.prefix.add(p.prompt, p.cache)

    # -- KV memory ------------------------------------------------------------------------------

    def _alone_bytes(self, seq: Continuation) -> int:
        """KV bytes of seq with nothing else: its row at full length plus its prefill's cache."""
        return self.kv.bytes_per_position * (seq.max_positions + len(seq.prompt))

    def _prefill_bytes(self, started_only: bool = False) -> int:
        """Bytes the prefills' caches take (or will take: each is sized to its prompt)."""
        return self.kv.bytes_per_position * sum(len(p.prompt) for p in self._prefills
                                                if p.cache is not None or not started_only)

    def _batch_budget(self) -> int | None:
        """What the batch storage may grow to: the limit less the prefills and the prefix cache."""
        if self.kv_limit_bytes is None:
            return None
        prefix = self.prefix.nbytes if self.prefix is not None else 0
        return self.kv_limit_bytes - self._prefill_bytes() - prefix

    def _make_room(self, seq: Continuation, shared: Prefill | None) -> bool:
        """Whether seq fits in KV memory besides the rows and prefills, at worst (every row at its full
        length, each prefill with its own cache). To make it fit, batch storage left larger than the
        rows need is shrunk, then prefix-cache entries are evicted. Called with the lock held."""
        if self.kv_limit_bytes is None:
            return True
        seqs = self._rows + [s for p in self._prefills for s in p.seqs] + [seq]
        batch = self.kv.bytes_for(len(seqs), max(s.max_positions for s in seqs))
        prefills = self._prefill_bytes() + (0 if shared is not None else len(seq.prompt) * self.kv.bytes_per_position)
        if batch + prefills > self.kv_limit_bytes:
            return False
        prefix = self.prefix.nbytes if self.prefix is not None else 0
        if self.kv.nbytes > batch and self.kv.nbytes + prefills + prefix > self.kv_limit_bytes:
            self.kv.shrink()  # rows that left made it larger than the rows now need
        if self.prefix is not None:
            self.prefix.evict(self.kv_limit_bytes - prefills - max(batch, self.kv.nbytes))
        return True

    # -- sequences -------------------------------------------------------------------------------

    def _fail_all(self) -> None:
        """Every sequence still here gets ("done", "cancelled"), and no new work is taken."""
        with self._cond:
            self._closing = True
            left = [s for p in self._prefills for s in p.seqs] + self._rows + list(self._waiting)
            self._waiting.clear()
        for s in left:
            self._finish(s, "cancelled")
        with self._cond:
            self._prefills, self._rows = [], []
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

    def _speculation_for(self, seq: Continuation) -> Speculation | None:
        """seq's speculation state (its committed ids; its draft cache comes when it is first alone), if it
        may ever speculate."""
        if (self.draft is None or (seq.seed is not None and not seq.sampling.greedy) or seq.logprobs is not None
                or not draft_fits(self.draft, seq.max_positions - 1)):
            return None
        ids = torch.zeros(1, seq.max_positions, dtype=torch.long, device=self.device)
        ids[0, :len(seq.prompt)] = torch.tensor(seq.prompt)
        ids[0, len(seq.prompt)] = seq._next
        return Speculation(self.model, self.draft, ids, len(seq.prompt) + 1, len(seq.prompt), self.kv,
                           None, seq._state, seq.sampling, self._draft_length(),
                           generators=seq._generator, stats=self.speculation)

    def _draft_length(self) -> DraftLength:
        # the costs are measured here, on the scheduler thread (it alone runs the models), at the first
        # speculation on this machine; afterwards read back
        costs = draft_costs(self.model, self.draft) if self.adaptive_draft else None
        return DraftLength(self.draft_tokens, self.adaptive_draft, costs)

    def _sample(self, seq: Continuation, logits: torch.Tensor) -> int | None:
        """Sample seq's next id from its logits (1, V), emit it; None (and finished) on a stop id or the limit."""
        state = seq._state
        ids = next_tokens(logits, seq.sampling, seq._generator, state.seen, state.counts, state.bias)  # (1,)
        state.record(ids)
        t = int(ids[0])
        entry = None if seq.logprobs is None else logprob_entries(logits, [t], seq.logprobs)[0]
        return self._take_token(seq, t, entry)

    def _take_token(self, seq: Continuation, t: int, entry) -> int | None:
        """Emit seq's next id t (its sampling state has recorded it); None (and finished) on a stop id or the limit."""
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
