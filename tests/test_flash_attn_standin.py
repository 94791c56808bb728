"""The pure-torch flash-attn stand-in of the GPU check (``benchmarks/flash_attn_standin``)
against dense attention on the CPU: the paged cache with a shuffled block table, both
``flash_attn_with_kvcache`` modes (new keys given and written into the cache first, or
the cache already holding them), grouped-query heads, bottom-right causality, and what
exllamav2 reads to decide it may run paged (issue 40)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")  # the dev extra installs it (a CPU build)
F = torch.nn.functional

pytestmark = pytest.mark.unit

STANDIN = Path(__file__).resolve().parent.parent / "benchmarks" / "flash_attn_standin"


@pytest.fixture(scope="module")
def fa() -> ModuleType:
    """The stand-in under a name of its own: ``flash_attn`` stays unimported here."""
    spec = importlib.util.spec_from_file_location(
        "flash_attn_standin", STANDIN / "flash_attn" / "__init__.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference: SDPA over one sequence, (s, h, d), causal aligned bottom-right."""
    sq, heads, _ = q.shape
    sk, kv_heads, _ = k.shape
    group = heads // kv_heads
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, dim=1).transpose(0, 1),
        v.repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


def paged(
    full: torch.Tensor, lengths: list[int], page: int, blocks_per_seq: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``full`` (batch, s, h, d) as a paged cache with a shuffled block table; positions
    past each length left as noise."""
    batch, _s, heads, dim = full.shape
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch * blocks_per_seq, generator=gen)
    table = order.view(batch, blocks_per_seq).to(torch.int32)
    cache = torch.randn(batch * blocks_per_seq, page, heads, dim, generator=gen)
    for b in range(batch):
        for p in range(lengths[b]):
            cache[table[b, p // page], p % page] = full[b, p]
    return cache, table


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_new_keys_are_written_into_the_paged_cache_then_attended(
    fa: ModuleType, kv_heads: int
) -> None:
    """exllamav2's prefill and decode (``k``/``v`` given): written at ``cache_seqlens``,
    then every query attends to the cache up to its own position."""
    torch.manual_seed(0)
    batch, heads, dim, page, blocks = 3, 4, 16, 8, 6
    before, new = [5, 0, 17], [4, 9, 1]
    sq = max(new)
    total = [b + n for b, n in zip(before, new, strict=True)]
    keys = torch.randn(batch, blocks * page, kv_heads, dim)
    values = torch.randn(batch, blocks * page, kv_heads, dim)
    k_cache, table = paged(keys, before, page, blocks, seed=1)
    v_cache, _ = paged(values, before, page, blocks, seed=1)
    q = torch.randn(batch, sq, heads, dim)
    k_new = torch.stack([keys[b, before[b] : before[b] + sq] for b in range(batch)])
    v_new = torch.stack([values[b, before[b] : before[b] + sq] for b in range(batch)])
    scale = dim**-0.5
    for b in range(batch):  # one call per sequence length: q and k share seqlen
        one = slice(b, b + 1)
        out = fa.flash_attn_with_kvcache(
            q[one, : new[b]],
            k_cache,
            v_cache,
            k=k_new[one, : new[b]],
            v=v_new[one, : new[b]],
            cache_seqlens=torch.tensor([before[b]], dtype=torch.int32),
            block_table=table[one],
            causal=True,
            softmax_scale=scale,
        )
        ref = dense(q[b, : new[b]], keys[b, : total[b]], values[b, : total[b]], scale)
        torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
        for p in range(total[b]):  # the new keys went where the block table says
            torch.testing.assert_close(k_cache[table[b, p // page], p % page], keys[b, p])


def test_a_cache_already_holding_the_keys_is_attended_as_is(fa: ModuleType) -> None:
    """exllamav2's sequential mode (``k=None``, ``cache_seqlens`` after the new tokens),
    batched, and the unpaged layout (batch, seqlen, heads, dim) alike."""
    torch.manual_seed(2)
    batch, heads, kv_heads, dim, page, blocks, sq = 2, 8, 2, 32, 16, 4, 3
    lengths = [40, 7]
    keys = torch.randn(batch, blocks * page, kv_heads, dim)
    values = torch.randn(batch, blocks * page, kv_heads, dim)
    q = torch.randn(batch, sq, heads, dim)
    k_cache, table = paged(keys, lengths, page, blocks, seed=3)
    v_cache, _ = paged(values, lengths, page, blocks, seed=3)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    got = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True
    )
    flat = fa.flash_attn_with_kvcache(q, keys, values, cache_seqlens=seqlens, causal=True)
    for b in range(batch):
        ref = dense(q[b], keys[b, : lengths[b]], values[b, : lengths[b]], dim**-0.5)
        torch.testing.assert_close(got[b], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(flat[b], ref, atol=1e-5, rtol=1e-5)


def test_exllamav2_takes_it_for_a_paged_flash_attn(fa: ModuleType) -> None:
    """What ``exllamav2/attn.py`` checks: a version of 2.5.7 or later, the three
    functions, and ``flash_attn_2_cuda`` importable from the same directory."""
    version = [int(t) for t in fa.__version__.split(".") if t.isdigit()]
    assert version >= [2, 5, 7]
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        assert callable(getattr(fa, name))
    assert (STANDIN / "flash_attn_2_cuda.py").is_file()
    assert str(STANDIN) not in sys.path  # never on the path outside the check
    text = (STANDIN / "flash_attn" / "__init__.py").read_text()
    assert not re.search(r"^import flash_attn", text, re.M)
