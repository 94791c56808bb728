"""The stop-handling cases of #2 as chat requests, and the text each must produce.

Shared by every client-facing path (SSE, non-streaming, WebSocket): each test sends
``chat_body(case, model, tokenizer)`` through its path against a stack running the echo
engine, and compares what it received with ``expected(case, model_dir)``, which runs
the same request through the echo engine and the streamer's decoders in-process, with
no Redis and no server. Equal results mean the path adds, drops and reorders nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from app.chat_template import PromptBuilder
from app.decoder import RequestDecoder
from app.intake import RecordBuilder
from app.messages import OutputEvent, OutputKind
from app.model_card import load_model_card
from app.protocol import parse_chat_request
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.echo import EchoEngine

# The echo engine repeats the last user message: multi-byte characters, spaces,
# punctuation, and words that recur, so stops can match early, late or across tokens.
TEXT = "The quick brown fox 🦊 jumps over the lazy dog; 東京 is far. END of story, friend."

# Case name -> request fields. "stop_token_ids": "<token 5>" is replaced by the id of
# TEXT's sixth token (tokenizer-dependent).
CASES: dict[str, dict[str, Any]] = {
    "stop_string_hidden": {"stop": ["lazy"]},
    "stop_string_visible": {"stop": ["lazy"], "include_stop_str_in_output": True},
    "stop_in_multibyte": {"stop": ["東"]},
    "two_stops_earliest_wins": {"stop": ["dog;", "over the"]},
    "stop_token_id": {"stop_token_ids": "<token 5>"},
    "min_tokens_skips_early_stop": {"stop": ["quick"], "min_tokens": 6},
    "max_tokens": {"max_tokens": 7},
    "n3": {"n": 3, "stop": ["jumps"]},
}


@dataclass(frozen=True)
class Expected:
    """Per choice: the text, finish_reason and stop_reason a client must receive."""

    texts: dict[int, str]
    finish_reasons: dict[int, str]
    stop_reasons: dict[int, int | str | None]
    completion_tokens: int


def chat_body(case: str, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """The chat-completions body of ``case`` (temperature 0, the echo engine's TEXT)."""
    fields = dict(CASES[case])
    if fields.get("stop_token_ids") == "<token 5>":
        fields["stop_token_ids"] = [tokenizer.encode(TEXT, add_special_tokens=False).ids[5]]
    return {
        "model": model,
        "messages": [{"role": "user", "content": TEXT}],
        "temperature": 0,
        **fields,
    }


def expected(case: str, model_dir: Path, model: str) -> Expected:
    """What ``case`` must produce, computed by the engine and decoders alone."""
    card = load_model_card(model_dir)
    prompts = PromptBuilder.from_card(card)
    builder = RecordBuilder(card, prompts, model_name=model, request_timeout_s=60, clock=time.time)
    record = builder.chat(parse_chat_request(chat_body(case, model, prompts.tokenizer)))
    engine = EchoEngine(context_length=card.context_length)
    for p, prompt in enumerate(record.prompts):
        engine.submit(
            EngineJob(
                job_id=str(p),
                prompt_ids=prompt,
                echo_ids=record.echo_ids[p] if record.echo_ids else None,
                choices=[ChoiceJob(p * record.n + i, record.max_tokens) for i in range(record.n)],
                eos_token_ids=frozenset(
                    () if record.stop.ignore_eos else record.stop.eos_token_ids
                ),
                stop_token_ids=frozenset(record.stop.stop_token_ids),
                min_tokens=record.stop.min_tokens,
            )
        )
    decoders = RequestDecoder.for_record(prompts.tokenizer, record)
    events: list[OutputEvent] = []
    while engine.has_work():
        for step in engine.step():
            events += decoders.feed(step.delta)
    texts: dict[int, str] = {c: "" for c in range(record.num_choices)}
    finish: dict[int, str] = {}
    stop: dict[int, int | str | None] = {}
    for ev in events:
        assert ev.choice is not None
        if ev.kind is OutputKind.DELTA:
            texts[ev.choice] += ev.text
        elif ev.kind is OutputKind.FINAL:
            assert ev.finish_reason is not None
            finish[ev.choice] = ev.finish_reason.value
            stop[ev.choice] = ev.stop_reason
    return Expected(texts, finish, stop, int(decoders.usage["completion_tokens"]))
