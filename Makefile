# Two commands on a fresh machine: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test test-fast lint install install-dev bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Stamp files: reinstall only when pyproject.toml changes.
$(VENV)/.installed-cpu: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[cpu]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[cpu,dev]'
	touch $@ $(VENV)/.installed-cpu

install: $(VENV)/.installed-cpu
install-dev: $(VENV)/.installed-dev

# The whole stack in the foreground (it prepares the bundled model on first use); Ctrl-C,
# or SIGTERM to make, stops everything it started. Options: make run UP_ARGS="--engine echo".
# `exec`: the signal make forwards must reach `tokenrelay up` itself, not a shell around it.
UP_ARGS ?=
run: install
	exec $(BIN)/tokenrelay up $(UP_ARGS)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Everything (unit, integration, e2e, faults); PYTEST_ARGS adds options, e.g. CI's
# "--durations=25" (the slowest tests).
PYTEST_ARGS ?=
test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

# Unit tests only: no process started, no socket, no weights loaded (under a minute).
test-fast: install-dev
	$(BIN)/pytest -m unit -q $(PYTEST_ARGS)

bench: install-dev
	$(BIN)/python benchmarks/decoder.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
