"""Anthropic's Messages API (``POST /v1/messages``) as a framer on the one request path
(issue 42): coding agents built on the Anthropic SDK can use a self-hosted model.

Pure. A Messages body is checked and translated to a chat completions body
(``to_chat_body``): ``system`` (a string or text blocks) becomes a system message,
``tool_use`` blocks an assistant turn's ``tool_calls``, ``tool_result`` blocks ``tool``
messages, ``tools`` / ``tool_choice`` / ``stop_sequences`` / ``thinking`` their chat
counterparts. The run's output events are framed by ``MessageFeed``: Anthropic's
streamed event sequence (``message_start``, ``content_block_start`` / ``_delta`` /
``_stop`` with ``text_delta``, ``thinking_delta`` and ``input_json_delta``,
``message_delta`` with the stop reason and usage, ``message_stop``), or, folded, the one
``message`` object. The framing is a function of the events alone, so a replay of the
output stream frames the same events again (resume).

Errors use Anthropic's shape and types (``anthropic_error``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json

from app.errors import InvalidRequest, TokenRelayError, error_body, event_error
from app.messages import FinishReason, OutputEvent, OutputKind

ROUTE = "/v1/messages"
MESSAGE_FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream",
        "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier",
        "container", "mcp_servers", "context_management", "output_config", "cache_control",
        "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id",
    }
)  # fmt: skip
# Thinking configurations that let the model think (``disabled`` does not).
_THINKING = ("enabled", "adaptive", "between_tools", "disabled")
_ROLES = ("user", "assistant")

# HTTP status -> Anthropic's error type (docs.anthropic.com, "Errors"); 503 is their
# 529 ``overloaded_error`` (the SDK retries both).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# Chat-side parameter names an intake error may carry -> the Messages field they are.
_PARAM_NAMES = {
    "reasoning_effort": "output_config.effort",
    "response_format": "output_config.format",
    "response_format.json_schema.schema": "output_config.format.schema",
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "chat_template_kwargs": "thinking",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}
_TOOL_FIELDS = {"name": "name", "description": "description", "parameters": "input_schema"}
_CHAT_TOOL = re.compile(r"tools\[(\d+)\](?:\.function\.(\w+))?")


def messages_param(param: str | None) -> str | None:
    """The Messages name of a chat parameter named by an intake error (Anthropic's
    dotted paths: ``tools.0.input_schema``)."""
    if param is None or param in _PARAM_NAMES:
        return _PARAM_NAMES.get(param or "", param)
    tool = _CHAT_TOOL.match(param)
    if tool:
        field = _TOOL_FIELDS.get(tool[2] or "", tool[2])
        return f"tools.{tool[1]}" + (f".{field}" if field else "") + param[tool.end() :]
    if param.startswith("stop["):
        return "stop_sequences." + param[len("stop[") :].replace("]", "", 1)
    if param.startswith("messages"):
        # Turns are regrouped (system first, tool results split off): no index maps back.
        return "messages"
    return param


def anthropic_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and Anthropic error body for ``exc`` (the message as OpenAI's)."""
    status, body = error_body(exc)
    if status == 503:
        status = 529
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


# -- the request -------------------------------------------------------------------------------


