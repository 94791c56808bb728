"""The usage ledger's pure half: what one finished request counts, and how the ledger's
hashes are named, keyed and read back (issue 44).

Every finished request is counted once, by the streamer that writes its terminal event,
in the same Lua call as that event (``broker.usage_ledger``): per owner (the request
record's ``owner``: an API key's hash or managed key id, "" without keys), model and API,
into one hash per UTC day, one per UTC hour and an all-time hash. A field is
``owner␟model␟api␟metric`` (␟ = the unit separator, which no owner, API or metric
holds; a model name that did would still parse, it is the middle part) and its value a
count. The API is the endpoint the client called (``/v1/chat/completions``,
``/v1/completions``, ``/v1/messages``, ``/v1/responses``); every batch line is counted
under ``batch`` whatever its endpoint, so a deployment sees batch traffic apart.

This module does no I/O: the streamer builds ``UsageCount`` values, the web tier parses
a query (``UsageQuery``) and folds the hashes it read into rows (``fold_rows``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from app.errors import InvalidRequest
from app.records import RequestRecord

SEP = "\x1f"
BATCH_API = "batch"
# Metric -> its field suffix in the ledger's hashes (one letter: a field per metric per
# (owner, model, api) per hour is most of the ledger's memory).
METRICS: dict[str, str] = {
    "requests": "n",
    "prompt_tokens": "p",
    "cached_tokens": "k",
    "completion_tokens": "c",
    "errors": "e",
}
_BY_CODE = {code: name for name, code in METRICS.items()}

Granularity = Literal["day", "hour"]
DAY_FORMAT = "%Y-%m-%d"
HOUR_FORMAT = "%Y-%m-%dT%H"
# The widest range one query may read: one hash per period, read in one round trip.
MAX_PERIODS: dict[str, int] = {"day": 400, "hour": 744}


def api_of(record: RequestRecord) -> str:
    """The API a request is counted under: ``batch`` for a batch line, else the
    endpoint its client called."""
    if record.queue == "batch":
        return BATCH_API
    return record.api or record.endpoint


def day_of(at: float) -> str:
    """The UTC day of unix time ``at``: ``YYYY-MM-DD`` (the day hash's name)."""
    return time.strftime(DAY_FORMAT, time.gmtime(at))


def hour_of(at: float) -> str:
    """The UTC hour of unix time ``at``: ``YYYY-MM-DDTHH`` (the hour hash's name)."""
    return time.strftime(HOUR_FORMAT, time.gmtime(at))


@dataclass(frozen=True, slots=True)
class UsageCount:
    """What one finished request adds to the ledger, at ``at`` (unix time of its end).

    ``error``: it ended with a request-level error (no worker, deadline, a fault) or a
    choice ended with ``finish_reason: "error"``; a cancelled request is not an error.
    """

    owner: str
    model: str
    api: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: bool
    at: float

    @classmethod
    def of(
        cls, record: RequestRecord, usage: Mapping[str, Any], *, error: bool, at: float
    ) -> UsageCount:
        """The count of ``record``'s request, from the usage object its client reads
        (OpenAI's: ``prompt_tokens``, ``completion_tokens``,
        ``prompt_tokens_details.cached_tokens``)."""
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens", 0) if isinstance(details, Mapping) else 0
        return cls(
            owner=record.owner,
            model=record.model,
            api=api_of(record),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            cached_tokens=int(cached or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            error=error,
            at=at,
        )

    @property
    def label(self) -> str:
        """The fields' common start: ``owner␟model␟api␟`` (the metric's code follows)."""
        return f"{self.owner}{SEP}{self.model}{SEP}{self.api}{SEP}"

    @property
    def increments(self) -> tuple[int, int, int, int]:
        """Prompt, cached, completion tokens and errors, in the order the ledger's script
        takes them (requests are always 1)."""
        return (self.prompt_tokens, self.cached_tokens, self.completion_tokens, int(self.error))


def parse_field(name: str) -> tuple[str, str, str, str] | None:
    """A ledger field -> (owner, model, api, metric name); None when it is not one."""
    owner, sep, rest = name.partition(SEP)
    parts = rest.rsplit(SEP, 2)
    if not sep or len(parts) != 3 or parts[2] not in _BY_CODE:
        return None
    return owner, parts[0], parts[1], _BY_CODE[parts[2]]


# -- the read side ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """What ``GET /admin/usage`` asks for: the periods to read (inclusive, oldest first)
    and the filters (None: any). ``key`` matches an owner or its first 16 characters."""

    granularity: Granularity
    periods: list[str]
    key: str | None = None
    model: str | None = None
    api: str | None = None

    @classmethod
    def parse(cls, args: Mapping[str, str], now: float) -> UsageQuery:
        """The query string's ``granularity`` (day, the default, or hour), ``from`` and
        ``to`` (``YYYY-MM-DD``, or ``YYYY-MM-DDTHH`` with hours; inclusive; ``to``
        defaults to now, ``from`` to 30 days or 24 hours before ``to``), ``key``,
        ``model`` and ``api``. Raises ``InvalidRequest`` naming the bad parameter."""
        granularity = args.get("granularity") or "day"
        if granularity not in MAX_PERIODS:
            raise InvalidRequest(
                "granularity must be 'day' or 'hour'.", param="granularity", code="invalid_value"
            )
        hourly = granularity == "hour"
        step = timedelta(hours=1) if hourly else timedelta(days=1)
        end = _parse_period(args.get("to"), "to", hourly, end=True)
        if end is None:
            end = _truncate(datetime.fromtimestamp(now, timezone.utc), hourly)
        start = _parse_period(args.get("from"), "from", hourly, end=False)
        if start is None:
            start = end - step * (23 if hourly else 29)
        if start > end:
            raise InvalidRequest("'from' is after 'to'.", param="from", code="invalid_value")
        count = (end - start) // step + 1
        most = MAX_PERIODS[granularity]
        if count > most:
            unit = "hours" if hourly else "days"
            raise InvalidRequest(
                f"The range spans {count} {unit}; at most {most} {unit} may be read at once "
                "(narrow 'from' and 'to').",
                param="from",
                code="range_too_large",
            )
        fmt = HOUR_FORMAT if hourly else DAY_FORMAT
        periods = [(start + step * i).strftime(fmt) for i in range(count)]
        return cls(
            granularity="hour" if hourly else "day",
            periods=periods,
            key=args.get("key") or None,
            model=args.get("model") or None,
            api=args.get("api") or None,
        )

    def matches(self, owner: str, model: str, api: str) -> bool:
        if self.key is not None and owner != self.key and owner[:16] != self.key:
            return False
        if self.model is not None and model != self.model:
            return False
        return self.api is None or api == self.api


def _parse_period(raw: str | None, param: str, hourly: bool, *, end: bool) -> datetime | None:
    """``YYYY-MM-DD`` or ``YYYY-MM-DDTHH`` (UTC) as the first period it names (the last,
    for a day given as ``to`` with hours); None when not given."""
    if not raw:
        return None
    for fmt, has_hour in ((HOUR_FORMAT, True), (DAY_FORMAT, False)):
        try:
            at = datetime.strptime(raw, fmt).replace(tzinfo=timezone.utc)
        except ValueError:
            continue
        if not 1970 <= at.year <= 9000:  # no ledger before; and room to step either way
            break
        if has_hour and not hourly:
            raise InvalidRequest(
                f"'{param}' names an hour ({raw!r}); with granularity=day use YYYY-MM-DD.",
                param=param,
                code="invalid_value",
            )
        if hourly and not has_hour and end:
            at += timedelta(hours=23)
        return at
    raise InvalidRequest(
        f"'{param}' must be a UTC date, YYYY-MM-DD (or YYYY-MM-DDTHH with granularity=hour); "
        f"got {raw!r}.",
        param=param,
        code="invalid_value",
    )


def _truncate(at: datetime, hourly: bool) -> datetime:
    at = at.replace(minute=0, second=0, microsecond=0)
    return at if hourly else at.replace(hour=0)


@dataclass(slots=True)
class UsageRow:
    """One (owner, model, api, period)'s counts, as ``GET /admin/usage`` answers it.
    ``key`` is the owner's first 16 characters: a managed key's id whole, an
    environment key's hash prefix (never a secret)."""

    owner: str
    model: str
    api: str
    period: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METRICS, 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.owner[:16],
            "model": self.model,
            "api": self.api,
            "period": self.period,
            **self.counts,
        }


def fold_rows(
    buckets: Iterable[tuple[str, Mapping[Any, Any]]], query: UsageQuery
) -> list[UsageRow]:
    """The rows of ``buckets`` (period, its hash as read) that ``query`` matches, ordered
    by period, then key, model and api."""
    rows: dict[tuple[str, str, str, str], UsageRow] = {}
    for period, fields in buckets:
        for raw_name, raw_value in fields.items():
            parsed = parse_field(_text(raw_name))
            if parsed is None:
                continue
            owner, model, api, metric = parsed
            if not query.matches(owner, model, api):
                continue
            row = rows.get((period, owner, model, api))
            if row is None:
                row = rows[(period, owner, model, api)] = UsageRow(owner, model, api, period)
            row.counts[metric] += int(raw_value)
    return [rows[k] for k in sorted(rows)]


def totals_of(rows: Iterable[UsageRow]) -> dict[str, int]:
    """Every metric summed over ``rows``."""
    out = dict.fromkeys(METRICS, 0)
    for row in rows:
        for name, value in row.counts.items():
            out[name] += value
    return out


def fold_totals(fields: Mapping[Any, Any]) -> dict[tuple[str, str, str], dict[str, int]]:
    """The all-time hash as read -> (owner, model, api) -> metric -> count."""
    out: dict[tuple[str, str, str], dict[str, int]] = {}
    for raw_name, raw_value in fields.items():
        parsed = parse_field(_text(raw_name))
        if parsed is None:
            continue
        owner, model, api, metric = parsed
        out.setdefault((owner, model, api), dict.fromkeys(METRICS, 0))[metric] += int(raw_value)
    return out


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
