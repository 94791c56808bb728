"""``POST /tokenize`` and ``POST /detokenize``: what clients use to count and trim
context before they send it (issue 42). Pure: a model's ``PromptBuilder`` does the work.

Two request shapes are understood, each answered in its own:

- vLLM's: ``{"prompt": ...}`` (``add_special_tokens``, default true: BOS where the
  model adds one) or ``{"messages": [...]}`` (rendered with the chat template, exactly
  the ids a chat request's prompt would be), ``return_token_strs``; answered
  ``{"count", "max_model_len", "tokens", "token_strs"}``; ``{"tokens": [...]}`` to
  detokenize, answered ``{"prompt": text}``.
- llama.cpp's server's: ``{"content": ...}`` (``add_special``, default false;
  ``with_pieces``), answered ``{"tokens": [...]}`` (``[{"id", "piece"}]`` with pieces);
  detokenize answers ``{"content": text}`` too, so either client finds its key.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator

from app.chat_message import ChatMessage
from app.chat_template import PromptBuilder
from app.errors import InvalidRequest
from app.protocol import RESERVED_TEMPLATE_VARIABLES
from app.token_texts import TokenTexts
from app.tools import ToolDefinition
from app.validation import RequestModel, invalid, validation_error_to_invalid_request


class _Tokenize(RequestModel):
    model: str | None = None
    return_token_strs: bool = False


class TokenizeText(_Tokenize):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(_Tokenize):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if set(value or ()) & RESERVED_TEMPLATE_VARIABLES:
            raise invalid("'chat_template_kwargs' may not set the request's own variables.")
        return value


class LlamaCppTokenize(RequestModel):
    content: str
    add_special: bool = False
    with_pieces: bool = False
    model: str | None = None


class Detokenize(RequestModel):
    tokens: list[int]
    model: str | None = None


def _parse(model: type[RequestModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_invalid_request(exc) from exc


def tokenize(body: Any, prompts: PromptBuilder) -> dict[str, Any]:
    """The answer to a ``/tokenize`` body (either shape) for ``prompts``' model."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    if "content" in body:
        req = _parse(LlamaCppTokenize, body)
        ids = _ids(prompts, req.content, special=req.add_special)
        if not req.with_pieces:
            return {"tokens": ids}
        texts = TokenTexts(prompts.tokenizer, skip_special_tokens=False)
        return {"tokens": [{"id": i, "piece": _piece(texts, i)} for i in ids]}
    if "messages" in body:
        chat = _parse(TokenizeChat, body)
        if chat.continue_final_message and chat.add_generation_prompt:
            raise InvalidRequest(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                param="continue_final_message",
            )
        text = prompts.render_chat(
            [m.for_template() for m in chat.messages],
            chat.add_generation_prompt,
            tools=[t.for_template() for t in chat.tools] if chat.tools else None,
            variables=chat.chat_template_kwargs,
        )
        if chat.continue_final_message:  # the prompt ends inside the last message
            last = chat.messages[-1].text
            cut = text.rfind(last) if last else -1
            text = text[: cut + len(last)] if cut >= 0 else text
        ids, wants_strs = prompts.encode(text), chat.return_token_strs
    else:
        req_text = _parse(TokenizeText, body)
        ids = _ids(prompts, req_text.prompt, special=req_text.add_special_tokens)
        wants_strs = req_text.return_token_strs
    return {
        "count": len(ids),
        "max_model_len": prompts.card.context_length,
        "tokens": ids,
        "token_strs": _pieces(prompts, ids) if wants_strs else None,
    }


def detokenize(body: Any, prompts: PromptBuilder) -> dict[str, Any]:
    """The answer to a ``/detokenize`` body: the text of the ids, special tokens' text
    kept (what ``/tokenize`` of that text gives back)."""
    req = _parse(Detokenize, body)
    vocab = prompts.card.vocab_size
    if any(t < 0 or (vocab is not None and t >= vocab) for t in req.tokens):
        raise InvalidRequest(f"Token ids must be in [0, {vocab}).", param="tokens")
    text = prompts.decode(req.tokens)
    return {"prompt": text, "content": text}


def _ids(prompts: PromptBuilder, text: str, *, special: bool) -> list[int]:
    """``special``: BOS where the model adds one (special tokens' text is parsed as
    special tokens either way, as a prompt's is)."""
    if special:
        return prompts.encode(text)
    return list(prompts.tokenizer.encode(text, add_special_tokens=False).ids)


def _piece(texts: TokenTexts, token_id: int) -> str | list[int]:
    """llama.cpp's ``with_pieces``: the token's text when its bytes are UTF-8 on their
    own, else the bytes (part of a character split across tokens)."""
    raw = bytes(texts.bytes(token_id))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _pieces(prompts: PromptBuilder, ids: list[int]) -> list[str]:
    """Each id's vocabulary entry, as vLLM's ``token_strs`` (``convert_ids_to_tokens``:
    a byte-level piece keeps its ``Ġ``)."""
    return [prompts.tokenizer.id_to_token(i) or "" for i in ids]
