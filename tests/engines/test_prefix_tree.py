"""The prefix cache's bookkeeping (workers/engines/prefix_cache.py), without llama.cpp.

A reference model keeps what llama.cpp's unified KV cache does: every sequence id holds
a list of cell ids, ``seq_cp`` copies ids, ``seq_rm`` removes them, and a cell is in use
while any sequence holds it. Random operations must leave the tree agreeing with it.
"""

from __future__ import annotations

import random

import pytest

from app.prefix_blocks import BLOCK, block_names
from workers.engines.prefix_cache import HostCache, HostEntry, PrefixTree

pytestmark = pytest.mark.unit  # pure bookkeeping: no engine, no weights


class KvModel:
    """What the unified KV cache holds, cell by cell."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.token: dict[int, int] = {}
        self.scope: dict[int, str] = {}
        self._next = 0

    def begin(self, seq: int, scope: str) -> None:
        self.seqs[seq] = []
        self.scope[seq] = scope

    def cp(self, src: int, dst: int, length: int) -> None:
        self.seqs[dst] = list(self.seqs[src][:length])

    def add(self, seqs: list[int], tokens: list[int]) -> None:
        cells = []
        for t in tokens:
            self.token[self._next] = t
            cells.append(self._next)
            self._next += 1
        for s in seqs:
            self.seqs[s] += cells

    def rm(self, seq: int, start: int) -> None:
        del self.seqs[seq][start:]

    def tokens(self, seq: int) -> list[int]:
        return [self.token[c] for c in self.seqs[seq]]

    @property
    def used(self) -> int:
        return len({c for cells in self.seqs.values() for c in cells})

    def best(self, scope: str, prompt: list[int], limit: int) -> int:
        out = 0
        for s, cells in self.seqs.items():
            if self.scope[s] != scope:
                continue
            n = 0
            for c, t in zip(cells, prompt[:limit], strict=False):
                if self.token[c] != t:
                    break
                n += 1
            out = max(out, n)
        return out


def check(tree: PrefixTree, kv: KvModel) -> None:
    assert tree.cells == kv.used
    for s in tree.sequences:
        assert tree.tokens(s) == kv.tokens(s)
        assert tree.length(s) == len(kv.seqs[s])


def test_a_second_turn_reuses_the_first_and_extends_it() -> None:
    tree = PrefixTree()
    tree.begin(0, "m")
    tree.extend([0], [1, 2, 3, 4])
    tree.extend([0], [5])
    tree.retire(0)
    tree.begin(1, "m")
    m = tree.match("m", [1, 2, 3, 4, 5, 6, 7])
    assert (m.length, m.source) == (5, 0)
    redundant = tree.share(m, [1])
    assert redundant == [0]  # turn 1's whole path is held by turn 2 now
    assert tree.drop(0) == 0
    tree.extend([1], [6])
    assert tree.tokens(1) == [1, 2, 3, 4, 5, 6]
    assert tree.cells == 6


def test_a_partial_match_splits_the_node_and_keeps_the_rest() -> None:
    tree = PrefixTree()
    tree.begin(0, "m")
    tree.extend([0], [1, 2, 3, 4, 5])
    tree.retire(0)
    tree.begin(1, "m")
    m = tree.match("m", [1, 2, 9])
    assert m.length == 2
    assert tree.share(m, [1]) == []  # seq 0 still holds 3, 4, 5 alone
    tree.extend([1], [9])
    assert tree.tokens(0) == [1, 2, 3, 4, 5]
    assert tree.tokens(1) == [1, 2, 9]
    assert tree.cells == 6
    assert tree.evictable() == 3  # seq 0's own tail; 1, 2 are held by a running seq


def test_scopes_never_share() -> None:
    tree = PrefixTree()
    tree.begin(0, "a")
    tree.extend([0], [1, 2, 3])
    tree.retire(0)
    assert tree.match("b", [1, 2, 3, 4]).length == 0
    assert tree.match("a", [1, 2, 3, 4]).length == 3


def test_match_honours_the_limit() -> None:
    tree = PrefixTree()
    tree.begin(0, "m")
    tree.extend([0], [1, 2, 3])
    assert tree.match("m", [1, 2, 3], limit=2).length == 2


def test_siblings_share_their_prompt_then_branch() -> None:
    tree = PrefixTree()
    for s in (0, 1, 2):
        tree.begin(s, "m")
    tree.extend([0, 1, 2], [7, 8, 9])
    for s in (0, 1, 2):
        tree.extend([s], [10 + s])
    assert tree.cells == 6
    assert tree.tokens(2) == [7, 8, 9, 12]


def test_eviction_takes_the_least_recently_used_leaf_block_by_block() -> None:
    tree = PrefixTree(block=2)
    for s, toks in ((0, [1, 2, 3, 4]), (1, [1, 2, 5, 6, 7])):
        tree.begin(s, "m")
        m = tree.match("m", toks)
        tree.share(m, [s])
        tree.extend([s], toks[m.length :])
        tree.retire(s)
    assert tree.cells == 7
    trims = tree.evict_block()  # seq 0 is older: its tail [3, 4] goes first
    assert [(t.seq, t.start) for t in trims] == [(0, 2)]
    assert tree.cells == 5
    assert tree.evicted == 2
    # Seq 0 now ends inside the shared [1, 2]: its node is not a leaf, seq 1's is next.
    assert [(t.seq, t.start) for t in tree.evict_block()] == [(1, 3)]
    assert [(t.seq, t.start) for t in tree.evict_block()] == [(1, 2)]
    assert tree.sequences == {0, 1}
    # Both now end at the shared [1, 2]: one leaf with two holders, trimmed for both.
    trims = tree.evict_block()
    assert sorted((t.seq, t.start) for t in trims) == [(0, 0), (1, 0)]
    assert tree.sequences == set()  # emptied cached sequences give their ids back
    assert tree.cells == 0
    assert tree.evict_block() == []


def test_running_sequences_are_never_evicted() -> None:
    tree = PrefixTree()
    tree.begin(0, "m")
    tree.extend([0], [1, 2, 3])
    assert tree.evictable() == 0
    assert tree.evict_block() == []
    assert tree.evict_entry() is None


def test_evict_entry_frees_the_least_recently_used_id() -> None:
    tree = PrefixTree()
    for s in (0, 1):
        tree.begin(s, "m")
        tree.extend([s], [s + 10, s + 20])
        tree.retire(s)
    tree.match("m", [10])  # a match alone does not refresh: only share and retire do
    assert tree.evict_entry() == 0
    assert tree.evicted == 2
    assert tree.sequences == {1}


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_agree_with_the_kv_model(seed: int) -> None:
    rnd = random.Random(seed)
    tree = PrefixTree(block=rnd.choice([1, 3, 8]))
    kv = KvModel()
    free = list(range(12))
    running: set[int] = set()
    vocab = [1, 2, 3]  # few ids: many shared and diverging prefixes
    for _ in range(300):
        op = rnd.random()
        if op < 0.3 and free:
            # A new job: 1-3 siblings take the longest cached prefix, prefill the rest.
            scope = rnd.choice("ab")
            k = min(len(free), rnd.randint(1, 3))
            seqs = [free.pop() for _ in range(k)]
            prompt = [rnd.choice(vocab) for _ in range(rnd.randint(1, 12))]
            for s in seqs:
                tree.begin(s, scope)
                kv.begin(s, scope)
            limit = len(prompt) - 1
            m = tree.match(scope, prompt, limit=limit)
            assert m.length == kv.best(scope, prompt, limit)
            for s in seqs:
                if m.length:
                    assert m.source is not None
                    kv.cp(m.source, s, m.length)
            for r in tree.share(m, seqs):
                kv.rm(r, 0)
                tree.drop(r)
                del kv.seqs[r]
                free.append(r)
            tree.extend(seqs, prompt[m.length :])
            kv.add(seqs, prompt[m.length :])
            running.update(seqs)
        elif op < 0.6 and running:
            s = rnd.choice(sorted(running))
            toks = [rnd.choice(vocab) for _ in range(rnd.randint(1, 4))]
            tree.extend([s], toks)
            kv.add([s], toks)
        elif op < 0.8 and running:
            s = rnd.choice(sorted(running))
            running.discard(s)
            if rnd.random() < 0.8:
                tree.retire(s)
            else:
                tree.drop(s)
                del kv.seqs[s]
                free.append(s)
        elif op < 0.93:
            before = tree.cells
            expected = tree.evictable()
            trims = tree.evict_block()
            for t in trims:
                kv.rm(t.seq, t.start)
            for s in list(kv.seqs):
                if s not in tree.sequences:
                    assert kv.seqs[s] == []
                    del kv.seqs[s]
                    free.append(s)
            assert (trims == []) == (expected == 0)
            assert tree.cells <= before
        else:
            s = tree.evict_entry()
            if s is not None:
                del kv.seqs[s]
                free.append(s)
        check(tree, kv)
        assert tree.cached.isdisjoint(running)
        assert tree.evictable() <= tree.cells
        # What the worker advertises: every full block of every sequence's tokens.
        assert tree.block_names(block=2) == {
            name for s in kv.seqs for name in block_names(kv.scope[s], kv.tokens(s), block=2)
        }


def test_shared_length_is_what_other_sequences_hold() -> None:
    tree = PrefixTree()
    tree.begin(0, "m")
    tree.extend([0], [1, 2, 3])
    tree.retire(0)
    tree.begin(1, "m")
    tree.share(tree.match("m", [1, 2, 9]), [1])
    tree.extend([1], [9, 9])
    assert tree.shared_length(1) == 2
    assert tree.shared_length(0) == 2
    tree.begin(2, "m")
    tree.extend([2], [5])
    assert tree.shared_length(2) == 0


def test_host_cache_matches_replaces_and_keeps_its_budget() -> None:
    host = HostCache(budget=10)
    host.put(HostEntry("m", [1, 2, 3], 0, b"aaa"))
    host.put(HostEntry("m", [1, 2, 3, 4, 5], 0, b"bbbb"))  # extends the first: replaces it
    assert len(host) == 1 and host.used == 4
    entry, n = host.match("m", [1, 2, 3, 4, 9])
    assert entry is not None and n == 4
    assert host.match("other", [1, 2, 3])[0] is None
    assert host.match("m", [1, 2, 3, 4, 5], limit=3)[1] == 3
    host.put(HostEntry("m", [7, 8], 0, b"cccc"))
    host.touch(entry)  # the first is now the more recent
    host.put(HostEntry("m", [6], 0, b"dddd"))  # over budget: [7, 8] goes
    assert host.used == 8
    assert host.match("m", [7, 8])[0] is None
    assert host.match("m", [1, 2])[0] is entry
    host.put(HostEntry("m", [5], 0, b"x" * 11))  # larger than the whole budget: not kept
    assert host.used == 8
    # An extension that leaves out more of the start cannot stand in for an entry.
    host.put(HostEntry("m", [1, 2, 3, 4, 5, 6], 2, b"e"))
    assert host.match("m", [1, 2, 3, 4, 5, 9])[0] is entry


def test_host_entries_name_their_blocks() -> None:
    host = HostCache(1000)
    tokens = list(range(130))
    host.put(HostEntry("m\n", tokens, 0, b"x"))
    assert host.block_names() == set(block_names("m\n", tokens))
    assert len(host.block_names()) == 130 // BLOCK  # full blocks only
    assert set(block_names("other\n", tokens)).isdisjoint(host.block_names())
