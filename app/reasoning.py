"""Reasoning parsers: split a choice's text into thinking and answer (pure, incremental).

Models that think in tags (DeepSeek-R1, Qwen3, QwQ, SmolLM3: ``<think>...</think>``)
write their reasoning first; vLLM and DeepSeek's API send it apart, as
``reasoning_content``. A ``ThinkParser`` does that per choice on the Decoder's released
text, holding back a possible partial tag exactly as stop strings are held back, so a
client never sees ``</thi`` as content.

Rules (as llama.cpp's ``reasoning_format``): the block counts only at the start of the
output (leading whitespace allowed); once closed, everything after is content. Some
templates open the block in the prompt (DeepSeek-R1's ends with ``<think>\\n``): then
the output starts inside it (``start_in_reasoning``; ``prompt_opens_block`` detects it
from the prompt's tail), and an open tag the model writes again anyway is dropped.
Whitespace right after either tag is dropped, so neither the reasoning nor the answer
starts with the template's newlines. A block the model never
closes (cut by ``max_tokens``) stays reasoning.
"""

from __future__ import annotations

from enum import Enum

from app.tags import Content, Piece, Reasoning, split_at_tag

__all__ = ["REASONING_PARSERS", "ThinkParser", "make_reasoning_parser", "prompt_opens_block"]

# name -> (open tag, close tag); the model card's ``reasoning_parser`` picks one.
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "think": ("<think>", "</think>"),  # DeepSeek-R1, Qwen3, QwQ, SmolLM3, ...
    "seed_think": ("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
}


class _State(Enum):
    START = "start"  # nothing but whitespace (and maybe part of the open tag) seen yet
    REASONING = "reasoning"
    AFTER = "after"  # just past the close tag: leading whitespace is dropped
    CONTENT = "content"  # pass-through


class ThinkParser:
    """One choice's reasoning splitter: ``feed(text) -> pieces``, ``flush() -> pieces``."""

    __slots__ = ("_close", "_entered", "_fresh", "_held", "_open", "_state")

    def __init__(
        self,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
        *,
        start_in_reasoning: bool = False,
    ) -> None:
        if not open_tag or not close_tag:
            raise ValueError("reasoning tags must not be empty")
        self._open = open_tag
        self._close = close_tag
        # Even when the template opened the block, the output may repeat the open tag:
        # START drops it then.
        self._state = _State.START
        self._entered = start_in_reasoning
        self._held = ""
        # True until the first non-whitespace reasoning character: leading whitespace of
        # the reasoning is dropped.
        self._fresh = True

    @property
    def in_reasoning(self) -> bool:
        """Inside the think block now (what ``reasoning_tokens`` counts)."""
        state = self._state
        return state is _State.REASONING or (state is _State.START and self._entered)

    @property
    def entered(self) -> bool:
        """The output has (or had) a think block."""
        return self._entered

    @property
    def passthrough(self) -> bool:
        """Past the block (or there was none): every later text is content as it is."""
        return self._state is _State.CONTENT

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self._state is _State.CONTENT:
            if text:
                out.append(Content(text))
            return out
        if self._state is _State.START:
            text = self._start(text, out)
        if self._state is _State.REASONING and text:
            text = self._reasoning(text, out)
        if self._state is _State.AFTER and text:
            text = text.lstrip()
            if text:
                self._state = _State.CONTENT
                out.append(Content(text))
        return out

    def flush(self) -> list[Piece]:
        """The choice ended: release what was held back (a partial tag is just text)."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self._state is _State.START and not self._entered:
            self._state = _State.CONTENT
            return [Content(held)]
        if self._fresh:
            held = held.lstrip()
        return [Reasoning(held)] if held else []

    def _start(self, text: str, out: list[Piece]) -> str:
        """Before anything but whitespace: is this output a think block? Returns the
        text left for the next state."""
        window = self._held + text
        rest = window.lstrip()
        if not rest or (len(rest) < len(self._open) and self._open.startswith(rest)):
            self._held = window  # whitespace, or the open tag's beginning: not yet known
            return ""
        self._held = ""
        if rest.startswith(self._open):
            self._state = _State.REASONING
            self._entered = True
            return rest[len(self._open) :]
        if self._entered:  # the template opened the block: this is reasoning already
            self._state = _State.REASONING
            return window
        self._state = _State.CONTENT
        out.append(Content(window))
        return ""

    def _reasoning(self, text: str, out: list[Piece]) -> str:
        before, found, after = split_at_tag(self._held + text, self._close)
        if self._fresh:
            before = before.lstrip()
            if before:
                self._fresh = False
        if before:
            out.append(Reasoning(before))
        if found:
            self._held = ""
            self._state = _State.AFTER
            return after
        self._held = after
        return ""


def prompt_opens_block(prompt_tail: str, name: str) -> bool:
    """Whether the rendered prompt ends inside an open think block (the template opened
    it for the model, as DeepSeek-R1's does), so the output starts in reasoning."""
    open_tag, close_tag = REASONING_PARSERS[name]
    return prompt_tail.rfind(open_tag) > prompt_tail.rfind(close_tag)


def make_reasoning_parser(name: str, *, start_in_reasoning: bool = False) -> ThinkParser:
    """The reasoning parser called ``name`` (a model card's ``reasoning_parser``)."""
    try:
        open_tag, close_tag = REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})") from None
    return ThinkParser(open_tag, close_tag, start_in_reasoning=start_in_reasoning)
