"""Stored responses of the Responses API on Redis, and folding them from output streams.

A stored response (``Keys.response``) is one hash that expires ``responses_ttl_s``
after creation: ``status``, ``owner`` (the key's hash, as files and batches record
theirs), ``request`` (the generation request behind it), and JSON fields: ``response``
(the object as last written), ``base`` (the object before any output: what the event
framer starts from when it replays the output stream) and ``input`` (this response's
own input items, with ids). A conversation is not copied into each response (that
would grow quadratically with an agent's turns): ``conversation`` walks the
``previous_response_id`` links back and joins each response's input and output.

Who writes the final object: whoever first sees the request's terminal event and
calls ``finish``, a check-and-set (Lua) that only moves a response that is not yet
terminal. That is the web process that created it (its request thread, or for a
background response a thread that follows the run to its end), or — when that process
died or its write failed — any web process that reads the response: ``settle`` folds
the request's output stream, still in Redis for ``stream_ttl_s``, from the start, and
finishes the object if the stream has ended. So a response never stays ``in_progress``
because the process that started it is gone.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis

from app.errors import QuotaExceeded
from app.records import RequestState
from app.responses_events import TERMINAL_STATUSES, ResponseEvents, error_code
from broker.keys import Keys
from broker.outputs import OutputStreams
from broker.requests import RequestStore

logger = logging.getLogger(__name__)

# Each owner's stored responses are counted in bytes (``key_max_stored_bytes``): a hash
# of each response's size with their ``#total``, and a sorted set of when each expires,
# from which a response that expired leaves the count at the owner's next create.
_FORGET_EXPIRED = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
for _, id in ipairs(gone) do
  local n = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HINCRBY', KEYS[3], '#total', -n)
  redis.call('HDEL', KEYS[3], id)
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1]) end
"""

# KEYS: response, owner's expiries, owner's sizes
# ARGV: now, expires at, ttl_s, limit (0: none), size, id, then the hash's field/values
# -> 1 stored, 0 over the owner's quota (nothing written)
CREATE = (
    _FORGET_EXPIRED
    + """
local size, limit = tonumber(ARGV[5]), tonumber(ARGV[4])
local total = tonumber(redis.call('HGET', KEYS[3], '#total') or '0')
if limit > 0 and total + size > limit then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 7))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[6])
redis.call('HSET', KEYS[3], ARGV[6], size)
redis.call('HINCRBY', KEYS[3], '#total', size)
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 1
"""
)

# KEYS: response, owner's sizes     ARGV: status, response JSON, id
# -> 1 written, 0 already terminal (left as it was), -1 no such response
# The final object replaces the one written at creation: the owner's count grows by the
# difference (never refused: the work is done; the owner's next create is).
FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'completed' or status == 'failed' or status == 'incomplete'
   or status == 'cancelled' then return 0 end
local grown = #ARGV[2] - redis.call('HSTRLEN', KEYS[1], 'response')
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'response', ARGV[2])
if redis.call('HEXISTS', KEYS[2], ARGV[3]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], grown)
  redis.call('HINCRBY', KEYS[2], '#total', grown)
end
return 1
"""

# KEYS: response, owner's expiries, owner's sizes     ARGV: id -> 1 deleted, 0 none
DELETE = """
local n = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('HINCRBY', KEYS[3], '#total', -n)
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
"""

# The longest conversation ``conversation`` walks (a guard; each turn is one round trip).
MAX_CHAIN = 10_000
LOST_MESSAGE = "The response's output expired or was lost before it was stored."


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response, as ``ResponseStore`` reads and writes it."""

    response_id: str
    request_id: str
    owner: str
    status: str
    response: dict[str, Any]
    base: dict[str, Any]
    input_items: list[dict[str, Any]]
    background: bool

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def with_response(self, response: dict[str, Any]) -> StoredResponse:
        return StoredResponse(
            self.response_id,
            self.request_id,
            self.owner,
            str(response["status"]),
            response,
            self.base,
            self.input_items,
            self.background,
        )


