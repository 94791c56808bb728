"""Tool-call parsers: find the calls a model wrote in its text (pure, incremental).

Each model family writes calls in its own syntax; the model card's ``tool_call_parser``
names the parser, which runs per choice on the Decoder's released text (after the
reasoning parser), only when the request gave tools:

- ``hermes`` (Hermes, Qwen, SmolLM): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block per call (several blocks: parallel calls).
- ``llama3_json`` (Llama 3.1+): ``<|python_tag|>`` then a JSON call, or an output that
  is itself a JSON call ``{"name": ..., "parameters": {...}}``; several calls may follow
  each other, separated by ``;``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``.

Text outside calls is content. Like the Decoder with stop strings, a parser holds back
the longest suffix that could still become its opening tag, so a partial tag never
reaches a client as content. A call whose JSON names the function first and then holds
its arguments as an object (``{"name": ..., "arguments": {``, and Mistral's
``name[ARGS]{``) is streamed as the model writes it, as OpenAI, vLLM and llama.cpp
stream calls: a fragment with index, id and name as soon as the name is known, then the
arguments' text as it grows, up to the end of the arguments object (what follows it,
the call's closing and tag, is not sent); the call stands from then on, however it ends.
Any other call is buffered until its JSON is complete, then sent as two fragments: index,
id and name, then the arguments (``json.dumps`` of the parsed object). Either way the
non-streamed response is the fragments joined, so the two cannot differ. A malformed
call that was not announced (bad JSON, no name) is released as content, at its end or at
``flush``, never an error. Whitespace that only separates calls from each other or from the edge
of the content (the template's newlines) is dropped, so a choice that only called tools
has no content.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from app.messages import ToolCallDelta
from app.tags import Content, Piece, split_at_tag

__all__ = [
    "TOOL_PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ToolCallParser",
    "make_tool_parser",
    "new_call_id",
]

logger = logging.getLogger(__name__)

_SPACE = re.compile(r"\s*")
_SPACE_OR_SEMICOLON = re.compile(r"[\s;]*")
_NAME_CHARS = re.compile(r"[\w.\-]*")
# A call object that names its function first, then opens its arguments object.
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*\{')


def _skip(pattern: re.Pattern[str], text: str) -> int:
    """How many leading characters of ``text`` the (always matching) pattern covers."""
    match = pattern.match(text)
    return match.end() if match else 0


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` + 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def call_from(obj: Any, *, require_arguments: bool = False) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a parsed call object, or None when it is not one.

    The arguments may be under ``arguments`` or ``parameters`` (Llama's word), as an
    object or as a JSON string of one (some models quote them)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    elif require_arguments:
        return None
    else:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class JsonEnd:
    """Where one JSON object or array ends, fed piecewise: bracket depth outside strings.

    Mismatched brackets end it too (the parse that follows then fails)."""

    __slots__ = ("_depth", "_escape", "_in_string")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> int:
        """Index just past the value's end in ``text``, or -1 when it goes on."""
        depth, in_string, escape = self._depth, self._in_string, self._escape
        for i, c in enumerate(text):
            if in_string:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c == "{" or c == "[":
                depth += 1
            elif c == "}" or c == "]":
                depth -= 1
                if depth <= 0:
                    self._depth, self._in_string, self._escape = 0, False, False
                    return i + 1
        self._depth, self._in_string, self._escape = depth, in_string, escape
        return -1


