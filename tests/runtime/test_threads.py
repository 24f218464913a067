"""An Engine used from two threads without a scheduler: each call serializes or is refused.

Proves the contract of the engine's module docstring ("Threads"): concurrent ``generate`` calls
serialize and each returns exactly the tokens it returns alone; ``generate``/the step API on
another thread while a ``stream`` holds the rows are refused with RuntimeError; ``decode`` on a
thread other than the one whose ``prefill`` made the batch is refused (it would continue another
thread's sequences); a session takes one call at a time (a second thread's call is refused) while
two sessions on two threads each give their solo tokens; the cache is never reallocated.
"""

from __future__ import annotations

import threading

import pytest

from kvforge.runtime import Engine

PROMPTS = [[1, 17, 42, 99, 5], [3, 4, 5], [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact, threads=1) as e:
        yield e


def run_threads(*targets) -> list:
    """Run each target on its own thread; return the exceptions raised (in target order; None: none)."""
    errors: list = [None] * len(targets)

    def wrap(i, fn):
        try:
            fn()
        except Exception as e:
            errors[i] = e

    threads = [threading.Thread(target=wrap, args=(i, fn)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"
    return errors


def test_generate_from_two_threads_serializes(engine):
    pointer = engine.cache.buffer.ctypes.data
    alone = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=6)]
    seen: list = []

    def worker():
        for _ in range(3):
            seen.append([r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=6)])

    assert run_threads(worker, worker) == [None, None]
    assert seen == [alone] * 6
    assert engine.cache.buffer.ctypes.data == pointer


def test_other_threads_are_refused_while_a_stream_holds_the_rows(engine):
    alone = engine.generate([PROMPTS[0]], max_new_tokens=6)[0].token_ids
    stream = engine.stream(PROMPTS[0], max_new_tokens=6)
    first = next(stream)
    errors = run_threads(
        lambda: engine.generate([PROMPTS[1]], max_new_tokens=2),
        lambda: engine.prefill([PROMPTS[1]]),
        lambda: engine.scheduler(),
    )
    for error in errors:
        assert isinstance(error, RuntimeError) and "rows belong to its running Generation" in str(error)
    assert first.token_ids + [t for c in stream for t in c.token_ids] == alone  # the stream was not disturbed


def test_decode_of_another_threads_batch_is_refused(engine):
    engine.prefill([PROMPTS[0]])
    [error] = run_threads(lambda: engine.decode([5]))
    assert isinstance(error, RuntimeError)
    assert "the current batch was prefilled by another thread" in str(error)
    assert "use a session per thread" in str(error)
    engine.decode([5])  # the prefilling thread goes on


def test_step_api_on_two_threads_never_mixes_sequences(engine):
    """Each thread prefills and decodes its own prompt; a decode that would continue the other
    thread's batch is refused, so every decode that runs continues its own thread's prefill."""
    alone = {}
    for i in (0, 1):
        logits = engine.prefill([PROMPTS[i]])
        alone[i] = int(engine.decode([int(logits.argmax(-1)[0])]).argmax(-1)[0])
    got: dict = {0: [], 1: []}

    def worker(i):
        def run():
            for _ in range(10):
                with engine._lock:  # prefill + decode as one unit: the thread's own batch
                    logits = engine.prefill([PROMPTS[i]])
                    got[i].append(int(engine.decode([int(logits.argmax(-1)[0])]).argmax(-1)[0]))
                try:  # outside the unit: another thread may have prefilled meanwhile
                    engine.decode([1])
                except RuntimeError as e:
                    assert "prefilled by another thread" in str(e)

        return run

    assert run_threads(worker(0), worker(1)) == [None, None]
    assert got == {0: [alone[0]] * 10, 1: [alone[1]] * 10}


def test_a_session_takes_one_call_at_a_time(engine):
    with engine.session() as s:
        s.append(PROMPTS[0])
        stream = s.stream(max_new_tokens=4)
        next(stream)  # the turn runs on this session
        [error] = run_threads(lambda: s.generate(max_new_tokens=2))
        assert isinstance(error, RuntimeError) and "the session is busy" in str(error)
        with pytest.raises(RuntimeError, match="the session is busy"):
            s.append([1])
        stream.close()
        s.append([1])  # free again


def test_two_sessions_on_two_threads_give_their_solo_tokens(engine):
    solo = {}
    for i in (0, 1):
        with engine.session() as s:
            s.append(PROMPTS[i])
            solo[i] = s.generate(max_new_tokens=8).token_ids
    got = {}

    def worker(i):
        def run():
            with engine.session() as s:
                s.append(PROMPTS[i])
                got[i] = s.generate(max_new_tokens=8).token_ids

        return run

    assert run_threads(worker(0), worker(1)) == [None, None]
    assert got == solo
