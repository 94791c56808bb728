"""``tokenrelay models``: the models served on the Redis, and forgetting one.

    tokenrelay models [list]          each model: live workers, engines, context, directory
    tokenrelay models remove NAME     forget a model whose workers are gone for good

A model is known from the entry its workers write (``broker.models``); it stays known
after its last worker stops (a model scaled to zero answers 503, not 404). ``remove``
deletes the entry: requests for it are 404 from then on, until a worker of it starts.
(``tokenrelay model list --served`` is the same listing.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import redis

from app.settings import Settings
from broker.connection import open_redis
from broker.models import catalog_of
from broker.registry import worker_registry


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenrelay models", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("list", help="the models served on the Redis (the default)")
    remove = commands.add_parser("remove", help="forget a model (its entry)")
    remove.add_argument("name")
    args = parser.parse_args(argv)
    settings = Settings()
    client, keys = open_redis(settings, max_connections=2)
    catalog = catalog_of(client, keys, worker_registry(client, keys), settings)
    try:
        if args.command == "remove":
            if not catalog.remove(args.name):
                print(f"tokenrelay models: no model {args.name!r} is known", file=sys.stderr)
                return 1
            print(f"forgot {args.name}")
            return 0
        entries, live = catalog.entries(), catalog.live()
    except redis.RedisError as exc:
        print(f"tokenrelay models: cannot reach Redis: {exc}", file=sys.stderr)
        return 1
    rows = [("NAME", "WORKERS", "ENGINES", "CONTEXT", "ALIASES", "DIRECTORY")]
    for name in catalog.known():
        entry = entries.get(name)
        workers = live.get(name, [])
        rows.append(
            (
                name,
                str(len(workers)),
                ",".join(sorted({w.engine for w in workers})) or "-",
                str(entry.context_length) if entry else "-",
                ",".join(catalog.aliases_of(name)) or "-",
                entry.model_dir if entry else "-",
            )
        )
    if len(rows) == 1:
        print("no model is served on this Redis")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
