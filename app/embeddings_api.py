"""``POST /v1/embeddings`` (issue 42), its pure half: the request checked and turned into
token ids with the model's tokenizer, and the response in OpenAI's shape (float lists,
or base64 of little-endian float32, as the openai SDK asks by default).

The vectors come from a worker of the model (``broker.embeddings``); every input of a
request goes in one batch there.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from app.chat_template import PromptBuilder
from app.errors import ContextLengthExceeded, InvalidRequest
from app.validation import RequestModel, invalid, validation_error_to_invalid_request

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
# The most tokens one input may have (a worker's embedding context: workers.embedder).
EMBED_MAX_TOKENS = 8192

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(RequestModel):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: EmbeddingInput) -> EmbeddingInput:
        items: list[Any] = [value] if isinstance(value, str) else list(value)
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            items = [value]  # one input given as token ids
        if not items or len(items) > MAX_INPUTS:
            raise invalid(f"'input' must hold 1 to {MAX_INPUTS} inputs.")
        if any(not item for item in items):
            raise invalid("'input' cannot contain an empty string or token list.")
        return value

    @field_validator("dimensions")
    @classmethod
    def _check_dimensions(cls, value: int | None) -> int | None:
        if value is not None:
            raise invalid(
                "'dimensions' is not supported: the vectors are the model's own width "
                "(see the 'embedding' length in the response); truncate them yourself."
            )
        return value

    def inputs(self, prompts: PromptBuilder) -> list[list[int]]:
        """Each input's token ids: text tokenized as a prompt is (BOS where the model
        adds one), token ids checked against the vocabulary and the length limit."""
        value = self.input
        if isinstance(value, str):
            texts: list[Any] = [value]
        elif value and all(isinstance(t, int) for t in value):
            texts = [value]
        else:
            texts = list(value)
        encoded = iter(prompts.encode_many([t for t in texts if isinstance(t, str)]))
        ids = [t if isinstance(t, list) else next(encoded) for t in texts]
        vocab = prompts.card.vocab_size
        longest = min(prompts.card.context_length, EMBED_MAX_TOKENS)
        for i, one in enumerate(ids):
            if vocab is not None and any(not 0 <= t < vocab for t in one):
                raise InvalidRequest(f"Token ids must be in [0, {vocab}).", param="input")
            if len(one) > longest:
                raise ContextLengthExceeded(
                    f"Input {i} has {len(one)} tokens; at most {longest} can be embedded.",
                    param="input",
                )
        return ids


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    try:
        return EmbeddingRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_invalid_request(exc) from exc


def embedding_response(
    vectors: list[list[float]], *, model: str, tokens: int, encoding: str
) -> dict[str, Any]:
    """OpenAI's ``list`` of ``embedding`` objects, in input order, with usage."""

    def encoded(vector: list[float]) -> list[float] | str:
        if encoding == "base64":
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector

    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encoded(v)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
