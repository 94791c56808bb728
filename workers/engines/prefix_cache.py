"""Which KV cells hold which token prefixes: the llama.cpp engine's prefix cache.

Chat clients resend the whole conversation every turn. llama.cpp's unified KV cache
lets one cell belong to several sequence ids (``llama_memory_seq_cp`` only adds an id
to cells), so a new sequence can take the cells of any sequence that already decoded
the same token prefix and prefill only the rest. This module is the bookkeeping of
that, pure Python and tested without llama.cpp: the engine applies each decision with
``llama_memory_seq_cp`` / ``llama_memory_seq_rm`` and this tree mirrors the result.

The cells form a radix tree of token segments (SGLang's RadixAttention has the same
shape). A ``Node`` is a run of cells at consecutive positions; a sequence id's KV is
the path from its scope's root to its ``tail`` node, and every node on that path lists
it among its ``holders``. A node whose last holder leaves is freed by llama.cpp, so the
cells in use are exactly the tokens of the nodes in the tree.

Sequence ids are *running* (a choice being prefilled or decoded, owned by the engine)
or *cached* (a finished choice kept for its KV). Only cached ids are evicted: least
recently used leaf first, ``block`` tokens at a time from its end, so a conversation's
shared system prompt outlives the turns that diverge from it.

Reuse is decided by token ids, never text, and only within one *scope*: the engine
gives every job a scope naming its model and cache salt (and API key where the
deployment isolates keys), so a request never reads KV another scope decoded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from app.prefix_blocks import BLOCK, block_names, chain, scope_seed

__all__ = ["HostCache", "HostEntry", "Match", "Node", "PrefixTree", "Trim"]


class Node:
    """Cells at positions ``start .. start + len(tokens) - 1``, held by ``holders``."""

    __slots__ = ("children", "holders", "last_used", "parent", "start", "tokens")

    def __init__(self, tokens: list[int], start: int, parent: Node | None) -> None:
        self.tokens = tokens
        self.start = start
        self.parent = parent
        self.children: list[Node] = []
        self.holders: set[int] = set()
        self.last_used = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def path(self) -> Iterator[Node]:
        """This node and its ancestors up to (not including) the scope's root."""
        node: Node | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent


@dataclass(slots=True, frozen=True)
class Match:
    """The longest cached prefix of a prompt: ``length`` tokens held by ``source``."""

    length: int
    source: int | None  # a sequence id holding the cells; None when length is 0
    node: Node | None  # the deepest node matched (partly when length < node.end)


@dataclass(slots=True, frozen=True)
class Trim:
    """An eviction for the engine to apply: ``llama_memory_seq_rm(seq, start, -1)``."""

    seq: int
    start: int


