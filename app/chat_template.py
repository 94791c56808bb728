"""Chat templates rendered exactly as transformers' ``apply_chat_template`` renders them.

Models ship Jinja templates written against transformers' environment: a sandbox with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that
keeps non-ASCII text, and the globals ``raise_exception`` and ``strftime_now``. Any
difference (say, Jinja's own HTML-safe ``tojson``) changes prompts silently, so the
environment is reproduced here rather than approximated.

``PromptBuilder`` turns OpenAI-style messages into prompt token ids for one model. It
takes plain dicts, not the web tier's pydantic models, so the streamer, the workers and
tests can use it too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta as jinja2meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from app.errors import InvalidRequest, ModelError
from app.lenient_json import loads_embedded
from app.model_card import ModelCard, load_tokenizer
from app.tools import (
    FALLBACK_TOOL_PARSER,
    TOOL_CALL_FORMATS,
    ToolCallFormat,
    fallback_tools_prompt,
    native_tool_parser,
)

Message = Mapping[str, Any]
Clock = Callable[[], datetime]


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject a conversation ("roles must alternate"): the
    # client's fault, so its message is shown to the client as a 400.
    raise InvalidRequest(str(message), param="messages")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: unlike Jinja's, it does not HTML-escape and keeps non-ASCII.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now_with(clock: Clock) -> Callable[[str], str]:
    def strftime_now(format: str) -> str:
        return clock().strftime(format)

    return strftime_now


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now_with(datetime.now)
    return env


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template once (compiling costs milliseconds; rendering, microseconds).

    A template that does not compile is the model directory's fault: ``ModelError``.
    """
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelError(f"the model's chat template does not compile: {exc}") from exc


@lru_cache(maxsize=32)
def template_uses_tools(source: str) -> bool:
    """Whether a template reads the ``tools`` variable (so it renders tool definitions
    itself, as transformers' tool-use templates do)."""
    try:
        return "tools" in jinja2meta.find_undeclared_variables(_environment().parse(source))
    except jinja2.TemplateSyntaxError as exc:
        raise ModelError(f"the model's chat template does not compile: {exc}") from exc


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Copy messages into the shape templates expect: ``content`` a string.

    OpenAI lets content be a list of parts; the text parts are joined with newlines,
    as vLLM does for templates that expect a string. Other keys (``name``,
    ``tool_calls``, ``tool_call_id``) pass through untouched.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"messages[{i}] must be an object with a string 'role'", param="messages"
            )
        copy = dict(message)
        content = copy.get("content")
        if isinstance(content, list):
            copy["content"] = "\n".join(_text_parts(content, i))
        elif content is not None and not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of parts", param="messages"
            )
        out.append(copy)
    return out


