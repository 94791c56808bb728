"""Names for cached prompt prefixes that every process computes alike.

A worker whose engine keeps a prefix cache advertises which prompt prefixes it can
start from; the web tier sends a conversation's next turn to the worker that holds the
most of it (``broker.prefix_routes``). Both sides name a prefix the same way: the
prompt's token ids cut into blocks of ``BLOCK``, each block's name a hash of its tokens
chained to the name of the block before it, the first chained to the job's scope
(``RequestRecord.engine_scope``: the model and the request's cache scope). So a block's
name stands for the whole prefix that ends with it, in that scope only, and "the first k
names of this prompt are in that worker's set" means "that worker holds these k x BLOCK
tokens". A partial block at the end is never named.

blake2b, not Python's ``hash``: the names must agree across processes and machines.
Eight bytes each: a false match costs one misrouted turn (a cold prefill), never a
wrong answer, since the engine decides reuse by comparing token ids itself.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

__all__ = ["BLOCK", "block_names", "chain", "scope_seed"]

# Tokens per named block: the llama.cpp engine's eviction block. Routing must tell
# apart two conversations that share a system prompt by their first turn alone (a
# question and a short reply are often under 64 tokens); finer blocks grow the sets.
BLOCK = 32

_DIGEST = 8


def scope_seed(scope: str) -> bytes:
    """The name the first block of a prompt in ``scope`` is chained to."""
    return blake2b(scope.encode(), digest_size=_DIGEST, person=b"tr-scope").digest()


def chain(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The name of the block ``tokens`` that follows the block named ``previous``."""
    data = array("q", tokens).tobytes()
    return blake2b(previous + data, digest_size=_DIGEST, person=b"tr-block").digest()


def block_names(scope: str, tokens: Sequence[int], *, block: int = BLOCK) -> list[bytes]:
    """The names of the full blocks of ``tokens`` in ``scope``, first block first."""
    names: list[bytes] = []
    previous = scope_seed(scope)
    for start in range(0, len(tokens) - block + 1, block):
        previous = chain(previous, tokens[start : start + block])
        names.append(previous)
    return names
