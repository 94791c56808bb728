"""The streamer's decode of one engine step, alone: no Redis round trip, hot caches.

    python benchmarks/streamer_decode.py [--requests 64] [--steps 2000] [--models-dir DIR]

Why: in the paced relay run (``relay.py --stage relay --rate 200``) the streamer's decode
of a step's 64 requests is the largest part of the chain each step goes through in turn
(docs/benchmarks-log.md, issue 12 session 19). This times exactly that code, the real
``Streamer`` taking a worker step entry's lines (``_take_steps``) and decoding each
request's chunk into its output entry (``_decode_all``: for these plain requests the
Decoder, the text chunk's codec and the chunk log), with the bundled model's tokenizer, one token
per request per step, and prints the p10 and p50 of a step's decode in µs and per
request. A private redis-server is started only because a ``Streamer`` is built with a
client; nothing is read or written during the timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import redis
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.decoder import RequestDecoder
from app.messages import TokenDelta
from app.prepare import prepare_bundled_model
from broker.celery_app import create_celery
from broker.publish import encode_deltas
from broker.server import RedisServer
from tests.stack import isolated_settings, make_record
from workers.streamer import Streamer
from workers.streamer_state import Tracked

TEXT = " the quick brown fox jumps over the lazy dog and runs back to the barn at night"


def measure(models_dir: Path, requests: int, steps: int) -> dict[str, float]:
    with RedisServer() as server:
        settings = isolated_settings(server.url, models_dir)
        tokenizer = Tokenizer.from_file(str(next(models_dir.rglob("tokenizer.json"))))
        streamer = Streamer(
            settings, redis.Redis.from_url(server.url), tokenizer, create_celery(settings)
        )
        step_key = streamer.keys.steps("w1")
        records = [make_record(settings, [[1, 2, 3]], max_tokens=10**6) for _ in range(requests)]
        for record in records:
            t = Tracked("1-0", record, RequestDecoder.for_record(tokenizer, record))
            t.step = step_key
            streamer.tracked[record.request_id] = t
        ids = tokenizer.encode(TEXT).ids
        by_key = {streamer.keys.tokens(rid).encode(): t for rid, t in streamer.tracked.items()}
        outputs = 0  # output entries the timed steps produced (one per request per step)

        def one(step: int) -> float:
            nonlocal outputs
            payload = encode_deltas([TokenDelta(0, [ids[step % len(ids)]])])
            lines = []
            for record in records:
                key = streamer.keys.tokens(record.request_id).encode()
                lines += [key, b"0", b"%d" % step, payload]
            entries = [(b"%d-0" % (1000 + step), {b"t": b"1.0", b"d": b"\n".join(lines)})]
            got: dict[str, list[object]] = {}
            t0 = time.perf_counter()
            streamer._take_steps(step_key, entries, by_key, got, {})
            made = streamer._decode_all(got)
            elapsed = time.perf_counter() - t0
            outputs += len(made.outputs)
            streamer._writes += 1
            return elapsed

        warm = steps // 10
        for step in range(1, warm + 1):
            one(step)
        outputs = 0
        times = sorted(one(step) for step in range(warm + 1, warm + steps + 1))
    p10, p50 = times[len(times) // 10] * 1e6, times[len(times) // 2] * 1e6
    return {
        "requests": requests,
        "steps": steps,
        "step_us_p10": round(p10, 1),
        "step_us_p50": round(p50, 1),
        "request_us_p10": round(p10 / requests, 2),
        "outputs": outputs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--models-dir", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = args.models_dir or Path(tmp)
        prepare_bundled_model(models_dir)
        print(json.dumps(measure(models_dir, args.requests, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
