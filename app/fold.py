"""Fold one request's output events into the body a non-streaming request returns.

A pure state machine: ``feed`` the events of ``tr:out:{rid}`` in order; once ``done``,
``response()`` is the ``ChatCompletionResponse`` / ``CompletionResponse`` the OpenAI
endpoint answers with, or ``failure`` says why there is none: a request-level error
event, or every choice failed (its HTTP status is the error's). A choice that failed
while others succeeded is kept, with ``finish_reason: "error"`` and its ``error``, as
the streamed response shows it. The HTTP routes and the batch driver both fold with
it, so a batch line and a plain request return the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from app.errors import StreamError, error_body, event_error
from app.messages import FinishReason, LogprobEntry, OutputEvent, OutputKind, ToolCallDelta
from app.response_models import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatToolCall,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionTokensDetails,
    ErrorBody,
    PromptTokensDetails,
    Timings,
    ToolCallFunction,
    Usage,
)
from app.timings import timings_from_usage

if TYPE_CHECKING:
    from app.intake import ResponseShape

FoldKind = Literal["chat", "completion"]


@dataclass(slots=True)
class _Call:
    """One tool call, reassembled from its fragments (as the openai SDK does)."""

    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: StreamError | None = None

    def ending(self) -> dict[str, Any]:
        """How the choice ended, as every response choice reports it."""
        return {
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "error": choice_error_body(self.error) if self.error is not None else None,
        }

    def add_calls(self, fragments: list[ToolCallDelta]) -> None:
        for fragment in fragments:
            call = self.calls.setdefault(fragment.index, _Call())
            if fragment.id is not None:
                call.id = fragment.id
            if fragment.name is not None:
                call.name = fragment.name
            if fragment.arguments:
                call.arguments.append(fragment.arguments)

    def message(self) -> ChatResponseMessage:
        """The chat message: ``content`` null when the model only called tools (what
        text it wrote around the calls is kept when there is any)."""
        text = "".join(self.text)
        tool_calls = [
            ChatToolCall(
                id=call.id,
                function=ToolCallFunction(name=call.name, arguments="".join(call.arguments)),
            )
            for _, call in sorted(self.calls.items())
        ]
        return ChatResponseMessage(
            content=None if tool_calls and not text.strip() else text,
            tool_calls=tool_calls or None,
            reasoning_content="".join(self.reasoning) if self.reasoning else None,
        )


def choice_error_body(error: StreamError) -> ErrorBody:
    """A failed choice's ``error`` field: the OpenAI error body of its event."""
    return ErrorBody(**error_body(error)[1]["error"])


def usage_from_event(usage: dict[str, Any] | None) -> Usage:
    """The client-facing usage: the streamer's internal fields (timings, its id) dropped."""
    u = usage or {}
    details = u.get("prompt_tokens_details")
    completion = u.get("completion_tokens_details")
    return Usage(
        prompt_tokens=int(u.get("prompt_tokens", 0)),
        completion_tokens=int(u.get("completion_tokens", 0)),
        total_tokens=int(u.get("total_tokens", 0)),
        prompt_tokens_details=(
            PromptTokensDetails(cached_tokens=int(details.get("cached_tokens", 0)))
            if isinstance(details, dict)
            else None
        ),
        completion_tokens_details=(
            CompletionTokensDetails(reasoning_tokens=int(completion.get("reasoning_tokens", 0)))
            if isinstance(completion, dict)
            else None
        ),
    )


class ResponseFold:
    """Accumulates a request's events into its non-streaming response."""

    def __init__(
        self,
        kind: FoldKind,
        *,
        num_choices: int,
        model: str,
        response_id: str,
        created: int,
        logprobs: bool = False,
        service_tier: bool = False,
        echo: tuple[str, ...] | None = None,
    ) -> None:
        self.kind = kind
        self.service_tier = service_tier
        self.echo = echo  # per choice: the prompt text its text starts with
        self.model = model
        self.response_id = response_id
        self.created = created
        self.want_logprobs = logprobs
        self.choices = [_Choice() for _ in range(num_choices)]
        self.usage: Usage | None = None
        self.timings: Timings | None = None  # llama.cpp's, from the usage event
        self.request_error: StreamError | None = None

    @classmethod
    def for_shape(cls, shape: ResponseShape) -> ResponseFold:
        """The fold for a prepared request's response shape."""
        return cls(
            "chat" if shape.chat else "completion",
            num_choices=shape.num_choices,
            model=shape.model,
            response_id=shape.response_id,
            created=shape.created,
            logprobs=shape.logprobs,
            service_tier=shape.service_tier,
            echo=shape.echo,
        )

    @property
    def done(self) -> bool:
        """The terminal event (usage, or a request-level error) has been fed."""
        return self.usage is not None or self.request_error is not None

    @property
    def failure(self) -> StreamError | None:
        """Why there is no response body: the request's error, or every choice's
        (the first one's), else None."""
        if self.request_error is not None:
            return self.request_error
        errors = [c.error for c in self.choices]
        if errors and all(e is not None for e in errors):
            return errors[0]
        return None

    @property
    def aborted(self) -> bool:
        """Some choice ended because the request was cancelled."""
        return any(c.finish_reason is FinishReason.CANCELLED for c in self.choices)

    def feed(self, ev: OutputEvent) -> None:
        if ev.kind is OutputKind.USAGE:
            self.usage = usage_from_event(ev.usage)
            self.timings = timings_from_usage(ev.usage)
            return
        if ev.kind is OutputKind.ERROR:
            if ev.choice is None:
                self.request_error = event_error(ev)
            return
        if ev.choice is None or not 0 <= ev.choice < len(self.choices):
            return
        c = self.choices[ev.choice]
        if ev.kind is OutputKind.DELTA:
            if ev.text:
                c.text.append(ev.text)
            if ev.logprobs:
                c.logprobs.extend(ev.logprobs)
            if ev.reasoning:
                c.reasoning.append(ev.reasoning)
            if ev.tool_calls:
                c.add_calls(ev.tool_calls)
        elif ev.kind is OutputKind.FINAL:
            c.finish_reason = ev.finish_reason
            c.stop_reason = ev.stop_reason
            c.error = event_error(ev)

    def response(self) -> ChatCompletionResponse | CompletionResponse:
        """The response body; call once ``done`` and without ``failure``."""
        usage = self.usage or Usage()
        if self.kind == "chat":
            return ChatCompletionResponse(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=[
                    ChatCompletionChoice(
                        index=i,
                        message=c.message(),
                        logprobs=(
                            ChatChoiceLogprobs.from_entries(c.logprobs)
                            if self.want_logprobs
                            else None
                        ),
                        **c.ending(),
                    )
                    for i, c in enumerate(self.choices)
                ],
                usage=usage,
                service_tier="default" if self.service_tier else None,
                timings=self.timings,
            )
        echo = self.echo or ("",) * len(self.choices)
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=echo[i] + "".join(c.text),
                    logprobs=(
                        CompletionLogprobs.from_entries(c.logprobs, 0)
                        if self.want_logprobs
                        else None
                    ),
                    **c.ending(),
                )
                for i, c in enumerate(self.choices)
            ],
            usage=usage,
            timings=self.timings,
        )