class ToolCallParser(ABC):
    """One choice's tool-call parser: ``feed(text) -> pieces``, ``flush() -> pieces``.

    Content is scanned for ``start_tag``; from the tag on, text is a call body that the
    subclass buffers until the call is complete. ``special_tags``: the tag is a special
    token, so the Decoder must keep special tokens for it to appear in the text.
    """

    name: ClassVar[str]
    start_tag: ClassVar[str]
    special_tags: ClassVar[bool] = False
    # What is dropped right after a call: the whitespace between calls (and Llama's ";").
    _separator: ClassVar[re.Pattern[str]] = _SPACE

    __slots__ = (
        "_after_call",
        "_announced",
        "_args_end",
        "_args_pos",
        "_body",
        "_calls",
        "_first",
        "_held",
        "_in_body",
        "_new_id",
        "_no_stream",
        "_stash",
        "_ws",
        "max_calls",
    )

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._first = self.start_tag[0]
        self._held = ""  # a possible start of ``start_tag``, not yet released
        self._ws = ""  # trailing whitespace of the content, dropped if a call follows
        self._after_call = False  # nothing but separators since the last call
        self._calls = 0
        self._in_body = False
        self._stash = ""  # what opened the body (whitespace before it + tag): released
        self._body = ""  # if the call turns out malformed, with the body's raw text
        # The open call's streamed arguments: announced (name sent), where the unsent
        # arguments text starts in the body, their end (None: not yet reached).
        self._announced = False
        self._no_stream = False  # the open call cannot be streamed: it is buffered
        self._args_pos = 0
        self._args_end: JsonEnd | None = None
        # At most this many calls; once made, the rest of the choice's text is dropped
        # (content after a call is not part of an answer that ends in the call).
        self.max_calls: int | None = None

    @property
    def calls(self) -> int:
        """How many tool calls this choice has made so far."""
        return self._calls

    @property
    def done(self) -> bool:
        """The choice made all the calls it may: nothing it writes is passed on."""
        return self.max_calls is not None and self._calls >= self.max_calls

    def feed(self, text: str) -> list[Piece]:
        if self.done:
            return []
        if not (self._in_body or self._held or self._after_call) and self._first not in text:
            # The common case, once per token: plain content, no tag can start in it.
            out: list[Piece] = []
            self._emit(text, out)
            return out
        return self._scan(text)

    def _scan(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text and not self.done:
            text = self._feed_body(text, out) if self._in_body else self._feed_content(text, out)
        return out

    def flush(self) -> list[Piece]:
        """The choice ended: finish or release an open call, release what was held."""
        out: list[Piece] = []
        if self.done:
            self._held = self._ws = ""
            return out
        if self._in_body:
            self._flush_body(out)
        held, self._held = self._held, ""
        self._emit(held, out)
        if self._ws:
            out.append(Content(self._ws))
            self._ws = ""
        return out

    # -- content ---------------------------------------------------------------------------
    def _feed_content(self, text: str, out: list[Piece]) -> str:
        """Scan content for the start tag; returns the text after it (a call body)."""
        before, found, after = split_at_tag(self._held + text, self.start_tag)
        self._emit(before, out)
        if not found:
            self._held = after
            return ""
        self._held = ""
        self._open_body(self._ws + self.start_tag)
        self._ws = ""
        return after

    def _emit(self, text: str, out: list[Piece]) -> None:
        """Release content, keeping back trailing whitespace (a call may follow) and
        dropping the separators right after a call."""
        if self._after_call:
            text = text[_skip(self._separator, text) :]
            if not text:
                return
            self._after_call = False
        core = text.rstrip()
        if core:
            out.append(Content(self._ws + core))
            self._ws = text[len(core) :]
        else:
            self._ws += text

    # -- call bodies -----------------------------------------------------------------------
    def _open_body(self, stash: str) -> None:
        self._in_body = True
        self._stash = stash
        self._body = ""
        self._announced = self._no_stream = False
        self._args_end = None

    def _stream_args(
        self, text: str, start: int, out: list[Piece], *, name: str | None = None
    ) -> None:
        """Send what is new of the open call's arguments: ``text`` is the call's body so
        far (only what is surely part of it), its JSON starting at ``start``; ``name``:
        the function, when the syntax gave it before the JSON (Mistral's ``[ARGS]``)."""
        if self._no_stream or self.done:
            return
        if not self._announced:
            if name is not None:
                head = len(text) - len(text[start:].lstrip())
                if head == len(text):
                    return
                if text[head] != "{":
                    self._no_stream = True
                    return
                at = head
            else:
                match = _CALL_HEAD.match(text, start)
                if match is None:
                    # The arguments opened but not right after the name: buffered.
                    self._no_stream = _ARGS_KEY.search(text, start) is not None
                    return
                name, at = _loads(f'"{match.group(1)}"'), match.end()
                if not isinstance(name, str) or not name:
                    self._no_stream = True
                    return
            self._announced = True
            self._args_pos, self._args_end = at, JsonEnd()
            out.append(ToolCallDelta(self._calls, self._new_id(), name, ""))
        ends = self._args_end
        if ends is None or self._args_pos >= len(text):
            return
        new = text[self._args_pos :]
        end = ends.feed(new)
        if end >= 0:
            new, self._args_end = new[:end], None
        self._args_pos += len(new)
        if new:
            out.append(ToolCallDelta(self._calls, None, None, new))

    def _end_streamed_call(self) -> None:
        """The announced call ended (well-formed or not): it stands as sent."""
        self._calls += 1
        self._announced = False
        self._in_body = False
        self._stash = self._body = self._ws = ""
        self._after_call = True

    @abstractmethod
    def _feed_body(self, text: str, out: list[Piece]) -> str:
        """Buffer a call's body; returns the text after the call once it ended."""

    def _flush_body(self, out: list[Piece]) -> None:
        """The choice ended inside a call body: by default it is released as content."""
        self._release(self._body, out)

    def _release(self, raw: str, out: list[Piece]) -> None:
        """A malformed call: what opened it and its raw text go out as content (one
        already announced stands, with the arguments sent)."""
        if self._announced:
            self._end_streamed_call()
            return
        self._in_body = False
        stash, self._stash, self._body = self._stash, "", ""
        logger.debug("malformed %s tool call released as content", self.name)
        self._emit(stash + raw, out)

    def _emit_calls(self, calls: list[tuple[str, str]], out: list[Piece]) -> None:
        if self._announced:  # its name and arguments are out already
            self._end_streamed_call()
            return
        if self.max_calls is not None:
            calls = calls[: max(self.max_calls - self._calls, 0)]
        for name, arguments in calls:
            index = self._calls
            self._calls += 1
            out.append(ToolCallDelta(index, self._new_id(), name, ""))
            out.append(ToolCallDelta(index, None, None, arguments))
        self._in_body = False
        self._stash = self._body = self._ws = ""
        self._after_call = True


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen, SmolLM).

    A call the model leaves unclosed at the end (EOS right after the JSON) still counts
    when its JSON is a complete call, as vLLM's Hermes parser does."""

    name = "hermes"
    start_tag = "<tool_call>"
    end_tag: ClassVar[str] = "</tool_call>"
    __slots__ = ()

    def _feed_body(self, text: str, out: list[Piece]) -> str:
        end = self.end_tag
        searched = max(len(self._body) - len(end) + 1, 0)
        body = self._body = self._body + text
        at = body.find(end, searched)
        if at < 0:
            # What may be the start of the closing tag is held back.
            held = len(body) - len(end) + 1
            self._stream_args(body[: max(held, 0)], 0, out)
            return ""
        self._stream_args(body[:at], 0, out)
        self._finish(body[:at], body[: at + len(end)], out)
        return body[at + len(end) :]

    def _flush_body(self, out: list[Piece]) -> None:
        self._stream_args(self._body, 0, out)
        self._finish(self._body, self._body, out)

    def _finish(self, json_text: str, raw: str, out: list[Piece]) -> None:
        call = call_from(_loads(json_text))
        if call is None:
            self._release(raw, out)
        else:
            self._emit_calls([call], out)


