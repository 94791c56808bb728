"""Stage what the relay benchmarks need on the device machine, for one call there.

    python benchmarks/device_carry.py [--dest .carry] [--python 3.12.3]

Why: issue 12's one unmet goal is the paced relay's added inter-token latency (p50
<= 2 ms at ``benchmarks/relay.py --stage relay --rate 200``). On this 2-core machine the
design's Redis hops alone take most of it, and the step every measurement names next is
a core per process: the device machine some sessions are lent has 16. It can reach no
network, its Python (3.12) has none of tokenrelay's dependencies but numpy and
tokenizers, and at most 64 MiB travel with a call. So this stages, under ``--dest``
(``.carry``, which .gitignore keeps out of git and ``carry`` sends along):

- ``whl/``: a wheel for the device's Python of every distribution tokenrelay's base
  requirements need, at the version installed here (the versions the suite passed
  with), except those the device image holds (``--skip``: numpy, tokenizers);
- ``models/SmolLM2-135M-Instruct/``: the bundled model's directory without its GGUF
  (the echo engine the relay benchmarks run reads only the tokenizer and the config).

Then ``benchmarks/device_relay.sh`` is the one command to run there (its header says
how). Nothing here runs in CI or in tests: the closure is computed from installed
metadata (``closure``, unit-tested), and downloading needs PyPI.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import BUNDLED_MODEL_NAME, prepare_bundled_model

# The device image's packages (/work/.library/device/KINDS.md, "Python packages already
# there") that tokenrelay's closure reaches and that are big: carried, they would cost
# most of the 64 MiB. The small pure-Python ones travel anyway, at the versions tested.
DEVICE_HAS = ("numpy", "tokenizers", "setuptools")
# manylinux tags, which pip must be told one by one: any glibc up to 2.35 (the device
# image's Python 3.12.3 is Ubuntu 24.04's, glibc 2.39; llguidance needs 2.31).
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in range(35, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)


def canonical(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(
    root: str,
    requires: Callable[[str], Iterable[str] | None],
    *,
    python: str,
    skip: Iterable[str] = (),
) -> list[str]:
    """The canonical names of the distributions ``root`` needs at run time on a Linux
    x86-64 CPython ``python`` (a full version: markers compare the patch level too): its
    requirements, their extras' requirements and so on, with markers evaluated for that
    Python; ``skip`` and what only they need are left out. ``requires`` is
    ``importlib.metadata.requires`` or a stand-in (None for a distribution it lacks)."""
    env = {
        "python_version": ".".join(python.split(".")[:2]),
        "python_full_version": python,
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
    }
    skipped = {canonical(s) for s in skip}
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    todo: list[tuple[str, str]] = [(r, "") for r in requires(root) or ()]
    while todo:
        raw, extra = todo.pop()
        req = Requirement(raw)
        if req.marker and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = canonical(req.name)
        if name in skipped:
            continue
        for wanted in ("", *sorted(req.extras)):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            names.add(name)
            todo.extend((sub, wanted) for sub in requires(name) or ())
    return sorted(names)


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def requires(name: str) -> list[str] | None:
    try:
        return metadata.requires(name)
    except metadata.PackageNotFoundError:
        return None


def download(names: list[str], dest: Path, python: str) -> None:
    """Wheels of ``names`` for CPython ``python``: at the versions installed here, and the
    newest that fits for one this Python does not need (a marker for an older patch)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pins = [f"{n}=={v}" if (v := installed(n)) else n for n in names]
    python_version = ".".join(python.split(".")[:2])
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    target = ["--python-version", python_version, "--implementation", "cp", *platforms]
    subprocess.run([*pip, *target, "-d", str(dest), *pins], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, default=Path(".carry"))
    parser.add_argument(
        "--python", default="3.12.3", help="the target's CPython (the device image's is 3.12.3)"
    )
    parser.add_argument("--skip", nargs="*", default=list(DEVICE_HAS))
    args = parser.parse_args()

    wheels = args.dest / "whl"
    shutil.rmtree(wheels, ignore_errors=True)  # one version of each, or pip stops
    wheels.mkdir(parents=True)
    names = closure("tokenrelay", requires, python=args.python, skip=args.skip)
    download(names, wheels, args.python)

    built = prepare_bundled_model(args.dest / "build-models")
    model = args.dest / "models" / BUNDLED_MODEL_NAME
    shutil.rmtree(model, ignore_errors=True)
    model.mkdir(parents=True)
    for f in built.iterdir():
        if f.is_file() and f.suffix != ".gguf":
            shutil.copy2(f, model / f.name)
    shutil.rmtree(args.dest / "build-models")

    size = sum(f.stat().st_size for f in args.dest.rglob("*") if f.is_file())
    print(f"{len(names)} wheels in {wheels}, the model's files in {model}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
