"""Prompt scoring in the scheduler (runtime/scoring.py): token logprobs equal transformers' while
requests run in other rows, in batches and chunk by chunk, and the running requests are untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge.runtime import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 8], [250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]


def reference(model, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax rows ``[n, V]`` of ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()


def check(scores, ids: list[int], rows: np.ndarray, top: int) -> None:
    assert scores.token_ids == ids and scores.logprobs[0] is None and scores.ranks[0] is None
    want = [rows[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(scores.logprobs[1:], want, atol=1e-4, rtol=0)
    for i in range(1, len(ids)):
        assert scores.ranks[i] == 1 + int((rows[i - 1] > rows[i - 1, ids[i]]).sum())
        assert [t for t, _ in scores.top[i]] == list(np.argsort(-rows[i - 1], kind="stable")[:top])


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact, threads=1) as engine:
        yield engine


def test_scores_equal_transformers_while_requests_decode(engine, llama_reference):
    alone = [r.token_ids for r in engine.generate([[1, 2, 3], [9, 8, 7]], max_new_tokens=24, sampling=GREEDY)]
    with engine.scheduler(prefill_chunk=8) as sched:  # the 18-token prompt is scored in 3 chunks
        running = [sched.submit(p, max_new_tokens=24, sampling=GREEDY) for p in ([1, 2, 3], [9, 8, 7])]
        scored = sched.score(PROMPTS, top=3).result(timeout=120)
        assert [h.result().token_ids for h in running] == alone  # the rows they decode in are untouched
    for ids, scores in zip(PROMPTS, scored):
        check(scores, ids, reference(llama_reference, ids), top=3)


def test_scored_prompt_goes_to_the_prefix_cache_and_scores_alike_after(engine):
    ids = list(range(20, 60))  # 40 tokens: two whole blocks of 16
    engine.prefix_pool.clear()
    with engine.scheduler() as sched:
        [first] = sched.score([ids], top=2).result(timeout=120)
        result = sched.submit(ids, max_new_tokens=2, sampling=GREEDY).result()
        assert result.cached_tokens == 32
        [again] = sched.score([ids], top=2).result(timeout=120)
    assert again == first


def test_score_refusals(engine, llama_chat_artifact):
    with engine.scheduler() as sched:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            sched.score([[1, 100_000]])
        with pytest.raises(ValueError, match="top must be an int in 0..20"):
            sched.score([[1, 2]], top=21)
        with pytest.raises(ValueError, match="non-empty list of token ids"):
            sched.score([[]])
    with (
        Engine.load(llama_chat_artifact, threads=1) as plain,
        plain.scheduler() as sched,
        pytest.raises(ValueError, match="no score graph"),
    ):
        sched.score([[1, 2]])


def test_a_score_job_takes_the_first_freed_row_before_queued_requests(engine):
    with engine.scheduler() as sched:
        rows = sched.rows
        running = [sched.submit([1, 2, i], max_new_tokens=20, sampling=GREEDY) for i in range(rows)]
        for handle in running:  # each has its first token: all rows are taken
            next(iter(handle))
        queued = [sched.submit([3, 4, i], max_new_tokens=40, sampling=GREEDY) for i in range(rows)]
        future = sched.score([PROMPTS[0]], top=1)  # every row is busy: it waits for one to free
        future.result(timeout=120)
        # The score took a freed row before any queued request got one: none of them has finished.
        # (The running requests finish on the same step, but their handles may be marked done a
        # moment after the score turn that follows that step: not checked here.)
        assert not any(h.done for h in queued)