class _JsonBodyParser(ToolCallParser):
    """A call body that is one JSON value right after the tag (whitespace allowed)."""

    _opens: ClassVar[str] = "{["
    __slots__ = ("_json", "_json_at")

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._json = JsonEnd()
        self._json_at = -1  # where the JSON starts in the body; -1: not yet

    def _open_body(self, stash: str) -> None:
        super()._open_body(stash)
        self._json = JsonEnd()
        self._json_at = -1

    def _feed_json(self, text: str, out: list[Piece], opens: str) -> str:
        if self._json_at < 0:
            value = text.lstrip()
            self._body += text[: len(text) - len(value)]
            if not value:
                return ""
            if value[0] not in opens:
                self._release(self._body, out)
                return value
            self._json_at = len(self._body)
            text = value
        end = self._json.feed(text)
        name = self._named()
        if end < 0:
            self._body += text
            self._stream_args(self._body, self._json_at, out, name=name)
            return ""
        raw = self._body + text[:end]
        self._stream_args(raw, self._json_at, out, name=name)
        calls = self._calls_in(raw[self._json_at :])
        if calls:
            self._emit_calls(calls, out)
        else:
            self._release(raw, out)
        return text[end:]

    def _named(self) -> str | None:
        """The function, when the syntax names it before the JSON (else the JSON does)."""
        return None

    @abstractmethod
    def _calls_in(self, json_text: str) -> list[tuple[str, str]] | None:
        """The calls a complete JSON body holds, or None when it is malformed."""


