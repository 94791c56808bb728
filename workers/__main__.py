"""``tokenrelay worker``: a Celery worker with the threads pool and one engine thread.

Equivalent to ``celery -A workers.celery_worker worker -P threads -c <slots> -Q <queues>``
with tokenrelay's defaults; extra arguments are passed to Celery.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenrelay worker", description=__doc__)
    parser.add_argument("--engine", choices=["echo", "llamacpp", "exllamav2"])
    parser.add_argument("--model", help="model name under models_dir, or a path")
    parser.add_argument("--slots", type=int, help="concurrent jobs (Celery threads)")
    parser.add_argument("--loglevel", default="INFO")
    args, rest = parser.parse_known_args(argv)

    from app import logs
    from broker.celery_app import worker_queues
    from workers.celery_worker import build_app

    # The environment, overridden by the command line; passed down explicitly.
    overrides = {
        "engine": args.engine,
        "model": args.model,
        "worker_slots": args.slots,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    settings = logs.settings_or_exit("worker", **given)
    if settings.log_format == "json":  # from here on (build_app keeps Celery to it)
        logs.configure("worker", args.loglevel, "json")
    app = build_app(settings)
    celery_args = [
        "worker",
        "-P",
        "threads",
        "-c",
        str(settings.worker_slots),
        "-Q",
        ",".join(
            worker_queues(
                settings.served_name,
                app.tokenrelay_worker_id,
                embeds=app.tokenrelay_embeds,
                shards=app.tokenrelay_shards,
                home=app.tokenrelay_home,
            )
        ),
        "--loglevel",
        args.loglevel,
        "-E",
        "--without-gossip",
        "--without-mingle",
        *rest,
    ]
    if not any(a in ("-n", "--hostname") or a.startswith("--hostname=") for a in rest):
        # Unique node names: several workers on one host must not collide in Flower.
        celery_args += ["-n", f"tokenrelay-{os.getpid()}@%h"]
    app.worker_main(celery_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
