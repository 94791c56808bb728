"""OpenAI response bodies as tokenrelay sends them (chat, completions, chunks, models).

Build the models below and send ``resp.to_dict()`` (or ``resp.to_json()``); they dump
exactly what OpenAI clients expect: ``finish_reason``, ``logprobs`` and ``stop_reason``
are always present (``null`` when unset), while a chunk's ``usage``, a delta's
``role``/``content`` and ``prompt_tokens_details`` appear only when set. Requests and
their validation live in ``app.protocol``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from app.messages import FinishReason, LogprobEntry, OutputEvent, ToolCallDelta


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class _Response(BaseModel):
    """A response body. Fields in ``_omit_if_none`` are left out while they are None."""

    model_config = ConfigDict(extra="forbid")
    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready body (``model_dump(mode="json")``)."""
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        return self.model_dump_json()


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class Usage(_Response):
    _omit_if_none = frozenset({"prompt_tokens_details", "completion_tokens_details"})

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    """Chat ``logprobs``: ``refusal`` is always null here (no refusals), but OpenAI
    sends it and clients generated from its schema require it."""

    content: list[ChatLogprobToken] | None = None
    refusal: list[ChatLogprobToken] | None = None

    @classmethod
    def from_entries(cls, entries: Iterable[LogprobEntry]) -> ChatChoiceLogprobs:
        """Chat ``logprobs`` from the streamer's entries."""
        return cls(
            content=[
                ChatLogprobToken(
                    token=e.text,
                    logprob=e.logprob,
                    bytes=list(e.bytes),
                    top_logprobs=[
                        TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top
                    ],
                )
                for e in entries
            ]
        )


class ToolCallFunction(_Response):
    name: str
    arguments: str


class ChatToolCall(_Response):
    """A tool call of a response message: ``arguments`` is JSON text, as the model
    wrote it (OpenAI's shape; clients ``json.loads`` it)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(_Response):
    """``refusal`` is always sent (null): OpenAI's schema marks it required.
    ``content`` is null when the model only called tools; ``tool_calls`` and
    ``reasoning_content`` (vLLM's and DeepSeek's name) appear only when there are some."""

    _omit_if_none = frozenset({"tool_calls", "reasoning_content"})

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    reasoning_content: str | None = None


class ChatCompletionChoice(_Response):
    _omit_if_none = frozenset({"error"})

    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: ErrorBody | None = None


class Timings(_Response):
    """Where a request's time went, with llama.cpp server's names (its users read them).

    ``prompt_n`` counts the prompt tokens the engine processed (without the ones reused
    from its prefix cache, ``cache_n``), ``predicted_n`` the completion tokens (the
    usage's ``completion_tokens``). ``prompt_ms`` is the time from a worker taking the
    request to the first token; ``predicted_ms`` from the first token to the end;
    ``queue_ms`` from arrival to a worker taking it; ``ttft_ms`` from arrival to the
    first token. A time that was not measured (no token came) is null, and so is a
    rate over it.
    """

    prompt_n: int = 0
    prompt_ms: float | None = None
    prompt_per_token_ms: float | None = None
    prompt_per_second: float | None = None
    predicted_n: int = 0
    predicted_ms: float | None = None
    predicted_per_token_ms: float | None = None
    predicted_per_second: float | None = None
    cache_n: int = 0
    queue_ms: float | None = None
    ttft_ms: float | None = None


class ChatCompletionResponse(_Response):
    _omit_if_none = frozenset({"timings", "service_tier"})

    id: str = Field(default_factory=new_chat_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    # "default" when the request named a tier (there is one tier here), else left out.
    service_tier: Literal["default"] | None = None
    timings: Timings | None = None


class DeltaFunction(_Response):
    """``name`` only on a call's first fragment; ``arguments`` fragments concatenate."""

    _omit_if_none = frozenset({"name"})

    name: str | None = None
    arguments: str = ""


class DeltaToolCall(_Response):
    """One fragment of tool call ``index``, as OpenAI streams it: the first carries
    ``id``, ``type`` and ``function.name`` (with ``arguments`` ""), the rest only
    ``function.arguments`` — what the openai SDK's stream helpers reassemble."""

    _omit_if_none = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @classmethod
    def from_fragment(cls, fragment: ToolCallDelta) -> DeltaToolCall:
        first = fragment.id is not None or fragment.name is not None
        return cls(
            index=fragment.index,
            id=fragment.id,
            type="function" if first else None,
            function=DeltaFunction(name=fragment.name, arguments=fragment.arguments),
        )


class ChatDelta(_Response):
    """A chunk's delta. As OpenAI's stream: the role chunk carries ``refusal: null``
    (``{"role": "assistant", "content": "", "refusal": null}``); content deltas carry
    only ``content``, tool-call deltas only ``tool_calls``, reasoning deltas only
    ``reasoning_content``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @classmethod
    def of_event(cls, ev: OutputEvent) -> ChatDelta:
        """The delta of one DELTA event (text, reasoning and tool-call fragments)."""
        return cls(
            content=ev.text or None,
            reasoning_content=ev.reasoning or None,
            tool_calls=[DeltaToolCall.from_fragment(f) for f in ev.tool_calls]
            if ev.tool_calls
            else None,
        )

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in ("content", "reasoning_content", "tool_calls"):
            if data.get(name, 0) is None:
                del data[name]
        if data.get("role", 0) is None:
            del data["role"]
            if data.get("refusal", 0) is None:
                del data["refusal"]
        return data


class ChatCompletionChunkChoice(_Response):
    _omit_if_none = frozenset({"error"})

    index: int
    delta: ChatDelta = Field(default_factory=ChatDelta)
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: ErrorBody | None = None


class ChatCompletionChunk(_Response):
    """One SSE event of a streamed chat completion (the usage chunk has no choices;
    it carries ``timings`` too)."""

    _omit_if_none = frozenset({"usage", "timings", "service_tier"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice] = Field(default_factory=list)
    service_tier: Literal["default"] | None = None
    usage: Usage | None = None
    timings: Timings | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    @classmethod
    def from_entries(cls, entries: Iterable[LogprobEntry], offset: int) -> CompletionLogprobs:
        """Legacy ``logprobs`` from the streamer's entries; ``offset`` is the length of
        the choice's text before the first entry."""
        out = cls()
        for e in entries:
            out.tokens.append(e.text)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append(dict(e.top))
            out.text_offset.append(offset)
            offset += len(e.text)
        return out


class CompletionChoice(_Response):
    """``error``: only on a choice that ended with ``finish_reason: "error"`` (n>1: the
    other choices go on), in OpenAI's error shape."""

    _omit_if_none = frozenset({"error"})

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: ErrorBody | None = None


class CompletionResponse(_Response):
    _omit_if_none = frozenset({"timings"})

    id: str = Field(default_factory=new_completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings | None = None


class CompletionChunk(_Response):
    """One SSE event of a streamed text completion (OpenAI keeps the same ``object``)."""

    _omit_if_none = frozenset({"usage", "timings"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Usage | None = None
    timings: Timings | None = None


class ModelObject(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenrelay"
    max_model_len: int | None = None
    # vLLM's field: the served model an alias stands for (itself for a served model).
    root: str | None = None
    engines: list[str] | None = None  # the engines of its live workers
    # What its live workers serve (Ollama's word): "completion", and "embedding" when
    # one of them answers /v1/embeddings.
    capabilities: list[str] | None = None
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"root", "engines", "capabilities"})


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelObject] = Field(default_factory=list)


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """``{"error": {...}}``; ``app.errors.error_body`` builds the same dict from an
    exception."""

    error: ErrorBody
