"""A request's output events as the chunks of a streamed OpenAI response.

Pure (no Flask, no Redis), so the framing rules are tested without a server.
Non-streamed responses fold the same ``OutputEvent`` sequence (docs/streams.md) with
``app.fold.ResponseFold``, which the batch driver shares, so a streamed, a plain and a
batched request cannot disagree.

``ChunkStream`` sends the role chunk of every choice first (chat), then one chunk per
delta, one per choice's ``final`` (``finish_reason`` + vLLM's ``stop_reason``; a choice
that failed gets ``finish_reason: "error"`` and its ``error`` while the other choices go
on), and the usage chunk (``choices: []``, with llama.cpp's ``timings``) when the
client asked for ``include_usage``. A request-level error ends the chunks and is exposed
as ``.error`` (``app.errors.StreamError``); the caller frames it (an HTTP status before
any output, an SSE error event after).
"""

from __future__ import annotations

import json
from typing import Any

from app.errors import StreamError, event_error
from app.fold import choice_error_body, usage_from_event
from app.intake import ResponseShape
from app.messages import OutputEvent, OutputKind
from app.response_models import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
)
from app.timings import timings_from_usage

Chunk = ChatCompletionChunk | CompletionChunk

# Stands for a delta's text while a choice's template is made (a private-use character:
# JSON leaves it as it is).
_TEXT_MARK = "\ue000"
_TEXT_MARK_JSON = json.dumps(_TEXT_MARK, ensure_ascii=False)


class ChunkStream:
    """Output events -> the chunks of one streamed response."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.error: StreamError | None = None
        self.usage: dict[str, Any] | None = None  # raw, timings included (for metrics)
        self.ended = False  # the terminal event was seen
        self._offsets = [0] * shape.num_choices  # legacy logprobs' text_offset per choice
        # Per choice: the JSON of a plain text delta around its text (``feed_json``);
        # None until first needed, ("", "") when the shape cannot have one.
        self._templates: list[tuple[str, str] | None] = [None] * shape.num_choices

    def _chat(self, choices: list[ChatCompletionChunkChoice]) -> ChatCompletionChunk:
        s = self.shape
        return ChatCompletionChunk(
            id=s.response_id,
            created=s.created,
            model=s.model,
            choices=choices,
            service_tier="default" if s.service_tier else None,
        )

    def _completion(self, choices: list[CompletionChoice]) -> CompletionChunk:
        s = self.shape
        return CompletionChunk(id=s.response_id, created=s.created, model=s.model, choices=choices)

    def opening(self) -> list[Chunk]:
        """Chat streams start with each choice's role, as OpenAI's do; completions with
        ``echo``, with each choice's prompt text."""
        if not self.shape.chat:
            echo = self.shape.echo or ()
            return [
                self._completion([CompletionChoice(index=i, text=text)])
                for i, text in enumerate(echo)
            ]
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
        kind = ev.kind
        if kind is OutputKind.ERROR:
            self.error = event_error(ev)
            self.ended = True
            return []
        if kind is OutputKind.DELTA:
            return [self._so_far(self._delta(ev), ev)]
        if kind is OutputKind.FINAL:
            return [self._so_far(self._final(ev), ev)]
        if kind is OutputKind.USAGE:
            self.ended = True
            self.usage = ev.usage
            if not self.shape.include_usage:
                return []
            chunk = self._chat([]) if self.shape.chat else self._completion([])
            chunk.usage, chunk.timings = usage_from_event(ev.usage), timings_from_usage(ev.usage)
            return [chunk]
        return []

    def feed_json(self, ev: OutputEvent) -> list[str]:
        """``feed``, serialized: exactly ``[c.to_json() for c in feed(ev)]``.

        A plain text delta (no logprobs asked for, no reasoning, no tool calls), which
        is nearly every event of a stream, is written into its choice's template
        instead of being built and dumped as models: that was a sixth of the web
        tier's CPU per token (docs/benchmarks.md). The template is the models' own
        JSON around a marker, and ``json.dumps`` escapes a string as pydantic does
        (tests/web/test_chunk_json.py), so the bytes are the same.
        """
        index = ev.choice or 0
        if (
            ev.kind is OutputKind.DELTA
            and ev.text
            and not ev.reasoning
            and not ev.tool_calls
            and (ev.logprobs is None or not self.shape.logprobs)
            and not self.shape.continuous_usage
            and self.error is None
            and not self.ended
            and 0 <= index < len(self._templates)
        ):
            template = self._templates[index]
            if template is None:
                template = self._templates[index] = self._template(index)
            head, tail = template
            if head:
                return [head + json.dumps(ev.text, ensure_ascii=False) + tail]
        return [chunk.to_json() for chunk in self.feed(ev)]

    def _so_far(self, chunk: Chunk, ev: OutputEvent) -> Chunk:
        """vLLM's ``continuous_usage_stats``: the usage so far on the chunk."""
        if self.shape.continuous_usage and ev.usage is not None:
            chunk.usage = usage_from_event(ev.usage)
        return chunk

    def _template(self, index: int) -> tuple[str, str]:
        marked = self._delta(OutputEvent(OutputKind.DELTA, choice=index, text=_TEXT_MARK))
        parts = marked.to_json().split(_TEXT_MARK_JSON)
        if len(parts) != 2:  # the marker is in the model's name or id too: no template
            return "", ""
        return parts[0], parts[1]

    def _delta(self, ev: OutputEvent) -> Chunk:
        index = ev.choice or 0
        entries = ev.logprobs if self.shape.logprobs else None
        if self.shape.chat:
            return self._chat(
                [
                    ChatCompletionChunkChoice(
                        index=index,
                        delta=ChatDelta.of_event(ev),
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
        failed = event_error(ev)
        error = choice_error_body(failed) if failed is not None else None
        if self.shape.chat:
            return self._chat(
                [
                    ChatCompletionChunkChoice(
                        index=index,
                        delta=ChatDelta(),
                        finish_reason=ev.finish_reason,
                        stop_reason=ev.stop_reason,
                        error=error,
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
                    error=error,
                )
            ]
        )
