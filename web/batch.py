"""The OpenAI Files + Batches API: ``/v1/files`` and ``/v1/batches``.

The web tier only stores: files and batch objects go to Redis (``broker.files``,
``broker.batches``) and a new batch lands on the drivers' work list in ``validating``.
Validation, running the lines and writing the output/error files is the batch driver's
job (``workers.batcher``), so a batch keeps running while web processes restart, and any
number of web processes can answer for it. A cancel only marks the batch
``cancelling``; the driver stops it.

Errors are ``app.errors`` exceptions, answered in OpenAI's shape by ``web.errors``; API
keys are checked for every ``/v1/`` route by ``web.openai_routes``' app-wide hook.

Tenants: every object belongs to the key that created it (``web.auth.Tenant``); another
key's file or batch is answered 404, exactly as an id that does not exist, so ids of
other tenants cannot be probed. Uploads count against the key's file quota (429 naming
the quota). Downloads stream the file from Redis in chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from flask import Blueprint, Flask, Response, current_app, jsonify, request
from pydantic import ValidationError
from werkzeug.exceptions import RequestEntityTooLarge

from app.batches import (
    CANCELLABLE,
    COMPLETION_WINDOWS,
    BatchCreateRequest,
    BatchStatus,
    check_batch_request,
    new_batch_id,
)
from app.errors import InvalidRequest, NotFound, PayloadTooLarge
from app.protocol import validation_error_to_invalid_request
from app.settings import Settings
from broker.batches import BatchBody, BatchStore, Transition
from broker.files import FileQuota, FileStore
from web.auth import Tenant, tenant_of
from web.bodies import json_body
from web.context import runner_of, settings_of

blueprint = Blueprint("batch", __name__)

# Room for the multipart framing around the file itself.
MULTIPART_OVERHEAD = 64 * 1024
MAX_LIST_LIMIT = 100
UPLOAD_PURPOSES = ("batch",)


@dataclass(frozen=True, slots=True)
class BatchApi:
    """The stores this blueprint uses, built once per app from its service's Redis."""

    settings: Settings
    files: FileStore
    batches: BatchStore


@blueprint.record_once
def _on_register(state: Any) -> None:
    app: Flask = state.app
    settings = settings_of(app)
    runner = runner_of(app)
    keys = runner.keys
    app.extensions["tokenrelay.batches"] = BatchApi(
        settings,
        FileStore(
            runner.redis,
            keys,
            ttl_s=settings.batch_file_ttl_s,
            quota=FileQuota(settings.key_max_files, settings.key_max_file_bytes),
        ),
        BatchStore(runner.redis, keys, ttl_s=settings.batch_ttl_s),
    )


def _api() -> BatchApi:
    api: BatchApi = current_app.extensions["tokenrelay.batches"]
    return api


def _tenant() -> Tenant:
    return tenant_of(_api().settings, request.headers.get("Authorization"))


def _now() -> float:
    return runner_of(current_app).clock()


def _limit(default: int, most: int) -> int:
    raw = request.args.get("limit")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise InvalidRequest(f"'limit' must be between 1 and {most}.", param="limit")
    return value


# -- files -----------------------------------------------------------------------------


@blueprint.post("/v1/files")
def upload_file() -> Response:
    api = _api()
    most = api.settings.batch_max_file_bytes
    # The app-wide body limit is for JSON requests; files have their own (a setting).
    request.max_content_length = most + MULTIPART_OVERHEAD
    too_large = PayloadTooLarge(
        f"The file is too large: files may be at most {most} bytes.", param="file"
    )
    try:
        upload = request.files.get("file")
        purpose = request.form.get("purpose")
    except RequestEntityTooLarge as exc:
        raise too_large from exc
    if upload is None:
        raise InvalidRequest(
            "Missing required parameter: 'file' (send multipart/form-data).", param="file"
        )
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(
            f"Invalid value for 'purpose': {purpose!r}; only 'batch' is supported.",
            param="purpose",
        )
    content = upload.stream.read(most + 1)
    if len(content) > most:
        raise too_large
    obj = api.files.create(
        filename=upload.filename or "upload.jsonl",
        purpose=purpose,
        content=content,
        now=_now(),
        owner=_tenant().owner,
    )
    return jsonify(obj.to_dict())


@blueprint.get("/v1/files")
def list_files() -> Response:
    page = _api().files.page(
        after=request.args.get("after"),
        limit=_limit(default=MAX_LIST_LIMIT, most=10_000),
        purpose=request.args.get("purpose"),
        scope=_tenant().scope,
    )
    return jsonify(page.to_dict())


