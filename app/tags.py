"""Pieces of a choice's parsed output, and the tag search its parsers share (pure).

The reasoning parser (app.reasoning) and the tool-call parsers (app.toolcalls) turn a
choice's released text into pieces: ``Content`` (what the client sees as
``content``), ``Reasoning`` (``reasoning_content``) and ``ToolCallDelta`` fragments.
Like the Decoder with stop strings, they never release a partial tag: the longest
suffix of the text that could still grow into the tag they look for is held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from app.messages import ToolCallDelta

__all__ = ["Content", "Piece", "Reasoning", "split_at_tag"]


@dataclass(slots=True, frozen=True)
class Content:
    """Text the client gets as the message's ``content``."""

    text: str


@dataclass(slots=True, frozen=True)
class Reasoning:
    """Text of the model's thinking: the client gets it as ``reasoning_content``."""

    text: str


Piece: TypeAlias = Content | Reasoning | ToolCallDelta


def split_at_tag(window: str, tag: str) -> tuple[str, bool, str]:
    """Look for ``tag`` in ``window``.

    Found: ``(text before it, True, text after it)``. Not found: ``(text that can no
    longer be part of the tag, False, the longest suffix that is a proper prefix of the
    tag)`` -- the held-back part, exactly as the Decoder holds back stop strings.
    """
    at = window.find(tag)
    if at >= 0:
        return window[:at], True, window[at + len(tag) :]
    first = tag[0]
    i = window.find(first, max(len(window) - len(tag) + 1, 0))
    while i >= 0:
        if tag.startswith(window[i:]):
            return window[:i], False, window[i:]
        i = window.find(first, i + 1)
    return window, False, ""
