"""``skip_special_tokens`` from the request body to the text and logprobs a client gets.

The body's field goes into the ``RequestRecord`` (``RecordBuilder``), and the streamer
builds its decoders from the record (``RequestDecoder.for_record``): with the default (true) the
model's EOS, let through by ``min_tokens``, is no text and has empty logprob text; with
false it is ``<|im_end|>`` in both.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from app.chat_template import PromptBuilder
from app.decoder import RequestDecoder
from app.intake import RecordBuilder
from app.messages import OutputKind, TokenDelta, TokenLogprob
from app.model_card import load_model_card
from app.protocol import parse_chat_request, parse_completion_request

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def builder(bundled_model_dir: Path) -> RecordBuilder:
    card = load_model_card(bundled_model_dir)
    return RecordBuilder(
        card,
        PromptBuilder.from_card(card),
        model_name="m",
        request_timeout_s=60,
        clock=time.time,
    )


@pytest.mark.parametrize(
    ("fields", "eos_text"), [({}, ""), ({"skip_special_tokens": False}, "<|im_end|>")]
)
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_the_request_field_reaches_text_and_logprobs(
    builder: RecordBuilder, fields: dict[str, Any], eos_text: str, endpoint: str
) -> None:
    common = {"min_tokens": 3, "max_tokens": 5, "logprobs": True, **fields}
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "Hi"}], **common}
        record = builder.chat(parse_chat_request(body))
    else:
        record = builder.completion(
            parse_completion_request({"prompt": "Hi", **common, "logprobs": 1})
        )
    assert record.skip_special_tokens is (eos_text == "")
    tok = builder.tokenizer
    hello = tok.encode("Hello", add_special_tokens=False).ids[0]
    ids = [hello, EOS, hello]  # the EOS is token 2 < min_tokens: text, not a stop
    decoders = RequestDecoder.for_record(tok, record)
    events = decoders.feed(
        TokenDelta(0, ids, logprobs=[TokenLogprob(i, -0.5, [(EOS, -1.0)]) for i in ids])
    )
    (delta,) = [e for e in events if e.kind is OutputKind.DELTA]
    assert delta.text == f"Hello{eos_text}Hello"
    assert [e.text for e in delta.logprobs or []] == ["Hello", eos_text, "Hello"]
    assert {e.top[0][0] for e in delta.logprobs or []} == {eos_text}
