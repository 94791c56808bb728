"""A request's ``timings`` in llama.cpp server's shape, from the streamer's usage event.

The streamer measures in seconds on its usage event (``usage["timings"]``: ``queue_s``
from arrival to a worker taking the request, ``ttft_s`` from arrival to the first
token, ``decode_s`` from the first token to the end, ``e2e_s``). Clients of llama.cpp's
server read milliseconds, counts and rates instead (``prompt_n``, ``prompt_ms``,
``predicted_per_second``, ...); ``timings_from_usage`` converts one into the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.response_models import Timings

__all__ = ["timings_from_usage"]


def _ms(seconds: Any) -> float | None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    return round(max(float(seconds), 0.0) * 1000.0, 3)


def _rates(n: int, ms: float | None) -> tuple[float | None, float | None]:
    """(ms per token, tokens per second); null when either side is zero or unknown."""
    if ms is None or ms <= 0 or n <= 0:
        return None, None
    return round(ms / n, 3), round(n * 1000.0 / ms, 3)


def timings_from_usage(raw_usage: Mapping[str, Any] | None) -> Timings | None:
    """The client's ``timings`` for a usage event, or None when it carries no timings.

    Prompt time is the time to first token less the queue time (the first token comes
    out of the prompt's evaluation); both are measured from the request's arrival, and
    it is null when either was not measured rather than a guess.
    """
    if not raw_usage:
        return None
    raw = raw_usage.get("timings")
    if not isinstance(raw, Mapping):
        return None
    details = raw_usage.get("prompt_tokens_details")
    cached = int(details.get("cached_tokens", 0) or 0) if isinstance(details, Mapping) else 0
    prompt_tokens = int(raw_usage.get("prompt_tokens", 0) or 0)
    prompt_n = max(prompt_tokens - cached, 0)
    predicted_n = int(raw_usage.get("completion_tokens", 0) or 0)
    queue_ms = _ms(raw.get("queue_s"))
    ttft_ms = _ms(raw.get("ttft_s"))
    prompt_ms = (
        None if ttft_ms is None or queue_ms is None else round(max(ttft_ms - queue_ms, 0.0), 3)
    )
    predicted_ms = _ms(raw.get("decode_s"))
    prompt_per_token_ms, prompt_per_second = _rates(prompt_n, prompt_ms)
    predicted_per_token_ms, predicted_per_second = _rates(predicted_n, predicted_ms)
    return Timings(
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_per_token_ms,
        prompt_per_second=prompt_per_second,
        predicted_n=predicted_n,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_per_token_ms,
        predicted_per_second=predicted_per_second,
        cache_n=cached,
        queue_ms=queue_ms,
        ttft_ms=ttft_ms,
    )
