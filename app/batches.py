"""The OpenAI Files + Batches API as tokenrelay serves it: objects, input lines, results.

Pure (no I/O): the web tier (``web.batch``), the Redis store (``broker.batches``) and the
batch driver (``workers.batcher``) share these models, so the three cannot disagree on
what a batch looks like.

Objects
    ``FileObject``, ``BatchObject`` (with ``RequestCounts``, ``BatchErrors``) dump exactly
    the fields OpenAI returns, ids prefixed ``file-`` and ``batch_``.

Input
    ``plan_batch`` validates an input file up front, line by line: a bad line (not JSON,
    no ``custom_id``, wrong ``method``/``url``, a body the endpoint rejects, an unknown
    model, too long) becomes a ``RejectedLine`` that goes to the error file and counts as
    failed, while the rest still run. Only problems of the file as a whole (empty, too many
    lines, duplicate ``custom_id``) fail the batch, in ``BatchPlan.errors``.

Results
    ``BatchOutputLine`` is one line of the output or error file, in OpenAI's JSONL format.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from app.errors import STATUS_TYPES, InvalidRequest, PayloadTooLarge, error_body
from app.lenient_json import loads_lenient
from app.metadata import check_metadata

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
RESPONSES_ENDPOINT = "/v1/responses"  # lines are not stored; no previous_response_id
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
ENDPOINTS: tuple[str, ...] = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, RESPONSES_ENDPOINT)
# OpenAI accepts only "24h"; the window is the batch's deadline (then: expired).
COMPLETION_WINDOWS: dict[str, int] = {"24h": 24 * 3600}


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def new_batch_request_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


class BatchStatus(str, Enum):
    """A batch's lifecycle, as OpenAI names it.

    validating -> in_progress -> finalizing -> completed; validating -> failed (the file
    as a whole is unusable); in_progress -> cancelling -> cancelled; in_progress ->
    expired once the completion window has passed.
    """

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)
# The statuses a client may cancel from (OpenAI: a batch that is still running).
CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


class _Object(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class FileObject(_Object):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(_Object):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(_Object):
    """A problem with the input file as a whole (``line`` is 1-based when known)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(_Object):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class BatchObject(_Object):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


T = TypeVar("T")


class ListPage(_Object, Generic[T]):
    """A page of a cursor-paginated list (``after`` = the last id of the previous page)."""

    object: Literal["list"] = "list"
    data: list[T] = Field(default_factory=list)
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# ---------------------------------------------------------------------------------------
# Creating a batch
# ---------------------------------------------------------------------------------------


class BatchCreateRequest(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None
    # Newer SDKs may send it; output files here expire after ``batch_file_ttl_s``.
    output_expires_after: Any = None


def check_batch_request(req: BatchCreateRequest) -> dict[str, str] | None:
    """Validate endpoint, window and metadata; returns the metadata to store."""
    if req.endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"Invalid value for 'endpoint': {req.endpoint!r} is not supported; "
            f"use one of {', '.join(ENDPOINTS)}.",
            param="endpoint",
        )
    if req.completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequest(
            "Invalid value for 'completion_window': only '24h' is supported.",
            param="completion_window",
        )
    return check_metadata(req.metadata)


# ---------------------------------------------------------------------------------------
# Input lines
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedLine(Generic[T]):
    """A valid line: ``request`` is what ``build`` made of its body (e.g. a record)."""

    index: int  # 0-based line number in the file
    custom_id: str
    request: T


@dataclass(frozen=True, slots=True)
class RejectedLine:
    """A line that failed validation: it goes to the error file, counted as failed."""

    index: int
    custom_id: str | None
    error: BaseException


@dataclass(slots=True)
class BatchPlan(Generic[T]):
    lines: list[PlannedLine[T] | RejectedLine] = field(default_factory=list)
    errors: list[BatchError] = field(default_factory=list)  # non-empty: the batch fails

    @property
    def total(self) -> int:
        return len(self.lines)


def plan_batch(
    content: bytes,
    *,
    endpoint: str,
    build: Callable[[dict[str, Any]], T],
    max_line_bytes: int,
    max_requests: int,
) -> BatchPlan[T]:
    """Validate every line of an input file (blank lines and a leading BOM are skipped).

    ``build`` turns a line's ``body`` into a runnable request and raises a
    ``TokenRelayError`` for a body the endpoint would reject; anything else it raises is
    kept (as a generic 500 line), so one odd line can never stop a batch.
    """
    plan: BatchPlan[T] = BatchPlan()
    seen: dict[str, int] = {}
    # Editors on Windows save UTF-8 with a BOM; like an HTTP body, the file may start
    # with one (it is not part of line 1's JSON).
    physical = content.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    if sum(1 for raw in physical if raw.strip()) > max_requests:
        plan.errors.append(
            BatchError(
                code="too_many_requests",
                message=f"The input file has more than {max_requests} requests.",
            )
        )
        return plan
    for index, raw in enumerate(physical):
        if not raw.strip():
            continue
        line = _plan_line(index, raw, endpoint, build, max_line_bytes)
        plan.lines.append(line)
        if line.custom_id is None:
            continue
        if line.custom_id in seen:
            plan.errors.append(
                BatchError(
                    code="duplicate_custom_id",
                    message=f"The custom_id {line.custom_id!r} appears more than once "
                    f"(lines {seen[line.custom_id] + 1} and {index + 1}).",
                    param="custom_id",
                    line=index + 1,
                )
            )
        else:
            seen[line.custom_id] = index
    if not plan.lines:
        plan.errors.append(
            BatchError(code="empty_file", message="The input file has no request lines.")
        )
    return plan


