"""The exllamav2 worker's start-up, without a GPU (issue 15, items 1, 6 and the close of 5).

- Item 6: ``plan_startup`` refuses, before any weight loads, exactly the settings that
  ``ExLlamaV2DynamicGenerator.__init__`` would assert on after the load (checked against
  a literal copy of those asserts over a grid of models and settings), naming the
  settings to change.
- Item 1: a worker that would run unpaged (no flash-attn >= 2.5.7) refuses to start
  unless allowed, and says why; mode and capacity reach the start-up log.
- Item 5 (its ``close`` half): ``close`` drops the generator, model and cache and frees
  CUDA's cache. The shutdown order is tested in test_exllamav2_shutdown.py.

``from_model_dir`` runs here on a stand-in ``exllamav2`` package (config, model, cache,
tokenizer, generator classes with 0.3.2's constructor arguments) so that the order of
its steps — check, then load — is what is tested.
"""

from __future__ import annotations

import gc
import importlib.abc
import json
import logging
import sys
import types
import weakref
from pathlib import Path
from typing import Any, cast

import pytest

from app.errors import ModelError
from app.model_card import ModelCard
from app.settings import Settings
from tests.engines.exllamav2_standin import VOCAB, StandInDynamicGenerator, stand_in_api
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.exllamav2 import ExLlamaV2Engine
from workers.engines.exllamav2_startup import (
    ModelLimits,
    plan_startup,
    resolve_paged,
    unpaged_reason,
)

pytestmark = pytest.mark.unit  # fakes only: no engine weights, no server

# --- item 6: limits checked before the load ---------------------------------------------


def exllamav2_would_assert(
    max_seq_len: int, batch: int, chunk: int | None, paged: bool, cache_tokens: int
) -> bool:
    """ExLlamaV2DynamicGenerator.__init__'s asserts (v0.3.2 dynamic.py:365-408), after
    load_autosplit capped max_input_len at max_seq_len (model.py:535-536); config
    defaults max_input_len 2048, max_batch_size 1 (config.py:174-175); max_q_size 8."""
    max_input_len = min(2048, max_seq_len)
    if 8 * batch > 1 * max_input_len:
        return True
    if cache_tokens % 256:
        return True
    chunk_size = max_input_len if chunk is None else chunk
    if chunk is not None and chunk > max_input_len:
        return True
    return paged and chunk_size % 256 != 0


SEQ_LENS = [100, 255, 256, 1000, 1024, 2048, 4096, 131072]
BATCHES = [1, 16, 100, 128, 200, 256, 257, 512]
CHUNKS: list[int | None] = [None, 256, 1024, 2048, 4096]


@pytest.mark.parametrize("paged", [True, False])
def test_the_plan_refuses_exactly_what_exllamav2_would_assert_on_after_loading(
    paged: bool,
) -> None:
    accepted = refused = 0
    for max_seq_len in SEQ_LENS:
        for batch in BATCHES:
            for chunk in CHUNKS:
                model = ModelLimits(max_seq_len)
                try:
                    plan = plan_startup(
                        model,
                        cache_tokens=65000,
                        max_batch_size=batch,
                        max_chunk_size=chunk,
                        paged=paged,
                    )
                except ModelError:
                    refused += 1
                    # No chunk size at or below the one asked for would have worked.
                    options = [None, *range(256, (chunk or 256) + 1, 256)]
                    if not paged:
                        options += [min(chunk or max_seq_len, max_seq_len)]
                    assert all(
                        exllamav2_would_assert(max_seq_len, batch, c, paged, 65024) for c in options
                    ), (max_seq_len, batch, chunk)
                    continue
                accepted += 1
                assert plan.paged is paged
                assert plan.max_batch_size == (batch if paged else 1)
                assert not exllamav2_would_assert(
                    max_seq_len, plan.max_batch_size, plan.max_chunk_size, paged, plan.cache_tokens
                ), (max_seq_len, batch, chunk, plan)
                if chunk is not None:
                    assert plan.max_chunk_size is not None and plan.max_chunk_size <= chunk
    assert accepted and (refused or not paged)


def test_the_default_settings_fit_a_model_of_2048_tokens_or_more() -> None:
    settings = Settings()
    for max_seq_len in (2048, 8192, 131072):
        plan = plan_startup(
            ModelLimits(max_seq_len),
            cache_tokens=settings.exllamav2_cache_tokens,
            max_batch_size=settings.worker_slots * settings.max_n,
            max_chunk_size=settings.exllamav2_max_chunk_size,
            paged=True,
        )
        assert (plan.mode, plan.capacity, plan.max_chunk_size) == ("paged", 256, 1024)


