"""The one settings object, read from ``TOKENRELAY_*`` environment variables once at
start-up and passed down explicitly (no module-level singletons).

``docs/configuration.md`` is generated from the field descriptions here
(``tokenrelay config docs``, ``app.settings_docs``); a test keeps the two in step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.records import DEADLINE_GRACE_S

EngineName = Literal["llamacpp", "exllamav2", "echo"]
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel")


def _default_models_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tokenrelay" / "models"


class Settings(BaseSettings):
    """Configuration for every tokenrelay process."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENRELAY_", extra="ignore", frozen=True, validate_default=True
    )

    # Redis and Celery
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis used as Celery broker, result backend and for all token traffic: "
        "redis://, rediss://, unix://, or a Sentinel group as "
        "redis+sentinel://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER_NAME[/DB] "
        "(docs/scaling.md).",
    )
    key_prefix: str = Field(
        default="tr:",
        pattern=r"^[^{}]*$",
        description="Prefix of every Redis key tokenrelay owns (no braces: on a Redis "
        "Cluster tokenrelay adds its own hash tags after it).",
    )
    redis_cluster: Literal["auto", "yes", "no"] = Field(
        default="auto",
        description="Whether TOKENRELAY_REDIS_URL is a Redis Cluster node (any one: the "
        "others are found from it). auto: asked once at start-up (INFO cluster); set yes "
        "or no to skip the question. On a cluster, token traffic, requests, leases, "
        "hand-off and admission are spread over TOKENRELAY_REDIS_SHARDS hash tags, and "
        "Celery needs TOKENRELAY_CELERY_URL (docs/scaling.md).",
    )
    redis_shards: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="On a Redis Cluster: how many shards (hash tags) requests are spread "
        "over; each worker step publishes one call per shard it has requests on. 0: the "
        "number the cluster already records for this key prefix, else its number of "
        "masters at the first start (then recorded). A number that differs from the "
        "recorded one is refused at start-up. Ignored without a cluster.",
    )
    celery_url: str = Field(
        default="",
        description="Redis for Celery's broker and result backend, when it is not "
        "TOKENRELAY_REDIS_URL: redis://, rediss://, unix:// or redis+sentinel://. Empty: "
        "TOKENRELAY_REDIS_URL. Required when that is a Redis Cluster (kombu does not "
        "speak Cluster).",
    )
    redis_maxmemory: str = Field(
        default="4gb",
        pattern=r"^\d+([kmgKMG][bB]?|[bB])?$",  # redis.conf's units, any case
        description="maxmemory of the redis-server `tokenrelay up` starts (noeviction: at "
        "the limit writes are refused and clients get 503 + Retry-After; deletes still "
        "work). Size it for the file quotas. compose.yaml's Redis reads REDIS_MAXMEMORY.",
    )

    # Models
    models_dir: Path = Field(
        default_factory=_default_models_dir,
        description="Directory holding prepared model directories (one per model).",
    )
    model: str = Field(
        default="SmolLM2-135M-Instruct",
        min_length=1,
        description="Model to serve: a directory name under models_dir, or a path to a "
        "HF-style model directory.",
    )
    served_model_name: str | None = Field(
        default=None, description="Name clients use for the model (default: the model's name)."
    )

    # Workers and engines
    engine: EngineName = Field(default="llamacpp", description="Engine a worker runs.")
    worker_slots: int = Field(
        default=16, ge=1, description="Concurrent jobs per worker (Celery threads, batch size)."
    )
    echo_tokens_per_second: float = Field(
        default=0.0, ge=0.0, description="Echo engine rate per job; 0 means unlimited."
    )
    llamacpp_threads: int | None = Field(
        default=None, ge=1, description="CPU threads for llama.cpp (default: all cores)."
    )
    embeddings: bool = Field(
        default=True,
        description="Workers also serve /v1/embeddings for their model when it is a GGUF "
        "and llama-cpp-python is installed (llama.cpp's embedding mode, loaded on the "
        "first embedding request; mean pooling unless the GGUF names one).",
    )
    llamacpp_extra_buffers: bool | None = Field(
        default=None,
        description="llama.cpp's extra weight buffers (repacked layouts, AMX kernels); "
        "default: on, except on CPUs with AMX, where this llama.cpp's AMX matmul crashes.",
    )
    llamacpp_n_ctx: int = Field(
        default=8192,
        ge=256,
        description="llama.cpp's KV cells, shared by the running sequences and the prefix "
        "cache (cached cells are evicted when running ones need room). Size it for the "
        "running conversations: a shared system prompt once plus each conversation's own "
        "tokens (8 chats of ~1,200 tokens sharing 700: ~5,000 cells). More is not free: "
        "every decode step scans every occupied cell, and 30,000 cached cells made 8 "
        "streams 1.6x slower here (docs/benchmarks.md, 'Chat'). ~23 KB a cell for the "
        "bundled model.",
    )
    llamacpp_cache_ram_mb: int = Field(
        default=2048,
        ge=0,
        description="Host memory (MiB) for the llama.cpp engine's prefix cache: finished "
        "sequences are saved there and copied back when a prompt starts with them, so the "
        "KV keeps only the running sequences (and llamacpp_hot_cells more): every "
        "occupied KV cell is scanned by every token of every step. 0: cached prefixes stay "
        "in the KV until evicted (llama-server's --cache-ram is the same idea; ~23 KB a "
        "token for the bundled model).",
    )
    llamacpp_hot_cells: int = Field(
        default=512,
        ge=0,
        description="With llamacpp_cache_ram_mb > 0: KV cells that cached prefixes may keep "
        "besides the running sequences (the rest wait in host memory). A cell costs every "
        "step; a restore costs a copy.",
    )
    prefix_cache: bool = Field(
        default=True,
        description="Keep the KV of finished requests so that a later prompt with the same "
        "start (a chat's next turn, a shared system prompt) prefills only the rest "
        "(llama.cpp engine; exllamav2 always reuses pages by hash).",
    )
    prefix_cache_per_key: bool = Field(
        default=False,
        description="Requests of different API keys never reuse each other's cached "
        "prompt prefixes, so cross-tenant timing cannot tell what others sent (a request's "
        "cache_salt isolates it as well).",
    )
    prefix_routing: bool = Field(
        default=True,
        description="With several workers for a model, send a conversation's next turn to "
        "the worker whose prefix cache holds its start, when that worker has room "
        "(otherwise the shared queue). Off: every request goes to the shared queue.",
    )
    exllamav2_cache_tokens: int = Field(
        default=65536, ge=256, description="Paged KV cache size of the exllamav2 engine, tokens."
    )
    exllamav2_allow_unpaged: bool = Field(
        default=False,
        description="Let an exllamav2 worker start without flash-attn >= 2.5.7 (paged "
        "attention). Unpaged, the dynamic generator runs ONE sequence at a time, so the "
        "worker serves requests one after another; off, such a worker refuses to start.",
    )
    exllamav2_segment_tokens: int = Field(
        default=512,
        ge=0,
        description="Most new tokens the exllamav2 engine reserves cache pages for at once: "
        "a longer generation runs as successive jobs of this many tokens, each continued "
        "from the text so far (full pages reused by hash), so the cache holds as many "
        "sequences as their actual length allows. 0 reserves the whole max_tokens up front.",
    )
    exllamav2_max_chunk_size: int = Field(
        default=1024,
        ge=256,
        multiple_of=256,
        description="Most prompt tokens the exllamav2 engine prefills for one job in one "
        "step (a multiple of 256, at most the model's max_input_len). A step gives every "
        "job still in prefill one chunk, so a burst of N long prompts prefills up to N "
        "chunks in one step: this bounds each job's share, not the step.",
    )
    lease_ttl_s: float = Field(
        default=5.0,
        gt=0,
        description="A job whose worker has not refreshed it for this long "
        "is considered lost and is resumed elsewhere.",
    )

    # Streamers and recovery
    streamer_takeover_s: float = Field(
        default=5.0,
        gt=0,
        description="A streamer silent this long has its requests taken over by another streamer.",
    )
    max_attempts: int = Field(
        default=4, ge=1, description="Most times a request is (re)started after losing workers."
    )
    drain_s: float = Field(
        default=20.0,
        ge=0,
        description="On SIGTERM, the most seconds a process drains before it exits: a "
        "worker takes no new jobs, finishes what it can, then hands the rest to other "
        "workers; a web process stops accepting and then ends its open streams for their "
        "clients to resume elsewhere; a streamer and a batch driver hand over at once. "
        "Keep a stop grace period (Kubernetes terminationGracePeriodSeconds) above it.",
    )
    requeue_after_s: float = Field(
        default=30.0,
        gt=0,
        description="A request still queued this long is sent again "
        "(duplicates are harmless: only one worker can claim it).",
    )
    model_max_queue: int = Field(
        default=0,
        ge=0,
        description="Most choices in flight for one model (0: only max_queue bounds it): "
        "a burst for one model cannot take all of max_queue from the others.",
    )
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Client-facing model names mapped to served ones (JSON object, e.g. "
        '{"gpt-4o-mini": "SmolLM2-135M-Instruct"}); responses report the name asked for.',
    )
    known_models: list[str] = Field(
        default_factory=list,
        description="Models served here before any worker of theirs registered (JSON "
        "list of served names, each a directory under models_dir): a request for one "
        "waits or gets 503, not 404, as a model an autoscaler starts from zero needs.",
    )
    model_wait_s: float = Field(
        default=0.0,
        ge=0,
        description="How long a request for a known model with no live worker waits "
        "queued for one to start (scale from zero); 0 answers 503 at once.",
    )
    no_worker_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A queued request fails (503) when no live worker "
        "serves its model for this long.",
    )

    # Requests
    max_stop_sequences: int = Field(
        default=16, ge=1, description="Most stop strings per request (OpenAI allows 4)."
    )
    max_stop_token_ids: int = Field(
        default=64, ge=1, description="Most stop_token_ids per request (400 above it)."
    )
    max_n: int = Field(default=16, ge=1, description="Largest n (choices per prompt) accepted.")
    max_logprobs: int = Field(
        default=20,
        ge=0,
        le=20,
        description="Largest top_logprobs (chat) / logprobs (completions) accepted.",
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="Deadline of a request, from its arrival."
    )
    stream_ttl_s: int = Field(
        default=3600,
        ge=10,
        description="TTL of request records and token/output streams; must exceed "
        "request_timeout_s + 30 s (a record must outlive its request).",
    )

    # Web
    host: str = Field(default="127.0.0.1", description="Address the web server binds.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port the web server binds.")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Bearer keys accepted (JSON list); empty means no authentication.",
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="Keys (each also in api_keys) that see, download, delete and cancel "
        "every key's files and batches; other keys see only their own (404 otherwise).",
    )
    max_queue: int = Field(
        default=256,
        ge=1,
        description="Admission limit: choices in flight (each request counts prompts x n) "
        "before 429; a request larger than this is admitted only when nothing else runs.",
    )
    key_max_in_flight: int = Field(
        default=128,
        ge=0,
        description="Quota: requests one API key may have in flight at once, HTTP and "
        "WebSocket together (429 naming key_max_in_flight above it). Applies only when "
        "api_keys are set. 0 = no limit.",
    )
    key_requests_per_minute: int = Field(
        default=0,
        ge=0,
        description="Rate limit: requests one API key may start per minute, across every "
        "web process (429 with x-ratelimit-* headers above it); a managed key's own limit "
        "wins. Applies only when api_keys are set. 0 = no limit.",
    )
    key_tokens_per_minute: int = Field(
        default=0,
        ge=0,
        description="Rate limit: tokens one API key may use per minute (prompt + max "
        "completion tokens reserved at admission, corrected to the real count at the "
        "end); a managed key's own limit wins. Applies only when api_keys are set. 0 = "
        "no limit.",
    )
    fair_share: bool = Field(
        default=True,
        description="Order the workers' queue between API keys: a key's next request "
        "waits behind other keys' first ones in proportion to how many it has in flight "
        "(divided by the key's weight), instead of arrival order.",
    )
    key_max_connections: int = Field(
        default=48,
        ge=0,
        description="Quota: WebSockets and stream followers (GET /v1/streams/{id}) one API "
        "key holds open at once in one web worker (429 naming key_max_connections above "
        "it). Each holds a thread for its life; this keeps one key from taking them all. "
        "Applies only when api_keys are set. 0 = no limit.",
    )
    max_request_choices: int = Field(
        default=256,
        ge=1,
        description="Quota: choices (prompts x n) one request may ask for (429 naming "
        "max_request_choices above it). Each request counts its choices against max_queue.",
    )
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="Largest request body accepted (413)."
    )
    web_workers: int = Field(
        default=2,
        ge=1,
        description="gunicorn worker processes of `tokenrelay web` (threaded workers that "
        "read request heads in their event loop).",
    )
    web_threads: int = Field(
        default=192,
        ge=1,
        description="Threads per web worker; each open SSE stream or WebSocket holds one, so "
        "web_workers x web_threads is the most concurrent streams (keep it above max_queue).",
    )
    web_max_connections: int = Field(
        default=2048,
        ge=16,
        description="Sockets one web worker holds at once (streams, kept-alive and "
        "half-sent requests); past it new connections wait in the kernel's backlog.",
    )
    web_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request's head (request line and headers) must arrive within this "
        "many seconds of its first byte, or the client gets 408 and is disconnected; until "
        "it is complete the request holds no thread (slowloris).",
    )
    web_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A small request body (up to 1 MiB) must arrive within this many "
        "seconds of its head; a larger one may pause at most this long between reads. "
        "Otherwise 408.",
    )
    resume_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="A streaming client that disconnects keeps its generation running this "
        "long so it can resume the stream (Last-Event-ID, WebSocket resume) on any web "
        "process; then, with nobody following, it is cancelled. 0 cancels at once.",
    )
    web_dead_after_s: float = Field(
        default=20.0,
        gt=0,
        description="A web process silent (it heartbeats every 5 s) this long is taken for "
        "dead (SIGKILL, OOM): another counts its clients out, and a stream nobody follows "
        "then is cancelled resume_grace_s after its last heartbeat. Too short cancels the "
        "streams of a process stalled longer than this plus resume_grace_s.",
    )
    sse_keepalive_s: float = Field(
        default=5.0,
        gt=0,
        description="Seconds without output after which an SSE stream gets a keep-alive "
        "comment (also how soon a silent client's disconnect is noticed).",
    )
    sse_pump: bool = Field(
        default=True,
        description="Write a flowing SSE stream's events from the web process's output "
        "reader thread instead of waking the request's thread for each (web CPU per "
        "token; gunicorn's head-first worker only). false: every write from its thread.",
    )
    ws_max_message_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="Largest WebSocket message answered normally; a larger one gets an error "
        "message and the socket stays open. Past max_body_bytes the socket is closed (1009).",
    )
    ws_ping_interval_s: float = Field(
        default=25.0,
        ge=0,
        description="Seconds between WebSocket pings; a client that misses a pong is "
        "disconnected and its requests cancelled. 0 disables pings.",
    )

    ws_allowed_origins: list[str] = Field(
        default_factory=list,
        description='Extra browser origins (JSON list, e.g. ["https://chat.example.com"]; '
        '"*" allows any) that may open the WebSocket. A page from the server\'s own '
        "origin (the Host it was reached at) and clients that send no Origin (non-browser "
        "clients) are always allowed; any other Origin is refused (1008).",
    )
    stream_buffer_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="Output a web process holds for one streaming client that has not "
        "taken it (encoded events); past it the rest waits in Redis until the client "
        "catches up.",
    )
    stream_stall_s: float = Field(
        default=30.0,
        gt=0,
        description="A streaming client whose buffer (stream_buffer_bytes) stays full "
        "while it takes nothing for this long is dropped: its stream ends with an error "
        "and its generation is cancelled. A client that keeps reading is never dropped.",
    )

    # Batches (the Files + Batches API and the batch driver)
    batch_max_file_bytes: int = Field(
        default=100 * 1024 * 1024,
        ge=1024,
        description="Largest file accepted by POST /v1/files (413 above it); files live in Redis.",
    )
    key_max_files: int = Field(
        default=1000,
        ge=0,
        description="Quota: files one API key may store at once, uploads and batch "
        "output/error files together (429 above it on upload). 0 = no limit.",
    )
    key_max_file_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=0,
        description="Quota: bytes of files one API key may store at once (429 above it "
        "on upload). 0 = no limit.",
    )
    key_max_output_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=0,
        description="Quota: bytes of output one API key's requests may have written in the "
        "last stream_ttl_s (kept that long for resumes and replays); past it new requests "
        "get 429 naming key_max_output_bytes until the oldest leave the window. Applies "
        "only when api_keys are set. 0 = no limit.",
    )
    key_max_stored_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        description="Quota: bytes of stored responses (the Responses API's store: true, "
        "their input and output) one API key may keep at once (429 naming "
        "key_max_stored_bytes above it on create). 0 = no limit.",
    )
    usage_ledger_days: int = Field(
        default=90,
        ge=1,
        description="Days the usage ledger keeps each UTC day's and hour's counts per key, "
        "model and API (GET /admin/usage; written once per finished request by the "
        "streamers). The all-time totals behind the usage metrics are kept for ever.",
    )
    batch_max_requests: int = Field(
        default=50_000, ge=1, description="Most request lines in one batch's input file."
    )
    batch_max_in_flight: int = Field(
        default=64,
        ge=1,
        description="Lines of one batch generating at once (batches do not count against "
        "max_queue; this bound keeps one batch from flooding the batch queue).",
    )
    batch_file_ttl_s: int = Field(
        default=30 * 24 * 3600,
        ge=60,
        description="TTL of uploaded files and of batch output/error files in Redis.",
    )
    batch_ttl_s: int = Field(
        default=30 * 24 * 3600,
        ge=60,
        description="TTL of a batch object, counted from its creation (keep it longer than "
        "the 24h completion window).",
    )
    batch_lock_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="A batch driver silent this long loses its batches to another driver.",
    )
    responses_ttl_s: int = Field(
        default=30 * 24 * 3600,
        ge=60,
        description="TTL of a stored Responses API object (store=true), counted from its "
        "creation. Its output stream lives only stream_ttl_s: an unfinished response whose "
        "web process died and that nobody read before then is settled as failed.",
    )

    # Logs
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="How every process logs: human text, or json: one JSON object a line "
        "on stderr (time, level, process, pid, logger, message, and request_id, trace_id, "
        "model, key_id when known; never a key). `tokenrelay up` passes it to its "
        "children (docs/operations.md, 'Logs').",
    )
    log_prompts: bool = Field(
        default=False,
        description="Debugging only: the web tier logs each request's body, prompts "
        "included, at INFO. Off, no prompt or output text is logged.",
    )

    # Flower
    flower_port: int = Field(default=5555, ge=1, le=65535, description="Flower's port.")
    flower_basic_auth: str | None = Field(
        default=None,
        pattern=r"^[^:]+:.+$",  # without a password Flower lets nobody in
        description="Flower basic auth as user:password (both non-empty).",
    )

    @field_validator("redis_url", "celery_url")
    @classmethod
    def _redis_scheme(cls, url: str, info: ValidationInfo) -> str:
        """Refused here, in one line, rather than as a traceback from the first
        connection of every process (the scheme only: the URL may hold a password)."""
        if url == "" and info.field_name == "celery_url":
            return url
        scheme = url.partition("://")[0] if "://" in url else ""
        if scheme not in REDIS_SCHEMES:
            raise ValueError(
                f"a Redis URL starts with {', '.join(s + '://' for s in REDIS_SCHEMES)} "
                f"(got {scheme + '://' if scheme else 'no scheme'})"
            )
        return url

    @model_validator(mode="after")
    def _admin_keys_are_keys(self) -> Settings:
        """An admin key that is not an API key could never authenticate: say so at start."""
        missing = [k for k in self.admin_api_keys if k not in self.api_keys]
        if missing:
            raise ValueError(
                "every key in TOKENRELAY_ADMIN_API_KEYS must also be listed in TOKENRELAY_API_KEYS"
            )
        return self

    @model_validator(mode="after")
    def _records_outlive_requests(self) -> Settings:
        """A request's record and streams must outlive the request: one that expired
        mid-generation would be recreated by the next publish without a TTL, and its
        client would lose the stream. The deadline is request_timeout_s plus a grace."""
        if self.stream_ttl_s <= self.request_timeout_s + DEADLINE_GRACE_S:
            raise ValueError(
                f"TOKENRELAY_STREAM_TTL_S ({self.stream_ttl_s}) must exceed "
                f"TOKENRELAY_REQUEST_TIMEOUT_S ({self.request_timeout_s:g}) + "
                f"{DEADLINE_GRACE_S:g} s"
            )
        return self

    def to_env(self) -> dict[str, str]:
        """These settings as TOKENRELAY_* variables, to hand to a child process."""
        out: dict[str, str] = {}
        for name, value in self.model_dump(mode="json").items():
            if value is None:
                continue
            text = value if isinstance(value, str) else json.dumps(value)
            out[f"TOKENRELAY_{name.upper()}"] = text
        return out

    @property
    def served_name(self) -> str:
        """The model id clients use, Celery queues are named after and workers register."""
        return self.served_model_name or Path(self.model).name

    def model_path(self) -> Path:
        """The directory of the served model (an absolute path wins over models_dir)."""
        candidate = Path(self.model).expanduser()
        if candidate.is_absolute() or candidate.exists():
            return candidate
        return self.models_dir / self.model

    def card_path(self) -> Path:
        """Where the served model's card is read: ``model_path()``, except for an echo
        model, which may have any name (``tokenrelay up --engine echo --model A --model
        B``): without a directory of its own it speaks with the bundled model's
        tokenizer and template."""
        path = self.model_path()
        if self.engine == "echo" and not path.is_dir():
            from app.prepare import BUNDLED_MODEL_NAME

            return self.models_dir / BUNDLED_MODEL_NAME
        return path
