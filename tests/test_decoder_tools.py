"""RequestDecoder with reasoning and tool-call parsing, end to end with the real SmolLM2
tokenizer: text with tool-call syntax is tokenized and fed one token at a time (as a
worker publishes it), and the events are what a client must get."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer

from app.decoder import RequestDecoder
from app.messages import (
    EngineFinish,
    FinishReason,
    OutputEvent,
    OutputKind,
    TokenDelta,
    TokenLogprob,
)
from app.records import RequestRecord, StopConditions

EOS = 2  # <|im_end|>
PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def counter_ids() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers):024x}"


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def decoder(tok: Tokenizer, prompt: str = PROMPT, **kwargs: object) -> RequestDecoder:
    stop = kwargs.pop("stop", StopConditions(eos_token_ids=(EOS,)))
    assert isinstance(stop, StopConditions)
    return RequestDecoder(
        tok,
        ids_of(tok, prompt),
        stop,
        new_call_id=counter_ids(),
        **kwargs,  # type: ignore[arg-type]
    )


def feed_one_by_one(req: RequestDecoder, ids: list[int], choice: int = 0) -> list[OutputEvent]:
    events: list[OutputEvent] = []
    for i in ids:
        events += req.feed(TokenDelta(choice, [i]))
    return events


def summary(events: list[OutputEvent]) -> tuple[str, str, list[tuple[str, str, str]]]:
    """(content, reasoning, [(id, name, arguments)]) of the DELTAs, as a client
    reassembles them."""
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    for e in events:
        if e.kind is not OutputKind.DELTA:
            continue
        assert e.text or e.reasoning or e.tool_calls or e.logprobs, "no empty DELTA"
        content += e.text
        reasoning += e.reasoning
        for c in e.tool_calls or []:
            if c.index not in calls:
                assert c.id is not None and c.name is not None
                calls[c.index] = [c.id, c.name, ""]
            calls[c.index][2] += c.arguments
    return content, reasoning, [(i, n, a) for i, n, a in calls.values()]


def final(events: list[OutputEvent]) -> OutputEvent:
    (fin,) = [e for e in events if e.kind is OutputKind.FINAL]
    return fin


ID0, ID1 = (f"call_{i:024x}" for i in range(2))


def test_hermes_call_one_token_at_a_time(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    ids = [*ids_of(tok, "Let me look.\n" + CALL), EOS]
    assert len(ids) > 20  # the tags really are split over several tokens
    req = decoder(tok, tool_parser="hermes", tools_enabled=True)
    events = feed_one_by_one(req, ids)
    assert summary(events) == (
        "Let me look.",
        "",
        [(ID0, "get_weather", json.dumps({"city": "Paris"}))],
    )
    # No piece of a tag ever reached the client as content.
    assert all("<" not in e.text for e in events)
    fin = final(events)
    assert (fin.finish_reason, fin.stop_reason) == (FinishReason.TOOL_CALLS, None)
    assert req.all_done
    assert "completion_tokens_details" not in req.usage


def test_parallel_calls_and_event_encoding_round_trip(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    ids = [*ids_of(tok, CALL + "\n" + CALL2 + "\n"), EOS]
    req = decoder(tok, tool_parser="hermes", tools_enabled=True)
    events = [OutputEvent.decode(e.encode()) for e in feed_one_by_one(req, ids)]
    content, _, calls = summary(events)
    assert content == ""
    assert [(i, n) for i, n, _ in calls] == [(ID0, "get_weather"), (ID1, "get_time")]
    assert [json.loads(a) for _, _, a in calls] == [{"city": "Paris"}, {"tz": "CET"}]
    assert final(events).finish_reason is FinishReason.TOOL_CALLS


def test_without_tools_enabled_the_syntax_is_content(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    ids = [*ids_of(tok, CALL), EOS]
    req = decoder(tok, tool_parser="hermes", tools_enabled=False)
    events = feed_one_by_one(req, ids)
    assert summary(events) == (CALL, "", [])
    assert final(events).finish_reason is FinishReason.STOP


def test_malformed_call_is_content_and_the_finish_is_stop(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    text = '<tool_call>\n{"name": "get_weather" "arguments": {"city": 1}\n</tool_call>'
    req = decoder(tok, tool_parser="hermes", tools_enabled=True)
    events = feed_one_by_one(req, [*ids_of(tok, text), EOS])
    assert summary(events) == (text, "", [])
    assert final(events).finish_reason is FinishReason.STOP


def test_a_streamed_call_with_bad_arguments_stands(smollm_tokenizer: Tokenizer) -> None:
    """Once its name and the opening of its arguments are out, a call is a call: what
    the model wrote for the arguments is what the client gets (as vLLM streams it)."""
    tok = smollm_tokenizer
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    req = decoder(tok, tool_parser="hermes", tools_enabled=True)
    events = feed_one_by_one(req, [*ids_of(tok, text), EOS])
    calls = [f for e in events for f in e.tool_calls or ()]
    assert calls[0].name == "get_weather" and calls[0].arguments == ""
    assert "".join(f.arguments for f in calls) == '{"city": }'
    assert summary(events)[0] == ""
    assert final(events).finish_reason is FinishReason.TOOL_CALLS


def test_length_cut_inside_a_call_s_arguments_keeps_the_partial_call(
    smollm_tokenizer: Tokenizer,
) -> None:
    """As OpenAI: a call cut by max_tokens keeps the arguments written so far, and the
    finish is ``length``; cut before its arguments opened, it is content."""
    tok = smollm_tokenizer
    ids = ids_of(tok, "Sure " + CALL)
    text = tok.decode(ids)
    args_at = text.index('"arguments": {') + len('"arguments": ')
    keep = next(n for n in range(len(ids)) if len(tok.decode(ids[:n])) > args_at + 3)
    stop = StopConditions(eos_token_ids=(EOS,), max_tokens=keep)
    req = decoder(tok, tool_parser="hermes", tools_enabled=True, stop=stop)
    events = feed_one_by_one(req, ids)
    calls = [f for e in events for f in e.tool_calls or ()]
    assert summary(events)[0] == "Sure"
    assert "".join(f.arguments for f in calls) == tok.decode(ids[:keep])[args_at:]
    assert final(events).finish_reason is FinishReason.LENGTH
    early = 4  # "Sure <tool_call>..." cut before the arguments
    stop = StopConditions(eos_token_ids=(EOS,), max_tokens=early)
    req = decoder(tok, tool_parser="hermes", tools_enabled=True, stop=stop)
    events = feed_one_by_one(req, ids)
    assert summary(events) == (tok.decode(ids[:early]), "", [])


def test_stop_string_after_a_call_ends_with_tool_calls(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    ids = ids_of(tok, CALL + "\nObservation: sunny")
    stop = StopConditions(eos_token_ids=(EOS,), stop=("Observation:",))
    req = decoder(tok, tool_parser="hermes", tools_enabled=True, stop=stop)
    events = feed_one_by_one(req, ids)
    assert summary(events)[0] == ""
    fin = final(events)
    assert (fin.finish_reason, fin.stop_reason) == (FinishReason.TOOL_CALLS, "Observation:")


def test_cancel_flushes_held_text_and_keeps_abort(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    req = decoder(tok, tool_parser="hermes", tools_enabled=True)
    events = feed_one_by_one(req, ids_of(tok, "Hello <tool_"))
    assert summary(events)[0] == "Hello"
    events = req.finish_all(EngineFinish.CANCELLED)
    assert summary(events)[0] == " <tool_"
    assert final(events).finish_reason is FinishReason.CANCELLED


def test_logprobs_ride_on_the_delta_of_their_token(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    ids = [*ids_of(tok, "<think>hm</think>Ok " + CALL), EOS]
    req = decoder(
        tok, tool_parser="hermes", tools_enabled=True, reasoning_parser="think", logprobs=True
    )
    events: list[OutputEvent] = []
    for i in ids:
        got = req.feed(TokenDelta(0, [i], logprobs=[TokenLogprob(i, -0.1, [])]))
        deltas = [e for e in got if e.kind is OutputKind.DELTA]
        assert len(deltas) == 1  # every token's DELTA is sent, held text or not
        assert [x.token_id for x in deltas[0].logprobs or []] == [i]
        events += got
    content, reasoning, calls = summary(events)
    assert (content, reasoning) == ("Ok", "hm")
    assert [n for _, n, _ in calls] == ["get_weather"]


def test_reasoning_then_answer_and_reasoning_tokens(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    think = "<think>\nParis is in France. Call the tool.\n</think>"
    ids = [*ids_of(tok, think + "\n\n" + CALL), EOS]
    req = decoder(tok, tool_parser="hermes", tools_enabled=True, reasoning_parser="think")
    events = feed_one_by_one(req, ids)
    content, reasoning, calls = summary(events)
    assert (content, reasoning) == ("", "Paris is in France. Call the tool.\n")
    assert [n for _, n, _ in calls] == ["get_weather"]
    assert all("<" not in e.reasoning and "<" not in e.text for e in events)
    n = req.usage["completion_tokens_details"]["reasoning_tokens"]
    # From the token that completes "<think>" to the one that completes "</think>".
    inner = len(ids_of(tok, think)) - len(ids_of(tok, "<think>")) + 1
    assert inner - 2 <= n <= len(ids_of(tok, think))
    assert req.usage["completion_tokens"] == len(ids)


def test_template_that_opens_the_think_block(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    ids = [*ids_of(tok, "Easy.\n</think>\n\nIt is 4."), EOS]
    req = decoder(tok, prompt=PROMPT + "<think>\n", reasoning_parser="think")
    events = feed_one_by_one(req, ids)
    assert summary(events) == ("It is 4.", "Easy.\n", [])
    assert final(events).finish_reason is FinishReason.STOP
    assert req.usage["completion_tokens_details"]["reasoning_tokens"] >= 3
    # A template that closed the block (thinking off) leaves the output as content.
    closed = decoder(tok, prompt=PROMPT + "<think>\n\n</think>\n\n", reasoning_parser="think")
    assert summary(feed_one_by_one(closed, ids))[:2] == ("Easy.\n</think>\n\nIt is 4.", "")
    assert closed.usage["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_choices_parse_independently(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    req = decoder(tok, tool_parser="hermes", tools_enabled=True, n=2)
    a = feed_one_by_one(req, [*ids_of(tok, CALL), EOS], choice=0)
    b = feed_one_by_one(req, [*ids_of(tok, "No tools needed."), EOS], choice=1)
    assert summary(a)[2][0][:2] == (ID0, "get_weather")
    assert final(a).finish_reason is FinishReason.TOOL_CALLS
    assert summary(b) == ("No tools needed.", "", [])
    assert final(b).finish_reason is FinishReason.STOP


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    ],
)
def test_other_formats_end_to_end(smollm_tokenizer: Tokenizer, parser: str, text: str) -> None:
    tok = smollm_tokenizer
    req = decoder(tok, tool_parser=parser, tools_enabled=True)
    events = feed_one_by_one(req, [*ids_of(tok, text), EOS])
    assert summary(events) == ("", "", [(ID0, "get_weather", '{"city": "Paris"}')])
    assert final(events).finish_reason is FinishReason.TOOL_CALLS


def test_special_token_tags_keep_special_tokens_in_the_text(smollm_tokenizer: Tokenizer) -> None:
    """Mistral's and Llama's tags are special tokens: their parsers need them decoded."""
    tok = smollm_tokenizer
    ids = [1, *ids_of(tok, "x"), EOS]  # 1: <|im_start|>, a special token of SmolLM2
    plain = decoder(tok, tool_parser="mistral", tools_enabled=False)
    assert summary(feed_one_by_one(plain, ids))[0] == "x"
    keeping = decoder(tok, tool_parser="mistral", tools_enabled=True)
    assert summary(feed_one_by_one(keeping, ids))[0] == "<|im_start|>x"


def test_unknown_parser_names_fail_at_construction(smollm_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="tool-call parser 'x'"):
        decoder(smollm_tokenizer, tool_parser="x", tools_enabled=True)
    with pytest.raises(ValueError, match="reasoning parser 'y'"):
        decoder(smollm_tokenizer, reasoning_parser="y")


def test_the_streamer_builds_parsers_from_the_record(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    record = RequestRecord(
        request_id="r",
        model="m",
        prompts=[ids_of(tok, PROMPT)],
        stop=StopConditions(eos_token_ids=(EOS,)),
        created=0.0,
        deadline=60.0,
        tool_parser="hermes",
        reasoning_parser="think",
        tools_enabled=True,
    )
    req = RequestDecoder.for_record(tok, record)
    events = feed_one_by_one(req, [*ids_of(tok, "<think>a</think>" + CALL), EOS])
    content, reasoning, calls = summary(events)
    assert (content, reasoning) == ("", "a")
    assert calls[0][0].startswith("call_") and len(calls[0][0]) == 29
    assert final(events).finish_reason is FinishReason.TOOL_CALLS
    assert "completion_tokens_details" in req.usage
