"""One request's output events as the Responses API's typed stream events and object.

A pure state machine (no Redis, no Flask): ``opening()`` gives ``response.created``
and ``response.in_progress``; ``feed`` turns each ``OutputEvent`` of the request's
output stream into the Responses events it implies, each with the next
``sequence_number``: ``response.output_item.added`` / ``response.content_part.added``
when an item starts, ``response.output_text.delta`` (``response.reasoning_text.delta``
for thinking, ``response.function_call_arguments.delta`` for a tool call's
arguments), their ``.done`` events when the item ends, then one terminal event:
``response.completed``, ``response.incomplete`` (``max_output_tokens`` reached, or
cancelled), or ``response.failed`` (after an ``error`` event). ``response`` is the
response object at any moment; once ``done`` it is the final one.

Everything depends only on the base object and the output events, in order: the
same stream replayed on any web process gives the same events with the same
sequence numbers, which is what makes ``starting_after`` exact.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from app.errors import StreamError, event_error
from app.messages import FinishReason, OutputEvent, OutputKind, ToolCallDelta
from app.records import RequestRecord
from app.responses_api import ResponseSkeleton, ResponsesRequest, response_id_of

TERMINAL_STATUSES = frozenset({"completed", "failed", "incomplete", "cancelled"})

Event = dict[str, Any]


@dataclass(slots=True)
class _Item:
    """One output item while it is being written."""

    kind: str  # "message", "reasoning", "function_call"
    item_id: str
    output_index: int
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""

    def part_type(self) -> str:
        return "reasoning_text" if self.kind == "reasoning" else "output_text"

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self, status: str, *, added: bool = False) -> dict[str, Any]:
        """The item as an object; ``added``: as ``output_item.added`` shows it (no
        content part yet: ``content_part.added`` brings it), else with the text so far."""
        text = "".join(self.text)
        content = [] if added else [self.part(text)]
        if self.kind == "function_call":
            return {
                "id": self.item_id,
                "type": "function_call",
                "status": status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": text,
            }
        if self.kind == "reasoning":
            return {
                "id": self.item_id,
                "type": "reasoning",
                "status": status,
                "summary": [],
                "content": content,
            }
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }


def usage_object(usage: dict[str, Any] | None) -> dict[str, Any]:
    """The streamer's usage as the Responses API names it."""
    u = usage or {}
    prompt = u.get("prompt_tokens_details")
    completion = u.get("completion_tokens_details")
    return {
        "input_tokens": int(u.get("prompt_tokens", 0)),
        "input_tokens_details": {
            "cached_tokens": int(prompt.get("cached_tokens", 0)) if isinstance(prompt, dict) else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": int(u.get("completion_tokens", 0)),
        "output_tokens_details": {
            "reasoning_tokens": (
                int(completion.get("reasoning_tokens", 0)) if isinstance(completion, dict) else 0
            )
        },
        "total_tokens": int(u.get("total_tokens", 0)),
    }


def error_code(status: int) -> str:
    """A ``response.error.code`` for an HTTP status (the SDK knows a fixed set)."""
    if status == 429:
        return "rate_limit_exceeded"
    if 400 <= status < 500:
        return "invalid_prompt"
    return "server_error"


class ResponseEvents:
    """Output events -> Responses stream events; ``response`` is the object so far."""

    def __init__(self, base: dict[str, Any], request_id: str, *, queued: bool = False) -> None:
        self.request_id = request_id
        self.queued = queued
        self._response = copy.deepcopy(base)
        self._response["output"] = []
        self._seq = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}
        self.finish_reason: FinishReason | None = None
        self._error: dict[str, Any] | None = None
        self._usage: dict[str, Any] | None = None
        # The request's error (or its one choice's): what a non-streaming caller
        # answers with when there is no output to show.
        self.failure: StreamError | None = None
        self.done = False

    @property
    def sequence_number(self) -> int:
        """The number the next event gets (events so far)."""
        return self._seq

    @property
    def response(self) -> dict[str, Any]:
        """The response object now (items in progress included)."""
        out = copy.deepcopy(self._response)
        out["output"] = [
            item.body("in_progress" if item is self._open else self._item_status())
            for item in self._items
        ]
        return out

    @property
    def status(self) -> str:
        return str(self._response["status"])

    def _item_status(self) -> str:
        return "incomplete" if self.finish_reason is FinishReason.LENGTH else "completed"

    def _event(self, kind: str, **fields: Any) -> Event:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def opening(self) -> list[Event]:
        """``response.created`` (status ``queued`` for a background response) and
        ``response.in_progress``."""
        created = self.response
        if self.queued:
            created["status"] = "queued"
        events = [self._event("response.created", response=created)]
        self._response["status"] = "in_progress"
        events.append(self._event("response.in_progress", response=self.response))
        return events

    def feed(self, ev: OutputEvent) -> list[Event]:
        """The events one output event implies; none once the response has ended."""
        if self.done or (ev.choice not in (None, 0)):
            return []
        if ev.kind is OutputKind.DELTA:
            out: list[Event] = []
            if ev.reasoning:
                out += self._text("reasoning", ev.reasoning)
            if ev.text:
                out += self._text("message", ev.text)
            for call in ev.tool_calls or ():
                out += self._call(call)
            return out
        if ev.kind is OutputKind.FINAL:
            self.finish_reason = ev.finish_reason
            error = event_error(ev)
            if error is not None and self._error is None:
                self.failure = error
                self._error = {"code": error_code(error.status), "message": str(error)}
            return self._close()
        if ev.kind is OutputKind.USAGE:
            self._usage = ev.usage
            self._response["usage"] = usage_object(ev.usage)
            return self._finish()
        if ev.kind is OutputKind.ERROR:
            error = event_error(ev) or StreamError("The response failed.", 500)
            self.failure = error
            message, status = str(error), error.status
            self._error = {"code": error_code(status), "message": message}
            out = self._close()
            out.append(self._event("error", code=error_code(status), message=message, param=None))
            return out + self._finish()
        return []

    # -- items ------------------------------------------------------------------------
    def _start(self, item: _Item) -> list[Event]:
        out = self._close()
        self._items.append(item)
        self._open = item
        out.append(
            self._event(
                "response.output_item.added",
                output_index=item.output_index,
                item=item.body("in_progress", added=True),
            )
        )
        if item.kind != "function_call":
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.item_id,
                    output_index=item.output_index,
                    content_index=0,
                    part=item.part(""),
                )
            )
        return out

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self.request_id}_{len(self._items)}"

    def _text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        item = self._open
        if item is None or item.kind != kind:
            prefix = "rs" if kind == "reasoning" else "msg"
            item = _Item(kind, self._item_id(prefix), len(self._items))
            out += self._start(item)
        item.text.append(text)
        fields: dict[str, Any] = {
            "item_id": item.item_id,
            "output_index": item.output_index,
            "content_index": 0,
            "delta": text,
        }
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", **fields))
        else:
            out.append(self._event("response.output_text.delta", logprobs=[], **fields))
        return out

    def _call(self, fragment: ToolCallDelta) -> list[Event]:
        out: list[Event] = []
        item = self._calls.get(fragment.index)
        if item is None:
            item = _Item("function_call", self._item_id("fc"), len(self._items))
            item.call_id = fragment.id or f"call_{self.request_id}_{fragment.index}"
            item.name = fragment.name or ""
            self._calls[fragment.index] = item
            out += self._start(item)
        if fragment.arguments:
            item.text.append(fragment.arguments)
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.item_id,
                    output_index=item.output_index,
                    delta=fragment.arguments,
                )
            )
        return out

    def _close(self) -> list[Event]:
        """The ``.done`` events of the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(item.text)
        out: list[Event] = []
        where = {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "function_call":
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    name=item.name,
                    arguments=text,
                    **where,
                )
            )
        else:
            if item.kind == "reasoning":
                out.append(
                    self._event("response.reasoning_text.done", content_index=0, text=text, **where)
                )
            else:
                out.append(
                    self._event(
                        "response.output_text.done",
                        content_index=0,
                        text=text,
                        logprobs=[],
                        **where,
                    )
                )
            out.append(
                self._event(
                    "response.content_part.done", content_index=0, part=item.part(text), **where
                )
            )
        out.append(
            self._event(
                "response.output_item.done",
                output_index=item.output_index,
                item=item.body(self._item_status()),
            )
        )
        return out

    def _finish(self) -> list[Event]:
        """The terminal event, with the final response object."""
        out = self._close()
        self.done = True
        r = self._response
        if self._error is not None:
            r["status"], r["error"], kind = "failed", self._error, "response.failed"
        elif self.finish_reason is FinishReason.LENGTH:
            r["status"], kind = "incomplete", "response.incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        elif self.finish_reason is FinishReason.CANCELLED:
            r["status"], kind = "cancelled", "response.incomplete"
        else:
            r["status"], kind = "completed", "response.completed"
            # From the stream itself (not a clock), so a replay gives the same object.
            timings = (self._usage or {}).get("timings") or {}
            r["completed_at"] = int(r["created_at"] + float(timings.get("e2e_s", 0.0)))
        out.append(self._event(kind, response=self.response))
        return out


@dataclass(frozen=True, slots=True)
class ResponseObject:
    """A finished response object (what ``ResponsesFold.response`` gives)."""

    body: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.body


class ResponsesFold:
    """``ResponseEvents`` behind ``app.fold.ResponseFold``'s interface, so the batch
    driver folds a ``/v1/responses`` line as it folds a chat line."""

    def __init__(self, request: ResponsesRequest, record: RequestRecord) -> None:
        rid = record.request_id
        base = ResponseSkeleton(
            response_id_of(rid), int(record.created), record.model, request
        ).base()
        self.events = ResponseEvents(base, rid)
        self.events.opening()

    def feed(self, ev: OutputEvent) -> None:
        self.events.feed(ev)

    @property
    def done(self) -> bool:
        return self.events.done

    @property
    def failure(self) -> StreamError | None:
        """Why there is no response to show: it failed without any output."""
        response = self.events.response
        if self.events.failure is not None and not response["output"]:
            return self.events.failure
        return None

    @property
    def aborted(self) -> bool:
        return self.events.finish_reason is FinishReason.CANCELLED

    def response(self) -> ResponseObject:
        return ResponseObject(self.events.response)
