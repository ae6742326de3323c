"""OpenAI's wire format, as pydantic models: what the server accepts, what it returns, and its errors.

    from gpt2.openai_api import CompletionRequest, parse_request
    req = parse_request(b'{"model": "gpt2", "prompt": "Hi"}', CompletionRequest)

The request models are strict (no unknown fields, no type coercion, ranges checked) and parse_request
turns every failure into one APIError in OpenAI's shape. The response models are the shapes server.py
returns; they exist so that GET /openapi.json describes the responses and streaming events exactly
(extra="forbid": the schema says no other field appears). tests/test_server_clients.py validates
real responses against that schema.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error for the client: HTTP status and OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------
# requests: strict types, no unknown fields
# ---------------------------------------------------------------------------------------------

TokenIds = list[Annotated[int, Field(ge=0)]]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Choices = Annotated[int, Field(ge=1, le=128)]
Stop = str | Annotated[list[str], Field(max_length=4)]
Seed = Annotated[int, Field(ge=-(1 << 63), lt=1 << 63)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LogitBias = dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]
User = Annotated[str, Field(max_length=256)]
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat completions share: which model, how to sample, how to stream."""
    model_config = STRICT

    model: str
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    n: Choices | None = 1
    stop: Stop | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: LogitBias | None = None
    user: User | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""
    prompt: str | list[str] | TokenIds | list[TokenIds] = "<|endoftext|>"
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = False


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: Annotated[str, Field(max_length=64)] | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: the messages become one prompt through the chat template."""
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # the newer name; wins if both are set

    def as_completion(self, prompt: list[int], max_tokens: int) -> CompletionRequest:
        """The same request as a completion of `prompt` (the rendered messages' ids); `max_tokens` when unset."""
        fields = self.model_dump(exclude={"messages", "max_tokens", "max_completion_tokens", "stream_options"})
        limit = self.max_completion_tokens or self.max_tokens or max_tokens
        return CompletionRequest(**fields, prompt=prompt, max_tokens=limit, stream_options=self.stream_options)


_UNION_FIELDS = {  # pydantic reports every union member's failure; one sentence says it better
    "prompt": "prompt must be a string, a list of strings, a list of token ids (non-negative integers) "
              "or a list of such lists",
    "stop": "stop must be a string or a list of at most 4 strings",
}


def parse_request(body: bytes, model: type[BaseModel]):
    """The body as a `model`; APIError 400 (not UTF-8, not a JSON object) or 422 (the schema)."""
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
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    """422 naming the first offending field; never echoes the input itself."""
    err = e.errors(include_url=False, include_input=False)[0]
    loc = [str(p) for p in err["loc"]]
    if loc and loc[0] in _UNION_FIELDS and len(loc) > 1:
        return APIError(422, _UNION_FIELDS[loc[0]], param=loc[0], code="invalid_type")
    param = ".".join(loc) or None
    return APIError(422, f"{param}: {err['msg']}" if param else err["msg"], param=param, code=err["type"])


# ---------------------------------------------------------------------------------------------
# responses (for the schema: server.py builds the same shapes as plain dicts)
# ---------------------------------------------------------------------------------------------

class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    error: ErrorDetail


class Logprobs(_Response):
    """The legacy completions logprobs: one entry per token (the first echoed prompt token's is null)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Logprobs | None
    finish_reason: FinishReason | None  # null in a stream's chunks until the choice's last


class Completion(_Response):
    """A text_completion: the whole response, or one server-sent event of a stream (each `data:` line;
    the stream ends with `data: [DONE]`, and with stream_options.include_usage its last event has
    no choices and the usage)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None  # in each choice's first chunk
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Response):
    """One server-sent event of a chat stream (each `data:` line; the stream ends with `data: [DONE]`)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


# What the routes do not declare to FastAPI (bodies parsed by hand, stream events): server.openapi_schema adds them.
UNDECLARED_MODELS = [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
                     (ChatCompletionChunk, "serialization")]
