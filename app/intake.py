"""Intake: one request body -> everything a run needs, the same for every transport.

HTTP (SSE or JSON), WebSocket messages and batch lines all arrive as a JSON body for
one of two endpoints. ``Intake.prepare`` is the one place that reads it leniently,
validates it against the server's ``Limits``, refuses what we do not implement (501),
checks the model, renders and tokenizes the prompt, checks the context and builds the
``RequestRecord`` plus the ``ResponseShape`` the framers need. Pure: no I/O, so the
web tier and the batch driver (and the tests) share it and cannot drift apart.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from app.chat_template import PromptBuilder
from app.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    NotFound,
    NotImplementedFeature,
    TokenRelayError,
    rename_param,
)
from app.grammar import grammar_problem
from app.lenient_json import loads_lenient
from app.messages_api import count_tokens_body, messages_param
from app.messages_api import to_chat_body as messages_to_chat_body
from app.model_card import ModelCard
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from app.records import OutputConstraint, QueueName, RequestRecord, cache_scope
from app.responses_api import (
    ResponsesRequest,
    parse_responses_request,
    responses_param,
    to_chat_body,
)
from app.settings import Settings
from app.tools import (
    FunctionName,
    NamedToolChoice,
    ToolDefinition,
    response_format_constraint,
    tool_call_constraint,
)


class Endpoint(str, Enum):
    """The generation endpoints; a batch line names one of them in its ``url``."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    # Translated to a chat request (app.responses_api); here without stored state
    # (batch lines): the HTTP route adds previous_response_id's context itself.
    RESPONSES = "/v1/responses"
    # Anthropic's Messages API, translated to a chat request (app.messages_api); its
    # record keeps this endpoint, so a resumed stream is framed as Messages again.
    MESSAGES = "/v1/messages"


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server accepts, read once from settings and passed down."""

    max_stop_sequences: int = 16
    max_stop_token_ids: int = 64
    max_n: int = 16
    max_logprobs: int = 20
    request_timeout_s: float = 600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            max_stop_sequences=settings.max_stop_sequences,
            max_stop_token_ids=settings.max_stop_token_ids,
            max_n=settings.max_n,
            max_logprobs=settings.max_logprobs,
            request_timeout_s=settings.request_timeout_s,
        )

    def parse_args(self) -> dict[str, int]:
        return {
            "max_stop_sequences": self.max_stop_sequences,
            "max_stop_token_ids": self.max_stop_token_ids,
            "max_n": self.max_n,
            "max_logprobs": self.max_logprobs,
        }


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What a response looks like, fixed when the request is accepted."""

    chat: bool
    response_id: str
    model: str
    created: int
    num_choices: int
    logprobs: bool = False
    include_usage: bool = False
    # OpenAI's ``service_tier`` was sent: responses say "default".
    service_tier: bool = False
    # vLLM's ``continuous_usage_stats``: every chunk carries the usage so far.
    continuous_usage: bool = False
    # The completions endpoint's ``echo``: per choice, the prompt text its text starts with.
    echo: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request that passed every check: ready to be admitted and submitted."""

    endpoint: Endpoint
    record: RequestRecord
    shape: ResponseShape
    stream: bool
    # The Responses API request behind a RESPONSES record (its object echoes it).
    responses: ResponsesRequest | None = None

    @property
    def request_id(self) -> str:
        return self.record.request_id


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request's rendered prompt and what rendering it settled."""

    text: str
    constraint: OutputConstraint | None
    tools_enabled: bool


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
        echo: bool = True,
    ) -> None:
        self.card = card
        self.prompts = prompts
        # Chat records carry the last user turn's ids for the echo engine to repeat;
        # another engine never reads them, so they are neither tokenized (a second
        # tokenization per request) nor stored unless the served engine is echo.
        self.echo = echo
        self.tokenizer = prompts.tokenizer
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.clock = clock
        self.new_id = new_id
        # Prompt text longer than this cannot fit the context whatever it says: refused
        # before the tokenizer spends seconds and gigabytes on an 8 MB prompt.
        self.max_prompt_chars = (card.context_length - 1) * max_chars_per_token(self.tokenizer)

    def check_prompt_chars(self, text: str, param: str) -> None:
        """The cheap bound: 400 ``context_length_exceeded`` for a prompt text so long
        that even at the vocabulary's longest token it has more tokens than the context."""
        if len(text) > self.max_prompt_chars:
            ctx = self.card.context_length
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, your "
                f"prompt has {len(text)} characters, more than {ctx} tokens can hold. "
                "Please reduce the length of the prompt.",
                param=param,
            )

    def check_model(self, model: str | None) -> None:
        """Only the served model exists here (a missing model field means ours)."""
        if model is not None and model != self.model_name:
            raise NotFound(
                f"The model '{model}' does not exist.", param="model", code="model_not_found"
            )

    def chat_prompt(self, req: ChatCompletionRequest) -> ChatPrompt:
        """The prompt text ``req`` renders: its tools only where they are offered (not
        under ``tool_choice: "none"``, nor beside a JSON ``response_format``), its
        template variables, the constraint its output runs under. One method for the
        request and for a count of its prompt (``/v1/messages/count_tokens``), so the
        count is the prompt's."""
        self.check_model(req.model)
        messages = [m.for_template() for m in req.messages]
        constraint = self.constraint(req)
        # Under a JSON response_format the grammar leaves no room for a call, so "auto"
        # tools are neither offered nor parsed (a JSON answer is never taken for a call).
        tools_enabled = req.tools_enabled and (constraint is None or constraint.kind == "tool_call")
        if tools_enabled and self.card.tool_call_parser is None:
            raise InvalidRequest(
                f"The model {self.model_name!r} has no tool-call parser (its model card sets "
                "'tool_call_parser' to null), so it cannot be offered tools.",
                param="tools",
            )
        tools = [t.for_template() for t in req.tools or ()] if tools_enabled else None
        text = self.prompts.render_chat(messages, tools=tools, variables=req.template_variables())
        self.check_prompt_chars(text, "messages")
        return ChatPrompt(text, constraint, tools_enabled)

    def chat(
        self,
        req: ChatCompletionRequest,
        *,
        queue: QueueName = "interactive",
        request_id: str | None = None,
    ) -> RequestRecord:
        prompt = self.chat_prompt(req)
        last_user = next((m.text for m in reversed(req.messages) if m.role == "user"), None)
        echo: list[list[int]] | None = None
        if last_user and self.echo:
            ids, last_user_ids = self.prompts.encode_with_part(prompt.text, last_user)
            echo = [last_user_ids]
        else:
            ids = self.prompts.encode(prompt.text)
        return self._record(
            req,
            [ids],
            echo_ids=echo,
            queue=queue,
            request_id=request_id,
            constraint=prompt.constraint,
            tools_enabled=prompt.tools_enabled,
        )

    def constraint(self, req: ChatCompletionRequest) -> OutputConstraint | None:
        """What the output must be: a forced tool call (``tool_choice`` required or
        named) wins over ``response_format``, which is the form of a content reply.

        Every schema that will be enforced is checked with the grammar engine first, so
        one it cannot enforce is a 400 naming the feature and the field, not a failed
        choice later.
        """
        fmt = self.prompts.tool_format
        choice = req.effective_tool_choice
        for i, tool in enumerate(req.tools or ()):
            if tool.function in req.forced_functions:
                one = tool_call_constraint([tool], tool_choice_for(tool), fmt)
                _check_enforceable(one, f"tools[{i}].function.parameters")
        constraint = tool_call_constraint(req.tools or [], choice, fmt)
        if constraint is not None:
            return constraint
        constraint = response_format_constraint(req.response_format)
        if constraint is not None:
            _check_enforceable(constraint, "response_format.json_schema.schema")
        return constraint

    def completion(
        self,
        req: CompletionRequest,
        *,
        queue: QueueName = "interactive",
        request_id: str | None = None,
    ) -> RequestRecord:
        self.check_model(req.model)
        for p in req.prompts:
            if isinstance(p, str):
                self.check_prompt_chars(p, "prompt")
        if req.suffix:
            self.check_prompt_chars(req.suffix, "suffix")
            prompts = [
                self.prompts.encode_infill(
                    p if isinstance(p, str) else self.prompts.decode(p), req.suffix
                )
                for p in req.prompts
            ]
        else:
            texts = iter(self.prompts.encode_many([p for p in req.prompts if isinstance(p, str)]))
            prompts = [p if isinstance(p, list) else next(texts) for p in req.prompts]
        for ids in prompts:
            self.check_token_ids(ids, "prompt", "Prompt token ids")
        echo = None
        if req.echo:  # each prompt's text, as given (token ids: their text)
            echo = [p if isinstance(p, str) else self.prompts.decode(p) for p in req.prompts]
        return self._record(
            req, prompts, echo_ids=None, queue=queue, request_id=request_id, echo_prompts=echo
        )

    def check_token_ids(self, ids: Iterable[int], param: str, what: str) -> None:
        """Token ids must be the model's: an id outside the vocabulary is a 400 here, not
        an engine's out-of-bounds read (or a silent no-op) later."""
        vocab = self.card.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"{what} must be in [0, {vocab}).", param=param)

    def _record(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        *,
        echo_ids: list[list[int]] | None,
        queue: QueueName,
        request_id: str | None,
        constraint: OutputConstraint | None = None,
        tools_enabled: bool = False,
        echo_prompts: list[str] | None = None,
    ) -> RequestRecord:
        self.check_token_ids(req.stop_token_ids, "stop_token_ids", "Stop token ids")
        self.check_token_ids(req.logit_bias or {}, "logit_bias", "Token ids in 'logit_bias'")
        longest = self._check_context(req, prompts)
        stop = req.stop_conditions(
            eos_token_ids=self.card.eos_token_ids,
            default_max_tokens=self.card.context_length - longest,
        )
        now = self.clock()
        chat = isinstance(req, ChatCompletionRequest)
        return RequestRecord(
            request_id=request_id or self.new_id(),
            model=self.model_name,
            prompts=prompts,
            n=req.n,
            sampling=req.sampling_params(constraint=constraint),
            stop=stop,
            echo_ids=echo_ids,
            skip_special_tokens=req.skip_special_tokens,
            created=now,
            deadline=now + self.request_timeout_s,
            queue=queue,
            endpoint="/v1/chat/completions" if chat else "/v1/completions",
            include_usage=req.include_usage,
            tool_parser=self.card.tool_call_parser if tools_enabled else None,
            # Completions are raw text (no template wrote think tags), and a constrained
            # output has no room for thinking: its text is the answer.
            reasoning_parser=self.card.reasoning_parser if chat and constraint is None else None,
            tools_enabled=tools_enabled,
            single_tool_call=tools_enabled
            and isinstance(req, ChatCompletionRequest)
            and req.parallel_tool_calls is False,
            service_tier=isinstance(req, ChatCompletionRequest) and req.service_tier is not None,
            continuous_usage=req.continuous_usage,
            echo_prompts=echo_prompts,
            priority=req.priority,
        )

    def _check_context(
        self, req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]]
    ) -> int:
        """The longest prompt's length, once it and the completion asked for fit in the
        model's context (else the OpenAI ``context_length_exceeded`` error)."""
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
        return longest


