"""Tool calling and structured outputs on the wire: OpenAI's request fields, and what
they become inside tokenrelay.

Request side (validated in ``app.protocol``): ``tools`` (``ToolDefinition``),
``tool_choice`` (``"none"`` / ``"auto"`` / ``"required"`` / ``NamedToolChoice``),
``response_format`` (``ResponseFormat``) and the ``tool_calls`` of assistant messages in
the history (``ToolCall``).

Inside: each tool-call parser (``app.toolcalls``) reads one model family's syntax;
``TOOL_CALL_FORMATS`` says, per parser name, how that syntax wraps one call (the tags an
output constraint puts around the call's JSON, and the key holding the arguments), which
markers in a chat template show that the template writes it, and how the fallback
prompt for templates that know no tools asks for it. ``tool_call_constraint`` and
``response_format_constraint`` turn a request into the ``OutputConstraint`` the engine
enforces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.reasoning import REASONING_PARSERS
from app.records import OutputConstraint

# OpenAI's rule for function and schema names.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class FunctionDefinition(_Wire):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="JSON schema of the arguments object (none: no arguments)."
    )
    strict: bool | None = None


class ToolDefinition(_Wire):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """The tool as transformers passes it to chat templates (``tools=[...]``)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
TOOL_CHOICE_SHAPES = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


def tool_choice_problem(value: Any) -> str | None:
    """What is wrong with a ``tool_choice`` (None: nothing), in our words: pydantic's
    would name its union's members (``tool_choice.literal['none','auto','required']``)."""
    if value is None or value in ("none", "auto", "required"):
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "allowed_tools":
        return (
            "'tool_choice' of type 'allowed_tools' is not supported; list only the allowed "
            "functions in 'tools', with 'tool_choice' 'auto' or 'required'."
        )
    if kind == "function":
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return None
        return (
            "'tool_choice' of type 'function' must name the function: "
            "{'type': 'function', 'function': {'name': ...}}."
        )
    shown = repr(value) if isinstance(value, str) and len(value) <= 40 else None
    said = f": {shown}" if shown else ""
    return f"Invalid value for 'tool_choice'{said}; use {TOOL_CHOICE_SHAPES}."


class ToolCallFunction(_Wire):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model wrote them.")


class ToolCall(_Wire):
    """A tool call of an assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class JsonSchemaFormat(_Wire):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one tool-call parser's syntax writes a single call."""

    parser: str
    prefix: str  # the text before the call's JSON object
    suffix: str  # the text after it
    arguments_key: str  # "arguments", or "parameters" (Llama 3)
    markers: tuple[str, ...]  # text in a chat template that writes this syntax

    def render_call(self, name: str, arguments: Any) -> str:
        """One call in this syntax (the fallback prompt's history of past calls)."""
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        return f"{self.prefix}{body}{self.suffix}"

    def instructions(self) -> str:
        """How the fallback system prompt asks the model to call a function."""
        example = (
            f'{self.prefix}{{"name": <function-name>, "{self.arguments_key}": '
            f"<args-json-object>}}{self.suffix}"
        )
        return (
            "For each function call, return a json object with the function name and "
            f"arguments in exactly this form:\n{example}"
        )


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(
        "hermes", "<tool_call>\n", "\n</tool_call>", "arguments", ("<tool_call>",)
    ),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS][", "]", "arguments", ("[TOOL_CALLS]",)),
    "llama3_json": ToolCallFormat(
        "llama3_json", "", "", "parameters", ("<|python_tag|>", "ipython")
    ),
}
# The parser a template that writes no known syntax gets: the fallback prompt asks for it.
FALLBACK_TOOL_PARSER = "hermes"
# Checked in this order: Mistral's and Llama 3's markers are specific to their families,
# while "<tool_call>" is the most widely copied one.
_DETECTION_ORDER = ("mistral", "llama3_json", "hermes")


def native_tool_parser(template: str | None) -> str | None:
    """The tool-call syntax a chat template writes itself, from its markers (None: it
    writes none we know)."""
    if not template:
        return None
    for name in _DETECTION_ORDER:
        if any(marker in template for marker in TOOL_CALL_FORMATS[name].markers):
            return name
    return None


def detect_tool_call_parser(template: str | None) -> str | None:
    """A model's tool-call parser from its chat template: the syntax the template
    writes, else the fallback prompt's (Hermes); None without a template."""
    if template is None:
        return None
    return native_tool_parser(template) or FALLBACK_TOOL_PARSER


def detect_reasoning_parser(template: str | None) -> str | None:
    """The reasoning parser whose open tag the template writes or strips (``<think>`` ->
    ``"think"``, ``<seed:think>`` -> ``"seed_think"``); the longest tag wins, so a
    specific variant is not taken for a generic one."""
    if not template:
        return None
    by_length = sorted(REASONING_PARSERS.items(), key=lambda item: -len(item[1][0]))
    for name, (open_tag, _close) in by_length:
        if open_tag in template:
            return name
    return None


FALLBACK_TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "{instructions}"
)


def fallback_tools_prompt(tools: Sequence[Mapping[str, Any]], fmt: ToolCallFormat) -> str:
    """The system prompt that describes ``tools`` to a model whose template knows none."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return FALLBACK_TOOLS_PROMPT.format(tools=listed, instructions=fmt.instructions())


def _no_arguments() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


def call_schema(function: FunctionDefinition, fmt: ToolCallFormat) -> dict[str, Any]:
    """The JSON schema of one call of ``function`` as ``fmt`` writes it (name first)."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            fmt.arguments_key: function.parameters or _no_arguments(),
        },
        "required": ["name", fmt.arguments_key],
        "additionalProperties": False,
    }


def forced_functions(
    tools: Sequence[ToolDefinition], choice: ToolChoice
) -> list[FunctionDefinition]:
    """The functions a ``tool_choice`` forces the model to call one of (none for
    ``"none"``/``"auto"``)."""
    if isinstance(choice, NamedToolChoice):
        return [t.function for t in tools if t.function.name == choice.function.name]
    if choice == "required":
        return [t.function for t in tools]
    return []


def tool_call_constraint(
    tools: Sequence[ToolDefinition], choice: ToolChoice, fmt: ToolCallFormat
) -> OutputConstraint | None:
    """The constraint for ``tool_choice`` ``"required"`` or named: exactly one call,
    in the model's syntax, whose arguments match the function's schema."""
    functions = forced_functions(tools, choice)
    if not functions:
        return None
    schemas = [call_schema(f, fmt) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return OutputConstraint(
        kind="tool_call",
        json_schema=json.dumps(schema, ensure_ascii=False),
        prefix=fmt.prefix,
        suffix=fmt.suffix,
    )


def response_format_constraint(fmt: ResponseFormat | None) -> OutputConstraint | None:
    """The constraint for ``response_format`` (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputConstraint(kind="json_object")
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if schema is None:
        return OutputConstraint(kind="json_object")
    return OutputConstraint(kind="json_schema", json_schema=json.dumps(schema, ensure_ascii=False))