class ResponseStore:
    """Stored responses: create, load (per owner), finish once, delete, settle."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        ttl_s: int,
        requests: RequestStore,
        outputs: OutputStreams,
        max_bytes: int = 0,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.requests = requests
        self.outputs = outputs
        self.max_bytes = max_bytes
        self._create = client.register_script(CREATE)
        self._finish = client.register_script(FINISH)
        self._delete = client.register_script(DELETE)

    def _owner_keys(self, owner: str) -> list[str]:
        return [self.keys.owner_responses(owner), self.keys.owner_response_bytes(owner)]

    def stored_bytes(self, owner: str) -> int:
        """What ``owner``'s stored responses count against its quota now (expired ones
        included until its next create)."""
        raw: Any = self.redis.hget(self.keys.owner_response_bytes(owner), "#total")
        return int(raw or 0)

    def check_room(self, owner: str, size: int) -> None:
        """Raise ``QuotaExceeded`` when ``size`` more bytes would take ``owner`` over its
        quota: checked before a response's generation starts (``create`` checks again,
        atomically)."""
        if self.max_bytes and self.stored_bytes(owner) + size > self.max_bytes:
            raise self._over_quota()

    def _over_quota(self) -> QuotaExceeded:
        return QuotaExceeded(
            f"This API key's stored responses already take up to {self.max_bytes} bytes, "
            "its quota (key_max_stored_bytes); delete responses (or create them with "
            "'store': false) to store more."
        )

    def create(self, stored: StoredResponse) -> None:
        """Store a new response, counted against its owner's quota (``QuotaExceeded``
        when it does not fit: nothing is written then)."""
        fields = {
            "status": stored.status,
            "owner": stored.owner,
            "request": stored.request_id,
            "response": _dumps(stored.response),
            "base": _dumps(stored.base),
            "input": _dumps(stored.input_items),
            "background": "1" if stored.background else "",
        }
        size = sum(len(k) + len(v.encode()) for k, v in fields.items())
        now = int(time.time())
        stored_now: Any = self._create(
            keys=[self.keys.response(stored.response_id), *self._owner_keys(stored.owner)],
            args=[
                now,
                now + self.ttl_s,
                self.ttl_s,
                self.max_bytes,
                size,
                stored.response_id,
                *(x for kv in fields.items() for x in kv),
            ],
        )
        if not int(stored_now):
            raise self._over_quota()

    def load(self, response_id: str, scope: str | None) -> StoredResponse | None:
        """The stored response, or None when missing, expired or another owner's
        (``scope`` None: any owner's)."""
        raw: Any = self.redis.hgetall(self.keys.response(response_id))
        if not raw or b"status" not in raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        if scope is not None and fields.get("owner", "") != scope:
            return None
        return StoredResponse(
            response_id=response_id,
            request_id=fields["request"],
            owner=fields.get("owner", ""),
            status=fields["status"],
            response=json.loads(fields["response"]),
            base=json.loads(fields["base"]),
            input_items=json.loads(fields["input"]),
            background=bool(fields.get("background")),
        )

    def conversation(self, last: StoredResponse) -> list[dict[str, Any]] | None:
        """Every item of the conversation ending with ``last``'s output, oldest first:
        each response's input items, then its output (reasoning left out). None when
        an earlier response of it expired, was deleted or is not finished."""
        turns: list[list[dict[str, Any]]] = []
        input_items, response = last.input_items, last.response
        for _ in range(MAX_CHAIN):
            output = [o for o in response.get("output", []) if o.get("type") != "reasoning"]
            turns.append(input_items + output)
            previous = response.get("previous_response_id")
            if not previous:
                return [item for turn in reversed(turns) for item in turn]
            raw: Any = self.redis.hmget(self.keys.response(previous), ["input", "response"])
            if raw[0] is None or raw[1] is None:
                return None
            input_items, response = json.loads(raw[0]), json.loads(raw[1])
            if response.get("status") not in TERMINAL_STATUSES:
                return None
        return None

    def finish(self, stored: StoredResponse, response: dict[str, Any]) -> bool:
        """Write the final object unless the response is already terminal (a cancel,
        or another process that got there first); whether it was written."""
        result: Any = self._finish(
            keys=[
                self.keys.response(stored.response_id),
                self.keys.owner_response_bytes(stored.owner),
            ],
            args=[response["status"], _dumps(response), stored.response_id],
        )
        return int(result) == 1

    def delete(self, stored: StoredResponse) -> bool:
        """Delete a stored response and take it out of its owner's count. No MULTI: a
        Redis at maxmemory refuses it, never DEL, HDEL or ZREM (a full Redis still frees)."""
        deleted: Any = self._delete(
            keys=[self.keys.response(stored.response_id), *self._owner_keys(stored.owner)],
            args=[stored.response_id],
        )
        return bool(deleted)

    # -- folding ------------------------------------------------------------------------
    def fold(self, stored: StoredResponse) -> ResponseEvents:
        """The request's output stream so far, folded (no blocking read)."""
        events = ResponseEvents(stored.base, stored.request_id, queued=stored.background)
        events.opening()
        for _n, batch in self.outputs.read(stored.request_id):
            for ev in batch:
                events.feed(ev)
                if events.done:
                    return events
        return events

    def settle(self, stored: StoredResponse) -> StoredResponse:
        """``stored`` brought up to date from its output stream: finished when the stream
        has ended (by whichever process reads it first), else the object in progress
        (``queued`` while no worker has started it)."""
        if stored.terminal:
            return stored
        events = self.fold(stored)
        if events.done:
            # The follower that would have freed its admission slot may be gone.
            self.requests.release(stored.request_id)
            self.finish(stored, events.response)
            return self.load(stored.response_id, None) or stored.with_response(events.response)
        if self.outputs.lost(stored.request_id):
            failed = {
                **events.response,
                "status": "failed",
                "error": {"code": error_code(500), "message": LOST_MESSAGE},
            }
            self.finish(stored, failed)
            return self.load(stored.response_id, None) or stored.with_response(failed)
        response = events.response
        state = self.requests.state(stored.request_id)
        quiet = stored.background and events.sequence_number <= 2
        if quiet and state is not None and state[0] is RequestState.QUEUED:
            response["status"] = "queued"
        return stored.with_response(response)