class Llama3JsonParser(_JsonBodyParser):
    """``<|python_tag|>{"name": ..., "parameters": {...}}``, or an output that is a JSON
    call itself (Llama 3.1+ JSON tool calling); calls may follow each other after ``;``.

    A bare object only counts as a call at the start of the output or right after a
    call, and only with ``parameters``/``arguments``: an answer that happens to be JSON
    with a ``name`` stays content."""

    name = "llama3_json"
    start_tag = "<|python_tag|>"
    special_tags = True
    _separator = _SPACE_OR_SEMICOLON
    __slots__ = ("_bare", "_may_bare")

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._may_bare = True  # a bare JSON call may start here
        self._bare = False  # the open body has no tag

    def feed(self, text: str) -> list[Piece]:
        # While a bare JSON call may start, every text needs the full scan.
        return self._scan(text) if self._may_bare else super().feed(text)

    def _feed_content(self, text: str, out: list[Piece]) -> str:
        if self._may_bare:
            pattern = self._separator if self._after_call else _SPACE
            skip = _skip(pattern, text)
            if skip == len(text):
                self._emit(text, out)
                return ""
            self._may_bare = False
            if text[skip] == "{":
                stash = "" if self._after_call else self._ws + text[:skip]
                self._ws = ""
                self._open_body(stash)
                self._bare = True
                return text[skip:]
        return super()._feed_content(text, out)

    def _open_body(self, stash: str) -> None:
        super()._open_body(stash)
        self._bare = False

    def _feed_body(self, text: str, out: list[Piece]) -> str:
        return self._feed_json(text, out, "{")

    def _calls_in(self, json_text: str) -> list[tuple[str, str]] | None:
        call = call_from(_loads(json_text), require_arguments=self._bare)
        return [call] if call else None

    def _emit_calls(self, calls: list[tuple[str, str]], out: list[Piece]) -> None:
        super()._emit_calls(calls, out)
        self._may_bare = True


class MistralParser(_JsonBodyParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (one block, parallel
    calls in the array), a single object after the tag, or the newer
    ``[TOOL_CALLS]name[ARGS]{...}`` (one tag per call)."""

    name = "mistral"
    start_tag = "[TOOL_CALLS]"
    special_tags = True
    args_tag: ClassVar[str] = "[ARGS]"
    __slots__ = ("_function", "_name_at")

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._name_at = -1  # where ``name[ARGS]`` starts in the body; -1: not that form
        self._function: str | None = None

    def _open_body(self, stash: str) -> None:
        super()._open_body(stash)
        self._name_at = -1
        self._function = None

    def _feed_body(self, text: str, out: list[Piece]) -> str:
        if self._function is None and self._json_at < 0:
            if self._name_at < 0:
                value = text.lstrip()
                if value and value[0] not in "{[" and _skip(_NAME_CHARS, value):
                    self._body += text[: len(text) - len(value)]
                    self._name_at = len(self._body)
                    text = value
            if self._name_at >= 0:
                return self._feed_name(text, out)
        return self._feed_json(text, out, "{" if self._function is not None else "{[")

    def _named(self) -> str | None:
        return self._function

    def _feed_name(self, text: str, out: list[Piece]) -> str:
        """``name[ARGS]``: the function's name, then its arguments object."""
        body = self._body = self._body + text
        name_part = body[self._name_at :]
        before, found, after = split_at_tag(name_part, self.args_tag)
        valid = _skip(_NAME_CHARS, before)
        if valid < len(before):
            # Not a name: release up to the offending character; the rest (maybe a held
            # "[AR" too) is scanned again as content.
            cut = self._name_at + valid
            self._release(body[:cut], out)
            return body[cut:]
        if not found:
            return ""
        self._function = before
        self._body = body[: len(body) - len(after)]
        return after

    def _calls_in(self, json_text: str) -> list[tuple[str, str]] | None:
        obj = _loads(json_text)
        if self._function is not None:
            if not isinstance(obj, dict):
                return None
            return [(self._function, json.dumps(obj, ensure_ascii=False))]
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def make_tool_parser(
    name: str, new_id: Callable[[], str] = new_call_id, *, max_calls: int | None = None
) -> ToolCallParser:
    """The tool-call parser called ``name`` (a model card's ``tool_call_parser``);
    ``max_calls``: at most that many calls (``parallel_tool_calls: false`` is 1)."""
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})") from None
    parser = cls(new_id)
    parser.max_calls = max_calls
    return parser
