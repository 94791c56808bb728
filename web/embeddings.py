"""``POST /v1/embeddings`` (issue 42): tokenized here with the model's tokenizer,
embedded by a worker of the model that serves embeddings (``broker.embeddings``), in
OpenAI's shape. A model none of whose live workers embeds is a 503 at once."""

from __future__ import annotations

from typing import Any

import redis
from flask import Blueprint, current_app, request

from app.embeddings_api import embedding_response, parse_embedding_request
from app.errors import ServiceUnavailable
from broker.backbone import backbone_unavailable
from broker.embeddings import embed
from web.bodies import json_body
from web.context import runner_of, settings_of
from web.tokenize import prompts_for

blueprint = Blueprint("embeddings", __name__)


@blueprint.post("/v1/embeddings")
def embeddings() -> dict[str, Any]:
    body = json_body(request)
    req = parse_embedding_request(body)
    runner = runner_of(current_app)
    prompts = prompts_for(body)
    inputs = req.inputs(prompts)
    try:
        served = runner.models.resolve(req.model)
        embedding_workers = [w for w in runner.workers.live() if w.model == served and w.embeds]
    except redis.RedisError as exc:
        raise backbone_unavailable() from exc
    if not embedding_workers:
        raise ServiceUnavailable(
            f"No live worker serves embeddings for the model '{served}'.",
            code="no_embedding_worker",
            retry_after=1,
        )
    vectors = embed(
        runner.celery,
        runner.redis,
        runner.keys,
        served,
        inputs,
        timeout_s=settings_of(current_app).request_timeout_s,
    )
    return embedding_response(
        vectors,
        model=req.model or served,
        tokens=sum(len(i) for i in inputs),
        encoding=req.encoding_format,
    )
