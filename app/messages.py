"""Typed messages that travel between tokenrelay's processes.

The web tier writes a request (``app.records``), a worker
publishes ``TokenDelta`` values (token ids, never text), and a streamer turns them into
``OutputEvent`` values that the web tier frames as SSE or WebSocket messages.

Hot-path messages (``TokenDelta``, ``OutputEvent``) are slotted dataclasses rather than
pydantic models: the relay handles tens of thousands of them per second and pydantic's
validation would dominate its CPU budget. Each has exactly one encode/decode pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class FinishReason(str, Enum):
    """Why a choice ended, as the OpenAI API reports it."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"  # the choice called tools and ended (EOS / stop)
    ERROR = "error"
    CANCELLED = "abort"


class EngineFinish(str, Enum):
    """Why an engine stopped producing tokens for a choice.

    Engines know nothing of stop strings: they stop on an EOS/stop token id, on
    max_new_tokens, on a cancel, or on an error.
    """

    EOS = "eos"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class TokenLogprob:
    """The logprob of one generated token and, when asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def encode(self) -> list[Any]:
        return [self.token_id, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def decode(cls, raw: list[Any]) -> TokenLogprob:
        return cls(int(raw[0]), float(raw[1]), [(int(t), float(lp)) for t, lp in raw[2]])


@dataclass(slots=True)
class TokenDelta:
    """New token ids for one choice of one request, as a worker publishes them.

    ``logprobs`` is aligned with ``token_ids`` when the request asked for logprobs.
    ``finish`` is set on the last delta of a choice; ``error`` carries a message that
    is safe to show a client when ``finish`` is ``EngineFinish.ERROR``, and
    ``error_code`` the HTTP status it maps to (400 for a job the engine rejects).
    """

    choice: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish: EngineFinish | None = None
    error: str | None = None
    error_code: int | None = None
    cached_tokens: int | None = None

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {"c": self.choice, "t": self.token_ids}
        if self.logprobs is not None:
            out["l"] = [lp.encode() for lp in self.logprobs]
        if self.finish is not None:
            out["f"] = self.finish.value
        if self.error is not None:
            out["e"] = self.error
        if self.error_code is not None:
            out["n"] = self.error_code
        if self.cached_tokens is not None:
            out["k"] = self.cached_tokens
        return out

    @classmethod
    def decode(cls, raw: dict[str, Any]) -> TokenDelta:
        if len(raw) == 2:  # the common case, decoded for every token: ids only
            return cls(int(raw["c"]), list(raw["t"]))
        lps = raw.get("l")
        fin = raw.get("f")
        return cls(
            choice=int(raw["c"]),
            token_ids=list(raw["t"]),
            logprobs=[TokenLogprob.decode(x) for x in lps] if lps is not None else None,
            finish=EngineFinish(fin) if fin is not None else None,
            error=raw.get("e"),
            error_code=raw.get("n"),
            cached_tokens=raw.get("k"),
        )


class OutputKind(str, Enum):
    """The kinds of event on a request's output stream (streamer -> web)."""

    DELTA = "delta"
    FINAL = "final"
    USAGE = "usage"
    ERROR = "error"


_OUTPUT_KINDS = {k.value: k for k in OutputKind}


@dataclass(slots=True)
class LogprobEntry:
    """One generated token as the client sees it in ``logprobs``.

    ``text`` is the token's own text (independent of stop-string withholding);
    ``top`` holds (text, logprob) pairs with texts filled from the tokenizer.
    """

    token_id: int
    text: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float]] = field(default_factory=list)

    def encode(self) -> list[Any]:
        return [self.token_id, self.text, self.logprob, self.bytes, [list(t) for t in self.top]]

    @classmethod
    def decode(cls, raw: list[Any]) -> LogprobEntry:
        return cls(
            int(raw[0]),
            str(raw[1]),
            float(raw[2]),
            list(raw[3]),
            [(str(t), float(lp)) for t, lp in raw[4]],
        )


@dataclass(slots=True)
class ToolCallDelta:
    """A fragment of one tool call of a choice, as OpenAI streams it: the first fragment
    of call ``index`` carries its ``id`` and ``name``; ``arguments`` fragments concatenate
    to the call's JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def encode(self) -> list[Any]:
        return [self.index, self.id, self.name, self.arguments]

    @classmethod
    def decode(cls, raw: list[Any]) -> ToolCallDelta:
        return cls(int(raw[0]), raw[1], raw[2], str(raw[3]))


@dataclass(slots=True)
class OutputEvent:
    """One event on a request's output stream.

    - DELTA: ``text`` for ``choice`` (never empty unless it carries logprobs, reasoning
      or tool calls); ``reasoning``: text of the model's thinking (``reasoning_content``);
      ``tool_calls``: fragments of the tool calls the model made.
    - FINAL: ``finish_reason`` and ``stop_reason`` (the user's stop string or token id).
    - USAGE: ``usage`` dict (prompt_tokens, completion_tokens, total_tokens, ...).
    - ERROR: ``error`` message and ``code`` (an HTTP status the web tier may use);
      with ``choice`` None it ends the whole request.
    """

    kind: OutputKind
    choice: int | None = None
    text: str = ""
    logprobs: list[LogprobEntry] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    code: int | None = None
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] | None = None

    def encode(self) -> dict[str, Any]:
        # The member itself, not ``.value`` (an enum property, a fifth of this call): a
        # str enum serializes as its value, with orjson and json alike.
        out: dict[str, Any] = {"k": self.kind}
        if self.choice is not None:
            out["c"] = self.choice
        if self.text:
            out["t"] = self.text
        if self.logprobs is not None:
            out["l"] = [e.encode() for e in self.logprobs]
        if self.finish_reason is not None:
            out["f"] = self.finish_reason.value
        if self.stop_reason is not None:
            out["s"] = self.stop_reason
        if self.usage is not None:
            out["u"] = self.usage
        if self.error is not None:
            out["e"] = self.error
        if self.code is not None:
            out["n"] = self.code
        if self.reasoning:
            out["r"] = self.reasoning
        if self.tool_calls is not None:
            out["tc"] = [c.encode() for c in self.tool_calls]
        return out

    @classmethod
    def decode(cls, raw: dict[str, Any]) -> OutputEvent:
        # Every web process decodes every event it relays: the plain text delta (kind,
        # choice, text) takes a short path, and kinds are looked up, not constructed.
        if len(raw) == 3 and "t" in raw and "c" in raw:
            return cls(_OUTPUT_KINDS[raw["k"]], raw["c"], raw["t"])
        lps = raw.get("l")
        fin = raw.get("f")
        calls = raw.get("tc")
        return cls(
            kind=_OUTPUT_KINDS[raw["k"]],
            choice=raw.get("c"),
            text=raw.get("t", ""),
            logprobs=[LogprobEntry.decode(x) for x in lps] if lps is not None else None,
            finish_reason=FinishReason(fin) if fin is not None else None,
            stop_reason=raw.get("s"),
            usage=raw.get("u"),
            error=raw.get("e"),
            code=raw.get("n"),
            reasoning=raw.get("r", ""),
            tool_calls=[ToolCallDelta.decode(c) for c in calls] if calls is not None else None,
        )