def test_too_many_sequences_for_the_model_names_the_settings_and_the_limit() -> None:
    with pytest.raises(ModelError) as err:
        plan_startup(
            ModelLimits(131072),
            cache_tokens=65536,
            max_batch_size=32 * 16,
            max_chunk_size=1024,
            paged=True,
        )
    message = str(err.value)
    assert "before loading" in message
    assert "TOKENRELAY_WORKER_SLOTS x TOKENRELAY_MAX_N to at most 256" in message


def test_a_short_context_model_lowers_the_limit_and_the_chunk() -> None:
    model = ModelLimits(1000)  # max_input_len becomes 1000 at load
    with pytest.raises(ModelError, match="at most 125"):
        plan_startup(model, cache_tokens=8192, max_batch_size=256, max_chunk_size=1024, paged=True)
    plan = plan_startup(
        model, cache_tokens=8192, max_batch_size=125, max_chunk_size=1024, paged=True
    )
    assert plan.max_chunk_size == 768  # whole pages below 1000
    assert any("TOKENRELAY_EXLLAMAV2_MAX_CHUNK_SIZE 1024" in w for w in plan.warnings)


def test_a_model_shorter_than_a_page_cannot_run_paged() -> None:
    with pytest.raises(ModelError, match="TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED"):
        plan_startup(
            ModelLimits(200), cache_tokens=1024, max_batch_size=16, max_chunk_size=256, paged=True
        )
    plan = plan_startup(
        ModelLimits(200), cache_tokens=1024, max_batch_size=16, max_chunk_size=256, paged=False
    )
    assert (plan.capacity, plan.max_chunk_size) == (1, 200)


def test_soft_limits_are_warnings_with_numbers() -> None:
    plan = plan_startup(
        ModelLimits(32768), cache_tokens=4000, max_batch_size=64, max_chunk_size=1024, paged=True
    )
    assert plan.cache_tokens == 4096  # whole pages
    assert any("at most 16 of the 64 sequences" in w for w in plan.warnings)
    assert any("less than the model's context (32768" in w for w in plan.warnings)
    unpaged = plan_startup(
        ModelLimits(4096), cache_tokens=65536, max_batch_size=64, max_chunk_size=None, paged=False
    )
    assert any("61440 of the 65536 cache tokens are never used" in w for w in unpaged.warnings)


# --- item 1: paged or refuse -------------------------------------------------------------


def test_unpaged_is_refused_unless_allowed_and_the_reason_is_given() -> None:
    with pytest.raises(ModelError) as err:
        resolve_paged(
            None,
            has_paged_attention=False,
            no_flash_attn=False,
            allow_unpaged=False,
            installed_version=lambda: None,
        )
    assert "flash-attn is not installed" in str(err.value)
    assert "TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED=true" in str(err.value)
    assert "one sequence at a time" in str(err.value)
    allowed = resolve_paged(
        None,
        has_paged_attention=False,
        no_flash_attn=False,
        allow_unpaged=True,
        installed_version=lambda: None,
    )
    assert allowed is False
    assert resolve_paged(None, has_paged_attention=True, no_flash_attn=False, allow_unpaged=False)
    # Asking for paged attention that is not there is refused even when unpaged is allowed.
    with pytest.raises(ModelError):
        resolve_paged(True, has_paged_attention=True, no_flash_attn=True, allow_unpaged=True)
    # An explicit unpaged engine (benchmarks) is the caller's choice.
    assert not resolve_paged(
        False, has_paged_attention=True, no_flash_attn=False, allow_unpaged=False
    )


def test_the_reason_distinguishes_missing_old_broken_and_disabled_flash_attn() -> None:
    def reason(has: bool, disabled: bool, version: str | None) -> str:
        return unpaged_reason(
            has_paged_attention=has, no_flash_attn=disabled, flash_attn_version=version
        )

    assert reason(False, False, None) == "flash-attn is not installed"
    assert "2.5.6 is older than 2.5.7" in reason(False, False, "2.5.6")
    assert "could not import its paged kernels" in reason(False, False, "2.7.4.post1")
    assert "disabled for this model" in reason(True, True, "2.7.4.post1")


# --- from_model_dir on a stand-in exllamav2 package ---------------------------------------


