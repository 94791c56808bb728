"""``/v1/embeddings`` end to end (issue 42): the openai SDK against a stack whose worker
embeds with llama.cpp's embedding mode on the bundled GGUF (the worker's generation
engine is echo; embeddings are llama.cpp's either way), and ``/tokenize`` then
``/detokenize`` round-tripping a prompt."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from tests.conftest import bundled_gguf
from tests.stack import Stack, full_stack, isolated_settings

pytest.importorskip("llama_cpp")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WIDTH = 576  # SmolLM2-135M's embedding length


@pytest.fixture(scope="module")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings("redis://unused", models_dir, llamacpp_threads=1)
    with full_stack(settings, tmp_path_factory.mktemp("embeddings-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0) as c:
        yield c


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_vectors_of_the_model_s_width_equal_llama_cpp_s(
    client: openai.OpenAI, stack: Stack
) -> None:
    import llama_cpp

    texts = ["The cat sat on the mat.", "A kitten rests on a rug.", "Bond yields rose today."]
    model = stack.settings.served_name
    got = client.embeddings.create(model=model, input=texts)  # base64, the SDK's default
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == model
    vectors = [d.embedding for d in got.data]
    assert {len(v) for v in vectors} == {WIDTH}
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(texts)
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    floats = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)
    llm = llama_cpp.Llama(
        str(bundled_gguf()),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_threads=1,
        verbose=False,
    )
    try:
        want = llm.embed(texts)
    finally:
        llm.close()
    for mine, theirs in zip(vectors, want, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-4)


def test_token_id_inputs_and_bad_requests(client: openai.OpenAI, stack: Stack) -> None:
    model = stack.settings.served_name
    ids = requests.post(
        f"{stack.base_url}/tokenize", json={"prompt": "The cat sat on the mat."}, timeout=10
    ).json()["tokens"]
    by_text = client.embeddings.create(model=model, input="The cat sat on the mat.")
    by_ids = client.embeddings.create(model=model, input=[ids])
    assert by_ids.data[0].embedding == pytest.approx(by_text.data[0].embedding, abs=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="x", dimensions=64)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=model, input="")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def test_models_say_which_embed(client: openai.OpenAI, stack: Stack) -> None:
    (model,) = client.models.list().data
    assert model.model_extra is not None
    assert model.model_extra["capabilities"] == ["completion", "embedding"]


def test_tokenize_then_detokenize_round_trips_a_prompt(stack: Stack) -> None:
    prompt = "Round trip: café, 東京, <|im_end|> and 12345."
    tokens = requests.post(f"{stack.base_url}/tokenize", json={"prompt": prompt}, timeout=10)
    ids = tokens.json()["tokens"]
    back = requests.post(f"{stack.base_url}/detokenize", json={"tokens": ids}, timeout=10)
    assert back.json()["prompt"] == prompt
