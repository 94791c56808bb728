"""Chat benchmark: multi-turn conversations, as chat clients send them, against
``tokenrelay up`` and llama.cpp's ``llama-server``, each with its defaults.

    python benchmarks/chat.py [--conversations 8 32] [--turns 6] [--slots 8]

A chat client resends the whole conversation every turn: a shared system prompt (~700
tokens), then every earlier question and reply. ``C`` conversations run at once, each a
client that sends its next turn when the previous reply has ended; replies are greedy
and ``--reply-tokens`` long (``ignore_eos``), so both servers do the same work. What a
server can skip is the prefill of what it has seen before: llama-server keeps each
slot's last prompt (``cache_prompt``, on by default) and saves idle slots' prompts to
host RAM (``--cache-ram``, 8 GiB by default); tokenrelay's llama.cpp engine keeps a
prefix cache over its whole KV (workers/engines/prefix_cache.py).

Servers as users run them: ``tokenrelay up`` with the llamacpp engine and its own
defaults (only ``--slots`` and the threads set), ``llama-server`` with its defaults
but ``--parallel`` = ``--slots`` and ``-c`` = ``--peer-ctx`` (its default context is
the model's 8192 tokens split over the slots: 1,024 each, less than a late turn of
this workload). Both stay up for the whole run; each (C, server) pass runs in turn,
the order reversed every round. Reported per server and C: the whole replay's wall
time, TTFT p50 of turn 0 (cold) and of turns >= 2, the share of prompt tokens the
server reported as cached, failures, and the ratios tokenrelay/peer. llama-server is
built by ``benchmarks/peer.py --build-only`` (outside the repo); never run by CI.

``--fleet``: routing across workers instead (broker.prefix_routes). Three tokenrelay
stacks, no llama-server: two workers of ``--slots`` slots and half the threads each,
the same with ``TOKENRELAY_PREFIX_ROUTING=false`` (the shared queue alone), and one
worker with twice the slots, the threads and the KV. The figure is the cached share of
prompt tokens two routed workers reach against the one big worker (goal: >= 80 %).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import urlopen

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import bundled_gguf_path, prepare_bundled_model
from benchmarks.peer import (
    CACHE_ROOT,
    PACKAGE,
    Server,
    build_llama_server,
    http_server,
    model_id,
    one_run_at_a_time,
    sse_events,
    tokenrelay_up,
)
from broker.server import free_port
from workers.engines.llamacpp_load import cpu_has_amx

RULES = [
    "Answer the question that was asked, and only that question.",
    "Prefer short, plain sentences to long ones; avoid jargon unless the user uses it.",
    "When a question is ambiguous, say which reading you answer and answer it.",
    "Give numbers with their units, and say where an estimate is rough.",
    "Never invent a source, a quotation, a statistic or a name.",
    "If you do not know, say so, and say what would be needed to find out.",
    "Keep a friendly tone, but do not flatter the user or praise the question.",
    "Use lists only when the user asks for steps or for several items.",
    "When the user corrects you, check the correction before accepting it.",
    "Do not repeat the question back before answering it.",
]
TOPICS = [
    "the water cycle", "prime numbers", "volcanoes", "the moon", "bread baking",
    "bicycles", "honey bees", "tides", "glaciers", "the printing press", "photosynthesis",
    "lighthouses", "comets", "coral reefs", "windmills", "the violin",
]  # fmt: skip
FOLLOW_UPS = [
    "Tell me about {t}.",
    "Why does that matter?",
    "Can you give an example?",
    "What is a common mistake people make about it?",
    "How would you explain it to a child?",
    "Summarise what you said in one sentence.",
    "What should I read next about {t}?",
    "Thanks. One more fact about {t}, please.",
]


def system_prompt(words: int) -> str:
    """A fixed system prompt of about ``words`` words (~1.3 tokens each here)."""
    text: list[str] = ["You are a careful assistant for a public library's help desk."]
    i = 0
    while sum(len(s.split()) for s in text) < words:
        text.append(f"Rule {i + 1}: {RULES[i % len(RULES)]}")
        i += 1
    return " ".join(text)


# -- one conversation --------------------------------------------------------------------


@dataclass
class Turn:
    ttft: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)


def chat_turn(base_url: str, body: dict[str, object]) -> tuple[Turn, str]:
    """One streamed turn: TTFT, usage (cached tokens from OpenAI's field, else
    llama-server's ``timings.cache_n``) and the reply's text."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=900)
    text: list[str] = []
    turn = Turn()
    try:
        t0 = time.perf_counter()
        data = json.dumps(body).encode()
        conn.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Turn(error=f"HTTP {resp.status}: {resp.read(300)!r}"), ""
        for now, event in sse_events(resp):
            if "error" in event:
                return Turn(error=str(event["error"])[:300]), ""
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if not text:
                        turn.ttft = now - t0
                    text.append(content)
            usage = event.get("usage")
            if usage:
                turn.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                turn.completion_tokens = int(usage.get("completion_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                turn.cached_tokens = int(details.get("cached_tokens") or 0)
            timings = event.get("timings")
            if timings and not turn.cached_tokens:
                turn.cached_tokens = int(timings.get("cache_n") or 0)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Turn(error=f"{type(exc).__name__}: {exc}"), ""
    finally:
        conn.close()
    if not text:
        turn.error = turn.error or "no content"
    return turn, "".join(text)


def converse(
    server: Server, tag: str, c: int, turns: int, system: str, reply_tokens: int
) -> Conversation:
    """Conversation ``c``; ``tag`` makes each pass's conversations new to the server."""
    topic = TOPICS[c % len(TOPICS)]
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    out = Conversation()
    for t in range(turns):
        question = FOLLOW_UPS[t % len(FOLLOW_UPS)].format(t=topic)
        messages.append(
            {"role": "user", "content": f"({tag}.{c}) {question}" if t == 0 else question}
        )
        body = {
            "model": server.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "max_tokens": reply_tokens,
            "ignore_eos": True,
        }
        turn, reply = chat_turn(server.base_url, body)
        out.turns.append(turn)
        if turn.error:
            break
        messages.append({"role": "assistant", "content": reply})
    return out


# -- a pass: C conversations against one server ------------------------------------------


@dataclass
class Pass:
    server: str
    conversations: int
    wall: float
    convs: list[Conversation]

    def turns(self, which: range | None = None) -> list[Turn]:
        return [
            t
            for conv in self.convs
            for i, t in enumerate(conv.turns)
            if not t.error and (which is None or i in which)
        ]

    @property
    def failures(self) -> int:
        return sum(1 for conv in self.convs for t in conv.turns if t.error)

    def ttft_p50(self, which: range) -> float:
        values = [t.ttft for t in self.turns(which)]
        return statistics.median(values) if values else float("nan")

    @property
    def cached_share(self) -> float:
        turns = self.turns()
        prompt = sum(t.prompt_tokens for t in turns)
        return sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0


def run_pass(server: Server, tag: str, c: int, turns: int, system: str, reply_tokens: int) -> Pass:
    start = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        convs = list(
            pool.map(lambda i: converse(server, tag, i, turns, system, reply_tokens), range(c))
        )
    return Pass(server.name, c, time.perf_counter() - start, convs)


def report(passes: list[Pass], cs: list[int], turns: int) -> str:
    late = range(2, turns)
    lines = [
        "| C | server | wall s (median; runs) | TTFT p50 turn 0 | TTFT p50 turns >= 2 "
        "| cached share | failed turns |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for c in cs:
        by: dict[str, list[Pass]] = {}
        for p in passes:
            if p.conversations == c:
                by.setdefault(p.server, []).append(p)
        walls = {}
        ttfts = {}
        for name, ps in by.items():
            walls[name] = statistics.median(p.wall for p in ps)
            ttfts[name] = statistics.median(p.ttft_p50(late) for p in ps)
            lines.append(
                f"| {c} | {name} | {walls[name]:.1f} ({', '.join(f'{p.wall:.1f}' for p in ps)}) "
                f"| {statistics.median(p.ttft_p50(range(1)) for p in ps):.2f} s "
                f"| {ttfts[name]:.2f} s | {statistics.median(p.cached_share for p in ps):.0%} "
                f"| {sum(p.failures for p in ps)} |"
            )
        if "tokenrelay" in walls and "llama-server" in walls:
            ratios.append(
                f"C={c}: wall {walls['tokenrelay'] / walls['llama-server']:.2f}x, "
                f"TTFT turns >= 2 {ttfts['tokenrelay'] / ttfts['llama-server']:.2f}x "
                "(tokenrelay / llama-server)"
            )
    return "\n".join([*lines, "", *ratios])


# --fleet's three stacks: (name, workers, slots and KV per worker as multiples of --slots
# and of the default context, threads per worker as a share of --threads, routing).
FLEET = {
    "tokenrelay 2 workers": (2, 1, 0.5, True),
    "tokenrelay 2 workers unrouted": (2, 1, 0.5, False),
    "tokenrelay 1 worker 2x slots": (1, 2, 1.0, True),
}
DEFAULT_N_CTX = 8192  # TOKENRELAY_LLAMACPP_N_CTX's default


def fleet(stack: ExitStack, root: Path, args: argparse.Namespace) -> list[Server]:
    models = root / "models"
    prepare_bundled_model(models)
    servers = []
    for i, (name, (workers, scale, share, routed)) in enumerate(FLEET.items()):
        env = dict(kv.split("=", 1) for kv in args.tokenrelay_env)
        env["TOKENRELAY_PREFIX_ROUTING"] = "true" if routed else "false"
        run = root / f"run{i}"
        run.mkdir()
        threads = max(1, int(args.threads * share))
        servers.append(
            stack.enter_context(
                tokenrelay_up(
                    models,
                    threads,
                    args.slots * scale,
                    run,
                    env,
                    n_ctx=DEFAULT_N_CTX * scale,
                    workers=workers,
                    name=name,
                )
            )
        )
    return servers


def routes_of(server: Server) -> dict[str, int]:
    """The web tier's routing outcomes so far (``tokenrelay_prefix_routes_total``)."""
    with urlopen(f"{server.base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenrelay_prefix_routes_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = int(float(line.split()[-1]))
    return out


def beyond_shared(p: Pass) -> float:
    """The cached share of prompt tokens past the system prompt, turns >= 1: what only
    the worker holding the conversation can have (every worker soon holds the system
    prompt, measured as the median cached count of the first turns)."""
    shared = statistics.median(conv.turns[0].cached_tokens for conv in p.convs if conv.turns)
    turns = [t for conv in p.convs for t in conv.turns[1:] if not t.error]
    prompt = sum(t.prompt_tokens - shared for t in turns)
    return sum(t.cached_tokens - shared for t in turns) / prompt if prompt else 0.0


def fleet_report(passes: list[Pass], cs: list[int]) -> str:
    names = list(FLEET)
    lines = []
    for c in cs:
        share = {
            n: statistics.median(
                p.cached_share for p in passes if p.server == n and p.conversations == c
            )
            for n in names
        }
        beyond = {
            n: statistics.median(
                beyond_shared(p) for p in passes if p.server == n and p.conversations == c
            )
            for n in names
        }
        one, one_beyond = share[names[2]], beyond[names[2]]
        lines.append(
            f"C={c}: cached share, 2 routed workers / 1 worker with 2x slots: "
            f"{share[names[0]] / one:.0%} (unrouted: {share[names[1]] / one:.0%}); past the "
            f"system prompt, turns >= 1: {beyond[names[0]]:.0%} / {one_beyond:.0%} = "
            f"{beyond[names[0]] / one_beyond:.0%} (unrouted {beyond[names[1]]:.0%} = "
            f"{beyond[names[1]] / one_beyond:.0%})"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--system-words", type=int, default=520, help="~700 tokens")
    parser.add_argument("--slots", type=int, default=8, help="llama-server --parallel, "
                        "tokenrelay's worker_slots")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-ctx", type=int, default=16384, help="llama-server -c")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--peer-args", default="", help="more llama-server arguments, e.g. '-kvu' (a control)"
    )
    parser.add_argument("--peers", default="tokenrelay,llama-server")
    parser.add_argument("--tokenrelay-env", nargs="*", default=[], metavar="K=V")
    parser.add_argument("--json", type=Path, help="write every pass here")
    parser.add_argument("--fleet", action="store_true", help="2 workers against 1 (module doc)")
    args = parser.parse_args()
    if args.fleet:
        args.peers = ",".join(FLEET)

    names = [p for p in args.peers.split(",") if p]
    version = metadata.version(PACKAGE)
    cache = CACHE_ROOT / f"llama-server-{version}"
    system = system_prompt(args.system_words)
    passes: list[Pass] = []
    with (
        one_run_at_a_time(CACHE_ROOT / "peer.lock"),
        tempfile.TemporaryDirectory(prefix="tr-chat-") as tmp,
        ExitStack() as stack,
    ):
        root = Path(tmp)
        servers: list[Server] = []
        if args.fleet:
            servers += fleet(stack, root, args)
        if "tokenrelay" in names:
            models = root / "models"
            prepare_bundled_model(models)
            extra = dict(kv.split("=", 1) for kv in args.tokenrelay_env)
            (root / "run").mkdir()
            tr = stack.enter_context(
                tokenrelay_up(models, args.threads, args.slots, root / "run", extra, n_ctx=None)
            )
            servers.append(tr)
        if "llama-server" in names:
            binary = build_llama_server(cache, version, None, 2)
            port = free_port()
            cmd = [
                str(binary), "-m", str(bundled_gguf_path()), "-t", str(args.threads),
                "-tb", str(args.threads), "-np", str(args.slots), "-c", str(args.peer_ctx),
                "--no-webui", "--host", "127.0.0.1", "--port", str(port),
            ]  # fmt: skip
            if cpu_has_amx():
                cmd.append("--no-repack")  # as tokenrelay's engine there (peer.py)
            cmd += args.peer_args.split()
            servers.append(
                stack.enter_context(http_server("llama-server", cmd, {}, port, root, "/health"))
            )
        for s in servers:
            s.model = model_id(s.base_url)
        servers.sort(key=lambda s: names.index(s.name))  # --peers gives the first order
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for c in args.conversations:
                for s in order:
                    p = run_pass(s, f"{r}{c}", c, args.turns, system, args.reply_tokens)
                    passes.append(p)
                    print(
                        f"round {r} C={c} {s.name}: wall {p.wall:.1f} s, TTFT turn 0 "
                        f"{p.ttft_p50(range(1)):.2f} s, turns>=2 "
                        f"{p.ttft_p50(range(2, args.turns)):.2f} s, cached "
                        f"{p.cached_share:.0%}, failed {p.failures}"
                        + (f", routes {routes_of(s)}" if args.fleet else ""),
                        flush=True,
                    )
    print()
    print(report(passes, args.conversations, args.turns))
    if args.fleet:
        print(fleet_report(passes, args.conversations))
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "server": p.server,
                        "conversations": p.conversations,
                        "wall": p.wall,
                        "turns": [[t.__dict__ for t in conv.turns] for conv in p.convs],
                    }
                    for p in passes
                ],
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
