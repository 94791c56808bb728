"""Tool-call parsers (app.toolcalls): each format, split at every character, parallel
calls, malformed calls released as content, and partial tags never released early."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest

from app.messages import ToolCallDelta
from app.tags import Content, Piece, split_at_tag
from app.toolcalls import (
    TOOL_PARSERS,
    JsonEnd,
    ToolCallParser,
    call_from,
    make_tool_parser,
    new_call_id,
)

Call = tuple[str, str, dict[str, object]]  # (id, name, arguments)


def counter_ids() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers):024x}"


def collect(pieces: list[Piece]) -> tuple[str, list[Call]]:
    """Content text, and the calls reassembled the way the openai SDK does (by index)."""
    content = ""
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if isinstance(p, Content):
            content += p.text
        else:
            assert isinstance(p, ToolCallDelta)
            if p.index not in calls:
                assert p.id is not None and p.name is not None, "first fragment names the call"
                assert p.index == len(calls), "indexes count up from 0"
                calls[p.index] = [p.id, p.name, ""]
            else:
                assert p.id is None and p.name is None
            calls[p.index][2] += p.arguments
    return content, [(i, n, json.loads(a)) for i, n, a in calls.values()]


def run(name: str, chunks: list[str]) -> tuple[str, list[Call]]:
    parser = make_tool_parser(name, counter_ids())
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    pieces += parser.flush()
    content, calls = collect(pieces)
    assert parser.calls == len(calls)
    return content, calls


def every_split(name: str, text: str) -> tuple[str, list[Call]]:
    """Parse ``text`` whole, one character at a time, and cut at every position: all the
    same."""
    whole = run(name, [text])
    assert run(name, list(text)) == whole
    for i in range(1, len(text)):
        assert run(name, [text[:i], text[i:]]) == whole, f"cut at {i}: {text[:i]!r}"
    return whole


ID0, ID1, ID2 = (f"call_{i:024x}" for i in range(3))

# -- hermes ---------------------------------------------------------------------------------


def test_hermes_one_call_after_content() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    )
    assert every_split("hermes", text) == (
        "Let me check.",
        [(ID0, "get_weather", {"city": "Paris"})],
    )


def test_hermes_parallel_calls_have_no_content() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"y": "<tool_call>"}}\n</tool_call>'
    )
    assert every_split("hermes", text) == (
        "",
        [(ID0, "a", {"x": 1}), (ID1, "b", {"y": "<tool_call>"})],
    )


def test_hermes_malformed_calls_are_content_verbatim() -> None:
    bad_json = 'Try <tool_call>{"name": "a" "arguments": {}}</tool_call> after'
    assert every_split("hermes", bad_json) == (bad_json, [])
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert every_split("hermes", no_name) == (no_name, [])
    bad_args = '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'
    assert every_split("hermes", bad_args) == (bad_args, [])


def test_hermes_malformed_then_good_call() -> None:
    text = 'x\n<tool_call>{oops}</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert every_split("hermes", text) == ("x\n<tool_call>{oops}</tool_call>", [(ID0, "f", {})])


def test_hermes_unclosed_call_counts_when_its_json_is_complete() -> None:
    assert every_split("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}\n') == (
        "",
        [(ID0, "f", {"a": 1})],
    )
    cut = '<tool_call>{"name": "f", "argu'
    assert every_split("hermes", cut) == (cut, [])


def test_hermes_arguments_as_a_json_string_and_missing_arguments() -> None:
    text = (
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>'
        '<tool_call>{"name": "g"}</tool_call>'
    )
    assert every_split("hermes", text) == ("", [(ID0, "f", {"a": 2}), (ID1, "g", {})])


def test_partial_tag_is_held_back_until_it_cannot_be_a_tag() -> None:
    parser = make_tool_parser("hermes", counter_ids())
    assert parser.feed("Hi <tool_") == [Content("Hi")]  # the space too: a call may follow
    assert parser.feed("cal") == []
    assert parser.feed("x") == [Content(" <tool_calx")]
    assert parser.feed(" <") == []
    assert parser.flush() == [Content(" <")]


def test_content_without_tags_streams_at_once() -> None:
    parser = make_tool_parser("hermes", counter_ids())
    assert parser.feed("Hello") == [Content("Hello")]
    assert parser.feed(", world") == [Content(", world")]
    assert parser.flush() == []


def test_whitespace_inside_content_is_kept() -> None:
    assert every_split("hermes", "  a\n\nb  ") == ("  a\n\nb  ", [])
    text = 'a <tool_call>{"name": "f", "arguments": {}}</tool_call> b'
    assert every_split("hermes", text) == ("ab", [(ID0, "f", {})])


def test_fragments_first_names_then_arguments() -> None:
    parser = make_tool_parser("hermes", counter_ids())
    out = parser.feed('<tool_call>{"name": "f", "arguments": {"q": "é"}}</tool_call>')
    assert out == [ToolCallDelta(0, ID0, "f", ""), ToolCallDelta(0, None, None, '{"q": "é"}')]


# -- llama3_json ----------------------------------------------------------------------------


def test_llama3_python_tag_call() -> None:
    text = '<|python_tag|>{"name": "search", "parameters": {"q": "a}b"}}'
    assert every_split("llama3_json", text) == ("", [(ID0, "search", {"q": "a}b"})])


def test_llama3_bare_json_calls_separated_by_semicolons() -> None:
    text = ' {"name": "a", "parameters": {"x": [1, {"y": 2}]}}; {"name": "b", "parameters": {}}'
    assert every_split("llama3_json", text) == (
        "",
        [(ID0, "a", {"x": [1, {"y": 2}]}), (ID1, "b", {})],
    )


def test_llama3_json_answer_that_is_no_call_is_content() -> None:
    text = '{"name": "Bob", "age": 3} is the record'
    assert every_split("llama3_json", text) == (text, [])
    assert every_split("llama3_json", "Answer: {not json}") == ("Answer: {not json}", [])


def test_llama3_python_tag_with_code_is_content() -> None:
    text = '<|python_tag|>brave_search.call(query="x")'
    assert every_split("llama3_json", text) == (text, [])


def test_llama3_text_after_a_call_is_content() -> None:
    text = '{"name": "a", "parameters": {}}\nDone.'
    assert every_split("llama3_json", text) == ("Done.", [(ID0, "a", {})])


# -- mistral --------------------------------------------------------------------------------


def test_mistral_array_of_parallel_calls() -> None:
    text = (
        'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"s": "]"}}, '
        '{"name": "b", "arguments": {}}]'
    )
    assert every_split("mistral", text) == ("Sure.", [(ID0, "a", {"s": "]"}), (ID1, "b", {})])


def test_mistral_name_args_form() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}'
    assert every_split("mistral", text) == (
        "",
        [(ID0, "get_weather", {"city": "Paris"}), (ID1, "now", {})],
    )


def test_mistral_malformed_blocks_are_content() -> None:
    for text in [
        '[TOOL_CALLS][{"nome": "a"}] then',
        "[TOOL_CALLS] hello world",
        "[TOOL_CALLS]!",
        "[TOOL_CALLS]f[ARGS][1, 2] x",
        '[TOOL_CALLS][{"name": "a", "arguments": {}}',  # cut before the array closed
    ]:
        assert every_split("mistral", text) == (text, []), text


def test_mistral_bad_name_then_a_good_block() -> None:
    text = '[TOOL_CALLS]a b [TOOL_CALLS][{"name": "f", "arguments": {}}]'
    assert every_split("mistral", text) == ("[TOOL_CALLS]a b", [(ID0, "f", {})])


# -- helpers --------------------------------------------------------------------------------


def test_split_at_tag_holds_the_longest_possible_tag_start() -> None:
    assert split_at_tag("a<tool_call>b", "<tool_call>") == ("a", True, "b")
    assert split_at_tag("a<to", "<tool_call>") == ("a", False, "<to")
    assert split_at_tag("a<x<t", "<tool_call>") == ("a<x", False, "<t")
    assert split_at_tag("[T[TOOL", "[TOOL_CALLS]") == ("[T", False, "[TOOL")
    assert split_at_tag("plain", "<tool_call>") == ("plain", False, "")


def test_json_end_skips_brackets_in_strings_and_escapes() -> None:
    end = JsonEnd()
    assert end.feed('{"a": "}\\"') == -1  # still inside the string (escaped quote)
    assert end.feed(' ]", "b": {"]"') == -1
    assert end.feed("}} tail") == 2
    assert JsonEnd().feed("[[]]x") == 4


def test_call_from_accepts_parameters_and_rejects_non_calls() -> None:
    assert call_from({"name": "f", "parameters": {"a": 1}}) == ("f", '{"a": 1}')
    assert call_from({"name": "f"}) == ("f", "{}")
    assert call_from({"name": "f"}, require_arguments=True) is None
    assert call_from({"name": "", "arguments": {}}) is None
    assert call_from({"name": "f", "arguments": "not json"}) is None
    assert call_from(["f"]) is None


def test_ids_look_like_openai_ids() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 and int(i[5:], 16) >= 0 for i in ids)


def test_unknown_parser_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        make_tool_parser("nope")


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_every_parser_passes_plain_text_and_releases_a_partial_tag_at_flush(name: str) -> None:
    parser: ToolCallParser = make_tool_parser(name, counter_ids())
    tag = parser.start_tag
    text = "Plain answer, no tools. " + tag[:-1]
    assert every_split(name, text) == (text, [])


TWO_CALLS = {
    "hermes": '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call> and more',
    "llama3_json": ' {"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
    "mistral": '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, '
    '{"name": "b", "arguments": {}}]',
}


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_parallel_tool_calls_false_keeps_the_first_call_only(name: str) -> None:
    """``parallel_tool_calls: false``: one call; what the model writes after it (a
    second call, more text) is not passed on, however the text is cut."""
    text = TWO_CALLS[name]
    assert len(run(name, [text])[1]) == 2  # unlimited: both
    for cut in range(len(text) + 1):
        parser = make_tool_parser(name, counter_ids(), max_calls=1)
        pieces = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.flush()
        assert collect(pieces) == ("", [(ID0, "a", {"x": 1})]), cut
        assert parser.calls == 1


STREAMED = {
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "n": [1, 2]}}\n'
    "</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "f", "parameters": {"city": "Paris", "n": [1, 2]}}',
    "mistral": '[TOOL_CALLS]f[ARGS]{"city": "Paris", "n": [1, 2]}',
}


@pytest.mark.parametrize("name", sorted(STREAMED))
def test_arguments_stream_as_the_model_writes_them(name: str) -> None:
    """Fed a few characters at a time, a call is announced (id and name) as soon as its
    name is known, and its arguments follow in many fragments that join to exactly the
    arguments' text: nothing of the call's closing or tag."""
    text = STREAMED[name]
    parser = make_tool_parser(name, counter_ids())
    fragments: list[ToolCallDelta] = []
    for i in range(0, len(text), 3):
        fragments += [p for p in parser.feed(text[i : i + 3]) if isinstance(p, ToolCallDelta)]
    fragments += [p for p in parser.flush() if isinstance(p, ToolCallDelta)]
    assert fragments[0].name == "f" and fragments[0].arguments == ""
    args = [f.arguments for f in fragments[1:]]
    assert len(args) > 5 and all(args)
    assert "".join(args) == '{"city": "Paris", "n": [1, 2]}'
    assert parser.calls == 1


def test_a_call_that_names_its_arguments_first_is_buffered() -> None:
    text = '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'
    parser = make_tool_parser("hermes", counter_ids())
    pieces = [p for c in text for p in parser.feed(c)] + parser.flush()
    calls = [p for p in pieces if isinstance(p, ToolCallDelta)]
    assert [(c.name, c.arguments) for c in calls] == [("f", ""), (None, '{"a": 1}')]
