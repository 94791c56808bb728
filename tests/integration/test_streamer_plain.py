"""The streamer's plain decode (``Streamer._decode_plain``: a request with one choice, no
logprobs and no parsers, one step line a cycle) against its general decode
(``_decode_entries``), which it must match exactly: the same output chunks (payload,
ordinal, checkpoint and prior chunks, source, publish time), the same ends and faults.

Each case runs two requests with the same record through one real ``Streamer`` (a
clock that stands still, so usage timings agree), step by step, the way a worker's step
entries reach it: one takes the plain path, the other has its plain decoder taken away.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from tokenizers import Tokenizer

from app.decoder import RequestDecoder
from app.messages import EngineFinish, TokenDelta
from app.model_card import load_model_card, load_tokenizer
from app.settings import Settings
from broker.celery_app import create_celery
from broker.chunks import CHECKPOINT_STEPS
from broker.outputs import OutputEntry, decode_events, encode_events, encode_text
from broker.publish import encode_deltas
from tests.pipeline import EOS, TEXT
from tests.stack import make_record
from workers.streamer import Streamer
from workers.streamer_state import Tracked

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path) -> Tokenizer:
    return load_tokenizer(load_model_card(models_dir / "SmolLM2-135M-Instruct"))


def ids_of(tokenizer: Tokenizer, text: str = TEXT) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def one_by_one(ids: list[int]) -> list[bytes]:
    return [encode_deltas([TokenDelta(0, [i])]) for i in ids]


def seen(out: OutputEntry | None) -> tuple[Any, ...] | None:
    if out is None:
        return None
    return (out.encoded(), out.n, out.checkpoint, out.prior, out.source, out.published, out.first)


def run_both(
    settings: Settings,
    redis_client: redis.Redis,
    tokenizer: Tokenizer,
    payloads: list[bytes],
    **record: Any,
) -> list[tuple[Any, ...]]:
    """Each payload as the next step line of both requests; per step, what each path
    made of it: (output, ended, failed). Asserts they agree; returns the plain one's."""
    streamer = Streamer(
        settings, redis_client, tokenizer, create_celery(settings), clock=lambda: 1000.0
    )
    step_key = streamer.keys.steps("w1")
    pair = []
    first = make_record(settings, [[1, 2, 3]], **record)
    for plain in (True, False):
        rec = first if plain else first.model_copy(update={"request_id": uuid.uuid4().hex})
        t = Tracked("1-0", rec, RequestDecoder.for_record(tokenizer, rec))
        assert t.plain is not None, "a plain record"
        if not plain:
            t.plain = None  # the general path for this one
        t.step = step_key
        streamer.tracked[rec.request_id] = t
        pair.append(t)
    by_key = {streamer.keys.tokens(rid).encode(): t for rid, t in streamer.tracked.items()}
    plain_path = 0
    real_plain = streamer._decode_plain

    def counting(*args: Any) -> OutputEntry | None:
        nonlocal plain_path
        plain_path += 1
        return real_plain(*args)

    streamer._decode_plain = counting  # type: ignore[method-assign]
    steps = []
    for n, payload in enumerate(payloads, start=1):
        lines = []
        for t in pair:
            lines += [streamer.keys.tokens(t.record.request_id).encode(), b"0", b"%d" % n, payload]
        stamp = b"%d.5" % n
        got: dict[str, list[Any]] = {}
        streamer._take_steps(
            step_key, [(b"%d-0" % n, {b"t": stamp, b"d": b"\n".join(lines)})], by_key, got, {}
        )
        c = streamer._decode_all(got)
        outs = {e.request_id: e for e in c.outputs}
        made = [(seen(outs.get(t.record.request_id)), t in c.ended, t in c.failed) for t in pair]
        assert made[0] == made[1], f"step {n}: the plain path made {made[0]}, the general {made[1]}"
        steps.append(made[0])
        if made[0][0] is not None:
            streamer._writes += 1
        for t in (*c.ended, *c.failed):
            streamer.tracked.pop(t.record.request_id)
    assert plain_path > 0, "the plain path was taken"
    return steps


