"""Model cards read from synthetic HF-style directories (no hub, no real weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.errors import ModelError
from app.model_card import ModelCard, load_model_card, load_tokenizer

TOKENS = ["<s>", "</s>", "<|eot|>", "<|eom|>", "<pad>", "a", "b", "ab"]


def tokenizer_json(post_bos: bool = False) -> dict[str, Any]:
    """A tiny but valid BPE tokenizer.json with five special tokens."""
    vocab = {t: i for i, t in enumerate(TOKENS)}
    data: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(TOKENS[:5])
        ],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": ["a b"],
        },
    }
    if post_bos:
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}},
        }
    return data


def write_model(
    root: Path,
    *,
    config: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
    tok_config: dict[str, Any] | None = None,
    tokenizer: dict[str, Any] | None = None,
    jinja: str | None = None,
    name: str = "tiny-model",
) -> Path:
    path = root / name
    path.mkdir()
    files = {
        "config.json": config,
        "generation_config.json": generation,
        "tokenizer_config.json": tok_config,
        "tokenizer.json": tokenizer if tokenizer is not None else tokenizer_json(),
    }
    for file, data in files.items():
        if data is not None:
            (path / file).write_text(json.dumps(data))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


BASE_CONFIG = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096}


def test_reads_an_hf_directory(tmp_path: Path) -> None:
    path = write_model(
        tmp_path,
        config={**BASE_CONFIG, "eos_token_id": 1, "bos_token_id": 0, "vocab_size": 8},
        generation={"eos_token_id": [1, 2, 3]},
        tok_config={
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
            "eos_token": "<|eot|>",
            "pad_token": "<pad>",
            "add_bos_token": True,
            "chat_template": "{{ messages[0]['content'] }}",
        },
    )
    card = load_model_card(path)
    assert card.name == "tiny-model"
    assert card.path == path
    assert card.context_length == 4096
    # The tokenizer's EOS first, then config's, then generation_config's, no repeats.
    assert card.eos_token_ids == (2, 1, 3)
    assert card.eos_token == "<|eot|>"
    assert (card.bos_token, card.bos_token_id) == ("<s>", 0)
    assert (card.pad_token, card.pad_token_id) == ("<pad>", 4)
    assert card.add_bos_token is True
    assert card.chat_template == "{{ messages[0]['content'] }}"
    assert card.special_tokens == {t: i for i, t in enumerate(TOKENS[:5])}
    assert card.architecture == "LlamaForCausalLM"
    assert card.vocab_size == 8
    assert card.gguf_file is None
    assert not card.has_safetensors
    assert card.engines() == ("echo",)


def test_generation_config_with_several_eos_ids_and_no_tokenizer_eos(tmp_path: Path) -> None:
    path = write_model(
        tmp_path,
        config={**BASE_CONFIG, "eos_token_id": [1, 3]},
        generation={"eos_token_id": [3, 2, 1]},
    )
    card = load_model_card(path)
    assert card.eos_token_ids == (1, 3, 2)
    assert card.eos_token == "</s>"  # named from the first id


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: Path) -> None:
    path = write_model(
        tmp_path,
        config=BASE_CONFIG,
        tok_config={"chat_template": "from config"},
        jinja="from jinja file",
    )
    assert load_model_card(path).chat_template == "from jinja file"


def test_named_chat_templates_take_default(tmp_path: Path) -> None:
    path = write_model(
        tmp_path,
        config=BASE_CONFIG,
        tok_config={
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "plain"},
            ]
        },
    )
    assert load_model_card(path).chat_template == "plain"


def test_no_chat_template_is_none(tmp_path: Path) -> None:
    path = write_model(tmp_path, config=BASE_CONFIG)
    assert load_model_card(path).chat_template is None


def test_add_bos_from_the_post_processor(tmp_path: Path) -> None:
    path = write_model(
        tmp_path,
        config=BASE_CONFIG,
        tok_config={"bos_token": "<s>"},
        tokenizer=tokenizer_json(post_bos=True),
    )
    assert load_model_card(path).add_bos_token is True


def test_context_length_from_tokenizer_config_and_text_config(tmp_path: Path) -> None:
    a = write_model(tmp_path, name="a", config={}, tok_config={"model_max_length": 2048})
    assert load_model_card(a).context_length == 2048
    b = write_model(tmp_path, name="b", config={"text_config": {"max_position_embeddings": 512}})
    assert load_model_card(b).context_length == 512


def test_weights_are_detected(tmp_path: Path) -> None:
    path = write_model(
        tmp_path, config={**BASE_CONFIG, "quantization_config": {"quant_method": "exl2"}}
    )
    (path / "output.safetensors").write_bytes(b"")
    (path / "model.Q4_0.gguf").write_bytes(b"")
    card = load_model_card(path)
    assert card.has_safetensors and card.is_exl2
    assert card.gguf_file == "model.Q4_0.gguf"
    assert card.engines() == ("echo", "llamacpp", "exllamav2")


def test_load_tokenizer(tmp_path: Path) -> None:
    card = load_model_card(write_model(tmp_path, config=BASE_CONFIG))
    tokenizer = load_tokenizer(card)
    assert tokenizer.encode("ab<|eot|>", add_special_tokens=False).ids == [7, 2]


def test_prepared_card_round_trips(tmp_path: Path) -> None:
    card = load_model_card(
        write_model(tmp_path, config={**BASE_CONFIG, "eos_token_id": [1, 2]}, name="src")
    )
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "tokenrelay.json").write_text(card.to_card_json())
    again = load_model_card(moved)
    assert again.path == moved  # the card follows the directory
    assert again == card.model_copy(update={"path": moved})


def test_card_is_immutable(tmp_path: Path) -> None:
    card = load_model_card(write_model(tmp_path, config=BASE_CONFIG))
    with pytest.raises(ValueError):
        card.context_length = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"config.json": "{not json"}, "cannot read"),
        ({"config.json": "[1, 2]"}, "must hold a JSON object"),
        ({"config.json": json.dumps({"max_position_embeddings": "long"})}, "must be an integer"),
        ({"config.json": json.dumps({})}, "context length"),
        (
            {"config.json": json.dumps({**BASE_CONFIG, "eos_token_id": "two"})},
            "eos_token_id",
        ),
        (
            {"tokenizer_config.json": json.dumps({"eos_token": "<missing>"})},
            "not in the vocabulary",
        ),
        ({"tokenizer_config.json": json.dumps({"eos_token": 5})}, "eos_token must be"),
        ({"tokenizer_config.json": json.dumps({"chat_template": 3})}, "chat_template"),
        ({"tokenizer.json": json.dumps({"added_tokens": [{"id": "x"}]})}, "added_tokens"),
        ({"tokenrelay.json": json.dumps({"format": 99})}, "card format"),
        ({"tokenrelay.json": json.dumps({"format": 1, "name": "x"})}, "not a valid model card"),
    ],
)
def test_garbled_files_are_model_errors(
    tmp_path: Path, files: dict[str, str], message: str
) -> None:
    path = write_model(tmp_path, config=BASE_CONFIG)
    for name, text in files.items():
        (path / name).write_text(text)
    with pytest.raises(ModelError, match=message):
        load_model_card(path)


def test_missing_directory_and_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        load_model_card(tmp_path / "nope")
    path = write_model(tmp_path, config=BASE_CONFIG)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"no tokenizer\.json"):
        load_model_card(path)


def test_bad_tokenizer_json_is_a_model_error(tmp_path: Path) -> None:
    card = load_model_card(write_model(tmp_path, config=BASE_CONFIG))
    (card.path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(card)


def test_model_card_type_is_exported() -> None:
    assert ModelCard.model_config.get("frozen") is True
