"""docs/configuration.md, rendered from the settings' field descriptions, so that the
page cannot drift from what the processes read (``tokenrelay config docs``; a test
compares the two)."""

from __future__ import annotations

import json

from app.settings import Settings


def settings_markdown() -> str:
    """Render docs/configuration.md from the field descriptions."""
    lines = [
        "# Configuration",
        "",
        "Every process reads one settings object from environment variables with the",
        "`TOKENRELAY_` prefix (lists as JSON, e.g. `TOKENRELAY_API_KEYS='[\"k1\"]'`).",
        "This page is generated from `app/settings.py` by `tokenrelay config docs`.",
        "",
        "| Variable | Default | Description |",
        "| --- | --- | --- |",
    ]
    for name, info in Settings.model_fields.items():
        if name == "models_dir":
            default = "(computed)"
        elif info.default_factory is not None:  # what the factory makes, as JSON ([] or {})
            default = f"`{json.dumps(info.default_factory())}`"  # type: ignore[call-arg]
        else:
            default = f"`{info.default!r}`" if info.default is not None else "(unset)"
        if name == "models_dir":
            default = "`$XDG_DATA_HOME/tokenrelay/models` (`~/.local/share/...`)"
        lines.append(f"| `TOKENRELAY_{name.upper()}` | {default} | {info.description} |")
    return "\n".join(lines) + "\n"
