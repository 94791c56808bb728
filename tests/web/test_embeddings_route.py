"""``/v1/embeddings`` in the web tier (issue 42): the request checked before anything is
sent, and a model none of whose live workers embeds answered 503 at once."""

from __future__ import annotations

import pytest
from flask.testing import FlaskClient

from tests.web.test_openai_routes import error_of

pytestmark = pytest.mark.integration


def test_no_embedding_worker_is_a_503_at_once(client: FlaskClient) -> None:
    resp = client.post("/v1/embeddings", json={"input": "hello"})
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert error_of(resp)["code"] == "no_embedding_worker"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[10**9]]}, "input"),
        ({"input": "x", "colour": 1}, "colour"),
    ],
)
def test_bad_requests_name_the_field(client: FlaskClient, body: dict, param: str) -> None:
    resp = client.post("/v1/embeddings", json=body)
    assert resp.status_code == 400 and error_of(resp)["param"] == param


def test_an_input_longer_than_the_model_can_embed(client: FlaskClient) -> None:
    resp = client.post("/v1/embeddings", json={"input": [[5] * 9000]})
    assert resp.status_code == 400 and error_of(resp)["code"] == "context_length_exceeded"
