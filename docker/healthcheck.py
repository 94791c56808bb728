"""Container healthchecks for compose.yaml: ``python healthcheck.py KIND``.

KIND is web, flower, worker, streamer or batcher; exit status 0 = healthy. Web and
Flower are asked over HTTP on their in-container ports. Workers, streamers and batch
drivers are healthy when a live registration from *this* container's
hostname is in Redis: they heartbeat every 2 s from the thread that does the work, so
"healthy" means "doing its job", not merely "the process exists".

Kept outside the package on purpose: it is container plumbing, copied into the images
by the Dockerfiles, and must stay cheap (no model, no engine import).
"""

from __future__ import annotations

import socket
import sys
import urllib.request

FLOWER_URL = "http://127.0.0.1:5555/healthcheck"  # compose.yaml runs Flower on 5555

# kind -> the broker.registry function that opens its registry
REGISTRIES = {
    "worker": "worker_registry",
    "streamer": "streamer_registry",
    "batcher": "batcher_registry",
}


def registered_here(kind: str) -> bool:
    from app.settings import Settings
    from broker import registry
    from broker.connection import redis_client
    from broker.keys import Keys

    settings = Settings()
    factory = getattr(registry, REGISTRIES[kind])
    # redis_client: the same URL forms as the processes, redis+sentinel:// included
    client = redis_client(settings.redis_url, max_connections=2, socket_timeout=3)
    try:
        live = factory(client, Keys(settings.key_prefix)).live()
    finally:
        client.close()
    return any(info.hostname == socket.gethostname() for info in live)


def http_ok(url: str) -> int:
    with urllib.request.urlopen(url, timeout=3) as resp:  # HTTP errors raise
        return 0 if resp.status == 200 else 1


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in {"web", "flower", *REGISTRIES}:
        print("usage: healthcheck.py web|flower|worker|streamer|batcher", file=sys.stderr)
        return 2
    kind = argv[0]
    try:
        if kind == "web":
            from app.settings import Settings

            return http_ok(f"http://127.0.0.1:{Settings().port}/health")
        if kind == "flower":
            return http_ok(FLOWER_URL)
        return 0 if registered_here(kind) else 1
    except Exception as exc:  # any failure is "unhealthy", said in one line
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
