"""The request record: what the web tier writes and workers and streamers read.

Stored as a Redis hash (``broker.keys.Keys.request``): ``body`` is the JSON of
``RequestRecord`` (immutable once written); ``state``, ``attempt`` and ``worker`` change
as the request moves queued -> running -> done, and only through the Lua scripts in
``broker.requests``.

``RecordBuilder`` turns a validated OpenAI request into a record (chat template,
tokenize, context check, stop conditions). It is pure, and two processes use it through
``app.intake.Intake``: the web tier for interactive requests and the batch driver for
batch lines, so a batch line and an HTTP request cannot disagree on what a request means.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.chat_template import PromptBuilder
from app.errors import ContextLengthExceeded, InvalidRequest, NotFound
from app.messages import SamplingParams, StopConditions
from app.model_card import ModelCard
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    to_sampling_params,
    to_stop_conditions,
)

# How long past a request's deadline a reader waits for the streamers' own deadline error
# before giving up itself: the "no hang" guarantee's last line, the same for every reader.
DEADLINE_GRACE_S = 30.0


class RequestState(str, Enum):
    QUEUED = "queued"  # waiting for a worker (first time or after a resume)
    RUNNING = "running"  # a worker holds its lease
    DONE = "done"  # every choice finished; nothing more will be published


QueueName = Literal["interactive", "batch"]
EndpointPath = Literal["/v1/chat/completions", "/v1/completions"]


class RequestRecord(BaseModel):
    """A generation request as token ids: everything a worker and a streamer need.

    ``prompts`` holds one prompt per prompt index (a chat has one); choice ``c`` runs
    on ``prompts[c // n]``, so the completions endpoint's list-of-prompts maps to
    choice index ``prompt_index * n + i`` as OpenAI does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    model: str
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
    include_usage: bool = False

    @property
    def give_up_at(self) -> float:
        """Unix time after which a reader stops waiting for output (deadline + grace)."""
        return self.deadline + DEADLINE_GRACE_S

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

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


class RecordBuilder:
    """OpenAI requests -> ``RequestRecord`` for one served model (pure: no I/O).

    ``clock`` and ``new_id`` are parameters so callers (and tests) control creation
    times, deadlines and request ids.
    """

    def __init__(
        self,
        card: ModelCard,
        prompts: PromptBuilder,
        *,
        model_name: str,
        request_timeout_s: float,
        clock: Callable[[], float],
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.card = card
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.clock = clock
        self.new_id = new_id

    def check_model(self, model: str | None) -> None:
        """Only the served model exists here (a missing model field means ours)."""
        if model is not None and model != self.model_name:
            raise NotFound(
                f"The model '{model}' does not exist.", param="model", code="model_not_found"
            )

    def chat(
        self,
        req: ChatCompletionRequest,
        *,
        queue: QueueName = "interactive",
        request_id: str | None = None,
    ) -> RequestRecord:
        self.check_model(req.model)
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        prompt = self.prompts.encode_chat(messages)
        last_user = next((m.text for m in reversed(req.messages) if m.role == "user"), None)
        echo = (
            [self.tokenizer.encode(last_user, add_special_tokens=False).ids] if last_user else None
        )
        return self._record(req, [prompt], echo_ids=echo, queue=queue, request_id=request_id)

    def completion(
        self,
        req: CompletionRequest,
        *,
        queue: QueueName = "interactive",
        request_id: str | None = None,
    ) -> RequestRecord:
        self.check_model(req.model)
        prompts = [p if isinstance(p, list) else self.prompts.encode(p) for p in req.prompts]
        vocab = self.card.vocab_size
        for ids in prompts:
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise InvalidRequest(f"Prompt token ids must be in [0, {vocab}).", param="prompt")
        return self._record(req, prompts, echo_ids=None, queue=queue, request_id=request_id)

    def _record(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        *,
        echo_ids: list[list[int]] | None,
        queue: QueueName,
        request_id: str | None,
    ) -> RequestRecord:
        ctx = self.card.context_length
        longest = max(len(p) for p in prompts)
        if longest >= ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, your "
                f"prompt has {longest} tokens. Please reduce the length of the prompt.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        asked = req.max_new_tokens
        if asked is not None and longest + asked > ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you "
                f"requested {longest + asked} tokens ({longest} in the prompt, {asked} for "
                f"the completion). Please reduce the length of the prompt or completion.",
                param="max_tokens",
            )
        stop = to_stop_conditions(
            req, eos_token_ids=self.card.eos_token_ids, default_max_tokens=ctx - longest
        )
        now = self.clock()
        chat = isinstance(req, ChatCompletionRequest)
        return RequestRecord(
            request_id=request_id or self.new_id(),
            model=self.model_name,
            prompts=prompts,
            n=req.n,
            sampling=to_sampling_params(req),
            stop=stop,
            echo_ids=echo_ids,
            skip_special_tokens=req.skip_special_tokens,
            created=now,
            deadline=now + self.request_timeout_s,
            queue=queue,
            endpoint="/v1/chat/completions" if chat else "/v1/completions",
            include_usage=req.include_usage,
        )
