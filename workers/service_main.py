"""The entry point shared by tokenrelay's loop processes (streamer, batch driver).

Parses ``--loglevel``, reads the settings from the environment, configures logging
once (``app.logs``: text or JSON lines), builds the service, and turns SIGTERM/SIGINT
into a graceful stop of its loop.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable
from typing import Protocol

from app import logs
from app.settings import Settings
from broker import tracing


class LoopService(Protocol):
    stopping: threading.Event

    def run(self) -> None: ...


def run_service(
    name: str,
    description: str,
    build: Callable[[Settings], LoopService],
    argv: list[str] | None = None,
) -> int:
    parser = argparse.ArgumentParser(prog=f"tokenrelay {name}", description=description)
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    settings = logs.settings_or_exit(name)
    logs.configure(name, args.loglevel, settings.log_format)
    tracing.start(name)
    service = build(settings)

    def _stop(_sig: int, _frame: object) -> None:
        service.stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    logging.getLogger(name).info("%s started", name)
    service.run()
    return 0
