"""The llama.cpp engine: continuous batching of many sequences on the CPU.

llama-cpp-python's own server runs one sequence at a time, so concurrent clients queue
behind each other. Decoding is memory-bound: one ``llama_decode`` over the next token of
every active sequence costs little more than over one token. So this engine drives
llama.cpp's batch API through the low-level bindings (``llama_cpp.llama_*``):

* one KV-cache sequence id per choice, on a *unified* KV cache (every sequence may use
  the whole context, and a prompt shared by n choices is stored once);
* each ``step()`` is exactly one ``llama_decode`` holding the last sampled token of every
  running choice plus a bounded chunk of prompt tokens of the jobs being admitted, so a
  long prompt delays the others by one chunk per step, never by its whole prefill;
* sampling is llama.cpp's own sampler chain, one per choice (logit bias, penalties,
  temperature, top-k, top-p, min-p, then greedy or a seeded draw); a choice whose chain
  is greedy alone takes its logits row's argmax (the same token, ~30x cheaper);
* logprobs are the log-softmax of the raw logits (before any sampling transform, as vLLM
  reports them), read straight from llama.cpp's logits buffer with numpy;
* a constrained choice (``SamplingParams.constraint``) has its own llguidance grammar
  state: before its sample the tokens the grammar forbids are set to -inf in the logits
  buffer (which the sampler chain copies), after it the token is fed back, and the
  choice ends as by EOS once the grammar is complete (workers/engines/constraint.py);
* a prefix cache (the bookkeeping: workers/engines/prefix_cache.py; applied to the KV
  and host memory: workers/engines/llamacpp_kv.py): a finished choice keeps its cells
  under its sequence id until their space or the id is needed, and a prompt starts from
  the longest prefix any sequence of its scope already decoded (``llama_memory_seq_cp``
  shares the cells, nothing is copied), so a chat's next turn prefills only what is new.
  The lookup happens when the prompt's prefill starts, not at submit, so conversations
  that arrive together still share a system prompt the first of them decoded.

Function names and signatures are those of llama-cpp-python 0.3.36 (``llama_memory_*``,
``llama_sampler_init_penalties`` taking ``n_vocab`` first, ``kv_unified`` in the context
params).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import llama_cpp as lc
import numpy as np

from app.messages import EngineFinish, TokenDelta, TokenLogprob
from workers.engines.base import ChoiceJob, Engine, EngineJob, EngineStep, JobRejected
from workers.engines.constraint import (
    ConstraintError,
    GrammarVocab,
    job_grammars,
    prepare_grammar,
)
from workers.engines.llamacpp_jobs import Entry, Job, Prefill, Seq, check_job
from workers.engines.llamacpp_kv import KvCells
from workers.engines.llamacpp_load import cpu_has_amx, load_model, new_context
from workers.engines.llamacpp_sampling import (
    choice_seed,
    grammar_vocab,
    plain_greedy,
    sampler_chain,
)
from workers.engines.logprobs import log_sum_exp, logprob, top_logprobs

if TYPE_CHECKING:
    from app.model_card import ModelCard
    from app.settings import Settings

logger = logging.getLogger(__name__)

# llama.cpp's status for "no KV cells left for this batch" (llama.h, llama_decode).
_DECODE_NO_KV_SLOT = 1
LENGTH = EngineFinish.LENGTH
# Past this many sequences a CPU step gets slow enough to hurt every stream's latency.
MAX_CAPACITY = 64
# llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h): running and cached sequence ids.
MAX_SEQ_IDS = 256
KV_FULL_MESSAGE = (
    "the server ran out of KV cache memory for this request; retry with a shorter "
    "prompt or a smaller max_tokens"
)
KV_FULL_STATUS = 503  # a capacity condition (retry), not a fault of the server's
VICTIM_BLOCK = 64  # cells: jobs within one block of each other count as the same size


class LlamaCppEngine(Engine):
    """Many sequences, one ``llama_decode`` per step, on a GGUF model (see module doc)."""

    name = "llamacpp"

    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = 8192,
        n_threads: int | None = None,
        capacity: int = 16,
        prefill_chunk: int = 256,
        context_length: int | None = None,
        extra_buffers: bool | None = None,
        prefix_cache: bool = True,
        prefix_block: int = 32,
        cache_ram_bytes: int = 0,
        hot_cells: int = 512,
        verbose: bool = False,
    ) -> None:
        """``prefix_cache``: keep finished sequences' KV for later prompts to reuse (up
        to ``MAX_SEQ_IDS - capacity`` cached sequences); ``prefix_block``: tokens freed
        at a time when the cache evicts. ``cache_ram_bytes`` > 0: finished sequences are
        also saved to host memory (up to that many bytes), and the KV keeps at most
        ``hot_cells`` cells that only cached sequences hold: every occupied cell costs
        every token of every step, a saved one costs a copy when it is needed again."""
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in 1..{MAX_CAPACITY}, not {capacity}")
        self._capacity = capacity
        self.prefix_cache = prefix_cache
        # Cached sequences need ids of their own beside the running ones.
        n_seq_ids = MAX_SEQ_IDS if prefix_cache else capacity
        self.prefill_chunk = max(1, prefill_chunk)
        threads = n_threads or os.cpu_count() or 1
        # ggml's extra weight buffers (repacked layouts, the AMX kernels) are on by
        # default; its AMX matmul crashes on batched decodes in this llama.cpp
        # (ggml-org/llama.cpp#20824; every batched test here segfaulted on an AMX CPU).
        self.extra_buffers = not cpu_has_amx() if extra_buffers is None else extra_buffers
        self._model = load_model(model_path, self.extra_buffers, verbose=verbose)
        self._n_batch = max(512, self.prefill_chunk + capacity)
        self._ctx = new_context(
            self._model,
            model_path,
            n_ctx=n_ctx,
            n_batch=self._n_batch,
            n_seq_max=n_seq_ids,
            threads=threads,
        )
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self.n_ctx = lc.llama_n_ctx(self._ctx)
        per_seq = lc.llama_n_ctx_seq(self._ctx)
        self.context_limit = min(per_seq, context_length) if context_length else per_seq
        self._batch = lc.llama_batch_init(self._n_batch, 0, capacity)
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(self._n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self._n_batch,))
        self._n_seq_id = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self._n_batch,))
        self._want = np.ctypeslib.as_array(self._batch.logits, shape=(self._n_batch,))
        # Which sequence ids hold which cells, and what they cache (llamacpp_kv.py).
        self._kv = KvCells(
            self._ctx,
            n_ctx=self.n_ctx,
            n_seq_ids=n_seq_ids,
            prefix_cache=prefix_cache,
            block=prefix_block,
            cache_ram_bytes=cache_ram_bytes,
            hot_cells=hot_cells,
        )
        self._jobs: dict[str, Job] = {}
        self._order = 0
        self.prompt_tokens_decoded = 0  # prompt tokens run through the model, since start
        self._closed = False
        self._grammar_vocab: GrammarVocab | None = None  # on the first constrained job
        self._vocab_lock = threading.Lock()  # ``prepare`` builds it on a task's thread
        logger.info(
            "llama.cpp engine: %s, n_ctx %d, %d sequences, %d threads, extra buffers %s, "
            "prefix cache %s",
            Path(model_path).name,
            self.n_ctx,
            capacity,
            threads,
            "on" if self.extra_buffers else "off",
            "on" if prefix_cache else "off",
        )

    @classmethod
    def from_card(cls, card: ModelCard, settings: Settings) -> LlamaCppEngine:
        if card.gguf_file is None:
            raise ValueError(f"model {card.name!r} has no GGUF file for the llamacpp engine")
        # Two sequences per Celery slot leaves room for n>1 jobs; bounded because a
        # CPU step over too many sequences slows every stream down.
        capacity = min(MAX_CAPACITY, settings.worker_slots * 2)
        return cls(
            card.path / card.gguf_file,
            n_ctx=settings.llamacpp_n_ctx,
            n_threads=settings.llamacpp_threads or os.cpu_count(),
            capacity=capacity,
            context_length=card.context_length,
            extra_buffers=settings.llamacpp_extra_buffers,
            prefix_cache=settings.prefix_cache,
            cache_ram_bytes=settings.llamacpp_cache_ram_mb * 2**20,
            hot_cells=settings.llamacpp_hot_cells,
        )

    @property
    def capacity(self) -> int:
        return self._capacity

    # -- the Engine interface ---------------------------------------------------------

    def prepare(self, job: EngineJob) -> None:
        prepare_grammar(job, self._vocab)

    def submit(self, job: EngineJob) -> None:
        if job.job_id in self._jobs:
            raise JobRejected(f"job {job.job_id!r} is already running")
        check_job(
            job,
            capacity=self._capacity,
            n_vocab=self.n_vocab,
            context_limit=self.context_limit,
            n_ctx=self.n_ctx,
        )
        grammars = job_grammars(job, self._vocab)
        self._order += 1
        self._jobs[job.job_id] = Job(
            job,
            self._order,
            grammars=grammars,
            greedy=plain_greedy(job.sampling),
            scope=job.cache_scope,
        )

    def cancel(self, job_id: str) -> None:
        found = self._jobs.get(job_id)
        if found is not None:
            found.cancelled = True

    def has_work(self) -> bool:
        return bool(self._jobs)

    def step(self) -> list[EngineStep]:
        out: list[EngineStep] = []
        for job in list(self._jobs.values()):
            if job.cancelled:
                self._end_job(job, EngineFinish.CANCELLED, out)
        self._admit(out)
        entries = self._plan()
        while entries:
            self._kv.make_room(len(entries))
            status = self._decode(entries)
            if status == 0:
                self._after_decode(entries, out)
                break
            if status == _DECODE_NO_KV_SLOT:
                # The largest job ends (the newest among those of about one size): one
                # that grows into the whole cache must not fail others' small ones.
                jobs = {e.job for e in entries}
                victim = max(jobs, key=lambda j: (j.cells() // VICTIM_BLOCK, j.order))
                logger.warning(
                    "KV cache full (%d/%d cells): failing job %s (%d cells)",
                    self._kv.tree.cells,
                    self.n_ctx,
                    victim.job.job_id,
                    victim.cells(),
                )
                self._end_job(victim, EngineFinish.ERROR, out, KV_FULL_MESSAGE, KV_FULL_STATUS)
                entries = [e for e in entries if e.job is not victim]
                continue
            # Any other status may leave part of the batch in the cache: drop every job
            # in it so that no sequence continues from a state we cannot vouch for.
            logger.error("llama_decode failed with status %d; failing its jobs", status)
            for job in {e.job for e in entries}:
                for s in job.seqs:
                    s.trusted = False
                self._end_job(job, EngineFinish.ERROR, out, "the model failed on this request")
            break
        self._kv.trim_hot()
        return out

    def stats(self) -> dict[str, float]:
        """``cache_usage``: the fraction of the KV cells running sequences hold (cells
        kept only for the prefix cache are free to take); the prefix cache's cells
        (gauge) and, since start, prompt tokens looked up, found, and cells evicted
        (counters: hits / queries is the hit rate)."""
        return self._kv.stats()

    def prefix_blocks(self) -> frozenset[bytes] | None:
        return self._kv.prefix_blocks()

    @property
    def kv_pinned(self) -> int:
        """KV cells held by running sequences (the rest is the prefix cache's)."""
        return self._kv.pinned

    @property
    def running_sequences(self) -> int:
        return self._kv.running

    @property
    def restored_tokens(self) -> int:
        """Prompt tokens brought back from host memory, since start."""
        return self._kv.restored_tokens

    @property
    def hot_cells(self) -> int:
        return self._kv.hot_cells

    def check_kv(self) -> None:
        """Raise unless llama.cpp's KV holds exactly what the prefix tree says. For tests."""
        self._kv.check()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for job in list(self._jobs.values()):
            self._end_job(job, EngineFinish.CANCELLED, [])
        lc.llama_batch_free(self._batch)
        lc.llama_free(self._ctx)
        lc.llama_model_free(self._model)

    # -- scheduling -------------------------------------------------------------------

    def _admit(self, out: list[EngineStep]) -> None:
        """Give waiting jobs sequence ids, first come first served.

        A job waits while there are too few running slots or KV cells for its prompt
        (plus one cell per running sequence for this step). Cells the prefix cache
        holds count as free: they are evicted when needed. A job blocks the jobs
        behind it, so a large n is not starved by a stream of small jobs.
        """
        waiting = [j for j in self._jobs.values() if not j.admitted and not j.cancelled]
        if not waiting:
            return
        running = sum(job.live for job in self._jobs.values() if job.admitted)
        pending_prompt = sum(
            len(p.tokens) - p.done for job in self._jobs.values() for p in job.prefills
        )
        pinned = self.kv_pinned
        for job in waiting:
            ej = job.job
            choices = [c for c in ej.choices if c.max_new_tokens > 0]
            share = len(choices) > 1 and not any(c.prefix_ids for c in choices)
            prompts = (
                [list(ej.prompt_ids)]
                if share
                else [[*ej.prompt_ids, *c.prefix_ids] for c in choices]
            )
            # What the prefix cache holds now is a fair guess of what it will hold when
            # the prefill starts; a wrong guess costs an eviction or a KV-full error.
            need = sum(len(t) - self._kv.peek(job.scope, t) for t in prompts)
            headroom = running + len(choices)
            if self._kv.running + len(choices) > self._capacity or (
                pinned + pending_prompt + need + headroom > self.n_ctx and running
            ):
                break
            job.admitted = True
            for c in ej.choices:
                if c.max_new_tokens <= 0:  # a resume with nothing left to generate
                    out.append(EngineStep(ej.job_id, TokenDelta(c.index, [], finish=LENGTH)))
            seqs = self._seat(job, choices, prompts, share)
            running += len(seqs)
            pending_prompt += need
            if not seqs:
                del self._jobs[ej.job_id]

    def _seat(
        self, job: Job, choices: list[ChoiceJob], prompts: list[list[int]], share: bool
    ) -> list[Seq]:
        """Give an admitted job's choices their sequence ids, sampler chains and
        prefills: one prefill shared by every choice (``share``), else one each."""
        ej = job.job
        seqs = [
            Seq(
                seq_id=self._kv.take_id(job.scope),
                job=job,
                index=c.index,
                chain=sampler_chain(ej, c.index, c.prefix_ids, self.n_vocab, self.context_limit),
                max_new=c.max_new_tokens,
                generated=len(c.prefix_ids),
                grammar=job.grammars.get(c.index),
            )
            for c in choices
        ]
        job.seqs = seqs
        if share:
            job.prefills.append(Prefill(prompts[0], seqs))
        else:
            for s, tokens in zip(seqs, prompts, strict=True):
                job.prefills.append(Prefill(tokens, [s]))
        return seqs

    def _start_prefill(self, job: Job, p: Prefill) -> None:
        """The prefill starts after the longest cached prefix (``KvCells.start``)."""
        p.started = True
        p.done = self._kv.start(job.scope, p.tokens, [s.seq_id for s in p.seqs])
        if self.prefix_cache and job.cached_tokens is None:
            job.cached_tokens = min(p.done, len(job.job.prompt_ids))

    def _plan(self) -> list[Entry]:
        """This step's batch: every running sequence's last token, then prompt chunks."""
        entries: list[Entry] = []
        for job in self._jobs.values():
            for s in job.seqs:
                if not s.done and s.last >= 0:
                    entries.append(Entry(s.last, s.pos, [s.seq_id], True, job, seq=s))
        # With nothing to decode no one waits on the prefill: use the whole batch.
        budget = self.prefill_chunk if entries else self._n_batch
        budget = min(budget, self._n_batch - len(entries))
        # One prompt (or one prompt shared by sibling choices) per step: in this
        # llama.cpp build a unified-KV ubatch holding several tokens of each of two or
        # more sequences yields wrong logits (checked against one-sequence decodes),
        # while decode tokens of many sequences plus one prompt chunk are bit-exact.
        for job in self._jobs.values():
            if job.prefills and budget > 0:
                p = job.prefills[0]
                if not p.started:
                    self._start_prefill(job, p)
                ids = [s.seq_id for s in p.seqs]
                end = min(len(p.tokens), p.done + budget)
                for i in range(p.done, end):
                    last = i == len(p.tokens) - 1
                    entries.append(Entry(p.tokens[i], i, ids, last, job, prefill=p))
                break
        return entries

    def _decode(self, entries: list[Entry]) -> int:
        n = len(entries)
        self._batch.n_tokens = n
        self._tokens[:n] = [e.token for e in entries]
        self._pos[:n] = [e.pos for e in entries]
        self._n_seq_id[:n] = [len(e.seq_ids) for e in entries]
        self._want[:n] = [e.logits for e in entries]
        seq_id = self._batch.seq_id
        for i, e in enumerate(entries):
            row = seq_id[i]
            for j, sid in enumerate(e.seq_ids):
                row[j] = sid
        return int(lc.llama_decode(self._ctx, self._batch))

    def _after_decode(self, entries: list[Entry], out: list[EngineStep]) -> None:
        """Account the decoded tokens, then sample every sequence that got logits."""
        to_sample: list[tuple[int, list[Seq]]] = []
        kv = self._kv
        prompt: list[int] = []
        for i, e in enumerate(entries):
            if e.seq is not None:
                e.seq.pos += 1
                kv.extend([e.seq.seq_id], [e.token])
                to_sample.append((i, [e.seq]))
                continue
            p = e.prefill
            assert p is not None
            p.done += 1
            prompt.append(e.token)
            if e.logits:
                e.job.prefills.remove(p)
                for s in p.seqs:
                    s.pos = len(p.tokens)
                to_sample.append((i, p.seqs))
        if prompt:  # one prefill's chunk per step (_plan), contiguous at the batch's end
            p = entries[-1].prefill
            assert p is not None
            kv.extend([s.seq_id for s in p.seqs], prompt)
            self.prompt_tokens_decoded += len(prompt)
        for idx, seqs in to_sample:
            self._sample(idx, seqs, out)

    # -- sampling ---------------------------------------------------------------------

    def _vocab(self) -> GrammarVocab:
        with self._vocab_lock:  # ``prepare`` runs on the threads handing jobs over
            if self._grammar_vocab is None:
                self._grammar_vocab = grammar_vocab(self._model)
            return self._grammar_vocab

    def _sample(self, idx: int, seqs: list[Seq], out: list[EngineStep]) -> None:
        """Sample the next token of ``seqs`` (siblings share one logits row) from the
        ``idx``-th batch token's logits and publish it."""
        owner = seqs[0].job
        job = owner.job
        k = job.sampling.logprobs
        stops = job.all_stop_ids
        # The grammar decides where a constrained output ends: min_tokens does not apply.
        constrained = seqs[0].grammar is not None
        needs_mask = constrained or (
            bool(stops) and any(s.generated < job.min_tokens for s in seqs)
        )
        row: np.ndarray | None = None
        lse = 0.0
        top: list[tuple[int, float]] = []
        if k is not None or needs_mask or owner.greedy:
            ptr = lc.llama_get_logits_ith(self._ctx, idx)
            row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        if k is not None and row is not None:
            # Raw logits, before bias, penalties, the grammar or the min_tokens mask.
            lse = log_sum_exp(row)
            top = top_logprobs(row, k, lse)
        # Siblings share the row and each grammar masks it differently after the first.
        raw = row.copy() if constrained and row is not None and len(seqs) > 1 else None
        for i, s in enumerate(seqs):
            if raw is not None and row is not None and i:
                row[:] = raw
            try:
                tok = self._pick(s, idx, row, stops)
            except ConstraintError as exc:
                logger.warning("job %s choice %d: %s", job.job_id, s.index, exc)
                delta = TokenDelta(
                    s.index, [], finish=EngineFinish.ERROR, error=str(exc), error_code=400
                )
                out.append(EngineStep(job.job_id, delta))
                self._free_seq(s)
                continue
            lps = None
            if k is not None and row is not None:
                # The sampled token is never masked: row[tok] is its raw logit.
                lps = [TokenLogprob(tok, logprob(row, tok, lse), list(top))]
            self._advance(s, tok, lps, stops, out)
        if not owner.live:
            self._jobs.pop(job.job_id, None)

    def _pick(self, s: Seq, idx: int, row: np.ndarray | None, stops: frozenset[int]) -> int:
        """The next token of one choice from the ``idx``-th batch token's logits (``row``,
        when read): masked by its grammar or by min_tokens, then its sampler chain."""
        grammar = s.grammar
        job = s.job.job
        if grammar is not None and row is not None:
            # The sampler copies the logits buffer: editing it is the mask.
            grammar.mask_logits(row, s.max_new - s.new)
        elif stops and s.generated < job.min_tokens and row is not None:
            row[list(stops)] = -np.inf  # min_tokens bans the stop ids
        if s.job.greedy and row is not None:
            tok = int(row.argmax())  # what the greedy chain picks, ~30x cheaper
        else:
            tok = int(lc.llama_sampler_sample(s.chain, self._ctx, idx))
        if grammar is not None and tok not in stops:
            grammar.consume(tok)
        return tok

    def _advance(
        self,
        s: Seq,
        tok: int,
        lps: list[TokenLogprob] | None,
        stops: frozenset[int],
        out: list[EngineStep],
    ) -> None:
        """Publish a choice's sampled token; end the choice on a stop id (after
        min_tokens), a complete grammar or its length."""
        job = s.job.job
        if s.grammar is not None:
            ends = tok in stops or s.grammar.complete
        else:
            ends = tok in stops and s.generated >= job.min_tokens
        s.generated += 1
        s.new += 1
        finish = EngineFinish.EOS if ends else (LENGTH if s.new >= s.max_new else None)
        delta = TokenDelta(s.index, [tok], lps, finish)
        if s.new == 1 or finish is not None:
            # With the first token: a stop string may end the choice in the streamer
            # before its finish comes, and the usage it sends then must have the count.
            delta.cached_tokens = s.job.cached_tokens
        out.append(EngineStep(job.job_id, delta))
        if finish is None:
            s.last = tok
        else:
            self._free_seq(s)

    # -- freeing ----------------------------------------------------------------------

    def _free_seq(self, s: Seq) -> None:
        """The choice is over: its cells stay in the prefix cache (or are freed)."""
        if s.done:
            return
        s.done = True
        lc.llama_sampler_free(s.chain)
        self._kv.free(s.seq_id, s.job.scope, keep=s.trusted)
        if not s.job.live:
            s.job.prefills.clear()

    def _end_job(
        self,
        job: Job,
        finish: EngineFinish,
        out: list[EngineStep],
        error: str | None = None,
        error_code: int | None = None,
    ) -> None:
        """End every unfinished choice of ``job`` with ``finish`` and free them."""
        ej = job.job
        finished = {s.index for s in job.seqs if s.done}
        for s in job.seqs:
            self._free_seq(s)
        for c in ej.choices:
            if c.index in finished or (job.admitted and c.max_new_tokens <= 0):
                continue  # already reported
            out.append(
                EngineStep(
                    ej.job_id,
                    TokenDelta(
                        c.index,
                        [],
                        finish=finish,
                        error=error,
                        error_code=error_code,
                        cached_tokens=job.cached_tokens,
                    ),
                )
            )
        self._jobs.pop(ej.job_id, None)


__all__ = ["KV_FULL_MESSAGE", "LlamaCppEngine", "choice_seed"]
