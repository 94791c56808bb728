"""docs/operations.md's metrics table is generated from the metrics (``web.metrics_docs``)
and kept in step by ``tokenrelay metrics docs``; a live scrape is compared with the same
rows in tests/web/test_model_gauges.py and tests/e2e/test_http_api.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Gauge

from web.cluster_metrics import CLUSTER_FAMILIES, ClusterCollector
from web.metrics import _ITL_BUCKETS, WebMetrics
from web.metrics_docs import (
    END,
    START,
    MetricDoc,
    generated_part,
    main,
    metric_docs,
    metrics_markdown,
)

REPO = Path(__file__).resolve().parent.parent


def test_operations_md_holds_the_generated_table() -> None:
    document = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    assert generated_part(document) == metrics_markdown(), (
        "docs/operations.md's metrics table differs from the metrics: run "
        "`tokenrelay metrics docs --write`"
    )


def test_rows_come_from_the_metric_objects_and_the_declarations() -> None:
    rows = {d.name: d for d in metric_docs()}
    itl = rows["tokenrelay_inter_token_latency_seconds"]
    assert (itl.type, itl.labels, itl.buckets) == (
        "histogram",
        ("model", "endpoint", "mode"),
        _ITL_BUCKETS,
    )
    assert itl.meaning == WebMetrics().itl._documentation
    assert rows["tokenrelay_requests_total"].labels == ("endpoint", "status", "error_type")
    # Counters are listed as queries spell them; the declared ones too.
    assert rows["tokenrelay_worker_tokens_total"].type == "counter"
    assert rows["tokenrelay_worker_engine_capacity"].labels == (
        "worker",
        "model",
        "engine",
        "mode",
    )
    assert rows["vllm:num_requests_waiting"].labels == ("model_name",)
    assert len(rows) == len(metric_docs())  # no name twice
    assert [d.name for d in metric_docs()] == sorted(rows)


def test_a_declared_family_cannot_share_a_static_metric_s_name() -> None:
    """``ClusterCollector.describe`` returns the declarations, so the registry refuses a
    static metric named like one of them."""
    WebMetrics(ClusterCollector(SimpleNamespace()))  # type: ignore[arg-type]  # none now
    registry = CollectorRegistry()
    registry.register(ClusterCollector(SimpleNamespace()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Duplicated"):
        Gauge(CLUSTER_FAMILIES[0].name, "again", registry=registry)


def test_a_label_without_a_meaning_fails_the_generation() -> None:
    row = MetricDoc("tokenrelay_x", "gauge", ("colour",), "A new gauge.")
    with pytest.raises(ValueError, match="colour"):
        metrics_markdown([row])


def test_histograms_name_their_series_and_bounds() -> None:
    row = MetricDoc("tokenrelay_x_seconds", "histogram", ("model",), "A | B.", (0.5, 1.0))
    line = metrics_markdown([row]).splitlines()[2]
    assert line == (
        "| `tokenrelay_x_seconds` | histogram | `model` | A \\| B. "
        "Series `_bucket` (`le`: 0.5, 1, `+Inf`), `_sum`, `_count`. |"
    )


def test_docs_prints_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs"]) == 0
    assert capsys.readouterr().out == metrics_markdown()

    target = tmp_path / "operations.md"
    assert main(["docs", "--check", "--path", str(target)]) == 1
    assert "cannot read" in capsys.readouterr().err

    target.write_text(f"# Ops\n\nbefore\n\n{START}\nstale\n{END}\n\nafter\n", encoding="utf-8")
    assert main(["docs", "--check", "--path", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenrelay: error: ") and err.count("\n") == 1
    assert "out of date: run `tokenrelay metrics docs --write`" in err

    assert main(["docs", "--write", "--path", str(target)]) == 0
    written = target.read_text(encoding="utf-8")
    assert written.startswith("# Ops\n\nbefore\n\n") and written.endswith(f"{END}\n\nafter\n")
    assert generated_part(written) == metrics_markdown()
    assert main(["docs", "--check", "--path", str(target)]) == 0
    assert main(["docs", "--write", "--path", str(target)]) == 0  # idempotent
    assert target.read_text(encoding="utf-8") == written


def test_a_file_without_the_markers_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "operations.md"
    target.write_text("# Ops\n", encoding="utf-8")
    for mode in ("--check", "--write"):
        assert main(["docs", mode, "--path", str(target)]) == 1
        err = capsys.readouterr().err
        assert "no metrics table markers" in err and err.count("\n") == 1
    assert target.read_text(encoding="utf-8") == "# Ops\n"
