"""What every blueprint of the app reads from it: the settings, the ``Runner`` and the
``ResponseService``.

A module of its own so that ``web.app`` (which registers the blueprints) and the
blueprints (which read these) do not import each other.
"""

from __future__ import annotations

from flask import Flask

from app.settings import Settings
from broker.response_service import ResponseService
from broker.runner import Runner
from web.connections import KeyConnections

SETTINGS = "tokenrelay.settings"
RUNNER = "tokenrelay.runner"
RESPONSES = "tokenrelay.responses"
CONNECTIONS = "tokenrelay.connections"


def runner_of(app: Flask) -> Runner:
    runner: Runner = app.extensions[RUNNER]
    return runner


def settings_of(app: Flask) -> Settings:
    s: Settings = app.extensions[SETTINGS]
    return s


def responses_of(app: Flask) -> ResponseService:
    service: ResponseService = app.extensions[RESPONSES]
    return service


def connections_of(app: Flask) -> KeyConnections:
    connections: KeyConnections = app.extensions[CONNECTIONS]
    return connections
