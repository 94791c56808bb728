"""Embeddings over the queue (issue 42): ``/v1/embeddings`` in the web tier, answered by
a worker of the model that declares it embeds (``WorkerInfo.embeds``).

An embedding is one short computation with nothing to stream, so it takes a simpler
path than generation: the web tier sends the ``embed`` task (the request's token ids:
the web tokenized them, as it does prompts) to the model's own embed queue, which only
embedding workers consume, and waits on a reply list; the worker pushes the vectors (or
an error) there. Every input of a request is embedded in one llama.cpp batch. A reply
that comes after the web gave up expires with its list.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
import redis
from celery import Celery

from app.errors import StreamError
from broker.keys import Keys

EMBED_TASK = "tokenrelay.embed"
REPLY_TTL_S = 60


def embed_queue(model: str) -> str:
    """The queue of ``model``'s embedding requests (not the generation queues: a worker
    that cannot embed must never take one; ``worker_queues(embeds=True)`` has it)."""
    return f"tr.embed.{model}"


def embed(
    app: Celery,
    client: redis.Redis,
    keys: Keys,
    model: str,
    inputs: list[list[int]],
    *,
    timeout_s: float,
) -> list[list[float]]:
    """The vectors of ``inputs`` (token ids), from a worker of ``model``; raises the
    worker's error, or 504 when none answered within ``timeout_s``."""
    request_id = uuid.uuid4().hex
    app.send_task(
        EMBED_TASK,
        args=[request_id, inputs],
        queue=embed_queue(model),
        task_id=f"emb-{request_id}",
        expires=timeout_s,
    )
    # A second at a time: the shared client's socket timeout is shorter than a wait
    # for a worker that loads its embedding model first.
    deadline = time.monotonic() + timeout_s
    while (got := client.blpop([keys.embed_reply(request_id)], timeout=1)) is None:
        if time.monotonic() > deadline:
            raise StreamError("No worker answered the embedding request in time.", 504)
    reply: dict[str, Any] = orjson.loads(got[1])
    if "error" in reply:
        raise StreamError(reply["error"], int(reply.get("code") or 500))
    vectors: list[list[float]] = reply["embeddings"]
    return vectors


def send_reply(client: redis.Redis, keys: Keys, request_id: str, reply: dict[str, Any]) -> None:
    """A worker's answer: on the list the web tier waits on, which expires unread."""
    key = keys.embed_reply(request_id)
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(key, orjson.dumps(reply))
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()
