"""The wire codecs of token deltas and output events: every token and every relayed event
goes through them, so the common shapes take short paths; each shape must still come
back exactly as it went out."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.messages import (
    EngineFinish,
    FinishReason,
    OutputEvent,
    OutputKind,
    TokenDelta,
    TokenLogprob,
)
from broker.outputs import decode_events, encode_events, encode_text

EVENTS = [
    OutputEvent(OutputKind.DELTA, 0, "hello"),  # the short path: kind, choice, text
    OutputEvent(OutputKind.DELTA, 3, ""),
    OutputEvent(OutputKind.DELTA, 0, reasoning="thinking"),  # three keys, no text
    OutputEvent(OutputKind.DELTA, 1, "x", reasoning="y"),
    OutputEvent(OutputKind.FINAL, 0, finish_reason=FinishReason.STOP, stop_reason="###"),
    OutputEvent(OutputKind.FINAL, 0, finish_reason=FinishReason.LENGTH),  # three keys
    OutputEvent(OutputKind.USAGE, usage={"completion_tokens": 3}),
    OutputEvent(OutputKind.ERROR, error="boom", code=500),  # three keys, no choice
    OutputEvent(OutputKind.ERROR, 0, "", error="bad choice", code=500),
]


@pytest.mark.parametrize("event", EVENTS)
def test_an_output_event_comes_back_as_it_went(event: OutputEvent) -> None:
    assert OutputEvent.decode(event.encode()) == event


DELTAS = [
    TokenDelta(0, [1, 2, 3]),  # the short path: choice and ids
    TokenDelta(2, []),
    TokenDelta(0, [5], finish=EngineFinish.EOS),
    TokenDelta(0, [], finish=EngineFinish.ERROR, error="oops", error_code=400),
    TokenDelta(0, [7], cached_tokens=12),
    TokenDelta(1, [9], logprobs=[TokenLogprob(9, -0.5, [(9, -0.5)])]),
]


@pytest.mark.parametrize("delta", DELTAS)
def test_a_token_delta_comes_back_as_it_went(delta: TokenDelta) -> None:
    assert TokenDelta.decode(delta.encode()) == delta


@given(
    kind=st.sampled_from(list(OutputKind)),
    choice=st.none() | st.integers(0, 8),
    text=st.text(max_size=8),
    reasoning=st.text(max_size=4),
)
def test_any_text_event_comes_back_as_it_went(
    kind: OutputKind, choice: int | None, text: str, reasoning: str
) -> None:
    event = OutputEvent(kind, choice, text, reasoning=reasoning)
    assert OutputEvent.decode(event.encode()) == event


@pytest.mark.parametrize("raw", [{"k": "nope", "c": 0, "t": "x"}, {"c": 0, "t": "x", "x": 1}])
def test_a_malformed_event_raises(raw: dict[str, Any]) -> None:
    with pytest.raises(Exception):  # noqa: B017 - any error: the hub ends that request
        OutputEvent.decode(raw)


@given(text=st.text(min_size=1, max_size=12))
def test_a_text_chunk_is_the_events_codec_of_its_text_delta(text: str) -> None:
    """``encode_text`` (the streamer's plain chunk) writes what ``encode_events`` writes
    for the one text delta, and ``decode_events`` (with its short path) reads it back."""
    event = OutputEvent(OutputKind.DELTA, 0, text)
    assert encode_text(text) == encode_events([event])
    assert decode_events(encode_text(text)) == [event]


@given(
    events=st.lists(
        st.sampled_from(EVENTS)
        | st.builds(OutputEvent, st.just(OutputKind.DELTA), st.just(0), st.text(max_size=6)),
        min_size=1,
        max_size=4,
    )
)
def test_any_chunk_comes_back_as_it_went(events: list[OutputEvent]) -> None:
    """Chunks that start as a text chunk does (a text delta of choice 0) but hold more
    events, or end in ``}]``, take the general path, and come back whole."""
    raw = encode_events(events)
    assert decode_events(raw) == events
    assert decode_events(raw.decode()) == events
