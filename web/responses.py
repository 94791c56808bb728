"""A request's output events as the chunks of a streamed OpenAI response.

Pure (no Flask, no Redis), so the framing rules are tested without a server.
Non-streamed responses fold the same ``OutputEvent`` sequence (docs/streams.md) with
``app.fold.ResponseFold``, which the batch API shares, so a streamed, a plain and a
batched request cannot disagree.

``ChunkStream`` sends the role chunk of every choice first (chat), then one chunk per
delta, one per choice's ``final`` (``finish_reason`` + vLLM's ``stop_reason``), and the
usage chunk (``choices: []``) when the client asked for ``include_usage``. It stops at
the first error (a choice ``final`` with ``finish_reason: error`` or a request-level
``error``; ``event_error`` recognizes both) and exposes it as ``.error``: a
``PipelineError`` whose status is the event's code. The caller decides what an error
means at that point (an HTTP status before any output, an SSE error event after).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.fold import usage_from_event
from app.messages import FinishReason, OutputEvent, OutputKind
from app.response_models import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
)
from web.errors import PipelineError

Chunk = ChatCompletionChunk | CompletionChunk


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What a response looks like, fixed when the request is accepted."""

    chat: bool
    response_id: str
    model: str
    created: int
    num_choices: int
    logprobs: bool = False
    include_usage: bool = False


def event_error(ev: OutputEvent) -> PipelineError | None:
    """The error an event reports (a choice ended in error, or the request failed)."""
    if ev.kind is OutputKind.ERROR or (
        ev.kind is OutputKind.FINAL and ev.finish_reason is FinishReason.ERROR
    ):
        return PipelineError(ev.error or "The request failed.", ev.code)
    return None


class ChunkStream:
    """Output events -> the chunks of one streamed response."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.error: PipelineError | None = None
        self.usage: dict[str, Any] | None = None  # raw, timings included (for metrics)
        self.ended = False  # the terminal event was seen
        self._offsets = [0] * shape.num_choices  # legacy logprobs' text_offset per choice

    def _chat(self, choices: list[ChatCompletionChunkChoice]) -> ChatCompletionChunk:
        s = self.shape
        return ChatCompletionChunk(
            id=s.response_id, created=s.created, model=s.model, choices=choices
        )

    def _completion(self, choices: list[CompletionChoice]) -> CompletionChunk:
        s = self.shape
        return CompletionChunk(id=s.response_id, created=s.created, model=s.model, choices=choices)

    def opening(self) -> list[Chunk]:
        """Chat streams start with each choice's role, as OpenAI's do."""
        if not self.shape.chat:
            return []
        return [
            self._chat(
                [ChatCompletionChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]
            )
            for i in range(self.shape.num_choices)
        ]

    def feed(self, ev: OutputEvent) -> list[Chunk]:
        """The chunks for one event; none once an error or the end was seen."""
        if self.error is not None or self.ended:
            return []
        error = event_error(ev)
        if error is not None:
            self.error = error
            self.ended = ev.kind is OutputKind.ERROR
            return []
        kind = ev.kind
        if kind is OutputKind.DELTA:
            return [self._delta(ev)]
        if kind is OutputKind.FINAL:
            return [self._final(ev)]
        if kind is OutputKind.USAGE:
            self.ended = True
            self.usage = ev.usage
            if not self.shape.include_usage:
                return []
            s = self.shape
            cls = ChatCompletionChunk if s.chat else CompletionChunk
            return [
                cls(
                    id=s.response_id,
                    created=s.created,
                    model=s.model,
                    choices=[],
                    usage=usage_from_event(ev.usage),
                )
            ]
        return []

    def _delta(self, ev: OutputEvent) -> Chunk:
        index = ev.choice or 0
        entries = ev.logprobs if self.shape.logprobs else None
        if self.shape.chat:
            return self._chat(
                [
                    ChatCompletionChunkChoice(
                        index=index,
                        delta=ChatDelta(content=ev.text) if ev.text else ChatDelta(),
                        logprobs=ChatChoiceLogprobs.from_entries(entries)
                        if entries is not None
                        else None,
                    )
                ]
            )
        logprobs = None
        if entries is not None:
            logprobs = CompletionLogprobs.from_entries(entries, self._offsets[index])
            self._offsets[index] += sum(len(e.text) for e in entries)
        return self._completion([CompletionChoice(index=index, text=ev.text, logprobs=logprobs)])

    def _final(self, ev: OutputEvent) -> Chunk:
        index = ev.choice or 0
        if self.shape.chat:
            return self._chat(
                [
                    ChatCompletionChunkChoice(
                        index=index,
                        delta=ChatDelta(),
                        finish_reason=ev.finish_reason,
                        stop_reason=ev.stop_reason,
                    )
                ]
            )
        return self._completion(
            [
                CompletionChoice(
                    index=index,
                    text="",
                    finish_reason=ev.finish_reason,
                    stop_reason=ev.stop_reason,
                )
            ]
        )