class FakeExllama:
    """A stand-in ``exllamav2`` package: records the order of what ``from_model_dir``
    does, and builds a ``StandInDynamicGenerator`` that also runs the real asserts."""

    def __init__(self, *, has_paged: bool = True) -> None:
        self.events: list[str] = []
        self.generator_kwargs: dict[str, Any] = {}
        events = self.events
        kwargs_seen = self.generator_kwargs

        class Config:
            def __init__(self, model_dir: str) -> None:
                raw = json.loads((Path(model_dir) / "config.json").read_text())
                self.max_seq_len = raw["max_position_embeddings"]
                self.max_input_len = 2048
                self.max_batch_size = 1
                self.no_flash_attn = False
                self.vocab_size = VOCAB
                events.append("config")

            def arch_compat_overrides(self) -> None:
                events.append("arch_compat")

        class Model:
            def __init__(self, config: Config) -> None:
                self.config = config

            def load_autosplit(self, cache: Any, progress: bool = False) -> None:
                events.append("load")
                self.config.max_input_len = min(self.config.max_input_len, self.config.max_seq_len)

            def unload(self) -> None:
                events.append("unload")

        class Cache:
            def __init__(self, model: Model, max_seq_len: int, lazy: bool = False) -> None:
                self.model = model
                self.max_seq_len = max_seq_len

        class Tokenizer:
            eos_token_id = 2

            def __init__(self, config: Config) -> None:
                self.config = config

        class Generator(StandInDynamicGenerator):
            def __init__(
                self,
                *,
                model: Model,
                cache: Cache,
                tokenizer: Tokenizer,
                max_batch_size: int,
                max_chunk_size: int | None,
                paged: bool,
            ) -> None:
                kwargs_seen.update(
                    max_batch_size=max_batch_size, max_chunk_size=max_chunk_size, paged=paged
                )
                cfg = model.config
                assert max_batch_size * 8 <= cfg.max_batch_size * cfg.max_input_len  # dyn:368
                chunk = cfg.max_input_len if max_chunk_size is None else max_chunk_size
                assert chunk <= cfg.max_input_len  # dyn:399
                assert not paged or chunk % 256 == 0  # dyn:407
                assert cache.max_seq_len % 256 == 0  # dyn:389
                super().__init__(
                    cache_tokens=cache.max_seq_len,
                    max_seq_len=cfg.max_seq_len,
                    max_batch_size=max_batch_size,
                    paged=paged,
                )
                self.model, self.cache, self.tokenizer = model, cache, tokenizer

            def warmup(self) -> None:
                events.append("warmup")

        self.package = types.ModuleType("exllamav2")
        pkg: Any = self.package
        pkg.ExLlamaV2Config = Config
        pkg.ExLlamaV2 = Model
        pkg.ExLlamaV2Cache = pkg.ExLlamaV2Cache_Q8 = Cache
        pkg.ExLlamaV2Cache_Q6 = pkg.ExLlamaV2Cache_Q4 = Cache
        pkg.ExLlamaV2Tokenizer = Tokenizer
        self.attn: Any = types.ModuleType("exllamav2.attn")
        self.attn.has_flash_attn_with_paged = has_paged
        self.generator: Any = types.ModuleType("exllamav2.generator")
        self.generator.ExLlamaV2DynamicGenerator = Generator
        pkg.attn, pkg.generator = self.attn, self.generator

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setitem(sys.modules, "exllamav2", self.package)
        monkeypatch.setitem(sys.modules, "exllamav2.attn", self.attn)
        monkeypatch.setitem(sys.modules, "exllamav2.generator", self.generator)
        api_cls = type(stand_in_api())  # ExllamaApi, wherever it lives
        monkeypatch.setattr(api_cls, "load", classmethod(lambda cls: stand_in_api()))


class FakeTorch:
    """Just enough of ``torch`` for ``free_cuda_memory``."""

    def __init__(self) -> None:
        self.emptied = 0
        outer = self

        class Cuda:
            @staticmethod
            def is_available() -> bool:
                return True

            @staticmethod
            def empty_cache() -> None:
                outer.emptied += 1

        self.module: Any = types.ModuleType("torch")
        self.module.cuda = Cuda