class PrefixTree:
    """The radix tree of the KV cells of every sequence id (see the module doc)."""

    def __init__(self, *, block: int = 32) -> None:
        if block < 1:
            raise ValueError("block must be at least 1")
        self.block = block
        self._roots: dict[str, Node] = {}
        self._tail: dict[int, Node] = {}  # sequence id -> the last node of its path
        self._scope: dict[int, str] = {}
        self._cached: set[int] = set()
        self._clock = 0
        self.cells = 0  # cells in use: the tokens of every node in the tree
        self.evicted = 0  # cells freed by eviction, since start

    # -- sequences ----------------------------------------------------------------------

    def begin(self, seq: int, scope: str) -> None:
        """``seq`` starts with no cells, to run a job of ``scope``."""
        if seq in self._tail:
            raise ValueError(f"sequence {seq} is already in use")
        root = self._roots.get(scope)
        if root is None:
            root = self._roots[scope] = Node([], 0, None)
        self._tail[seq] = root
        self._scope[seq] = scope

    def length(self, seq: int) -> int:
        """Cells (positions 0 .. length-1) ``seq`` holds."""
        return self._tail[seq].end

    def tokens(self, seq: int) -> list[int]:
        """The token ids whose KV ``seq`` holds, in order (for tests and checks)."""
        out: list[int] = []
        for node in reversed(list(self._tail[seq].path())):
            out += node.tokens
        return out

    @property
    def sequences(self) -> set[int]:
        return set(self._tail)

    @property
    def cached(self) -> set[int]:
        return set(self._cached)

    def is_cached(self, seq: int) -> bool:
        return seq in self._cached

    # -- lookup and sharing ---------------------------------------------------------------

    def match(self, scope: str, tokens: Sequence[int], *, limit: int | None = None) -> Match:
        """The longest prefix of ``tokens`` (at most ``limit``) whose cells exist."""
        cap = len(tokens) if limit is None else min(limit, len(tokens))
        root = self._roots.get(scope)
        if root is None or cap <= 0:
            return Match(0, None, None)
        # Depth first over every child that matches: two sequences that decoded the
        # same tokens separately hold sibling nodes with equal starts, and the one that
        # matches less here may lead deeper.
        best: Node | None = None
        best_len = 0
        stack = [(root, 0)]
        while stack:
            node, pos = stack.pop()
            for child in node.children:
                n = _common(child.tokens, tokens, pos, cap)
                if n == 0:
                    continue
                if pos + n > best_len:
                    best, best_len = child, pos + n
                if n == len(child.tokens) and pos + n < cap:
                    stack.append((child, pos + n))
        if best is None:
            return Match(0, None, None)
        return Match(best_len, min(best.holders), best)

    def share(self, match: Match, seqs: Sequence[int]) -> list[int]:
        """``seqs`` (just begun, no cells) take the matched prefix's cells; the engine
        copies them with ``llama_memory_seq_cp(match.source, seq, 0, match.length)``.

        Returns the cached sequence ids made redundant (every cell they hold is now also
        held by ``seqs``): the engine frees their ids with ``llama_memory_seq_rm``,
        which frees no cell, and calls ``drop`` here."""
        if match.length == 0 or match.node is None:
            return []
        for seq in seqs:
            if self._tail[seq].parent is not None:
                raise ValueError(f"sequence {seq} already holds cells")
        node = match.node
        if match.length < node.end:
            node = self._split(node, match.length - node.start)
        self._clock += 1
        for n in node.path():
            n.holders.update(seqs)
            n.last_used = self._clock
        for seq in seqs:
            self._tail[seq] = node
        return [h for h in node.holders if h in self._cached and self._tail[h] is node]

    def extend(self, seqs: Sequence[int], tokens: Sequence[int]) -> None:
        """``tokens`` were just decoded into every one of ``seqs`` (which share one
        tail: siblings prefilling their prompt together, or a single sequence)."""
        if not tokens:
            return
        tail = self._tail[seqs[0]]
        if any(self._tail[s] is not tail for s in seqs[1:]):
            raise ValueError("sequences extended together must share their tail")
        holders = set(seqs)
        if tail.parent is not None and not tail.children and tail.holders == holders:
            tail.tokens.extend(tokens)
        else:
            node = Node(list(tokens), tail.end, tail)
            node.holders = holders
            node.last_used = self._clock
            tail.children.append(node)
            for s in seqs:
                self._tail[s] = node
        self.cells += len(tokens)

    def retire(self, seq: int) -> None:
        """``seq``'s job ended: keep its cells as a cache entry, most recently used."""
        self._clock += 1
        for n in self._tail[seq].path():
            n.last_used = self._clock
        self._cached.add(seq)

    def drop(self, seq: int) -> int:
        """``seq`` lets go of every cell (``llama_memory_seq_rm(seq, -1, -1)``); returns
        the cells freed (those no other sequence holds)."""
        freed = self._release(seq, 0)
        del self._tail[seq]
        del self._scope[seq]
        self._cached.discard(seq)
        return freed

    # -- eviction -------------------------------------------------------------------------

    def shared_length(self, seq: int) -> int:
        """How many of ``seq``'s first cells other sequences hold too (a system prompt
        that running conversations share): what a saved copy of it can leave out."""
        for node in self._tail[seq].path():
            if len(node.holders) > 1:
                return node.end
        return 0

    def evictable(self) -> int:
        """Cells held by cached sequences alone: what eviction can free."""
        total = 0
        for root in self._roots.values():
            stack = list(root.children)
            while stack:
                node = stack.pop()
                if node.holders <= self._cached:
                    total += _subtree_cells(node)
                else:
                    stack.extend(node.children)
        return total

    def evict_block(self) -> list[Trim]:
        """Free up to ``block`` cells from the least recently used cached leaf.

        Returns the trims to apply (empty when nothing is evictable). A cached sequence
        left with no cells is dropped; its id is free again."""
        leaf = self._lru_leaf()
        if leaf is None:
            return []
        cut = max(leaf.start, leaf.end - self.block)
        trims = [Trim(h, cut) for h in sorted(leaf.holders)]
        before = self.cells
        for t in trims:
            self._release(t.seq, cut)
        for t in trims:
            if self._tail[t.seq].parent is None:
                self.drop(t.seq)
        self.evicted += before - self.cells
        return trims

    def evict_entry(self) -> int | None:
        """Drop the least recently used cached sequence whole, to free its id; returns
        it (the engine applies ``llama_memory_seq_rm(seq, -1, -1)``), or None."""
        if not self._cached:
            return None
        seq = min(self._cached, key=lambda s: (self._tail[s].last_used, s))
        self.evicted += self.drop(seq)
        return seq

    # -- internals -------------------------------------------------------------------------

    def block_names(self, *, block: int = BLOCK) -> set[bytes]:
        """The names (``app.prefix_blocks``) of every full block on every sequence's
        path: what a prompt can take from the KV without prefilling it."""
        names: set[bytes] = set()
        for scope, root in self._roots.items():
            # (node, the name of the last full block above it, the tokens after that block)
            stack: list[tuple[Node, bytes, list[int]]] = [(root, scope_seed(scope), [])]
            while stack:
                node, previous, pending = stack.pop()
                run = pending + node.tokens
                full = len(run) - len(run) % block
                for i in range(0, full, block):
                    previous = chain(previous, run[i : i + block])
                    names.add(previous)
                rest = run[full:]
                stack.extend((child, previous, rest) for child in node.children)
        return names

    def _lru_leaf(self) -> Node | None:
        best: Node | None = None
        for seq in self._cached:
            node = self._tail[seq]
            if node.parent is None or node.children or not node.holders <= self._cached:
                continue
            if best is None or node.last_used < best.last_used:
                best = node
        return best

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` tokens; returns the new upper part (the
        lower part keeps its identity, so tails pointing at it stay right)."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.tokens)
        head = Node(node.tokens[:k], node.start, parent)
        head.holders = set(node.holders)
        head.last_used = node.last_used
        head.children = [node]
        parent.children[parent.children.index(node)] = head
        node.tokens = node.tokens[k:]
        node.start += k
        node.parent = head
        return head

    def _release(self, seq: int, start: int) -> int:
        """``seq`` lets go of its cells at positions ``start`` and beyond."""
        tail = self._tail[seq]
        if start >= tail.end:
            return 0
        node: Node | None = tail
        freed = 0
        while node is not None and node.parent is not None and node.end > start:
            if node.start < start:
                self._split(node, start - node.start)  # ``node`` is now the lower part
            upper = node.parent
            node.holders.discard(seq)
            if not node.holders:
                assert not node.children
                assert upper is not None
                upper.children.remove(node)
                freed += len(node.tokens)
            node = upper
        assert node is not None
        self._tail[seq] = node
        self.cells -= freed
        return freed


def _common(a: list[int], b: Sequence[int], offset: int, cap: int) -> int:
    """How many leading tokens of ``a`` equal ``b[offset:cap]``."""
    n = min(len(a), cap - offset)
    i = 0
    while i < n and a[i] == b[offset + i]:
        i += 1
    return i


def _subtree_cells(node: Node) -> int:
    total = 0
    stack = [node]
    while stack:
        n = stack.pop()
        total += len(n.tokens)
        stack.extend(n.children)
    return total


@dataclass(slots=True, eq=False)
class HostEntry:
    """A finished sequence's KV saved to host memory (``llama_state_seq_get_data``):
    the cells at positions ``base ..`` of ``tokens``; the first ``base`` are left out
    (other sequences held them) and must be in the KV again to restore it."""

    scope: str
    tokens: list[int]
    base: int
    blob: bytes
    last_used: int = 0
    # Its tokens' block names (``app.prefix_blocks``), what the worker advertises.
    names: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.names:
            self.names = block_names(self.scope, self.tokens)


class HostCache:
    """Saved sequences in host memory, least recently used out first past ``budget``
    bytes (llama-server's ``--cache-ram`` does the same for its slots).

    Why: every cell in llama.cpp's unified KV is scanned by every token of every step,
    so cached prefixes kept there slow every stream down. Here they cost memory only,
    and coming back costs a copy, not a prefill."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._entries: list[HostEntry] = []
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(
        self, scope: str, tokens: Sequence[int], *, limit: int | None = None
    ) -> tuple[HostEntry | None, int]:
        """The entry sharing the longest prefix with ``tokens`` (at most ``limit``)."""
        cap = len(tokens) if limit is None else min(limit, len(tokens))
        best: HostEntry | None = None
        best_n = 0
        for e in self._entries:
            if e.scope != scope:
                continue
            n = _common(e.tokens, tokens, 0, cap)
            if n > best_n:
                best, best_n = e, n
        return best, best_n

    def put(self, entry: HostEntry) -> None:
        """Keep ``entry``; entries of its scope whose tokens it extends go when it can
        stand in for them (it leaves out no more of the start than they do), then the
        least recently used past the budget."""
        if len(entry.blob) > self.budget:
            return
        n = len(entry.tokens)
        for e in list(self._entries):
            if (
                e.scope == entry.scope
                and len(e.tokens) <= n
                and entry.base <= e.base
                and e.tokens == entry.tokens[: len(e.tokens)]
            ):
                self._remove(e)
        self.touch(entry)
        self._entries.append(entry)
        self.used += len(entry.blob)
        while self.used > self.budget:
            self._remove(min(self._entries, key=lambda e: e.last_used))

    def block_names(self) -> set[bytes]:
        """The block names of every saved sequence."""
        return {name for e in self._entries for name in e.names}

    def touch(self, entry: HostEntry) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def _remove(self, entry: HostEntry) -> None:
        self._entries.remove(entry)
        self.used -= len(entry.blob)
