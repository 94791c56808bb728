"""The GPU run's independent reference: transformers on the converted weights.

Comparing the exllamav2 engine with exllamav2's own generator proves the mapping layer,
not the model: a wrong GGUF -> HF conversion, or a kernel bug common to both, would pass.
So every token the engine produces is also checked against transformers, a different
implementation of the same architecture, *teacher-forced*: one forward pass over the
prompt and the engine's tokens gives transformers' logits at every position, and each
engine token must be within ``margin`` logits of transformers' argmax there. Greedy
runs of two FP16 implementations may part at a near-tie and then differ for good; the
margin check does not, and still fails at once on a wrong weight or kernel (a wrong
conversion puts the chosen token several logits below the best).

The same comparisons give logprobs (log-softmax of transformers' logits) and penalties
(``penalized``: exllamav2's repetition penalty over the whole sequence, then OpenAI's
presence/frequency penalties over the generated tokens, then the logit bias; the order
and formulas of ``apply_rep_penalty_cpu`` and tokenrelay's ``OutputPenalties``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# transformers' FP16 and exllamav2's FP16 agree to ~0.1 logits on this model; a token
# the engine chose further than this below transformers' best is a wrong token. On the
# CPU, llama.cpp's Q8 activations against transformers' FP32 stay within 0.22
# (tests/engines/test_gguf_reference.py).
DEFAULT_MARGIN = 0.5


def log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    peak = rows.max(axis=-1, keepdims=True)
    out: np.ndarray = rows - peak - np.log(np.exp(rows - peak).sum(axis=-1, keepdims=True))
    return out


def penalized(
    row: np.ndarray,
    context: Sequence[int],
    generated: Sequence[int],
    *,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
    bias: dict[int, float] | None = None,
) -> np.ndarray:
    """One logits row as the engine's sampler sees it: the repetition penalty over every
    distinct token of ``context`` (prompt and output: divide a positive logit, multiply a
    negative one), then ``-(frequency * count + presence)`` per token of ``generated``,
    then ``bias``."""
    out = np.array(row, dtype=np.float64)
    if repetition != 1.0:
        seen = np.unique(np.asarray(context, dtype=np.int64))
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / repetition, vals * repetition)
    if presence or frequency:
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        out[ids] -= frequency * counts + presence
    for tok, b in (bias or {}).items():
        out[tok] += b
    return out


@dataclass
class Agreement:
    """How one sequence of engine tokens agrees with the reference's logits."""

    tokens: int = 0
    max_margin: float = 0.0  # the worst (best logit - chosen logit) over the tokens
    over: int = 0  # tokens further than the margin below the best
    argmax_equal: int = 0  # tokens that are the reference's argmax exactly
    max_logprob_error: float | None = None  # |engine logprob - reference log-softmax|
    worst: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Agreement) -> None:
        self.tokens += other.tokens
        self.max_margin = max(self.max_margin, other.max_margin)
        self.over += other.over
        self.argmax_equal += other.argmax_equal
        if other.max_logprob_error is not None:
            self.max_logprob_error = max(self.max_logprob_error or 0.0, other.max_logprob_error)
        self.worst = sorted([*self.worst, *other.worst], key=lambda w: -w["margin"])[:5]

    def summary(self, margin: float) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "margin": margin,
            "max_margin": round(self.max_margin, 4),
            "over_margin": self.over,
            "argmax_fraction": round(self.argmax_equal / max(self.tokens, 1), 4),
            "max_logprob_error": None
            if self.max_logprob_error is None
            else round(self.max_logprob_error, 4),
            "worst": self.worst,
            "ok": self.over == 0,
        }


def agreement(
    rows: np.ndarray,
    prompt: Sequence[int],
    tokens: Sequence[int],
    *,
    margin: float,
    logprobs: Sequence[float] | None = None,
    **penalties: Any,
) -> Agreement:
    """``rows[i]``: the reference's logits for the token after ``prompt + tokens[:i]``.
    With ``penalties`` (``penalized``'s keywords) the rows are penalized as the engine's
    sampler does before the tokens are compared; ``logprobs`` are compared with the
    log-softmax of the rows as they are (the raw distribution both engines report)."""
    a = Agreement(tokens=len(tokens))
    errors: list[float] = []
    for i, tok in enumerate(tokens):
        raw = row = np.asarray(rows[i], dtype=np.float64)
        if penalties:
            row = penalized(row, [*prompt, *tokens[:i]], tokens[:i], **penalties)
        gap = float(row.max() - row[tok])
        a.argmax_equal += int(gap == 0.0)
        if gap > margin:
            a.over += 1
        if gap > a.max_margin:
            a.max_margin = gap
        if gap > 0:
            a.worst.append({"position": i, "token": int(tok), "margin": round(gap, 4)})
        if logprobs is not None:
            # Both engines report the model's own distribution, before the sampler.
            errors.append(abs(float(log_softmax(raw)[tok]) - logprobs[i]))
    a.worst = sorted(a.worst, key=lambda w: -w["margin"])[:5]
    if errors:
        a.max_logprob_error = max(errors)
    return a


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


class TransformersReference:
    """transformers' ``AutoModelForCausalLM`` on an HF model directory: greedy ids and
    teacher-forced logits. FP16 on a GPU (as exllamav2 runs), FP32 on the CPU."""

    def __init__(self, model_dir: Path, *, device: str | None = None) -> None:
        import torch
        import transformers

        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.float16 if self.device.startswith("cuda") else torch.float32
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype
        ).to(self.device)  # type: ignore[arg-type]
        self.model.eval()
        self.version = transformers.__version__

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy ids after ``prompt``, to exactly ``max_new_tokens`` (no EOS stop)."""
        torch = self.torch
        with torch.no_grad():
            ids = torch.tensor([list(prompt)], device=self.device)
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return [int(t) for t in out[0, len(prompt) :].tolist()]

    def rows(self, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Logits (float32, (len(tokens), vocab)) predicting each of ``tokens`` in turn."""
        torch = self.torch
        seq = [*prompt, *tokens]
        with torch.no_grad():
            logits = self.model(torch.tensor([seq], device=self.device)).logits[0]
        rows: np.ndarray = logits[len(prompt) - 1 : len(seq) - 1].float().cpu().numpy()
        return rows

    def next_logits(self, sequence: Sequence[int]) -> np.ndarray:
        """The logits after ``sequence`` (the stand-in generator's model in a dry run)."""
        torch = self.torch
        with torch.no_grad():
            logits = self.model(torch.tensor([list(sequence)], device=self.device)).logits
        last: np.ndarray = logits[0, -1].float().cpu().numpy()
        return last

    def check(
        self,
        prompt: Sequence[int],
        tokens: Sequence[int],
        *,
        margin: float = DEFAULT_MARGIN,
        logprobs: Sequence[float] | None = None,
        **penalties: Any,
    ) -> Agreement:
        if not tokens:
            return Agreement()
        return agreement(
            self.rows(prompt, tokens), prompt, tokens, margin=margin, logprobs=logprobs, **penalties
        )
