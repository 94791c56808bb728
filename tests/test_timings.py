"""``timings`` as llama.cpp's server sends them, from the streamer's usage event."""

from __future__ import annotations

import json

import pytest

from app.response_models import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    Timings,
    Usage,
)
from app.timings import timings_from_usage

# What workers/streamer.py's usage event carries (seconds, rounded to 0.1 ms).
RAW = {
    "prompt_tokens": 40,
    "completion_tokens": 25,
    "total_tokens": 65,
    "prompt_tokens_details": {"cached_tokens": 8},
    "timings": {"queue_s": 0.05, "ttft_s": 0.25, "decode_s": 0.5, "e2e_s": 0.75},
    "streamer": "s-1",
}


def test_llama_cpp_fields_from_the_streamers_seconds() -> None:
    t = timings_from_usage(RAW)
    assert t is not None
    assert t.to_dict() == {
        "prompt_n": 32,  # the prompt tokens processed: 40 less 8 from the prefix cache
        "prompt_ms": 200.0,  # ttft less queue
        "prompt_per_token_ms": 6.25,
        "prompt_per_second": 160.0,
        "predicted_n": 25,
        "predicted_ms": 500.0,
        "predicted_per_token_ms": 20.0,
        "predicted_per_second": 50.0,
        "cache_n": 8,
        "queue_ms": 50.0,
        "ttft_ms": 250.0,
    }


def test_predicted_n_is_the_usages_completion_tokens() -> None:
    for completion in (0, 1, 17):
        t = timings_from_usage({**RAW, "completion_tokens": completion})
        assert t is not None and t.predicted_n == completion


def test_unmeasured_times_are_null_not_guessed() -> None:
    # No token came (ttft and decode unknown) and the worker's claim was never seen.
    raw = {
        **RAW,
        "completion_tokens": 0,
        "timings": {"queue_s": None, "ttft_s": None, "decode_s": None, "e2e_s": 1.0},
    }
    t = timings_from_usage(raw)
    assert t is not None
    assert (t.prompt_ms, t.prompt_per_second, t.predicted_ms, t.predicted_per_second) == (
        None,
        None,
        None,
        None,
    )
    assert (t.queue_ms, t.ttft_ms, t.predicted_n) == (None, None, 0)
    # A queue time but no first token: still no prompt time.
    raw["timings"] = {"queue_s": 0.1, "ttft_s": None, "decode_s": None, "e2e_s": 1.0}
    t = timings_from_usage(raw)
    assert t is not None and (t.queue_ms, t.prompt_ms) == (100.0, None)


def test_clock_skew_never_gives_negative_times() -> None:
    # Worker and streamer clocks differ: the claim can look later than the first token.
    raw = {**RAW, "timings": {"queue_s": 0.3, "ttft_s": 0.25, "decode_s": -0.001}}
    t = timings_from_usage(raw)
    assert t is not None
    assert (t.prompt_ms, t.prompt_per_second, t.predicted_ms, t.predicted_per_second) == (
        0.0,
        None,
        0.0,
        None,
    )


@pytest.mark.parametrize("raw", [None, {}, {"prompt_tokens": 1}, {"timings": "soon"}])
def test_no_timings_without_the_streamers_measurements(raw: dict[str, object] | None) -> None:
    assert timings_from_usage(raw) is None


def test_responses_carry_timings_only_when_set() -> None:
    timings = timings_from_usage(RAW)
    assert timings is not None
    usage = Usage(prompt_tokens=40, completion_tokens=25, total_tokens=65)
    chat = ChatCompletionResponse(model="m", choices=[], usage=usage)
    assert "timings" not in chat.to_dict()
    chat = ChatCompletionResponse(model="m", choices=[], usage=usage, timings=timings)
    assert chat.to_dict()["timings"]["predicted_n"] == chat.to_dict()["usage"]["completion_tokens"]
    text = CompletionResponse(model="m", choices=[], usage=usage, timings=timings)
    assert json.loads(text.to_json())["timings"] == timings.to_dict()
    head = {"id": "x", "created": 1, "model": "m"}
    assert "timings" not in ChatCompletionChunk(**head).to_dict()
    assert "timings" not in CompletionChunk(**head).to_dict()
    last = ChatCompletionChunk(**head, usage=usage, timings=timings)
    assert last.to_dict()["timings"] == timings.to_dict()
    assert CompletionChunk(**head, usage=usage, timings=timings).to_dict()["timings"] == (
        timings.to_dict()
    )


def test_openai_sdk_accepts_a_response_with_timings() -> None:
    pytest.importorskip("openai")
    from openai.types.chat import ChatCompletion
    from openai.types.chat import ChatCompletionChunk as SdkChunk

    timings = Timings(predicted_n=1)
    usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    body = ChatCompletionResponse(model="m", choices=[], usage=usage, timings=timings)
    parsed = ChatCompletion.model_validate(body.to_dict())
    assert parsed.usage is not None and parsed.usage.completion_tokens == 1
    chunk = ChatCompletionChunk(id="x", created=1, model="m", usage=usage, timings=timings)
    assert SdkChunk.model_validate(chunk.to_dict()).usage is not None
