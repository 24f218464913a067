"""The scheduler on the tiny Llama (fp32): requests submitted concurrently from several threads get
exactly their solo greedy tokens (and seeded samples) while rows join and retire; streaming through
handles; cancel frees the row at the next step; queue/TTFT/decode timings recorded and ordered;
chunked prefill of joining requests (no call above one chunk); a failing request fails alone; bad
parameters raise at submit; rows are the scheduler's until close (closing the engine cancels and
joins it); the cache is never reallocated; the runtime (generate, stream, sessions, scheduler, chat)
imports neither torch nor transformers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from kvforge.runtime import Engine, SamplingParams

PROMPTS = [
    [0, 17, 201, 33, 90, 4, 150, 77, 12],
    [0, 5, 9],
    [0, 300, 2, 250, 61, 8],
    [0, 44],
    [0, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131],
    [0, *range(10, 60)],
    [0, 7, 7, 7],
    [0, 99, 98, 97, 96, 95],
]
NEW = [12, 5, 20, 9, 16, 7, 24, 3]


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact) as engine:
        yield engine


@pytest.fixture(scope="module")
def solo(engine):
    """Each request run alone through generate."""
    return [engine.generate([p], max_new_tokens=n)[0] for p, n in zip(PROMPTS, NEW)]


def test_concurrent_submissions_equal_solo_runs(engine, solo):
    handles: dict[int, object] = {}

    def client(indices):
        for i in indices:
            handles[i] = sched.submit(PROMPTS[i], max_new_tokens=NEW[i])
            time.sleep(0.001 * i)

    with engine.scheduler() as sched:
        threads = [threading.Thread(target=client, args=(range(t, 8, 3),)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = {i: h.result(timeout=60) for i, h in handles.items()}
    for i in range(8):
        assert results[i].token_ids == solo[i].token_ids, f"request {i}"
        assert results[i].finish_reason == solo[i].finish_reason


def test_seeded_sampling_beside_other_requests_equals_alone(engine):
    params = SamplingParams(temperature=1.0, top_k=40, seed=21)
    [alone] = engine.generate([PROMPTS[2]], max_new_tokens=16, sampling=params)
    with engine.scheduler() as sched:
        others = [sched.submit(p, 10, SamplingParams(temperature=0.9, seed=i)) for i, p in enumerate(PROMPTS[:3])]
        mine = sched.submit(PROMPTS[2], 16, params)
        others += [sched.submit(p, 8) for p in PROMPTS[4:6]]
        assert mine.result(timeout=60).token_ids == alone.token_ids
        for h in others:
            h.result(timeout=60)


def test_handles_stream_their_chunks(engine, solo):
    with engine.scheduler() as sched:
        handles = [sched.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS[:4], NEW[:4])]
        for i, h in enumerate(handles):
            chunks = list(h)
            assert [t for c in chunks for t in c.token_ids] == solo[i].token_ids
            assert "".join(c.text for c in chunks) == h.result().text == solo[i].text
            assert chunks[-1].finish_reason == solo[i].finish_reason


def test_cancel_frees_the_row_at_the_next_step(engine):
    with engine.scheduler() as sched:
        assert sched.rows == 4
        long = [sched.submit(p, max_new_tokens=80) for p in PROMPTS[:4]]  # fills every row
        first_chunk = next(iter(long[1]))
        assert len(first_chunk.token_ids) == 1
        late = sched.submit(PROMPTS[6], max_new_tokens=3)  # queued: no free row
        long[1].cancel()
        result = long[1].result(timeout=60)
        assert result.finish_reason == "cancelled" and 1 <= len(result.token_ids) < 80
        late_result = late.result(timeout=60)
        for h in (long[0], long[2], long[3]):
            h.cancel()
    # The queued request took the cancelled row while the other long ones were still running.
    others = [h.result() for h in (long[0], long[2], long[3])]
    assert result.timing.finished <= late_result.timing.admitted < min(r.timing.finished for r in others)
    assert late_result.token_ids == engine.generate([PROMPTS[6]], max_new_tokens=3)[0].token_ids


def test_queue_ttft_and_decode_times_are_recorded_in_order(engine):
    with engine.scheduler() as sched:
        handles = [sched.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, NEW)]
        results = [h.result(timeout=60) for h in handles]
    for r in results:
        t = r.timing
        assert t.submitted <= t.admitted <= t.first_token <= t.finished
        assert 0 <= t.queue_s <= t.ttft_s <= t.total_s and t.decode_s >= 0
    # 8 requests on 4 rows: the last ones waited for a row that an earlier one freed.
    assert results[-1].timing.admitted >= min(r.timing.finished for r in results[:4])
    assert results[-1].timing.queue_s > results[0].timing.queue_s


def test_joining_prefill_runs_in_chunks_and_equals_one_shot(engine, solo, monkeypatch):
    calls: list[int] = []
    original = engine.prefill_rows

    def spy(rows, start, first):
        calls.append(len(rows) * max(len(r) for r in rows))
        return original(rows, start, first)

    monkeypatch.setattr(engine, "prefill_rows", spy)
    with engine.scheduler(prefill_chunk=8) as sched:
        handles = [sched.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, NEW)]
        results = [h.result(timeout=60) for h in handles]
    assert max(calls) <= 8 and len(calls) >= 51 // 8
    assert [r.token_ids for r in results] == [r.token_ids for r in solo]


class _Broken:
    plain_greedy = False
    logprobs: list = []  # noqa: RUF012

    def __call__(self, logits):
        raise RuntimeError("sampler exploded")


def test_a_failing_request_fails_alone(engine, solo, monkeypatch):
    original = engine.request

    def request(prompt_ids, *args, **kwargs):
        gen = original(prompt_ids, *args, **kwargs)
        if prompt_ids == PROMPTS[3]:
            gen.sampler = _Broken()  # a failure inside one request while the batch runs
        return gen

    monkeypatch.setattr(engine, "request", request)
    with engine.scheduler() as sched:
        handles = [sched.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS[:3], NEW[:3])]
        bad = sched.submit(PROMPTS[3], max_new_tokens=5)
        with pytest.raises(ValueError, match="max_new_tokens"):
            sched.submit(PROMPTS[4], max_new_tokens=0)
        with pytest.raises(ValueError, match="prompt 0 has 97 tokens"):
            sched.submit([5] * 97, max_new_tokens=2)
        with pytest.raises(ValueError, match="top_p"):
            sched.submit(PROMPTS[4], sampling={"top_p": 2.0})
        with pytest.raises(ValueError, match="a prompt is a string or a list of token ids"):
            sched.submit(["two", "prompts"])
        more = sched.submit(PROMPTS[4], max_new_tokens=NEW[4])
        with pytest.raises(RuntimeError, match="sampler exploded"):
            bad.result(timeout=60)
        with pytest.raises(RuntimeError, match="sampler exploded"):
            list(bad)
        for i, h in enumerate([*handles, None, more]):
            if h is not None:
                assert h.result(timeout=60).token_ids == solo[i].token_ids


def test_the_scheduler_owns_the_rows_until_closed(engine):
    sched = engine.scheduler()
    try:
        with pytest.raises(RuntimeError, match="rows belong to its running Scheduler"):
            engine.generate([PROMPTS[0]], max_new_tokens=2)
        with pytest.raises(RuntimeError, match="rows belong to its running Scheduler"):
            engine.session()
        with pytest.raises(RuntimeError, match="rows belong to its running Scheduler"):
            engine.prefill([PROMPTS[0]])
    finally:
        sched.close()
    assert not sched._thread.is_alive()
    with pytest.raises(RuntimeError, match="the scheduler is closed"):
        sched.submit(PROMPTS[0])
    assert engine.generate([PROMPTS[1]], max_new_tokens=2)[0].token_ids


def test_a_session_runs_beside_the_scheduler(engine, solo):
    with engine.session() as s:
        s.append(PROMPTS[0])
        with engine.scheduler() as sched:
            assert sched.rows == 3
            handles = [sched.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, NEW)]
            turn = s.generate(max_new_tokens=NEW[0])
            results = [h.result(timeout=60) for h in handles]
    assert turn.token_ids == solo[0].token_ids
    assert [r.token_ids for r in results] == [r.token_ids for r in solo]


def test_cache_is_never_reallocated_by_the_scheduler(engine):
    pointer = engine.cache.buffer.ctypes.data
    with engine.scheduler(prefill_chunk=5) as sched:
        handles = [sched.submit(p, 6, SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)]
        handles[2].cancel()
        for h in handles:
            h.result(timeout=60)
    assert engine.cache.buffer.ctypes.data == pointer


def test_the_runtime_imports_neither_torch_nor_transformers(llama_chat_artifact):
    script = (
        "import sys\n"
        "from kvforge.runtime import Engine, SamplingParams\n"
        f"with Engine.load({str(llama_chat_artifact)!r}) as engine:\n"
        "    engine.generate([[0, 5, 9]], 3, SamplingParams(temperature=0.7, top_p=0.9, seed=1), stop=['x'])\n"
        "    list(engine.stream('The for', max_new_tokens=3))\n"
        "    engine.chat([{'role': 'user', 'content': 'hi'}], max_new_tokens=3)\n"
        "    with engine.session() as s:\n"
        "        s.append('The for'); s.generate(max_new_tokens=3)\n"
        "    with engine.scheduler() as sched:\n"
        "        sched.submit('The while', max_new_tokens=3).result()\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


def test_closing_the_engine_cancels_and_joins_its_scheduler(llama_artifact):
    engine = Engine.load(llama_artifact)
    sched = engine.scheduler()
    handle = sched.submit(PROMPTS[0], max_new_tokens=80)
    next(iter(handle))  # running
    engine.close()
    assert handle.result(timeout=10).finish_reason == "cancelled"
    assert not sched._thread.is_alive()


def test_random_stream_of_requests_equals_solo_runs(engine):
    """12 requests of random prompt and output lengths, a prefill chunk of 7 (prompts fill over
    several steps while rows finish and move): every request's tokens equal its solo run."""
    import numpy as np

    rng = np.random.default_rng(3)
    prompts = [[0, *rng.integers(2, 384, int(rng.integers(1, 40))).tolist()] for _ in range(12)]
    new = [int(n) for n in rng.integers(1, 20, 12)]
    expected = [engine.generate([p], max_new_tokens=n)[0].token_ids for p, n in zip(prompts, new)]
    with engine.scheduler(prefill_chunk=7) as sched:
        handles = []
        for p, n in zip(prompts, new):
            handles.append(sched.submit(p, max_new_tokens=n))
            time.sleep(float(rng.exponential(0.002)))
        got = [h.result(timeout=60).token_ids for h in handles]
    assert got == expected
