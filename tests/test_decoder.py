"""Decoder and RequestDecoder rules, each checked with the real SmolLM2 tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer

from app.decoder import Decoder, RequestDecoder, TokenTexts
from app.messages import (
    EngineFinish,
    FinishReason,
    OutputEvent,
    OutputKind,
    TokenDelta,
    TokenLogprob,
)
from app.records import StopConditions

EOS = 2  # <|im_end|>
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def prompt_ids(tok: Tokenizer) -> list[int]:
    return ids_of(tok, PROMPT)


def new_decoder(tok: Tokenizer, stop: StopConditions, **kwargs: bool) -> Decoder:
    return Decoder(tok, prompt_ids(tok), stop, **kwargs)


def one_by_one(dec: Decoder, ids: Sequence[int]) -> list[str]:
    return [dec.step([i]) for i in ids]


def texts_by_choice(events: list[OutputEvent]) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        if e.kind is OutputKind.DELTA:
            assert e.choice is not None
            out[e.choice] = out.get(e.choice, "") + e.text
    return out


# 1. Incremental detokenization


def test_emoji_and_cjk_split_across_tokens_yield_whole_characters(
    smollm_tokenizer: Tokenizer,
) -> None:
    text = "I love 🍕 and 日本語!"
    ids = ids_of(smollm_tokenizer, text)
    dec = new_decoder(smollm_tokenizer, StopConditions())
    pieces = one_by_one(dec, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # ' 🍕' is three tokens: the first two end mid character and release nothing.
    mid = [k for k in range(len(ids)) if smollm_tokenizer.decode(ids[: k + 1]).endswith("\ufffd")]
    assert len(mid) >= 4, "the text should split characters across tokens"
    assert all(pieces[k] == "" for k in mid)
    assert " 🍕" in pieces
    assert dec.completion_tokens == len(ids)


def test_prompt_prefill_keeps_leading_space_and_survives_a_cut_character(
    smollm_tokenizer: Tokenizer,
) -> None:
    # A long prompt is cut to its tail for the stream, here in the middle of an emoji.
    prompt = ids_of(smollm_tokenizer, "🍕" * 20 + "Hello")
    dec = Decoder(smollm_tokenizer, prompt, StopConditions())
    assert one_by_one(dec, ids_of(smollm_tokenizer, " world 😀")) == [" world", "", " 😀"]


def test_request_never_emits_an_empty_delta(smollm_tokenizer: Tokenizer) -> None:
    ids = ids_of(smollm_tokenizer, "Hi 😀")
    req = RequestDecoder(smollm_tokenizer, prompt_ids(smollm_tokenizer), StopConditions())
    events = [e for i in ids for e in req.feed(TokenDelta(0, [i]))]
    assert [e.text for e in events] == ["Hi", " 😀"]


# 2. min_tokens (as backend.rs: "below" is decided before the token is counted, so
# tokens 1..min_tokens bypass every stop and token min_tokens+1 is the first that stops)


def test_stop_string_applies_from_the_token_after_min_tokens(
    smollm_tokenizer: Tokenizer,
) -> None:
    ids = ids_of(smollm_tokenizer, "a b a b a b a b")  # one token per letter
    assert len(ids) == 8
    results = {}
    for min_tokens in (0, 1, 2, 3, 4, 5):
        dec = new_decoder(smollm_tokenizer, StopConditions(stop=("b",), min_tokens=min_tokens))
        results[min_tokens] = ("".join(one_by_one(dec, ids)), dec.completion_tokens)
        assert dec.stop_reason == "b"
    assert results == {
        0: ("a ", 2),
        1: ("a ", 2),  # token 2 is the first that can stop
        2: ("a b a ", 4),
        3: ("a b a ", 4),
        4: ("a b a b a ", 6),  # the " b" of token 4 bypasses the stop
        5: ("a b a b a ", 6),
    }


@pytest.mark.parametrize(
    ("min_tokens", "hide", "expected", "tokens"),
    [
        (0, True, "", 3),
        (2, True, "a b ", 5),
        # "a b a" is completed by token 3, but tokens 1..3 bypass the stop and their
        # text never becomes part of a match: the next match is tokens 5..7.
        (3, True, "a b a b ", 7),
        (4, True, "a b a b ", 7),
        (3, False, "a b a b a b a", 7),
    ],
)
def test_text_up_to_min_tokens_is_never_part_of_a_stop_string(
    smollm_tokenizer: Tokenizer, min_tokens: int, hide: bool, expected: str, tokens: int
) -> None:
    ids = ids_of(smollm_tokenizer, "a b a b a b a b")
    stop = StopConditions(
        stop=("a b a",), min_tokens=min_tokens, include_stop_str_in_output=not hide
    )
    dec = new_decoder(smollm_tokenizer, stop)
    assert "".join(one_by_one(dec, ids)) == expected
    assert (dec.completion_tokens, dec.stop_reason) == (tokens, "a b a")


def test_text_up_to_min_tokens_is_released_at_once(smollm_tokenizer: Tokenizer) -> None:
    ids = ids_of(smollm_tokenizer, "a b a b")
    # Without min_tokens "a" is withheld: it could become "a b a".
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("a b a",)))
    assert one_by_one(dec, ids[:2]) == ["", ""]
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("a b a",), min_tokens=2))
    assert one_by_one(dec, ids) == ["a", " b", " ", ""]
    assert dec.finish(EngineFinish.LENGTH) == "a b"  # withheld from token 3 on
    assert dec.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(("skip", "shown"), [(True, ""), (False, "<|im_end|>")])
def test_eos_and_stop_ids_up_to_min_tokens_are_just_tokens(
    smollm_tokenizer: Tokenizer, skip: bool, shown: str
) -> None:
    hello, world = ids_of(smollm_tokenizer, "Hello"), ids_of(smollm_tokenizer, " world")
    assert len(hello) == len(world) == 1
    ids = [*hello, EOS, *world, EOS, *world]
    # EOS is also a user stop id here: the user's id is reported when it stops.
    stop = StopConditions(eos_token_ids=(EOS,), stop_token_ids=(EOS,), min_tokens=4)
    dec = new_decoder(smollm_tokenizer, stop, skip_special_tokens=skip)
    # Token 4 (an EOS) is still below min_tokens=4: it is text, and the choice goes on.
    assert "".join(one_by_one(dec, ids)) == f"Hello{shown} world{shown} world"
    assert not dec.done and dec.completion_tokens == 5
    stop = StopConditions(eos_token_ids=(EOS,), stop_token_ids=(EOS,), min_tokens=3)
    dec = new_decoder(smollm_tokenizer, stop, skip_special_tokens=skip)
    assert "".join(one_by_one(dec, ids)) == f"Hello{shown} world"
    assert (dec.finish_reason, dec.stop_reason, dec.completion_tokens) == (
        FinishReason.STOP,
        EOS,
        4,
    )


# 3. Stop token ids


def test_eos_ends_the_choice_silently(smollm_tokenizer: Tokenizer) -> None:
    ids = [*ids_of(smollm_tokenizer, "Hello world"), EOS, *ids_of(smollm_tokenizer, " more")]
    dec = new_decoder(smollm_tokenizer, StopConditions(eos_token_ids=(EOS,)))
    assert "".join(one_by_one(dec, ids)) == "Hello world"
    assert dec.done
    assert (dec.finish_reason, dec.stop_reason, dec.completion_tokens) == (
        FinishReason.STOP,
        None,
        3,
    )


def test_ignore_eos_keeps_going(smollm_tokenizer: Tokenizer) -> None:
    ids = [*ids_of(smollm_tokenizer, "Hello"), EOS, *ids_of(smollm_tokenizer, " world")]
    dec = new_decoder(smollm_tokenizer, StopConditions(eos_token_ids=(EOS,), ignore_eos=True))
    assert "".join(one_by_one(dec, ids)) == "Hello world"
    assert not dec.done


def test_user_stop_token_id_is_hidden_and_reported(smollm_tokenizer: Tokenizer) -> None:
    ids = ids_of(smollm_tokenizer, "Hello world, how are you today?")
    how = ids[3]
    assert smollm_tokenizer.decode([how]) == " how"
    dec = new_decoder(smollm_tokenizer, StopConditions(stop_token_ids=(how,)))
    assert dec.step(ids) == "Hello world,"
    assert (dec.finish_reason, dec.stop_reason, dec.completion_tokens) == (
        FinishReason.STOP,
        how,
        4,
    )


# 4. Stop strings


def test_hidden_stop_string_spanning_three_tokens(smollm_tokenizer: Tokenizer) -> None:
    ids = ids_of(smollm_tokenizer, "Hello world, how are you today?")
    assert [smollm_tokenizer.decode([i]) for i in ids[1:4]] == [" world", ",", " how"]
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("world, how",)))
    # "world" and "world," could still become the stop: withheld, not released.
    assert one_by_one(dec, ids) == ["Hello", " ", "", "", "", "", "", ""]
    assert (dec.finish_reason, dec.stop_reason, dec.completion_tokens) == (
        FinishReason.STOP,
        "world, how",
        4,
    )


def test_withheld_text_is_released_once_it_cannot_be_a_stop(
    smollm_tokenizer: Tokenizer,
) -> None:
    ids = ids_of(smollm_tokenizer, "The end <|stop> more")
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("<|stop|>",)))
    pieces = one_by_one(dec, ids)
    assert "".join(pieces) == "The end <|stop> more"
    assert pieces[:3] == ["The", " end", " "]  # "<" is withheld...
    assert pieces[-1].endswith(" more")  # ...and released once it cannot match
    assert not dec.done


def test_stop_string_inside_multibyte_characters(smollm_tokenizer: Tokenizer) -> None:
    text = "日本語です。東京"
    ids = ids_of(smollm_tokenizer, text)
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("語で",)))
    pieces = one_by_one(dec, ids)
    assert "".join(pieces) == "日本"
    assert dec.stop_reason == "語で"
    # The stop completes with the last byte of 'で', not earlier.
    assert smollm_tokenizer.decode(ids[: dec.completion_tokens]) == "日本語で"

    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("🍕",)))
    assert "".join(one_by_one(dec, ids_of(smollm_tokenizer, "I love 🍕 and 🎉!"))) == "I love "
    assert dec.completion_tokens == 5


def test_near_miss_inside_multibyte_characters_is_released(
    smollm_tokenizer: Tokenizer,
) -> None:
    text = "日本語です。東京"
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("語X", "京都")))
    pieces = one_by_one(dec, ids_of(smollm_tokenizer, text))
    assert "".join(pieces) == "日本語です。東"
    assert dec.finish(EngineFinish.EOS) == "京"
    assert (dec.finish_reason, dec.stop_reason) == (FinishReason.STOP, None)


@pytest.mark.parametrize(
    ("stops", "expected", "reason"),
    [
        (("bar", "obar"), "xyz fo", "obar"),  # same end: the earlier start wins
        (("obar", "bar"), "xyz fo", "obar"),
        (("ba", "oob"), "xyz f", "oob"),  # both complete in 'bar': the earlier end wins
        (("ba", "oob", "xyz foobar baz"), "xyz f", "oob"),
    ],
)
def test_two_stop_strings_completing_in_the_same_token(
    smollm_tokenizer: Tokenizer, stops: tuple[str, ...], expected: str, reason: str
) -> None:
    ids = ids_of(smollm_tokenizer, "xyz foobar baz")
    assert [smollm_tokenizer.decode([i]) for i in ids[:3]] == ["xyz", " foo", "bar"]
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=stops))
    assert "".join(one_by_one(dec, ids)) == expected
    assert (dec.stop_reason, dec.completion_tokens) == (reason, 3)


def test_include_stop_str_in_output(smollm_tokenizer: Tokenizer) -> None:
    ids = ids_of(smollm_tokenizer, "Hello world, how are you today?")
    visible = StopConditions(stop=("wor",), include_stop_str_in_output=True)
    dec = new_decoder(smollm_tokenizer, visible)
    # Nothing beyond the match end is released, even within the stopping token.
    assert one_by_one(dec, ids) == ["Hello", " wor", "", "", "", "", "", ""]
    assert (dec.stop_reason, dec.completion_tokens) == ("wor", 2)

    spanning = StopConditions(stop=("world, how",), include_stop_str_in_output=True)
    dec = new_decoder(smollm_tokenizer, spanning)
    assert one_by_one(dec, ids)[:4] == ["Hello", " world", ",", " how"]
    assert dec.stop_reason == "world, how"


def test_empty_stop_strings_are_ignored(smollm_tokenizer: Tokenizer) -> None:
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("",)))
    assert dec.step(ids_of(smollm_tokenizer, "Hello")) == "Hello"
    assert not dec.done


# 5. Engine finishes


def test_eos_token_flushes_withheld_text(smollm_tokenizer: Tokenizer) -> None:
    ids = [*ids_of(smollm_tokenizer, "x <|st"), EOS]
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("<|stop|>",), eos_token_ids=(EOS,)))
    pieces = one_by_one(dec, ids)
    assert pieces == ["x", " ", "", "", "<|st"]
    assert (dec.finish_reason, dec.stop_reason, dec.completion_tokens) == (
        FinishReason.STOP,
        None,
        5,
    )


@pytest.mark.parametrize(
    ("engine", "reason"),
    [
        (EngineFinish.EOS, FinishReason.STOP),
        (EngineFinish.LENGTH, FinishReason.LENGTH),
        (EngineFinish.CANCELLED, FinishReason.CANCELLED),
    ],
)
def test_engine_finish_flushes_withheld_text(
    smollm_tokenizer: Tokenizer, engine: EngineFinish, reason: FinishReason
) -> None:
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("<|stop|>",)))
    assert dec.step(ids_of(smollm_tokenizer, "x <|st")) == "x "
    assert dec.finish(engine) == "<|st"
    assert (dec.done, dec.finish_reason, dec.stop_reason, dec.error) == (
        True,
        reason,
        None,
        None,
    )
    assert dec.finish(EngineFinish.ERROR, "late") == ""  # already done
    assert dec.finish_reason is reason


def test_max_tokens_ends_with_length(smollm_tokenizer: Tokenizer) -> None:
    ids = ids_of(smollm_tokenizer, "x <|stop|> and more")
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("<|stop|>",), max_tokens=3))
    assert dec.step(ids) == "x <|"
    assert (dec.finish_reason, dec.completion_tokens) == (FinishReason.LENGTH, 3)


def test_error_finish_is_an_error_not_a_stop(smollm_tokenizer: Tokenizer) -> None:
    dec = new_decoder(smollm_tokenizer, StopConditions(stop=("<|stop|>",)))
    assert dec.step(ids_of(smollm_tokenizer, "x <|st")) == "x "
    assert dec.finish(EngineFinish.ERROR, "CUDA out of memory") == "<|st"
    assert (dec.finish_reason, dec.stop_reason, dec.error) == (
        FinishReason.ERROR,
        None,
        "CUDA out of memory",
    )
    dec = new_decoder(smollm_tokenizer, StopConditions())
    dec.finish(EngineFinish.ERROR)
    assert dec.finish_reason is FinishReason.ERROR
    assert dec.error


def test_request_error_event(smollm_tokenizer: Tokenizer) -> None:
    req = RequestDecoder(smollm_tokenizer, prompt_ids(smollm_tokenizer), StopConditions())
    events = req.feed(
        TokenDelta(0, ids_of(smollm_tokenizer, "Hi"), finish=EngineFinish.ERROR, error="boom")
    )
    assert [(e.kind, e.text, e.finish_reason, e.error) for e in events] == [
        (OutputKind.DELTA, "Hi", None, None),
        (OutputKind.FINAL, "", FinishReason.ERROR, "boom"),
    ]
    assert req.all_done


def test_tokens_after_done_are_ignored(smollm_tokenizer: Tokenizer) -> None:
    dec = new_decoder(smollm_tokenizer, StopConditions(eos_token_ids=(EOS,)))
    assert dec.step([*ids_of(smollm_tokenizer, "Hi"), EOS]) == "Hi"
    assert dec.step(ids_of(smollm_tokenizer, " more")) == ""
    assert dec.completion_tokens == 2
    req = RequestDecoder(smollm_tokenizer, prompt_ids(smollm_tokenizer), StopConditions())
    assert req.feed(TokenDelta(0, [EOS], finish=EngineFinish.EOS))[-1].kind is OutputKind.FINAL
    assert req.feed(TokenDelta(0, ids_of(smollm_tokenizer, " more"))) == []


# 6. Logprobs


def lp(token_id: int, top: list[tuple[int, float]] | None = None) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5, top or [])


def test_logprobs_align_with_tokens_and_carry_raw_bytes(smollm_tokenizer: Tokenizer) -> None:
    ids = [*ids_of(smollm_tokenizer, "I love 🍕"), EOS]
    hello = ids_of(smollm_tokenizer, "Hello")[0]
    req = RequestDecoder(
        smollm_tokenizer,
        prompt_ids(smollm_tokenizer),
        StopConditions(eos_token_ids=(EOS,)),
        logprobs=True,
    )
    events = []
    for i in ids:
        events += req.feed(TokenDelta(0, [i], logprobs=[lp(i, [(i, -0.5), (hello, -2.0)])]))
    deltas = [e for e in events if e.kind is OutputKind.DELTA]
    # Every token has its delta, the ones ending mid-character with logprobs and no text.
    assert len(deltas) == len(ids)
    entries = [entry for e in deltas for entry in e.logprobs or []]
    assert [e.token_id for e in entries] == ids
    assert [e.text for e in entries] == [
        smollm_tokenizer.decode([i], skip_special_tokens=True) for i in ids
    ]
    assert (entries[-1].text, entries[-1].bytes) == ("", [])  # skip_special_tokens
    assert entries[2].text.endswith("\ufffd")
    assert b"".join(bytes(e.bytes) for e in entries[2:5]) == " 🍕".encode()
    assert all(e.top[1] == ("Hello", -2.0) for e in entries)
    assert entries[0].top[0] == ("I", -0.5)
    assert [e.text for e in deltas] == ["I", " love", "", "", " 🍕", ""]
    assert events[-1].finish_reason is FinishReason.STOP


def test_tokens_after_a_stop_are_dropped_with_their_logprobs(
    smollm_tokenizer: Tokenizer,
) -> None:
    ids = ids_of(smollm_tokenizer, "Hello world, how are you today?")
    req = RequestDecoder(
        smollm_tokenizer, prompt_ids(smollm_tokenizer), StopConditions(stop=("how",)), logprobs=True
    )
    events = req.feed(TokenDelta(0, ids, logprobs=[lp(i) for i in ids]))
    delta, final = events
    assert delta.text == "Hello world, "
    assert [e.token_id for e in delta.logprobs or []] == ids[:4]
    assert (final.finish_reason, final.stop_reason) == (FinishReason.STOP, "how")
    assert req.usage["completion_tokens"] == 4
    assert req.all_done


def test_logprobs_not_asked_are_not_sent(smollm_tokenizer: Tokenizer) -> None:
    ids = ids_of(smollm_tokenizer, "Hello")
    req = RequestDecoder(smollm_tokenizer, prompt_ids(smollm_tokenizer), StopConditions())
    (event,) = req.feed(TokenDelta(0, ids, logprobs=[lp(i) for i in ids]))
    assert event.logprobs is None


def test_misaligned_logprobs_are_rejected(smollm_tokenizer: Tokenizer) -> None:
    req = RequestDecoder(smollm_tokenizer, [], StopConditions(), logprobs=True)
    with pytest.raises(ValueError, match="logprobs"):
        req.feed(TokenDelta(0, [5, 6], logprobs=[lp(5)]))
    with pytest.raises(ValueError, match="choice"):
        req.feed(TokenDelta(1, [5]))


def test_token_texts_of_special_and_unknown_ids(smollm_tokenizer: Tokenizer) -> None:
    texts = TokenTexts(smollm_tokenizer, skip_special_tokens=False)
    assert (texts.text(EOS), texts.bytes(EOS)) == ("<|im_end|>", list(b"<|im_end|>"))
    space = ids_of(smollm_tokenizer, " world")[0]
    assert texts.bytes(space) == list(b" world")
    skipping = TokenTexts(smollm_tokenizer)  # vLLM's default: skip_special_tokens=True
    assert (skipping.text(EOS), skipping.bytes(EOS)) == ("", [])
    assert skipping.text(space) == " world"


@pytest.mark.parametrize(("skip", "eos_text"), [(True, ""), (False, "<|im_end|>")])
def test_skip_special_tokens_applies_to_text_and_logprob_text(
    smollm_tokenizer: Tokenizer, skip: bool, eos_text: str
) -> None:
    """The request's ``skip_special_tokens`` governs the text, the logprob entries' text
    and the top-logprob candidates' text alike (as vLLM and the seed)."""
    hello = ids_of(smollm_tokenizer, "Hello")[0]
    ids = [hello, EOS, hello]
    req = RequestDecoder(
        smollm_tokenizer,
        prompt_ids(smollm_tokenizer),
        StopConditions(eos_token_ids=(EOS,), min_tokens=3),  # EOS at token 2 is text
        skip_special_tokens=skip,
        logprobs=True,
    )
    events = req.feed(TokenDelta(0, ids, logprobs=[lp(i, [(EOS, -1.0)]) for i in ids]))
    (delta,) = events
    assert delta.text == f"Hello{eos_text}Hello"
    entries = delta.logprobs or []
    assert [e.text for e in entries] == ["Hello", eos_text, "Hello"]
    assert entries[1].bytes == list(eos_text.encode())
    assert all(e.top == [(eos_text, -1.0)] for e in entries)


