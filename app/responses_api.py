"""OpenAI's Responses API as a chat request: the translation, pure (no I/O).

A ``POST /v1/responses`` body is checked here (its input items in
``app.responses_input``) and turned into the body of a chat
completion, which then takes the one request path every other transport takes
(``app.intake`` -> ``broker.run``): the conversation (``input`` items, after the
stored context of ``previous_response_id``) becomes chat ``messages``, ``instructions``
a leading system message, function tools and ``tool_choice`` their chat forms,
``text.format`` a ``response_format`` (so #9's constrained decoding applies), and
``max_output_tokens`` ``max_tokens``. What the chat pipeline cannot do (built-in tools,
images, reasoning options, ...) is refused here with a 400 naming the field, before
anything is admitted.

The response object's fields that echo the request (``ResponseSkeleton``) are fixed
here too, so the event framer (``app.responses_events``) can rebuild exactly the same
events from the output stream on any web process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.errors import InvalidRequest, NotFound
from app.metadata import check_metadata
from app.responses_input import input_items, text_of, unsupported

# Fields of a Responses request that are translated (the rest are refused).
SUPPORTED_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "stream",
        "store",
        "previous_response_id",
        "metadata",
        "background",
        "user",
        "truncation",
        "reasoning",
        "max_tool_calls",
        "top_logprobs",
        "conversation",
        "prompt",
    }
)
# Accepted and ignored: hints that change nothing a client relies on here.
IGNORED_FIELDS = frozenset(
    {
        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
        "safety_identifier", "service_tier", "stream_options", "include", "moderation",
        "image", "access_programs", "background_options", "context_management",
    }
)  # fmt: skip
# Accepted only empty (null, [] or {}: what SDKs may send by default).
EMPTY_ONLY_FIELDS: frozenset[str] = frozenset()
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed")

# Chat-side parameter names an intake error may carry -> the Responses field they are.
_PARAM_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema.name": "text.format.name",
}


def responses_param(param: str | None) -> str | None:
    """The Responses name of a chat parameter named by an intake error."""
    if param is None:
        return None
    if param in _PARAM_NAMES:
        return _PARAM_NAMES[param]
    if param.startswith("messages"):
        return "input" + param[len("messages") :]
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A checked ``POST /v1/responses`` body.

    ``input_items`` are the request's own input as Responses items (a string input is
    one user message), without ids; ``tools`` and ``tool_choice`` keep their Responses
    shape (the response object echoes them).
    """

    model: str | None
    input_items: list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    background: bool = False
    user: str | None = None
    reasoning_effort: str | None = None
    # Echoed by the response object only (OpenAI's defaults when absent).
    reasoning_summary: str | None = None
    truncation: str = "disabled"
    top_logprobs: int = 0
    max_tool_calls: int | None = None


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Check a Responses body; a 400 naming the first field that is wrong or unsupported."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    extra = sorted(
        k
        for k, v in body.items()
        if k not in SUPPORTED_FIELDS
        and k not in IGNORED_FIELDS
        and not (k in EMPTY_ONLY_FIELDS and not v)
    )
    if extra:
        names = ", ".join(repr(k) for k in extra)
        raise unsupported(f"Unsupported parameter(s) for /v1/responses: {names}.", extra[0])
    if "input" not in body or body["input"] is None:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise InvalidRequest("'truncation' must be 'auto' or 'disabled'.", param="truncation")
    _no_stored_reference(body, "conversation", "conversations", "use 'previous_response_id'")
    _no_stored_reference(body, "prompt", "prompt templates", "send the prompt's text")
    max_calls = _opt_int(body, "max_tool_calls", minimum=1)
    background = _opt_bool(body, "background", False)
    stream = _opt_bool(body, "stream", False)
    store = _opt_bool(body, "store", True)
    if background and not store:
        raise InvalidRequest("A background response must be stored ('store' true).", param="store")
    tools = _tools(body.get("tools"))
    effort, summary = _reasoning(body.get("reasoning"))
    return ResponsesRequest(
        model=_opt_str(body, "model"),
        input_items=input_items(body["input"]),
        instructions=_opt_str(body, "instructions"),
        max_output_tokens=_opt_int(body, "max_output_tokens", minimum=1),
        temperature=_opt_number(body, "temperature"),
        top_p=_opt_number(body, "top_p"),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_opt_bool(body, "parallel_tool_calls", True) and max_calls != 1,
        text_format=_text_format(body.get("text")),
        stream=stream,
        store=store,
        previous_response_id=_opt_str(body, "previous_response_id"),
        metadata=check_metadata(body.get("metadata")) or {},
        background=background,
        user=_opt_str(body, "user"),
        reasoning_effort=effort,
        reasoning_summary=summary,
        truncation=truncation or "disabled",
        top_logprobs=_opt_int(body, "top_logprobs", minimum=0, maximum=20) or 0,
        max_tool_calls=max_calls,
    )


