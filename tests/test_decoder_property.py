"""Property test: the Decoder's streamed text equals the reference definition.

Reference: the text of tokens 1..``min_tokens`` bypasses the stops (as backend.rs); in
the rest of the full decoded text, for each stop string ``s`` take its first occurrence
``[i_s, e_s)``; the winner is the least ``(e_s, i_s)``; the output is ``text[:i_s]`` for
hidden stops and ``text[:e_s]`` for visible ones, or the whole text when nothing matches.
"""

from __future__ import annotations

from bisect import bisect_left

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from app.decoder import Decoder
from app.messages import EngineFinish, FinishReason
from app.records import StopConditions

PROMPT = "<|im_start|>user\nWrite.<|im_end|>\n<|im_start|>assistant\n"
CHARS = [*"ab <|>\n.,x", "é", "ß", "日", "本", "語", "😀", "🍕", "🎉"]
WORDS = ["hello", " world", " the", "日本語", "です", " 😀", "🍕🍕", " <|stop|>", "ab", "\n\n"]

texts = st.one_of(
    st.text(alphabet=st.sampled_from(CHARS), min_size=1, max_size=40),
    st.lists(st.sampled_from(WORDS + CHARS), min_size=1, max_size=16).map("".join),
)


def cumulative_text(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    """The decoded text after each token (complete characters only)."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    out, text = [], ""
    for i in ids:
        text += stream.step(tok, i) or ""
        out.append(text)
    return out


def reference(
    text: str, lengths: list[int], stops: list[str], hide: bool, min_tokens: int
) -> tuple[str, str | None, int]:
    """Expected (output, stop_reason, completion_tokens), by brute force on the full text."""
    floor = bypassed_chars(lengths, min_tokens, len(lengths))
    best: tuple[int, int, str] | None = None
    for s in stops:
        if not s:
            continue
        for i in range(floor, len(text) - len(s) + 1):
            if text.startswith(s, i):
                if best is None or (i + len(s), i) < best[:2]:
                    best = (i + len(s), i, s)
                break
    if best is None:
        return text, None, len(lengths)
    end, start, s = best
    # The completing token is the first one after which the text reaches ``end``.
    return (text[:start] if hide else text[:end]), s, bisect_left(lengths, end) + 1


def bypassed_chars(lengths: list[int], min_tokens: int, accepted: int) -> int:
    """How much of the text came from tokens 1..min_tokens (of ``accepted`` tokens):
    released at once, and never part of a stop string."""
    bypassed = min(min_tokens, accepted)
    return lengths[bypassed - 1] if bypassed else 0


def longest_pending_prefix(text: str, stops: list[str]) -> int:
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stops):
            return k
    return 0


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    text=texts,
    hide=st.booleans(),
    min_tokens=st.one_of(st.just(0), st.integers(0, 6)),
)
def test_streamed_text_equals_reference(
    smollm_tokenizer: Tokenizer, data: st.DataObject, text: str, hide: bool, min_tokens: int
) -> None:
    tok = smollm_tokenizer
    prompt = tok.encode(PROMPT).ids
    ids = tok.encode(text).ids
    so_far = cumulative_text(tok, prompt, ids)
    assert (so_far[-1] if so_far else "") == text  # byte-level BPE round-trips exactly

    substring = st.tuples(st.integers(0, len(text)), st.integers(1, 6)).map(
        lambda t: text[t[0] : t[0] + t[1]]
    )
    stops = data.draw(
        st.lists(
            st.one_of(substring, substring, st.text(st.sampled_from(CHARS), max_size=4)),
            max_size=4,
        ),
        label="stops",
    )
    # Step sizes from one token at a time to all at once.
    every = st.integers(1, max(len(ids) - 1, 1))
    if data.draw(st.booleans(), label="one token at a time"):
        cuts = list(range(1, len(ids)))
    else:
        cuts = sorted(data.draw(st.sets(every, max_size=len(ids)), label="cuts"))
    steps = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]

    stop = StopConditions(
        stop=tuple(stops), include_stop_str_in_output=not hide, min_tokens=min_tokens
    )
    dec = Decoder(tok, prompt, stop)
    lengths = [len(t) for t in so_far]
    released = ""
    live = [s for s in stops if s]
    for step in steps:
        released += dec.step(step)
        if dec.done:
            break
        decoded = so_far[dec.completion_tokens - 1] if dec.completion_tokens else ""
        # Never ahead of the text, and only what could still become a stop is withheld
        # (never text of tokens 1..min_tokens).
        floor = bypassed_chars(lengths, min_tokens, dec.completion_tokens)
        held = longest_pending_prefix(decoded[floor:], live) if hide else 0
        assert released == decoded[: len(decoded) - held]
    if not dec.done:
        released += dec.finish(EngineFinish.LENGTH)

    expected, reason, tokens = reference(text, lengths, stops, hide, min_tokens)
    event(f"stopped by a stop string: {reason is not None}, hidden: {hide}")
    event(f"steps: {min(len(steps), 3)}{'+' if len(steps) > 3 else ''}")
    assert released == expected
    assert dec.stop_reason == reason
    assert dec.finish_reason is (FinishReason.STOP if reason else FinishReason.LENGTH)
    assert dec.completion_tokens == tokens
