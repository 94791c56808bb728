"""The Flask app factory: ``create_app(settings=None)``.

Served by gunicorn (``tokenrelay web``). Each piece of the API lives in its own module
and registers itself here: OpenAI HTTP + SSE routes (``web.openai_routes``), the
WebSocket chat (``web.ws``), the Files + Batches API (``web.batch``), the browser chat
page (``web/static``), errors (``web.errors``) and metrics (``web.metrics``).
"""

from __future__ import annotations

from flask import Flask
from flask_sock import Sock

from app.settings import Settings
from web.service import GenerationService


def create_app(
    settings: Settings | None = None, *, service: GenerationService | None = None
) -> Flask:
    settings = settings or Settings()
    service = service or GenerationService(settings)
    app = Flask(__name__, static_folder="static", static_url_path="/static")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["tokenrelay.settings"] = settings
    app.extensions["tokenrelay.service"] = service

    from web import batch, errors, metrics, openai_routes, ws

    errors.register(app)
    metrics.register(app)
    app.register_blueprint(openai_routes.blueprint)
    app.register_blueprint(batch.blueprint)
    ws.register(Sock(app))
    return app


def service_of(app: Flask) -> GenerationService:
    svc: GenerationService = app.extensions["tokenrelay.service"]
    return svc


def settings_of(app: Flask) -> Settings:
    s: Settings = app.extensions["tokenrelay.settings"]
    return s
