"""Prompt scoring: the log-probability of each prompt token given the tokens before it, from the
score graph (the logits of every position), run on a scheduler's free cache rows.

    with engine.scheduler() as sched:
        [scores] = sched.score([[1, 2, 3]], top=2).result()
        scores.logprobs        # [None, log p(2 | 1), log p(3 | 1 2)]
        scores.top[1]          # [(id, logprob), (id, logprob)]: position 1's two likeliest tokens

This is what evaluation harnesses call "loglikelihood" (lm-evaluation-harness through
``echo`` + ``logprobs`` on ``/v1/completions``, vLLM's ``prompt_logprobs``). The first token has
no logprob (nothing comes before it; OpenAI returned ``null``).

Batches. :meth:`~kvforge.runtime.scheduler.Scheduler.score` queues a :class:`ScoreJob`; between
its batch loop's steps the scheduler thread scores the job's next prompts that fit together in
the free rows and in one chunk (``rows × longest ≤ chunk``) with one score call
(:func:`score_next`), so running requests are delayed by one score call at a time. A prompt longer
than the chunk is scored alone, chunk after chunk (``start > 0``) within one turn: its row must
not be given to a request between two chunks.

Prefix cache. Logprobs need the logits of every prompt position, which the prefix pool does not
keep (it holds KV), so a scored prompt is computed whole even when the pool holds its prefix (vLLM
skips the prefix cache lookup for prompt-logprob requests for the same reason); its KV is then
offered to the pool, so a generation that continues it (an eval's context) starts from a hit.

Precision: log-softmax in float32 over the graph's logits (the artifact's dtype, upcast).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvforge.runtime.engine import StepEngine

MAX_TOP = 20  # top alternatives per position, as OpenAI's logprobs allow


@dataclass(frozen=True)
class PromptScores:
    """One prompt's scores, one entry per prompt token (index 0: no context, so None / [])."""

    token_ids: list[int]
    logprobs: list[float | None]  # log p(token_i | tokens_<i)
    ranks: list[int | None]  # 1 + how many tokens the model found likelier at that position
    top: list[list[tuple[int, float]]]  # the ``top`` likeliest (id, logprob) at each position, best first


@dataclass
class ScoreJob:
    """Prompts queued for scoring; ``future`` gets one :class:`PromptScores` per prompt, in order
    (or the error of the score call that failed). Cancelling the future drops what is left."""

    prompts: list[list[int]]
    top: int
    done: int = 0  # prompts scored so far (in order)
    results: list[PromptScores] = field(default_factory=list)
    future: Future = field(default_factory=Future)

    def finish(self, error: BaseException | None = None) -> None:
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: nobody waits
            if error is None:
                self.future.set_result(self.results)
            else:
                self.future.set_exception(error)


def check_prompts(prompts: object, top: object, vocab_size: int, max_seq: int) -> tuple[list[list[int]], int]:
    """``prompts`` as lists of token ids in ``[0, vocab_size)``, 1..``max_seq`` tokens each, and
    ``top`` in ``0..MAX_TOP``; ValueError naming the first problem otherwise."""
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP:
        raise ValueError(f"top must be an int in 0..{MAX_TOP} (alternatives per position), got {top!r}")
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, ids in enumerate(prompts):
        if not isinstance(ids, Sequence) or isinstance(ids, str) or not ids:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt {i} holds something other than int token ids")
        bad = [int(t) for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if len(ids) > max_seq:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; a cache row holds at most max_seq={max_seq} "
                "(recompile with a larger --max-seq)"
            )
        out.append([int(t) for t in ids])
    return out, top


def position_scores(
    logits: np.ndarray, targets: Sequence[int], top: int
) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    """Scores of ``targets[i]`` under ``logits[i]`` (``[m, V]``, m = len(targets)): logprobs,
    ranks and each position's ``top`` likeliest (id, logprob), best first."""
    m = len(targets)
    if m == 0:
        return [], [], []
    x = logits[:m].astype(np.float32)  # (m, V)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))  # log-softmax
    picked = x[np.arange(m), np.asarray(targets)]  # (m,)
    ranks = (x > picked[:, None]).sum(axis=-1) + 1
    tops: list[list[tuple[int, float]]] = [[] for _ in range(m)]
    if top:
        ids = np.argpartition(-x, top - 1, axis=-1)[:, :top]  # (m, top), unordered
        vals = np.take_along_axis(x, ids, axis=-1)
        order = np.argsort(-vals, axis=-1, kind="stable")
        ids, vals = np.take_along_axis(ids, order, axis=-1), np.take_along_axis(vals, order, axis=-1)
        tops = [list(zip(map(int, i), map(float, v))) for i, v in zip(ids, vals)]
    return [float(v) for v in picked], [int(r) for r in ranks], tops


def score_next(engine: StepEngine, job: ScoreJob, first: int, free: int, chunk: int) -> None:
    """Score the job's next prompts in cache rows ``[first, first + free)`` (free, and owned by the
    caller, which holds the engine's lock): as many as fit together in the rows and in ``chunk``
    tokens (one score call), or one longer prompt chunk by chunk. Appends to ``job.results``."""
    prompts = job.prompts[job.done :]
    group, longest = [], 0
    for ids in prompts:
        if len(group) == free or max(longest, len(ids)) * (len(group) + 1) > chunk:
            break
        group.append(ids)
        longest = max(longest, len(ids))
    if group:
        logits = engine.score_rows(group, [0] * len(group), first)  # (B, S, V)
        for b, ids in enumerate(group):
            lps, ranks, tops = position_scores(logits[b], ids[1:], job.top)
            job.results.append(PromptScores(ids, [None, *lps], [None, *ranks], [[], *tops]))
            _offer(engine, ids, first + b, logits[b, len(ids) - 1])
        job.done += len(group)
        return
    ids = prompts[0]  # longer than a chunk: alone, chunk after chunk in one row
    lps, ranks, tops = [], [], []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        logits = engine.score_rows([piece], [start], first)[0]  # (len(piece), V)
        part = position_scores(logits, ids[start + 1 : start + 1 + len(piece)], job.top)
        lps += part[0]
        ranks += part[1]
        tops += part[2]
    job.results.append(PromptScores(ids, [None, *lps], [None, *ranks], [[], *tops]))
    _offer(engine, ids, first, logits[-1])
    job.done += 1


def _offer(engine: StepEngine, ids: list[int], row: int, last: np.ndarray) -> None:
    """The scored prompt's KV (every position was fed) to the prefix pool, if there is one; with
    states, the snapshot at its end and ``last``, its last position's logits (the same prompt
    generated from then hits whole)."""
    pool = engine.prefix_pool
    if pool is None:
        return

    def snapshot(start: int):
        if int(engine.lengths[row]) != len(ids):
            return None  # the row's state is not at the prompt's end
        return engine.export_kv(row, ids[start:], start=start, with_state=True)

    def export(start: int, stop: int):
        return engine.export_kv(row, ids[start:stop], start=start, with_state=False)

    pool.offer(ids, export, snapshot if pool.needs_state else None, last if pool.needs_state else None)