# Characters one token covers at most when the vocabulary cannot be listed.
FALLBACK_CHARS_PER_TOKEN = 128


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters of prompt text one token can cover: the longest entry of
    the vocabulary (a byte-level entry's symbols are bytes, never fewer than the
    characters they spell), doubled when a normalizer might drop characters first."""
    try:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(t) for t in vocab), default=0)
    except Exception:  # not a tokenizers.Tokenizer: be generous instead
        longest = 0
    if longest <= 0:
        return FALLBACK_CHARS_PER_TOKEN
    return longest * (2 if getattr(tokenizer, "normalizer", None) is not None else 1)


def tool_choice_for(tool: ToolDefinition) -> NamedToolChoice:
    """``tool_choice`` naming ``tool``."""
    return NamedToolChoice(type="function", function=FunctionName(name=tool.function.name))


def _check_enforceable(constraint: OutputConstraint | None, param: str) -> None:
    problem = grammar_problem(constraint) if constraint is not None else None
    if problem is not None:
        raise InvalidRequest(
            f"Invalid schema: it cannot be enforced while sampling: {problem}.", param=param
        )


FUNCTIONS_NOT_SUPPORTED = (
    "The deprecated 'functions' / 'function_call' API is not supported by this server."
)


class Intake:
    """Request bodies -> ``PreparedRequest`` for the one model this process serves."""

    def __init__(
        self, builder: RecordBuilder, limits: Limits, *, cache_per_key: bool = False
    ) -> None:
        """``cache_per_key``: requests of different API keys never share cached prompt
        prefixes (``Settings.prefix_cache_per_key``)."""
        self.builder = builder
        self.limits = limits
        self.cache_per_key = cache_per_key

    @classmethod
    def for_model(
        cls,
        settings: Settings,
        card: ModelCard,
        *,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        model_name: str | None = None,
        echo: bool | None = None,
    ) -> Intake:
        """The intake of ``card`` served as ``model_name`` (default: the settings' own
        model); ``echo``: its workers run the echo engine (default: the settings')."""
        limits = Limits.from_settings(settings)
        builder = RecordBuilder(
            card,
            PromptBuilder.from_card(card),
            model_name=model_name or settings.served_name,
            request_timeout_s=limits.request_timeout_s,
            clock=clock,
            new_id=new_id,
            echo=settings.engine == "echo" if echo is None else echo,
        )
        return cls(builder, limits, cache_per_key=settings.prefix_cache_per_key)

    @property
    def model_name(self) -> str:
        return self.builder.model_name

    def prepare(
        self,
        endpoint: Endpoint,
        body: Any,
        *,
        queue: QueueName = "interactive",
        request_id: str | None = None,
        stream: bool | None = None,
        owner: str = "",
        context: list[Any] | None = None,
    ) -> PreparedRequest:
        """Validate ``body`` (raw bytes/text are read leniently) and build its record.

        ``stream`` overrides the body's own ``stream`` (a WebSocket always streams; a
        batch line never does); ``owner`` (the key's hash) is who may resume it;
        ``context`` is the conversation a Responses body continues, settled from stored
        responses (``broker.response_service``; None: there is no stored state).
        Raises a ``TokenRelayError`` naming what is wrong.
        """
        if isinstance(body, bytes | str):
            body = loads_lenient(body)
        if not isinstance(body, dict):
            raise InvalidRequest("The request body must be a JSON object.")
        if stream is not None:
            body = {**body, "stream": stream}
        if endpoint is Endpoint.RESPONSES:
            return self._prepare_responses(
                body, queue=queue, request_id=request_id, owner=owner, context=context
            )
        if endpoint is Endpoint.MESSAGES:
            chat_body = messages_to_chat_body(body)
            try:
                chat = self.prepare(
                    Endpoint.CHAT, chat_body, queue=queue, request_id=request_id, owner=owner
                )
            except TokenRelayError as exc:
                rename_param(exc, messages_param(exc.param))
                raise
            record = chat.record.model_copy(update={"endpoint": Endpoint.MESSAGES.value})
            return replace(chat, endpoint=Endpoint.MESSAGES, record=record)
        req: ChatCompletionRequest | CompletionRequest
        if endpoint is Endpoint.CHAT:
            req = parse_chat_request(body, **self.limits.parse_args())
            if req.uses_deprecated_functions:
                raise NotImplementedFeature(
                    FUNCTIONS_NOT_SUPPORTED,
                    param="functions" if req.functions is not None else "function_call",
                    code="unsupported_parameter",
                )
            record = self.builder.chat(req, queue=queue, request_id=request_id)
        else:
            req = parse_completion_request(body, **self.limits.parse_args())
            record = self.builder.completion(req, queue=queue, request_id=request_id)
        scope = cache_scope(req.cache_salt, owner if self.cache_per_key else "")
        if owner or scope:
            record = record.model_copy(update={"owner": owner, "cache_scope": scope})
        return PreparedRequest(endpoint, record, shape_of(record), stream=bool(req.stream))

    def message_tokens(self, body: Any) -> int:
        """The prompt tokens of a Messages ``body`` (``/v1/messages/count_tokens``, where
        ``max_tokens`` is not required): the prompt ``prepare`` builds for it, counted
        without checking that a completion fits the context."""
        chat = count_tokens_body(body)
        try:
            req = parse_chat_request(chat, **self.limits.parse_args())
            text = self.builder.chat_prompt(req).text
        except TokenRelayError as exc:
            rename_param(exc, messages_param(exc.param))
            raise
        return len(self.builder.prompts.encode(text))

    def _prepare_responses(
        self,
        body: dict[str, Any],
        *,
        queue: QueueName,
        request_id: str | None,
        owner: str,
        context: list[Any] | None,
    ) -> PreparedRequest:
        """A Responses body, translated to chat over ``context`` + its own input. Without
        stored state (a batch line) it may not continue or outlive its request."""
        responses = parse_responses_request(body)
        for name in ("previous_response_id", "background"):
            if context is None and getattr(responses, name):
                raise InvalidRequest(
                    f"'{name}' needs stored responses: use POST /v1/responses.",
                    param=name,
                    code="unsupported_parameter",
                )
        chat = to_chat_body(responses, (context or []) + responses.input_items)
        try:
            prepared = self.prepare(
                Endpoint.CHAT, chat, queue=queue, request_id=request_id, owner=owner
            )
        except TokenRelayError as exc:
            rename_param(exc, responses_param(exc.param))
            raise
        record = prepared.record.model_copy(update={"api": Endpoint.RESPONSES.value})
        return replace(prepared, endpoint=Endpoint.RESPONSES, record=record, responses=responses)

    def restore(self, record: RequestRecord) -> PreparedRequest:
        """A stored request again (a client resuming its stream on another process)."""
        return PreparedRequest(Endpoint(record.endpoint), record, shape_of(record), stream=True)


def shape_of(record: RequestRecord) -> ResponseShape:
    """A request's response shape, from its record alone."""
    chat = record.endpoint in (Endpoint.CHAT.value, Endpoint.MESSAGES.value)
    return ResponseShape(
        chat=chat,
        response_id=("chatcmpl-" if chat else "cmpl-") + record.request_id,
        model=record.model_alias or record.model,
        created=int(record.created),
        num_choices=record.num_choices,
        logprobs=record.sampling.logprobs is not None,
        include_usage=record.include_usage,
        service_tier=record.service_tier,
        continuous_usage=record.continuous_usage,
        echo=tuple(record.echo_prompts[c // record.n] for c in range(record.num_choices))
        if record.echo_prompts is not None
        else None,
    )
