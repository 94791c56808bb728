"""Publishing token chunks: how a worker's engine thread writes every request's new
token ids in one round trip per engine step (``scripts.PUBLISH``), refreshing leases,
learning of cancels and fences, and sealing a fenced attempt's tail.

``TokenPublishing`` is the worker's part of ``broker.requests.RequestStore`` (a mixin,
so one store serves every process); the types and codecs the engine thread uses with it
are here too. ``docs/architecture.md`` ("The lease is the fence") says why it is safe.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import orjson
from redis import Redis

from app.messages import TokenDelta
from broker import scripts
from broker.chunks import encode_prior
from broker.connection import as_str
from broker.direct import DirectConnection
from broker.keys import Keys
from broker.step_lines import last_entries, step_head


class PublishStatus(int, Enum):
    OK = 0
    FENCED = 1  # the lease is no longer ours: stop generating, publish nothing more
    CANCEL = 2  # a cancel was requested: stop generating


@dataclass(frozen=True, slots=True)
class FencedTail:
    """What an attempt that was fenced had published since its last checkpoint
    (``ChunkLog.unsealed``), to seal (``RequestStore.seal_fenced``)."""

    request_id: str
    attempt: int
    checkpointed: int  # the ordinal of its last checkpoint (the token stream's last entry)
    chunks: list[tuple[int, bytes]]  # (ordinal, payload), in order; not empty


def seal_call(
    keys: Keys, rid: str, lease: str, attempt: int, recorded: int, chunks: list[tuple[int, bytes]]
) -> tuple[list[str], list[Any]]:
    """``scripts.SEAL``'s keys and arguments: seal ``chunks`` after ordinal ``recorded``."""
    (*prior, (n, payload)) = chunks
    args = [lease, attempt, publish_stamp(), recorded, n, payload, encode_prior(prior)]
    return [keys.lease(rid), keys.tokens(rid)], args


@dataclass(slots=True)
class PublishItem:
    """One request's contribution to one engine step's publish round trip.

    ``payload`` is already encoded (``encode_deltas``; empty = a lease refresh only):
    the engine thread encodes each request on its own, so one request whose deltas
    cannot be encoded fails alone instead of failing the whole step's round trip.
    """

    request_id: str
    lease_value: str
    attempt: int
    payload: bytes
    first: bool = False
    done: bool = False
    refresh: bool = True  # extend the lease (False: it was extended recently)
    # The chunk's ordinal (``broker.chunks``); 0: the next after the token stream's last
    # entry, written there whatever (a publisher that keeps no ``ChunkLog``).
    ordinal: int = 0
    checkpoint: bool = False  # write it (and ``prior``) to the request's token stream
    prior: bytes = b""  # ``encode_prior``: the chunks since the last checkpoint


# A plain publish item's parts (``RequestStore._plain_parts_of``): worker id, attempt,
# lease value, (lease key, cancel key), step line head.
_PlainParts = tuple[str, int, str, tuple[str, str], bytes]


# Kept for this many requests at most (a worker holds far fewer at once).
PLAIN_PARTS_KEPT = 4096


@dataclass(slots=True)
class KnownEpoch:
    """The fence epoch (``Keys.fence_epoch``) one sender's last publish ran under, and
    the connection generation (``DirectConnection.generation``) it came over.

    Trusted only on the same connection: a new one may be to a Redis that restarted
    without its last writes (a claim's lease lost, then claimed again by another worker
    under an epoch this sender already knows), so the first publish on it checks every
    request again."""

    generation: int = -1
    value: str = ""

    def argument(self, generation: int) -> str:
        """The publish script's epoch argument for a call on ``generation``."""
        return "e:" + self.value if generation == self.generation else ""

    def learn(self, generation: int, value: str) -> None:
        self.generation, self.value = generation, value


@dataclass(frozen=True, slots=True)
class PublishReply:
    statuses: list[PublishStatus]
    epoch: str  # the fence epoch the call ran under
    # The call ran nothing: the epoch changed, and it left the plain items' keys out.
    recheck: bool = False


def publish_reply(res: Any, order: Sequence[int], plain: int) -> PublishReply:
    """``scripts.PUBLISH``'s reply, parsed: the statuses of the items whose indexes
    ``order`` lists, in that order, put back in the items' order. The last ``plain`` of
    them are the plain items, whose statuses the reply holds only when the script
    checked them; otherwise each was published."""
    *replied, epoch = res
    if replied == [b"recheck"]:
        return PublishReply([], as_str(epoch), recheck=True)
    if len(replied) not in (len(order), len(order) - plain):
        raise ValueError(f"publish replied {len(replied)} statuses for {len(order)} items")
    statuses = [PublishStatus.OK] * len(order)
    for i, x in zip(order, replied, strict=False):
        statuses[i] = PublishStatus(int(x))
    return PublishReply(statuses, as_str(epoch))


