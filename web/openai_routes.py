"""The OpenAI-compatible HTTP API: completions (SSE or JSON), models, health.

Every generation route does the same four things through ``GenerationService``:
parse + validate (``app.protocol``), build the request record (template, tokenize,
context check), submit (admission: 429), then read the output stream and either
stream it as SSE (``web.responses.ChunkStream``) or fold it into one body
(``ResponseFold``).

Streaming responses first wait (at most one keep-alive interval) for the first
meaningful event, so an error that happens before any output — a worker rejecting the
prompt, no worker at all — is answered with its HTTP status like a non-streamed
request, instead of a 200 whose body only says "error". Later errors are SSE error
events. Whatever happens, the stream ends with ``data: [DONE]``, and the request's
admission slot is given back: ``finish`` when the output was read to its end,
``cancel`` otherwise (a client that disconnected, an error mid-way), which also stops
the worker. That bookkeeping runs in the response's close callback, which the WSGI
server calls even when it never started iterating the body.

Also installs two app-wide hooks: the ``x-request-id`` response header (the client's
``X-Request-Id`` when it sent a sane one, else the request's id) and API-key checks on
``/v1/`` routes (``web.auth``).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterator
from itertools import chain
from typing import Any

from flask import Blueprint, Flask, Response, current_app, g, request

from app.errors import NotFound, NotImplementedFeature, ServiceUnavailable
from app.fold import ResponseFold
from app.messages import OutputEvent, OutputKind
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from app.response_models import (
    ModelList,
    ModelObject,
)
from app.records import RequestRecord
from web import auth, sse
from web.app import service_of, settings_of
from web.bodies import json_body
from web.errors import PipelineError
from web.metrics import RequestTimer, WebMetrics, metrics_of
from web.responses import ChunkStream, ResponseShape, event_error
from web.service import GenerationService

logger = logging.getLogger(__name__)

blueprint = Blueprint("openai", __name__)

# How long past a request's deadline the web tier waits for the streamers' own
# deadline error before giving up itself (the "no hang" guarantee's last line).
DEADLINE_GRACE_S = 30.0
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

Item = tuple[str, OutputEvent] | None


# -- app-wide hooks ---------------------------------------------------------------------


@blueprint.record_once
def _on_register(state: Any) -> None:
    app: Flask = state.app
    app.extensions.setdefault("tokenrelay.started", int(time.time()))


@blueprint.before_app_request
def _before() -> None:
    client_id = request.headers.get("X-Request-Id", "")
    g.client_request_id = bool(_CLIENT_ID.fullmatch(client_id))
    g.request_id = client_id if g.client_request_id else uuid.uuid4().hex
    if request.path.startswith("/v1/"):
        keys = settings_of(current_app).api_keys
        view = current_app.view_functions.get(request.endpoint or "")
        if keys and not auth.is_exempt(view):
            auth.check_key(keys, auth.bearer_key(request.headers.get("Authorization")))


@blueprint.after_app_request
def _request_id_header(response: Response) -> Response:
    response.headers["x-request-id"] = getattr(g, "request_id", "") or uuid.uuid4().hex
    return response


# -- health and models --------------------------------------------------------------------


@blueprint.get("/health")
def health() -> dict[str, str]:
    """Liveness: the process answers. Readiness is ``/ready``."""
    return {"status": "ok"}


@blueprint.get("/ready")
def ready() -> dict[str, str]:
    """503 with the reason unless Redis, a worker for our model and a streamer are up."""
    ok, reason = service_of(current_app).readiness()
    if not ok:
        raise ServiceUnavailable(reason, code="not_ready")
    return {"status": "ready"}


def _model_object() -> ModelObject:
    svc = service_of(current_app)
    return ModelObject(
        id=svc.model_name,
        created=current_app.extensions["tokenrelay.started"],
        max_model_len=svc.card.context_length,
    )


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.to_json(), status=status, mimetype="application/json")


@blueprint.get("/v1/models")
def list_models() -> Response:
    return _json(ModelList(data=[_model_object()]))


@blueprint.get("/v1/models/<path:model_id>")
def get_model(model_id: str) -> Response:
    model = _model_object()
    if model_id != model.id:
        raise NotFound(
            f"The model '{model_id}' does not exist.", param="model", code="model_not_found"
        )
    return _json(model)


# -- generation ---------------------------------------------------------------------------


@blueprint.post("/v1/chat/completions")
def chat_completions() -> Response:
    settings = settings_of(current_app)
    req = parse_chat_request(
        json_body(request),
        max_stop_sequences=settings.max_stop_sequences,
        max_n=settings.max_n,
    )
    if req.uses_deprecated_functions:
        raise NotImplementedFeature(
            "The deprecated 'functions' / 'function_call' API is not supported by this server.",
            param="functions" if req.functions is not None else "function_call",
            code="unsupported_parameter",
        )
    record = service_of(current_app).chat_record(req)
    return _generate(req, record, chat=True, endpoint="/v1/chat/completions")


@blueprint.post("/v1/completions")
def completions() -> Response:
    settings = settings_of(current_app)
    req = parse_completion_request(
        json_body(request),
        max_stop_sequences=settings.max_stop_sequences,
        max_n=settings.max_n,
    )
    record = service_of(current_app).completion_record(req)
    return _generate(req, record, chat=False, endpoint="/v1/completions")


def _generate(
    req: ChatCompletionRequest | CompletionRequest,
    record: RequestRecord,
    *,
    chat: bool,
    endpoint: str,
) -> Response:
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    svc = service_of(app)
    settings = settings_of(app)
    rid = record.request_id
    if not g.client_request_id:
        g.request_id = rid
    svc.submit(record)  # QueueFull -> 429 with Retry-After
    timer = RequestTimer(metrics_of(app), endpoint, record.num_choices)
    timer.begin()
    shape = ResponseShape(
        chat=chat,
        response_id=("chatcmpl-" if chat else "cmpl-") + rid,
        model=record.model,
        created=int(record.created),
        num_choices=record.num_choices,
        logprobs=record.sampling.logprobs is not None,
        include_usage=req.include_usage,
    )
    run = _Run(svc, rid, timer, guard=record.deadline + DEADLINE_GRACE_S)
    events = svc.events(rid, block_ms=max(int(settings.sse_keepalive_s * 1000), 1))
    try:
        if req.stream:
            return _stream(run, shape, events, metrics_of(app), endpoint)
        return _fold(run, shape, events)
    except BaseException:
        run.close()
        raise


class _Run:
    """The end-of-request bookkeeping of one generation, done exactly once."""

    def __init__(
        self, svc: GenerationService, rid: str, timer: RequestTimer, *, guard: float
    ) -> None:
        self.svc = svc
        self.rid = rid
        self.timer = timer
        self.guard = guard  # unix time after which we stop waiting for output
        self.complete = False  # the terminal event was read: nothing left to stop
        self.disconnected = False  # the client went away mid-stream
        self.usage: dict[str, Any] | None = None
        self._closed = False

    def overdue(self) -> bool:
        return self.svc.clock() > self.guard

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.complete:
                self.svc.finish(self.rid)
            else:
                self.svc.cancel(self.rid)
        except Exception:
            logger.exception("could not release request %s", self.rid)
        self.timer.end(self.usage, disconnected=self.disconnected)


def _timeout() -> PipelineError:
    return PipelineError("The request timed out waiting for output.", 504)


def _fold(run: _Run, shape: ResponseShape, events: Iterator[Item]) -> Response:
    """The whole output in one body; any error (even of one choice) is the HTTP status,
    since a non-streaming client has no other way to learn of it."""
    fold = ResponseFold(
        "chat" if shape.chat else "completion",
        num_choices=shape.num_choices,
        model=shape.model,
        response_id=shape.response_id,
        created=shape.created,
        logprobs=shape.logprobs,
    )
    error: PipelineError | None = None
    raw_usage: dict[str, Any] | None = None
    for item in events:
        if item is None:
            if run.overdue():
                error = _timeout()
                break
            continue
        ev = item[1]
        error = event_error(ev)
        if error is not None:
            run.complete = ev.kind is OutputKind.ERROR
            break
        if ev.kind is OutputKind.DELTA and ev.text:
            run.timer.text_sent()
        elif ev.kind is OutputKind.USAGE:
            raw_usage = ev.usage
        fold.feed(ev)
        if fold.done:
            run.complete = True
            break
    run.usage = raw_usage
    run.close()
    if error is not None:
        raise error
    return _json(fold.response())


def _peek(run: _Run, events: Iterator[Item]) -> list[Item]:
    """Events up to the first one that shows how the request starts.

    Raises the request's error if that comes first; returns [] after one keep-alive
    interval without output (the stream then starts and keeps the client waiting).
    """
    seen: list[Item] = []
    for item in events:
        if item is None:
            break
        error = event_error(item[1])
        if error is not None:
            run.complete = item[1].kind is OutputKind.ERROR
            raise error
        seen.append(item)
        ev = item[1]
        if ev.kind is not OutputKind.DELTA or ev.text or ev.logprobs:
            break
    return seen


def _stream(
    run: _Run,
    shape: ResponseShape,
    events: Iterator[Item],
    metrics: WebMetrics,
    endpoint: str,
) -> Response:
    first = _peek(run, events)

    def body() -> Iterator[str]:
        chunks = ChunkStream(shape)
        try:
            opening = chunks.opening()
            if opening:
                yield "".join(sse.data_frame(c.to_json()) for c in opening)
            for item in chain(first, events):
                if item is None:
                    if run.overdue():
                        chunks.error = _timeout()
                    else:
                        yield sse.KEEPALIVE
                        continue
                else:
                    ev = item[1]
                    out = chunks.feed(ev)
                    if out:
                        if ev.kind is OutputKind.DELTA and ev.text:
                            run.timer.text_sent()
                        yield "".join(sse.data_frame(c.to_json()) for c in out)
                if chunks.error is not None:
                    metrics.stream_errors.labels(endpoint, chunks.error.type).inc()
                    yield sse.error_frame(chunks.error)
                    break
                if chunks.ended:
                    break
            run.complete = chunks.ended and chunks.error is None
            run.usage = chunks.usage
        except GeneratorExit:  # the WSGI server closed us: the client is gone
            run.disconnected = True
            raise
        except Exception as exc:
            logger.exception("stream of request %s failed", run.rid)
            metrics.stream_errors.labels(endpoint, "internal_error").inc()
            yield sse.error_frame(exc)
        yield sse.DONE

    response = Response(body(), mimetype=sse.MIMETYPE, headers=sse.HEADERS)
    response.call_on_close(run.close)
    return response