def texts(steps: list[tuple[Any, ...]]) -> tuple[str, list[Any]]:
    """The text of every output chunk, and its other events (finals, usage, errors)."""
    text, other = "", []
    for out, _ended, _failed in steps:
        if out is None:
            continue
        for ev in decode_events(out[0]):
            if ev.kind.value == "delta":
                text += ev.text
            else:
                other.append((ev.kind.value, ev.finish_reason, ev.stop_reason, ev.code))
    return text, other


def test_text_then_eos(settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer) -> None:
    ids = ids_of(tokenizer) * 3  # long enough for periodic checkpoints
    assert len(ids) > 2 * CHECKPOINT_STEPS
    payloads = one_by_one(ids)
    payloads.append(encode_deltas([TokenDelta(0, [EOS], finish=EngineFinish.EOS)]))
    steps = run_both(settings, redis_client, tokenizer, payloads, max_tokens=1000)
    text, other = texts(steps)
    assert text == TEXT * 3
    assert [o[0] for o in other] == ["final", "usage"]
    assert steps[-1][1], "ended"
    assert sum(1 for out, *_ in steps if out is not None and out[2]) >= 3, "checkpoints"


def test_eos_without_a_finish_and_token_ids_together(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer
) -> None:
    ids = ids_of(tokenizer)
    chunks = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    payloads = [encode_deltas([TokenDelta(0, c)]) for c in chunks]
    payloads.insert(2, encode_deltas([TokenDelta(0, [])]))  # a step with no token
    payloads.append(encode_deltas([TokenDelta(0, [EOS, 5, 6])]))  # EOS decoded, not told
    payloads.append(encode_deltas([TokenDelta(0, [7])]))  # after the end: ignored
    steps = run_both(settings, redis_client, tokenizer, payloads, max_tokens=1000)
    text, other = texts(steps)
    assert text == TEXT
    assert [o[:2] for o in other][:1] == [("final", "stop")]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_held_across_steps(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer, include: bool
) -> None:
    payloads = one_by_one(ids_of(tokenizer))
    steps = run_both(
        settings,
        redis_client,
        tokenizer,
        payloads,
        max_tokens=1000,
        stop=("lazy dog;", "brown q"),
        include_stop_str_in_output=include,
    )
    text, other = texts(steps)
    assert text == TEXT[: TEXT.index("lazy dog;") + (len("lazy dog;") if include else 0)]
    assert other[0][:3] == ("final", "stop", "lazy dog;")


def test_max_tokens_and_min_tokens(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer
) -> None:
    ids = ids_of(tokenizer)
    stop_id = ids[2]
    steps = run_both(
        settings,
        redis_client,
        tokenizer,
        one_by_one(ids),
        max_tokens=9,
        min_tokens=4,
        stop_token_ids=(stop_id,),
    )
    _text, other = texts(steps)
    assert other[0][:2] == ("final", "length")  # the stop id came below min_tokens


@pytest.mark.parametrize(
    ("bad", "ends"),
    [
        (b"not json", "failed"),
        (b'[{"c":0,"t":["x"]}]', "ended"),  # not a token id: that choice ends in error
        (b'[{"c":1,"t":[5]}]', "failed"),  # no such choice
        (b'{"c":0,"t":[5]}', "failed"),
        (b'[{"c":0,"t":5}]', "failed"),
        (b"[]", "neither"),
    ],
)
def test_faults_match(
    settings: Settings, redis_client: redis.Redis, tokenizer: Tokenizer, bad: bytes, ends: str
) -> None:
    ids = ids_of(tokenizer)
    payloads = [*one_by_one(ids[:3]), bad, *one_by_one(ids[3:6])]
    steps = run_both(settings, redis_client, tokenizer, payloads, max_tokens=1000)
    _out, ended, failed = steps[3]
    assert (ended, failed) == (ends == "ended", ends == "failed")
    if ends == "neither":
        assert texts(steps)[0] == "The quick brown fox"  # the emoji's bytes are not whole yet


def test_encode_text_is_encode_events_of_a_text_delta() -> None:
    from app.messages import OutputEvent, OutputKind

    for text in ("a", " fox", '"quoted"\n\\', "東京 🦊", "\u2028\x00\x1f", "</script>"):
        assert encode_text(text) == encode_events([OutputEvent(OutputKind.DELTA, 0, text)])
