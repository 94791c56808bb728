"""The OpenAI API as tokenrelay serves it: request validation and response shapes.

Field names follow OpenAI's API (and vLLM's extensions: ``stop_token_ids``,
``min_tokens``, ``top_k``, ``stop_reason``, ...) exactly, so any OpenAI client works.

Requests
    ``parse_chat_request`` / ``parse_completion_request`` validate a decoded JSON body
    against limits taken from settings and raise ``InvalidRequest`` (400) whose ``param``
    names the offending field (``"temperature"``, ``"messages[0].content"``). Unknown
    fields are rejected as OpenAI does. A validated request builds the parts of its record
    itself (``sampling_params``, ``stop_conditions``: ``app.records``).

Responses live in ``app.response_models``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, cast

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.chat_message import ChatMessage
from app.metadata import check_metadata
from app.records import OutputConstraint, SamplingParams, StopConditions
from app.tools import (
    FunctionDefinition,
    NamedToolChoice,
    ResponseFormat,
    ToolChoice,
    ToolDefinition,
    forced_functions,
    tool_choice_problem,
)
from app.validation import RequestModel, invalid
from app.validation import (
    validation_error_to_invalid_request as validation_error_to_invalid_request,
)

DEFAULT_MAX_STOP_SEQUENCES = 16
DEFAULT_MAX_STOP_TOKEN_IDS = 64
DEFAULT_MAX_N = 16
DEFAULT_MAX_LOGPROBS = 20  # OpenAI allows 20 top_logprobs (5 for legacy completions)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

_LIMIT_DEFAULTS = {
    "max_stop_sequences": DEFAULT_MAX_STOP_SEQUENCES,
    "max_stop_token_ids": DEFAULT_MAX_STOP_TOKEN_IDS,
    "max_n": DEFAULT_MAX_N,
    "max_logprobs": DEFAULT_MAX_LOGPROBS,
}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# What an engine takes as a count (a C int): more is no setting, only an overflow.
_INT32_MAX = 2**31 - 1

# ---------------------------------------------------------------------------------------
# Validation plumbing (the errors themselves: app.validation)
# ---------------------------------------------------------------------------------------


def _limit(info: ValidationInfo, name: str) -> int:
    context = info.context
    if isinstance(context, Mapping) and context.get(name) is not None:
        return int(context[name])
    return _LIMIT_DEFAULTS[name]


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool | None = Field(
        default=None, description="Send a final chunk with the request's usage."
    )
    continuous_usage_stats: bool | None = Field(
        default=None, description="vLLM's: every chunk carries the usage so far."
    )
    include_obfuscation: bool | None = Field(
        default=None, description="OpenAI's stream padding: accepted, none is added."
    )


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class _GenerationRequest(RequestModel):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = Field(default=None, description="Served model name (default: ours).")
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    stop: list[str] = Field(default_factory=list, description="A string or a list of them.")
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(default=0, ge=0, le=_INT32_MAX)
    ignore_eos: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        default=None, ge=-1, le=_INT32_MAX, description="-1 or 0 disables top-k."
    )
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="vLLM's: requests reuse each other's cached prompt prefixes only when "
        "their salts are equal (or both absent).",
    )
    skip_special_tokens: bool = Field(
        default=True,
        description="vLLM's: leave special tokens (e.g. EOS) out of the text and logprobs.",
    )
    # vLLM's: lower runs earlier among the same key's waiting requests.
    priority: int = Field(default=0, ge=-_INT32_MAX, le=_INT32_MAX)

    @field_validator("n")
    @classmethod
    def _check_n(cls, n: int, info: ValidationInfo) -> int:
        max_n = _limit(info, "max_n")
        if n > max_n:
            raise invalid(f"'n' must be at most {max_n} (got {n}).")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any, info: ValidationInfo) -> list[str]:
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise invalid("'stop' must be a string or a list of strings.")
        # An empty stop string would end every completion at once: treat it as absent.
        stops = list(dict.fromkeys(s for s in items if s))
        most = _limit(info, "max_stop_sequences")
        if len(stops) > most:
            raise invalid(f"'stop' may hold at most {most} sequences (got {len(stops)}).")
        return stops

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _check_stop_token_ids(cls, value: Any, info: ValidationInfo) -> list[int]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise invalid("'stop_token_ids' must be a list of non-negative token ids.")
        # Counted before the ids are checked: a million ids is one cheap 400.
        most = _limit(info, "max_stop_token_ids")
        if len(value) > most:
            raise invalid(f"'stop_token_ids' may hold at most {most} ids (got {len(value)}).")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise invalid("'stop_token_ids' must be a list of non-negative token ids.")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> dict[int, float] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid("'logit_bias' must be an object mapping token ids to biases.")
        out: dict[int, float] = {}
        for key, bias in value.items():
            try:
                token = int(key) if isinstance(key, str | int) else -1
            except ValueError:
                token = -1
            if isinstance(key, bool) or token < 0:
                raise invalid(f"Invalid key in 'logit_bias': {key!r} is not a token id.")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise invalid(f"Invalid bias for token {key!r} in 'logit_bias': not a number.")
            if not -100 <= bias <= 100:
                raise invalid(
                    f"Invalid bias for token {key!r} in 'logit_bias': "
                    f"must be between -100 and 100 (got {bias!r})."
                )
            out[token] = float(bias)
        return out

    @model_validator(mode="after")
    def _check_combinations(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise invalid(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                subpath="stream_options",
            )
        limit = self.max_new_tokens
        if limit is not None and self.min_tokens > limit:
            raise invalid(
                f"'min_tokens' ({self.min_tokens}) must not exceed 'max_tokens' ({limit}).",
                subpath="min_tokens",
            )
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """The requested completion length limit, if the client set one."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a streaming client asked for a final usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: the usage so far on every chunk (with
        ``include_usage``, as vLLM has it)."""
        options = self.stream_options
        return bool(self.include_usage and options and options.continuous_usage_stats)

    @property
    def top_logprobs_wanted(self) -> int | None:
        """How many alternatives to report per token (None: no logprobs at all)."""
        raise NotImplementedError

    def sampling_params(self, *, constraint: OutputConstraint | None = None) -> SamplingParams:
        """The request's sampling settings; what it leaves unset gets OpenAI's neutral
        value. ``constraint`` is what the output must be (built from the request and
        the model's tool-call syntax: ``app.tools``)."""

        def pick(value: float | None, default: float) -> float:
            return default if value is None else value

        return SamplingParams(
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=max(self.top_k or 0, 0),
            min_p=pick(self.min_p, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            logit_bias=dict(self.logit_bias or {}),
            seed=self.seed,
            logprobs=self.top_logprobs_wanted,
            constraint=constraint,
        )

    def stop_conditions(
        self, *, eos_token_ids: Iterable[int], default_max_tokens: int | None
    ) -> StopConditions:
        """Everything that ends a choice of this request: what the Decoder applies.

        ``max_tokens`` is ``max_completion_tokens``, else ``max_tokens``, else
        ``default_max_tokens`` (e.g. what is left of the context; None: no limit).
        """
        return StopConditions(
            max_tokens=self.max_new_tokens or default_max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            eos_token_ids=tuple(eos_token_ids),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
        )


# Template variables that the request's own fields set.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)
    # Accepted by the schema only so the web tier can answer 501 (see
    # ``uses_deprecated_functions``).
    functions: Any = None
    function_call: Any = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's fields, honoured where they mean something here, else accepted and
    # ignored (SDK helpers and agent frameworks send them): docs/api.md says which.
    reasoning_effort: ReasoningEffort | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: Any = None
    # vLLM's: extra variables for the chat template (e.g. ``enable_thinking``).
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _check_metadata(cls, value: Any) -> dict[str, str] | None:
        return check_metadata(value)

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value and "audio" in value:
            raise invalid("Audio output is not supported by this server; use ['text'].")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise invalid(
                f"'chat_template_kwargs' may not set {', '.join(map(repr, reserved))}: "
                "those come from the request itself."
            )
        return value

    def template_variables(self) -> dict[str, Any]:
        """The extra chat template variables: ``chat_template_kwargs``, and
        ``reasoning_effort`` as itself and as the thinking switch templates such as
        Qwen 3's read (``enable_thinking``: off for "none", on otherwise) unless the
        kwargs set it."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return variables

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise invalid("'messages' must be a non-empty list of messages.")
        return messages

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        most = _limit(info, "max_logprobs")
        if value is not None and value > most:
            raise invalid(f"'top_logprobs' must be at most {most} (got {value}).")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        problem = tool_choice_problem(value)
        if problem is not None:
            raise invalid(problem)
        return value

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise invalid(
                    f"Duplicate function name {name!r} in 'tools'.", subpath=f"tools[{i}]"
                )
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid(
                f"'tool_choice' names the function {choice.function.name!r}, which is not "
                "in 'tools'.",
                subpath="tool_choice",
            )
        if choice == "required" and not names:
            raise invalid(
                "'tool_choice' 'required' is only allowed when 'tools' are specified.",
                subpath="tool_choice",
            )
        # Whether a schema can be enforced is checked with the grammar engine when the
        # record is built (app.intake): only schemas that will be enforced must be.
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise invalid(
                    "Missing required parameter: 'response_format.json_schema'.",
                    subpath="response_format.json_schema",
                )
        elif fmt is not None and fmt.json_schema is not None:
            raise invalid(
                f"'response_format.json_schema' is only allowed with type 'json_schema' "
                f"(got {fmt.type!r}).",
                subpath="response_format.json_schema",
            )
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """``tool_choice`` with OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tools_enabled(self) -> bool:
        """Tools are offered to the model (and its output parsed for calls)."""
        return bool(self.tools) and self.effective_tool_choice != "none"

    @property
    def forced_functions(self) -> list[FunctionDefinition]:
        """The functions ``tool_choice`` forces one call of (required / named)."""
        return forced_functions(self.tools or [], self.effective_tool_choice)

    @model_validator(mode="after")
    def _check_chat_combinations(self) -> ChatCompletionRequest:
        if (
            self.max_completion_tokens is not None
            and self.max_tokens is not None
            and self.max_completion_tokens != self.max_tokens
        ):
            raise invalid(
                "'max_tokens' and 'max_completion_tokens' disagree; set only one.",
                subpath="max_completion_tokens",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid(
                "'top_logprobs' is only allowed when 'logprobs' is true.", subpath="top_logprobs"
            )
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def uses_deprecated_functions(self) -> bool:
        """True when the deprecated function-calling API is used (the web tier: 501)."""
        return (
            self.functions is not None
            or self.function_call is not None
            or any(m.role == "function" for m in self.messages)
        )


Prompt = str | list[str] | list[int] | list[list[int]]


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``; token-id prompts are accepted, as vLLM does."""

    prompt: Prompt
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        bad = (
            "'prompt' must be a non-empty string, a list of strings, a list of token ids "
            "or a list of lists of token ids."
        )
        if isinstance(value, str):
            if not value:
                raise invalid("'prompt' must not be empty.")
            return value
        if not isinstance(value, list) or not value:
            raise invalid(bad)
        if all(isinstance(p, str) for p in value):
            if not all(value):
                raise invalid("'prompt' must not contain empty strings.")
            return value
        if _is_token_ids(value) or all(_is_token_ids(p) for p in value):
            return value
        raise invalid(bad)

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        most = _limit(info, "max_logprobs")
        if value is not None and value > most:
            raise invalid(f"'logprobs' must be at most {most} (got {value}).")
        return value

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise invalid(
                "'echo' with 'logprobs' is not supported (the prompt's own logprobs are "
                "not computed); ask for either.",
                subpath="echo",
            )
        if self.echo and self.suffix:
            raise invalid("'echo' and 'suffix' cannot be combined.", subpath="echo")
        return self

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise invalid(
                f"'best_of' must equal 'n' ({self.n}) when set (got {self.best_of}).",
                subpath="best_of",
            )
        return self

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of this batch (choice index = prompt_index * n + i)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if _is_token_ids(prompt):
            return [cast("list[int]", prompt)]
        return list(cast("list[str] | list[list[int]]", prompt))


def _context(
    max_stop_sequences: int,
    max_n: int,
    max_logprobs: int,
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS,
) -> dict[str, int]:
    return {
        "max_stop_sequences": max_stop_sequences,
        "max_stop_token_ids": max_stop_token_ids,
        "max_n": max_n,
        "max_logprobs": min(max_logprobs, 20),  # SamplingParams holds at most 20
    }


def parse_chat_request(
    body: Any,
    *,
    max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES,
    max_n: int = DEFAULT_MAX_N,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS,
) -> ChatCompletionRequest:
    """Validate a decoded JSON body; raises ``InvalidRequest`` (400) naming the field."""
    try:
        return ChatCompletionRequest.model_validate(
            body, context=_context(max_stop_sequences, max_n, max_logprobs, max_stop_token_ids)
        )
    except ValidationError as exc:
        raise validation_error_to_invalid_request(exc) from exc


def parse_completion_request(
    body: Any,
    *,
    max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES,
    max_n: int = DEFAULT_MAX_N,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS,
) -> CompletionRequest:
    """Validate a decoded JSON body; raises ``InvalidRequest`` (400) naming the field."""
    try:
        return CompletionRequest.model_validate(
            body, context=_context(max_stop_sequences, max_n, max_logprobs, max_stop_token_ids)
        )
    except ValidationError as exc:
        raise validation_error_to_invalid_request(exc) from exc


# ---------------------------------------------------------------------------------------
# Conversions to the internal messages
# ---------------------------------------------------------------------------------------
