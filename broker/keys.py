"""Every Redis key tokenrelay uses, built in one place under one prefix.

{p}req:{rid}        hash   request record: body (JSON), state, attempt, worker
{p}lease:{rid}      string "worker:attempt" of the worker generating it; PX lease TTL
{p}tok:{rid}        stream token deltas (worker -> streamer), fields a=attempt t=time d=JSON
{p}out:{rid}        stream output events (streamer -> web), field e=JSON
{p}cancel:{rid}     string durable cancel flag (TTL); the fence epoch changes with it
{p}emb:{rid}        list   an embedding request's reply (worker -> web), TTL 60 s
{p}worker:{wid}     string worker registration JSON, TTL = heartbeat timeout
{p}workers          zset   worker ids scored by last heartbeat (unix seconds)
{p}pfx:{wid}        set    names of the prompt prefixes a worker's engine holds (8-byte
                           block names, app.prefix_blocks); TTL = heartbeat timeout
{p}pfx:{wid}:load   string requests running or waiting on that worker, at every change
{p}streamer:{sid}   string streamer registration JSON, TTL = heartbeat timeout
{p}streamers        zset   streamer ids scored by last heartbeat
{p}batcher:{id}     string batch driver registration JSON, TTL = heartbeat timeout
{p}batchers         zset   batch driver ids scored by last heartbeat
{p}new              stream new requests handed to streamers (consumer group)
{p}new:epoch        string a random value, new at every takeover of hand-off entries
{p}fence:epoch      string a value new at every resume, second claim and cancel: a worker's
                           publish checks each lease and cancel key only when it changed
{p}inflight         zset   admitted request ids scored by deadline (admission limit)
{p}inflight:weights hash   request id -> "<choices> <owner>\n<model>": what each admitted request
                           counts against the limit and whose per-key quota it uses
{p}hub:{id}         stream wake-ups of one web process's output reader (MAXLEN 16, TTL)
{p}file:{fid}       hash   an uploaded or generated file: meta (JSON), owner
{p}file:{fid}:data  string the file's bytes (read in ranges: downloads stream)
{p}files            zset   file ids scored by creation time (listing)
{p}owner:{o}:files  zset   one API key's file ids (o = key hash, "-" without keys)
{p}owner:{o}:fbytes hash   one API key's file ids -> bytes (its storage quota)
{p}owner:{o}:batches zset  one API key's batch ids
{p}batch:{bid}      hash   a batch: body (JSON), status, timestamps, counts, progress
{p}batch:{bid}:res  hash   per line index: its result (output or error line)
{p}batch:{bid}:lock string id of the driver running the batch; PX lock TTL
{p}batches          zset   batch ids scored by creation time (listing)
{p}batches:active   zset   batches not yet in a terminal state (the drivers' work list)
{p}resp:{id}        hash   a stored Responses API object: status, owner, request id, JSON
                           (broker.responses); TTL responses_ttl_s
{p}usage:d:{day}    hash   the usage ledger of one UTC day (YYYY-MM-DD): "owner\x1fmodel\x1f
                           api\x1fmetric" -> count (app.usage); TTL usage_ledger_days
{p}usage:h:{hour}   hash   the same per UTC hour (YYYY-MM-DDTHH); TTL usage_ledger_days
{p}usage:total      hash   the same, all time (the web tier's usage metrics)
{p}usage:done:{rid} string a request was counted in the ledger (once); TTL 2 x stream_ttl_s
{p}apikeys          hash   managed API key id -> record JSON (broker.api_keys; no secrets)
{p}apikeys:secrets  hash   SHA-256 of a managed key's current secret -> its id
{p}apikeys:revoked  hash   revoked key id -> unix time
{p}apikeys:version  string counter bumped by every key change (web processes reload)
{p}rl:{o}:r:{m}     string requests key o was admitted in unix minute m (TTL 120 s)
{p}rl:{o}:t:{m}     string tokens key o reserved in minute m, corrected at the end
{p}rl:settled:{rid} string a request's reservation was corrected (once; TTL 120 s)
{p}fq:{m}           zset   fair share: keys with waiting requests of model m by virtual start
{p}fq:{m}:s         hash   fair share: virtual clock, each key's weight and last finish
{p}fq:{m}:o:{o}     zset   fair share: key o's waiting request ids (priority, arrival)

On a Redis Cluster (``broker.cluster``) every key carries a hash tag after the prefix:
a request's keys its shard's (``{p}{<tag>}:req:{rid}``), and so do the keys a script
uses together with them (fence epoch, hand-off stream and epoch, step and output step
streams, hub wake-ups, the usage ledger's counts: "shard-scoped", asked of a ``Keys``
bound to one shard, ``at`` or ``of``); every other key the global tag
(``{p}{g}:inflight``). On one Redis (``shards=0``) there are no tags: the keys above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.cluster import GLOBAL_TAG, shard_of, shard_tags


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one prefix (``Settings.key_prefix``).

    ``shards``: 0 on one Redis (or a Sentinel group); on a cluster, how many shards
    requests are spread over. ``shard``: the shard this builder is bound to (its
    shard-scoped keys), None for a cluster's unbound builder, which refuses them."""

    prefix: str = "tr:"
    shards: int = 0
    shard: int | None = None
    _g: str = field(init=False, repr=False, compare=False)  # the global keys' prefix
    _tagged: tuple[str, ...] = field(init=False, repr=False, compare=False)  # per shard
    _bound: list[Keys] = field(init=False, repr=False, compare=False)  # at(k), made once

    def __post_init__(self) -> None:
        tagged = (
            tuple(f"{self.prefix}{{{t}}}:" for t in shard_tags(self.shards)) if self.shards else ()
        )
        object.__setattr__(
            self, "_g", f"{self.prefix}{{{GLOBAL_TAG}}}:" if self.shards else self.prefix
        )
        object.__setattr__(self, "_tagged", tagged)
        object.__setattr__(self, "_bound", [])

    # -- shards ---------------------------------------------------------------------------
    @property
    def clustered(self) -> bool:
        return self.shards > 0

    def at(self, index: int) -> Keys:
        """This builder bound to shard ``index`` (itself on one Redis)."""
        if not self.shards:
            return self
        if not self._bound:
            self._bound.extend(Keys(self.prefix, self.shards, k) for k in range(self.shards))
        return self._bound[index]

    def of(self, rid: str) -> Keys:
        """This builder bound to request ``rid``'s shard (itself on one Redis)."""
        return self.at(shard_of(rid, self.shards)) if self.shards else self

    def index_of(self, rid: str) -> int:
        """The index of request ``rid``'s shard (0 on one Redis)."""
        return shard_of(rid, self.shards) if self.shards else 0

    def all_shards(self) -> list[Keys]:
        """One builder per shard: ``[self]`` on one Redis."""
        return [self.at(k) for k in range(self.shards)] if self.shards else [self]

    @property
    def _s(self) -> str:
        """The prefix of this builder's shard-scoped keys."""
        if not self.shards:
            return self.prefix
        if self.shard is None:
            raise RuntimeError("a shard-scoped key of a cluster's Keys needs a shard: at() or of()")
        return self._tagged[self.shard]

    def _r(self, rid: str) -> str:
        """The prefix of request ``rid``'s keys."""
        return self._tagged[shard_of(rid, self.shards)] if self.shards else self.prefix

    def tokens_prefix(self) -> str:
        """``tokens(rid)`` is this + ``rid`` for every request of this builder's shard."""
        return f"{self._s}tok:"

    def output_prefix(self) -> str:
        """``output(rid)`` is this + ``rid`` for every request of this builder's shard."""
        return f"{self._s}out:"

    # -- one request's keys ---------------------------------------------------------------
    def request(self, rid: str) -> str:
        return f"{self._r(rid)}req:{rid}"

    def lease(self, rid: str) -> str:
        return f"{self._r(rid)}lease:{rid}"

    def tokens(self, rid: str) -> str:
        return f"{self._r(rid)}tok:{rid}"

    def output(self, rid: str) -> str:
        return f"{self._r(rid)}out:{rid}"

    def steps(self, worker_id: str) -> str:
        """A worker's step stream: one entry per publish with every token entry it
        appended (read by streamers instead of one token stream per request). One per
        shard on a cluster."""
        return f"{self._s}steps:{worker_id}"

    def output_steps(self, streamer_id: str) -> str:
        """A streamer's output step stream: one entry per output write with every output
        entry it appended (read by web processes' hubs instead of one stream per
        request). One per shard on a cluster."""
        return f"{self._s}osteps:{streamer_id}"

    def followers(self, rid: str) -> str:
        """Counter of clients following the request's output right now (any process):
        a disconnected stream's generation is cancelled only if nobody resumed it."""
        return f"{self._r(rid)}fol:{rid}"

    def cancel(self, rid: str) -> str:
        return f"{self._r(rid)}cancel:{rid}"

    def embed_reply(self, rid: str) -> str:
        """The list an embedding request's worker answers on (broker.embeddings)."""
        return f"{self._r(rid)}emb:{rid}"

    def member(self, kind: str, member_id: str) -> str:
        """Registration of one process of ``kind`` ("worker" or "streamer")."""
        return f"{self._g}{kind}:{member_id}"

    def members(self, kind: str) -> str:
        return f"{self._g}{kind}s"

    def hub_wake(self, hub_id: str) -> str:
        """Wake-up stream of one web process's output hub."""
        return f"{self._s}hub:{hub_id}"

    @property
    def inflight(self) -> str:
        return f"{self._g}inflight"

    @property
    def models(self) -> str:
        """Hash: served model name -> its entry (``broker.models.ModelEntry``)."""
        return f"{self._g}models"

    def prefix_blocks(self, worker_id: str) -> str:
        """A worker's advertised prefix-block names (``broker.prefix_routes``)."""
        return f"{self._g}pfx:{worker_id}"

    def prefix_load(self, worker_id: str) -> str:
        """Requests running or waiting on a worker, written by its engine thread."""
        return f"{self._g}pfx:{worker_id}:load"

    @property
    def worker_homes(self) -> str:
        """Counter of workers started on a cluster: each takes the next shard as its home
        (``broker.connection.home_shard``)."""
        return f"{self._g}homes"

    @property
    def abandoned(self) -> str:
        """Zset: request id -> deadline of a stream nobody follows (``broker.abandon``)."""
        return f"{self._g}abandoned"

    @property
    def web_processes(self) -> str:
        """Zset: web process id -> its last heartbeat (``broker.abandon.Follows``)."""
        return f"{self._g}webs"

    def web_follows(self, process_id: str) -> str:
        """Hash: request id -> how many of a web process's clients follow it, so that
        another process can take the counts back if it dies (``broker.abandon``)."""
        return f"{self._g}webfol:{process_id}"

    @property
    def inflight_weights(self) -> str:
        """Hash beside the in-flight zset: request id -> "<choices> <owner>"."""
        return f"{self._g}inflight:weights"

    @property
    def new_requests(self) -> str:
        return f"{self._s}new"

    @property
    def handoff_epoch(self) -> str:
        """Changed (to a new random value) by every takeover of hand-off entries: a
        streamer that saw it unchanged since it last checked which entries are its own
        writes without checking each entry's owner again (``OutputStreams``)."""
        return f"{self._s}new:epoch"

    @property
    def fence_epoch(self) -> str:
        """Changed (to a value it never had) by everything that can fence a worker's
        publish or cancel a request: a publish under the epoch it last checked
        everything under skips the per-request checks (``scripts.PUBLISH``)."""
        return f"{self._s}fence:epoch"

    def file(self, fid: str) -> str:
        return f"{self._g}file:{fid}"

    def file_data(self, fid: str) -> str:
        return f"{self._g}file:{fid}:data"

    @property
    def files(self) -> str:
        return f"{self._g}files"

    def owner_files(self, owner: str) -> str:
        """One owner's (API key hash's) files, for its listing."""
        return f"{self._g}owner:{owner or '-'}:files"

    def owner_file_bytes(self, owner: str) -> str:
        """One owner's file ids -> sizes, what its storage quota counts."""
        return f"{self._g}owner:{owner or '-'}:fbytes"

    def owner_responses(self, owner: str) -> str:
        """One owner's stored responses -> when each expires (unix s): what falls out of
        its storage count (``broker.responses``)."""
        return f"{self._g}owner:{owner or '-'}:resps"

    def owner_response_bytes(self, owner: str) -> str:
        """One owner's stored responses -> their sizes, and ``#total``: what its stored
        bytes quota counts."""
        return f"{self._g}owner:{owner or '-'}:rbytes"

    def owner_output_bytes(self, owner: str, bucket: int) -> str:
        """Bytes of output one owner's requests wrote in one period (``broker.output_usage``)."""
        return f"{self._g}owner:{owner or '-'}:obytes:{bucket}"

    def owner_batches(self, owner: str) -> str:
        return f"{self._g}owner:{owner or '-'}:batches"

    def batch(self, bid: str) -> str:
        return f"{self._g}batch:{bid}"

    def batch_results(self, bid: str) -> str:
        return f"{self._g}batch:{bid}:res"

    def batch_lock(self, bid: str) -> str:
        return f"{self._g}batch:{bid}:lock"

    @property
    def batches(self) -> str:
        return f"{self._g}batches"

    @property
    def active_batches(self) -> str:
        return f"{self._g}batches:active"

    def response(self, response_id: str) -> str:
        """A stored response of the Responses API (``broker.responses``)."""
        return f"{self._g}resp:{response_id}"

    # -- the usage ledger (broker.usage_ledger) -------------------------------------------
    def usage_day(self, day: str) -> str:
        """One UTC day's usage ledger hash (``day``: YYYY-MM-DD)."""
        return f"{self._s}usage:d:{day}"

    def usage_hour(self, hour: str) -> str:
        """One UTC hour's usage ledger hash (``hour``: YYYY-MM-DDTHH)."""
        return f"{self._s}usage:h:{hour}"

    @property
    def usage_total(self) -> str:
        """The all-time usage ledger hash."""
        return f"{self._s}usage:total"

    def usage_done(self, rid: str) -> str:
        """Set once a request has been counted in the usage ledger (its guard)."""
        return f"{self._r(rid)}usage:done:{rid}"

    # -- API keys managed at run time (broker.api_keys) and rate limits ------------------
    @property
    def api_keys(self) -> str:
        return f"{self._g}apikeys"

    @property
    def api_key_secrets(self) -> str:
        return f"{self._g}apikeys:secrets"

    @property
    def api_keys_revoked(self) -> str:
        return f"{self._g}apikeys:revoked"

    @property
    def api_keys_version(self) -> str:
        return f"{self._g}apikeys:version"

    def rate_requests(self, owner: str, window: int) -> str:
        """Requests one key was admitted in one minute (``window``: unix minute)."""
        return f"{self._g}rl:{owner}:r:{window}"

    def rate_tokens(self, owner: str, window: int) -> str:
        """Tokens one key reserved (then used) in one minute."""
        return f"{self._g}rl:{owner}:t:{window}"

    def rate_settled(self, rid: str) -> str:
        """Set once a request's token reservation was corrected to its real count."""
        return f"{self._g}rl:settled:{rid}"

    # -- fair share between keys (broker.fair_queue); one hash tag per model -------------
    def fair_owners(self, model: str) -> str:
        return f"{self._g}fq:{{{model}}}"

    def fair_state(self, model: str) -> str:
        return f"{self._g}fq:{{{model}}}:s"

    def fair_requests(self, model: str, owner: str) -> str:
        return f"{self._g}fq:{{{model}}}:o:{owner}"
