"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching scheduler.

    gpt2 serve --model gpt2                                   # http://127.0.0.1:8000/v1, playground at /
    gpt2 serve --model ./my-model --port 8080 --api-key sk-local --max-batch 16 --max-kv-mb 512

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-local")
    client.completions.create(model="gpt2", prompt="Hello, my dog", max_tokens=32, temperature=0)
    client.chat.completions.create(model="gpt2", messages=[{"role": "user", "content": "Hi"}])

    lm_eval --model local-completions --model_args model=gpt2,base_url=http://127.0.0.1:8000/v1/completions,...

Endpoints: POST /v1/completions (prompt: a string, a list of strings, token ids or a list of token-id
lists; max_tokens, temperature, top_p, n, stop, stream (server-sent events ending with `data: [DONE]`),
seed, logprobs, echo, presence_penalty, frequency_penalty, logit_bias, user), POST /v1/chat/completions
(messages through the chat template, chat.py), GET /v1/models, GET /health, GET /metrics (Prometheus,
metrics.py), GET /openapi.json (the request and response models of openai_api.py), GET / (the
playground, playground.html).

This file is the HTTP and text edge: it turns JSON and text into token ids and back, and nothing else.
Generation is batching.py's Scheduler: every request's sequences join one shared decode loop, on the
one thread that runs the model (the prompt's own logprobs for `echo` come from its prefill). Choice j of
a prompt with `seed` s samples with seed s + j, so it is reproducible whatever else the server is doing.

One request, in three parts: request_to_sequences (pure: the request as token-id Continuations),
the event pump (_Pump: scheduler events -> each choice's text and logprobs), and plain functions that
format OpenAI's shapes. Legacy completions semantics are exact, as lm-eval relies on them: with echo
and logprobs the prompt's tokens come first (the first one's logprob null), max_tokens=0 returns the
prompt alone, and a generated <|endoftext|> gets its logprob entry (text "<|endoftext|>" in `tokens`,
nothing added to `text`), so there is one entry for every generated token.

Bad input never gets a 500 or a hung connection: broken JSON or UTF-8 and too-long prompts get 400,
a body over the limit 413, wrong types, out-of-range values and unknown fields 422, an unknown `model`
404 model_not_found, all as OpenAI's `{"error": {"message", "type", "param", "code"}}`; a full queue or
the KV memory limit gets 429 with Retry-After. Messages never carry paths or tracebacks. With --api-key
every endpoint but /health and the playground page wants `Authorization: Bearer`.

Connections: a request whose head has not arrived `request_timeout` s after its connection opened (or
after its previous response) gets 408 and the connection is closed; a body slower than that gets a
408 error. A connection opened while `max_connections` others are open gets 503 (an OpenAI error,
Retry-After: 1) and is closed. On SIGTERM (or Ctrl+C)
uvicorn stops accepting connections and lets in-flight requests finish (up to `shutdown_timeout` s);
then the scheduler cancels whatever is left, its thread exits and so does the process, with status 0.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import signal
import sys
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from gpt2.batching import Continuation, KVLimitExceeded, QueueFull, Scheduler, SchedulerClosed, compiled_row_counts
from gpt2.chat import ChatTemplate, ChatTemplateError
from gpt2.config import GPT2_EOT, require_gpt2_vocab
from gpt2.metrics import ServerMetrics
from gpt2.openai_api import (UNDECLARED_MODELS, APIError, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                             Completion, CompletionRequest, ErrorResponse, ModelList, parse_request)
from gpt2.sampling import SamplingConfig
from gpt2.tokenizer import TextStream


@dataclass
class ServerConfig:
    model: str = "gpt2"
    host: str = "127.0.0.1"            # loopback only, unless asked
    port: int = 8000
    api_key: str | None = None
    aliases: tuple[str, ...] = ()      # more names `model` may give (the first served name is the directory's)
    chat_template: str | None = None   # a Jinja file; None: chat.DEFAULT_CHAT_TEMPLATE
    max_batch: int = 16                # rows in the shared decode batch
    max_queue: int = 64                # sequences waiting for a row before requests get 429
    prefill_chunk: int = 256           # prompt tokens prefilled between two decode steps
    prefix_cache: bool = True          # reuse the keys and values of a repeated prompt prefix
    max_kv_mb: float | None = None     # KV cache limit (None: only max_batch x the context bounds it)
    dtype: str = "float32"
    kv_dtype: str = "auto"             # the KV caches' dtype: bfloat16 halves them (quantize.load_for_inference)
    device: str | None = None
    max_body_bytes: int = 1 << 20
    max_choices: int = 64              # prompts x n in one request
    request_timeout: float = 30.0      # seconds a request's head, then its body, may take to arrive
    max_connections: int = 256         # open connections; more get 503
    shutdown_timeout: float = 30.0     # seconds in-flight requests get after SIGTERM
    draft: str | None = None           # speculative decoding for a lone request (batching.py)
    draft_dtype: str | None = None     # a draft model's weights (None: dtype)
    draft_tokens: int = 4
    adaptive_draft: bool = True
    compile: bool = False              # decode steps through the compiled step (batching.Scheduler)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


PLAYGROUND = "playground.html"  # package data beside this file
ENDPOINTS = ("/", "/health", "/metrics", "/openapi.json", "/v1/models", "/v1/completions", "/v1/chat/completions")


# ---------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------

def create_app(model, tokenizer, cfg: ServerConfig, model_name: str | None = None, draft=None) -> FastAPI:
    """The FastAPI app serving `model`; its lifespan starts and stops the scheduler (app.state.scheduler).
    draft: a model (or "self:int8" / "self:int4") for speculative decoding of a lone request."""
    model_name = model_name or Path(cfg.model).name or "gpt2"
    names = list(dict.fromkeys([model_name, *cfg.aliases]))
    scheduler = Scheduler(model, max_batch=cfg.max_batch, max_queue=cfg.max_queue, prefill_chunk=cfg.prefill_chunk,
                          prefix_cache=cfg.prefix_cache, max_kv_mb=cfg.max_kv_mb, draft=draft,
                          draft_tokens=cfg.draft_tokens, adaptive_draft=cfg.adaptive_draft, compile=cfg.compile)
    metrics = ServerMetrics(scheduler)
    template = ChatTemplate.from_file(cfg.chat_template) if cfg.chat_template else ChatTemplate.default()
    playground = files("gpt2").joinpath(PLAYGROUND).read_text(encoding="utf-8")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop, cfg.shutdown_timeout)

    app = FastAPI(title="gpt2", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.openapi = lambda: openapi_schema(app)

    if cfg.api_key is not None:
        app.add_middleware(_RequireKey, key=cfg.api_key)
    app.add_middleware(_CountRequests, metrics=metrics)  # added last: outermost, so it counts the 401s too

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), code=None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        # A bug: say so without a traceback, path or repr of the input.
        return error_response(APIError(500, "internal server error", type="server_error"))

    def check_model(name: str) -> None:
        if name not in names:  # OpenAI's answer, word for word
            raise APIError(404, f"The model `{name[:100]}` does not exist or you do not have access to it.",
                           code="model_not_found")

    def start(req: CompletionRequest) -> _Pump:
        """The request's sequences, submitted; the pump that follows them."""
        seqs = request_to_sequences(req, tokenizer, model.config, cfg)
        stop = stop_strings(req)
        choices = [_Choice(i, s.prompt, tokenizer, stop, bool(req.echo), req.logprobs) for i, s in enumerate(seqs)]
        pump = _Pump(scheduler, seqs, choices, sum(len(s.prompt) for s in seqs) // (req.n or 1), metrics)
        pump.submit()
        return pump

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(playground)

    @app.get("/health")
    async def health():
        if scheduler.error is not None:
            return JSONResponse({"status": "error"}, status_code=503)
        return {"status": "ok", "busy": scheduler.busy}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "gpt2"}
                                           for name in names]}

    @app.post("/v1/completions", **endpoint_schema(CompletionRequest, Completion))
    async def completions(request: Request):
        req = parse_request(await _read_body(request, cfg), CompletionRequest)
        check_model(req.model)
        pump = start(req)
        head = response_head("cmpl-", "text_completion", model_name)
        if req.stream:
            return event_stream(completion_events(pump, head, bool(req.echo), _include_usage(req)))
        return await finished(pump, request, lambda: completion_chunk(head, [c.as_dict() for c in pump.choices],
                                                                      pump.usage()))

    @app.post("/v1/chat/completions", **endpoint_schema(ChatCompletionRequest, ChatCompletion, ChatCompletionChunk))
    async def chat_completions(request: Request):
        req = parse_request(await _read_body(request, cfg), ChatCompletionRequest)
        check_model(req.model)
        try:
            prompt = template.render([m.model_dump(exclude_none=True) for m in req.messages])
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages", code="invalid_chat_template") from None
        ids = tokenizer.encode(prompt, allowed_special="all")
        # Without a limit the answer may fill the context, as OpenAI's may.
        pump = start(req.as_completion(ids, max_tokens=max(model.config.n_positions - len(ids), 1)))
        head = response_head("chatcmpl-", "chat.completion", model_name)
        if req.stream:
            return event_stream(chat_events(pump, {**head, "object": "chat.completion.chunk"}, _include_usage(req)))
        return await finished(pump, request, lambda: chat_completion(head, pump))

    return app


