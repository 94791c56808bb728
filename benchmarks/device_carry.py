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


def download(names: list[str], dest: Path, python: str, pins: dict[str, str] | None = None) -> None:
    """Wheels of ``names`` for CPython ``python``: at ``pins`` or the versions installed
    here, and the newest that fits for one this Python does not need (a marker for an
    older patch)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pinned = pins or {}
    wanted = [f"{n}=={v}" if (v := pinned.get(n) or installed(n)) else n for n in names]
    python_version = ".".join(python.split(".")[:2])
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    target = ["--python-version", python_version, "--implementation", "cp", *platforms]
    subprocess.run([*pip, *target, "-d", str(dest), *wanted], check=True)


# For the GPU run (benchmarks/device_gpu.sh), also left out: what the device image holds
# in a version the run works with (KINDS.md's list), and Flower's own needs (no Flower
# there). Every MiB counts: the wheels and the 94 MiB GGUF fill two calls' 64 MiB.
GPU_DEVICE_HAS = (
    *DEVICE_HAS,
    *("pyyaml", "psutil", "requests", "urllib3", "certifi", "idna", "charset-normalizer"),
    *("prometheus-client", "jinja2", "markupsafe", "packaging", "six", "python-dateutil"),
    *("tqdm", "flower", "tornado", "humanize", "pytz"),
)
# What one call may carry (the device tool's limit), less a margin for what else travels.
CALL_LIMIT = 64 * 2**20
MARGIN = 2 * 2**20


def tree_bytes(root: Path) -> int:
    """Bytes of the files git would send from ``root`` (tracked and untracked, not
    ignored): the part of each call's 64 MiB the working tree takes."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    files = [root / f for f in out.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file())


def split_to_fit(
    big: Path, first: Path, second: Path, *, first_room: int, second_room: int
) -> tuple[int, int]:
    """``big`` in two pieces, ``first`` as large as ``first_room`` allows and the rest in
    ``second``; refuses when the rest exceeds ``second_room``. The device joins them
    with ``cat`` and checks the sha256."""
    size = big.stat().st_size
    head = min(size, max(first_room, 0))
    if size - head > second_room:
        raise SystemExit(
            f"{big.name} ({size / 2**20:.1f} MiB) does not fit two calls: "
            f"{first_room / 2**20:.1f} + {second_room / 2**20:.1f} MiB of room"
        )
    with big.open("rb") as src:
        first.write_bytes(src.read(head))
        second.write_bytes(src.read())
    return head, size - head


def stage_gpu(dest: Path, python: str, repo: Path) -> None:
    """``dest/a``: the wheels (tokenrelay's closure, exllamav2 0.3.2) and the GGUF's first
    piece; ``dest/b``: its second piece and sha256; each under one call's limit with the
    working tree that travels beside it (checked here, by size)."""
    import hashlib

    from app.prepare import bundled_gguf_path

    shutil.rmtree(dest, ignore_errors=True)
    wheels = dest / "a" / "whl"
    wheels.mkdir(parents=True)
    (dest / "b").mkdir()
    names = closure("tokenrelay", requires, python=python, skip=GPU_DEVICE_HAS)
    download([*names, "exllamav2"], wheels, python, pins={"exllamav2": "0.3.2"})
    gguf = bundled_gguf_path()
    room = CALL_LIMIT - MARGIN - tree_bytes(repo)
    used = sum(f.stat().st_size for f in wheels.iterdir())
    a, b = split_to_fit(
        gguf,
        dest / "a" / "part.aa",
        dest / "b" / "part.ab",
        first_room=room - used,
        second_room=room,
    )
    (dest / "b" / "sha256").write_text(hashlib.sha256(gguf.read_bytes()).hexdigest() + "\n")
    print(
        f"{len(names) + 1} wheels ({used / 2**20:.1f} MiB) + GGUF {a / 2**20:.1f} MiB in "
        f"{dest / 'a'}; GGUF {b / 2**20:.1f} MiB in {dest / 'b'}; room per call "
        f"{room / 2**20:.1f} MiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, default=Path(".carry"))
    parser.add_argument(
        "--python", default="3.12.3", help="the target's CPython (the device image's is 3.12.3)"
    )
    parser.add_argument("--skip", nargs="*", default=list(DEVICE_HAS))
    parser.add_argument(
        "--gpu", action="store_true", help="stage the GPU run's two parts (device_gpu.sh)"
    )
    args = parser.parse_args()
    if args.gpu:
        stage_gpu(args.dest, args.python, Path(__file__).resolve().parent.parent)
        return 0

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
