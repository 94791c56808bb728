"""The project's shape, as the developers' guide states it, checked so that it stays
true: ``app/`` (the pure core) imports nothing from the other layers, nor Redis, Celery
or Flask; ``web/`` and ``workers/`` talk only through ``broker/``, which imports
neither; no product module grows past 600 lines (issue 39: a module that long is
usually two); and docs/benchmarks.md stays a page a user reads (about 500 lines; its
history lives in docs/benchmarks-log.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("app", "broker", "workers", "web")
# What each layer may not import (docs/architecture.md, "Packages"): the pure core
# does no network I/O, so no Redis, Celery or web framework either.
FORBIDDEN = {
    "app": {"broker", "workers", "web", "redis", "celery", "kombu", "flask", "werkzeug"},
    "broker": {"workers", "web"},
    "workers": {"web"},
    "web": {"workers"},
}
MAX_MODULE_LINES = 600
MAX_BENCHMARKS_MD_LINES = 500


def _modules(layer: str) -> list[Path]:
    return sorted((ROOT / layer).rglob("*.py"))


def _imported_packages(path: Path) -> set[tuple[str, int]]:
    """The top-level package of every import in ``path``, with its line (imports inside
    functions too: a lazy import is still a dependency)."""
    out: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add((node.module.split(".")[0], node.lineno))
    return out


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_imports_only_what_the_layering_allows(layer: str) -> None:
    modules = _modules(layer)
    assert modules, f"no modules under {layer}/"
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {package}"
        for path in modules
        for package, line in sorted(_imported_packages(path))
        if package in FORBIDDEN[layer]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_product_module_is_over_600_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for layer in LAYERS
        for path in _modules(layer)
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "split these (one noun per module):\n" + "\n".join(long)


def test_the_benchmarks_page_stays_a_page() -> None:
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines <= MAX_BENCHMARKS_MD_LINES, (
        f"docs/benchmarks.md has {lines} lines: keep one current table per benchmark and "
        "move earlier runs to docs/benchmarks-log.md"
    )