def _text_of(blocks: Any, param: str) -> str:
    """A string, or text blocks joined (what a system prompt or tool result holds)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise InvalidRequest(f"{param}: must be a string or a list of text blocks.", param=param)
    texts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidRequest(
                f"{param}.{i}: only text blocks are supported here (got {kind!r}).",
                param=f"{param}.{i}",
            )
        if not isinstance(block.get("text"), str):
            raise InvalidRequest(f"{param}.{i}.text: must be a string.", param=f"{param}.{i}")
        texts.append(block["text"])
    return "\n".join(texts)


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{param}: must be a string or a list of blocks.", param=param)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidRequest(f"{param}.{i}: a block needs a 'type'.", param=f"{param}.{i}")
    return content


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Anthropic turns as chat messages: a user turn's ``tool_result`` blocks become
    ``tool`` messages (before its text), an assistant turn's ``tool_use`` blocks its
    ``tool_calls``; thinking blocks of past turns are dropped (templates drop them too)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: must be a non-empty list.", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        param = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise InvalidRequest(
                f"{param}.role: must be 'user' or 'assistant'.", param=f"{param}.role"
            )
        role = message["role"]
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(message.get("content"), f"{param}.content")):
            where, kind = f"{param}.content.{j}", block["type"]
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                text = _text_of(result, f"{where}.content") if result else ""
                if block.get("is_error"):
                    text = f"Error: {text}"
                out.append(
                    {"role": "tool", "tool_call_id": str(block.get("tool_use_id")), "content": text}
                )
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                    raise InvalidRequest(f"{where}: tool_use needs 'id' and 'name'.", param=where)
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": arguments},
                    }
                )
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise InvalidRequest(
                    f"{where}: blocks of type {kind!r} are not supported in a {role} turn.",
                    param=where,
                )
        if texts or calls or role == "assistant":
            chat: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
            if calls:
                chat["tool_calls"] = calls
            out.append(chat)
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be a list.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(
                f"tools.{i}: must be an object with a 'name' and an 'input_schema'.",
                param=f"tools.{i}",
            )
        kind = tool.get("type", "custom")
        if kind not in ("custom", None) or not isinstance(tool.get("name"), str):
            raise InvalidRequest(
                f"tools.{i}: only client tools with a 'name' and an 'input_schema' are "
                f"supported (got type {kind!r}).",
                param=f"tools.{i}",
            )
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, body: dict[str, Any]) -> None:
    """``tool_choice`` into the chat ``body``: auto, any (required), tool (named), none;
    ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``."""
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise InvalidRequest(
            "tool_choice: must be {'type': 'auto' | 'any' | 'tool' | 'none'}.", param="tool_choice"
        )
    kind = choice["type"]
    names = [t["function"]["name"] for t in body.get("tools", ())]
    if kind in ("any", "tool") and not names:  # a forced call with nothing to call
        raise InvalidRequest(
            f"tool_choice: type {kind!r} is only allowed when 'tools' are given.",
            param="tool_choice",
        )
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice.name: required for type 'tool'.", param="tool_choice")
        if choice["name"] not in names:
            raise InvalidRequest(
                f"tool_choice.name: {choice['name']!r} is not the name of one of 'tools'.",
                param="tool_choice.name",
            )
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") and "tools" in body:
        body["parallel_tool_calls"] = False


def to_chat_body(body: Any) -> dict[str, Any]:
    """A checked Messages body as a chat completions body; 400 naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    unknown = sorted(k for k in body if k not in MESSAGE_FIELDS)
    if unknown:
        names = ", ".join(unknown)
        raise InvalidRequest(
            f"{unknown[0]}: Extra inputs are not permitted ({names}).", param=unknown[0]
        )
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequest("max_tokens: a positive integer is required.", param="max_tokens")
    messages = _chat_messages(body.get("messages"))
    system = body.get("system")
    if system:
        messages.insert(0, {"role": "system", "content": _text_of(system, "system")})
    chat: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    for name in ("model", "temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    temperature = chat.get("temperature")
    if isinstance(temperature, int | float) and not 0 <= temperature <= 1:
        raise InvalidRequest("temperature: must be between 0 and 1.", param="temperature")
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise InvalidRequest(
                "stop_sequences: must be a list of strings.", param="stop_sequences"
            )
        chat["stop"] = stops
    user = (
        (body.get("metadata") or {}).get("user_id")
        if isinstance(body.get("metadata"), dict)
        else None
    )
    if isinstance(user, str):
        chat["user"] = user
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in _THINKING:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    elif thinking is not None:
        kinds = " | ".join(repr(k) for k in _THINKING)
        raise InvalidRequest(f"thinking: must be {{'type': {kinds}}}.", param="thinking")
    _output_config(body.get("output_config"), chat)
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    """``output_config``: ``effort`` is the chat template's ``reasoning_effort``;
    ``format`` (a JSON schema) is enforced as chat's ``response_format`` is."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise InvalidRequest("output_config: must be an object.", param="output_config")
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise InvalidRequest(
                "output_config.format: only {'type': 'json_schema', 'schema': ...} is supported.",
                param="output_config.format",
            )
        schema = {"name": "output", "schema": fmt.get("schema") or {}}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}


def count_tokens_body(body: Any) -> dict[str, Any]:
    """``/v1/messages/count_tokens``: the same body less ``max_tokens`` (not required
    there), as the chat body that is tokenized."""
    if isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}
    return to_chat_body(body)


# -- the response ------------------------------------------------------------------------------

_STOP_REASONS = {
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
}


def tool_input(arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block's ``input`` from the arguments the model wrote.

    A call cut short (``max_tokens``, a stop sequence) has arguments that are not whole
    JSON: its input is what the anthropic SDK's stream helper makes of the same
    ``input_json_delta``s (partial JSON: the members written in full, an unfinished
    value left out; ``{}`` when none is), so a streamed and a non-streamed answer agree,
    and no key the tool never declared is invented. Anything but an object is ``{}``.
    """
    if not arguments:
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        try:
            value = from_json(arguments, allow_partial=True)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


@dataclass
class _Block:
    kind: str  # "text", "thinking", "tool_use"
    index: int
    text: list[str] = field(default_factory=list)
    tool_id: str = ""
    name: str = ""


@dataclass
class MessageFeed:
    """One request's output events as Anthropic's stream events (``feed``), and the
    message they make (``message``). ``input_tokens``: the prompt's length, known when
    the request is accepted (``message_start`` carries it)."""

    message_id: str
    model: str
    input_tokens: int
    blocks: list[_Block] = field(default_factory=list)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    done: bool = False
    error: TokenRelayError | None = None
    _open: _Block | None = None
    _calls: dict[int, _Block] = field(default_factory=dict)

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
        }
        usage["cache_read_input_tokens"] = self.cached_tokens
        usage["cache_creation_input_tokens"] = 0
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": usage,
        }

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self._message([])}]

    def _start(self, kind: str, **extra: Any) -> tuple[_Block, list[dict[str, Any]]]:
        out = self._close()
        block = _Block(kind, len(self.blocks), **extra)
        self.blocks.append(block)
        self._open = block
        if kind == "text":
            start: dict[str, Any] = {"type": "text", "text": ""}
        elif kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            start = {"type": "tool_use", "id": block.tool_id, "name": block.name, "input": {}}
        out.append({"type": "content_block_start", "index": block.index, "content_block": start})
        return block, out

    def _close(self) -> list[dict[str, Any]]:
        block, self._open = self._open, None
        if block is None:
            return []
        return [{"type": "content_block_stop", "index": block.index}]

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        block, out = (
            (self._open, []) if self._open and self._open.kind == kind else self._start(kind)
        )
        assert block is not None
        block.text.append(text)
        key = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}[kind]
        out.append(
            {
                "type": "content_block_delta",
                "index": block.index,
                "delta": {"type": key[0], key[1]: text},
            }
        )
        return out

    def feed(self, ev: OutputEvent) -> list[dict[str, Any]]:
        """The stream events for one output event (none once done)."""
        if self.done:
            return []
        out: list[dict[str, Any]] = []
        if ev.kind is OutputKind.DELTA:
            if ev.reasoning:
                out += self._delta("thinking", ev.reasoning)
            if ev.text:
                out += self._delta("text", ev.text)
            for fragment in ev.tool_calls or ():
                block = self._calls.get(fragment.index)
                if block is None:
                    block, started = self._start(
                        "tool_use", tool_id=fragment.id or "", name=fragment.name or ""
                    )
                    self._calls[fragment.index] = block
                    out += started
                if fragment.arguments:
                    block.text.append(fragment.arguments)
                    out.append(
                        {
                            "type": "content_block_delta",
                            "index": block.index,
                            "delta": {
                                "type": "input_json_delta",
                                "partial_json": fragment.arguments,
                            },
                        }
                    )
        elif ev.kind is OutputKind.ERROR or ev.finish_reason is FinishReason.ERROR:
            # The one choice failed, or the request: the stream ends with an error event.
            error = self.error = event_error(ev) or TokenRelayError("generation failed")
            self.done = True
            out += self._close()
            out.append(anthropic_error(error)[1])
        elif ev.kind is OutputKind.FINAL:
            if isinstance(ev.stop_reason, str):
                self.stop_reason, self.stop_sequence = "stop_sequence", ev.stop_reason
            else:
                reason = ev.finish_reason
                self.stop_reason = _STOP_REASONS.get(reason, "end_turn") if reason else "end_turn"
        elif ev.kind is OutputKind.USAGE:
            usage = ev.usage or {}
            self.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)
            self.done = True
            out += self._close()
            out.append(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                    "usage": {"output_tokens": self.output_tokens},
                }
            )
            out.append({"type": "message_stop"})
        return out

    def message(self) -> dict[str, Any]:
        """The whole message (the non-streamed answer)."""
        content: list[dict[str, Any]] = []
        for block in self.blocks:
            text = "".join(block.text)
            if block.kind == "text":
                content.append({"type": "text", "text": text})
            elif block.kind == "thinking":
                content.append({"type": "thinking", "thinking": text, "signature": ""})
            else:
                content.append(
                    {
                        "type": "tool_use",
                        "id": block.tool_id,
                        "name": block.name,
                        "input": tool_input(text),
                    }
                )
        return self._message(content)