def _file_not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="id")


@blueprint.get("/v1/files/<file_id>")
def get_file(file_id: str) -> Response:
    obj = _api().files.get(file_id, _tenant().scope)
    if obj is None:
        raise _file_not_found(file_id)
    return jsonify(obj.to_dict())


def content_disposition(filename: str) -> str:
    """``attachment`` with an ASCII ``filename`` any client reads and, for a name that is
    not plain ASCII, the exact name as RFC 5987 ``filename*`` (RFC 6266 section 4.3)."""
    fallback = (
        "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename).strip()
        or "download"
    )
    header = f'attachment; filename="{fallback}"'
    if fallback != filename:
        header += f"; filename*=UTF-8''{quote(filename, safe='')}"
    return header


@blueprint.get("/v1/files/<file_id>/content")
def file_content(file_id: str) -> Response:
    api = _api()
    obj = api.files.get(file_id, _tenant().scope)
    if obj is None:
        raise _file_not_found(file_id)
    chunks = api.files.chunks(file_id, obj.bytes)
    first = next(chunks, None)  # a file deleted since ``get`` is a 404, not an empty 200
    if first is None and obj.bytes:
        raise _file_not_found(file_id)

    def body() -> Iterator[bytes]:
        if first:
            yield first
        yield from chunks

    response = Response(body(), mimetype="application/octet-stream")
    response.headers["Content-Length"] = str(obj.bytes)
    response.headers["Content-Disposition"] = content_disposition(obj.filename)
    return response


@blueprint.delete("/v1/files/<file_id>")
def delete_file(file_id: str) -> Response:
    if not _api().files.delete(file_id, _tenant().scope):
        raise _file_not_found(file_id)
    return jsonify({"id": file_id, "object": "file", "deleted": True})


# -- batches ---------------------------------------------------------------------------


@blueprint.post("/v1/batches")
def create_batch() -> Response:
    api = _api()
    try:
        req = BatchCreateRequest.model_validate(json_body(request))
    except ValidationError as exc:
        raise validation_error_to_invalid_request(exc) from exc
    metadata = check_batch_request(req)
    tenant = _tenant()
    source = api.files.get(req.input_file_id, tenant.scope)
    if source is None:
        raise NotFound(f"No such File object: {req.input_file_id}", param="input_file_id")
    if source.purpose != "batch":
        raise InvalidRequest(
            f"The file {req.input_file_id} has purpose {source.purpose!r}, not 'batch'.",
            param="input_file_id",
        )
    now = _now()
    body = BatchBody(
        id=new_batch_id(),
        endpoint=req.endpoint,
        input_file_id=req.input_file_id,
        completion_window=req.completion_window,
        created_at=int(now),
        expires_at=int(now) + COMPLETION_WINDOWS[req.completion_window],
        metadata=metadata,
    )
    return jsonify(api.batches.create(body, now, owner=tenant.owner).to_dict())


@blueprint.get("/v1/batches")
def list_batches() -> Response:
    page = _api().batches.page(
        after=request.args.get("after"),
        limit=_limit(default=20, most=MAX_LIST_LIMIT),
        scope=_tenant().scope,
    )
    return jsonify(page.to_dict())


def _batch_not_found(batch_id: str) -> NotFound:
    return NotFound(f"No such Batch object: {batch_id}", param="batch_id")


@blueprint.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str) -> Response:
    batch = _api().batches.get(batch_id, _tenant().scope)
    if batch is None:
        raise _batch_not_found(batch_id)
    return jsonify(batch.to_dict())


@blueprint.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    """Mark the batch ``cancelling``; its driver cancels the running lines, writes
    what finished to the output/error files and ends it ``cancelled``."""
    api = _api()
    scope = _tenant().scope
    outcome = api.batches.request_cancel(batch_id, _now(), scope)
    batch = api.batches.get(batch_id, scope)
    if outcome is Transition.MISSING or batch is None:
        raise _batch_not_found(batch_id)
    if outcome is not Transition.DONE and batch.status not in (
        *CANCELLABLE,
        BatchStatus.CANCELLING,
        BatchStatus.CANCELLED,
    ):
        raise InvalidRequest(
            f"Cannot cancel a batch with status '{batch.status.value}'.", param="batch_id"
        )
    return jsonify(batch.to_dict())
