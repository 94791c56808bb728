"""``POST /tokenize`` and ``/detokenize`` (issue 42): vLLM's request and response
shapes, llama.cpp's server's, the chat form that tokenizes exactly what a chat request's
prompt is, the round trip, the model a request names, and API keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from flask.testing import FlaskClient

from app.model_card import ModelCard, load_tokenizer
from broker.runner import Runner
from tests.web.conftest import RequestIds
from tests.web.test_openai_routes import error_of

pytestmark = pytest.mark.integration

TEXT = "Hello there, café <|im_end|> 東京 12345"


def ok(resp: Any) -> dict[str, Any]:
    assert resp.status_code == 200, resp.get_data(as_text=True)
    body: dict[str, Any] = resp.get_json()
    return body


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_a_prompt_tokenizes_as_the_model_s_tokenizer_does(
    client: FlaskClient, card: ModelCard, path: str
) -> None:
    want = load_tokenizer(card).encode(TEXT, add_special_tokens=False).ids
    body = ok(client.post(path, json={"prompt": TEXT, "return_token_strs": True}))
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == card.context_length
    assert len(body["token_strs"]) == len(want) and "<|im_end|>" in body["token_strs"]
    assert ok(client.post(path, json={"prompt": TEXT}))["token_strs"] is None


def test_detokenize_round_trips(client: FlaskClient) -> None:
    ids = ok(client.post("/tokenize", json={"prompt": TEXT}))["tokens"]
    body = ok(client.post("/detokenize", json={"tokens": ids}))
    assert body == {"prompt": TEXT, "content": TEXT}
    bad = client.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and error_of(bad)["param"] == "tokens"


def test_messages_tokenize_to_the_chat_prompt(
    client: FlaskClient, service: Runner, ids: RequestIds
) -> None:
    """The ids a chat request with these messages would send to the engine."""
    from app.intake import Endpoint

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    body = ok(client.post("/tokenize", json={"messages": messages}))
    prepared = service.prepare(Endpoint.CHAT, {"messages": messages})
    assert body["tokens"] == prepared.record.prompts[0]
    assert body["count"] == len(body["tokens"])
    open_turn = ok(
        client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    )
    assert open_turn["count"] < body["count"]


def test_llama_cpp_shapes(client: FlaskClient, card: ModelCard) -> None:
    tok = load_tokenizer(card)
    want = tok.encode(TEXT, add_special_tokens=False).ids
    assert ok(client.post("/tokenize", json={"content": TEXT})) == {"tokens": want}
    pieces = ok(client.post("/tokenize", json={"content": TEXT, "with_pieces": True}))["tokens"]
    assert [p["id"] for p in pieces] == want
    # A piece is text, or the bytes of part of a character (東京 is split across tokens).
    raw = b"".join(
        p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces
    )
    assert raw.decode() == TEXT and any(isinstance(p["piece"], list) for p in pieces)
    assert ok(client.post("/detokenize", json={"tokens": want}))["content"] == TEXT


def test_bad_bodies_and_unknown_models(client: FlaskClient) -> None:
    resp = client.post("/tokenize", json={"prompt": TEXT, "colour": 1})
    assert resp.status_code == 400 and "colour" in error_of(resp)["message"]
    resp = client.post("/tokenize", json={"prompt": TEXT, "model": "no-such-model"})
    assert resp.status_code == 404 and error_of(resp)["code"] == "model_not_found"
    assert client.post("/tokenize", data="x", content_type="text/plain").status_code == 415


def test_api_keys_apply(make_client: Callable[..., tuple[FlaskClient, Runner]]) -> None:
    client, _runner = make_client(api_keys=["k1"])
    for path in ("/tokenize", "/v1/tokenize", "/detokenize"):
        assert client.post(path, json={"prompt": "x", "tokens": [1]}).status_code == 401
    headers = {"Authorization": "Bearer k1"}
    assert client.post("/tokenize", json={"prompt": "x"}, headers=headers).status_code == 200
