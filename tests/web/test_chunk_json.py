"""``ChunkStream.feed_json`` writes plain text deltas from a template: its bytes must be
exactly the models' own JSON for every text, every shape and every event kind."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from app.intake import ResponseShape
from app.messages import FinishReason, LogprobEntry, OutputEvent, OutputKind, ToolCallDelta
from web.responses import ChunkStream

# Any text the decoder can produce (no lone surrogates: the output stream is UTF-8).
TEXTS = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1)
HARD = [
    'quote " backslash \\ slash /',
    "\n\r\t\b\f\x00\x01\x1f\x7f",
    "\u2028\u2029\ufeff é ü 中文 🦀",
    "\ue000 the template's marker itself",
    "</script><!--",
]


def shapes(model: str = "smollm2") -> list[ResponseShape]:
    return [
        ResponseShape(chat=chat, response_id="r-1", model=model, created=1, num_choices=n,
                      logprobs=lp, include_usage=True)
        for chat in (True, False)
        for n in (1, 3)
        for lp in (False, True)
    ]  # fmt: skip


def both(shape: ResponseShape, events: list[OutputEvent]) -> tuple[list[str], list[str]]:
    fast, slow = ChunkStream(shape), ChunkStream(shape)
    a = [j for ev in events for j in fast.feed_json(ev)]
    b = [c.to_json() for ev in events for c in slow.feed(ev)]
    return a, b


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, choice=st.integers(0, 2))
def test_a_text_delta_is_the_models_json(text: str, choice: int) -> None:
    for shape in shapes():
        index = min(choice, shape.num_choices - 1)
        a, b = both(shape, [OutputEvent(OutputKind.DELTA, choice=index, text=text)])
        assert a == b


def test_hard_texts_and_every_other_event_are_the_models_json() -> None:
    entry = LogprobEntry(
        token_id=7, text="a", logprob=-0.5, bytes=[97], top=[("a", -0.5), ("b", -1.5)]
    )
    events = [
        *(OutputEvent(OutputKind.DELTA, choice=0, text=t) for t in HARD),
        OutputEvent(OutputKind.DELTA, choice=0, text="a", logprobs=[entry]),
        OutputEvent(OutputKind.DELTA, choice=0, text="b", logprobs=[entry]),
        OutputEvent(OutputKind.DELTA, choice=0, reasoning="think"),
        OutputEvent(
            OutputKind.DELTA,
            choice=0,
            tool_calls=[ToolCallDelta(index=0, id="call_1", name="f", arguments="{")],
        ),
        OutputEvent(OutputKind.DELTA, choice=0, text="and text", reasoning="and thought"),
        OutputEvent(OutputKind.FINAL, choice=0, finish_reason=FinishReason.STOP, stop_reason="x"),
        OutputEvent(OutputKind.DELTA, choice=None, text="choice None is choice 0"),
        OutputEvent(OutputKind.USAGE, usage={"prompt_tokens": 1, "completion_tokens": 2}),
        OutputEvent(OutputKind.DELTA, choice=0, text="after the end: nothing"),
    ]
    for shape in [*shapes(), *shapes(model='a "quoted" \ue000 model')]:
        a, b = both(shape, events)
        assert a == b
        assert len(a) >= len(HARD) + 4


def test_after_an_error_nothing_more() -> None:
    for shape in shapes():
        a, b = both(
            shape,
            [
                OutputEvent(OutputKind.DELTA, choice=0, text="x"),
                OutputEvent(OutputKind.ERROR, error="boom", code=500),
                OutputEvent(OutputKind.DELTA, choice=0, text="y"),
            ],
        )
        assert a == b and len(a) == 1
