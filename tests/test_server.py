"""The OpenAI-compatible server and its continuous-batching scheduler, against engine.generate.

    .venv/bin/pytest tests/test_server.py -q

A tiny random GPT-2 (GPT-2's vocabulary, so the real tokenizer applies) is saved with
save_pretrained and served on a free loopback port: uvicorn in a thread (the tests can reach the
scheduler) or `gpt2 serve` in a subprocess (SIGTERM). Every reference is engine.generate on the same
model and prompt; every request loop is bounded in count and time. Tests about cancellation and
shutdown put the model behind a gate (SteppedModel) and count forwards and tokens, never seconds.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from openai import OpenAI

from gpt2 import GPT, GPTConfig
from gpt2.batching import Continuation, Scheduler, SchedulerClosed
from gpt2.engine import generate
from gpt2.kv_cache import BatchKV, KVCache
from gpt2.sampling import SamplingConfig
from gpt2.server import APIError, CompletionRequest, ServerConfig, create_app, request_to_sequences, uvicorn_config
from gpt2.tokenizer import Tokenizer

N_POSITIONS = 128
PROMPTS = ["Hello, my dog", "The meaning of life is", "a", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    # initializer_range 0.1, not GPT-2's 0.02: at 0.02 a model this small greedy-decodes one token over
    # and over, whatever its cache holds, so greedy comparisons could not fail.
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, n_positions=N_POSITIONS, initializer_range=0.1))
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def model(model_dir):
    return GPT.from_pretrained(str(model_dir)).eval()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.gpt2()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model, tok, draft=None, **overrides):
    """uvicorn in a thread on a free loopback port; yields url, port and the scheduler."""
    cfg = ServerConfig(**{"model": "tiny", "port": free_port(), "shutdown_timeout": 5, **overrides})
    app = create_app(model, tok, cfg, draft=draft)
    port = cfg.port
    server = uvicorn.Server(uvicorn_config(app, cfg, log_level="warning"))  # as `gpt2 serve` runs it
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield SimpleNamespace(port=port, url=f"http://127.0.0.1:{port}", scheduler=app.state.scheduler, cfg=cfg)
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def srv(model, tok):
    with running_server(model, tok, max_batch=8, max_queue=64) as s:
        yield s


def client(srv, key="unused"):
    return OpenAI(base_url=f"{srv.url}/v1", api_key=key, timeout=60, max_retries=0)


def reference(model, tok, prompt: str, max_tokens: int, **kw) -> str:
    ids = tok.encode(prompt, allowed_special="all") or [50256]
    return tok.decode(generate(model, [ids], max_new_tokens=max_tokens, **kw)[0])


# ---------------------------------------------------------------------------------------------
# the scheduler alone: merged mid-flight == alone
# ---------------------------------------------------------------------------------------------

def test_sequences_merged_mid_flight_match_engine_generate(model):
    """Joins at fixed steps (a longer prompt shifts the batch, a full batch queues, columns get compacted)."""
    sched = Scheduler(model, max_batch=3, max_queue=8, initial_capacity=32)
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(0, 50256, (n,), generator=g).tolist()
    specs = {  # name: (prompt, max tokens, sampling, seed)
        "A": (prompt(6), 60, SamplingConfig(), None),
        "B": (prompt(40), 80, SamplingConfig(temperature=1.0), 5),
        "C": (prompt(3), 100, SamplingConfig(), None),
        "D": (prompt(8), 30, SamplingConfig(temperature=0.8, top_p=0.9, presence_penalty=0.5), 11),
    }
    out = {name: [] for name in specs}
    done = threading.Event()
    seqs = {}

    def on_event(name):
        def emit(ev):
            if ev[0] == "token":
                out[name].append(ev[1])
                if name == "A" and len(out["A"]) == 20:
                    sched.submit([seqs["B"]])
                if name == "A" and len(out["A"]) == 40:
                    sched.submit([seqs["C"], seqs["D"]])  # the batch is full: D waits for A to finish
            elif all(s.finish_reason for s in seqs.values()):
                done.set()
        return emit

    for name, (p, n, sampling, seed) in specs.items():
        seqs[name] = Continuation(prompt=p, max_new_tokens=n, emit=on_event(name), sampling=sampling, seed=seed)
    sched.start()
    try:
        sched.submit([seqs["A"]])
        assert done.wait(120), "the scheduler did not finish"
    finally:
        sched.stop(5)
    assert sched.error is None
    for name, (p, n, sampling, seed) in specs.items():
        ref = generate(model, [p], max_new_tokens=n, temperature=sampling.temperature, top_p=sampling.top_p,
                       presence_penalty=sampling.presence_penalty, seed=seed)[0]
        assert out[name] == ref, name
        assert seqs[name].finish_reason == ("length" if len(ref) == n else "stop")
    assert sched.kv.shifts >= 1 and sched.kv.compactions >= 1  # both storage moves were exercised


def test_batch_kv_insert_remove_make_room_match_per_row_caches(model):
    """BatchKV against one plain KVCache per sequence, decoded alone: the same logits every step, and
    each row's keys and values right-aligned at the shared position, through a shift (a longer
    prompt), growth (8 -> 16 -> 24 columns), a removal and a compaction (at the 24-column limit)."""
    config = model.config
    kv = BatchKV(config.n_layer, 3, config.n_head, config.head_size, max_capacity=24, initial_capacity=8)
    g = torch.Generator().manual_seed(3)
    refs = []  # row i of kv is refs[i]: its own batch-1 cache

    def join(n):
        ids = torch.randint(0, 50256, (1, n), generator=g)
        alone, prefilled = KVCache.for_model(model, 1, N_POSITIONS), KVCache.for_model(model, 1, n)
        model(ids, cache=alone)
        model(ids, cache=prefilled)
        assert kv.insert(prefilled) == len(refs)
        refs.append(alone)

    def steps(n):
        for _ in range(n):
            ids = torch.randint(0, 50256, (kv.rows, 1), generator=g)
            logits = model(ids, cache=kv, attention_mask=kv.decode_mask())[:, -1]  # (rows, V)
            for i, ref in enumerate(refs):
                torch.testing.assert_close(logits[i], model(ids[i:i + 1], cache=ref)[0, -1], atol=1e-5, rtol=1e-5)
            check_rows()

    def check_rows():
        P = kv.pos
        for i, ref in enumerate(refs):
            T = ref.pos
            assert kv.mask[i, :P].tolist() == [0] * (P - T) + [1] * T
            torch.testing.assert_close(kv.k[:, i, :, P - T:P], torch.stack(ref.k)[:, 0, :, :T], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(kv.v[:, i, :, P - T:P], torch.stack(ref.v)[:, 0, :, :T], atol=1e-6, rtol=1e-6)

    def leave(i):
        kv.remove(i)
        refs[i] = refs[-1]
        refs.pop()
        check_rows()

    with torch.inference_mode():
        join(5)
        steps(3)                    # pos 8: the 8 columns are full
        join(10)                    # longer than pos: every row shifts right by 2
        assert kv.shifts == 1 and kv.pos == 10 and kv.capacity == 16
        steps(2)
        join(3)
        steps(4)                    # pos 16: the next step grows the storage to its limit
        leave(1)                    # the last row moves into slot 1; columns [0, 2) are now unused
        steps(9)                    # pos reaches 24 = the limit: the free columns are dropped
        assert kv.capacity == 24 and kv.compactions == 1 and kv.pos == 23
        leave(0)
        leave(0)
        assert kv.rows == 0 and kv.pos == 0


def test_scheduler_prefill_returns_prompt_logprobs_equal_to_a_full_forward(model):
    prompt = torch.randint(0, 50256, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    events = {0: [], 1: [], 2: []}
    seqs = [Continuation(prompt=prompt, max_new_tokens=0, logprobs=3, echo_logprobs=True, emit=events[0].append),
            Continuation(prompt=prompt, max_new_tokens=4, logprobs=0, echo_logprobs=True, emit=events[1].append),
            Continuation(prompt=prompt[:1], max_new_tokens=1, logprobs=2, echo_logprobs=True, emit=events[2].append)]
    sched = Scheduler(model, max_batch=2).start()
    sched.submit(seqs)
    sched.stop(timeout=None)
    assert sched.error is None
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)  # (T, V)
    ref = [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    top = torch.topk(logp[:-1], 3)
    kind, entries = events[0][0]
    assert kind == "prompt" and [lp for lp, _ in entries] == pytest.approx(ref, abs=1e-4)
    for (_, got), ids, values in zip(entries, top.indices.tolist(), top.values.tolist()):
        assert [i for i, _ in got] == ids and [v for _, v in got] == pytest.approx(values, abs=1e-4)
    assert events[0][1:] == [("done", "length")]  # max_tokens=0: the prompt alone
    kind, entries = events[1][0]                   # then its tokens, as generate draws them
    assert kind == "prompt" and [lp for lp, _ in entries] == pytest.approx(ref, abs=1e-4)
    assert all(top == [] for _, top in entries)
    assert [ev[1] for ev in events[1][1:-1]] == generate(model, [prompt], max_new_tokens=4)[0]
    assert events[2][0] == ("prompt", [])          # a one-token prompt has nothing to score


def test_request_to_sequences_without_http(model, tok):
    cfg = ServerConfig(max_batch=4, max_queue=4)
    req = CompletionRequest(model="tiny", prompt=["Hello", "a"], n=2, max_tokens=5, seed=(1 << 63) - 1,
                            temperature=0.5, top_p=0.9, logit_bias={"11": 2.0}, echo=True, logprobs=1)
    seqs = request_to_sequences(req, tok, model.config, cfg)
    assert [s.prompt for s in seqs] == [tok.encode("Hello")] * 2 + [tok.encode("a")] * 2  # index = prompt * n + j
    assert [s.seed for s in seqs] == [(1 << 63) - 1, 1 << 63] * 2                          # seed + j
    assert all(s.max_new_tokens == 5 and s.logprobs == 1 and s.echo_logprobs and s.emit is None for s in seqs)
    assert seqs[0].sampling == SamplingConfig(temperature=0.5, top_p=0.9, logit_bias={11: 2.0})
    # the defaults; an empty prompt starts from <|endoftext|>; token ids pass through
    (s,) = request_to_sequences(CompletionRequest(model="tiny", prompt=""), tok, model.config, cfg)
    assert s.prompt == [50256] and s.max_new_tokens == 16 and s.seed is None and not s.echo_logprobs
    assert s.sampling == SamplingConfig(temperature=1.0)
    (s,) = request_to_sequences(CompletionRequest(model="tiny", prompt=[[5, 6]], echo=True), tok, model.config, cfg)
    assert s.prompt == [5, 6] and not s.echo_logprobs  # echo without logprobs needs no prompt logprobs
    # what the schema cannot check
    for fields, status, code in [
        (dict(prompt=[]), 400, "invalid_value"),
        (dict(prompt=[[1], []]), 400, "invalid_value"),
        (dict(prompt=[50257]), 400, "invalid_value"),
        (dict(prompt="hi", max_tokens=N_POSITIONS), 400, "context_length_exceeded"),
        (dict(prompt=["a", "b"], n=5), 400, "too_many_choices"),          # 10 > max_batch + max_queue
        (dict(prompt="hi", logit_bias={"50257": 1.0}), 422, "invalid_value"),
    ]:
        with pytest.raises(APIError) as e:
            request_to_sequences(CompletionRequest(model="tiny", **fields), tok, model.config, cfg)
        assert (e.value.status, e.value.code) == (status, code), fields


# ---------------------------------------------------------------------------------------------
# through HTTP with the official client
# ---------------------------------------------------------------------------------------------

def test_greedy_completions_equal_engine_generate(srv, model, tok):
    c = client(srv)
    for prompt in PROMPTS:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
        assert r.choices[0].text == reference(model, tok, prompt, 24)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(tok.encode(prompt))
        assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    # token ids and a list of prompts
    ids = tok.encode(PROMPTS[0])
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == reference(model, tok, PROMPTS[0], 10)
    r = c.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=10, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [reference(model, tok, p, 10) for p in PROMPTS[:3]]
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_seeded_sampling_is_reproducible_and_equals_engine(srv, model, tok):
    c = client(srv)
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    a = c.completions.create(**kw).choices[0].text
    b = c.completions.create(**kw).choices[0].text
    assert a == b == reference(model, tok, PROMPTS[1], 20, temperature=0.9, top_p=0.95, seed=1234)
    # n > 1: choice j samples with seed + j
    r = c.completions.create(**{**kw, "n": 3})
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for j, ch in enumerate(r.choices):
        assert ch.text == reference(model, tok, PROMPTS[1], 20, temperature=0.9, top_p=0.95, seed=1234 + j)
    assert len({ch.text for ch in r.choices}) > 1
    assert r.usage.completion_tokens == 60
    # max_tokens=0 with echo: the prompt alone
    r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPTS[1] and r.choices[0].finish_reason == "length"


def test_streaming_equals_non_streaming(srv, model, tok):
    c = client(srv)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == reference(model, tok, PROMPTS[0], 16)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    # the raw event stream: data lines, ending with [DONE]
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "stream": True, "n": 2, "seed": 0}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    finals = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    assert sorted(f["index"] for f in finals if f["finish_reason"]) == [0, 1]


def test_stop_strings(srv, model, tok):
    c = client(srv)
    full = reference(model, tok, PROMPTS[3], 30)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    r = c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=30, temperature=0, stop=[stop, "\u2603"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=30, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_and_logprobs(srv, model, tok):
    c = client(srv)
    prompt = PROMPTS[0]
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    ch = r.choices[0]
    ids = tok.encode(prompt)
    new = generate(model, [ids], max_new_tokens=5)[0]
    assert ch.text == prompt + tok.decode(new)
    lp = ch.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids + new]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # reference: log_softmax of one full forward over prompt + completion
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids + new]))[0].float(), -1)
    seq = ids + new
    ref = [float(logp[i - 1, seq[i]]) for i in range(1, len(seq))]
    assert lp.token_logprobs[1:] == pytest.approx(ref, abs=1e-4)
    for i, top in enumerate(lp.top_logprobs[1:], start=1):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(float(logp[i - 1].max()), abs=1e-4)
    # streamed: the echoed prompt's chunk carries its logprobs, then one chunk per token
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                       logprobs=2, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == ch.text
    streamed = [x for chunk in chunks if chunk.choices[0].logprobs for x in chunk.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(ref, abs=1e-4)


def test_malformed_requests_get_openai_errors_then_server_still_correct(srv, model, tok, model_dir):
    url = f"{srv.url}/v1/completions"
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    cases = [  # (body bytes, expected status)
        (b'{"model": "tiny", "prompt": ', 400),                      # broken JSON
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400),           # invalid UTF-8
        (b"", 400),
        (b"[1, 2, 3]", 400),                                        # not an object
        (b"[" * 100000 + b"]" * 100000, 400),                       # nesting bomb
        (json.dumps({**ok, "prompt": 5}).encode(), 422),            # wrong types
        (json.dumps({**ok, "max_tokens": "5"}).encode(), 422),
        (json.dumps({**ok, "temperature": "hot"}).encode(), 422),
        (json.dumps({**ok, "stream": "yes"}).encode(), 422),
        (json.dumps({**ok, "prompt": [1, "a"]}).encode(), 422),
        (json.dumps({**ok, "prompt": [-1]}).encode(), 422),
        (json.dumps({**ok, "temperature": 3}).encode(), 422),       # out of range
        (json.dumps({**ok, "n": 1000}).encode(), 422),
        (json.dumps({**ok, "logprobs": 50}).encode(), 422),
        (json.dumps({**ok, "stop": ["a", "b", "c", "d", "e"]}).encode(), 422),
        (json.dumps({**ok, "best_of": 2}).encode(), 422),            # unknown fields
        (json.dumps({**ok, "max_tokenz": 2}).encode(), 422),
        (json.dumps({**ok, "logit_bias": {"x": 1}}).encode(), 422),
        (json.dumps({k: v for k, v in ok.items() if k != "model"}).encode(), 422),
        (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 422),
        (json.dumps({**ok, "prompt": [50257]}).encode(), 400),      # id outside the vocabulary
        (json.dumps({**ok, "prompt": []}).encode(), 400),
        (json.dumps({**ok, "prompt": [[]]}).encode(), 400),
        (json.dumps({**ok, "prompt": list(range(200))}).encode(), 400),      # longer than the context
        (json.dumps({**ok, "prompt": "word " * 200}).encode(), 400),
        (json.dumps({**ok, "max_tokens": 1000}).encode(), 400),               # max_tokens too large
        (json.dumps({**ok, "max_tokens": 10**30}).encode(), 400),
        (json.dumps({**ok, "n": 100}).encode(), 400),                         # n x prompts over the limit
        (json.dumps({**ok, "prompt": "x" * (2 << 20)}).encode(), 413),        # body too large
    ]
    with httpx.Client(timeout=30) as http:
        for body, status in cases:
            r = http.post(url, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body[:60], r.status_code, r.text[:200])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert str(model_dir) not in r.text and "Traceback" not in r.text and "site-packages" not in r.text
        # a chunked body over the limit (no content-length)
        r = http.post(url, content=iter([b"{" + b" " * (1 << 19)] * 4))
        assert r.status_code == 413
        for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
            r = http.request(method, f"{srv.url}{path}")
            assert r.status_code == status and "error" in r.json()
    # the client sees the same as exceptions
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).completions.create(model="tiny", prompt="hi", max_tokens=500)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.UnprocessableEntityError):
        client(srv).completions.create(model="tiny", prompt="hi", extra_body={"nonsense": 1})
    # still serving correct answers
    r = client(srv).completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert r.choices[0].text == reference(model, tok, PROMPTS[2], 12)
    assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"


def test_32_concurrent_clients(srv, model, tok):
    refs = {p: reference(model, tok, p, 12) for p in PROMPTS}
    seeded = {p: reference(model, tok, p, 12, temperature=1.0, seed=7) for p in PROMPTS}
    c = client(srv)

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            r = c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
            return r.choices[0].text == refs[p]
        r = c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=1.0, seed=7, stream=i % 4 == 0)
        text = "".join(ch.choices[0].text for ch in r) if i % 4 == 0 else r.choices[0].text
        return text == seeded[p]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32), timeout=120))
    assert results == [True] * 32


# ---------------------------------------------------------------------------------------------
# overload, keys, disconnects, shutdown
# ---------------------------------------------------------------------------------------------

def test_full_queue_gets_429_with_retry_after(model, tok):
    with running_server(model, tok, max_batch=1, max_queue=1) as s:
        s.scheduler.pause()  # nothing moves: the slot and the queue fill deterministically
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=60) for _ in range(2)]
            deadline = time.monotonic() + 20
            while s.scheduler.busy < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=10)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            s.scheduler.resume()
            assert [w.result(60).status_code for w in waiting] == [200, 200]
        assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=30).status_code == 200


def test_api_key_is_enforced_except_health(model, tok):
    with running_server(model, tok, api_key="sk-test") as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}]:
            r = httpx.get(f"{s.url}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.post(f"{s.url}/v1/completions", headers=headers, json={"model": "tiny", "prompt": "hi"})
            assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
        r = client(s, "sk-test").completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
        assert r.choices[0].text == reference(model, tok, "hi", 2)


class SteppedModel:
    """The model behind a gate: each forward takes one permit, so a test decides how far generation
    gets, counts steps instead of seconds, and can wait until the scheduler stands at the gate."""

    def __init__(self, model):
        self.model, self.config, self.transformer = model, model.config, model.transformer
        self._cond = threading.Condition()
        self._permits = 0      # forwards allowed; None: no gate
        self._parked = False   # a forward waits at the gate with no permit left

    def eval(self):
        return self

    def allow(self, n: int | None) -> None:
        """n more forwards (None: every forward from now on)."""
        with self._cond:
            self._permits = None if n is None or self._permits is None else self._permits + n
            self._parked = False
            self._cond.notify_all()

    def hold(self) -> None:
        """Close the gate again, from the next forward on."""
        with self._cond:
            self._permits = 0

    def wait_parked(self) -> None:
        """Until the scheduler has used every permit and waits for the next (it is then standing still)."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._parked, 30), "the scheduler never reached the gate"

    def __call__(self, *args, **kwargs):
        with self._cond:
            if self._permits == 0:
                self._parked = True
                self._cond.notify_all()
            assert self._cond.wait_for(lambda: self._permits != 0, 60), "the test never opened the gate"
            if self._permits is not None:
                self._permits -= 1
        return self.model(*args, **kwargs)


