"""Peer benchmark: llama.cpp's own ``llama-server`` (and llama-cpp-python's server) against
``tokenrelay up`` with the llamacpp engine, same GGUF, same thread count, one client.

    python benchmarks/peer.py [--threads 2] [--concurrency 1 8 32] [--rounds 2]
    python benchmarks/peer.py --build-only

``llama-server`` is built once (CPU only, cmake target ``llama-server``) from the
llama.cpp that the installed llama-cpp-python vendors (its sdist's ``vendor/llama.cpp``),
so peer and tokenrelay run the same ggml kernels; the build lives outside the repo in
``~/.cache/tokenrelay-peer/llama-server-<version>/`` and is reused. It is a benchmark
tool: never a dependency, never run by CI or ``make test``.

All servers stay up for the whole run; each (concurrency, server) measurement runs in
turn, the order reversed every round so drift on a shared machine hits all alike. Every
request is a streamed chat completion, temperature 0, ``--max-tokens`` with
``ignore_eos`` (llama-cpp-python's server ignores that field and may stop early at EOS;
tokens are counted from ``usage``, else one per content chunk). ``llama-server`` runs
with ``--no-cache-prompt`` and every prompt is unique, so no server skips prefill work
the others do. Reported per server and concurrency: aggregate tokens/s (median of the
rounds, and their range), TTFT p50/p95, the gap between content chunks p50/p95 (as the
client receives them: a server that coalesces tokens shows fewer, wider gaps, hence the
tokens-per-chunk column), the server's CPU µs per token (tokenrelay's also per process),
the CPU the rest of the machine burnt meanwhile (% of one core: the noise to read the
row with), the share of a pace probe's samples that found a CPU at about half speed
(``relay.py``'s ``pace_probe``: this machine's CPUs switch between full and half speed,
and a pair's ratio moves with it; per run in the progress lines), and the ratios
tokenrelay/peer.
"""

from __future__ import annotations

import argparse
import fcntl
import http.client
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.prepare import BUNDLED_GGUF, prepare_bundled_model
from benchmarks.llamacpp_engine import QUESTIONS
from benchmarks.relay import TICK, cpu_burner, cpu_seconds, pace_probe, percentile
from benchmarks.sse_clients import tree_cpu
from broker.server import free_port
from tests.stack import Proc, wait_for
from workers.engines.llamacpp_load import cpu_has_amx

PACKAGE = "llama-cpp-python"
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenrelay-peer"
#: Where llama-cpp-python's ``[server]`` extras may live, outside the project's venv.
PY_SERVER_DEPS = CACHE_ROOT / "llama-cpp-python-server"
PY_SERVER_PINS = (
    "fastapi==0.115.12 starlette==0.46.2 uvicorn==0.34.2 sse-starlette==2.3.3 "
    "starlette-context==0.3.6"
)
N_CTX = 8192  # tokenrelay's llamacpp_n_ctx default: one KV cache shared by all slots
TOKENRELAY = "tokenrelay"


# -- building llama-server ----------------------------------------------------------------


def extract_vendored(sdist: Path, version: str, dest: Path) -> None:
    """Unpack only the sdist's ``vendor/llama.cpp`` to ``dest`` (whole, or not at all)."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar, tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise SystemExit(f"{sdist} has no {prefix}")
        tar.extractall(tmp, members=members, filter="data")
        Path(tmp, prefix).rename(dest)


def build_llama_server(cache: Path, version: str, sdist: Path | None, jobs: int) -> Path:
    """The cached ``llama-server`` binary, built first if absent (minutes on 2 cores)."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    src = cache / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        if sdist is None:
            print(f"downloading the {PACKAGE}=={version} sdist into {cache}", flush=True)
            pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
            subprocess.run([*pip, "--dest", str(cache), f"{PACKAGE}=={version}"], check=True)
            sdist = next(cache.glob(f"llama_cpp_python-{version}.tar.gz"))
        extract_vendored(sdist, version, src)
    configure = [
        "cmake", "-S", str(src), "-B", str(cache / "build"), "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
    ]  # fmt: skip
    print(f"building llama-server in {cache / 'build'} (-j{jobs})", flush=True)
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["cmake", "--build", str(cache / "build"), "--target", "llama-server", f"-j{jobs}"],
        check=True,
    )
    return binary


