"""Settings: read from TOKENRELAY_* variables; docs/configuration.md kept in step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.logs import settings_or_exit, unknown_variables
from app.settings import Settings
from app.settings_docs import settings_markdown

REPO = Path(__file__).resolve().parent.parent


def test_configuration_docs_are_generated_from_the_settings() -> None:
    docs = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert docs == settings_markdown(), "run `tokenrelay config docs --write`"


def test_every_setting_is_documented() -> None:
    text = settings_markdown()
    for name, info in Settings.model_fields.items():
        assert f"`TOKENRELAY_{name.upper()}`" in text
        assert info.description, f"{name} has no description"


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENRELAY_PORT", "9001")
    monkeypatch.setenv("TOKENRELAY_ENGINE", "echo")
    monkeypatch.setenv("TOKENRELAY_API_KEYS", '["k1", "k2"]')
    monkeypatch.setenv("TOKENRELAY_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("TOKENRELAY_REDIS_URL", "redis://example:6380/2")
    monkeypatch.setenv("TOKENRELAY_ECHO_TOKENS_PER_SECOND", "12.5")
    monkeypatch.setenv("PORT", "1")  # unprefixed variables are not ours
    settings = Settings()
    assert settings.port == 9001
    assert settings.engine == "echo"
    assert settings.api_keys == ["k1", "k2"]
    assert settings.models_dir == tmp_path
    assert settings.redis_url == "redis://example:6380/2"
    assert settings.echo_tokens_per_second == 12.5


def test_defaults_and_model_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENRELAY_MODELS_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENRELAY_MODEL", raising=False)
    settings = Settings()
    assert settings.model == "SmolLM2-135M-Instruct"
    assert settings.model_path() == tmp_path / "SmolLM2-135M-Instruct"
    absolute = tmp_path / "elsewhere" / "my-model"
    monkeypatch.setenv("TOKENRELAY_MODEL", str(absolute))
    assert Settings().model_path() == absolute


def test_xdg_data_home_sets_the_default_models_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TOKENRELAY_MODELS_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert Settings().models_dir == tmp_path / "tokenrelay" / "models"


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TOKENRELAY_PORT", "0"),
        ("TOKENRELAY_PORT", "http"),
        ("TOKENRELAY_ENGINE", "vllm"),
        ("TOKENRELAY_WORKER_SLOTS", "0"),
        ("TOKENRELAY_API_KEYS", "not json"),
        ("TOKENRELAY_REDIS_URL", "http://127.0.0.1:6379/0"),
        ("TOKENRELAY_REDIS_URL", "127.0.0.1:6379"),
        ("TOKENRELAY_CELERY_URL", "amqp://guest@localhost//"),
        ("TOKENRELAY_FLOWER_BASIC_AUTH", "admin"),
        ("TOKENRELAY_FLOWER_BASIC_AUTH", "admin:"),
        ("TOKENRELAY_MODEL", ""),
    ],
)
def test_invalid_values_are_rejected(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises((ValidationError, ValueError)):
        Settings()


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(ValidationError):
        settings.port = 1  # type: ignore[misc]


def test_records_must_outlive_the_requests_they_describe() -> None:
    """A record or stream that expired mid-generation would be recreated by the next
    publish without a TTL (found by benchmarks/memory.py): refused at start instead."""
    with pytest.raises(ValidationError, match=r"TOKENRELAY_STREAM_TTL_S \(600\) must exceed"):
        Settings(stream_ttl_s=600, request_timeout_s=600)
    assert Settings(stream_ttl_s=91, request_timeout_s=60).stream_ttl_s == 91


def test_every_redis_scheme_is_accepted() -> None:
    for url in (
        "redis://h:6379/0",
        "rediss://:pw@h:6380/1",
        "unix:///run/redis.sock",
        "redis+sentinel://h:26379/main/0",
    ):
        assert Settings(redis_url=url, celery_url=url).redis_url == url


@pytest.mark.parametrize(
    ("var", "value", "said"),
    [
        # The scheme only: a URL may hold a password.
        ("TOKENRELAY_REDIS_URL", "http://u:secret@h/0", "TOKENRELAY_REDIS_URL: a Redis URL"),
        ("TOKENRELAY_API_KEYS", "k1", "TOKENRELAY_API_KEYS: not valid JSON"),
        ("TOKENRELAY_FLOWER_BASIC_AUTH", "admin", "user:password"),
        # Checks across settings name them (they have no one variable to blame).
        ("TOKENRELAY_STREAM_TTL_S", "100", "invalid settings: TOKENRELAY_STREAM_TTL_S (100)"),
        ("TOKENRELAY_ADMIN_API_KEYS", '["a"]', "TOKENRELAY_ADMIN_API_KEYS must also be"),
    ],
)
def test_a_bad_setting_is_one_line_that_names_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    var: str,
    value: str,
    said: str,
) -> None:
    monkeypatch.delenv("TOKENRELAY_LOG_FORMAT", raising=False)
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exited:
        settings_or_exit("web")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenrelay web: error: ") and said in err and err.count("\n") == 1
    assert "secret" not in err and "TOKENRELAY_:" not in err and "Value error" not in err


def test_a_misspelt_variable_is_named_with_what_it_was_meant_to_be(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TOKENRELAY_LOG_FORMAT", raising=False)
    monkeypatch.setenv("TOKENRELAY_API_KEY", '["k"]')
    settings_or_exit("web")  # a warning, not an error
    err = capsys.readouterr().err
    assert "TOKENRELAY_API_KEY (did you mean TOKENRELAY_API_KEYS?)" in err
    assert unknown_variables({"TOKENRELAY_PORT": "1", "OTHER": "x"}) == []


def test_documented_defaults_are_accepted() -> None:
    """Each default docs/configuration.md shows for a computed list or mapping is what
    the setting defaults to, and valid as that variable's value."""
    for name, info in Settings.model_fields.items():
        if info.default_factory is None or name == "models_dir":
            continue
        row = next(
            ln for ln in settings_markdown().splitlines() if f"`TOKENRELAY_{name.upper()}`" in ln
        )
        shown = json.loads(row.split("|")[2].strip().strip("`"))
        assert shown == info.default_factory(), name  # type: ignore[call-arg]
        assert getattr(Settings(**{name: shown}), name) == shown


def test_redis_maxmemory_takes_redis_conf_units_in_any_case() -> None:
    for size in ("4gb", "4GB", "512Mb", "4g", "1024", "100kb"):
        assert Settings(redis_maxmemory=size).redis_maxmemory == size
    for size in ("4x", "gb", "4 gb", "-1gb"):
        with pytest.raises(ValidationError):
            Settings(redis_maxmemory=size)
