"""app/grammar.py: the grammar a constraint compiles to, and the web tier's check.

Pure: llguidance only (no model, no llama.cpp). Where a tokenizer is needed to show what
the grammar accepts, the bundled SmolLM2 tokenizer is used through llguidance.
"""

from __future__ import annotations

import json

import llguidance
import pytest
from tokenizers import Tokenizer

from app.errors import InvalidRequest
from app.grammar import (
    check_constraint,
    check_schema_supported,
    constraint_grammar,
    grammar_problem,
)
from app.records import OutputConstraint

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def lltok(smollm_tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(smollm_tokenizer.to_str(), eos_token=[2])


def accepts(tok: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    """Does ``grammar`` accept exactly ``text`` (and then stop)?"""
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    for t in tok.tokenize_str(text):
        if not m.consume_token(t):
            return False
    return bool(m.is_accepting())


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "not": {"required": ["a"]}}, "not"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
        ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
        ({"type": "integer", "x-guidance": {"lenient": True}, "not": {}}, "not"),
    ],
)
def test_unsupported_features_are_a_400_naming_them(
    schema: dict[str, object], feature: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_schema_supported(schema)
    assert info.value.status == 400
    assert feature in info.value.message
    assert "\n" not in info.value.message  # one line, not the grammar excerpt
    with pytest.raises(InvalidRequest, match=feature.replace(".", r"\.")):
        check_constraint(OutputConstraint(kind="json_schema", json_schema=json.dumps(schema)))


@pytest.mark.parametrize(
    "schema",
    [
        OBJ,
        {"type": "integer", "minimum": 1, "maximum": 9},
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5},
        {"$defs": {"p": {"type": "string"}}, "type": "array", "items": {"$ref": "#/$defs/p"}},
        {"anyOf": [{"type": "null"}, {"type": "string", "format": "date-time"}]},
        {"type": "object", "additionalProperties": {"type": "number"}, "minProperties": 1},
    ],
)
def test_supported_schemas_pass(schema: dict[str, object]) -> None:
    check_schema_supported(schema)
    check_schema_supported(json.dumps(schema))


def test_schema_text_that_is_not_a_json_object_is_a_400() -> None:
    for text in ("{nope", "[1, 2]"):
        with pytest.raises(InvalidRequest):
            check_schema_supported(text)
        assert grammar_problem(OutputConstraint(kind="json_schema", json_schema=text))


def test_prefix_and_suffix_are_exact_literals(lltok: llguidance.LLTokenizer) -> None:
    odd = 'say "hi" \\ \t é\n'
    c = OutputConstraint(kind="tool_call", json_schema=json.dumps(OBJ), prefix=odd, suffix="\n</x>")
    g = constraint_grammar(c)
    assert accepts(lltok, g, odd + '{"a": 1}\n</x>')
    assert not accepts(lltok, g, '{"a": 1}\n</x>')  # prefix missing
    assert not accepts(lltok, g, odd + '{"a": 1}')  # suffix missing
    assert not accepts(lltok, g, odd + '{"a": "1"}\n</x>')  # schema violated


def test_json_object_is_any_object_in_the_fixed_layout(lltok: llguidance.LLTokenizer) -> None:
    g = constraint_grammar(OutputConstraint(kind="json_object"))
    assert accepts(lltok, g, '{"a": [1, {"b": null}], "c": "d"}')
    assert not accepts(lltok, g, "[1]")
    assert not accepts(lltok, g, '{"a":1}')  # separators are ", " and ": ", nothing else
    assert not accepts(lltok, g, '{\n  "a": 1\n}')