@dataclass(slots=True)
class PendingPublish:
    """A publish sent on ``via`` whose reply has not been read yet."""

    via: DirectConnection
    script: Any  # the registered publish script (reloaded if Redis lost it)
    keys: list[str]
    args: list[Any]
    order: list[int]  # the items' indexes in the reply's order
    plain: int  # how many of them (the last) are plain
    known: KnownEpoch | None = None  # updated from the reply
    generation: int = 0  # ``via``'s when it was sent
    plain_keys: list[str] = field(default_factory=list)  # when left out of ``keys``

    def statuses(self) -> list[PublishStatus]:
        """Read the reply (waits for it if Redis has not answered yet). A call that
        asks for the plain items' keys (the epoch changed since the last) is sent again
        with them, now: it ran nothing."""
        res = self.via.evalsha_reply(self.script, self.keys, self.args)
        reply = publish_reply(res, self.order, self.plain)
        if reply.recheck:
            # Before the step stream key, the last (there is one: plain items need it).
            self.keys = [*self.keys[:-1], *self.plain_keys, self.keys[-1]]
            self.plain_keys = []
            self.via.send_evalsha(self.script, self.keys, self.args)
            res = self.via.evalsha_reply(self.script, self.keys, self.args)
            reply = publish_reply(res, self.order, self.plain)
        if self.known is not None and self.via.generation == self.generation:
            self.known.learn(self.generation, reply.epoch)
        return reply.statuses


@dataclass(slots=True)
class PublishLinks:
    """A publisher's own connection and known fence epoch per shard (one on one Redis):
    each shard's publish goes to its master, and trusts what it learned there only."""

    via: list[DirectConnection]
    known: list[KnownEpoch]

    @classmethod
    def of(cls, client: Redis, keys: Keys) -> PublishLinks:
        shards = keys.all_shards()
        routes = [k.fence_epoch if keys.clustered else None for k in shards]
        return cls([DirectConnection(client, r) for r in routes], [KnownEpoch() for _ in shards])

    def forget(self, vias: Sequence[DirectConnection] = ()) -> None:
        """After a call failed: close ``vias`` (their replies are not read) and trust no
        shard's epoch: the failed call's statuses (a fence) may never have been read."""
        for via in vias:
            via.close()
        for known in self.known:
            known.generation = -1

    def close(self) -> None:
        for via in self.via:
            via.close()


@dataclass(slots=True)
class ShardedPublish:
    """``PendingPublish`` of one step's publish calls, one per shard."""

    sent: list[tuple[PendingPublish, list[int]]]  # each call and its items' indexes
    count: int
    links: PublishLinks

    def statuses(self) -> list[PublishStatus]:
        """Every call's reply is read (a connection must not keep an unread one); if any
        failed, its error is raised after, and every shard checks everything next."""
        statuses = [PublishStatus.OK] * self.count
        error: BaseException | None = None
        for pending, indexes in self.sent:
            try:
                for i, status in zip(indexes, pending.statuses(), strict=True):
                    statuses[i] = status
            except Exception as exc:
                pending.via.close()
                error = error or exc
        if error is not None:
            self.links.forget()
            raise error
        return statuses


def publish_stamp() -> str:
    """A publish call's time (unix seconds, full precision), as its entries carry it."""
    return repr(time.time())


def encode_deltas(deltas: Sequence[TokenDelta]) -> bytes:
    return orjson.dumps([d.encode() for d in deltas])


def decode_deltas(raw: str | bytes) -> list[TokenDelta]:
    return [TokenDelta.decode(x) for x in orjson.loads(raw)]


def lease_value(worker_id: str, attempt: int) -> str:
    return f"{worker_id}:{attempt}"


