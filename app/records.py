"""The request record: what the web tier writes and workers and streamers read.

Stored as a Redis hash (``broker.keys.Keys.request``): ``body`` is the JSON of
``RequestRecord`` (immutable once written); ``state``, ``attempt`` and ``worker`` change
as the request moves queued -> running -> done, and only through the Lua scripts in
``broker.requests``.

``app.intake`` builds records from request bodies (``RecordBuilder``); this module is
only the record and its parts (``StopConditions``, built by the request model itself;
``SamplingParams`` with its ``OutputConstraint``), which web, workers and streamers all
read.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# How long past a request's deadline a reader waits for the streamers' own deadline error
# before giving up itself: the "no hang" guarantee's last line, the same for every reader.
DEADLINE_GRACE_S = 30.0


class StopConditions(BaseModel):
    """Everything that ends a choice, applied by the Decoder (and partly by engines).

    ``eos_token_ids`` come from the model card and end a choice silently (no
    stop_reason); ``stop_token_ids`` come from the user and are reported as the
    stop_reason. Both are hidden from the text.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    min_tokens: int = Field(default=0, ge=0, description="No stop applies before this many.")
    stop: tuple[str, ...] = Field(default=(), description="Stop strings.")
    stop_token_ids: tuple[int, ...] = Field(default=(), description="User stop token ids.")
    eos_token_ids: tuple[int, ...] = Field(default=(), description="The model's EOS ids.")
    include_stop_str_in_output: bool = Field(
        default=False, description="Keep the matched stop string in the text."
    )
    ignore_eos: bool = Field(default=False, description="Do not stop on the model's EOS ids.")


class OutputConstraint(BaseModel):
    """What a choice's output must be, enforced by the engine while sampling (a grammar
    per sequence): ``prefix`` + one JSON value + ``suffix``, then EOS.

    ``kind``: ``json_object`` (any JSON object; ``json_schema`` None), ``json_schema``
    (``response_format`` with a schema), ``tool_call`` (``tool_choice`` required or
    named: one call object ``{"name", "arguments"}`` in the model's tool-call syntax,
    whose ``prefix``/``suffix`` are that syntax's tags).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["json_object", "json_schema", "tool_call"]
    json_schema: str | None = Field(default=None, description="The JSON schema, as JSON text.")
    prefix: str = ""
    suffix: str = ""


class SamplingParams(BaseModel):
    """Sampling settings with OpenAI's neutral defaults (engines map them explicitly)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="None: no logprobs; 0: the sampled token's only; k: plus the top k.",
    )
    constraint: OutputConstraint | None = None


class RequestState(str, Enum):
    QUEUED = "queued"  # waiting for a worker (first time or after a resume)
    RUNNING = "running"  # a worker holds its lease
    DONE = "done"  # every choice finished; nothing more will be published


QueueName = Literal["interactive", "batch"]
EndpointPath = Literal["/v1/chat/completions", "/v1/completions", "/v1/messages"]


class RequestRecord(BaseModel):
    """A generation request as token ids: everything a worker and a streamer need.

    ``prompts`` holds one prompt per prompt index (a chat has one); choice ``c`` runs
    on ``prompts[c // n]``, so the completions endpoint's list-of-prompts maps to
    choice index ``prompt_index * n + i`` as OpenAI does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    model: str
    # The name the client asked for when it was an alias of ``model`` (responses report
    # it); "" when it asked for ``model`` itself.
    model_alias: str = ""
    prompts: list[list[int]] = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stop: StopConditions
    echo_ids: list[list[int]] | None = Field(
        default=None, description="Per prompt: what the echo engine repeats (chat: last user turn)."
    )
    created: float = Field(description="Unix time the request arrived.")
    deadline: float = Field(description="Unix time after which it is abandoned with an error.")
    queue: QueueName = "interactive"
    skip_special_tokens: bool = True
    # How its response is framed, so a client can resume the stream on any process.
    endpoint: EndpointPath = "/v1/chat/completions"
    # The API the client called when its endpoint frames it as another (a Responses API
    # request runs as a chat): what the usage ledger counts it under (app.usage). "" =
    # ``endpoint``.
    api: Literal["", "/v1/responses"] = ""
    include_usage: bool = False
    # Tool calls and reasoning (parsed per choice beside the Decoder, app.toolcalls and
    # app.reasoning): the parsers' names, and whether tool syntax is parsed at all.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    tools_enabled: bool = False
    # ``parallel_tool_calls: false``: a choice makes at most one call (what the model
    # writes after it is dropped).
    single_tool_call: bool = False
    # Framing the client asked for: OpenAI's ``service_tier`` (echoed as "default"),
    # vLLM's ``continuous_usage_stats`` (usage on every chunk), and the completions
    # endpoint's ``echo`` (each prompt's text before its choices' text).
    service_tier: bool = False
    continuous_usage: bool = False
    echo_prompts: list[str] | None = None
    # vLLM's ``priority``: lower runs earlier among the same key's waiting requests
    # (it shifts the key's fair-share step, ``broker.celery_app.fair_priority``).
    priority: int = 0
    # Queued in its key's fair-share queue (``broker.fair_queue``): its task takes
    # whichever request is next by fair share, and a resend puts it back there.
    fair: bool = False
    # Who may resume or replay the stream: the hash of the API key that made it ("" when
    # no keys are configured), as files and batches record theirs.
    owner: str = ""
    # Whose cached prompt prefixes it may reuse on a worker (``cache_scope``): "" shares
    # with every request of the model that has no scope either.
    cache_scope: str = ""
    # The worker the web tier sent it to because that worker holds its prefix
    # (``broker.prefix_routes``); "" for the shared queue. If that worker dies before
    # taking it, the streamers' watchdog sends it to the shared queue.
    route: str = ""
    # Its W3C trace context (``traceparent``, ``tracestate``: app.tracecontext) when the
    # web tier traces it: the parent of every span the other processes add to its trace
    # (``broker.tracing``). Empty when tracing is off.
    trace: dict[str, str] = Field(default_factory=dict)

    @property
    def give_up_at(self) -> float:
        """Unix time after which a reader stops waiting for output (deadline + grace)."""
        return self.deadline + DEADLINE_GRACE_S

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def engine_scope(self) -> str:
        """The scope a worker runs its jobs under (``EngineJob.cache_scope``) and the
        web tier routes by (``app.prefix_blocks``): the model, then ``cache_scope``, so
        a cached prefix is never reused across models or scopes."""
        return f"{self.model}\n{self.cache_scope}"

    def prompt_for(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]

    @property
    def max_tokens(self) -> int:
        """Resolved by the web tier: the record always carries a max_tokens."""
        assert self.stop.max_tokens is not None
        return self.stop.max_tokens

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: str | bytes) -> RequestRecord:
        return cls.model_validate_json(raw)


def cache_scope(cache_salt: str | None, key: str = "") -> str:
    """The prefix-cache scope of a request: a digest of its ``cache_salt`` (vLLM's
    request field) and, where a deployment isolates API keys, the key's hash.

    Requests reuse each other's cached KV only within one scope, so a tenant who sets a
    salt (or every key, with ``TOKENRELAY_PREFIX_CACHE_PER_KEY``) cannot learn from
    timing which prompts others sent. A digest, so that neither reaches the workers."""
    if not cache_salt and not key:
        return ""
    raw = f"{len(cache_salt or '')}:{cache_salt or ''}:{key}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]
