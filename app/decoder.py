"""Token ids in, text out: the per-choice stop logic of a request (pure, no I/O).

A ``Decoder`` turns one choice's generated token ids into released text, applying
``StopConditions`` the way NVIDIA Dynamo's backend and vLLM do: incremental
detokenization (``DecodeStream``), ``min_tokens``, stop token ids, stop strings that may
span tokens and split characters, and withholding of text that could still become a
hidden stop string. A ``RequestDecoder`` holds one ``Decoder`` per choice and turns
``TokenDelta`` values into ``OutputEvent`` values; when the request parses reasoning or
tool calls, each choice's released text then goes through a ``ChoiceParser``
(app.choice_parser), after stop handling.

This is the relay's hot path: ``Decoder.step`` does a few attribute reads per token
unless the new text could touch a stop string (it contains a stop string's first
character, or a possible stop prefix is pending), and only then searches a small window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from app.choice_parser import ChoiceParser, Parsed
from app.messages import (
    EngineFinish,
    FinishReason,
    LogprobEntry,
    OutputEvent,
    OutputKind,
    TokenDelta,
)
from app.reasoning import REASONING_PARSERS, prompt_opens_block
from app.records import RequestRecord, StopConditions
from app.token_texts import TokenTexts
from app.toolcalls import TOOL_PARSERS, new_call_id

__all__ = ["Decoder", "RequestDecoder", "TokenTexts"]

# The stream is prefilled with the prompt's last ids, not the whole prompt: it only needs
# a little left context (leading-space handling, a character split across the
# prompt/completion boundary), and decoding a 100k-token prompt per choice is wasted work.
PROMPT_CONTEXT = 32

_ENGINE_FINISH = {
    EngineFinish.EOS: FinishReason.STOP,
    EngineFinish.LENGTH: FinishReason.LENGTH,
    EngineFinish.CANCELLED: FinishReason.CANCELLED,
    EngineFinish.ERROR: FinishReason.ERROR,
}


class Decoder:
    """One choice's incremental detokenizer and stop-condition checker.

    Feed generated token ids with ``step``; when the engine ends the choice, call
    ``finish``. Once ``done``, further input is ignored (the caller should cancel the
    choice upstream). Each choice needs its own ``Decoder``: the stream is stateful.
    """

    __slots__ = (
        "_done",
        "_error",
        "_finish_reason",
        "_first",
        "_held",
        "_hide",
        "_max_prefix",
        "_max_tokens",
        "_min_tokens",
        "_n",
        "_stop_ids",
        "_stop_reason",
        "_stops",
        "_stream_step",
        "_tokenizer",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: StopConditions,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stream_step = stream.step
        self._min_tokens = stop.min_tokens
        self._max_tokens = stop.max_tokens or -1
        # id -> stop_reason: the model's EOS ids end silently, the user's ids are reported.
        stop_ids: dict[int, int | None] = {}
        if not stop.ignore_eos:
            stop_ids.update(dict.fromkeys(stop.eos_token_ids))
        stop_ids.update({i: i for i in stop.stop_token_ids})
        self._stop_ids = stop_ids
        self._stops = tuple(dict.fromkeys(s for s in stop.stop if s))
        self._first = frozenset(s[0] for s in self._stops)
        self._max_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._hide = not stop.include_stop_str_in_output
        # The longest suffix of the text so far that is a proper prefix of a stop string:
        # unreleased when stops are hidden, already released (kept as context) otherwise.
        self._held = ""
        self._n = 0
        self._done = False
        self._finish_reason: FinishReason | None = None
        self._stop_reason: int | str | None = None
        self._error: str | None = None

    @property
    def done(self) -> bool:
        return self._done

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self._stop_reason

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def completion_tokens(self) -> int:
        """Tokens accepted so far, the stopping token included; dropped ones excluded."""
        return self._n

    def step(self, token_ids: Sequence[int]) -> str:
        """Accept generated tokens; return the text that can no longer become a stop.

        Tokens after the one that ends the choice are dropped (``completion_tokens``
        tells how many were accepted, to cut their logprobs too). Once ``done``, input
        is ignored. Returns ``""`` when nothing is released.
        """
        # The hot path, once per token: a dict lookup, the stream's step, and a set
        # check of the new chunk against the stop strings' first characters. Returning
        # a str rather than a result object saves an allocation per call.
        if self._done:
            return ""
        text = ""
        n = self._n
        min_tokens = self._min_tokens
        for token_id in token_ids:
            # As backend.rs: "below" is decided before the token is counted, so tokens
            # 1..min_tokens bypass every stop (EOS, stop ids, stop strings) and their text
            # is released at once, never kept for matching; token min_tokens+1 is the
            # first that can end the choice.
            below = n < min_tokens
            n += 1
            if below:
                chunk = self._stream_step(self._tokenizer, token_id)
                if chunk:
                    text += chunk
            elif token_id in self._stop_ids:
                self._n = n
                return text + self._end(FinishReason.STOP, self._stop_ids[token_id])
            else:
                chunk = self._stream_step(self._tokenizer, token_id)
                if chunk:
                    if self._held or not self._first.isdisjoint(chunk):
                        text += self._scan(chunk)
                        if self._done:
                            self._n = n
                            return text
                    else:
                        text += chunk
            if n == self._max_tokens:
                self._n = n
                return text + self._end(FinishReason.LENGTH, None)
        self._n = n
        return text

    def finish(self, reason: EngineFinish, error: str | None = None) -> str:
        """The engine ended this choice: end it, and return the withheld text it releases.

        An error still releases the withheld text (it was generated and can no longer
        become a stop), then ends the choice with ``FinishReason.ERROR``.
        """
        if self._done:
            return ""
        fin = _ENGINE_FINISH[reason]
        if fin is FinishReason.ERROR:
            self._error = error or "the engine failed while generating this choice"
        return self._end(fin, None)

    def _end(self, reason: FinishReason, stop_reason: int | str | None) -> str:
        """End the choice; return the withheld text that is released by ending."""
        self._done = True
        self._finish_reason = reason
        self._stop_reason = stop_reason
        held, self._held = self._held, ""
        return held if self._hide else ""

    def _scan(self, chunk: str) -> str:
        """Slow path: the chunk may complete or start a stop string.

        Only text of tokens past ``min_tokens`` ever reaches here, so a stop string
        never matches text that was released below ``min_tokens`` (as backend.rs,
        whose jail only receives text once stops apply).
        """
        held = self._held
        window = held + chunk
        start = len(held)
        # A match ending inside ``held`` would have ended the choice already, so only
        # matches ending in ``chunk`` are looked for; the earliest end wins, then the
        # earliest start (the longer stop string).
        best_end = best_at = -1
        best = ""
        for s in self._stops:
            at = window.find(s, max(start - len(s) + 1, 0))
            if at >= 0:
                end = at + len(s)
                if best_end < 0 or end < best_end or (end == best_end and at < best_at):
                    best_end, best_at, best = end, at, s
        if best:
            self._held = ""
            self._done = True
            self._finish_reason = FinishReason.STOP
            self._stop_reason = best
            return window[:best_at] if self._hide else window[start:best_end]
        # The longest suffix that could still grow into a stop string.
        # (Checked with startswith rather than a set of all prefixes, which would take
        # memory quadratic in a stop string's length.)
        new_held = ""
        first = self._first
        for i in range(max(len(window) - self._max_prefix, 0), len(window)):
            if window[i] in first:
                tail = window[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                    new_held = tail
                    break
        self._held = new_held
        if self._hide:
            return window[: len(window) - len(new_held)]
        return chunk


class RequestDecoder:
    """The ``n`` choices of one request, each with its own ``Decoder``.

    ``feed`` turns a worker's ``TokenDelta`` into output events: a DELTA when there is
    text, reasoning, tool calls or logprobs to send, then a FINAL when that choice
    ended. Logprob entries ride on the DELTA of the delta that brought their tokens (a
    DELTA may carry logprobs and no text), and stop at the token that ended the choice.
    Once ``all_done``, the request can be cancelled upstream.

    ``reasoning_parser`` / ``tool_parser`` (the record's parser names; tool calls only
    when ``tools_enabled``) give each choice a ``ChoiceParser`` on the released text. A
    choice that made a tool call and ended by EOS or a stop ends with ``tool_calls``.
    Tool-call tags that are special tokens (Mistral's ``[TOOL_CALLS]``, Llama's
    ``<|python_tag|>``) only appear in text decoded with special tokens, so with such a
    parser the choices' text keeps them, as vLLM does for these parsers.
    """

    __slots__ = (
        "_cached_tokens",
        "_choices",
        "_continuous_usage",
        "_n",
        "_open",
        "_parsers",
        "_prompt_tokens",
        "_reasoning",
        "_texts",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: StopConditions,
        *,
        n: int = 1,
        skip_special_tokens: bool = True,
        logprobs: bool = False,
        more_prompts: Sequence[Sequence[int]] = (),
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        tools_enabled: bool = False,
        single_tool_call: bool = False,
        continuous_usage: bool = False,
        new_call_id: Callable[[], str] = new_call_id,
    ) -> None:
        """``more_prompts``: the completions endpoint's list of prompts after the first;
        choice ``c`` then runs on prompt ``c // n`` (OpenAI's index = prompt_index*n + i).
        ``new_call_id``: the tool call id factory (tests pass a deterministic one)."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        prompts = [prompt_ids, *more_prompts]
        tools = tool_parser if tools_enabled else None
        if tools is not None and tools not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {tools!r}")
        keep_special = tools is not None and TOOL_PARSERS[tools].special_tags
        self._choices = [
            Decoder(
                tokenizer,
                prompt,
                stop,
                skip_special_tokens=skip_special_tokens and not keep_special,
            )
            for prompt in prompts
            for _ in range(n)
        ]
        if reasoning_parser and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}")
        self._reasoning = bool(reasoning_parser)
        self._parsers = _choice_parsers(
            tokenizer, prompts, n, reasoning_parser, tools, new_call_id, single_tool_call
        )
        self._texts = (
            TokenTexts(tokenizer, skip_special_tokens=skip_special_tokens) if logprobs else None
        )
        self._open = len(self._choices)
        self._prompt_tokens = sum(len(p) for p in prompts)
        # vLLM's ``continuous_usage_stats``: every DELTA and FINAL carries the usage so far.
        self._continuous_usage = continuous_usage
        self._n = n
        # Per prompt index: the prompt tokens the engine took from its prefix cache.
        self._cached_tokens: dict[int, int] = {}

    @classmethod
    def for_record(cls, tokenizer: Tokenizer, record: RequestRecord) -> RequestDecoder:
        """The decoders of a stored request: its stop conditions, parsers and choices
        as the web tier wrote them (choice c runs on prompt c // n)."""
        return cls(
            tokenizer,
            record.prompts[0],
            record.stop,
            n=record.n,
            skip_special_tokens=record.skip_special_tokens,
            logprobs=record.sampling.logprobs is not None,
            more_prompts=record.prompts[1:],
            tool_parser=record.tool_parser,
            reasoning_parser=record.reasoning_parser,
            tools_enabled=record.tools_enabled,
            single_tool_call=record.single_tool_call,
            continuous_usage=record.continuous_usage,
        )

    @property
    def choices(self) -> Sequence[Decoder]:
        return self._choices

    @property
    def all_done(self) -> bool:
        return self._open == 0

    def plain_decoder(self) -> Decoder | None:
        """The one Decoder of a request whose deltas need nothing but their text: one
        choice, no logprobs, no parsers; None otherwise.

        Why: the streamer decodes every request at every engine step, and for most
        requests ``feed`` builds a ``TokenDelta`` and an ``OutputEvent`` only to carry a
        few characters. It steps this Decoder itself instead (``Decoder.step`` on the
        delta's token ids: the same text, the same stops) and calls ``ended`` when the
        step ends the choice, which gives the events ``feed`` would have given."""
        if (
            len(self._choices) != 1
            or self._parsers is not None
            or self._texts is not None
            or self._continuous_usage
        ):
            return None
        return self._choices[0]

    def ended(self, text: str) -> list[OutputEvent]:
        """The events of a plain request (``plain_decoder``) whose Decoder's ``step``
        just ended its choice, releasing ``text``: what ``feed`` returns for that step."""
        return self._events(0, self._choices[0], (text, "", None), None)

    @property
    def completion_tokens(self) -> int:
        return sum(d.completion_tokens for d in self._choices)

    @property
    def reasoning_tokens(self) -> int | None:
        """Tokens of the choices' think blocks; None without a reasoning parser."""
        if self._parsers is None or not self._reasoning:
            return None
        return sum(p.reasoning_tokens for p in self._parsers)

    @property
    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object for the tokens accepted so far."""
        completion = self.completion_tokens
        out: dict[str, Any] = {
            "prompt_tokens": self._prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self._prompt_tokens + completion,
        }
        if self._cached_tokens:
            out["prompt_tokens_details"] = {"cached_tokens": sum(self._cached_tokens.values())}
        reasoning = self.reasoning_tokens
        if reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return out

    def feed(self, delta: TokenDelta) -> list[OutputEvent]:
        """Apply one worker delta; ignored once its choice has ended."""
        events = self._feed(delta)
        if self._continuous_usage and events:
            self._with_usage(events)
        return events

    def _with_usage(self, events: list[OutputEvent]) -> None:
        """The usage so far on each DELTA and FINAL (``continuous_usage_stats``)."""
        usage = self.usage
        for ev in events:
            if ev.kind is OutputKind.DELTA or ev.kind is OutputKind.FINAL:
                ev.usage = usage

    def _feed(self, delta: TokenDelta) -> list[OutputEvent]:
        choice = delta.choice
        if not 0 <= choice < len(self._choices):
            raise ValueError(f"choice {choice} out of range for n={len(self._choices)}")
        if delta.cached_tokens is not None:
            # Every choice of a prompt reports the same count: one per prompt is counted.
            self._cached_tokens[choice // self._n] = delta.cached_tokens
        decoder = self._choices[choice]
        # Its fields, not its properties: this runs once per request per step.
        if decoder._done:
            return []
        logprobs = delta.logprobs
        before = decoder._n
        if logprobs is None or self._texts is None:
            text = decoder.step(delta.token_ids)
            entries = None
        else:
            if len(logprobs) != len(delta.token_ids):
                raise ValueError(f"{len(logprobs)} logprobs for {len(delta.token_ids)} token ids")
            text = decoder.step(delta.token_ids)
            entry = self._texts.entry
            entries = [entry(lp) for lp in logprobs[: decoder.completion_tokens - before]]
        if delta.finish is not None and not decoder.done:
            text += decoder.finish(delta.finish, delta.error)
        if self._parsers is not None:
            tokens = decoder.completion_tokens - before
            parsed = self._parse(self._parsers[choice], decoder, text, tokens)
            return self._events(choice, decoder, parsed, entries, delta.error_code)
        if entries is None and not decoder._done:
            # The common case: text only, no allocation beyond the event itself.
            return [OutputEvent(OutputKind.DELTA, choice, text)] if text else []
        return self._events(choice, decoder, (text, "", None), entries, delta.error_code)

    def finish_all(
        self, reason: EngineFinish, error: str | None = None, code: int | None = None
    ) -> list[OutputEvent]:
        """End every open choice (a cancel, a lost worker), releasing withheld text.

        ``code`` is the HTTP status an ERROR maps to (e.g. 504 for a deadline)."""
        events: list[OutputEvent] = []
        for i, decoder in enumerate(self._choices):
            if not decoder.done:
                text = decoder.finish(reason, error)
                parsed: Parsed = (
                    (text, "", None)
                    if self._parsers is None
                    else self._parse(self._parsers[i], decoder, text, 0)
                )
                events += self._events(i, decoder, parsed, None, code)
        if self._continuous_usage and events:
            self._with_usage(events)
        return events

    @staticmethod
    def _parse(parser: ChoiceParser, decoder: Decoder, text: str, tokens: int) -> Parsed:
        """The choice's parser on released text; everything held is flushed at its end."""
        content, reasoning, calls = parser.feed(text, tokens)
        if decoder.done:
            more_content, more_reasoning, more_calls = parser.flush()
            content += more_content
            reasoning += more_reasoning
            if more_calls:
                calls = [*(calls or []), *more_calls]
        return content, reasoning, calls

    def _events(
        self,
        choice: int,
        decoder: Decoder,
        parsed: Parsed,
        entries: list[LogprobEntry] | None,
        code: int | None = None,
    ) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        text, reasoning, calls = parsed
        if text or reasoning or calls or entries:
            events.append(
                OutputEvent(
                    OutputKind.DELTA,
                    choice,
                    text,
                    logprobs=entries,
                    reasoning=reasoning,
                    tool_calls=calls,
                )
            )
        if decoder.done:
            self._open -= 1
            finish = decoder.finish_reason
            if (
                finish is FinishReason.STOP
                and self._parsers is not None
                and self._parsers[choice].calls
            ):
                finish = FinishReason.TOOL_CALLS
            events.append(
                OutputEvent(
                    OutputKind.FINAL,
                    choice,
                    finish_reason=finish,
                    stop_reason=decoder.stop_reason,
                    error=decoder.error,
                    code=code if finish is FinishReason.ERROR else None,
                )
            )
        return events


def _choice_parsers(
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    n: int,
    reasoning_parser: str | None,
    tools: str | None,
    new_id: Callable[[], str],
    single_tool_call: bool = False,
) -> list[ChoiceParser] | None:
    """One ``ChoiceParser`` per choice when the request parses reasoning or tool calls
    (None: its text is passed on as it is)."""
    if tools is None and not reasoning_parser:
        return None
    # A template may open the think block in the prompt (the output starts in it).
    opens = [
        prompt_opens_block(
            tokenizer.decode(list(p[-PROMPT_CONTEXT:]), skip_special_tokens=False),
            reasoning_parser,
        )
        if reasoning_parser
        else False
        for p in prompts
    ]
    return [
        ChoiceParser(
            reasoning_parser=reasoning_parser,
            start_in_reasoning=opens[c // n],
            tool_parser=tools,
            new_id=new_id,
            max_tool_calls=1 if single_tool_call else None,
        )
        for c in range(len(prompts) * n)
    ]
