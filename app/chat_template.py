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
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from app.errors import InvalidRequest, ModelError
from app.model_card import ModelCard, load_tokenizer

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


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template once (compiling costs milliseconds; rendering, microseconds).

    A template that does not compile is the model directory's fault: ``ModelError``.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now_with(datetime.now)
    try:
        return env.from_string(source)
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
    **extra: Any,
) -> str:
    """Render ``source`` with the variables transformers passes to chat templates.

    ``extra`` are further template variables (e.g. ``enable_thinking``), as
    ``apply_chat_template(**kwargs)`` allows. Errors raised while rendering are the
    conversation's fault (wrong roles, wrong content shape): ``InvalidRequest``.
    """
    template = compile_chat_template(source)
    variables: dict[str, Any] = {
        **extra,
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
        return template.render(**variables)
    except InvalidRequest:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidRequest(
            f"the model's chat template cannot render these messages ({type(exc).__name__})",
            param="messages",
        ) from exc


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
        if card.chat_template is not None:
            compile_chat_template(card.chat_template)  # fail at start-up, not per request

    @classmethod
    def from_card(cls, card: ModelCard, *, now: Clock = datetime.now) -> PromptBuilder:
        return cls(card, load_tokenizer(card), now=now)

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for a conversation."""
        if self.card.chat_template is None:
            raise InvalidRequest(
                f"model {self.card.name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        return render_chat_template(
            self.card.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.card.bos_token,
            eos_token=self.card.eos_token,
            tools=tools,
            now=self._now,
            **extra,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt text (special-token text in it becomes special ids)."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.card.bos_token_id
        if self.card.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """``encode(render_chat(...))``: the prompt ids an engine is given."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra))