def endpoint_schema(request_model, response_model, event_model=None) -> dict:
    """Route arguments that document a body parsed by hand: the request model, the JSON response and
    the server-sent events (each `data:` line one `event_model`), and the error shape."""
    ref = lambda m: {"$ref": f"#/components/schemas/{m.__name__}"}
    return {"openapi_extra": {"requestBody": {"required": True,
                                              "content": {"application/json": {"schema": ref(request_model)}}}},
            "responses": {200: {"model": response_model, "description": "the response; with `stream`, server-sent "
                                "events, one JSON object per `data:` line, then `data: [DONE]`",
                                "content": {"text/event-stream": {"schema": ref(event_model or response_model)}}},
                          **{status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 422, 429)}},
            "response_class": JSONResponse}


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema of the routes, plus the models the routes parse by hand or stream."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema(UNDECLARED_MODELS, ref_template="#/components/schemas/{model}")
        schema["components"]["schemas"].update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


class _RequireKey:
    """ASGI middleware: every path but /health and the playground page wants `Authorization: Bearer
    <key>` (401 otherwise). The page holds no secret: it asks its user for the key."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in ("/health", "/"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.key):
                response = error_response(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                                   code="invalid_api_key"))
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class _CountRequests:
    """ASGI middleware: gpt2_requests_total{endpoint, status} for every answered HTTP request."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"  # bounded label values

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)
        return await self.app(scope, receive, counting_send)


