"""One choice's text after the Decoder: reasoning, then tool calls (pure, incremental).

The RequestDecoder keeps one ``ChoiceParser`` per choice when the request has a
reasoning parser or parses tool calls. The Decoder's released text (stop strings
already applied) goes through the reasoning parser first, whose content then goes
through the tool-call parser; what comes out is the DELTA's ``text``, ``reasoning``
and ``tool_calls``.
"""

from __future__ import annotations

from collections.abc import Callable

from app.messages import ToolCallDelta
from app.reasoning import ThinkParser, make_reasoning_parser
from app.tags import Content, Piece, Reasoning
from app.toolcalls import ToolCallParser, make_tool_parser, new_call_id

__all__ = ["ChoiceParser", "Parsed"]

# (content, reasoning, tool-call fragments or None)
Parsed = tuple[str, str, list[ToolCallDelta] | None]


class ChoiceParser:
    """Reasoning and tool-call parsing of one choice, and its reasoning token count."""

    __slots__ = ("_reasoning", "_tools", "reasoning_tokens")

    def __init__(
        self,
        *,
        reasoning_parser: str | None = None,
        start_in_reasoning: bool = False,
        tool_parser: str | None = None,
        new_id: Callable[[], str] = new_call_id,
        max_tool_calls: int | None = None,
    ) -> None:
        self._reasoning: ThinkParser | None = (
            make_reasoning_parser(reasoning_parser, start_in_reasoning=start_in_reasoning)
            if reasoning_parser
            else None
        )
        self._tools: ToolCallParser | None = (
            make_tool_parser(tool_parser, new_id, max_calls=max_tool_calls) if tool_parser else None
        )
        # Tokens fed while inside the think block (those that open and close it too):
        # usage's ``completion_tokens_details.reasoning_tokens``.
        self.reasoning_tokens = 0

    @property
    def calls(self) -> int:
        """Tool calls made so far (a choice that made any ends with ``tool_calls``)."""
        return self._tools.calls if self._tools is not None else 0

    def feed(self, text: str, tokens: int) -> Parsed:
        """The Decoder released ``text`` for ``tokens`` accepted tokens."""
        reasoning = self._reasoning
        if reasoning is None or reasoning.passthrough:
            # Past the think block (or none): only the tool parser, if any, is left.
            tools = self._tools
            if tools is None or not text:
                return text, "", None
            content, calls = _collect(tools.feed(text), "", None)
            return content, "", calls
        # Tokens fed inside the block, or that opened or closed it, count as reasoning.
        was_inside, had_block = reasoning.in_reasoning, reasoning.entered
        pieces = reasoning.feed(text) if text else []
        if was_inside or reasoning.in_reasoning or had_block is not reasoning.entered:
            self.reasoning_tokens += tokens
        return self._route(pieces, final=False)

    def flush(self) -> Parsed:
        """The choice ended: release everything held back."""
        pieces = self._reasoning.flush() if self._reasoning is not None else []
        return self._route(pieces, final=True)

    def _route(self, pieces: list[Piece], *, final: bool) -> Parsed:
        content = reasoning = ""
        calls: list[ToolCallDelta] | None = None
        tools = self._tools
        for piece in pieces:
            if isinstance(piece, Reasoning):
                reasoning += piece.text
            elif isinstance(piece, Content):
                if tools is None:
                    content += piece.text
                else:
                    content, calls = _collect(tools.feed(piece.text), content, calls)
        if final and tools is not None:
            content, calls = _collect(tools.flush(), content, calls)
        return content, reasoning, calls


def _collect(
    pieces: list[Piece], content: str, calls: list[ToolCallDelta] | None
) -> tuple[str, list[ToolCallDelta] | None]:
    for piece in pieces:
        if isinstance(piece, ToolCallDelta):
            if calls is None:
                calls = []
            calls.append(piece)
        elif isinstance(piece, Content):
            content += piece.text
    return content, calls
