"""``POST /tokenize`` and ``POST /detokenize`` (also under ``/v1/``): vLLM's and
llama.cpp's server's token-counting endpoints (``app.tokenize_api``), answered by the
web tier with the requested model's own tokenizer and chat template, no worker
involved. API keys apply as on ``/v1/``."""

from __future__ import annotations

from typing import Any

import redis
from flask import Blueprint, current_app, request

from app.chat_template import PromptBuilder
from app.intake import Intake
from app.tokenize_api import detokenize, tokenize
from broker.backbone import backbone_unavailable
from web import auth
from web.bodies import json_body
from web.context import runner_of, settings_of

blueprint = Blueprint("tokenize", __name__)


def intake_for(body: Any) -> tuple[Intake, Any]:
    """The intake of the model the body names (the default model without one), and the
    body as that intake takes it (an alias named as the model it serves)."""
    runner = runner_of(current_app)
    asked = body.get("model") if isinstance(body, dict) else None
    try:
        served = runner.models.resolve(asked if isinstance(asked, str) else None)
    except redis.RedisError as exc:
        raise backbone_unavailable() from exc
    if isinstance(asked, str) and asked != served:
        body = {**body, "model": served}
    return runner.intake_for(served), body


def prompts_for(body: Any) -> PromptBuilder:
    """The prompt builder of the model the body names (the default model without one)."""
    return intake_for(body)[0].builder.prompts


def _check_key() -> None:
    settings = settings_of(current_app)
    if settings.api_keys and not request.path.startswith("/v1/"):  # /v1/: checked already
        key = auth.bearer_key(request.headers.get("Authorization"))
        auth.authenticate(settings, key, runner_of(current_app).policy.cache)


@blueprint.post("/tokenize")
@blueprint.post("/v1/tokenize")
def tokenize_route() -> dict[str, Any]:
    _check_key()
    body = json_body(request)
    return tokenize(body, prompts_for(body))


@blueprint.post("/detokenize")
@blueprint.post("/v1/detokenize")
def detokenize_route() -> dict[str, Any]:
    _check_key()
    body = json_body(request)
    return detokenize(body, prompts_for(body))