async def _read_body(request: Request, cfg: ServerConfig) -> bytes:
    """The body, 413 when it is over the limit, 408 when it takes over `request_timeout` s to arrive."""
    limit = cfg.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > 4 * limit):
        raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")

    async def read() -> tuple[bytes, int]:
        # Up to 4x the limit is read and dropped, so a client that sends the whole body before
        # reading gets the 413 rather than a reset.
        body, size = bytearray(), 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > 4 * limit:
                break
            if size <= limit:
                body += chunk
        return bytes(body), size

    try:
        body, size = await asyncio.wait_for(read(), cfg.request_timeout)
    except (asyncio.TimeoutError, TimeoutError):
        raise APIError(408, f"the request body did not arrive within {cfg.request_timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    if size > limit:
        raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    return body


# ---------------------------------------------------------------------------------------------
# one request, as token ids: CompletionRequest -> one Continuation per choice (no HTTP, no event loop)
# ---------------------------------------------------------------------------------------------

def request_to_sequences(req: CompletionRequest, tokenizer, config, cfg: ServerConfig) -> list[Continuation]:
    """One Continuation per choice, index = prompt * n + j, with `emit` unset; APIError for what the
    schema cannot check (empty prompts, ids outside the vocabulary, the context, the choice limit)."""
    prompts = prompt_ids(req.prompt, tokenizer, config.vocab_size)
    n = req.n or 1
    limit = min(cfg.max_choices, cfg.max_batch + cfg.max_queue)
    if len(prompts) * n > limit:
        raise APIError(400, f"{len(prompts)} prompts x n={n} is more than the {limit} completions one request "
                            "may ask for", param="n", code="too_many_choices")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    for ids in prompts:
        if len(ids) + max_tokens > config.n_positions:
            raise APIError(400, f"This model's maximum context length is {config.n_positions} tokens, however you "
                                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in your prompt; {max_tokens} "
                                "for the completion). Please reduce your prompt or completion length.",
                           param="max_tokens" if max_tokens >= config.n_positions else "prompt",
                           code="context_length_exceeded")
    sampling = sampling_config(req, config.vocab_size)
    # Choice j of a prompt samples with seed + j, so each is reproducible whatever else runs.
    return [Continuation(prompt=ids, max_new_tokens=max_tokens, sampling=sampling,
                         seed=None if req.seed is None else (req.seed + j) % (1 << 64), logprobs=req.logprobs,
                         echo_logprobs=bool(req.echo) and req.logprobs is not None)
            for ids in prompts for j in range(n)]


def prompt_ids(prompt, tokenizer, vocab_size: int) -> list[list[int]]:
    """The request's prompt field as a list of token-id prompts."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    out = []
    for p in prompts:
        if isinstance(p, str):
            # GPT-2 has no BOS token: an empty prompt starts from <|endoftext|>, as OpenAI's did.
            ids = tokenizer.encode(p, allowed_special="all") or [GPT2_EOT]
        else:
            if not p:
                raise APIError(400, "a token-id prompt is empty", param="prompt", code="invalid_value")
            if max(p) >= vocab_size:
                raise APIError(400, f"prompt holds token ids outside [0, {vocab_size})", param="prompt",
                               code="invalid_value")
            ids = list(p)
        out.append(ids)
    return out


def sampling_config(req: CompletionRequest, vocab_size: int) -> SamplingConfig:
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise APIError(422, f"logit_bias: {key[:20]!r} is not a token id", param="logit_bias", code="invalid_value")
        bias[int(key)] = value
    return SamplingConfig(temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=None if req.top_p in (None, 1.0) else req.top_p,
                          presence_penalty=req.presence_penalty or 0.0,
                          frequency_penalty=req.frequency_penalty or 0.0, logit_bias=bias)


def stop_strings(req: CompletionRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


# ---------------------------------------------------------------------------------------------
# the event pump: scheduler thread -> asyncio queue -> choices
# ---------------------------------------------------------------------------------------------

class _Pump:
    """One request's sequences in the scheduler, and their events applied to its choices on the event loop."""

    def __init__(self, scheduler: Scheduler, seqs: list[Continuation], choices: list["_Choice"], prompt_tokens: int,
                 metrics: ServerMetrics):
        self.scheduler, self.seqs, self.choices, self.prompt_tokens = scheduler, seqs, choices, prompt_tokens
        self.metrics = metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.disconnected = False
        self.submitted: float | None = None  # time.monotonic() at submit (time to first token)
        self._polled = time.monotonic()
        loop = asyncio.get_running_loop()
        for index, seq in enumerate(seqs):  # emit runs on the scheduler thread: hand over to the loop
            seq.emit = lambda ev, i=index: loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))

    def submit(self) -> None:
        try:
            self.scheduler.submit(self.seqs)
        except QueueFull:
            raise APIError(429, "the server is busy; retry shortly", type="server_busy", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except KVLimitExceeded as e:
            raise APIError(429, f"the KV cache limit does not allow this request now: {e}", type="server_busy",
                           code="kv_limit", headers={"Retry-After": "1"}) from None
        except SchedulerClosed:
            raise APIError(503, "the server is shutting down", type="server_busy", code="shutting_down",
                           headers={"Retry-After": "5"}) from None
        self.submitted = time.monotonic()
        self.metrics.prompt_tokens.inc(self.prompt_tokens)

    async def updates(self, request: Request | None = None):
        """(choice, kind, text) per event, once applied to its choice, until every choice is done.

        kind "prompt": text is the echoed prompt (its logprobs arrived); "token": text is what is now
        safe to show (maybe ""); "done": text is the held-back tail. request: watch it for a disconnect
        (non-streaming responses; a stream's disconnect cancels the response itself). On leaving,
        unfinished sequences are cancelled.
        """
        try:
            pending = len(self.choices)
            while pending:
                item = await self._next_event(request)
                if item is None:
                    self.disconnected = True
                    return
                index, event = item
                choice = self.choices[index]
                kind = event[0]
                if kind == "prompt":
                    text = choice.push_prompt(event[1])
                elif kind in ("token", "stop_token"):
                    self._observe(choice)
                    text = choice.push(event[1], event[2]) if kind == "token" else choice.push_stop_token(event[2])
                    if choice.text.stopped:
                        self.scheduler.cancel(self.seqs[index], "stop")
                    kind = "token"
                else:
                    text = choice.finish(event[1])
                    pending -= 1
                yield choice, kind, text
        finally:
            for s in self.seqs:
                if s.finish_reason is None:
                    self.scheduler.cancel(s)

    def _observe(self, choice: "_Choice") -> None:
        """A token of `choice` arrived: time to first token or since its previous one."""
        now = time.monotonic()
        if choice.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - self.submitted)
        else:
            self.metrics.inter_token_latency.observe(now - choice.last_token_at)
        choice.last_token_at = now
        self.metrics.generation_tokens.inc()

    async def _next_event(self, request: Request | None):
        """The next (choice index, event); None if the client went away (polled every half second)."""
        while True:
            if request is not None and time.monotonic() - self._polled > 0.5:
                self._polled = time.monotonic()
                if await request.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    def usage(self) -> dict:
        return usage_dict(self.prompt_tokens, sum(c.tokens for c in self.choices))


