"""compose.yaml, the Dockerfiles and .env.example, checked without a Docker engine.

* ``docker-compose config -q`` (Debian's docker-compose v1, installed by .ci/run) parses
  and validates the file against the Compose schema, with .env.example as the .env;
* every service's command exists in the package (a ``tokenrelay`` subcommand whose
  module runs under ``python -m``, or a ``celery`` subcommand that is installed);
* every TOKENRELAY_* variable in compose.yaml and .env.example is a real setting, every
  setting is documented in .env.example, and every ``${VAR}`` compose interpolates is too;
* the deployment rules of docs/deploy.md: Redis unpublished with noeviction and a volume,
  healthchecks and restart policies everywhere, the GPU worker reserving a GPU, the CPU
  worker under the ``cpu`` profile, Flower's basic auth from the environment.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cli import EXTERNAL_COMMANDS, is_runnable_module
from app.settings import Settings
from tests.stack import REPO

COMPOSE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERFILES = [REPO / "Dockerfile", REPO / "Dockerfile.gpu"]
SETTING_VARS = {f"TOKENRELAY_{name.upper()}" for name in Settings.model_fields}
TOKENRELAY_VAR = re.compile(r"\bTOKENRELAY_[A-Z0-9_]+")
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def services() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose()["services"]
    return result


def env_example_vars() -> set[str]:
    """Names in .env.example, set or commented out (``# NAME=value`` documents a default)."""
    names = set()
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=", line)
        if match:
            names.add(match.group(1))
    return names


@pytest.mark.integration  # starts a process or opens a socket
def test_docker_compose_config_validates(tmp_path: Path) -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose (v1, Debian package docker-compose) is not installed")
    # A deployment directory as docs/deploy.md describes it: compose.yaml and the
    # Dockerfiles beside a .env copied from .env.example.
    for path in [COMPOSE, *DOCKERFILES]:
        shutil.copy(path, tmp_path / path.name)
    shutil.copy(ENV_EXAMPLE, tmp_path / ".env")
    for profile in ([], ["--profile", "cpu"]):
        result = subprocess.run(
            [exe, *profile, "config", "-q"], cwd=tmp_path, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
    # Without a .env, the error names what to set rather than starting half-configured.
    (tmp_path / ".env").unlink()
    result = subprocess.run([exe, "config", "-q"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0
    assert ".env" in result.stderr


def test_every_service_command_exists_in_the_package() -> None:
    checked = 0
    for name, service in services().items():
        command = service.get("command")
        if name == "redis":
            assert command[0] == "redis-server"
            continue
        assert isinstance(command, list), f"{name}: use the exec form (a list)"
        program, sub = command[0], command[1]
        if program == "tokenrelay":
            # A long-running process: one of the CLI's external subcommands.
            assert sub in EXTERNAL_COMMANDS, f"{name}: `tokenrelay {sub}` is not a subcommand"
            module = EXTERNAL_COMMANDS[sub].module
            assert is_runnable_module(module), f"{name}: python -m {module} cannot run"
        elif program == "celery":
            rest = [arg for arg in command[1:] if not arg.startswith("-")]
            assert "flower" in rest, f"{name}: unexpected celery command {command}"
            assert importlib.util.find_spec("flower") is not None
        else:
            pytest.fail(f"{name}: command {command} is neither tokenrelay nor celery")
        checked += 1
    assert checked >= 5


def test_tokenrelay_variables_are_real_settings_and_all_documented() -> None:
    used = set(TOKENRELAY_VAR.findall(COMPOSE.read_text()))
    documented = {v for v in env_example_vars() if v.startswith("TOKENRELAY_")}
    unknown = (used | documented) - SETTING_VARS
    assert not unknown, f"not settings (see app/settings.py): {sorted(unknown)}"
    missing = SETTING_VARS - documented
    assert not missing, f"document these settings in .env.example: {sorted(missing)}"


def test_every_interpolated_variable_is_documented() -> None:
    interpolated = set(INTERPOLATION.findall(COMPOSE.read_text()))
    assert interpolated, "compose.yaml interpolates nothing?"
    undocumented = interpolated - env_example_vars()
    assert not undocumented, f"add to .env.example: {sorted(undocumented)}"
    # Compose-only variables must be used; OpenTelemetry's (OTEL_*) reach every process
    # through env_file, as the SDK reads them (docs/operations.md, "Traces").
    for name in env_example_vars() - SETTING_VARS:
        if name.startswith("OTEL_"):
            continue
        assert name in interpolated, f".env.example documents {name}, but compose ignores it"


def test_redis_is_private_durable_and_never_evicts() -> None:
    redis = services()["redis"]
    assert redis["image"].startswith("redis:7")
    assert "ports" not in redis, "Redis must not be published to the host"
    command = redis["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-data" in compose()["volumes"]


def test_healthchecks_and_restart_policies_everywhere() -> None:
    for name, service in services().items():
        assert service.get("restart") in ("unless-stopped", "always"), name
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        if name != "redis":
            assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
    for name in ("web", "streamer", "batcher", "worker", "worker-cpu", "flower"):
        test = services()[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/usr/local/lib/tokenrelay/healthcheck.py"], name


def test_gpu_worker_reserves_its_gpu_and_mounts_the_model_read_only() -> None:
    worker = services()["worker"]
    assert worker["command"][-2:] == ["--engine", "exllamav2"]
    assert worker["environment"]["TOKENRELAY_ENGINE"] == "exllamav2"
    assert worker["build"]["dockerfile"] == "Dockerfile.gpu"
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert len(device["device_ids"]) == 1  # one worker per GPU
    for name in ("web", "streamer", "worker"):
        assert any(v.endswith(":/model:ro") for v in services()[name]["volumes"]), name
    assert "TOKENRELAY_MODEL=/model" in ENV_EXAMPLE.read_text()


def test_cpu_worker_is_under_the_cpu_profile() -> None:
    cpu = services()["worker-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert cpu["environment"]["TOKENRELAY_ENGINE"] == "llamacpp"
    assert "deploy" not in cpu
    assert all("profiles" not in s for n, s in services().items() if n != "worker-cpu")


def test_web_and_flower_are_published_and_flower_needs_a_password() -> None:
    web, flower = services()["web"], services()["flower"]
    assert web["ports"] == ["${WEB_PORT:-8000}:8000"]
    assert web["environment"]["TOKENRELAY_HOST"] == "0.0.0.0"
    assert flower["ports"] == ["${FLOWER_PORT:-5555}:5555"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${TOKENRELAY_FLOWER_BASIC_AUTH:?")


def test_dockerfiles_install_the_right_extras_and_the_bundled_model() -> None:
    cpu, gpu = (path.read_text() for path in DOCKERFILES)
    assert "FROM python:3.11-slim" in cpu
    assert "'.[cpu]'" in cpu and "RUN tokenrelay model prepare" in cpu
    assert "'.[gpu]'" in gpu and "download.pytorch.org" in gpu and "nvidia/cuda:" in gpu
    for text in (cpu, gpu):
        assert "COPY docker/healthcheck.py /usr/local/lib/tokenrelay/healthcheck.py" in text
        assert "USER tokenrelay" in text


@pytest.mark.integration  # starts a process or opens a socket
def test_healthcheck_script_reports_unhealthy_in_one_line() -> None:
    script = REPO / "docker" / "healthcheck.py"
    env = {"TOKENRELAY_REDIS_URL": "redis://127.0.0.1:1/0", "PYTHONPATH": str(REPO)}
    for kind in ("worker", "streamer", "batcher", "flower"):
        result = subprocess.run(
            [sys.executable, str(script), kind],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, (kind, result.stderr)
        assert result.stderr.startswith("unhealthy: "), result.stderr