def _no_stored_reference(body: dict[str, Any], name: str, what: str, instead: str) -> None:
    """``conversation`` and ``prompt`` name objects stored on OpenAI's side; none are
    stored here, so any id is one that does not exist (OpenAI's answer: 404)."""
    value = body.get(name)
    if value is None:
        return
    ref = value.get("id") if isinstance(value, dict) else value
    if not isinstance(ref, str):
        raise InvalidRequest(f"'{name}' must be an id or an object with an 'id'.", param=name)
    raise NotFound(
        f"{name.capitalize()} {ref!r} not found: this server keeps no {what}; {instead}.",
        param=name,
    )


def _reasoning(value: Any) -> tuple[str | None, str | None]:
    """``reasoning``'s effort (the chat template's thinking switch, ``reasoning_effort``)
    and summary (accepted and echoed: the reasoning text itself is what the model wrote)."""
    if value is None:
        return None, None
    effort = value.get("effort") if isinstance(value, dict) else value
    summary = value.get("summary") if isinstance(value, dict) else None
    if effort is not None and effort not in _EFFORTS:
        raise InvalidRequest(
            f"'reasoning.effort' must be one of {', '.join(_EFFORTS)}.", param="reasoning.effort"
        )
    if summary is not None and summary not in _SUMMARIES:
        raise InvalidRequest(
            f"'reasoning.summary' must be one of {', '.join(_SUMMARIES)}.",
            param="reasoning.summary",
        )
    return effort, summary


# -- scalar fields ------------------------------------------------------------------------


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"'{name}' must be a string.", param=name)
    return value


def _opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean.", param=name)
    return value