async def finished(pump: _Pump, request: Request, body) -> JSONResponse:
    """Run the request to its end, then the JSON `body()` (499 if the client left first)."""
    async with aclosing(pump.updates(request)) as updates:
        async for _ in updates:
            pass
    if pump.disconnected:
        return JSONResponse({}, status_code=499)  # nobody reads this: the client is gone
    return JSONResponse(body())


def event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def completion_events(pump: _Pump, head: dict, echo: bool, include_usage: bool):
    """Server-sent events: one chunk per new text, a final chunk per choice, then [DONE]."""
    async with aclosing(pump.updates()) as updates:
        if echo:  # without logprobs the echoed prompt is known now; with them it comes after the prefill
            for c in pump.choices:
                if not c.want_logprobs:
                    yield sse(completion_chunk(head, [choice_dict(c.index, c.prefix, None, None)]))
        async for choice, kind, text in updates:
            if kind == "prompt":
                yield sse(completion_chunk(head, [choice_dict(choice.index, text, choice.echo, None)]))
            elif text or kind == "done":  # a token's entry waits for the chunk that shows its text
                reason = choice.finish_reason if kind == "done" else None
                yield sse(completion_chunk(head, [choice_dict(choice.index, text, choice.take_logprobs(), reason)]))
    if include_usage:
        yield sse(completion_chunk(head, [], pump.usage()))
    yield "data: [DONE]\n\n"


