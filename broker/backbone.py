"""Redis away, as a client is told of it: which errors mean the backbone is down or
full (answered 503 + Retry-After, never a 500) and the one 503 given then. The web
tier's error handlers (``web.errors``) answer a request so; a stream that fails after
its first byte (SSE, the WebSocket) sends ``client_error``'s event, the same 503.
"""

from __future__ import annotations

import redis
from kombu.exceptions import OperationalError

from app.errors import ServiceUnavailable

RETRY_AFTER_S = 1

# What "Redis is away" looks like to a client library: refused or dropped connections,
# timeouts, a Redis still loading its append-only file (BusyLoadingError is a
# ConnectionError), a former master turned replica (ReadOnlyError), a full Redis under
# noeviction (OutOfMemoryError), and kombu's own error when it cannot publish a task.
# Each is answered 503 + Retry-After: the client should retry, nothing is wrong with
# its request. Any other RedisError is a bug (500).
BACKBONE_DOWN: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    OperationalError,
)
UNAVAILABLE_MESSAGE = "The server cannot reach its queue right now; please retry shortly."


def is_backbone_down(exc: BaseException) -> bool:
    """Whether ``exc`` means Redis is away or full (``BACKBONE_DOWN``). A write refused
    at ``maxmemory`` inside a Lua script comes back as a plain script error naming OOM."""
    if isinstance(exc, BACKBONE_DOWN):
        return True
    return isinstance(exc, redis.ResponseError) and "OOM command not allowed" in str(exc)


def client_error(exc: BaseException) -> BaseException:
    """``exc`` as a client is told of it: Redis away or full is the 503 it is (retry),
    never a 500; anything else as it is."""
    return backbone_unavailable() if is_backbone_down(exc) else exc


def backbone_unavailable() -> ServiceUnavailable:
    """The 503 a client gets while Redis is away (``BACKBONE_DOWN``)."""
    return ServiceUnavailable(UNAVAILABLE_MESSAGE, code="not_ready", retry_after=RETRY_AFTER_S)