# 7. Choices and request completion


def test_three_choices_are_independent(smollm_tokenizer: Tokenizer) -> None:
    stop = StopConditions(stop=("STOP",), eos_token_ids=(EOS,))
    req = RequestDecoder(smollm_tokenizer, prompt_ids(smollm_tokenizer), stop, n=3)
    streams = [
        [*ids_of(smollm_tokenizer, "日本語 and 🍕"), EOS],
        ids_of(smollm_tokenizer, "I love 🎉 STOP never"),
        ids_of(smollm_tokenizer, "Hello ST"),
    ]
    events: list[OutputEvent] = []
    for k in range(max(len(s) for s in streams)):
        for c, ids in enumerate(streams):
            if k < len(ids):
                events += req.feed(TokenDelta(c, [ids[k]]))
        assert not req.all_done
    events += req.feed(TokenDelta(2, [], finish=EngineFinish.LENGTH))
    assert req.all_done
    assert texts_by_choice(events) == {0: "日本語 and 🍕", 1: "I love 🎉 ", 2: "Hello ST"}
    finals = {e.choice: (e.finish_reason, e.stop_reason) for e in events if e.finish_reason}
    assert finals == {
        0: (FinishReason.STOP, None),
        1: (FinishReason.STOP, "STOP"),
        2: (FinishReason.LENGTH, None),
    }
    stopped = len(ids_of(smollm_tokenizer, "I love 🎉 STOP"))
    expected = len(streams[0]) + stopped + len(streams[2])
    assert req.completion_tokens == expected
    assert req.usage["total_tokens"] == expected + len(prompt_ids(smollm_tokenizer))


