"""What every blueprint of the app reads from it: the settings and the ``Runner``.

A module of its own so that ``web.app`` (which registers the blueprints) and the
blueprints (which read these) do not import each other.
"""

from __future__ import annotations

from flask import Flask

from app.settings import Settings
from broker.runner import Runner

SETTINGS = "tokenrelay.settings"
RUNNER = "tokenrelay.runner"


def runner_of(app: Flask) -> Runner:
    runner: Runner = app.extensions[RUNNER]
    return runner


def settings_of(app: Flask) -> Settings:
    s: Settings = app.extensions[SETTINGS]
    return s