def py_server_env() -> dict[str, str] | None:
    """Env in which ``python -m llama_cpp.server`` imports (its extras may sit in
    ``PY_SERVER_DEPS``), or None when they are missing."""
    env = dict(os.environ)
    if PY_SERVER_DEPS.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(PY_SERVER_DEPS), env.get("PYTHONPATH")])
        )
    probe = subprocess.run(
        [sys.executable, "-c", "import llama_cpp.server.app"], env=env, capture_output=True
    )
    return env if probe.returncode == 0 else None


# -- servers -------------------------------------------------------------------------------


@dataclass
class Server:
    """A running server: where to send requests and which PIDs' CPU is its cost."""

    name: str
    base_url: str
    pids: dict[str, int]
    model: str = ""
    # A control: measured while a process keeps this much of a core busy (``--burn``).
    burn: float = 0.0

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each of its processes (and their direct children)."""
        out = {}
        for part, pid in self.pids.items():
            try:
                out[part] = tree_cpu(pid)
            except OSError:  # restarted under `up`'s supervision: its CPU is lost
                out[part] = 0.0
        return out


def http_ok(url: str) -> bool:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=2)
    try:
        conn.request("GET", parts.path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def model_id(base_url: str) -> str:
    """The model id a server lists first in ``/v1/models`` (each names it its own way)."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    try:
        conn.request("GET", "/v1/models")
        return str(json.loads(conn.getresponse().read())["data"][0]["id"])
    finally:
        conn.close()


@contextmanager
def http_server(
    name: str, args: list[str], env: dict[str, str], port: int, log_dir: Path, ready_path: str
) -> Iterator[Server]:
    """A server process on ``port``, ready when ``ready_path`` answers 200."""
    proc = Proc(args, env, log_dir / f"{name}.log")
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if not proc.alive():
                raise RuntimeError(f"{name} exited early:\n{proc.output()}")
            return http_ok(base + ready_path)

        wait_for(ready, 180, f"{name} to answer {ready_path}", interval=0.25)
        yield Server(name, base, {name: proc.pid})
    finally:
        proc.stop()


