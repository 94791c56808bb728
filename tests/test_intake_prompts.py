"""/v1/completions prompt lists become the record's prompts in order: the texts are
tokenized in one call (``PromptBuilder.encode_many``), id lists pass through."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.chat_template import PromptBuilder
from app.intake import RecordBuilder
from app.model_card import load_model_card
from app.protocol import parse_completion_request


@pytest.fixture(scope="module")
def builder(bundled_model_dir: Path) -> RecordBuilder:
    card = load_model_card(bundled_model_dir)
    return RecordBuilder(
        card, PromptBuilder.from_card(card), model_name="m", request_timeout_s=60, clock=time.time
    )


def own(builder: RecordBuilder, text: str) -> list[int]:
    return builder.tokenizer.encode(text, add_special_tokens=False).ids


def test_a_list_of_texts_keeps_its_order(builder: RecordBuilder) -> None:
    texts = ["Hello there", "Bye", "héllo 🙂", "one more, a longer one than the rest"]
    record = builder.completion(parse_completion_request({"prompt": texts, "max_tokens": 2}))
    assert record.prompts == [own(builder, t) for t in texts]


def test_id_lists_pass_through(builder: RecordBuilder) -> None:
    body = {"prompt": [[1, 2, 3], [7, 8]], "max_tokens": 2}
    assert builder.completion(parse_completion_request(body)).prompts == [[1, 2, 3], [7, 8]]
    one = builder.completion(parse_completion_request({"prompt": "Hi", "max_tokens": 2}))
    assert one.prompts == [own(builder, "Hi")]
