"""The models ``tokenrelay up`` serves: each ``--model`` resolved to the name it is
served as (a .gguf file prepared into the models directory first), each once, each
checked before any process starts, so that a missing model is one line of error rather
than a worker that exits at start."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

from app.prepare import (
    BUNDLED_MODEL_NAME,
    bundled_is_current,
    prepare_bundled_model,
    prepare_model_file,
)
from app.settings import Settings
from workers.up_options import UpError


def own_model(settings: Settings, model: str, say: Callable[[str], None]) -> str:
    """``model``, or for a path to a .gguf file the name it is served as once prepared
    into the models directory (``tokenrelay model add``)."""
    path = Path(model).expanduser()
    if path.suffix.lower() != ".gguf":
        return model
    if not path.is_file():
        raise UpError(f"model file {path} not found")
    say(f"preparing {path.name} in {settings.models_dir}")
    return prepare_model_file(path, settings.models_dir, progress=lambda m: say(f"  {m}")).name


def ensure_model(settings: Settings, say: Callable[[str], None]) -> None:
    """Prepare the bundled model if it is the one asked for and is missing; else check."""
    path = settings.card_path()
    if path.name == BUNDLED_MODEL_NAME and not bundled_is_current(settings.models_dir):
        say(f"preparing the bundled model in {settings.models_dir} (once)")
        prepare_bundled_model(settings.models_dir, progress=lambda m: say(f"  {m}"))
    elif not path.is_dir():
        raise UpError(
            f"model {settings.model!r} not found (looked in {path}); set TOKENRELAY_MODEL "
            "or TOKENRELAY_MODELS_DIR, or run `tokenrelay model prepare`"
        )
    if settings.engine == "llamacpp" and importlib.util.find_spec("llama_cpp") is None:
        raise UpError(
            "the llamacpp engine needs llama-cpp-python: pip install 'tokenrelay[cpu]' "
            "(or try `tokenrelay up --engine echo`)"
        )


def models_to_serve(
    settings: Settings, more: Sequence[str], say: Callable[[str], None]
) -> list[str]:
    """The settings' model, then each of ``more``, as they are served, each checked.

    Each once: a .gguf file and the name it is prepared as (``x.gguf``, ``x``) are one
    model, and a second set of workers for it would only double its memory."""
    models = list(dict.fromkeys(own_model(settings, m, say) for m in (settings.model, *more)))
    for model in models:
        ensure_model(settings.model_copy(update={"model": model}), say)
    return models