def llama_server(
    binary: Path, gguf: Path, threads: int, parallel: int, log_dir: Path
) -> AbstractContextManager[Server]:
    """llama.cpp's server: ``parallel`` slots on one unified KV cache of tokenrelay's size."""
    port = free_port()
    args = [
        str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(N_CTX),
        "-np", str(parallel), "-kvu", "--no-cache-prompt", "--no-webui",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if cpu_has_amx():
        # As tokenrelay's engine there: no extra weight buffers (ggml's AMX matmul
        # crashes on batched decodes in this llama.cpp), so both run the same kernels.
        args.append("--no-repack")
    return http_server("llama-server", args, dict(os.environ), port, log_dir, "/health")


def llama_cpp_python_server(
    gguf: Path, threads: int, env: dict[str, str], log_dir: Path
) -> AbstractContextManager[Server]:
    """llama-cpp-python's server: one ``Llama``, so one request at a time; by default a
    new request cuts the running stream off, which ``--interrupt_requests False`` stops."""
    port = free_port()
    args = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads",
        str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(N_CTX),
        "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    return http_server("llama-cpp-python", args, env, port, log_dir, "/v1/models")


@contextmanager
def tokenrelay_up(
    models_dir: Path,
    threads: int,
    slots: int,
    run_dir: Path,
    extra_env: dict[str, str],
    n_ctx: int | None = N_CTX,
    *,
    workers: int = 1,
    name: str = TOKENRELAY,
) -> Iterator[Server]:
    """``tokenrelay up`` (python -m workers.up) with the llamacpp engine; its children's
    PIDs come from ``up.json``; stopped with SIGTERM to ``up``, which stops them in order.
    ``extra_env`` goes to tokenrelay's processes only (an A/B of e.g. OMP_WAIT_POLICY);
    ``n_ctx`` None keeps tokenrelay's default context; ``workers`` worker processes,
    ``threads`` each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
    env.update(extra_env)
    env.update(
        TOKENRELAY_ENGINE="llamacpp",
        TOKENRELAY_MODELS_DIR=str(models_dir),
        TOKENRELAY_LLAMACPP_THREADS=str(threads),
        TOKENRELAY_WORKER_SLOTS=str(slots),
    )
    if n_ctx is not None:
        env["TOKENRELAY_LLAMACPP_N_CTX"] = str(n_ctx)
    port = free_port()
    args = [sys.executable, "-m", "workers.up", "--port", str(port), "--run-dir", str(run_dir)]
    args += ["--flower-port", str(free_port()), "--redis-port", str(free_port()), "--fresh"]
    args += ["--workers", str(workers)]
    proc = Proc(args, env, run_dir.parent / f"tokenrelay-{run_dir.name}-up.log")
    state_file = run_dir / "up.json"
    try:

        def running() -> dict[str, object] | None:
            if not proc.alive():
                raise RuntimeError(f"tokenrelay up exited early:\n{proc.output()}")
            if not state_file.exists():
                return None
            state = json.loads(state_file.read_text())
            return dict(state) if state.get("state") == "running" else None

        state = wait_for(running, 240, "tokenrelay up to be ready", interval=0.25)
        assert isinstance(state, dict)
        pids = {name: int(child["pid"]) for name, child in state["children"].items()}
        yield Server(name, f"http://127.0.0.1:{port}", pids)
    finally:
        proc.stop(timeout=60)


# -- the client ----------------------------------------------------------------------------


@dataclass
class Sample:
    """One streamed request as the client saw it (perf_counter seconds)."""

    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    chunks: int = 0
    error: str = ""


def sse_events(resp: http.client.HTTPResponse) -> Iterator[tuple[float, dict[str, Any]]]:
    """A streamed response's JSON events with their arrival times (perf_counter), up to
    ``data: [DONE]``. ``read1`` returns whatever the socket holds (chunked encoding
    decoded), so no read waits to fill a buffer and arrival times stay exact."""
    pending = b""
    while True:
        data = resp.read1(65536)
        if not data:
            return
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield now, json.loads(payload)


def stream_chat(base_url: str, body: bytes) -> Sample:
    """POST one streamed chat completion and time every content chunk on arrival (a
    small client leaves the two cores to the servers)."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=600)
    arrivals: list[float] = []
    usage_tokens = None
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Sample(error=f"HTTP {resp.status}: {resp.read(300)!r}")
        for now, chunk in sse_events(resp):
            if "error" in chunk:
                return Sample(error=str(chunk["error"])[:300])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    arrivals.append(now)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Sample(error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    if not arrivals:
        return Sample(error="no content")
    return Sample(
        ttft=arrivals[0] - t0,
        gaps=[b - a for a, b in itertools.pairwise(arrivals)],
        tokens=usage_tokens or len(arrivals),
        chunks=len(arrivals),
    )


def request_body(model: str, i: int, tag: str, max_tokens: int) -> bytes:
    """A prompt unique from its first token (the system message, before any template
    text a server could reuse from its last request) asking for long output;
    ``ignore_eos`` holds every server that knows it to ``max_tokens``."""
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": f"[{tag}-{i}] You are a helpful assistant."},
            {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} Answer at length."},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    return json.dumps(body).encode()


@dataclass
class Measurement:
    """``requests`` requests to one server, ``concurrency`` at a time."""

    server: str
    concurrency: int
    requests: int
    elapsed_s: float
    samples: list[Sample]
    cpu_us_per_token: dict[str, float]  # the server's, per process
    client_cpu_us_per_token: float
    foreign_cpu_pct: float  # CPU busy outside this server and the client: the noise
    burner_cores: float = 0.0  # what the control's burner used (not in the other figures)
    # The share of the pace probe's samples that found a CPU at about half speed
    # (benchmarks/relay.py ``pace_probe``): a pair's ratio moves with it (issue 12).
    slow_share: float | None = None

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if not s.error]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.ok)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.elapsed_s

    @property
    def ttft(self) -> list[float]:
        return [s.ttft for s in self.ok]

    @property
    def gaps(self) -> list[float]:
        return [g for s in self.ok for g in s.gaps]

    @property
    def tokens_per_chunk(self) -> float:
        return self.tokens / max(sum(s.chunks for s in self.ok), 1)

    def brief(self) -> dict[str, object]:
        """One line of progress (and of ``--json``)."""
        return {
            "server": self.server,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "failed": len(self.samples) - len(self.ok),
            "errors": sorted({s.error for s in self.samples if s.error})[:3],
            "tokens": self.tokens,
            "elapsed_s": round(self.elapsed_s, 2),
            "tok_s": round(self.tok_s, 1),
            "ttft_ms_p50": round(percentile(self.ttft, 0.5) * 1000, 1),
            "ttft_ms_p95": round(percentile(self.ttft, 0.95) * 1000, 1),
            "gap_ms_p50": round(percentile(self.gaps, 0.5) * 1000, 2),
            "gap_ms_p95": round(percentile(self.gaps, 0.95) * 1000, 2),
            "tokens_per_chunk": round(self.tokens_per_chunk, 2),
            "cpu_us_per_token": {k: round(v, 1) for k, v in self.cpu_us_per_token.items()},
            "client_cpu_us_per_token": round(self.client_cpu_us_per_token, 1),
            "foreign_cpu_pct": round(self.foreign_cpu_pct, 1),
            **({"burner_cores": round(self.burner_cores, 3)} if self.burner_cores else {}),
            "slow_cpu_share": self.slow_share,
        }