def model_dir(tmp_path: Path, max_seq_len: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": max_seq_len}))
    return tmp_path


@pytest.fixture
def no_flash_attn_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("workers.engines.exllamav2_startup.flash_attn_version", lambda: None)


@pytest.mark.usefixtures("no_flash_attn_installed")
def test_an_unpaged_worker_refuses_before_loading_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeExllama(has_paged=False)
    fake.install(monkeypatch)
    with pytest.raises(ModelError, match="TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED"):
        ExLlamaV2Engine.from_model_dir(
            model_dir(tmp_path, 4096), cache_tokens=8192, max_batch_size=256
        )
    assert "load" not in fake.events and fake.events[:1] == ["config"]


@pytest.mark.usefixtures("no_flash_attn_installed")
def test_an_allowed_unpaged_worker_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeExllama(has_paged=False)
    fake.install(monkeypatch)
    with caplog.at_level(logging.INFO):
        engine = ExLlamaV2Engine.from_model_dir(
            model_dir(tmp_path, 4096), cache_tokens=8192, max_batch_size=256, allow_unpaged=True
        )
    assert (engine.mode, engine.capacity) == ("unpaged", 1)
    assert fake.generator_kwargs == {"max_batch_size": 1, "max_chunk_size": None, "paged": False}
    assert "runs unpaged, one sequence at a time: flash-attn is not installed" in caplog.text
    assert "unpaged attention, capacity 1 sequences" in caplog.text


def test_too_many_sequences_are_refused_before_loading_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeExllama()
    fake.install(monkeypatch)
    with pytest.raises(ModelError, match="at most 128"):
        ExLlamaV2Engine.from_model_dir(
            model_dir(tmp_path, 1024), cache_tokens=8192, max_batch_size=256, max_chunk_size=1024
        )
    assert "load" not in fake.events


def test_a_paged_engine_gets_the_planned_limits_and_close_lets_go_of_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeExllama()
    fake.install(monkeypatch)
    torch = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", torch.module)
    engine = ExLlamaV2Engine.from_model_dir(
        model_dir(tmp_path, 1000), cache_tokens=5000, max_batch_size=64, max_chunk_size=1024
    )
    assert fake.events == ["config", "arch_compat", "load", "warmup"]
    assert fake.generator_kwargs == {"max_batch_size": 64, "max_chunk_size": 768, "paged": True}
    assert (engine.mode, engine.capacity) == ("paged", 64)
    gen = engine.generator
    assert gen.max_total_tokens == 5120  # whole pages
    refs = [weakref.ref(o) for o in (gen, gen.model, gen.cache)]
    engine.submit(EngineJob("j", [1, 2, 3], [ChoiceJob(0, 4)]))
    engine.step()
    del gen
    engine.close()
    gc.collect()
    assert fake.events[-1] == "unload" and torch.emptied == 1
    assert [r() for r in refs] == [None, None, None]  # generator, model, cache all gone
    assert engine.generator is None and not engine.has_work()
    assert (engine.mode, engine.capacity) == ("paged", 64)  # still answers, from start-up
    engine.close()  # twice is harmless
    assert fake.events.count("unload") == 1


def test_from_card_passes_the_settings_through(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def capture(cls: Any, path: Path, **kwargs: Any) -> str:
        seen.update(kwargs, path=path)
        return "engine"

    monkeypatch.setattr(ExLlamaV2Engine, "from_model_dir", classmethod(capture))
    card = types.SimpleNamespace(has_safetensors=True, path=Path("/m"), eos_token_ids=[2], name="m")
    settings = Settings(
        worker_slots=8, max_n=4, exllamav2_allow_unpaged=True, exllamav2_max_chunk_size=512
    )
    ExLlamaV2Engine.from_card(cast(ModelCard, card), settings)
    assert seen["max_batch_size"] == 32 and seen["allow_unpaged"] is True
    assert seen["max_chunk_size"] == 512
    assert seen["cache_tokens"] == settings.exllamav2_cache_tokens


class _BrokenFlashAttn(importlib.abc.MetaPathFinder):
    """``import exllamav2`` failing as it does with a flash-attn wheel for another torch."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "exllamav2" or name.startswith("exllamav2."):
            raise ImportError(
                "/venv/lib/python3.12/site-packages/flash_attn_2_cuda.cpython-312-x86_64-"
                "linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"
            )
        return None


def test_a_flash_attn_that_does_not_load_is_named_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: an ABI-broken flash-attn makes ``import exllamav2`` raise an ImportError
    about an undefined symbol; the worker's start-up error says what it is and what to do."""
    for name in [m for m in sys.modules if m == "exllamav2" or m.startswith("exllamav2.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BrokenFlashAttn(), *sys.meta_path])
    with pytest.raises(ModelError, match="flash-attn is installed but does not load") as err:
        ExLlamaV2Engine.from_model_dir(
            model_dir(tmp_path, 4096), cache_tokens=8192, max_batch_size=8
        )
    assert "undefined symbol" in str(err.value) and "flash_attn_wheel.py" in str(err.value)