def watch_cancels(scheduler) -> threading.Event:
    """An event set when the server first cancels a sequence (scheduler.cancel is wrapped)."""
    cancelled, cancel = threading.Event(), scheduler.cancel

    def wrapped(seq, reason="cancelled"):
        cancel(seq, reason)
        cancelled.set()
    scheduler.cancel = wrapped
    return cancelled


def wait_idle(scheduler) -> None:
    deadline = time.monotonic() + 30  # only against a hang: the assertions count tokens, not seconds
    while scheduler.busy:
        assert time.monotonic() < deadline, "the scheduler kept working"
        time.sleep(0.02)


def test_client_disconnect_cancels_its_work(model, tok):
    stepped = SteppedModel(model)
    with running_server(stepped, tok) as s:
        cancelled = watch_cancels(s.scheduler)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 100, "temperature": 0, "stream": True}
        # a stream: three tokens (a prefill and two decode steps), then the client hangs up mid-way
        stepped.allow(3)
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                stepped.wait_parked()
                assert s.scheduler.tokens == 3
        assert cancelled.wait(30), "the abandoned stream was not cancelled"
        stepped.allow(None)
        wait_idle(s.scheduler)
        assert s.scheduler.tokens == 3  # not one token after the client left (of 100)
        # the same for a plain (non-streaming) request whose client gives up after five tokens
        cancelled.clear()
        stepped.hold()
        payload = json.dumps({**body, "stream": False}).encode()
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            stepped.wait_parked()  # the prefill waits
            stepped.allow(5)
            stepped.wait_parked()
            assert s.scheduler.tokens == 3 + 5
        assert cancelled.wait(30), "the abandoned request was not cancelled"
        stepped.allow(None)
        wait_idle(s.scheduler)
        assert s.scheduler.tokens == 3 + 5