def machine_busy() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: all but idle, iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def measure(
    server: Server, concurrency: int, n_requests: int, max_tokens: int, tag: str
) -> Measurement:
    """``n_requests`` requests, ``concurrency`` at a time, with the CPU they cost."""
    bodies = [request_body(server.model, i, tag, max_tokens) for i in range(n_requests)]
    pace: dict[str, list[float]] = {}
    with ExitStack() as stack:
        burner = stack.enter_context(cpu_burner(server.burn)) if server.burn else None
        # The CPUs' pace while the requests run (~1 % of a core, counted as foreign).
        with pace_probe(pace):
            cpu0, client0, busy0 = server.cpu(), time.process_time(), machine_busy()
            burned0 = cpu_seconds(burner.pid) if burner else 0.0
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                samples = list(pool.map(lambda b: stream_chat(server.base_url, b), bodies))
            elapsed = time.perf_counter() - t0
            cpu1, client1, busy1 = server.cpu(), time.process_time(), machine_busy()
            burned = cpu_seconds(burner.pid) - burned0 if burner else 0.0
    ours = sum(cpu1.values()) - sum(cpu0.values()) + client1 - client0 + burned
    per_token = 1e6 / max(sum(s.tokens for s in samples if not s.error), 1)
    return Measurement(
        server=server.name,
        concurrency=concurrency,
        requests=n_requests,
        elapsed_s=elapsed,
        samples=samples,
        cpu_us_per_token={k: (cpu1[k] - cpu0[k]) * per_token for k in cpu0},
        client_cpu_us_per_token=(client1 - client0) * per_token,
        foreign_cpu_pct=max(0.0, 100 * (busy1 - busy0 - ours) / elapsed),
        burner_cores=burned / elapsed,
        slow_share=pace["slow_share"][0] if "slow_share" in pace else None,
    )


# -- report --------------------------------------------------------------------------------


@dataclass
class Summary:
    """The rounds of one (server, concurrency): tok/s median and range, latencies pooled."""

    tok_s: float
    tok_s_min: float
    tok_s_max: float
    ttft_p50: float
    ttft_p95: float
    gap_p50: float
    gap_p95: float
    tok_chunk: float
    cpu: float
    foreign: float
    failed: int
    slow: float | None  # the runs' median slow-CPU share

    @classmethod
    def of(cls, runs: list[Measurement]) -> Summary:
        rates = [r.tok_s for r in runs]
        ttft = [t for r in runs for t in r.ttft]
        gaps = [g for r in runs for g in r.gaps]
        shares = [r.slow_share for r in runs if r.slow_share is not None]
        return cls(
            tok_s=statistics.median(rates),
            tok_s_min=min(rates),
            tok_s_max=max(rates),
            ttft_p50=percentile(ttft, 0.5),
            ttft_p95=percentile(ttft, 0.95),
            gap_p50=percentile(gaps, 0.5),
            gap_p95=percentile(gaps, 0.95),
            tok_chunk=statistics.median(r.tokens_per_chunk for r in runs),
            cpu=statistics.median(sum(r.cpu_us_per_token.values()) for r in runs),
            foreign=statistics.median(r.foreign_cpu_pct for r in runs),
            failed=sum(len(r.samples) - len(r.ok) for r in runs),
            slow=statistics.median(shares) if shares else None,
        )


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds >= 0.1 else f"{seconds * 1000:.1f}"


