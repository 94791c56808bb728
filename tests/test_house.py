"""The project's shape, as the developers' guide states it, checked so that it stays
true: ``app/`` (the pure core) imports nothing from the other layers, nor Redis, Celery
or Flask; ``web/`` and ``workers/`` talk only through ``broker/``, which imports
neither; no product module grows past 600 lines (issue 39: a module that long is
usually two), and no function's body past 60 unless it is declarative (a table, a
parser's arguments, a configuration); and docs/benchmarks.md stays a page a user
reads (about 500 lines; its history lives in docs/benchmarks-log.md)."""

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
MAX_FUNCTION_LINES = 60
# Longer, and declarative: each states a list of things (metric families, Celery's
# configuration, the command line's options, a worker's tasks and signal handlers).
DECLARATIVE = {
    "web/metrics.py:WebMetrics.__init__",
    "broker/celery_app.py:create_celery",
    "workers/up_options.py:build_parser",
    "workers/celery_worker.py:build_app",
}


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


def _function_bodies(path: Path) -> list[tuple[str, int]]:
    """Every function in ``path`` (methods as ``Class.name``; nested ones under their
    own name) with its body's length in lines, docstring and signature left out."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body
                if ast.get_docstring(child) is not None:
                    body = body[1:]
                if body:
                    end = child.end_lineno or body[-1].lineno
                    out.append((f"{prefix}{child.name}", end - body[0].lineno + 1))
                visit(child, "")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_no_function_is_over_60_lines_unless_declarative() -> None:
    found: set[str] = set()
    long = []
    for layer in LAYERS:
        for path in _modules(layer):
            for name, n in _function_bodies(path):
                where = f"{path.relative_to(ROOT)}:{name}"
                if n <= MAX_FUNCTION_LINES:
                    continue
                if where in DECLARATIVE:
                    found.add(where)
                else:
                    long.append(f"{where}: {n} lines")
    assert not long, "split these (a function that long does several things):\n" + "\n".join(long)
    assert found == DECLARATIVE, f"no longer long, drop from DECLARATIVE: {DECLARATIVE - found}"


def test_the_benchmarks_page_stays_a_page() -> None:
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines <= MAX_BENCHMARKS_MD_LINES, (
        f"docs/benchmarks.md has {lines} lines: keep one current table per benchmark and "
        "move earlier runs to docs/benchmarks-log.md"
    )