def test_stop_cancels_what_is_left_after_the_timeout(model):
    stepped = SteppedModel(model)
    sched = Scheduler(stepped, max_batch=2, max_queue=4).start()
    events = []
    seqs = [Continuation(prompt=[1, 2, 3], max_new_tokens=100, emit=events.append, stop_token_ids=frozenset())
            for _ in range(4)]
    sched.submit(seqs)  # two decode, two wait
    stepped.allow(3)    # one prefill (the two share the prompt) and two decode steps
    stepped.wait_parked()
    sched.pause()       # the loop holds after the step now waiting at the gate
    stepped.allow(None)
    sched.stop(timeout=0)  # the time is up at once: nothing more runs, everything left is cancelled
    assert not sched._thread.is_alive()
    assert [s.finish_reason for s in seqs] == ["cancelled"] * 4
    assert [s.generated for s in seqs] == [4, 4, 0, 0]
    assert sum(ev[0] == "done" for ev in events) == 4
    with pytest.raises(SchedulerClosed):
        sched.submit([Continuation(prompt=[1], max_new_tokens=1)])
    # without a timeout, stop lets running and queued sequences finish
    sched = Scheduler(model, max_batch=2, max_queue=4).start()
    seqs = [Continuation(prompt=[1, 2, 3], max_new_tokens=5, stop_token_ids=frozenset()) for _ in range(4)]
    sched.submit(seqs)
    sched.stop(timeout=None)
    assert [s.finish_reason for s in seqs] == ["length"] * 4 and [s.generated for s in seqs] == [5] * 4