async def chat_events(pump: _Pump, head: dict, include_usage: bool):
    """Chat server-sent events: per choice a first chunk with the role, then the content, then the reason."""
    for c in pump.choices:
        yield sse({**head, "choices": [chat_delta(c.index, {"role": "assistant", "content": ""}, None)]})
    async with aclosing(pump.updates()) as updates:
        async for choice, kind, text in updates:
            if text:
                yield sse({**head, "choices": [chat_delta(choice.index, {"content": text}, None)]})
            if kind == "done":
                yield sse({**head, "choices": [chat_delta(choice.index, {}, choice.finish_reason)]})
    if include_usage:
        yield sse({**head, "choices": [], "usage": pump.usage()})
    yield "data: [DONE]\n\n"


def _include_usage(req) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


# ---------------------------------------------------------------------------------------------
# OpenAI's response shapes (openai_api.py's response models): plain formatting
# ---------------------------------------------------------------------------------------------

def response_head(prefix: str, object: str, model_name: str) -> dict:
    return {"id": prefix + uuid.uuid4().hex, "object": object, "created": int(time.time()), "model": model_name}


def completion_chunk(head: dict, choices: list[dict], usage: dict | None = None) -> dict:
    """A text_completion object (head: id, object, created, model) with these choices (and usage)."""
    out = {**head, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def choice_dict(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(head: dict, pump: _Pump) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text.text}, "logprobs": None,
                "finish_reason": c.finish_reason} for c in pump.choices]
    return {**head, "choices": choices, "usage": pump.usage()}