def _text_parts(parts: list[Any], index: int) -> list[str]:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping):
            raise InvalidRequest(
                f"messages[{index}].content has a malformed part", param="messages"
            )
        kind = part.get("type")
        if kind != "text":
            raise InvalidRequest(
                f"messages[{index}].content: part type {kind!r} is not supported (only 'text')",
                param="messages",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(
                f"messages[{index}].content: a text part needs a string 'text'", param="messages"
            )
        texts.append(text)
    return texts


def render_chat_template(
    source: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    now: Clock = datetime.now,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """Render ``source`` with the variables transformers passes to chat templates.

    ``variables`` are further template variables (e.g. ``enable_thinking``), as
    ``apply_chat_template(**kwargs)`` allows: a mapping, not keyword arguments, so a
    client's ``chat_template_kwargs`` can never bind one of this function's own
    parameters (``now``, ``source``). Errors raised while rendering are the
    conversation's fault (wrong roles, wrong content shape): ``InvalidRequest``.
    """
    template = compile_chat_template(source)
    every: dict[str, Any] = {
        **(variables or {}),
        "messages": normalize_messages(messages),
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
        "tools": list(tools) if tools is not None else None,
        # Render-time variables shadow the environment's globals: this is how the clock
        # is passed in without recompiling.
        "strftime_now": _strftime_now_with(now),
    }
    try:
        return template.render(every)  # a mapping: a variable named "self" is fine too
    except InvalidRequest:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidRequest(
            f"the model's chat template cannot render these messages ({type(exc).__name__})",
            param="messages",
        ) from exc


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as an object when they are JSON text of one (else as given)."""
    if isinstance(arguments, str):
        try:
            parsed = loads_embedded(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _calls(message: Message) -> list[tuple[str, Any]]:
    """(name, arguments object) of each tool call of an assistant message."""
    out = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            out.append((str(function.get("name")), _arguments_object(function.get("arguments"))))
    return out


def native_message(message: Message) -> Message:
    """A message for a template that knows tools: tool-call arguments as objects (a
    template writes them with ``tojson``; JSON text would be quoted twice) and no null
    content (templates concatenate it)."""
    if not isinstance(message, Mapping) or (
        not message.get("tool_calls") and message.get("content") is not None
    ):
        return message  # malformed input included: normalize_messages names it
    copy = dict(message)
    if copy.get("content") is None:
        copy["content"] = ""
    calls = copy.get("tool_calls")
    if isinstance(calls, list):
        copy["tool_calls"] = [_native_call(call) for call in calls]
    return copy


def _native_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return call
    arguments = _arguments_object(function.get("arguments"))
    return {**call, "function": {**function, "arguments": arguments}}


def fallback_messages(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    fmt: ToolCallFormat,
) -> list[Message]:
    """The conversation in plain turns, for templates that know no tools.

    - ``tools``: described in the system prompt (``app.tools.FALLBACK_TOOLS_PROMPT``,
      which asks for calls in ``fmt``'s syntax), appended to the first system or
      developer message, else in a new system message first;
    - an assistant turn's ``tool_calls``: written after its content in ``fmt``'s syntax;
    - ``tool`` messages: user turns of ``<tool_response>``...``</tool_response>``
      blocks, consecutive ones merged into one turn (templates that insist on
      alternating roles accept it).

    Messages without tool fields are passed on untouched.
    """

    def role_of(message: Any) -> Any:
        return message.get("role") if isinstance(message, Mapping) else None

    if not tools and not any(
        role_of(m) == "tool" or (role_of(m) == "assistant" and m.get("tool_calls"))
        for m in messages
    ):
        return list(messages)  # malformed input too: normalize_messages names it
    out: list[Message] = []
    previous_role = None
    for message in messages:
        role = role_of(message)
        if role == "tool":
            block = f"<tool_response>\n{_content_text(message)}\n</tool_response>"
            if previous_role == "tool":
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            text = _content_text(message)
            calls = "\n".join(fmt.render_call(name, args) for name, args in _calls(message))
            copy = {k: v for k, v in message.items() if k != "tool_calls"}
            copy["content"] = f"{text}\n{calls}" if text else calls
            out.append(copy)
        else:
            out.append(message)
        previous_role = role
    if tools:
        prompt = fallback_tools_prompt(tools, fmt)
        first = out[0] if out else None
        if isinstance(first, Mapping) and first.get("role") in ("system", "developer"):
            text = _content_text(first)
            out[0] = {**first, "content": f"{text}\n\n{prompt}" if text else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _content_text(message: Message) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(_text_parts(content, 0))
    return str(content)


# The fill-in-the-middle tokens' texts llama.cpp recognises (llama-vocab.cpp): prefix,
# suffix, middle.
_FIM_TEXTS: tuple[tuple[str, ...], ...] = (
    ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
     "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
     "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
     "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
)  # fmt: skip


class PromptBuilder:
    """Messages -> prompt text -> prompt token ids, for one model.

    Token ids are encoded without the tokenizer's post-processor (the rendered template
    already holds its special tokens, as ``apply_chat_template(tokenize=True)`` does);
    BOS is prepended only when the card asks for it and the prompt lacks it, so it is
    never doubled.
    """

    def __init__(self, card: ModelCard, tokenizer: Tokenizer, *, now: Clock = datetime.now):
        self.card = card
        self.tokenizer = tokenizer
        self._now = now
        template = card.chat_template
        if template is not None:
            compile_chat_template(template)  # fail at start-up, not per request
        parser = card.tool_call_parser or FALLBACK_TOOL_PARSER
        self.tool_format: ToolCallFormat = TOOL_CALL_FORMATS[parser]
        # The template renders tools itself only if it reads `tools` and writes the
        # syntax the model's parser reads; otherwise the fallback prompt describes them.
        self.native_tools = (
            template is not None
            and template_uses_tools(template)
            and native_tool_parser(template) == parser
        )

    @classmethod
    def from_card(cls, card: ModelCard, *, now: Clock = datetime.now) -> PromptBuilder:
        return cls(card, load_tokenizer(card), now=now)

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation, offering ``tools`` (transformers' shape:
        ``[{"type": "function", "function": {...}}]``) when given.

        A template that knows tools gets them as ``tools=`` and the history's
        ``tool_calls`` (arguments as objects, as transformers documents) and ``tool``
        messages as they are; any other gets the fallback (``fallback_messages``).
        """
        if self.card.chat_template is None:
            raise InvalidRequest(
                f"model {self.card.name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        if self.native_tools:
            messages = [native_message(m) for m in messages]
        else:
            messages = fallback_messages(messages, tools, self.tool_format)
            tools = None
        return render_chat_template(
            self.card.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.card.bos_token,
            eos_token=self.card.eos_token,
            tools=tools,
            now=self._now,
            variables=variables,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt text (special-token text in it becomes special ids)."""
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text, in one call.

        Why ``encode_batch_fast``: the same ids as ``Tokenizer.encode`` without the
        offsets, which only ``encode_with_part`` needs: less CPU on a chat prompt (15-20 %
        called back to back, ~4 % with other work between calls, as in a server;
        tokenizing is a fifth of the web tier's work per request start, issue 12), and it
        releases the GIL while it runs, so the web's other request threads go on
        meanwhile; several texts (a completions prompt list) are tokenized in parallel."""
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids) for e in encodings]

    def encode_with_part(self, text: str, part: str) -> tuple[list[int], list[int]]:
        """``encode(text)``, and the ids of ``part`` (its last occurrence in ``text``).

        The echo engine repeats the last user turn, which is in the rendered prompt:
        when the prompt's tokens tile that turn exactly (a token starts where it starts
        and one ends where it ends), those tokens are its ids and spell it back byte for
        byte, with no second tokenization (half of a chat start's tokenizing). Otherwise
        (a token across its edge) ``part`` is tokenized on its own."""
        # ``encode`` for the offsets (``encode_batch`` would release the GIL, but costs
        # ~2.5 % more CPU here: its thread pool's hand-offs).
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        offsets = enc.offsets
        start = text.rfind(part) if part else -1
        end = start + len(part)
        inside = [i for i, (a, b) in enumerate(offsets) if start <= a and b <= end]
        if (
            start >= 0
            and inside
            and offsets[inside[0]][0] == start
            and offsets[inside[-1]][1] == end
        ):
            part_ids = enc.ids[inside[0] : inside[-1] + 1]
        else:
            part_ids = self.tokenizer.encode_batch_fast([part], add_special_tokens=False)[0].ids
        return self._with_bos(enc.ids), part_ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        bos = self.card.bos_token_id
        if self.card.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids as a prompt holds it (special tokens' text kept)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        """Fill-in-the-middle (the completions endpoint's ``suffix``), laid out as
        llama.cpp's server does: ``<PRE> prefix <SUF> suffix <MID>``, BOS first where
        the vocabulary adds one; the completion is the middle. A model without the
        three tokens (found by the texts llama.cpp looks for) cannot do it: a 400."""
        found = [
            next((i for t in texts if (i := self.tokenizer.token_to_id(t)) is not None), None)
            for texts in _FIM_TEXTS
        ]
        pre, suf, mid = found
        if pre is None or suf is None or mid is None:
            raise InvalidRequest(
                f"The model {self.card.name!r} has no fill-in-the-middle tokens, so "
                "'suffix' cannot be used with it.",
                param="suffix",
            )
        parts = self.tokenizer.encode_batch_fast([prefix, suffix], add_special_tokens=False)
        return self._with_bos([pre, *parts[0].ids, suf, *parts[1].ids, mid])

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        """``encode(render_chat(...))``: the prompt ids an engine is given."""
        return self.encode(self.render_chat(messages, add_generation_prompt))
