"""The bundled GGUF as an FP16 HF model directory: what exllamav2 and transformers load.

exllamav2 cannot read GGUF files, and the prepared GPU run (benchmarks/gpu_check.py)
needs an independent reference from transformers on the same weights. So the Q4_1 GGUF is
dequantized, its tensors renamed to HF's ``LlamaForCausalLM`` names, q/k un-permuted
(llama.cpp interleaves each head's rotary halves), and written as one FP16 safetensors
file with config.json and tokenizer.json. Runs on any CPU; the mapping is unit-tested
(tests/engines/test_exllamav2_mapping.py) and the whole conversion is checked against
llama.cpp's own greedy output (tests/engines/test_gguf_reference.py).
"""

from __future__ import annotations

import json
import re
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