def test_cancel_ends_every_open_choice(smollm_tokenizer: Tokenizer) -> None:
    req = RequestDecoder(
        smollm_tokenizer, prompt_ids(smollm_tokenizer), StopConditions(stop=("<|x",)), n=2
    )
    req.feed(TokenDelta(0, ids_of(smollm_tokenizer, "a <|"), finish=EngineFinish.EOS))
    req.feed(TokenDelta(1, ids_of(smollm_tokenizer, "b <|")))
    events = req.finish_all(EngineFinish.CANCELLED)
    assert [(e.kind, e.choice, e.text, e.finish_reason) for e in events] == [
        (OutputKind.DELTA, 1, "<|", None),
        (OutputKind.FINAL, 1, "", FinishReason.CANCELLED),
    ]
    assert req.all_done


@pytest.mark.parametrize(
    "stop",
    [
        StopConditions(),
        StopConditions(stop=("語で", "🎉 ST", "never")),
        StopConditions(stop=("語で", "🎉 ST"), include_stop_str_in_output=True),
        StopConditions(stop=("a",), min_tokens=6, eos_token_ids=(EOS,)),
    ],
)
def test_one_token_at_a_time_equals_all_at_once(
    smollm_tokenizer: Tokenizer, stop: StopConditions
) -> None:
    ids = [*ids_of(smollm_tokenizer, "a 日本語です I love 🎉 STOP a"), EOS, 5, 6]
    outcomes = set()
    for size in (1, 2, 3, 7, len(ids)):
        dec = new_decoder(smollm_tokenizer, stop)
        text = "".join(dec.step(ids[k : k + size]) for k in range(0, len(ids), size))
        text += dec.finish(EngineFinish.LENGTH)
        outcomes.add((text, dec.finish_reason, dec.stop_reason, dec.completion_tokens))
    assert len(outcomes) == 1, outcomes


def test_request_decoder_list_of_prompts_maps_choice_to_prompt(
    smollm_tokenizer: Tokenizer,
) -> None:
    """Completions' list of prompts: choice c decodes against prompt c // n."""
    a, b = ids_of(smollm_tokenizer, "first"), ids_of(smollm_tokenizer, "second")
    req = RequestDecoder(smollm_tokenizer, a, StopConditions(), n=2, more_prompts=[b])
    assert len(req.choices) == 4
    assert req.usage["prompt_tokens"] == len(a) + len(b)
    for c in range(4):
        req.feed(TokenDelta(c, ids_of(smollm_tokenizer, " x"), finish=EngineFinish.LENGTH))
    assert req.all_done


def test_error_code_travels_on_the_final_event(smollm_tokenizer: Tokenizer) -> None:
    req = RequestDecoder(smollm_tokenizer, [], StopConditions(), n=2)
    (final,) = req.feed(
        TokenDelta(0, [], finish=EngineFinish.ERROR, error="too long", error_code=400)
    )
    assert final.code == 400 and final.error == "too long"
    finals = req.finish_all(EngineFinish.ERROR, "deadline", 504)
    assert [(e.choice, e.code) for e in finals] == [(1, 504)]
