"""The OpenAI-compatible HTTP API: completions (SSE or JSON), models, health.

The generation routes only frame: ``Runner.start`` (``broker.run``) prepares, checks,
admits and submits the request and returns its ``Run``; the route turns the run's
items into SSE chunks (``web.responses.ChunkStream``) or one folded body
(``app.fold.ResponseFold``), and calls ``run.close`` — which frees the slot, cancels
generation unless the output was read to its end, and records the metrics — from the
response's close callback (the WSGI server calls it even when it never started
iterating the body) or as soon as the fold is done.

Streaming responses first wait (at most one keep-alive interval) for the first
meaningful event, so an error that happens before any output — a worker rejecting the
prompt — is answered with its HTTP status like a non-streamed request, instead of a
200 whose body only says "error". Later errors are SSE error events. Whatever happens,
the stream ends with ``data: [DONE]``.

Every SSE event carries an ``id:`` (the output cursor, ``web.resume``): a client that
lost its connection reconnects to ``GET /v1/streams/<request_id>`` on any web process
with ``Last-Event-ID`` and gets exactly the remaining events. A non-streaming client
that hangs up is noticed within a tick and its generation cancelled (499).

Also installs two app-wide hooks: the ``x-request-id`` response header (the client's
``X-Request-Id`` when it sent a sane one, else the request's id) and API-key checks on
``/v1/`` routes (``web.auth``).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis
from flask import Blueprint, Flask, Response, current_app, g, request

from app import logs
from app.errors import NotFound, ServiceUnavailable
from app.fold import ResponseFold
from app.intake import Endpoint
from app.response_models import ModelList, ModelObject
from broker import drive
from broker.backbone import client_error
from broker.run import Run
from web import auth, messages_api, sse
from web.auth import tenant_of
from web.bodies import client_trace, json_body
from web.clients import client_gone_probe
from web.context import connections_of, runner_of, settings_of
from web.responses import ChunkStream
from web.resume import parse_event_id
from web.sse_pump import ClientGone, SsePump, frame_items

logger = logging.getLogger(__name__)

blueprint = Blueprint("openai", __name__)

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# -- app-wide hooks ---------------------------------------------------------------------


@blueprint.record_once
def _on_register(state: Any) -> None:
    app: Flask = state.app
    app.extensions.setdefault("tokenrelay.started", int(time.time()))


@blueprint.before_app_request
def _before() -> None:
    logs.clear()  # this thread's last request's fields must not mark this one's lines
    client_id = request.headers.get("X-Request-Id", "")
    g.client_request_id = bool(_CLIENT_ID.fullmatch(client_id))
    g.request_id = client_id if g.client_request_id else uuid.uuid4().hex
    if request.path.startswith(("/v1/", "/admin/")):
        settings = settings_of(current_app)
        view = current_app.view_functions.get(request.endpoint or "")
        if settings.api_keys and not auth.is_exempt(view):
            # Anthropic's clients send their key as ``x-api-key``.
            key = auth.bearer_key(request.headers.get("Authorization"))
            managed = runner_of(current_app).policy.cache
            g.tenant = auth.authenticate(settings, key or request.headers.get("x-api-key"), managed)
            logs.bind(key_id=logs.key_label(g.tenant.owner))


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
def ready() -> dict[str, Any]:
    """503 with the reason unless Redis, a worker for the default model and a streamer
    are up (``?model=NAME``: for that model).

    When ready, ``workers`` lists each live worker of that model with its engine, mode
    and capacity (an exllamav2 worker running ``unpaged`` serves one sequence at a
    time, which readiness alone would not show, docs/deploy.md), and ``models`` each
    served model with its live workers."""
    runner = runner_of(current_app)
    asked = request.args.get("model")
    model = runner.models.resolve(asked) if asked else runner.model_name
    ok, reason = runner.readiness(model)
    if not ok:
        raise ServiceUnavailable(reason, code="not_ready", retry_after=1)
    try:
        live = runner.models.live()
        known = runner.models.known()
    except redis.RedisError:
        live, known = {}, []  # gone since the check: the detail is best-effort
    workers = [
        {
            "worker_id": w.worker_id,
            "engine": w.engine,
            "mode": w.mode or None,
            "capacity": w.engine_capacity or None,
            "slots": w.capacity,
        }
        for w in sorted(live.get(model, []), key=lambda w: w.worker_id)
    ]
    models = {
        name: {"ready": bool(live.get(name)), "workers": len(live.get(name, []))} for name in known
    }
    return {"status": "ready", "model": model, "workers": workers, "models": models}


def _model_objects() -> list[ModelObject]:
    """Every model with a live worker, then each alias of one."""
    runner = runner_of(current_app)
    try:
        live = runner.models.live()
        entries = runner.models.entries()
    except redis.RedisError:
        # Redis away and nothing read yet: this process's own model, as it knows it.
        live, entries = {runner.model_name: []}, {}
    created = current_app.extensions["tokenrelay.started"]
    out = []
    for name in sorted(live, key=lambda n: (n != runner.model_name, n)):
        entry = entries.get(name)
        length = runner.card.context_length if name == runner.model_name else None
        served = ModelObject(
            id=name,
            created=int(entry.registered) if entry and entry.registered else created,
            max_model_len=entry.context_length if entry else length,
            root=name,
            engines=sorted({w.engine for w in live[name]}) or None,
            capabilities=(
                ["completion", "embedding"] if any(w.embeds for w in live[name]) else ["completion"]
            )
            if live[name]
            else None,
        )
        out.append(served)
        out += [served.model_copy(update={"id": a}) for a in runner.models.aliases_of(name)]
    return out


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.to_json(), status=status, mimetype="application/json")


@blueprint.get("/v1/models")
def list_models() -> Response:
    return _json(ModelList(data=_model_objects()))


@blueprint.get("/v1/models/<path:model_id>")
def get_model(model_id: str) -> Response:
    for model in _model_objects():
        if model.id == model_id:
            return _json(model)
    raise NotFound(f"The model '{model_id}' does not exist.", param="model", code="model_not_found")


# -- generation ---------------------------------------------------------------------------


@blueprint.post("/v1/chat/completions")
def chat_completions() -> Response:
    return _generate(Endpoint.CHAT)


@blueprint.post("/v1/completions")
def completions() -> Response:
    return _generate(Endpoint.COMPLETIONS)


# What ``/v1/streams`` frames as the stream was framed; a Responses stream resumes on its
# own route, with its own event numbers (``web.responses_api``).
FRAMED_HERE = (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.MESSAGES)


@blueprint.get("/v1/streams/<request_id>")
def resume_stream(request_id: str) -> Response:
    """Continue a streamed response after ``Last-Event-ID`` (or ``?last_event_id=``):
    exactly the events the client has not seen, then ``[DONE]``; from the start when
    no id is given. Works on any web process until the request's output expires."""
    cursor = parse_event_id(
        request.headers.get("Last-Event-ID") or request.args.get("last_event_id"),
        message_events=True,  # refused by ``Runner.resume`` where the stream is not one
    )
    tenant = tenant_of(settings_of(current_app), messages_api.authorization())
    close = connections_of(current_app).open(tenant.owner)  # a follower holds a thread
    try:
        # Only the key that made a stream may read it: an admin key's reach is files
        # and batches (docs/security.md), not other keys' prompts and outputs.
        run = runner_of(current_app).resume(
            request_id,
            cursor,
            scope=tenant.owner,
            trace=client_trace(request),
            framed=FRAMED_HERE,
        )
        if run.prepared.endpoint is Endpoint.MESSAGES:  # framed as it was made
            response = messages_api.stream(run, last_seen=cursor)
        else:
            response = _stream(run, opening=cursor is None)
    except BaseException:
        close()
        raise
    response.call_on_close(close)
    return response


