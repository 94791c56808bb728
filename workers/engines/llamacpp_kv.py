"""The llama.cpp engine's KV cells: which sequence ids hold them, what they cache.

``KvCells`` applies the prefix cache's decisions (``workers/engines/prefix_cache.py``,
the bookkeeping) to llama.cpp's unified KV (``llama_memory_seq_cp`` / ``seq_rm``) and to
host memory (``llama_state_seq_get_data`` / ``set_data``): a prompt taking the longest
cached prefix, a finished choice retired into the cache (and saved to host memory),
eviction, and bringing saved prefixes back. The engine (``workers.engines.llamacpp``)
schedules, decodes and samples; everything about which cell belongs to whom is here.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

import llama_cpp as lc

from workers.engines.prefix_cache import HostCache, HostEntry, PrefixTree

logger = logging.getLogger(__name__)


class KvCells:
    """Sequence ids and the cells they hold, in llama.cpp's KV and in the prefix tree.

    ``n_seq_ids`` ids exist; at most the engine's capacity are *running* (a choice being
    prefilled or decoded), the rest hold finished choices' KV for later prompts when
    ``prefix_cache`` (else a finished choice's cells are freed at once)."""

    def __init__(
        self,
        ctx: Any,
        *,
        n_ctx: int,
        n_seq_ids: int,
        prefix_cache: bool,
        block: int,
        cache_ram_bytes: int,
        hot_cells: int,
    ) -> None:
        self.ctx = ctx
        self.mem = lc.llama_get_memory(ctx)
        self.n_ctx = n_ctx
        self.n_seq_ids = n_seq_ids
        self.prefix_cache = prefix_cache
        self.free_ids = list(range(n_seq_ids - 1, -1, -1))
        self.running = 0  # sequence ids held by running choices
        self.tree = PrefixTree(block=block)  # every sequence's KV cells
        self.host = HostCache(cache_ram_bytes) if prefix_cache and cache_ram_bytes else None
        self.hot_cells = hot_cells
        self.restored_tokens = 0  # prompt tokens brought back from host memory, since start
        # Prompt tokens looked up in the prefix cache, and found (for the hit rate).
        self.queried = 0
        self.hits = 0

    # -- what the engine asks ---------------------------------------------------------

    @property
    def pinned(self) -> int:
        """Cells held by running sequences (the rest is the prefix cache's)."""
        return self.tree.cells - self.tree.evictable()

    def peek(self, scope: str, tokens: list[int]) -> int:
        """How much of ``tokens`` a prefill would take from the KV now."""
        if not self.prefix_cache:
            return 0
        return self.tree.match(scope, tokens, limit=len(tokens) - 1).length

    def stats(self) -> dict[str, float]:
        cached = self.tree.evictable()
        pinned = self.tree.cells - cached
        return {
            "cache_usage": pinned / self.n_ctx if self.n_ctx else 0.0,
            "prefix_cache_cells": float(cached),
            "prefix_cache_queries": float(self.queried),
            "prefix_cache_hits": float(self.hits),
            "prefix_cache_evicted": float(self.tree.evicted),
        }

    def prefix_blocks(self) -> frozenset[bytes] | None:
        """Every prefix in the KV (running and cached sequences) or in host memory."""
        if not self.prefix_cache:
            return None
        names = self.tree.block_names()
        if self.host is not None:
            names |= self.host.block_names()
        return frozenset(names)

    def check(self) -> None:
        """Raise unless llama.cpp's KV holds, for every sequence id, exactly the cells
        the prefix tree says (positions 0 .. length-1), and no others. For tests."""
        live = self.tree.sequences
        for seq in range(self.n_seq_ids):
            lo = lc.llama_memory_seq_pos_min(self.mem, seq)
            hi = lc.llama_memory_seq_pos_max(self.mem, seq)
            n = self.tree.length(seq) if seq in live else 0
            want = (0, n - 1) if n else (-1, -1)
            if (lo, hi) != want:
                raise AssertionError(f"sequence {seq}: KV holds {lo}..{hi}, tree {want}")

    # -- sequences --------------------------------------------------------------------

    def take_id(self, scope: str) -> int:
        """A free sequence id for a running choice, evicting a cached sequence whole
        when every id is taken (there are ``n_seq_ids - capacity`` for the cache)."""
        seq = self.take_spare()
        assert seq is not None  # running sequences never exceed capacity
        self.tree.begin(seq, scope)
        self.running += 1
        return seq

    def start(self, scope: str, tokens: list[int], seqs: list[int]) -> int:
        """The prompt's longest cached prefix becomes ``seqs``' own cells (shared, not
        copied); how many tokens the prefill skips. At least the prompt's last token
        is decoded: its logits give the first sample."""
        if not self.prefix_cache:
            return 0
        m = self.tree.match(scope, tokens, limit=len(tokens) - 1)
        if self.host is not None:
            self._restore(scope, tokens, m.length, len(tokens) - 1)
            m = self.tree.match(scope, tokens, limit=len(tokens) - 1)
        self.queried += len(tokens)
        if not m.length or m.source is None:
            return 0
        for s in seqs:
            lc.llama_memory_seq_cp(self.mem, m.source, s, 0, m.length)
        for seq in self.tree.share(m, seqs):
            # A cached sequence whose every cell the new one now holds: its id is worth
            # more than it (removing it frees no cell).
            self._drop(seq)
        self.hits += m.length
        return m.length

    def extend(self, seqs: list[int], tokens: list[int]) -> None:
        """``seqs`` decoded ``tokens`` (their cells are in the KV now)."""
        self.tree.extend(seqs, tokens)

    def free(self, seq: int, scope: str, *, keep: bool) -> None:
        """A running choice is over: with ``keep`` (and a prefix cache) its cells stay
        cached (and are saved to host memory), else they are freed."""
        self.running -= 1
        if keep and self.prefix_cache and self.tree.length(seq):
            if self.host is not None:
                self._save(seq, scope)
            self.tree.retire(seq)
        else:
            self._drop(seq)

    # -- room -------------------------------------------------------------------------

    def make_room(self, n: int) -> None:
        """Evict cached prefixes, least recently used first, until ``n`` cells are free."""
        self._evict(lambda: self.n_ctx - self.tree.cells < n)

    def trim_hot(self) -> None:
        """With host memory: past ``hot_cells``, cached cells live in host memory only
        (every cell in the KV costs every step)."""
        if self.host is None:
            return
        excess = self.tree.evictable() - self.hot_cells
        if excess > 0:
            goal = self.tree.evicted + excess
            self._evict(lambda: self.tree.evicted < goal)

    def take_spare(self) -> int | None:
        """A sequence id for a moment (not a running one), freeing a cached one if needed."""
        if not self.free_ids:
            seq = self.tree.evict_entry()
            if seq is None:
                return None
            lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self.free_ids.append(seq)
        return self.free_ids.pop()

    def _drop(self, seq: int) -> None:
        lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.tree.drop(seq)
        self.free_ids.append(seq)

    def _evict(self, more: Callable[[], bool]) -> None:
        """Evict cached prefixes block by block, least recently used first, while
        ``more()`` says so and something is evictable."""
        while more():
            trims = self.tree.evict_block()
            if not trims:
                return
            for t in trims:
                lc.llama_memory_seq_rm(self.mem, t.seq, t.start, -1)
            live = self.tree.sequences
            for t in trims:
                if t.seq not in live and t.seq not in self.free_ids:
                    self.free_ids.append(t.seq)

    # -- host memory ------------------------------------------------------------------

    def _save(self, seq: int, scope: str) -> None:
        """Copy ``seq``'s KV to host memory, less the prefix other sequences hold (a
        temporary sequence id takes just the rest: ``seq_cp`` of a position range)."""
        assert self.host is not None
        tokens = self.tree.tokens(seq)
        base = self.tree.shared_length(seq)
        if base >= len(tokens):
            return
        src = seq
        tmp: int | None = None
        if base:
            tmp = self.take_spare()
            if tmp is None:
                return
            lc.llama_memory_seq_cp(self.mem, seq, tmp, base, -1)
            src = tmp
        try:
            size = lc.llama_state_seq_get_size(self.ctx, src)
            buf = (ctypes.c_uint8 * size)()
            if lc.llama_state_seq_get_data(self.ctx, buf, size, src) == size:
                self.host.put(HostEntry(scope, tokens, base, bytes(buf)))
        finally:
            if tmp is not None:
                lc.llama_memory_seq_rm(self.mem, tmp, -1, -1)
                self.free_ids.append(tmp)

    def _restore(
        self, scope: str, tokens: list[int], have: int, limit: int, depth: int = 0
    ) -> None:
        """Bring back from host memory a saved sequence that shares more of ``tokens``
        (up to ``limit``) than the KV's ``have``: it becomes a cached sequence the
        prefill then shares. A saved sequence that left out a prefix other sequences
        held needs that prefix in the KV first: from the KV, or restored the same way."""
        assert self.host is not None
        entry, n = self.host.match(scope, tokens, limit=limit)
        if entry is None or n < have + self.tree.block or n <= entry.base:
            return
        if entry.base:
            held = self.tree.match(scope, entry.tokens, limit=entry.base).length
            if held < entry.base and depth < 4:
                self._restore(scope, entry.tokens, held, entry.base, depth + 1)
        need = len(entry.tokens) - entry.base
        self.make_room(need)
        seq = self.take_spare()
        if seq is None:
            return
        prefix = self.tree.match(scope, entry.tokens, limit=entry.base)
        if prefix.length < entry.base or self.n_ctx - self.tree.cells < need:
            self.free_ids.append(seq)  # the prefix it leaves out is gone, or no room
            return
        blob = entry.blob
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if lc.llama_state_seq_set_data(self.ctx, buf, len(blob), seq) != len(blob):
            lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self.free_ids.append(seq)
            logger.warning("could not restore a cached prefix of %d tokens", len(entry.tokens))
            return
        self.tree.begin(seq, scope)
        if entry.base and prefix.source is not None:
            lc.llama_memory_seq_cp(self.mem, prefix.source, seq, 0, entry.base)
            for r in self.tree.share(prefix, [seq]):
                self._drop(r)
        self.tree.extend([seq], entry.tokens[entry.base :])
        self.tree.retire(seq)
        self.host.touch(entry)
        self.restored_tokens += len(entry.tokens) - entry.base
