"""``tokenrelay up``'s command line: ``--redis-cluster N`` and what it refuses."""

from __future__ import annotations

import pytest

from workers.up_options import parse_args


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TOKENRELAY_REDIS_URL", "TOKENRELAY_CELERY_URL"):
        monkeypatch.delenv(var, raising=False)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_redis_cluster_takes_its_number_of_masters() -> None:
    assert parse_args(["--redis-cluster", "3"])[1].redis_cluster == 3
    assert parse_args([])[1].redis_cluster == 0


def test_redis_cluster_refuses_a_redis_given_by_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    err = refused(["--redis-cluster", "3", "--redis-url", "redis://elsewhere:6379/0"], capsys)
    assert "--redis-cluster starts a cluster of its own" in err
    monkeypatch.setenv("TOKENRELAY_REDIS_URL", "redis://elsewhere:6379/0")
    assert "TOKENRELAY_REDIS_URL" in refused(["--redis-cluster", "3"], capsys)


def test_redis_cluster_refuses_a_celery_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENRELAY_CELERY_URL", "redis://elsewhere:6379/0")
    assert "unset TOKENRELAY_CELERY_URL" in refused(["--redis-cluster", "3"], capsys)


@pytest.mark.parametrize("masters", ["1", "2", "-3"])
def test_redis_cluster_needs_three_masters(
    masters: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "at least 3 masters" in refused(["--redis-cluster", masters], capsys)
