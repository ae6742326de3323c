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
is batching.py's Scheduler: every request's sequences join one shared decode loop. Choice j of a prompt
with `seed` s samples with seed s + j, so it is reproducible whatever else the server is doing.

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
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt2.batching import QueueFull, Scheduler, SchedulerClosed, Sequence, prompt_logprobs
from gpt2.config import GPT2_EOT
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
        body = await _read_body(request, cfg.max_body_bytes)
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
            req = CompletionRequest.model_validate(obj)
        except ValidationError as e:
            raise _validation_error(e) from None
        job = _Job(req, model, tokenizer, cfg, scheduler, model_name)
        await job.prepare()
        job.submit()
        if req.stream:
            return StreamingResponse(job.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await job.result(request)

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
# one request: prompts -> sequences -> choices
# ---------------------------------------------------------------------------------------------

class _Job:
    def __init__(self, req: CompletionRequest, model, tokenizer, cfg: ServerConfig, scheduler: Scheduler, name: str):
        self.req, self.model, self.tok, self.cfg, self.scheduler = req, model, tokenizer, cfg, scheduler
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.name = name
        self.n = req.n or 1
        self.queue: asyncio.Queue = asyncio.Queue()
        self._polled = time.monotonic()

    async def prepare(self) -> None:
        """Token ids of every prompt, the limits, one Sequence per choice (index = prompt * n + j)."""
        req, config = self.req, self.model.config
        self.prompts = self._prompt_ids(req.prompt, config.vocab_size)
        if len(self.prompts) * self.n > min(self.cfg.max_choices, self.cfg.max_batch + self.cfg.max_queue):
            raise APIError(400, f"{len(self.prompts)} prompts x n={self.n} is more than the "
                                f"{min(self.cfg.max_choices, self.cfg.max_batch + self.cfg.max_queue)} "
                                "completions one request may ask for", param="n", code="too_many_choices")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        for ids in self.prompts:
            if len(ids) + max_tokens > config.n_positions:
                raise APIError(400, f"This model's maximum context length is {config.n_positions} tokens, however you "
                                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in your prompt; {max_tokens} "
                                    "for the completion). Please reduce your prompt or completion length.",
                               param="max_tokens" if max_tokens >= config.n_positions else "prompt",
                               code="context_length_exceeded")
        bias = {}
        for key, value in (req.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= config.vocab_size:
                raise APIError(422, f"logit_bias: {key[:20]!r} is not a token id", param="logit_bias",
                               code="invalid_value")
            bias[int(key)] = value
        temperature = 1.0 if req.temperature is None else req.temperature
        sampling = SamplingConfig(temperature=temperature, top_p=None if req.top_p in (None, 1.0) else req.top_p,
                                  presence_penalty=req.presence_penalty or 0.0,
                                  frequency_penalty=req.frequency_penalty or 0.0, logit_bias=bias)
        self.stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.echo_logprobs = None
        if req.echo and req.logprobs is not None:  # the prompt's own logprobs: one full forward each
            self.echo_logprobs = [await asyncio.to_thread(prompt_logprobs, self.model, ids, req.logprobs)
                                  for ids in self.prompts]
        loop = asyncio.get_running_loop()
        self.seqs = []
        for p, ids in enumerate(self.prompts):
            for j in range(self.n):
                index = p * self.n + j
                seed = None if req.seed is None else (req.seed + j) % (1 << 64)
                emit = (lambda ev, i=index: loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev)))
                self.seqs.append(Sequence(prompt=ids, max_new_tokens=max_tokens, emit=emit, sampling=sampling,
                                          seed=seed, logprobs=req.logprobs))
        self.choices = [_Choice(self, index, self.prompts[index // self.n]) for index in range(len(self.seqs))]

    def _prompt_ids(self, prompt, vocab_size: int) -> list[list[int]]:
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
                ids = self.tok.encode(p, allowed_special="all") or [GPT2_EOT]
            else:
                if not p:
                    raise APIError(400, "a token-id prompt is empty", param="prompt", code="invalid_value")
                if max(p) >= vocab_size:
                    raise APIError(400, f"prompt holds token ids outside [0, {vocab_size})", param="prompt",
                                   code="invalid_value")
                ids = list(p)
            out.append(ids)
        return out

    def submit(self) -> None:
        try:
            self.scheduler.submit(self.seqs)
        except QueueFull:
            raise APIError(429, "the server is busy; retry shortly", type="server_busy", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except SchedulerClosed:
            raise APIError(503, "the server is shutting down", type="server_busy", code="shutting_down",
                           headers={"Retry-After": "5"}) from None

    def cancel_all(self) -> None:
        for s in self.seqs:
            if s.finish_reason is None:
                self.scheduler.cancel(s)

    async def _next_event(self, request: Request | None):
        """The next (choice index, event); None if the client went away.

        request: poll it for a disconnect every half second (non-streaming responses; a stream
        notices a disconnect itself, when a write fails).
        """
        while True:
            if request is not None and time.monotonic() - self._polled > 0.5:
                self._polled = time.monotonic()
                if await request.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    def _handle(self, index: int, event) -> str:
        """Apply one scheduler event to its choice; the new text that is safe to show."""
        choice, seq = self.choices[index], self.seqs[index]
        if event[0] == "token":
            chunk = choice.push(event[1], event[2])
            if choice.text.stopped:
                self.scheduler.cancel(seq, "stop")
            return chunk
        choice.finish(event[1])
        return choice.text.flush() if not choice.text.stopped else ""

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def result(self, request: Request) -> dict:
        try:
            pending = len(self.choices)
            while pending:
                item = await self._next_event(request)
                if item is None:
                    return JSONResponse({}, status_code=499)  # nobody reads this: the client is gone
                index, event = item
                self._handle(index, event)
                pending -= event[0] == "done"
        finally:
            self.cancel_all()
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.name,
                "choices": [c.as_dict() for c in self.choices], "usage": self.usage()}

    async def events(self):
        """Server-sent events: one chunk per new text, a final chunk per choice, then [DONE]."""
        def sse(choices, usage=None):
            chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.name,
                     "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk)}\n\n"
        try:
            if self.req.echo:
                for c in self.choices:
                    yield sse([{"index": c.index, "text": c.prefix, "logprobs": c.echo_logprobs(),
                                "finish_reason": None}])
            pending = len(self.choices)
            while pending:
                item = await self._next_event(None)
                if item is None:
                    return
                index, event = item
                choice = self.choices[index]
                start = len(choice.lp_tokens)
                text = self._handle(index, event)
                finished = event[0] == "done"
                pending -= finished
                if text or finished:
                    yield sse([{"index": index, "text": text, "logprobs": choice.logprobs_since(start),
                                "finish_reason": choice.finish_reason if finished else None}])
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield sse([], self.usage())
            yield "data: [DONE]\n\n"
        finally:
            self.cancel_all()


class _Choice:
    """One choice's text (through TextStream: UTF-8-safe, stop strings cut) and logprobs."""

    def __init__(self, job: _Job, index: int, prompt: list[int]):
        self.job, self.index, self.prompt = job, index, prompt
        self.prefix = job.tok.decode(prompt) if job.req.echo else ""
        self.text = TextStream(job.tok.stream_decoder(), job.stop)
        self.finish_reason = None
        self.tokens = 0
        self.lp_tokens, self.lp_values, self.lp_top, self.lp_offsets = [], [], [], []

    def push(self, t: int, lp) -> str:
        self.tokens += 1
        if self.text.stopped:
            return ""
        if lp is not None:
            self.lp_tokens.append(self.job.tok.decode([t]))
            self.lp_values.append(lp[0])
            self.lp_top.append({self.job.tok.decode([i]): v for i, v in lp[1]} if self.job.req.logprobs else {})
            self.lp_offsets.append(len(self.prefix) + len(self.text.text))
        return self.text.push(t)

    def finish(self, reason: str) -> None:
        if self.text.stopped or reason == "cancelled":
            reason = "stop"
        self.finish_reason = reason

    def _kept(self) -> int:
        """Logprob entries whose token starts before the end of the (stop-trimmed) text."""
        end = len(self.prefix) + len(self.text.text)
        return sum(1 for o in self.lp_offsets if o < end) if self.text.stopped else len(self.lp_offsets)

    def echo_logprobs(self):
        if self.job.echo_logprobs is None:
            return None
        lps = self.job.echo_logprobs[self.index // self.job.n]
        tok = self.job.tok
        tokens = [tok.decode([t]) for t in self.prompt]
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens,
                "token_logprobs": [None] + [lp for lp, _ in lps],
                "top_logprobs": [None] + [{tok.decode([i]): v for i, v in top} for _, top in lps],
                "text_offset": offsets}

    def logprobs_since(self, start: int):
        if self.job.req.logprobs is None:
            return None
        end = self._kept()
        return {"tokens": self.lp_tokens[start:end], "token_logprobs": self.lp_values[start:end],
                "top_logprobs": self.lp_top[start:end], "text_offset": self.lp_offsets[start:end]}

    def as_dict(self) -> dict:
        logprobs = None
        if self.job.req.logprobs is not None:
            logprobs = self.logprobs_since(0)
            echo = self.echo_logprobs()
            if echo is not None:
                logprobs = {key: echo[key] + logprobs[key] for key in logprobs}
        return {"index": self.index, "text": self.prefix + self.text.text, "logprobs": logprobs,
                "finish_reason": self.finish_reason}


# ---------------------------------------------------------------------------------------------
# entry point (gpt2 serve)
# ---------------------------------------------------------------------------------------------

def serve(cfg: ServerConfig) -> None:
    """Load the model and tokenizer, then run uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    from gpt2.quantize import load_for_inference
    from gpt2.errors import ConfigError
    from gpt2.tokenizer import Tokenizer
    if cfg.max_batch < 1 or cfg.max_queue < 0:
        raise ConfigError("--max-batch must be at least 1 and --max-queue at least 0")
    model = load_for_inference(cfg.model, dtype=cfg.dtype, device=cfg.device).eval()
    if model.config.vocab_size != 50257:
        raise ConfigError(f"a vocabulary of {model.config.vocab_size} tokens is not GPT-2's; the server needs "
                          "GPT-2's tokenizer")
    tokenizer = Tokenizer.from_pretrained(cfg.model)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and cfg.api_key is None:
        print(f"gpt2 serve: warning: listening on {cfg.host} without --api-key: anyone who can reach this "
              "address can use the model", file=sys.stderr)
    app = create_app(model, tokenizer, cfg)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info", access_log=False,
                timeout_graceful_shutdown=int(cfg.shutdown_timeout))
