"""The one lenient JSON reader (HTTP bodies, WebSocket messages, batch lines).

The first cases port ``openai.rs``'s own tests of ``parse_json_request`` (raw control
characters, one right after a backslash, invalid UTF-8); the rest pin what
``web/bodies.py`` did before it moved here (BOM, lone surrogates, 400s without the
parser's text).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.batches import PlannedLine, RejectedLine, plan_batch
from app.errors import InvalidRequest
from app.lenient_json import escape_control_chars_in_strings, loads_lenient


def chat_body(content: bytes) -> bytes:
    return b'{"model":"test-model","messages":[{"role":"user","content":"' + content + b'"}]}'


def content_of(raw: bytes) -> str:
    value = loads_lenient(raw)
    assert value["model"] == "test-model"
    content = value["messages"][0]["content"]
    assert isinstance(content, str)
    return content


# openai.rs: test_parse_chat_completion_request_escapes_control_chars_in_strings
def test_raw_control_characters_in_strings_are_kept() -> None:
    assert content_of(chat_body(b"log \x1b[33mPK\x03\x04")) == "log \x1b[33mPK\x03\x04"


# openai.rs: test_parse_chat_completion_request_escapes_control_char_after_backslash
def test_control_character_right_after_a_backslash_is_kept() -> None:
    raw = chat_body(b"slash \\\nnext")
    with pytest.raises(json.JSONDecodeError):  # not even strict=False takes it
        json.loads(raw, strict=False)
    assert content_of(raw) == "slash \\\nnext"


# openai.rs: test_parse_chat_completion_request_replaces_invalid_utf8_in_strings
def test_invalid_utf8_becomes_replacement_characters() -> None:
    assert content_of(chat_body(b"raw \xff data")) == "raw \ufffd data"


def test_invalid_utf8_and_a_control_character_after_a_backslash_together() -> None:
    assert content_of(chat_body(b"\xfe\\\tx\\\\\ny")) == "\ufffd\\\tx\\\ny"


def test_escaped_backslash_then_control_character() -> None:
    # "\\" is a whole escape: the newline after it is a lone raw control character.
    assert content_of(chat_body(b"a\\\\\nb")) == "a\\\nb"
    # ... and an ordinary escape after a raw one still means what it says.
    assert content_of(chat_body(b'a\x01\\n\\"\\u00e9')) == 'a\x01\n"é'


def test_control_characters_outside_strings_are_whitespace_as_before() -> None:
    assert loads_lenient(b'{\n\t"a":\r\n 1}') == {"a": 1}
    assert escape_control_chars_in_strings('{\n"a": 1}') is None


def test_escape_is_the_seeds_byte_for_byte() -> None:
    # The seed writes "\\u00XX" after a backslash and "\u00XX" elsewhere, and leaves
    # everything outside strings (and every ordinary escape) alone.
    raw = '{"k\x01": "x\\\ny\x1f\\n"}\n'
    assert escape_control_chars_in_strings(raw) == '{"k\\u0001": "x\\\\\\u000ay\\u001f\\n"}\n'
    assert escape_control_chars_in_strings('{"a": "b"}') is None


def test_bom_and_surrogates() -> None:
    assert loads_lenient(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}
    assert loads_lenient(b'{"a": "x\\ud800y"}') == {"a": "x\ufffdy"}
    assert loads_lenient('{"a": "\\ud83d\\ude00"}') == {"a": "😀"}
    assert loads_lenient('{"\\udc00": ["\\uDFFF"]}') == {"\ufffd": ["\ufffd"]}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "The request body is empty; a JSON object is required."),
        (b"  \n", "The request body is empty; a JSON object is required."),
        (b'{"a": }', "The request body is not valid JSON (line 1, column 7)."),
        # Unterminated even once repaired: the position is the one in the client's text.
        (b'{"a": "x\\\n', "The request body is not valid JSON (line 1, column 9)."),
        (
            b"[" * 100_000 + b"]" * 100_000,
            "The request body is nested too deeply (at most 128 levels).",
        ),
    ],
)
def test_not_json_is_a_400_without_the_parsers_text(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        loads_lenient(raw)
    assert info.value.status == 400
    assert info.value.message == message


def raw_dumps(value: object) -> str:
    """JSON as a careless client writes it: control characters raw inside strings, and
    a backslash left unescaped when a control character follows it."""
    if isinstance(value, str):
        out = []
        for i, c in enumerate(value):
            if c == "\\":
                after = value[i + 1 : i + 2]
                out.append("\\" if after and after < " " else "\\\\")
            elif c == '"':
                out.append('\\"')
            else:
                out.append(c)
        return '"' + "".join(out) + '"'
    if isinstance(value, list):
        return "[" + ",".join(raw_dumps(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{raw_dumps(k)}:{raw_dumps(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


controls = st.text(st.sampled_from(["\\", '"', "a", "é", *map(chr, range(0x20))]), max_size=12)
values = st.recursive(
    st.none() | st.booleans() | st.integers() | controls,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(controls, inner, max_size=4),
    max_leaves=12,
)


@given(values)
def test_any_value_written_carelessly_reads_back(value: object) -> None:
    raw = raw_dumps(value)
    assert loads_lenient(raw.encode()) == value
    assert loads_lenient(json.dumps(value)) == value


def test_batch_lines_use_the_same_reader() -> None:
    """A batch input line is repaired exactly as an HTTP body is (it used to miss the
    lone-surrogate repair and the control character after a backslash)."""
    raw = b'{"custom_id":"r","method":"POST","url":"/v1/chat/completions",' + (
        b'"body":{"messages":[{"role":"user","content":"a\\\tb \\ud800 \xff"}]}}'
    )
    plan = plan_batch(
        raw,
        endpoint="/v1/chat/completions",
        build=lambda body: body["messages"][0]["content"],
        max_line_bytes=10_000,
        max_requests=10,
    )
    assert plan.lines == [PlannedLine(0, "r", "a\\\tb \ufffd \ufffd")]
    bad = plan_batch(
        b"{nope",
        endpoint="/v1/chat/completions",
        build=lambda body: body,
        max_line_bytes=10_000,
        max_requests=10,
    )
    (line,) = bad.lines
    assert isinstance(line, RejectedLine)
    assert isinstance(line.error, InvalidRequest)
    assert (line.error.message, line.error.code) == ("The line is not valid JSON.", "invalid_json")