def report(results: list[Measurement], concurrencies: list[int], names: list[str]) -> str:
    """Markdown: per server; the ratios tokenrelay/peer; tokenrelay's CPU by process."""
    table = {
        (n, c): Summary.of([r for r in results if r.server == n and r.concurrency == c])
        for n in names
        for c in concurrencies
    }
    lines = [
        "| server | conc | tok/s (range) | TTFT p50 / p95 ms | gap p50 / p95 ms "
        "| tok/chunk | server CPU µs/tok | foreign CPU % | slow CPU share | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in concurrencies:
        for n in names:
            s = table[n, c]
            lines.append(
                f"| {n} | {c} | {s.tok_s:.0f} ({s.tok_s_min:.0f}–{s.tok_s_max:.0f}) "
                f"| {ms(s.ttft_p50)} / {ms(s.ttft_p95)} | {ms(s.gap_p50)} / {ms(s.gap_p95)} "
                f"| {s.tok_chunk:.2f} | {s.cpu:.0f} | {s.foreign:.0f} "
                f"| {'–' if s.slow is None else f'{s.slow:.2f}'} | {s.failed} |"
            )
    peers = [n for n in names if n != TOKENRELAY]
    if peers:
        lines += [
            "",
            "| tokenrelay / peer | conc | tok/s | TTFT p50 | TTFT p95 | gap p50 | gap p95 |",
            "|---|---|---|---|---|---|---|",
        ]
    for peer in peers:
        for c in concurrencies:
            t, p = table[TOKENRELAY, c], table[peer, c]
            pairs = [
                (t.tok_s, p.tok_s),
                (t.ttft_p50, p.ttft_p50),
                (t.ttft_p95, p.ttft_p95),
                (t.gap_p50, p.gap_p50),
                (t.gap_p95, p.gap_p95),
            ]
            cells = [f"{a / b:.2f}×" if b else "–" for a, b in pairs]
            lines.append(f"| {peer} | {c} | " + " | ".join(cells) + " |")
    ours = [r for r in results if r.server == TOKENRELAY]
    parts = sorted({k for r in ours for k in r.cpu_us_per_token})
    lines += [
        "",
        "| tokenrelay CPU µs/tok | " + " | ".join(parts) + " | the client |",
        "|---|" + "---|" * (len(parts) + 1),
    ]
    for c in concurrencies:
        runs = [r for r in ours if r.concurrency == c]
        cpu = [statistics.median(r.cpu_us_per_token.get(p, 0.0) for r in runs) for p in parts]
        cpu.append(statistics.median(r.client_cpu_us_per_token for r in runs))
        lines.append(f"| conc {c} | " + " | ".join(f"{x:.0f}" for x in cpu) + " |")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads (all cores)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--requests", type=int, default=0, help="per measurement (default: max(16, 2 x conc))"
    )
    parser.add_argument(
        "--tokenrelay-threads", type=int,
        help="llama.cpp threads of tokenrelay's worker only (default: --threads), to A/B a "
        "count that leaves the relay processes a core",
    )  # fmt: skip
    parser.add_argument(
        "--tokenrelay-env", action="append", default=[], metavar="KEY=VALUE",
        help="an environment variable for tokenrelay's processes only (repeatable)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--parallel", type=int, default=8,
        help="llama-server --parallel, and tokenrelay's worker_slots (the same batch)",
    )  # fmt: skip
    parser.add_argument(
        "--peers", default="llama-server,llama-cpp-python", help="comma-separated peers to run"
    )
    parser.add_argument(
        "--burn", type=float, default=0.0, metavar="CORES",
        help="also measure llama-server while a process keeps CORES (0-1) of a core busy in "
        "10 ms cycles: a control with the relay processes' CPU demand and no relay",
    )  # fmt: skip
    parser.add_argument("--build-only", action="store_true", help="build llama-server and exit")
    parser.add_argument("--jobs", type=int, default=2, help="parallel build jobs")
    parser.add_argument("--sdist", type=Path, help=f"a {PACKAGE} sdist (else pip download)")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args()

    version = metadata.version(PACKAGE)
    cache = CACHE_ROOT / f"llama-server-{version}"
    cache.mkdir(parents=True, exist_ok=True)
    peers = [p for p in args.peers.split(",") if p]
    tr_threads = args.tokenrelay_threads or args.threads
    binary = None
    if "llama-server" in peers or args.build_only:
        binary = build_llama_server(cache, version, args.sdist, args.jobs)
        print(f"llama-server: {binary}", flush=True)
    if args.build_only:
        return 0
    py_env = py_server_env() if "llama-cpp-python" in peers else None
    if "llama-cpp-python" in peers and py_env is None:
        print(
            "skipping llama-cpp-python's server: its [server] extras do not import; to add "
            f"them outside the venv: {sys.executable} -m pip install --target "
            f"{PY_SERVER_DEPS} --no-deps {PY_SERVER_PINS}",
            flush=True,
        )
        peers.remove("llama-cpp-python")

    with ExitStack() as stack:
        stack.enter_context(one_run_at_a_time(cache.parent / "peer-run.lock"))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tr-peer-")))
        log_dir = args.log_dir or tmp / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        model_dir = prepare_bundled_model(tmp / "models")
        gguf = model_dir / BUNDLED_GGUF
        servers: list[Server] = []
        if "llama-server" in peers and binary:
            peer = stack.enter_context(
                llama_server(binary, gguf, args.threads, args.parallel, log_dir)
            )
            servers.append(peer)
            if args.burn > 0:  # the same server, measured beside the burner
                name = f"{peer.name}+burn{args.burn:g}"
                servers.append(Server(name, peer.base_url, peer.pids, burn=args.burn))
        servers.append(
            stack.enter_context(
                tokenrelay_up(
                    tmp / "models",
                    tr_threads,
                    args.parallel,
                    log_dir / "up",
                    dict(kv.split("=", 1) for kv in args.tokenrelay_env),
                )
            )
        )
        if py_env is not None:
            servers.append(
                stack.enter_context(llama_cpp_python_server(gguf, args.threads, py_env, log_dir))
            )
        for s in servers:  # the model id each names itself, then one warm-up request
            s.model = model_id(s.base_url)
            warm = stream_chat(s.base_url, request_body(s.model, 0, "warm", 8))
            if warm.error:
                raise SystemExit(f"{s.name}: warm-up failed: {warm.error}")
        print(
            f"threads {args.threads} (tokenrelay {tr_threads}), parallel/slots {args.parallel}, "
            f"max_tokens {args.max_tokens}, servers {[s.name for s in servers]}, logs {log_dir}",
            flush=True,
        )
        results: list[Measurement] = []
        for rnd in range(args.rounds):
            for c in args.concurrency:
                order = servers if rnd % 2 == 0 else servers[::-1]
                for s in order:
                    n = args.requests or max(16, 2 * c)
                    r = measure(s, c, n, args.max_tokens, f"r{rnd}c{c}")
                    results.append(r)
                    print(json.dumps({"round": rnd, **r.brief()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps([r.brief() for r in results], indent=1) + "\n")
    names = [s.name for s in servers]
    print()
    print(report(results, args.concurrency, names))
    return 0 if all(len(r.ok) == r.requests for r in results) else 1


@contextmanager
def one_run_at_a_time(path: Path) -> Iterator[None]:
    """Refuse to run beside another run: two sets of servers on the same cores measure
    nothing, and four spinning llama.cpp threads on two cores make steps take seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another peer.py run holds {path}; wait for it to end") from None
        yield


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the servers' cleanup
    sys.exit(main())
