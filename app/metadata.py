"""OpenAI's ``metadata`` rules, one check for every endpoint that takes it (chat
completions, Responses, Batches): at most 16 string pairs, keys of at most 64
characters, values of at most 512."""

from __future__ import annotations

from typing import Any

from app.errors import InvalidRequest

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def check_metadata(value: Any) -> dict[str, str] | None:
    """``value`` as a plain dict (None when absent); a 400 naming the field otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("'metadata' must be an object of string values.", param="metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"'metadata' may hold at most {MAX_METADATA_PAIRS} pairs.", param="metadata"
        )
    out: dict[str, str] = {}
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequest(
                f"'metadata' keys must be at most {MAX_METADATA_KEY} characters.",
                param="metadata",
            )
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise InvalidRequest(
                f"'metadata' values must be strings of at most {MAX_METADATA_VALUE} characters.",
                param=f"metadata.{key}",
            )
        out[key] = item
    return out