def _opt_int(
    body: dict[str, Any], name: str, *, minimum: int, maximum: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequest(f"'{name}' must be an integer of at least {minimum}.", param=name)
    if maximum is not None and value > maximum:
        raise InvalidRequest(f"'{name}' must be at most {maximum}.", param=name)
    return value


def _opt_number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'{name}' must be a number.", param=name)
    return float(value)


# -- tools and formats --------------------------------------------------------------------


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("'tools' must be a list.", param="tools")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise unsupported(
                f"Tools of type {kind!r} are not supported (no built-in tools here); "
                "only 'function' tools are.",
                f"tools[{i}].type",
            )
        known = {"type", "name", "description", "parameters", "strict"}
        extra = sorted(k for k in tool if k not in known)
        if extra:
            raise unsupported(f"Unsupported function tool field {extra[0]!r}.", f"tools[{i}]")
        if not isinstance(tool.get("name"), str):
            raise InvalidRequest("A function tool needs a string 'name'.", param=f"tools[{i}].name")
        out.append(
            {
                "type": "function",
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict", True),
            }
        )
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise InvalidRequest(
                "'tool_choice' must be 'none', 'auto', 'required' or a function.",
                param="tool_choice",
            )
        if value == "required" and not tools:  # as chat and OpenAI: nothing to call
            raise InvalidRequest(
                "'tool_choice' 'required' is only allowed when 'tools' are given.",
                param="tool_choice",
            )
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if name is None:
            raise InvalidRequest(
                "Missing required parameter: 'tool_choice.name'.", param="tool_choice.name"
            )
        if not isinstance(name, str) or name not in {t["name"] for t in tools}:
            raise InvalidRequest(
                f"'tool_choice' names function {name!r}, which is not in 'tools'.",
                param="tool_choice.name",
            )
        return {"type": "function", "name": name}
    kind = value.get("type") if isinstance(value, dict) else None
    raise unsupported(f"'tool_choice' of type {kind!r} is not supported.", "tool_choice")


def _text_format(value: Any) -> dict[str, Any]:
    if value is None:
        return {"type": "text"}
    if not isinstance(value, dict):
        raise InvalidRequest("'text' must be an object.", param="text")
    extra = sorted(k for k in value if k not in ("format", "verbosity"))  # verbosity: a hint
    if extra:
        raise unsupported(f"Unsupported parameter 'text.{extra[0]}'.", f"text.{extra[0]}")
    fmt = value.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str):
            raise InvalidRequest("A json_schema format needs a 'name'.", param="text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest(
                "A json_schema format needs a 'schema'.", param="text.format.schema"
            )
        out = {"type": "json_schema", "name": fmt["name"], "schema": fmt["schema"]}
        for key in ("description", "strict"):
            if fmt.get(key) is not None:
                out[key] = fmt[key]
        return out
    raise unsupported(f"'text.format' of type {kind!r} is not supported.", "text.format.type")


# -- the chat body ------------------------------------------------------------------------


def to_chat_body(req: ResponsesRequest, context: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion body for ``req`` over the whole conversation ``context``
    (the previous responses' items, then ``req``'s own input items)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += chat_messages(context)
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.model is not None:
        body["model"] = req.model
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.user is not None:
        body["user"] = req.user
    if req.reasoning_effort is not None:
        body["reasoning_effort"] = req.reasoning_effort
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in (
                        ("name", t["name"]),
                        ("description", t["description"]),
                        ("parameters", t["parameters"]),
                    )
                    if v is not None
                },
            }
            for t in req.tools
        ]
        choice = req.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}}
            if isinstance(choice, dict)
            else choice
        )
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text_format
    if fmt["type"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items -> chat messages: consecutive function calls (and the assistant
    text just before them) are one assistant turn with ``tool_calls``; each output is
    a ``tool`` message; reasoning items are not replayed to the model."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": text_of(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def with_ids(items: list[dict[str, Any]], new_id: Callable[[], str]) -> list[dict[str, Any]]:
    """Input items as stored and listed (``input_items``): each with its own id."""
    prefix = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}
    return [{"id": prefix[str(item["type"])] + new_id(), **item} for item in items]


# -- the response object's request half ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseSkeleton:
    """What a response object says about its request, fixed at creation."""

    response_id: str
    created_at: int
    model: str
    request: ResponsesRequest

    def base(self) -> dict[str, Any]:
        """The response object before any output (status set by the caller)."""
        r = self.request
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": "in_progress",
            "background": r.background,
            "completed_at": None,
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata,
            "model": self.model,
            "output": [],
            "max_tool_calls": r.max_tool_calls,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning_effort, "summary": r.reasoning_summary},
            "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": r.text_format},
            "tool_choice": r.tool_choice,
            "tools": r.tools,
            "top_logprobs": r.top_logprobs,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": r.truncation,
            "usage": None,
            "user": r.user,
        }


def response_id_of(request_id: str) -> str:
    """The response id of a generation request (one per response)."""
    return "resp_" + request_id


def request_id_of(response_id: str) -> str | None:
    """The generation request behind a response id (None: not one of ours)."""
    if not response_id.startswith("resp_") or len(response_id) > 80:
        return None
    rid = response_id[len("resp_") :]
    return rid if rid and all(c.isalnum() or c in "-_" for c in rid) else None


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
