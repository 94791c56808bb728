"""The GPU image's flash-attn choice and check (docker/flash_attn_wheel.py), without a GPU.

The wheel must be the one flash-attn's own setup.py would pick for the installed torch:
torch 2.6.0 from PyTorch's cu126 index is built with the CXX11 ABI (pytorch#152790), and
the ``cxx11abiFALSE`` wheel does not load with it. The build check must fail for every
way paged attention can be missing, since an image without it serves one request at a
time.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest

from tests.stack import REPO

SCRIPT = REPO / "docker" / "flash_attn_wheel.py"


def load() -> Any:
    spec = importlib.util.spec_from_file_location("flash_attn_wheel", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheel_for_the_image_is_the_cxx11_abi_cu12_torch26_cp312_release_asset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fa = load()
    monkeypatch.setattr(fa.platform, "machine", lambda: "x86_64")
    name = fa.wheel_name(
        "2.7.4.post1", torch_version="2.6.0+cu126", cuda="12.6", cxx11_abi=True, python=(3, 12)
    )
    assert name == "flash_attn-2.7.4.post1+cu12torch2.6cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    assert fa.wheel_url("2.7.4.post1", name) == (
        "https://github.com/Dao-AILab/flash-attention/releases/download/v2.7.4.post1/" + name
    )
    older = fa.wheel_name(
        "2.7.4.post1", torch_version="2.6.0+cu124", cuda="12.4", cxx11_abi=False, python=(3, 11)
    )
    assert older == "flash_attn-2.7.4.post1+cu12torch2.6cxx11abiFALSE-cp311-cp311-linux_x86_64.whl"


def fake_flash_attn(monkeypatch: pytest.MonkeyPatch, version: str, kernels: bool) -> None:
    module: Any = types.ModuleType("flash_attn")
    module.__version__ = version
    if kernels:
        module.flash_attn_with_kvcache = lambda *a: None
        monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    else:
        monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", None)  # import fails
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def test_the_check_fails_unless_paged_kernels_import(monkeypatch: pytest.MonkeyPatch) -> None:
    fa = load()
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert "does not import" in fa.paged_attention_problem(False)
    fake_flash_attn(monkeypatch, "2.5.6", kernels=True)
    assert "older than 2.5.7" in fa.paged_attention_problem(False)
    fake_flash_attn(monkeypatch, "2.7.4.post1", kernels=False)
    assert "paged kernels do not import" in fa.paged_attention_problem(False)
    fake_flash_attn(monkeypatch, "2.7.4.post1", kernels=True)
    assert fa.paged_attention_problem(False) is None


def test_the_exllamav2_check_reads_has_flash_attn_with_paged(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fa = load()
    attn: Any = types.ModuleType("exllamav2.attn")
    package: Any = types.ModuleType("exllamav2")
    package.attn = attn
    monkeypatch.setitem(sys.modules, "exllamav2", package)
    monkeypatch.setitem(sys.modules, "exllamav2.attn", attn)
    attn.has_flash_attn_with_paged = False
    assert fa.main(["check", "--exllamav2"]) == 1
    assert "TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED=true" in capsys.readouterr().err
    attn.has_flash_attn_with_paged = True
    assert fa.main(["check", "--exllamav2"]) == 0
    assert fa.main(["bogus"]) == 2


def test_the_gpu_dockerfile_installs_and_checks_flash_attn() -> None:
    text = (REPO / "Dockerfile.gpu").read_text()
    for arg in ("FLASH_ATTN=wheel", "FLASH_ATTN_VERSION=2.7.4.post1", "FLASH_ATTN_WHEEL_URL="):
        assert f"ARG {arg}" in text
    assert "flash_attn_wheel.py url" in text and "flash_attn_wheel.py check" in text
    assert "ARG TORCH_VERSION=2.6.0" in text and "whl/cu126" in text
    # flash-attn goes in before the sources are copied (a code change must not redo it).
    assert text.index("flash_attn_wheel.py url") < text.index("COPY app ./app")
    assert text.index("import exllamav2.ext") < text.index("flash_attn_wheel.py check")


def test_the_gpu_dockerfile_names_its_compiler_and_bounds_the_extension_build() -> None:
    """Issue 40: nvcc's host compiler is installed explicitly (the devel image does not
    promise one), and the extension's compile jobs are bounded (one per core is GBs of
    RAM each on a large build host)."""
    text = (REPO / "Dockerfile.gpu").read_text()
    apt = next(line for line in text.splitlines() if "apt-get install" in line)
    assert " g++" in apt
    assert "ARG EXTENSION_MAX_JOBS=4" in text
    assert 'MAX_JOBS="${EXTENSION_MAX_JOBS}" python -c "import exllamav2.ext"' in text