def _plan_line(
    index: int,
    raw: bytes,
    endpoint: str,
    build: Callable[[dict[str, Any]], T],
    max_line_bytes: int,
) -> PlannedLine[T] | RejectedLine:
    custom_id: str | None = None
    try:
        if len(raw) > max_line_bytes:
            raise PayloadTooLarge(
                f"The request line is {len(raw)} bytes; the limit is {max_line_bytes}."
            )
        try:
            # Repaired like an HTTP body: broken UTF-8, raw control characters inside
            # strings and lone surrogates are kept as text, not rejected.
            line = loads_lenient(raw)
        except InvalidRequest as exc:
            raise InvalidRequest("The line is not valid JSON.", code="invalid_json") from exc
        if not isinstance(line, dict):
            raise InvalidRequest("The line must be a JSON object.", code="invalid_json")
        cid = line.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise InvalidRequest(
                "Missing required parameter: 'custom_id' (a non-empty string).",
                param="custom_id",
            )
        custom_id = cid
        if line.get("method") != "POST":
            raise InvalidRequest("The line's 'method' must be 'POST'.", param="method")
        if line.get("url") != endpoint:
            raise InvalidRequest(
                f"The line's 'url' ({line.get('url')!r}) must be the batch's endpoint "
                f"({endpoint!r}).",
                param="url",
                code="invalid_url",
            )
        body = line.get("body")
        if not isinstance(body, dict):
            raise InvalidRequest("The line's 'body' must be a JSON object.", param="body")
        if body.get("stream"):
            raise InvalidRequest("Streaming is not supported in batches.", param="body.stream")
        return PlannedLine(index, custom_id, build(body))
    except Exception as exc:
        return RejectedLine(index, custom_id, exc)


# ---------------------------------------------------------------------------------------
# Output and error files
# ---------------------------------------------------------------------------------------


class BatchResponse(_Object):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(_Object):
    code: str | None = None
    message: str


class BatchOutputLine(_Object):
    """One line of an output file (``response`` 200) or error file."""

    id: str = Field(default_factory=new_batch_request_id)
    custom_id: str | None
    response: BatchResponse | None = None
    error: LineError | None = None

    @property
    def ok(self) -> bool:
        return self.response is not None and self.response.status_code == 200

    def to_line(self) -> str:
        return self.model_dump_json()


def success_line(custom_id: str, request_id: str, body: dict[str, Any]) -> BatchOutputLine:
    return BatchOutputLine(
        custom_id=custom_id,
        response=BatchResponse(status_code=200, request_id=request_id, body=body),
    )


def rejected_line(custom_id: str | None, exc: BaseException, request_id: str) -> BatchOutputLine:
    """The error line of a request the endpoint would have answered with an error.

    ``response`` holds what the HTTP endpoint would have sent (status and error body),
    and ``error`` repeats its code and message for clients that only look there.
    """
    status, body = error_body(exc)
    return _error_line(custom_id, request_id, status, body)


def failed_line(custom_id: str, request_id: str, message: str, status: int) -> BatchOutputLine:
    """The error line of a request that failed while generating (an error event, whose
    message the streamer wrote to be shown to clients)."""
    body = {
        "error": {
            "message": message,
            "type": STATUS_TYPES.get(status, "internal_error"),
            "param": None,
            "code": None,
        }
    }
    return _error_line(custom_id, request_id, status, body)


def _error_line(
    custom_id: str | None, request_id: str, status: int, body: dict[str, Any]
) -> BatchOutputLine:
    err = body["error"]
    return BatchOutputLine(
        custom_id=custom_id,
        response=BatchResponse(status_code=status, request_id=request_id, body=body),
        error=LineError(code=err.get("code") or err.get("type"), message=err["message"]),
    )


def not_run_line(custom_id: str, code: str, message: str) -> BatchOutputLine:
    """The error line of a request the batch never finished (cancelled or expired)."""
    return BatchOutputLine(custom_id=custom_id, error=LineError(code=code, message=message))


NOT_RUN_MESSAGES = {
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}
