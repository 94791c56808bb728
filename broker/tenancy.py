"""What one API key may do, for admission: its rate limits, in-flight quota and weight.

The limits come from the key's record when it is a managed key (``broker.api_keys``),
else from the server's settings (every key in ``TOKENRELAY_API_KEYS`` alike). Without
keys configured nobody is limited: an owner stands for one client only when keys are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.records import RequestRecord
from app.settings import Settings
from broker.api_keys import KeyCache, KeyLimits
from broker.requests import RateLimit


@dataclass
class KeyPolicy:
    """The per-key part of admission (``broker.runner.Runner``); ``cache`` is set by the
    web tier, which follows the managed keys (``KeyCache``)."""

    settings: Settings
    cache: KeyCache | None = None

    def limits(self, owner: str) -> KeyLimits | None:
        """The owner's own limits (a managed key), else None."""
        key = self.cache.key(owner) if self.cache is not None and owner else None
        return None if key is None else key.limits

    def in_flight_limit(self, owner: str) -> int:
        own = self.limits(owner)
        return own.max_in_flight if own and own.max_in_flight else self.settings.key_max_in_flight

    def weight(self, owner: str) -> int:
        own = self.limits(owner)
        return own.weight if own else 1

    def rate(self, owner: str) -> tuple[int, int]:
        """(requests, tokens) per minute for ``owner``; 0: none."""
        if not owner or not self.settings.api_keys:
            return 0, 0
        own = self.limits(owner)
        rpm = own.requests_per_minute if own and own.requests_per_minute else 0
        tpm = own.tokens_per_minute if own and own.tokens_per_minute else 0
        return (
            rpm or self.settings.key_requests_per_minute,
            tpm or self.settings.key_tokens_per_minute,
        )

    def rate_for(self, record: RequestRecord) -> RateLimit:
        """The limits ``record`` is admitted under, with the tokens it reserves. Batch
        lines are not rate limited (a batch has its own limits and 24 h)."""
        if record.queue != "interactive":
            return RateLimit()
        rpm, tpm = self.rate(record.owner)
        return RateLimit(rpm, tpm, reserved_tokens(record) if tpm else 0)


def reserved_tokens(record: RequestRecord) -> int:
    """What a request may use at most: its prompts and every choice's max tokens."""
    return sum(len(p) for p in record.prompts) + record.max_tokens * record.num_choices


def unused_tokens(record: RequestRecord, usage: dict[str, Any] | None) -> int:
    """What a finished request reserved and did not use (its usage event's counts)."""
    if not usage:
        return 0
    used = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    return max(reserved_tokens(record) - used, 0)