def chat_delta(index: int, delta: dict, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_dict(tokens: list[str], values: list, top: list, offsets: list[int]) -> dict:
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Choice:
    """One choice's text (through TextStream: UTF-8-safe, stop strings cut) and logprobs, in OpenAI's fields."""

    def __init__(self, index: int, prompt: list[int], tokenizer, stop: list[str], echo: bool, logprobs: int | None):
        self.index, self.prompt, self.tok = index, prompt, tokenizer
        self.want_logprobs = logprobs is not None
        self.prefix = tokenizer.decode(prompt) if echo else ""
        self.echo = None  # the prompt's logprobs dict, once the scheduler's prefill sent them
        self.text = TextStream(tokenizer.stream_decoder(), stop)
        self.finish_reason = None
        self.tokens = 0
        self.last_token_at = None  # time.monotonic() of the latest token (metrics)
        self.lp_tokens, self.lp_values, self.lp_top, self.lp_offsets = [], [], [], []
        self.lp_sent = 0  # entries already streamed

    def push_prompt(self, entries) -> str:
        """The prompt's own logprob entries (tokens 1..T-1); the echoed text to show with them."""
        tokens = [self.tok.decode([t]) for t in self.prompt]
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        self.echo = logprobs_dict(tokens, [None] + [lp for lp, _ in entries],
                                  [None] + [self._top(top) for _, top in entries], offsets)
        return self.prefix

    def push(self, t: int, entry) -> str:
        """One new id (and its logprob entry); the new text that is safe to show."""
        self.tokens += 1
        if self.text.stopped:
            return ""
        if entry is not None:
            self._add_entry(t, entry)
        return self.text.push(t)

    def push_stop_token(self, entry) -> str:
        """The stop id the model drew (sent only with logprobs): its entry, and no text."""
        self.tokens += 1
        if not self.text.stopped:
            self._add_entry(GPT2_EOT, entry)
        return ""

    def _add_entry(self, t: int, entry) -> None:
        self.lp_tokens.append(self.tok.decode([t]))
        self.lp_values.append(entry[0])
        self.lp_top.append(self._top(entry[1]))
        self.lp_offsets.append(len(self.prefix) + len(self.text.text))

    def finish(self, reason: str) -> str:
        """The scheduler's reason (a cancel after a stop string is a "stop"); the held-back tail."""
        self.finish_reason = "stop" if self.text.stopped or reason == "cancelled" else reason
        return "" if self.text.stopped else self.text.flush()

    def _top(self, top: list[tuple[int, float]]) -> dict:
        return {self.tok.decode([i]): v for i, v in top}

    def _kept(self) -> int:
        """Logprob entries whose token starts before the end of the (stop-trimmed) text."""
        end = len(self.prefix) + len(self.text.text)
        return sum(1 for o in self.lp_offsets if o < end) if self.text.stopped else len(self.lp_offsets)

    def _logprobs(self, start: int, end: int) -> dict:
        return logprobs_dict(self.lp_tokens[start:end], self.lp_values[start:end], self.lp_top[start:end],
                             self.lp_offsets[start:end])

    def take_logprobs(self) -> dict | None:
        """The entries not streamed yet (None without logprobs)."""
        if not self.want_logprobs:
            return None
        start, self.lp_sent = self.lp_sent, max(self.lp_sent, self._kept())
        return self._logprobs(start, self.lp_sent)

    def as_dict(self) -> dict:
        logprobs = self._logprobs(0, self._kept()) if self.want_logprobs else None
        if logprobs is not None and self.echo is not None:
            logprobs = {key: self.echo[key] + logprobs[key] for key in logprobs}
        return choice_dict(self.index, self.prefix + self.text.text, logprobs, self.finish_reason)


# ---------------------------------------------------------------------------------------------
# entry point (gpt2 serve)
# ---------------------------------------------------------------------------------------------

class SlowSenderTimeout(H11Protocol):
    """uvicorn's h11 protocol, plus: when a request's head has not arrived `timeout` s after the
    connection opened or its previous response ended, the client gets 408 and the connection closes
    (uvicorn alone waits forever for a head sent a byte at a time). Made by uvicorn_config."""

    def __init__(self, *args, timeout: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeout, self.timer, self.max_connections = timeout, None, max_connections

    def connection_made(self, transport):
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # the server's open connections, this one included
            self.app = functools.partial(_too_many_connections, self.max_connections)
        self._arm()

    def on_response_complete(self):
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()
        super().connection_lost(exc)

    def _arm(self):
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(self.timeout, self._expired)

    def _expired(self):
        no_request = self.cycle is None or self.cycle.response_complete  # else the app has it (and its body)
        if no_request and not self.transport.is_closing():
            body = json.dumps(APIError(408, f"the request did not arrive within {self.timeout:g} s",
                                       code="request_timeout").body()).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()


async def _too_many_connections(limit: int, scope, receive, send) -> None:
    """The app a connection over --max-connections gets: 503 with Retry-After, as an OpenAI error, and
    the connection closes (uvicorn's own limit answers in plain text)."""
    if scope["type"] != "http":
        return
    error = APIError(503, f"the server has {limit} connections open, its limit; retry shortly",
                     type="server_busy", code="too_many_connections")
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT drain and then return: uvicorn's own re-raises the signal
    once shut down, and the process would end with -15 instead of 0. A second Ctrl+C forces the exit."""

    def handle_exit(self, sig, frame):
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def uvicorn_config(app, cfg: ServerConfig, log_level: str = "info"):
    """How `gpt2 serve` runs the app (tests run the same)."""
    return uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, access_log=False,
                          http=functools.partial(SlowSenderTimeout, timeout=cfg.request_timeout,
                                                 max_connections=cfg.max_connections),
                          timeout_graceful_shutdown=int(cfg.shutdown_timeout))


def serve(cfg: ServerConfig) -> None:
    """Load the model and tokenizer, then run uvicorn until SIGINT/SIGTERM (then drain and return)."""
    from gpt2.errors import ConfigError
    from gpt2.quantize import load_draft, load_for_inference
    from gpt2.tokenizer import Tokenizer
    if cfg.max_batch < 1 or cfg.max_queue < 0:
        raise ConfigError("--max-batch must be at least 1 and --max-queue at least 0")
    if cfg.request_timeout <= 0 or cfg.max_connections < 1:
        raise ConfigError("--request-timeout must be positive and --max-connections at least 1")
    if cfg.prefill_chunk < 0 or (cfg.max_kv_mb is not None and cfg.max_kv_mb <= 0):
        raise ConfigError("--prefill-chunk must be at least 0 and --max-kv-mb positive")
    if cfg.chat_template:
        ChatTemplate.from_file(cfg.chat_template)  # a bad file fails now, before the model loads
    if cfg.draft_tokens < 1:
        raise ConfigError("--draft-tokens must be at least 1")
    model = load_for_inference(cfg.model, dtype=cfg.dtype, device=cfg.device, kv_dtype=cfg.kv_dtype).eval()
    require_gpt2_vocab(model.config, cfg.model)
    draft = None if cfg.draft is None else load_draft(cfg.draft, cfg.model, cfg.draft_dtype or cfg.dtype, cfg.device,
                                                      kv_dtype=cfg.kv_dtype)
    tokenizer = Tokenizer.from_pretrained(cfg.model)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and cfg.api_key is None:
        print(f"gpt2 serve: warning: listening on {cfg.host} without --api-key: anyone who can reach this "
              "address can use the model", file=sys.stderr)
    if cfg.compile:
        rows = ", ".join(map(str, compiled_row_counts(cfg.max_batch)))
        print(f"gpt2 serve: --compile: the decode step's graphs for {rows} rows are built "
              "before the first request is served (10-50 s each)", file=sys.stderr)
    GracefulServer(uvicorn_config(create_app(model, tokenizer, cfg, draft=draft), cfg)).run()
