"""What an exllamav2 worker checks before it loads weights, and how it lets go of the GPU.

Loading a large model takes minutes; exllamav2 asserts several of its limits only
afterwards, in ``ExLlamaV2DynamicGenerator.__init__``. Every limit below is computed from
the settings and the model's ``config.json`` (as ``ExLlamaV2Config`` parsed it, which
reads no weights), so a worker that can never serve refuses at once, naming the setting
to change. Nothing here imports exllamav2 or torch at module level: the checks are pure
functions, tested on machines without a GPU.

Source references are to exllamav2 v0.3.2 (tag commit 6a2d831): ``dyn`` =
``exllamav2/generator/dynamic.py``, ``attn`` = ``exllamav2/attn.py``, ``model`` =
``exllamav2/model.py``, ``config`` = ``exllamav2/config.py``.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.errors import ModelError

logger = logging.getLogger(__name__)

# The dynamic generator's page size (dyn PAGED_PAGE_SIZE): the cache and, in paged mode,
# every prefill chunk are whole pages (dyn:389, dyn:406-408).
PAGE_SIZE = 256

# ``max_q_size``, the tokens per sequence one generation step evaluates (dyn:249 default,
# which tokenrelay never changes): ``max_batch_size * MAX_Q_SIZE`` must fit the model's
# scratch, ``config.max_batch_size * config.max_input_len`` (dyn:365-370).
MAX_Q_SIZE = 8

# flash-attn's first version with paged KV (``flash_attn_with_kvcache`` + block table):
# below it exllamav2 sets ``has_flash_attn_with_paged`` False (attn:47-59).
PAGED_FLASH_ATTN = (2, 5, 7)

MODE_PAGED = "paged"
MODE_UNPAGED = "unpaged"


@dataclass(frozen=True)
class ModelLimits:
    """The ``ExLlamaV2Config`` numbers the generator's asserts use, read before loading.

    ``max_seq_len`` comes from config.json (``max_position_embeddings`` and its
    aliases, config:369-375); ``max_input_len`` (2048) and ``max_batch_size`` (1) are
    exllamav2's defaults (config:174-175), which tokenrelay does not change.
    """

    max_seq_len: int
    max_input_len: int = 2048
    max_batch_size: int = 1

    @property
    def loaded_input_len(self) -> int:
        """``max_input_len`` as loading leaves it: capped at ``max_seq_len`` (model:535-536)."""
        return min(self.max_input_len, self.max_seq_len)


@dataclass(frozen=True)
class StartupPlan:
    """How the generator will be built: what ``from_model_dir`` passes to exllamav2."""

    paged: bool
    max_batch_size: int
    cache_tokens: int  # rounded up to whole pages
    max_chunk_size: int | None  # None: exllamav2's default, the model's max_input_len
    warnings: list[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return MODE_PAGED if self.paged else MODE_UNPAGED

    @property
    def capacity(self) -> int:
        """Sequences (choices) that run at once: unpaged mode has one page (dyn:384-391)."""
        return self.max_batch_size if self.paged else 1


def plan_startup(
    model: ModelLimits,
    *,
    cache_tokens: int,
    max_batch_size: int,
    max_chunk_size: int | None,
    paged: bool,
) -> StartupPlan:
    """Check the settings against the model's limits; raise ``ModelError`` listing
    every setting that exllamav2 would refuse after the weights loaded.

    ``max_batch_size`` is ``worker_slots x max_n`` (one exllamav2 job per choice).
    A ``max_chunk_size`` above what the model allows is lowered to it, with a warning:
    it only bounds the time of a step. Soft problems (a cache too small for the batch
    or the context) are warnings: the worker runs, with less than the settings promise.
    """
    errors: list[str] = []
    warnings: list[str] = []
    input_len = model.loaded_input_len
    batch = max_batch_size if paged else 1
    tokens = -(-cache_tokens // PAGE_SIZE) * PAGE_SIZE

    room = model.max_batch_size * input_len
    if batch * MAX_Q_SIZE > room:
        errors.append(
            f"worker_slots x max_n = {batch} sequences per step need {batch * MAX_Q_SIZE} "
            f"tokens of the model's forward-pass room, which is {room} "
            f"(max_input_len {input_len} = min(2048, the model's max_seq_len "
            f"{model.max_seq_len})): set TOKENRELAY_WORKER_SLOTS x TOKENRELAY_MAX_N to at "
            f"most {room // MAX_Q_SIZE}"
        )

    chunk = _chunk_size(input_len, max_chunk_size, paged, warnings)
    if paged and chunk is not None and chunk < PAGE_SIZE:
        errors.append(
            f"the model's max_seq_len {model.max_seq_len} is shorter than one "
            f"{PAGE_SIZE}-token page, the smallest prefill chunk of paged attention: "
            "this model cannot run paged (TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED=true runs it "
            "one sequence at a time)"
        )
    if errors:
        raise ModelError(
            "exllamav2 cannot start with these settings (checked before loading the "
            "weights): " + "; ".join(errors)
        )

    warnings += _cache_warnings(model, tokens, batch, paged)
    return StartupPlan(paged, batch, tokens, chunk, warnings)


def _chunk_size(input_len: int, chunk: int | None, paged: bool, warnings: list[str]) -> int | None:
    """The prefill chunk exllamav2 accepts: at most ``max_input_len``, whole pages when
    paged (a larger setting is lowered, with a warning)."""
    if chunk is not None and chunk > input_len:
        # Paged, a chunk is whole pages (dyn:406-408); unpaged, any length fits.
        lowered = (input_len // PAGE_SIZE) * PAGE_SIZE if paged else input_len
        if lowered > 0:
            warnings.append(
                f"TOKENRELAY_EXLLAMAV2_MAX_CHUNK_SIZE {chunk} exceeds the model's "
                f"max_input_len {input_len}: prefilling {lowered} tokens per step instead"
            )
        chunk = lowered
    elif chunk is None and paged and input_len % PAGE_SIZE:
        # exllamav2's default chunk is max_input_len, which must then be whole pages.
        chunk = (input_len // PAGE_SIZE) * PAGE_SIZE
    return chunk


def _cache_warnings(model: ModelLimits, tokens: int, batch: int, paged: bool) -> list[str]:
    """What a cache of ``tokens`` costs the settings: sequences that wait for pages, a
    context longer than the cache, cache tokens never used."""
    warnings: list[str] = []
    pages = tokens // PAGE_SIZE
    if paged and pages < batch:
        warnings.append(
            f"TOKENRELAY_EXLLAMAV2_CACHE_TOKENS {tokens} is {pages} pages of {PAGE_SIZE} "
            f"tokens: at most {pages} of the {batch} sequences (worker_slots x max_n) run "
            "at once, the others wait for pages"
        )
    if paged and tokens < model.max_seq_len:
        warnings.append(
            f"TOKENRELAY_EXLLAMAV2_CACHE_TOKENS {tokens} is less than the model's context "
            f"({model.max_seq_len} tokens): a prompt longer than the cache is refused"
        )
    if not paged and tokens > model.max_seq_len:
        warnings.append(
            f"unpaged, one sequence holds at most the model's context ({model.max_seq_len} "
            f"tokens): {tokens - model.max_seq_len} of the "
            f"{tokens} cache tokens are never used"
        )
    return warnings


def resolve_paged(
    paged: bool | None,
    *,
    has_paged_attention: bool,
    no_flash_attn: bool,
    allow_unpaged: bool,
    installed_version: Callable[[], str | None] | None = None,
) -> bool:
    """Paged or not, decided before loading; ``ModelError`` for a worker that would run
    unpaged without being allowed to (``paged=None``: as the libraries allow) or that
    asked for paged attention it does not have (dyn:354-357 would assert after the load).

    ``has_paged_attention`` is ``exllamav2.attn.has_flash_attn_with_paged`` and
    ``no_flash_attn`` the model config's.
    ``installed_version`` gives flash-attn's version for the message (default: from the
    package metadata; only asked when refusing).
    """
    can_page = has_paged_attention and not no_flash_attn
    if paged is False or can_page:
        return bool(paged is None or paged)
    reason = unpaged_reason(
        has_paged_attention=has_paged_attention,
        no_flash_attn=no_flash_attn,
        flash_attn_version=(installed_version or flash_attn_version)(),
    )
    if paged or not allow_unpaged:
        raise ModelError(unpaged_refusal(reason))
    logger.warning("exllamav2 runs unpaged, one sequence at a time: %s", reason)
    return False


def unpaged_reason(
    *, has_paged_attention: bool, no_flash_attn: bool, flash_attn_version: str | None
) -> str:
    """Why exllamav2 would run unpaged, in words an operator can act on.

    ``has_paged_attention`` is ``exllamav2.attn.has_flash_attn_with_paged``;
    ``no_flash_attn`` is the model config's (set by ``EXLLAMA_NO_FLASH_ATTN`` or by
    ``arch_compat_overrides`` for an architecture flash-attn cannot run, config:629-660).
    """
    if has_paged_attention and no_flash_attn:
        return (
            "flash-attn is disabled for this model (EXLLAMA_NO_FLASH_ATTN is set, or the "
            "architecture needs attention flash-attn does not provide)"
        )
    if flash_attn_version is None:
        return "flash-attn is not installed"
    wanted = ".".join(map(str, PAGED_FLASH_ATTN))
    if _version(flash_attn_version) < PAGED_FLASH_ATTN:
        return f"flash-attn {flash_attn_version} is older than {wanted}"
    return (
        f"flash-attn {flash_attn_version} is installed but exllamav2 could not import its "
        "paged kernels (a build for another torch/CUDA, or EXLLAMA_NO_FLASH_ATTN is set)"
    )


def unpaged_refusal(reason: str) -> str:
    """The start-up error of an unpaged worker that was not allowed to run unpaged."""
    return (
        f"exllamav2 would run unpaged because {reason}: one sequence at a time, so this "
        "worker would serve requests one after another. Install flash-attn >= "
        f"{'.'.join(map(str, PAGED_FLASH_ATTN))} built for this torch and CUDA (the GPU "
        "image does; see docs/deploy.md), or set TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED=true "
        "to run unpaged anyway"
    )


def flash_attn_version() -> str | None:
    """The installed flash-attn's version (package metadata: imports nothing)."""
    from importlib import metadata

    try:
        return metadata.version("flash-attn")
    except metadata.PackageNotFoundError:
        return None