def _generate(endpoint: Endpoint) -> Response:
    runner = runner_of(current_app)
    tenant = tenant_of(settings_of(current_app), request.headers.get("Authorization"))
    # 4xx/5xx are raised before any output.
    run = runner.start(
        endpoint, json_body(request), owner=tenant.owner, trace=client_trace(request)
    )
    if not g.client_request_id:
        g.request_id = run.request_id
    try:
        if run.prepared.stream:
            return _stream(run)
        return _fold(run, client_gone_probe(request.environ))
    except BaseException as exc:
        run.close(error=exc)
        raise


def _fold(run: Run, client_gone: Callable[[], bool]) -> Response:
    """The whole output in one body. An error of the request (or of every choice) is
    the HTTP status, since a non-streaming client has no other way to learn of it."""
    fold = ResponseFold.for_shape(run.shape)
    if not drive.unary(run, fold.feed, lambda: fold.done, client_gone):
        return Response(status=499)  # nobody reads it; the WSGI server drops it
    run.close()
    if fold.failure is not None:
        raise fold.failure
    return _json(fold.response())


def _stream(run: Run, *, opening: bool = True) -> Response:
    settings = settings_of(current_app)
    keepalive_s = max(settings.sse_keepalive_s, 0.001)
    first = drive.opening(run, keepalive_s) if opening else []
    ended_by_client = False
    chunks = ChunkStream(run.shape)
    # Writes a flowing stream from the hub's thread while this one sleeps (web.sse_pump).
    pump = SsePump.for_request(request.environ, run, chunks) if settings.sse_pump else None

    def body() -> Iterator[str]:
        nonlocal ended_by_client
        try:
            if opening:
                head = chunks.opening()
                if head:
                    yield "".join(sse.data_frame(c.to_json()) for c in head)
            for read in drive.reads(run, keepalive_s, first, pump):
                if read is None:
                    yield sse.KEEPALIVE
                    continue
                frames = frame_items(chunks, read)
                if frames:
                    yield "".join(frames)
                if chunks.error is not None or chunks.ended:
                    break
        except GeneratorExit:  # the WSGI server closed us: the client is gone
            ended_by_client = True
            raise
        except drive.HandedOver:  # resumed on another process (Last-Event-ID)
            yield sse.HANDED_OVER
            return
        except ClientGone:  # the pump's write failed: nobody to write to any more
            ended_by_client = True
            return
        except Exception as exc:
            logger.exception("stream of request %s failed", run.request_id)
            run.close(error=exc)
            yield sse.error_frame(client_error(exc))
        yield sse.DONE

    response = Response(body(), mimetype=sse.MIMETYPE, headers=sse.HEADERS)
    response.headers["x-request-id"] = g.request_id if g.client_request_id else run.request_id
    response.call_on_close(
        lambda: run.close(disconnected=ended_by_client or not run.ended, resumable=True)
    )
    return response
