"""W3C Trace Context (``traceparent``), read and written without OpenTelemetry.

A request carries its trace context from the web tier to workers and streamers in its
record (``RequestRecord.trace``: the carrier dict OpenTelemetry's propagators read and
write) and in its Celery message's headers. Everything that only needs to *look* at a
context (the JSON logs' ``trace_id``, the web tier checking a client's header) uses
these functions, so that a process with tracing off never imports OpenTelemetry
(``broker.tracing`` does, only when tracing is on).

The format (https://www.w3.org/TR/trace-context/#traceparent-header):
``00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>``; all-zero ids are invalid,
version ``ff`` is invalid, and a future version may append fields after the flags.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["TRACEPARENT", "TRACESTATE", "TraceParent", "parse_traceparent", "trace_id_of"]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


class TraceParent(NamedTuple):
    """A valid ``traceparent``'s parts (lowercase hex)."""

    trace_id: str
    parent_id: str
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags:02x}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The parts of a ``traceparent`` header, or None when it is absent or invalid (an
    invalid one is ignored, as the specification says: a new trace is started)."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return TraceParent(trace_id, parent_id, int(flags, 16))


def trace_id_of(carrier: Mapping[str, str] | None) -> str:
    """The trace id in a carrier (``RequestRecord.trace``), or "" when it has none."""
    if not carrier:
        return ""
    parsed = parse_traceparent(carrier.get(TRACEPARENT))
    return parsed.trace_id if parsed is not None else ""
