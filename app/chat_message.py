"""One message of a chat request, as the OpenAI API takes it (``messages[i]``).

Apart from ``app.protocol`` (the request around it) because it is the piece every chat
transport shares: the chat template renders it (``for_template``) and the prompt
checks read its text.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.tools import ToolCall
from app.validation import RequestModel, invalid


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(RequestModel):
    """One message of a conversation. Only text content is supported."""

    role: ChatRole
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> str | list[TextContentPart] | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise invalid("Message content must be a string or a list of text parts.")
        parts = []
        unknown: list[str] = []
        for i, part in enumerate(value):
            if not isinstance(part, dict):
                raise invalid(f"Content part {i} must be an object.", subpath=f"[{i}]")
            kind = part.get("type")
            if kind != "text":
                raise invalid(
                    f"Content part type {kind!r} is not supported; only 'text' parts are.",
                    subpath=f"[{i}].type",
                )
            unknown += [f"[{i}].{name}" for name in part if name not in ("type", "text")]
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"Content part {i} needs a string 'text'.", subpath=f"[{i}].text")
            parts.append(TextContentPart(type="text", text=text))
        if unknown:
            # One error naming every unknown key ("also"), so the 400 can list them all.
            raise PydanticCustomError(
                "extra_forbidden",
                "Extra inputs are not permitted",
                {"subpath": unknown[0], "also": tuple(unknown[1:])},
            )
        return parts

    @model_validator(mode="after")
    def _check_role_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise invalid(
                f"Missing required parameter: 'content' of a {self.role!r} message.",
                subpath="content",
            )
        if self.role == "tool" and not self.tool_call_id:
            raise invalid(
                "Missing required parameter: 'tool_call_id' of a 'tool' message.",
                subpath="tool_call_id",
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise invalid(
                f"Only 'assistant' messages may have 'tool_calls' (got a {self.role!r} message).",
                subpath="tool_calls",
            )
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates receive it (``app.chat_template``): content as
        text ("" for null: templates concatenate it), and ``name``, ``tool_calls``,
        ``tool_call_id`` when present."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return out

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)