class TokenPublishing:
    """The publish calls of ``RequestStore`` (module doc)."""

    redis: Redis
    keys: Keys
    stream_ttl_s: int

    def _init_publishing(self, client: Redis) -> None:
        self._publish = client.register_script(scripts.PUBLISH)
        self._seal = client.register_script(scripts.SEAL)
        self._plain_parts: dict[str, _PlainParts] = {}  # request id -> ``_plain_parts_of``

    def seal_fenced(self, tails: Sequence[FencedTail]) -> list[int]:
        """Attempts that a publish just fenced seal the chunks they published since
        their last checkpoint into their token streams, in one round trip
        (``scripts.SEAL`` without a lease: a successor that has written wins).
        Per tail: 1 sealed, -1 a successor wrote first (it read the tail itself)."""
        if self.keys.clustered:  # a cluster's pipeline would not reload a lost script
            calls = [
                seal_call(self.keys, t.request_id, "", t.attempt, t.checkpointed, t.chunks)
                for t in tails
            ]
            return [int(self._seal(keys=keys, args=args)) for keys, args in calls]
        pipe = self.redis.pipeline(transaction=False)
        for t in tails:
            keys, args = seal_call(self.keys, t.request_id, "", t.attempt, t.checkpointed, t.chunks)
            self._seal(keys=keys, args=args, client=pipe)
        return [int(r) for r in pipe.execute()]

    def publish(
        self,
        items: Sequence[PublishItem],
        lease_ttl_s: float,
        worker_id: str | None = None,
        stamp: str | None = None,
    ) -> list[PublishStatus]:
        """Append one engine step's deltas for many requests in ONE round trip.

        Also extends the leases of the items that ask (``refresh``) and reports cancels
        and lost leases. With ``worker_id``, the token entries appended are also written,
        together, as one entry of the worker's step stream (``Keys.steps``). The engine
        thread uses ``publish_begin`` (on its own connection, the reply read after its
        next step); this is the same call, whole. ``stamp`` (``publish_stamp()``, by
        default a new one) is the call's publish time, written in each entry it appends:
        ``landed`` tells from it whether a call whose reply was lost ran.
        """
        if not items:
            return []
        k = self.keys.of(items[0].request_id)  # one shard's requests (one Redis: all)
        keys, args, order, plain, _ = self._publish_args(
            items, lease_ttl_s, worker_id, stamp, "", k
        )
        return publish_reply(self._publish(keys=keys, args=args), order, plain).statuses

    def publish_begin(
        self,
        items: Sequence[PublishItem],
        lease_ttl_s: float,
        via: DirectConnection,
        worker_id: str | None = None,
        stamp: str | None = None,
        known: KnownEpoch | None = None,
        keys: Keys | None = None,
    ) -> PendingPublish:
        """``publish``, split in two: send it now, read its statuses later with the
        result's ``statuses()``, so the engine can run its next step meanwhile.

        ``known``: the fence epoch this sender's publishes on ``via`` ran under, kept
        up to date by ``statuses()``; while it is current the script skips checking
        each request's lease and cancel key (``scripts.PUBLISH``)."""
        generation = via.connect()
        epoch = known.argument(generation) if known is not None else ""
        ks, args, order, plain, plain_keys = self._publish_args(
            items, lease_ttl_s, worker_id, stamp, epoch, keys or self.keys
        )
        via.send_evalsha(self._publish, ks, args)
        return PendingPublish(
            via, self._publish, ks, args, order, plain, known, generation, plain_keys
        )

    def publish_shards(
        self,
        items: Sequence[PublishItem],
        lease_ttl_s: float,
        links: PublishLinks,
        worker_id: str | None = None,
        stamp: str | None = None,
    ) -> PendingPublish | ShardedPublish:
        """``publish_begin`` for requests of any shard: on one Redis that call itself;
        on a cluster one call per shard with requests in ``items``, each on its shard's
        connection (``links``), all sent before any reply is read."""
        if not self.keys.clustered:
            return self.publish_begin(
                items, lease_ttl_s, links.via[0], worker_id, stamp, links.known[0]
            )
        groups: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault(self.keys.index_of(it.request_id), []).append(i)
        sent: list[tuple[PendingPublish, list[int]]] = []
        try:
            for shard, indexes in groups.items():
                pending = self.publish_begin(
                    [items[i] for i in indexes],
                    lease_ttl_s,
                    links.via[shard],
                    worker_id,
                    stamp,
                    links.known[shard],
                    self.keys.at(shard),
                )
                sent.append((pending, indexes))
        except BaseException:
            links.forget([p.via for p, _ in sent])  # replies no one will read
            raise
        return ShardedPublish(sent, len(items), links)

    def _publish_args(
        self,
        items: Sequence[PublishItem],
        lease_ttl_s: float,
        worker_id: str | None,
        stamp: str | None,
        epoch: str,
        k: Keys,
    ) -> tuple[list[str], list[Any], list[int], int, list[str]]:
        """``scripts.PUBLISH``'s keys and arguments, the items' indexes in the order of
        its reply: those written out, then the plain ones (see the script), whose step
        lines are written here, as the step entry holds them; how many are plain; and
        their keys. Those are in the call's keys only without an ``epoch`` expected: under
        one the script needs them only if the epoch changed, and then asks for them
        (``PendingPublish.statuses`` sends the call again with them). ``k``: the keys
        of the items' shard."""
        keys: list[str] = [k.fence_epoch]
        plain_keys: list[str] = []
        lines: list[bytes] = []
        order: list[int] = []
        plain: list[int] = []
        each: list[Any] = []
        # Once per request per step, on the way to every token: the key prefixes are
        # concatenated rather than built by ``Keys``' methods.
        known = self._plain_parts
        for i, it in enumerate(items):
            rid = it.request_id
            if (
                worker_id is not None
                and it.payload
                and it.ordinal
                and not (it.first or it.done or it.refresh or it.checkpoint)
            ):
                parts = known.get(rid)
                if parts is None or parts[0] != worker_id or parts[1] != it.attempt:
                    parts = self._plain_parts_of(rid, worker_id, it.attempt)
                if it.lease_value == parts[2]:
                    plain_keys += parts[3]
                    lines.append(b"%s%d\n%s" % (parts[4], it.ordinal, it.payload))
                    plain.append(i)
                    continue
            elif it.done:
                known.pop(rid, None)
            keys += [k.lease(rid), k.tokens(rid), k.request(rid), k.cancel(rid)]
            flags = it.first | 2 * it.done | (0 if it.refresh else 4) | 8 * it.checkpoint
            each += [it.lease_value, it.attempt, it.payload, flags | it.ordinal << 4]
            order.append(i)
        if not epoch:
            keys += plain_keys
        # The publish time travels with each entry so the relay's added latency can be
        # measured to the microsecond (entry ids only carry milliseconds); it also names
        # the call, for ``landed``.
        stamp = stamp or publish_stamp()
        args: list[Any] = [int(lease_ttl_s * 1000), self.stream_ttl_s, stamp, epoch]
        args += [len(order), len(plain), b"\n".join(lines), *each]
        if worker_id is not None:
            keys.append(k.steps(worker_id))
            args.append(worker_id)
            args += [it.prior for it in items if it.checkpoint and it.payload]
        return keys, args, order + plain, len(plain), plain_keys

    def _plain_parts_of(self, rid: str, worker_id: str, attempt: int) -> _PlainParts:
        """What a plain item of ``rid``'s ``attempt`` published by ``worker_id`` needs in
        the publish's arguments, built once per attempt, not per step: its expected
        lease value, its lease and cancel keys, and its step line's head
        (``step_head``). Forgotten at the attempt's last publish, or all at once when
        more than ``PLAIN_PARTS_KEPT`` are kept (attempts that ended elsewhere)."""
        if len(self._plain_parts) >= PLAIN_PARTS_KEPT:
            self._plain_parts.clear()
        k = self.keys
        parts = (
            worker_id,
            attempt,
            lease_value(worker_id, attempt),
            (k.lease(rid), k.cancel(rid)),
            step_head(k.tokens(rid), attempt),
        )
        self._plain_parts[rid] = parts
        return parts

    def landed(
        self, calls: Sequence[tuple[str, int, str]], worker_id: str | None = None
    ) -> list[bool]:
        """For each ``(request_id, attempt, stamp)`` of a publish whose reply was lost
        (the connection broke, Redis restarted): whether it ran. One round trip.

        A publish is not idempotent: retrying one that ran appends its tokens twice. Its
        sender publishes nothing more until it knows. So, with ``worker_id`` (the call
        wrote that worker's step stream), the call ran if the step stream's last entry
        is the one it appended (a part fenced there is fenced again when retried);
        without, if the last entry of the request's token stream is. A call that ran
        but that Redis lost with its AOF tail counts as not landed, which is what it is
        now."""
        if worker_id is not None:  # one step stream per shard (one on one Redis)
            shards = sorted({self.keys.index_of(rid) for rid, _a, _s in calls})
            lasts = last_entries(self.redis, [self.keys.at(i).steps(worker_id) for i in shards])
            stamps = {shard: last.get(b"t") for shard, last in zip(shards, lasts, strict=True)}
            return [stamps[self.keys.index_of(rid)] == stamp.encode() for rid, _a, stamp in calls]
        lasts = last_entries(self.redis, [self.keys.tokens(rid) for rid, _a, _s in calls])
        return [
            last.get(b"a") == str(attempt).encode() and last.get(b"t") == stamp.encode()
            for (_rid, attempt, stamp), last in zip(calls, lasts, strict=True)
        ]
