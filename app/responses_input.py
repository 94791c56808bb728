"""A Responses body's ``input`` items, checked and in the form they are stored and
listed in (``input_items``), without ids. Pure.

Only what the chat pipeline can replay is taken: ``message`` items with text parts
(``input_text``, or ``output_text`` for the assistant's own earlier turns),
``function_call`` and ``function_call_output``; anything else is a 400
``unsupported_parameter`` naming the item's field.
"""

from __future__ import annotations

from typing import Any

from app.errors import InvalidRequest


def unsupported(message: str, param: str) -> InvalidRequest:
    """A 400 for a Responses feature this server does not have (OpenAI's code for it)."""
    return InvalidRequest(message, param=param, code="unsupported_parameter")


_ROLES = ("user", "assistant", "system", "developer")


def input_items(value: Any) -> list[dict[str, Any]]:
    """The input as Responses items in their stored form (ids are added on storing)."""
    if isinstance(value, str):
        return [_message("user", [{"type": "input_text", "text": value}])]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "'input' must be a string or a non-empty list of items.", param="input"
        )
    return [_input_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _message(role: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content, "status": "completed"}


def _input_item(item: Any, param: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InvalidRequest("Each input item must be an object.", param=param)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"An input message's role must be one of {', '.join(_ROLES)}.",
                param=f"{param}.role",
            )
        content = _content(item.get("content"), role, f"{param}.content")
        return _message(role, content)
    if kind == "function_call":
        call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
        for key, v in (("call_id", call_id), ("name", name), ("arguments", arguments)):
            if not isinstance(v, str):
                raise InvalidRequest(
                    f"A function_call needs a string '{key}'.", param=f"{param}.{key}"
                )
        return {
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str):
            raise InvalidRequest(
                "A function_call_output needs a 'call_id'.", param=f"{param}.call_id"
            )
        if isinstance(output, list):
            output = text_of(_content(output, "user", f"{param}.output"))
        if not isinstance(output, str):
            raise InvalidRequest(
                "A function_call_output needs a string 'output'.", param=f"{param}.output"
            )
        return {
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
    raise unsupported(
        f"Input items of type {kind!r} are not supported; use 'message', 'function_call' "
        "or 'function_call_output'.",
        f"{param}.type",
    )


def _content(value: Any, role: str, param: str) -> list[dict[str, Any]]:
    """Message content as a list of text parts (input_text, or output_text for the
    assistant's own earlier turns)."""
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(value, str):
        return [_part(part_type, value)]
    if not isinstance(value, list):
        raise InvalidRequest("Message content must be a string or a list of parts.", param=param)
    parts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise unsupported(
                f"Content parts of type {kind!r} are not supported; only text parts are.",
                f"{param}[{i}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest("A text part needs a string 'text'.", param=f"{param}[{i}].text")
        parts.append(_part(part_type, text))
    return parts


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": kind, "text": text}


def text_of(parts: list[dict[str, Any]]) -> str:
    return "\n".join(str(p.get("text", "")) for p in parts)
