"""Who may reuse whose cached prompt prefixes, decided in the web tier, and how the
cached count reaches ``usage``: no model, no Redis (the engine side is
tests/engines/test_llamacpp_prefix_cache.py)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from app.decoder import RequestDecoder
from app.errors import InvalidRequest
from app.intake import Endpoint, Intake
from app.messages import EngineFinish, TokenDelta
from app.model_card import ModelCard
from app.records import StopConditions, cache_scope
from app.settings import Settings

BODY = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def intake(card: ModelCard, **settings: object) -> Intake:
    return Intake.for_model(Settings(model=str(card.path), **settings), card)  # type: ignore[arg-type]


def test_no_salt_and_no_key_share_one_scope() -> None:
    assert cache_scope(None) == cache_scope(None, "") == ""


def test_salts_and_keys_give_distinct_scopes() -> None:
    scopes = {
        cache_scope("a"),
        cache_scope("b"),
        cache_scope(None, "k1"),
        cache_scope(None, "k2"),
        cache_scope("a", "k1"),
        # A salt that ends like a key must not collide with salt + key.
        cache_scope("a:k1"),
    }
    assert len(scopes) == 6 and "" not in scopes
    assert cache_scope("a", "k1") == cache_scope("a", "k1")
    assert "tenant-secret" not in cache_scope("tenant-secret")  # a digest goes to workers


def test_cache_salt_sets_the_record_scope(card: ModelCard) -> None:
    take = intake(card)
    plain = take.prepare(Endpoint.CHAT, BODY).record
    salted = take.prepare(Endpoint.CHAT, {**BODY, "cache_salt": "tenant-1"}).record
    assert plain.cache_scope == ""
    assert salted.cache_scope == cache_scope("tenant-1")


def test_an_empty_cache_salt_is_a_400(card: ModelCard) -> None:
    with pytest.raises(InvalidRequest) as info:
        intake(card).prepare(Endpoint.CHAT, {**BODY, "cache_salt": ""})
    assert info.value.param == "cache_salt"


def test_keys_share_prefixes_unless_isolated(card: ModelCard) -> None:
    shared = intake(card)
    assert shared.prepare(Endpoint.CHAT, BODY, owner="h1").record.cache_scope == ""
    isolated = intake(card, prefix_cache_per_key=True)
    one = isolated.prepare(Endpoint.CHAT, BODY, owner="h1").record.cache_scope
    two = isolated.prepare(Endpoint.CHAT, BODY, owner="h2").record.cache_scope
    assert one and two and one != two
    # Completions too, and the salt still splits one key's requests.
    text = {"prompt": "Hello", "max_tokens": 2}
    assert isolated.prepare(Endpoint.COMPLETIONS, text, owner="h1").record.cache_scope == one
    salted = isolated.prepare(Endpoint.CHAT, {**BODY, "cache_salt": "s"}, owner="h1")
    assert salted.record.cache_scope not in ("", one)


def test_usage_counts_cached_tokens_once_per_prompt(smollm_tokenizer: Tokenizer) -> None:
    prompts = [[1, 2, 3, 4], [1, 2, 5]]
    dec = RequestDecoder(
        smollm_tokenizer, prompts[0], StopConditions(), n=2, more_prompts=[prompts[1]]
    )
    assert "prompt_tokens_details" not in dec.usage  # an engine without a cache says nothing
    # Choices 0, 1 run on prompt 0 and 2, 3 on prompt 1; each reports its prompt's count.
    for choice, cached in ((0, 3), (1, 3), (2, 2), (3, 2)):
        dec.feed(TokenDelta(choice, [42], finish=EngineFinish.LENGTH, cached_tokens=cached))
    assert dec.usage["prompt_tokens"] == 7
    assert dec.usage["prompt_tokens_details"] == {"cached_tokens": 5}
