"""Two models behind one web tier (issue 41): real processes (redis-server, a worker per
model with the echo engine, a streamer, the batch driver, gunicorn), one client per API.

Each model's requests are answered by its own worker: the workers' token counters (their
heartbeats) grow by exactly the completion tokens of their own model's requests, and the
other model's stay still. The echo engine repeats the last user message, so every text
is known exactly."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from broker.celery_app import queue_name
from broker.keys import Keys
from broker.registry import worker_registry
from tests.e2e.test_batches import jsonl, poll, upload
from tests.e2e.test_websocket import ChatClient, ws_url
from tests.stack import Stack, full_stack, isolated_settings, start_model_worker, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODELS = ("model-a", "model-b")


@pytest.fixture(scope="module")
def two(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings("redis://unused", models_dir, web_workers=1, web_threads=16)
    with full_stack(
        settings, tmp_path_factory.mktemp("models-logs"), workers=(), batcher=True
    ) as running:
        for model in MODELS:
            start_model_worker(running, model)
        yield running


def flower_queues(flower: str, auth: str) -> set[str]:
    """The queue names Flower's broker page lists (``/api/queues/length``): every queue
    of its known workers, so the workers are asked for first (its Workers page's
    refresh), as a worker started after Flower is known only from then on."""
    from tests.upstack import get

    get(flower + "api/workers?refresh=1", auth)
    status, body = get(flower + "api/queues/length", auth)
    return {q["name"] for q in json.loads(body)["active_queues"]} if status == 200 else set()


def tokens_by_model(stack: Stack) -> dict[str, int]:
    live = worker_registry(stack.redis(), Keys(stack.settings.key_prefix)).live()
    return {w.model: w.tokens_total for w in live}


def every_api(two: Stack, client: openai.OpenAI, model: str) -> int:
    """One request of each API for ``model``, texts checked; the completion tokens."""
    used = 0
    text = f"Hello from {model}, said plainly."
    # JSON and SSE.
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}]
    )
    assert reply.model == model and reply.choices[0].message.content == text
    assert reply.usage is not None
    used += reply.usage.completion_tokens
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        parts += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == text and usage is not None
    used += usage.completion_tokens
    # Responses.
    response = client.responses.create(model=model, input=text)
    assert response.model == model and response.output_text == text
    assert response.usage is not None
    used += response.usage.output_tokens
    # WebSocket.
    ws = ChatClient(ws_url(two))
    try:
        ws.chat("w1", text, model=model)
        ws.wait_done("w1")
        got = ws.reply("w1")
        assert not got.errors and "".join(d["text"] for d in got.deltas) == text
        used += got.usage["completion_tokens"]
    finally:
        ws.close()
    # A batch of two lines.
    lines = [
        json.dumps(
            {
                "custom_id": f"{model}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": text}]},
            }
        )
        for i in range(2)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch, _ = poll(client, batch.id)
    assert batch.status == "completed", two.logs()
    for line in jsonl(client, batch.output_file_id):
        out = line["response"]["body"]
        assert out["model"] == model and out["choices"][0]["message"]["content"] == text
        used += out["usage"]["completion_tokens"]
    return used


def test_each_api_reaches_its_own_model_s_worker_with_exact_text(two: Stack) -> None:
    with openai.OpenAI(base_url=two.base_url + "/v1", api_key="x", max_retries=0) as client:
        listed = {m.id for m in client.models.list().data}
        assert set(MODELS) <= listed, listed
        for model in MODELS:
            check_model(two, client, model)


def check_model(two: Stack, client: openai.OpenAI, model: str) -> None:
    """Every API for ``model``; its worker counts exactly their tokens, the other none."""
    before = tokens_by_model(two)
    used = every_api(two, client, model)
    wanted = {m: before[m] + (used if m == model else 0) for m in MODELS}
    wait_for(
        lambda: tokens_by_model(two) == wanted,
        10,
        f"{model}'s worker to count its {used} tokens, the other none",
        interval=0.2,
    )


def test_an_unknown_model_is_404_and_a_model_without_workers_503_at_once(two: Stack) -> None:
    url = two.base_url + "/v1/chat/completions"
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    resp = requests.post(url, json={**body, "model": "no-such-model"}, timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    # The web tier's default model has no worker here (only model-a and model-b do).
    t0 = time.monotonic()
    resp = requests.post(url, json=body, timeout=10)
    assert resp.status_code == 503 and time.monotonic() - t0 < 1.0
    assert resp.headers["Retry-After"] == "1"


def test_the_models_command_lists_what_is_served(two: Stack) -> None:
    import subprocess
    import sys

    from tests.stack import child_env

    out = subprocess.run(
        [sys.executable, "-m", "broker.models_cli", "list"],
        env=child_env(two.settings),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert set(MODELS) <= set(rows), out
    assert rows["model-a"][1:3] == ["1", "echo"]  # one live worker, its engine


@pytest.mark.timeout(180)
def test_up_serves_every_model_it_is_given(tmp_path: Path, models_dir: Path) -> None:
    """``tokenrelay up --engine echo --model alpha --model beta``: a worker per model
    (echo names speak with the bundled tokenizer), one web tier for both."""
    import signal

    from tests.upstack import start_up

    run = start_up(tmp_path, models_dir, "--model", "alpha", "--model", "beta")
    try:
        urls = run.wait_ready(150)["urls"]
        assert "'alpha', 'beta'" in run.output()
        assert {"worker", "worker-beta"} <= set(run.state()["children"])
        with openai.OpenAI(base_url=urls["api"], api_key="x", max_retries=0) as client:
            assert {m.id for m in client.models.list().data} == {"alpha", "beta"}
            for model in ("alpha", "beta"):
                reply = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"to {model}"}]
                )
                assert reply.model == model and reply.choices[0].message.content == f"to {model}"
        # Flower shows each model's queues (its workers consume them).
        want = {queue_name(kind, m) for kind in ("interactive", "batch") for m in ("alpha", "beta")}
        wait_for(lambda: want <= flower_queues(urls["flower"], run.flower_auth()), 30, "queues", 1)
        run.popen.send_signal(signal.SIGTERM)
        assert run.wait_exit(60) == 0, run.logs()
    finally:
        run.cleanup()


@pytest.mark.timeout(180)
def test_up_serves_a_gguf_file_beside_another_vocabulary(tmp_path: Path, models_dir: Path) -> None:
    """``tokenrelay up --model FILE.gguf --model alpha``: the file is prepared and served
    under its name with its own SentencePiece vocabulary, beside alpha (the bundled
    byte-level BPE one), behind one web tier; both texts exact."""
    import shutil
    import signal

    import llama_cpp

    from tests.test_gguf_spm import write_spm_gguf
    from tests.upstack import start_up

    gguf = tmp_path / "Spm-Vocab.gguf"
    write_spm_gguf(gguf, add_space_prefix=True)
    models = tmp_path / "models"
    shutil.copytree(models_dir, models, symlinks=True)  # the bundled model, and room
    run = start_up(tmp_path, models, "--model", str(gguf), "--model", "alpha")
    try:
        urls = run.wait_ready(150)["urls"]
        assert (models / "Spm-Vocab" / "tokenizer.json").is_file()
        with openai.OpenAI(base_url=urls["api"], api_key="x", max_retries=0) as client:
            assert {m.id for m in client.models.list().data} == {"Spm-Vocab", "alpha"}
            text = "Hello there, café 東京 and more"
            done = client.completions.create(model="Spm-Vocab", prompt=text, max_tokens=64)
            # The echo of the prompt's ids as a continuation: the text llama.cpp's server
            # gives for them (each piece as it is, the first one's space included).
            llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
            try:
                ids = llm.tokenize(text.encode(), add_bos=False, special=False)
                want = llm.detokenize(ids).decode()
            finally:
                llm.close()
            assert want == " " + text and done.choices[0].text == want
            reply = client.chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": text}]
            )
            assert reply.choices[0].message.content == text
        run.popen.send_signal(signal.SIGTERM)
        assert run.wait_exit(60) == 0, run.logs()
    finally:
        run.cleanup()


def llama_cpp_greedy(gguf: Path, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    """llama.cpp's own greedy continuation of ``prompt`` (BOS as the vocabulary says,
    special tokens parsed, as llama.cpp's server tokenizes a prompt), and its
    ``llama_detokenize`` of those ids."""
    import llama_cpp

    from tests.test_gguf_gemma import detokenize

    llm = llama_cpp.Llama(str(gguf), n_ctx=512, n_threads=1, seed=0, verbose=False)
    try:
        prompt_ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        ids: list[int] = []
        eog = llama_cpp.llama_vocab_is_eog
        vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0):
            if eog(vocab, token) or len(ids) == max_tokens:
                break
            ids.append(token)
        return ids, detokenize(llm, ids, special=False)
    finally:
        llm.close()


@pytest.mark.timeout(300)
def test_up_serves_gemma_beside_the_bundled_model(
    tmp_path: Path, models_dir: Path, gemma_gguf: Path
) -> None:
    """``tokenrelay up --model gemma-3-270m-q4_k_m.gguf --model SmolLM2-135M-Instruct`` on
    the llamacpp engine: two real models, two vocabularies (SentencePiece, byte-level
    BPE), two templates (ChatML by llama.cpp's default, SmolLM2's own), one web tier.
    Gemma's greedy text is llama.cpp's own detokenization of llama.cpp's greedy ids."""
    import shutil
    import signal

    from tests.upstack import start_up

    models = tmp_path / "models"
    shutil.copytree(models_dir, models, symlinks=True)
    prompt = "The three primary colours are"
    want_ids, want = llama_cpp_greedy(gemma_gguf, prompt, 24)
    run = start_up(
        tmp_path,
        models,
        "--engine",
        "llamacpp",
        "--model",
        str(gemma_gguf),
        "--model",
        "SmolLM2-135M-Instruct",
        TOKENRELAY_LLAMACPP_THREADS="1",
    )
    try:
        urls = run.wait_ready(240)["urls"]
        gemma = gemma_gguf.stem
        with openai.OpenAI(base_url=urls["api"], api_key="x", max_retries=0) as client:
            assert {m.id for m in client.models.list().data} == {gemma, "SmolLM2-135M-Instruct"}
            done = client.completions.create(
                model=gemma, prompt=prompt, max_tokens=24, temperature=0
            )
            assert done.usage is not None and done.usage.completion_tokens == len(want_ids)
            assert done.choices[0].text == want, (want_ids, want)
            streamed = "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model=gemma, prompt=prompt, max_tokens=24, temperature=0, stream=True
                )
                if c.choices
            )
            assert streamed == want
            for model in (gemma, "SmolLM2-135M-Instruct"):
                reply = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Name a colour."}],
                    max_tokens=8,
                    temperature=0,
                )
                assert reply.model == model and reply.choices[0].finish_reason in ("stop", "length")
                assert reply.usage is not None and reply.usage.completion_tokens > 0
        run.popen.send_signal(signal.SIGTERM)
        assert run.wait_exit(60) == 0, run.logs()
    finally:
        run.cleanup()
