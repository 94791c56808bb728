"""The usage ledger's pure half (app/usage.py): what a finished request counts, the
fields' codec, the admin query's periods and limits, and folding hashes into rows."""

from __future__ import annotations

import calendar
import time

import pytest

from app.errors import InvalidRequest
from app.intake import Endpoint, Intake
from app.model_card import ModelCard
from app.records import RequestRecord, StopConditions
from app.settings import Settings
from app.usage import (
    SEP,
    UsageCount,
    UsageQuery,
    api_of,
    day_of,
    fold_rows,
    fold_totals,
    hour_of,
    parse_field,
    totals_of,
)

NOW = calendar.timegm((2026, 3, 10, 14, 30, 0))  # 2026-03-10T14:30:00Z


def record(**kw: object) -> RequestRecord:
    values: dict[str, object] = {
        "request_id": "r1",
        "model": "m",
        "prompts": [[1, 2, 3]],
        "stop": StopConditions(max_tokens=8),
        "created": 0.0,
        "deadline": 60.0,
        "owner": "o" * 64,
    }
    values.update(kw)
    return RequestRecord(**values)  # type: ignore[arg-type]


def test_api_is_the_endpoint_called_and_batch_lines_are_batch() -> None:
    assert api_of(record()) == "/v1/chat/completions"
    assert api_of(record(endpoint="/v1/messages")) == "/v1/messages"
    assert api_of(record(api="/v1/responses")) == "/v1/responses"
    assert api_of(record(queue="batch", endpoint="/v1/completions")) == "batch"


def test_a_count_reads_the_usage_the_client_reads() -> None:
    usage = {
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 8},
        "timings": {"e2e_s": 1.0},
    }
    c = UsageCount.of(record(), usage, error=False, at=NOW)
    assert (c.prompt_tokens, c.cached_tokens, c.completion_tokens, c.error) == (12, 8, 5, False)
    assert c.increments == (12, 8, 5, 0)
    assert c.label == f"{'o' * 64}{SEP}m{SEP}/v1/chat/completions{SEP}"
    bare = UsageCount.of(record(owner=""), {"prompt_tokens": 3}, error=True, at=NOW)
    assert bare.increments == (3, 0, 0, 1) and bare.label.startswith(SEP)


def test_fields_parse_back_even_with_odd_model_names() -> None:
    c = UsageCount.of(record(model=f"we{SEP}ird:model/x"), {}, error=False, at=NOW)
    assert parse_field(c.label + "p") == ("o" * 64, f"we{SEP}ird:model/x", c.api, "prompt_tokens")
    assert parse_field(c.label + "n")[3] == "requests"  # type: ignore[index]
    assert parse_field("junk") is None
    assert parse_field(c.label + "zz") is None


def test_periods_are_utc() -> None:
    assert day_of(NOW) == "2026-03-10"
    assert hour_of(NOW) == "2026-03-10T14"
    assert day_of(calendar.timegm((2026, 12, 31, 23, 59, 59))) == "2026-12-31"


