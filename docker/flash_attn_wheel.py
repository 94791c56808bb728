"""flash-attn for the GPU image (Dockerfile.gpu): which wheel, and does exllamav2 page.

Without flash-attn >= 2.5.7 exllamav2's dynamic generator runs unpaged, one sequence at
a time (exllamav2 0.3.2 attn.py:47-59, generator/dynamic.py:314-317), so the image
installs it and checks it at build time.

    python flash_attn_wheel.py url VERSION   # the release wheel for the installed torch
    python flash_attn_wheel.py check [--exllamav2]

``url`` prints the GitHub release asset Dao-AILab/flash-attention's own setup.py looks
for (``get_wheel_url`` at v2.7.4.post1): CUDA major version, torch major.minor, the C++
ABI torch was built with (torch 2.6.0+cu126 from PyTorch's index is built with the
CXX11 ABI, unlike 2.6.0+cu124: pytorch/pytorch#152790), Python tag and platform.
Reading the ABI flag from the installed torch rather than assuming it is what keeps the
wheel loadable: the other ABI fails at import with an undefined ``c10::Error`` symbol.

``check`` exits non-zero unless paged attention is available: with ``--exllamav2`` it
asserts ``exllamav2.attn.has_flash_attn_with_paged`` itself (this imports exllamav2's
extension, so only once it is compiled); without, it repeats that module's test (import
flash_attn, version >= 2.5.7, ``flash_attn_with_kvcache``, ``flash_attn_2_cuda``). No GPU
is needed for either: exllamav2 only counts the visible GPUs, and there are none.
"""

from __future__ import annotations

import platform
import sys

RELEASES = "https://github.com/Dao-AILab/flash-attention/releases/download"
PAGED_SINCE = (2, 5, 7)


def wheel_name(
    version: str, *, torch_version: str, cuda: str, cxx11_abi: bool, python: tuple[int, int]
) -> str:
    """The release asset name for these versions (flash-attn's setup.py spells it so)."""
    torch_mm = ".".join(torch_version.split("+")[0].split(".")[:2])
    cuda_major = cuda.split(".")[0]
    tag = f"cp{python[0]}{python[1]}"
    abi = "TRUE" if cxx11_abi else "FALSE"
    plat = f"linux_{platform.machine() or 'x86_64'}"
    return f"flash_attn-{version}+cu{cuda_major}torch{torch_mm}cxx11abi{abi}-{tag}-{tag}-{plat}.whl"


def wheel_url(version: str, name: str) -> str:
    return f"{RELEASES}/v{version}/{name}"


def numeric(version: str) -> tuple[int, ...]:
    """``"2.7.4.post1"`` -> (2, 7, 4), as exllamav2 compares flash-attn versions."""
    return tuple(int(t) for t in version.split(".") if t.isdigit())


def paged_attention_problem(use_exllamav2: bool) -> str | None:
    """None when exllamav2 can run paged attention here, else what is wrong."""
    if use_exllamav2:
        import exllamav2.attn as attn

        return None if attn.has_flash_attn_with_paged else "has_flash_attn_with_paged is False"
    try:
        import flash_attn
    except ImportError as exc:
        return f"flash_attn does not import: {exc}"
    if numeric(flash_attn.__version__) < PAGED_SINCE:
        return f"flash-attn {flash_attn.__version__} is older than 2.5.7"
    try:
        import flash_attn_2_cuda  # noqa: F401
        from flash_attn import flash_attn_with_kvcache  # noqa: F401
    except ImportError as exc:
        return f"flash-attn's paged kernels do not import: {exc}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "url":
        import torch

        name = wheel_name(
            argv[1],
            torch_version=torch.__version__,
            cuda=str(torch.version.cuda),
            cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
            python=(sys.version_info[0], sys.version_info[1]),
        )
        print(wheel_url(argv[1], name))
        return 0
    if argv and argv[0] == "check" and set(argv[1:]) <= {"--exllamav2"}:
        problem = paged_attention_problem("--exllamav2" in argv)
        if problem is not None:
            sys.stderr.write(
                f"exllamav2 cannot use paged attention: {problem}. The worker would serve "
                "one request at a time; fix flash-attn, or build with --build-arg "
                "FLASH_ATTN=skip and run it with TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED=true.\n"
            )
            return 1
        print("exllamav2 paged attention: available")
        return 0
    sys.stderr.write(__doc__ or "")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
