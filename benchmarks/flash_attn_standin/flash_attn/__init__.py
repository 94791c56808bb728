"""A pure-torch stand-in for flash-attn, for the prepared GPU check only (issue 40).

exllamav2 batches (paged attention, its dynamic generator with many jobs) only when
``import flash_attn`` finds version 2.5.7 or later with ``flash_attn_with_kvcache`` and
``flash_attn_2_cuda`` (``exllamav2/attn.py``). Where no flash-attn wheel exists for the
device's torch and CUDA, the check puts this directory first on ``PYTHONPATH`` so that
exllamav2 runs paged anyway: the kernels are plain torch (slow, exact), so the ratios and
the token equality the check measures are valid, its speeds are not production speeds.
It is never installed: nothing outside ``benchmarks/gpu_check.py`` puts it on the path.

``flash_attn_with_kvcache`` follows flash-attn 2's contract: ``q`` (batch, seqlen_q,
heads, dim); the cache either (batch, seqlen, kv_heads, dim) or, with ``block_table``
(batch, blocks per sequence), paged as (blocks, block size, kv_heads, dim); ``k``/``v``
given are written into the cache at ``cache_seqlens`` first; attention runs over each
sequence's cache up to its length, causal aligned bottom-right (the last query sees every
key), with grouped-query heads, ``softmax_scale``, ``softcap`` and ``window_size``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__version__ = "2.7.4.post1+torchstandin"


def _lengths(cache_seqlens: Any, batch: int, device: torch.device) -> list[int]:
    if cache_seqlens is None:
        return [0] * batch
    if isinstance(cache_seqlens, int):
        return [cache_seqlens] * batch
    return [int(n) for n in cache_seqlens.to(device="cpu").tolist()]


def _positions(block_table: torch.Tensor | None, b: int, start: int, end: int, page: int) -> Any:
    """Where positions ``start``..``end - 1`` of sequence ``b`` are in the cache: (block,
    offset) index tensors when paged, else a slice of the sequence's own row."""
    if block_table is None:
        return slice(start, end)
    pos = torch.arange(start, end, device=block_table.device)
    return block_table[b, pos // page].long(), pos % page


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
) -> torch.Tensor:
    """One sequence: q (sq, h, d) over keys/values (sk, hk, d) -> (sq, h, d)."""
    sq, heads, _ = q.shape
    sk, kv_heads, _ = keys.shape
    group = heads // kv_heads
    k = keys.repeat_interleave(group, dim=1).float()
    v = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # each query's position
    j = torch.arange(sk, device=q.device)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= i
    left, right = window
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0 and not causal:
        allowed &= j <= i + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
    return torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor:
    """flash-attn 2's ``flash_attn_with_kvcache``, in plain torch (module doc)."""
    unsupported = {
        "rotary_cos": rotary_cos,
        "cache_batch_idx": cache_batch_idx,
        "cache_leftpad": cache_leftpad,
        "alibi_slopes": alibi_slopes,
    }
    named = [name for name, value in unsupported.items() if value is not None]
    if named or return_softmax_lse:
        raise NotImplementedError(f"the flash-attn stand-in does not do {named or 'lse'}")
    batch, _sq, _heads, dim = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    page = k_cache.shape[1]
    lengths = _lengths(cache_seqlens, batch, q.device)
    out = torch.empty_like(q)
    for b in range(batch):
        start = lengths[b]
        total = start
        if k is not None and v is not None:
            total = start + k.shape[1]
            at = _positions(block_table, b, start, total, page)
            if block_table is None:
                k_cache[b, at] = k[b]
                v_cache[b, at] = v[b]
            else:
                k_cache[at] = k[b]
                v_cache[at] = v[b]
        at = _positions(block_table, b, 0, total, page)
        keys = k_cache[b, at] if block_table is None else k_cache[at]
        values = v_cache[b, at] if block_table is None else v_cache[at]
        out[b] = _attend(
            q[b], keys, values, scale=scale, causal=causal, window=window_size, softcap=softcap
        )
    return out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    """flash-attn 2's ``flash_attn_func`` (batch, seqlen, heads, dim), in plain torch."""
    if dropout_p or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("the flash-attn stand-in does not do dropout/alibi/probs")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.stack(
        [
            _attend(
                q[b], k[b], v[b], scale=scale, causal=causal, window=window_size, softcap=softcap
            )
            for b in range(q.shape[0])
        ]
    )


def flash_attn_varlen_func(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Not used by exllamav2's paged path; present because exllamav2 imports it."""
    raise NotImplementedError("the flash-attn stand-in has no varlen attention")
