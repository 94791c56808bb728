"""Constrained decoding through the real engine thread, llama.cpp engine and Redis.

What a client's request meets on a worker: a schema the engine cannot enforce (had the
web tier not checked it) ends every choice with a 400 naming the feature, and the engine
thread goes on to run a constrained request whose published tokens decode to a value
that validates.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.chat_template import PromptBuilder
from app.messages import EngineFinish
from app.model_card import load_model_card
from app.records import OutputConstraint, RequestRecord, SamplingParams, StopConditions
from broker.celery_app import TaskOutcome
from broker.publish import lease_value
from broker.requests import ClaimResult, RequestStore
from tests.engines.test_constrained import PERSON, validate
from workers.engine_thread import EngineThread
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.llamacpp import LlamaCppEngine
from workers.work_items import WorkItem

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def builder(models_dir: Path) -> PromptBuilder:
    return PromptBuilder.from_card(load_model_card(next(p for p in models_dir.iterdir())))


@pytest.fixture
def thread(models_dir: Path, store: RequestStore) -> Iterator[EngineThread]:
    card = load_model_card(next(p for p in models_dir.iterdir()))
    assert card.gguf_file is not None
    engine = LlamaCppEngine(card.path / card.gguf_file, n_ctx=2048, n_threads=2, capacity=4)
    t = EngineThread(engine, store, lease_ttl_s=10.0)
    t.start()
    yield t
    t.stop()
    t.join(10)
    engine.close()


def request(store: RequestStore, rid: str, prompt: list[int], schema: object, n: int) -> WorkItem:
    now = time.time()
    store.create(
        RequestRecord(
            request_id=rid,
            model="m",
            prompts=[prompt],
            stop=StopConditions(max_tokens=120, eos_token_ids=(2,)),
            n=n,
            created=now,
            deadline=now + 120,
        )
    )
    assert store.claim(rid, 0, "w", 10.0, now) is ClaimResult.OK
    constraint = OutputConstraint(kind="json_schema", json_schema=json.dumps(schema))
    job = EngineJob(
        job_id=f"{rid}/0",
        prompt_ids=prompt,
        choices=[ChoiceJob(i, 120) for i in range(n)],
        sampling=SamplingParams(temperature=1.0, seed=5, constraint=constraint),
        eos_token_ids=frozenset({2}),
    )
    return WorkItem(rid, 0, lease_value("w", 0), [job], deadline=now + 120)


def test_unenforceable_schema_is_a_400_and_the_thread_goes_on(
    thread: EngineThread, store: RequestStore, builder: PromptBuilder
) -> None:
    prompt = builder.encode_chat([{"role": "user", "content": "Describe a person."}])
    unique = {"type": "array", "uniqueItems": True}
    bad = thread.submit(request(store, "bad-schema", prompt, unique, n=2))
    assert bad.wait(30)
    finals = [d for _e, _a, ds in store.read_tokens("bad-schema") for d in ds if d.finish]
    assert sorted(d.choice for d in finals) == [0, 1]
    for d in finals:
        assert d.finish is EngineFinish.ERROR and d.error_code == 400
        assert "uniqueItems" in (d.error or "")

    good = thread.submit(request(store, "good-schema", prompt, PERSON, n=2))
    assert good.wait(120)
    assert thread.is_alive()
    assert good.result is not None and good.result.outcome is TaskOutcome.DONE
    for p in store.progress("good-schema", 2):
        assert p.finish is EngineFinish.EOS
        validate(json.loads(builder.tokenizer.decode(p.token_ids)), PERSON)