def free_cuda_memory() -> None:
    """Collect what was just dropped and hand CUDA's cached blocks back to the driver.

    torch keeps freed GPU memory in its caching allocator; without ``empty_cache`` a
    closed engine's cache and weights still show as used in ``nvidia-smi`` and cannot be
    used by another process (or another engine in this one)."""
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _version(text: str) -> tuple[int, ...]:
    """``"2.7.4.post1"`` -> (2, 7, 4): the numeric parts, as exllamav2 compares them."""
    return tuple(int(t) for t in text.split(".") if t.isdigit())


def cache_class(cache_bits: int) -> Any:
    """exllamav2's KV cache class for ``cache_bits``: FP16, or the quantized Q8/Q6/Q4."""
    import exllamav2

    caches = {
        16: exllamav2.ExLlamaV2Cache,
        8: exllamav2.ExLlamaV2Cache_Q8,
        6: exllamav2.ExLlamaV2Cache_Q6,
        4: exllamav2.ExLlamaV2Cache_Q4,
    }
    if cache_bits not in caches:
        raise ValueError(f"cache_bits must be one of {sorted(caches)}, not {cache_bits}")
    return caches[cache_bits]


def import_exllamav2() -> tuple[Any, Any, Any]:
    """exllamav2, its attention module and its dynamic generator, or a start-up error
    that says what to do: exllamav2 imports flash-attn when it is installed, and a
    flash-attn wheel built for another torch (C++ ABI, version) fails that import with
    an ``undefined symbol`` deep inside it."""
    try:
        import exllamav2
        from exllamav2 import attn
        from exllamav2.generator import ExLlamaV2DynamicGenerator
    except ImportError as exc:
        hint = ""
        if "flash_attn" in str(exc) or "undefined symbol" in str(exc):
            hint = (
                " flash-attn is installed but does not load with this torch (a wheel for "
                "another torch version or C++ ABI): install the wheel matching this torch "
                "(docker/flash_attn_wheel.py names it), or uninstall flash-attn to run "
                "unpaged (TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED=true)."
            )
        raise ModelError(f"exllamav2 cannot be imported: {exc}.{hint}") from exc
    return exllamav2, attn, ExLlamaV2DynamicGenerator