def test_sigterm_lets_in_flight_requests_finish(model_dir, model, tok):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gpt2", "serve", "--model", str(model_dir), "--port", str(port),
                             "--max-batch", "4", "--alias", "tiny"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "stream": True}
        text, lines = "", []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line:
                    continue  # the blank line after each event
                if not lines:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                lines.append(line)
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert lines[-1] == "data: [DONE]"
        assert text == reference(model, tok, PROMPTS[0], 100)
        assert proc.wait(30) == 0  # drained, then a clean exit (uvicorn alone re-raises the SIGTERM: -15)
        log = proc.stdout.read().decode()
        assert "Application shutdown complete" in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------------------------
# speculative decoding (gpt2 serve --draft)
# ---------------------------------------------------------------------------------------------

def test_serve_with_a_draft_speculates_for_a_lone_greedy_request(model_dir, model, tok):
    """Through the official client: greedy completions equal the model's own greedy output, and the
    scheduler ran speculative rounds for them (a self:int8 draft, as `gpt2 serve --draft self:int8` loads
    it); a seeded sampled request does not speculate and stays exact."""
    from gpt2.quantize import load_draft
    draft = load_draft("self:int8", str(model_dir), "float32")
    assert any(type(m).__name__ == "FastLinear" for m in draft.modules())
    with running_server(model, tok, draft=draft, draft_tokens=3) as srv:
        for prompt in PROMPTS[:2]:
            got = client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0)
            assert got.choices[0].text == reference(model, tok, prompt, 30)
        rounds = srv.scheduler.speculation.rounds
        assert rounds > 0 and srv.scheduler.speculation.proposed > 0
        scraped = httpx.get(f"{srv.url}/metrics").text
        assert f"gpt2_speculative_rounds_total {float(rounds)}" in scraped
        assert f"gpt2_draft_tokens_accepted_total {float(srv.scheduler.speculation.accepted)}" in scraped
        got = client(srv).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=4)
        assert got.choices[0].text == reference(model, tok, PROMPTS[0], 12, temperature=1.0, seed=4)
        assert srv.scheduler.speculation.rounds == rounds


@pytest.mark.slow
def test_serve_compiled_answers_concurrent_clients_as_eager_generate(model, tok):
    """`gpt2 serve --compile`: concurrent greedy completions through the official client, batched by the
    scheduler and decoded by the compiled step (a graph per batch-row count, compiled on first use while
    the requests wait), equal the model's own eager greedy output."""
    with running_server(model, tok, max_batch=4, compile=True) as srv:
        patient = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=600, max_retries=0)
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: patient.completions.create(model="tiny", prompt=p, max_tokens=20,
                                                                     temperature=0).choices[0].text, PROMPTS[:3]))
        assert got == [reference(model, tok, p, 20) for p in PROMPTS[:3]]
        assert srv.scheduler.compile and srv.scheduler.steps > 0


def test_serve_parses_its_draft_options():
    from gpt2.cli import build_parser
    args = build_parser().parse_args(["serve", "--model", "m", "--draft", "self:int4", "--draft-tokens", "6",
                                      "--fixed-draft-tokens"])
    assert (args.draft, args.draft_tokens, args.fixed_draft_tokens, args.draft_dtype) == ("self:int4", 6, True, None)
    assert not args.compile and build_parser().parse_args(["serve", "--model", "m", "--compile"]).compile
