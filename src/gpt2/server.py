"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching scheduler.

    gpt2 serve --model gpt2                                   # http://127.0.0.1:8000/v1
    gpt2 serve --model ./my-model --port 8080 --api-key sk-local --max-batch 16 --max-queue 64

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-local")
    client.completions.create(model="gpt2", prompt="Hello, my dog", max_tokens=32, temperature=0)

Endpoints: POST /v1/completions (prompt: a string, a list of strings, token ids or a list of token-id
lists; max_tokens, temperature, top_p, n, stop, stream (server-sent events ending with `data: [DONE]`),
seed, logprobs, echo, presence_penalty, frequency_penalty, logit_bias, user), GET /v1/models, GET /health.

This file is the text edge: it turns JSON and text into token ids and back, and nothing else. Generation
is batching.py's Scheduler: every request's sequences join one shared decode loop, on the one thread
that runs the model (the prompt's own logprobs for `echo` come from its prefill). Choice j of a prompt
with `seed` s samples with seed s + j, so it is reproducible whatever else the server is doing.

One request, in three parts: request_to_sequences (pure: the request as token-id Continuations),
the event pump (_Pump: scheduler events -> each choice's text and logprobs), and plain functions that
format OpenAI's shapes.

Bad input never gets a 500 or a hung connection: broken JSON or UTF-8 and too-long prompts get 400,
a body over the limit 413, wrong types, out-of-range values and unknown fields 422, all as OpenAI's
`{"error": {"message", "type", "param", "code"}}`; a full queue gets 429 with Retry-After. Messages
never carry paths or tracebacks. With --api-key every endpoint but /health wants `Authorization: Bearer`.
On SIGTERM uvicorn stops accepting connections and lets in-flight requests finish (up to
`shutdown_timeout` s); then the scheduler cancels whatever is left and its thread exits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt2.batching import Continuation, QueueFull, Scheduler, SchedulerClosed
from gpt2.config import GPT2_EOT, require_gpt2_vocab
from gpt2.sampling import SamplingConfig
from gpt2.tokenizer import TextStream


@dataclass
class ServerConfig:
    model: str = "gpt2"
    host: str = "127.0.0.1"            # loopback only, unless asked
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 16                # rows in the shared decode batch
    max_queue: int = 64                # sequences waiting for a row before requests get 429
    dtype: str = "float32"
    device: str | None = None
    max_body_bytes: int = 1 << 20
    max_choices: int = 64              # prompts x n in one request
    shutdown_timeout: float = 30.0     # seconds in-flight requests get after SIGTERM


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type, param, code, headers


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


# ---------------------------------------------------------------------------------------------
# the request schema: strict types, no unknown fields
# ---------------------------------------------------------------------------------------------

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    prompt: str | list[str] | TokenIds | list[TokenIds] = "<|endoftext|>"
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = 1.0
    n: Annotated[int, Field(ge=1, le=128)] | None = 1
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 63)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = False
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None


_UNION_FIELDS = {  # pydantic reports every union member's failure; one sentence says it better
    "prompt": "prompt must be a string, a list of strings, a list of token ids (non-negative integers) "
              "or a list of such lists",
    "stop": "stop must be a string or a list of at most 4 strings",
}


def parse_request(body: bytes) -> CompletionRequest:
    """The body as a CompletionRequest; APIError 400 (not UTF-8, not a JSON object) or 422 (the schema)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8", code="invalid_utf8") from None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return CompletionRequest.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> APIError:
    """422 naming the first offending field; never echoes the input itself."""
    err = e.errors(include_url=False, include_input=False)[0]
    loc = [str(p) for p in err["loc"]]
    if loc and loc[0] in _UNION_FIELDS and len(loc) > 1:
        return APIError(422, _UNION_FIELDS[loc[0]], param=loc[0], code="invalid_type")
    param = ".".join(loc) or None
    return APIError(422, f"{param}: {err['msg']}" if param else err["msg"], param=param, code=err["type"])


# ---------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------

def create_app(model, tokenizer, cfg: ServerConfig, model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving `model`; its lifespan starts and stops the scheduler (app.state.scheduler)."""
    model_name = model_name or Path(cfg.model).name or "gpt2"
    scheduler = Scheduler(model, max_batch=cfg.max_batch, max_queue=cfg.max_queue)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop, cfg.shutdown_timeout)

    app = FastAPI(title="gpt2", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler

    if cfg.api_key is not None:
        app.add_middleware(_RequireKey, key=cfg.api_key)

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

    @app.get("/health")
    async def health():
        if scheduler.error is not None:
            return JSONResponse({"status": "error"}, status_code=503)
        return {"status": "ok", "busy": scheduler.busy}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "gpt2"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(await _read_body(request, cfg.max_body_bytes))
        seqs = request_to_sequences(req, tokenizer, model.config, cfg)
        stop = stop_strings(req)
        choices = [_Choice(i, s.prompt, tokenizer, stop, bool(req.echo), req.logprobs) for i, s in enumerate(seqs)]
        pump = _Pump(scheduler, seqs, choices, prompt_tokens=sum(len(s.prompt) for s in seqs) // (req.n or 1))
        pump.submit()
        head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(completion_events(pump, head, bool(req.echo), include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await completion_response(pump, head, request)

    return app


class _RequireKey:
    """ASGI middleware: every path but /health wants `Authorization: Bearer <key>` (401 otherwise)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.key):
                response = error_response(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                                   code="invalid_api_key"))
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 when it is over `limit` bytes. Up to 4x the limit is read and dropped first,
    so a client that sends the whole body before reading gets the 413 rather than a reset."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > 4 * limit):
        raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > 4 * limit:
            break
        if size <= limit:
            body += chunk
    if size > limit:
        raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    return bytes(body)


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

    def __init__(self, scheduler: Scheduler, seqs: list[Continuation], choices: list["_Choice"], prompt_tokens: int):
        self.scheduler, self.seqs, self.choices, self.prompt_tokens = scheduler, seqs, choices, prompt_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.disconnected = False
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
        except SchedulerClosed:
            raise APIError(503, "the server is shutting down", type="server_busy", code="shutting_down",
                           headers={"Retry-After": "5"}) from None

    async def updates(self, request: Request | None = None):
        """(choice, kind, text, first) per event, once applied to its choice, until every choice is done.

        kind "prompt": text is the echoed prompt (its logprobs arrived); "token": text is what is now
        safe to show (maybe ""); "done": text is the held-back tail. first: the choice's first logprob
        entry this event added. request: watch it for a disconnect (non-streaming responses; a stream's
        disconnect cancels the response itself). On leaving, unfinished sequences are cancelled.
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
                first = len(choice.lp_tokens)
                if event[0] == "prompt":
                    text = choice.push_prompt(event[1])
                elif event[0] == "token":
                    text = choice.push(event[1], event[2])
                    if choice.text.stopped:
                        self.scheduler.cancel(self.seqs[index], "stop")
                else:
                    text = choice.finish(event[1])
                    pending -= 1
                yield choice, event[0], text, first
        finally:
            for s in self.seqs:
                if s.finish_reason is None:
                    self.scheduler.cancel(s)

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


async def completion_response(pump: _Pump, head: dict, request: Request) -> JSONResponse:
    """The whole completion as one JSON body (499 if the client left first)."""
    async with aclosing(pump.updates(request)) as updates:
        async for _ in updates:
            pass
    if pump.disconnected:
        return JSONResponse({}, status_code=499)  # nobody reads this: the client is gone
    return JSONResponse(completion_chunk(head, [c.as_dict() for c in pump.choices], pump.usage()))


async def completion_events(pump: _Pump, head: dict, echo: bool, include_usage: bool):
    """Server-sent events: one chunk per new text, a final chunk per choice, then [DONE]."""
    async with aclosing(pump.updates()) as updates:
        if echo:  # without logprobs the echoed prompt is known now; with them it comes after the prefill
            for c in pump.choices:
                if not c.want_logprobs:
                    yield sse(completion_chunk(head, [choice_dict(c.index, c.prefix, None, None)]))
        async for choice, kind, text, first in updates:
            if kind == "prompt":
                yield sse(completion_chunk(head, [choice_dict(choice.index, text, choice.echo, None)]))
            elif text or kind == "done":
                reason = choice.finish_reason if kind == "done" else None
                yield sse(completion_chunk(head, [choice_dict(choice.index, text, choice.logprobs_since(first),
                                                              reason)]))
    if include_usage:
        yield sse(completion_chunk(head, [], pump.usage()))
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# OpenAI's response shapes: plain formatting
# ---------------------------------------------------------------------------------------------

def completion_chunk(head: dict, choices: list[dict], usage: dict | None = None) -> dict:
    """A text_completion object (head: id, object, created, model) with these choices (and usage)."""
    out = {**head, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def choice_dict(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


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
        self.lp_tokens, self.lp_values, self.lp_top, self.lp_offsets = [], [], [], []

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
            self.lp_tokens.append(self.tok.decode([t]))
            self.lp_values.append(entry[0])
            self.lp_top.append(self._top(entry[1]))
            self.lp_offsets.append(len(self.prefix) + len(self.text.text))
        return self.text.push(t)

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

    def logprobs_since(self, start: int) -> dict | None:
        if not self.want_logprobs:
            return None
        end = self._kept()
        return logprobs_dict(self.lp_tokens[start:end], self.lp_values[start:end], self.lp_top[start:end],
                             self.lp_offsets[start:end])

    def as_dict(self) -> dict:
        logprobs = self.logprobs_since(0)
        if logprobs is not None and self.echo is not None:
            logprobs = {key: self.echo[key] + logprobs[key] for key in logprobs}
        return choice_dict(self.index, self.prefix + self.text.text, logprobs, self.finish_reason)

# ---------------------------------------------------------------------------------------------
# entry point (gpt2 serve)
# ---------------------------------------------------------------------------------------------

def serve(cfg: ServerConfig) -> None:
    """Load the model and tokenizer, then run uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    from gpt2.errors import ConfigError
    from gpt2.quantize import load_for_inference
    from gpt2.tokenizer import Tokenizer
    if cfg.max_batch < 1 or cfg.max_queue < 0:
        raise ConfigError("--max-batch must be at least 1 and --max-queue at least 0")
    model = load_for_inference(cfg.model, dtype=cfg.dtype, device=cfg.device).eval()
    require_gpt2_vocab(model.config, cfg.model)
    tokenizer = Tokenizer.from_pretrained(cfg.model)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and cfg.api_key is None:
        print(f"gpt2 serve: warning: listening on {cfg.host} without --api-key: anyone who can reach this "
              "address can use the model", file=sys.stderr)
    app = create_app(model, tokenizer, cfg)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info", access_log=False,
                timeout_graceful_shutdown=int(cfg.shutdown_timeout))
