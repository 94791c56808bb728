"""The Flask app factory: ``create_app(settings=None)``.

Served by gunicorn (``tokenrelay web``). Each piece of the API lives in its own module
and registers itself here: OpenAI HTTP + SSE routes (``web.openai_routes``), the
WebSocket chat (``web.ws``), the Files + Batches API (``web.batch``), the
Responses API (``web.responses_api``), the browser chat
page (``web/static``), errors (``web.errors``) and metrics (``web.metrics``). Every
generation goes through one ``broker.runner.Runner`` per process.
"""

from __future__ import annotations

from flask import Flask
from flask_sock import Sock

from app.settings import Settings
from broker.api_keys import ApiKeyStore, KeyCache
from broker.response_service import ResponseService
from broker.runner import Runner
from web import (
    admin_keys,
    admin_usage,
    batch,
    embeddings,
    errors,
    messages_api,
    metrics,
    openai_routes,
    page_headers,
    rate_headers,
    responses_api,
    tokenize,
    ws,
)
from web.connections import KeyConnections
from web.context import CONNECTIONS, RESPONSES, RUNNER, SETTINGS


def create_app(settings: Settings | None = None, *, runner: Runner | None = None) -> Flask:
    settings = settings or Settings()
    runner = runner or Runner(settings)
    app = Flask(__name__, static_folder="static", static_url_path="/static")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions[SETTINGS] = settings
    app.extensions[RUNNER] = runner
    app.extensions[RESPONSES] = ResponseService(
        runner, ttl_s=settings.responses_ttl_s, max_bytes=settings.key_max_stored_bytes
    )
    # Only with keys does an owner stand for one client (web.connections).
    app.extensions[CONNECTIONS] = KeyConnections(
        settings.key_max_connections if settings.api_keys else 0
    )
    if settings.api_keys and runner.policy.cache is None:  # keys managed at run time
        runner.policy.cache = KeyCache(ApiKeyStore(runner.redis, runner.keys))
    errors.register(app)
    metrics.register(app)
    app.register_blueprint(openai_routes.blueprint)
    app.register_blueprint(batch.blueprint)
    app.register_blueprint(responses_api.blueprint)
    app.register_blueprint(tokenize.blueprint)
    app.register_blueprint(messages_api.blueprint)
    app.register_blueprint(embeddings.blueprint)
    app.register_blueprint(admin_keys.blueprint)
    app.register_blueprint(admin_usage.blueprint)
    rate_headers.register(app)
    ws.register(Sock(app))
    page_headers.register(app)
    return app
