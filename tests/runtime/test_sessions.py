"""Sessions and chunked prefill on the tiny Llama (fp32): a turn prefills only its new tokens and
gives the logits (within 1e-5) and greedy tokens of prefilling the whole conversation from scratch;
rewind(n) equals a fresh session without those tokens; prompts longer than the prefill chunk are
prefilled in chunks and equal one-shot prefill (sessions, generate, stream); a session's row is
its own while generate runs beside it; chat turns through a session equal Engine.chat; the cache
is never reallocated."""

from __future__ import annotations

import pytest

from kvforge.runtime import Engine, SamplingParams
from tests.helpers import assert_close

A = [0, 17, 201, 33, 90, 4, 150, 77, 12]
B = [44, 61, 8, 250]
LONG = [0, *range(120, 170)]  # 51 tokens


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact) as engine:
        yield engine


@pytest.fixture
def no_prefix_cache(engine):
    """The prefix cache off, for tests that count prefill calls (a cache hit makes fewer)."""
    saved, engine.prefix_pool = engine.prefix_pool, None
    yield
    engine.prefix_pool = saved


@pytest.fixture
def small_chunks(engine):
    saved = engine.prefill_chunk
    engine.prefill_chunk = 4
    yield 4
    engine.prefill_chunk = saved


def _fresh_logits(engine, tokens):
    return engine.prefill([tokens])[0].copy()


def test_turns_prefill_only_new_tokens_and_equal_prefilling_from_scratch(engine, monkeypatch):
    prefilled: list[tuple[int, int]] = []  # (start, tokens) of every prefill call
    original = engine.prefill_rows

    def spy(rows, start, first):
        prefilled.extend((s, len(r)) for r, s in zip(rows, start))
        return original(rows, start, first)

    with engine.session() as s:
        s.append(A)
        assert_close(s.prefill(), _fresh_logits(engine, A), 1e-5, 1e-5, "turn 1 logits")
        r1 = s.generate(max_new_tokens=8)
        assert r1.token_ids == engine.generate([A], max_new_tokens=8)[0].token_ids
        assert s.tokens == A + r1.token_ids and s.cached == len(A) + 7
        s.append(B)
        history = A + r1.token_ids + B
        monkeypatch.setattr(engine, "prefill_rows", spy)
        logits = s.prefill()
        monkeypatch.undo()
        assert prefilled == [(len(A) + 7, 1 + len(B))]  # the last generated token and the new turn only
        assert_close(logits, _fresh_logits(engine, history), 1e-5, 1e-5, "turn 2 logits")
        r2 = s.generate(max_new_tokens=8)
        assert r2.token_ids == engine.generate([history], max_new_tokens=8)[0].token_ids
        assert r2.prompt_tokens == len(history)


def test_rewind_equals_a_fresh_session_without_those_tokens(engine):
    with engine.session() as s, engine.session() as fresh:
        s.append(A)
        s.generate(max_new_tokens=6)
        s.append(B)
        s.rewind(len(B) + 6)
        assert s.tokens == A
        fresh.append(A)
        assert_close(s.prefill(), fresh.prefill(), 1e-5, 1e-5, "rewound logits")
        turn = s.generate(max_new_tokens=10).token_ids
        assert turn == fresh.generate(max_new_tokens=10).token_ids
        s.rewind(3)  # into the cached part
        assert s.tokens == A + turn[:7] and s.cached == len(A) + 7
        assert_close(s.prefill(), _fresh_logits(engine, A + turn[:7]), 1e-5, 1e-5, "logits after rewind")
        with pytest.raises(ValueError, match="n_tokens must be an integer in \\[0, "):
            s.rewind(len(s.tokens) + 1)


def test_session_prefill_in_chunks_equals_one_shot(engine, small_chunks):
    one_shot = _fresh_logits(engine, LONG)  # the step API prefills in one call
    with engine.session() as s:
        s.append(LONG)
        assert_close(s.prefill(), one_shot, 1e-5, 1e-5, "chunked session prefill")
        got = s.generate(max_new_tokens=10).token_ids  # all cached: the last token is fed again
    engine.prefill_chunk = 10_000
    expected = engine.generate([LONG], max_new_tokens=10)[0].token_ids
    assert got == expected


def test_generate_and_stream_prefill_long_prompts_in_chunks(engine, small_chunks, no_prefix_cache, monkeypatch):
    calls: list[int] = []
    original = engine.prefill_rows

    def spy(rows, start, first):
        calls.append(len(rows) * max(len(r) for r in rows))
        return original(rows, start, first)

    monkeypatch.setattr(engine, "prefill_rows", spy)
    chunked = engine.generate([LONG, A], max_new_tokens=10)
    streamed = [t for c in engine.stream(LONG, max_new_tokens=10) for t in c.token_ids]
    monkeypatch.undo()
    assert max(calls) <= 4 and len(calls) > 51 // 4
    engine.prefill_chunk = 10_000
    one_shot = engine.generate([LONG, A], max_new_tokens=10)
    assert [r.token_ids for r in chunked] == [r.token_ids for r in one_shot]
    assert streamed == one_shot[0].token_ids