def test_query_defaults_and_ranges() -> None:
    q = UsageQuery.parse({}, NOW)
    assert q.granularity == "day" and len(q.periods) == 30
    assert q.periods[-1] == "2026-03-10" and q.periods[0] == "2026-02-09"
    h = UsageQuery.parse({"granularity": "hour"}, NOW)
    assert len(h.periods) == 24 and h.periods[-1] == "2026-03-10T14"
    q = UsageQuery.parse({"from": "2026-02-27", "to": "2026-03-01"}, NOW)
    assert q.periods == ["2026-02-27", "2026-02-28", "2026-03-01"]
    # Days given to an hourly query: the whole days, hour 00 to hour 23.
    h = UsageQuery.parse({"granularity": "hour", "from": "2026-03-01", "to": "2026-03-01"}, NOW)
    assert h.periods[0] == "2026-03-01T00" and h.periods[-1] == "2026-03-01T23"
    h = UsageQuery.parse(
        {"granularity": "hour", "from": "2026-03-01T22", "to": "2026-03-02T01"}, NOW
    )
    assert h.periods == ["2026-03-01T22", "2026-03-01T23", "2026-03-02T00", "2026-03-02T01"]
    assert len(UsageQuery.parse({"from": "2025-02-04", "to": "2026-03-10"}, NOW).periods) == 400


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"from": "yesterday"}, "from"),
        ({"to": "2026-13-01"}, "to"),
        ({"to": "0001-01-01"}, "to"),
        ({"from": "9999-12-31"}, "from"),
        ({"from": "2026-03-10T05"}, "from"),  # an hour with granularity=day
        ({"granularity": "minute"}, "granularity"),
        ({"from": "2026-03-10", "to": "2026-03-01"}, "from"),
        ({"from": "2025-01-01", "to": "2026-03-10"}, "from"),  # 434 days
        ({"granularity": "hour", "from": "2026-01-01", "to": "2026-03-10"}, "from"),
    ],
)
def test_bad_queries_say_which_parameter(args: dict[str, str], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        UsageQuery.parse(args, NOW)
    assert info.value.param == param and info.value.status == 400


def test_rows_fold_filter_and_total() -> None:
    a = UsageCount.of(record(owner="a" * 64), {}, error=False, at=NOW).label
    b = UsageCount.of(record(owner="key_0123456789ab", model="n"), {}, error=False, at=NOW).label
    buckets = [
        ("2026-03-09", {(a + "n").encode(): b"2", (a + "p").encode(): b"30", b"junk": b"1"}),
        ("2026-03-10", {a + "n": "1", a + "c": "7", b + "n": "4", b + "e": "1"}),
    ]
    everything = UsageQuery("day", ["2026-03-09", "2026-03-10"])
    rows = fold_rows(buckets, everything)
    assert [(r.period, r.owner[:3]) for r in rows] == [
        ("2026-03-09", "aaa"),
        ("2026-03-10", "aaa"),
        ("2026-03-10", "key"),
    ]
    assert rows[0].to_dict() == {
        "key": "a" * 16,
        "model": "m",
        "api": "/v1/chat/completions",
        "period": "2026-03-09",
        "requests": 2,
        "prompt_tokens": 30,
        "cached_tokens": 0,
        "completion_tokens": 0,
        "errors": 0,
    }
    assert totals_of(rows) == {
        "requests": 7,
        "prompt_tokens": 30,
        "cached_tokens": 0,
        "completion_tokens": 7,
        "errors": 1,
    }
    by_prefix = UsageQuery("day", [], key="a" * 16)
    assert {r.owner for r in fold_rows(buckets, by_prefix)} == {"a" * 64}
    by_id = UsageQuery("day", [], key="key_0123456789ab", model="n")
    assert [r.counts["requests"] for r in fold_rows(buckets, by_id)] == [4]
    assert fold_rows(buckets, UsageQuery("day", [], api="batch")) == []
    totals = fold_totals(dict(buckets[1][1]))
    assert totals[("a" * 64, "m", "/v1/chat/completions")]["completion_tokens"] == 7


def test_the_default_range_ends_now() -> None:
    now = time.time()
    assert UsageQuery.parse({"granularity": "hour"}, now).periods[-1] == hour_of(now)


def test_each_endpoint_is_counted_under_the_api_its_client_called(card: ModelCard) -> None:
    intake = Intake.for_model(Settings(model=str(card.path)), card)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    apis = {
        Endpoint.CHAT: chat,
        Endpoint.COMPLETIONS: {"prompt": "Hi", "max_tokens": 4},
        Endpoint.MESSAGES: chat,
        Endpoint.RESPONSES: {"input": "Hi", "max_output_tokens": 16},
    }
    for endpoint, body in apis.items():
        assert api_of(intake.prepare(endpoint, body).record) == endpoint.value
        line = intake.prepare(endpoint, body, queue="batch").record
        assert api_of(line) == "batch"