def test_a_session_row_is_its_own_while_generate_runs(engine):
    with engine.session() as s:
        assert s.row == engine.max_batch - 1 and engine.general_rows() == engine.max_batch - 1
        s.append(A)
        first = s.generate(max_new_tokens=5)
        # generate runs on the other rows (more prompts than rows: in-flight) and leaves this one alone
        others = engine.generate([B, A, LONG, [0, 5, 9], [0, 44]], max_new_tokens=12)
        assert [r.token_ids for r in others[:2]] == [
            engine.generate([p], max_new_tokens=12)[0].token_ids for p in (B, A)
        ]
        second = s.generate(max_new_tokens=5)
        whole = engine.generate([A + first.token_ids], max_new_tokens=5)[0]
        assert second.token_ids == whole.token_ids
        with pytest.raises(RuntimeError, match="sessions hold rows \\[3, 4\\)"):
            engine.prefill([A] * 4)
    assert engine.general_rows() == engine.max_batch


def test_sessions_take_rows_from_the_top_and_give_them_back(engine):
    sessions = [engine.session() for _ in range(engine.max_batch)]
    assert [s.row for s in sessions] == [3, 2, 1, 0]
    with pytest.raises(RuntimeError, match="every cache row .* is held by a session"):
        engine.session()
    with pytest.raises(RuntimeError, match="sessions hold rows \\[0, 4\\)"):
        engine.generate([A], max_new_tokens=2)
    sessions[0].close()
    assert engine.session().row == 3
    for s in sessions:
        s.close()
    engine._session_rows.clear()


def test_seeded_sampling_in_a_session_equals_generate(engine):
    params = SamplingParams(temperature=1.0, seed=4)
    with engine.session() as s:
        s.append(A)
        assert s.generate(12, params).token_ids == engine.generate([A], 12, params)[0].token_ids


def test_session_chat_turns_equal_engine_chat(llama_chat_artifact):
    with Engine.load(llama_chat_artifact) as engine, engine.session() as s:
        messages = [{"role": "user", "content": "The for statement?"}]
        r1 = s.chat(messages, max_new_tokens=8)
        assert r1.token_ids == engine.chat(messages, max_new_tokens=8).token_ids
        messages += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And while?"}]
        before = len(s.tokens)
        r2 = s.chat(messages, max_new_tokens=8)
        assert r2.token_ids == engine.chat(messages, max_new_tokens=8).token_ids
        assert s.cached >= len(engine.chat_prompt(messages[:1])) and before > 0


def test_bad_session_use(engine):
    with engine.session() as s:
        with pytest.raises(ValueError, match="the session is empty; append a prompt first"):
            s.generate(max_new_tokens=2)
        with pytest.raises(ValueError, match="would hold 97 tokens; its cache row holds max_seq=96"):
            s.append([5] * 97)
        with pytest.raises(ValueError, match="token id 384 is outside the vocabulary"):
            s.append([0, 384])
        with pytest.raises(ValueError, match="max_new_tokens"):
            s.append(A)
            s.generate(max_new_tokens=0)
    with pytest.raises(RuntimeError, match="the session is closed"):
        s.append(A)


def test_cache_is_never_reallocated_by_sessions(engine, small_chunks):
    pointer = engine.cache.buffer.ctypes.data
    with engine.session() as s:
        s.append(LONG)
        s.generate(max_new_tokens=6)
        s.rewind(10)
        s.append(B)
        list(s.stream(max_new_tokens=4))
    assert engine.cache.buffer.ctypes.data == pointer


def test_prompts_longer_than_max_prompt_are_prefilled_in_chunks(engine, no_prefix_cache, monkeypatch):
    """An artifact whose prefill takes at most ``max_prompt`` tokens per call (a TensorRT profile)
    still takes prompts up to ``max_seq``: generation and sessions prefill them in max_prompt chunks."""
    import dataclasses

    one_shot = engine.generate([LONG], max_new_tokens=8)[0].token_ids
    one_shot_logits = _fresh_logits(engine, LONG)
    manifest = engine.manifest
    limited = dataclasses.replace(manifest, limits=dataclasses.replace(manifest.limits, max_prompt=8))
    monkeypatch.setattr(engine, "manifest", limited)
    calls: list[int] = []
    original = engine.prefill_rows

    def spy(rows, start, first):
        calls.append(max(len(r) for r in rows))
        return original(rows, start, first)

    monkeypatch.setattr(engine, "prefill_rows", spy)
    assert engine.chunk_tokens == 8
    assert engine.generate([LONG], max_new_tokens=8)[0].token_ids == one_shot
    with engine.session() as s:
        s.append(LONG)
        assert_close(s.prefill(), one_shot_logits, 1e-5, 1e-5, "max_prompt-chunked session prefill")
    assert max(calls) == 8 and len(calls) == 2 * 7  # 51 tokens: 7 chunks, twice
