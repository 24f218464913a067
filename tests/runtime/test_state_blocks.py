"""State snapshots in the prefix cache, KV blocks with state entries, saved sessions and the
disaggregated hand-off of a hybrid artifact (LFM2: conv-state layers 0, 2, 3 beside one attention
layer), each checked token for token against a run without it:

* the prefix pool (unit): a hybrid's prefix is found only where a snapshot ends, the longest one
  wins, snapshot bytes count against the budget, and a leaf block without a snapshot goes first;
* a chat's next turn hits the snapshot at the end of the last turn's answer, a prompt extending an
  earlier prompt hits the one at its end, the same prompt again hits whole (the snapshot keeps its
  last position's logits) and prefills nothing, a prompt sharing part of a long prompt hits the one at
  the end of a chunk of its prefill, and each answers exactly as without the prefix cache (and as
  transformers);
* a block exported at its row's length carries the row's state; a saved session restores the
  conversation with its state and continues it exactly; a file with a corrupted state, a block
  with a state of another layout, another artifact's state, and a KV block without state are
  refused before anything is written;
* a hand-off of a hybrid row between two engines (in process, and through shared memory)
  produces the tokens of one engine, and a corrupted state in transit is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from kvforge.runtime import Engine, KVBlock, KVBlockError, SamplingParams
from kvforge.runtime.kv import PrefixPool, shm
from tests.helpers import hf_greedy

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101, 64]  # 12 tokens: under one block of 16


@pytest.fixture(scope="module")
def reference(lfm2_dir):
    return transformers.Lfm2ForCausalLM.from_pretrained(lfm2_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def engine(lfm2_artifact):
    with Engine.load(lfm2_artifact, threads=1) as engine:  # the default prefix cache: on, with snapshots
        yield engine


@pytest.fixture(scope="module")
def plain(lfm2_artifact):
    with Engine.load(lfm2_artifact, threads=1, prefix_cache=0) as engine:
        yield engine


def _fresh_pool(engine: Engine) -> PrefixPool:
    engine.prefix_pool.clear()
    return engine.prefix_pool


# ------------------------------------------------------------------ the pool, alone


def _block(start: int, tokens, state: bool = False, nbytes_state: int = 64) -> KVBlock:
    data = np.zeros((1, 2, 1, len(tokens), 4), np.float32)
    st = {"past_state.0.conv": np.full(nbytes_state // 4, start, np.float32)} if state else None
    return KVBlock({}, start, tuple(tokens), data, state=st)


def _offer(pool: PrefixPool, ids, with_state: bool = True) -> int:
    return pool.offer(
        ids,
        lambda a, b: _block(a, ids[a:b]),
        lambda a: _block(a, ids[a:], state=True) if with_state else None,
    )


def test_a_hybrid_pool_finds_prefixes_only_where_a_snapshot_ends():
    pool = PrefixPool(10**6, block_tokens=4, needs_state=True)
    ids = list(range(1, 12))  # 11 tokens: whole blocks [0, 4), [4, 8), a snapshot of [8, 11)
    assert _offer(pool, ids) == 3
    assert pool.match_length([*ids, 50], limit=11) == 11
    assert pool.match_length(ids, limit=10) == 0  # the only snapshot is at 11: KV alone cannot resume
    assert _offer(pool, ids[:6]) == 1  # a snapshot at 6 under the first block
    hit = pool.acquire(ids, limit=10)
    assert hit.tokens == 6 and [(b.start, b.stop) for b in hit.blocks] == [(0, 4), (4, 6)]
    assert hit.blocks[-1].state is not None and all(b.state is None for b in hit.blocks[:-1])
    pool.release(hit)
    hit = pool.acquire([*ids, 99], limit=11)  # the longest snapshot wins
    assert hit.tokens == 11 and hit.blocks[-1].state["past_state.0.conv"][0] == 8
    pool.release(hit)
    assert _offer(pool, [7, 7, 7], with_state=False) == 0  # no state there: nothing kept
    assert pool.stats().blocks == 4


def test_a_whole_prompt_is_found_only_with_its_last_positions_logits():
    pool = PrefixPool(10**6, block_tokens=4, needs_state=True)
    ids = [1, 2, 3, 4, 5, 6]
    _offer(pool, ids[:5])  # a snapshot at 5 without logits (a chunk's end, a finished row)
    _offer(pool, ids)
    assert pool.match_length(ids, whole=True) == 5  # the one at 6 has no logits: not the whole prompt
    before = pool.stats().bytes
    logits = np.arange(8, dtype=np.float32)
    assert pool.offer(ids, lambda a, b: _block(a, ids[a:b]), lambda a: _block(a, ids[a:], state=True), logits) == 0
    assert pool.stats().bytes == before + logits.nbytes  # joined the snapshot there, counted
    logits[:] = 0  # the pool kept a copy
    hit = pool.acquire(ids, whole=True)
    assert hit.tokens == 6 and hit.logits.tolist() == list(range(8)) and hit.blocks[-1].state is not None
    pool.release(hit)
    hit = pool.acquire([*ids, 7], whole=True)  # a longer prompt resumes at 6 and has no logits from it
    assert hit.tokens == 6 and hit.logits is None
    pool.release(hit)
    pool.clear()
    assert pool.stats().bytes == 0
    plain = PrefixPool(10**6, block_tokens=4)  # without states a prompt's last token is always prefilled
    plain.offer(ids[:4], lambda a, b: _block(a, ids[a:b]))
    assert plain.match_length(ids[:4], whole=True) == 3 and plain.match_length(ids, whole=True) == 4


def test_snapshot_bytes_count_against_the_budget_and_useless_blocks_go_first():
    one = _block(0, [1, 2, 3, 4]).nbytes  # 128 bytes of KV per whole block of 4
    snap = _block(4, [5, 6], state=True).nbytes  # 64 bytes of KV and 64 of state
    pool = PrefixPool(450, block_tokens=4, needs_state=True)
    a = [1, 2, 3, 4, 5, 6]  # a block [0, 4) and a snapshot [4, 6)
    _offer(pool, a)
    assert pool.stats().bytes == one + snap == 256
    b = [9, 9, 9, 9, 8, 8, 8, 8, 7]  # two blocks (256) and a snapshot of one position (96)
    _offer(pool, b)  # evicts a's snapshot, then a's block, now a leaf without one, before anything else
    stats = pool.stats()
    assert pool.match_length(b, limit=9) == 9 and pool.match_length([*a, 0], limit=6) == 0
    assert (stats.evictions, stats.blocks, stats.bytes) == (2, 3, 2 * one + 96)


# ------------------------------------------------------------------ the prefix cache on a hybrid


def test_a_chats_next_turn_hits_the_snapshot_of_the_last_answer(engine, plain, reference):
    _fresh_pool(engine)
    with engine.scheduler() as sched:
        first = sched.submit(PROMPT, max_new_tokens=8, sampling=GREEDY).result(timeout=120)
    assert first.cached_tokens == 0
    turn = [*PROMPT, *first.token_ids, 5, 250, 31, 7, 2]  # the next turn's prompt: the last turn and a reply
    with engine.scheduler() as sched:
        second = sched.submit(turn, max_new_tokens=8, sampling=GREEDY).result(timeout=120)
    # The row held the prompt and the answer but its last token: a block of 16, a snapshot of 3 after it.
    assert second.cached_tokens == len(PROMPT) + len(first.token_ids) - 1
    [without] = plain.generate([turn], max_new_tokens=8, sampling=GREEDY)
    assert second.token_ids == without.token_ids == hf_greedy(reference, turn, 8)
    assert engine.prefix_pool.stats().hits >= second.cached_tokens


def test_a_prompt_extending_an_earlier_one_hits_the_snapshot_at_its_end(engine, plain):
    _fresh_pool(engine)
    engine.generate([PROMPT], max_new_tokens=3, sampling=GREEDY)
    longer = [*PROMPT, 40, 41, 42]
    [b] = engine.generate([longer], max_new_tokens=6, sampling=GREEDY)
    assert b.cached_tokens == len(PROMPT)  # the snapshot taken right after the first prompt's prefill
    [want] = plain.generate([longer], max_new_tokens=6, sampling=GREEDY)
    assert b.token_ids == want.token_ids


def test_the_same_prompt_again_hits_whole_and_prefills_nothing(engine, plain, monkeypatch):
    """The snapshot at a prompt's end keeps that position's logits: the same prompt again (greedy,
    or seeded sampling) imports all of it, samples its first token from them, and prefills nothing."""
    _fresh_pool(engine)
    seeded = SamplingParams(temperature=0.9, seed=7)
    [a] = engine.generate([PROMPT], max_new_tokens=5, sampling=GREEDY)
    [s] = engine.generate([[*PROMPT, 3]], max_new_tokens=5, sampling=seeded)
    calls = []
    prefill_rows = engine.prefill_rows
    monkeypatch.setattr(engine, "prefill_rows", lambda *args, **kw: calls.append(args[0]) or prefill_rows(*args, **kw))
    [again] = engine.generate([PROMPT], max_new_tokens=5, sampling=GREEDY)
    [s_again] = engine.generate([[*PROMPT, 3]], max_new_tokens=5, sampling=seeded)
    assert (again.cached_tokens, s_again.cached_tokens) == (len(PROMPT), len(PROMPT) + 1)
    assert calls == []  # nothing prefilled: the first tokens came from the kept logits, then decode steps
    [want] = plain.generate([PROMPT], max_new_tokens=5, sampling=GREEDY)
    [s_want] = plain.generate([[*PROMPT, 3]], max_new_tokens=5, sampling=seeded)
    assert again.token_ids == a.token_ids == want.token_ids and s_again.token_ids == s.token_ids == s_want.token_ids


def test_a_scored_prompt_leaves_a_snapshot_with_its_last_logits(engine, plain):
    """``score`` on a hybrid offers the scored prompt with the snapshot at its end and its last
    position's logits: generating that prompt then prefills nothing, a longer one only its rest."""
    _fresh_pool(engine)
    with engine.scheduler() as sched:
        sched.score([PROMPT]).result(timeout=120)
        whole = sched.submit(PROMPT, max_new_tokens=5, sampling=GREEDY).result(timeout=120)
        longer = sched.submit([*PROMPT, 40, 41], max_new_tokens=5, sampling=GREEDY).result(timeout=120)
    assert (whole.cached_tokens, longer.cached_tokens) == (len(PROMPT), len(PROMPT))
    want = plain.generate([PROMPT, [*PROMPT, 40, 41]], max_new_tokens=5, sampling=GREEDY)
    assert [whole.token_ids, longer.token_ids] == [w.token_ids for w in want]


def test_a_cache_point_leaves_a_snapshot_that_prompts_sharing_it_resume_from(engine, plain):
    """A shared system prompt: without a cache point the next conversation finds nothing (the only
    snapshot is at the first prompt's end); with one at the system prompt's end, the first request's
    prefill stops there once, and the next conversation resumes from it, exactly."""
    system = [(7 * i + 3) % 300 for i in range(10)]
    first, second = [*system, 40, 41, 42, 43], [*system, 90, 91, 92]
    [want] = plain.generate([second], max_new_tokens=6, sampling=GREEDY)
    [want_first] = plain.generate([first], max_new_tokens=6, sampling=GREEDY)
    for points, cached in (((), 0), ((len(system),), len(system))):
        _fresh_pool(engine)
        with engine.scheduler() as sched:
            a = sched.submit(first, max_new_tokens=6, sampling=GREEDY, cache_points=points).result(timeout=120)
            b = sched.submit(second, max_new_tokens=6, sampling=GREEDY).result(timeout=120)
        assert (a.token_ids, b.token_ids, b.cached_tokens) == (want_first.token_ids, want.token_ids, cached), points
    with engine.scheduler() as sched, pytest.raises(ValueError, match=r"cache_points=\[0\] is not accepted"):
        sched.submit(first, max_new_tokens=2, cache_points=[0])


def test_chats_sharing_a_system_prompt_resume_from_its_snapshot_through_the_openai_server(lfm2_dir, tmp_path):
    """The server marks the end of a chat's system message as a cache point on a hybrid: the next
    conversation with the same system prompt (through the official client) resumes from its
    snapshot, reported as ``cached_tokens``, and answers as an engine without the prefix cache."""
    import json
    import shutil

    import openai

    from kvforge.compile import compile_model
    from tests.conftest import CHATML_TEMPLATE
    from tests.helpers import KEY
    from tests.tools.test_serve import MODEL, running

    model = tmp_path / "model"
    shutil.copytree(lfm2_dir, model)
    config = {
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    compile_model(model, tmp_path / "out", max_batch=2, max_seq=128, score_graph=False, progress=None)
    system = {"role": "system", "content": "You answer in one short sentence about loops."}
    chats = [[system, {"role": "user", "content": q}] for q in ("What is a list", "Why use a for loop")]
    with Engine.load(tmp_path / "out", threads=1, prefix_cache=0) as plain:
        system_tokens = len(plain.chat_prompt([system], add_generation_prompt=False))
        want = [plain.generate([plain.chat_prompt(c)], max_new_tokens=6, sampling=GREEDY)[0].text for c in chats]
    with running(tmp_path / "out") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        answers = [client.chat.completions.create(model=MODEL, messages=c, max_tokens=6, temperature=0) for c in chats]
    assert [a.choices[0].message.content for a in answers] == want
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    assert cached == [0, system_tokens] and 0 < system_tokens < answers[1].usage.prompt_tokens


def test_a_long_prompt_keeps_a_snapshot_at_each_chunks_end(engine, plain):
    _fresh_pool(engine)
    document = [(11 * i + 5) % 300 for i in range(22)]
    # chunks [0, 8), [8, 16), [16, 22): a snapshot at 8, 16 and 22
    saved_chunk, engine.prefill_chunk = engine.prefill_chunk, 8
    try:
        engine.generate([document], max_new_tokens=2, sampling=GREEDY)
        question = [*document[:19], 7, 5, 9]  # the same document, another question after position 19
        [got] = engine.generate([question], max_new_tokens=6, sampling=GREEDY)
    finally:
        engine.prefill_chunk = saved_chunk
    assert got.cached_tokens == 16
    [want] = plain.generate([question], max_new_tokens=6, sampling=GREEDY)
    assert got.token_ids == want.token_ids


def test_a_session_turn_imports_a_snapshot_and_batches_stay_exact(engine, plain):
    _fresh_pool(engine)
    prompts = [PROMPT, [7, 5, 9, 250, 31], [*PROMPT, 1, 2], [11, 2]]
    with engine.scheduler() as sched:  # 4 requests on 2 rows: offers at prefill and at retirement
        got = [h.result(timeout=120) for h in [sched.submit(p, 6, GREEDY) for p in prompts]]
    want = plain.generate(prompts, max_new_tokens=6, sampling=GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    with engine.session() as session:  # a session's first turn looks up the pool too
        session.append([*PROMPT, 1, 2, 3])
        result = session.generate(max_new_tokens=6, sampling=GREEDY)
    [alone] = plain.generate([[*PROMPT, 1, 2, 3]], max_new_tokens=6, sampling=GREEDY)
    assert result.cached_tokens >= len(PROMPT) and result.token_ids == alone.token_ids


# ------------------------------------------------------------------ blocks and saved sessions


def test_a_block_at_the_rows_length_carries_its_state(engine):
    with engine.session() as session:
        session.append(PROMPT)
        session.prefill()
        with engine._lock:
            block = engine.export_kv(session.row, PROMPT)
            inner = engine.export_kv(session.row, PROMPT[:5])
            state = {k: v[session.row].copy() for k, v in engine.cache.states.items()}
        assert sorted(block.state) == ["past_state.0.conv", "past_state.2.conv", "past_state.3.conv"]
        for name, value in state.items():
            np.testing.assert_array_equal(block.state[name], value)
        assert inner.state is None  # positions inside the row: its state is not theirs
        assert block.data.shape[0] == 1 and block.nbytes == engine.kv_nbytes(len(PROMPT))
        with pytest.raises(ValueError, match="cannot carry its state, which is valid at position 12 only"):
            engine.export_kv(session.row, PROMPT[:5], with_state=True)


def test_a_saved_session_restores_the_state_and_continues_exactly(engine, reference, tmp_path):
    path = tmp_path / "chat.kvb"
    with engine.session() as session:
        session.append(PROMPT)
        session.generate(max_new_tokens=4, sampling=GREEDY)
        session.save(path)
        session.append([5, 250, 31])
        whole = session.generate(max_new_tokens=6, sampling=GREEDY)
        conversation = session.tokens[: -len(whole.token_ids)]
    assert KVBlock.load(path).state is not None
    with engine.session(restore=path) as restored:
        restored.append([5, 250, 31])
        again = restored.generate(max_new_tokens=6, sampling=GREEDY)
    assert again.token_ids == whole.token_ids == hf_greedy(reference, conversation, 6)


def _saved(engine: Engine, path) -> KVBlock:
    with engine.session() as session:
        session.append(PROMPT)
        session.generate(max_new_tokens=3, sampling=GREEDY)
        session.save(path)
    return KVBlock.load(path)


def test_corrupted_and_foreign_states_are_refused_before_anything_is_written(engine, tmp_path):
    path = tmp_path / "s.kvb"
    block = _saved(engine, path)
    raw = bytearray(path.read_bytes())
    raw[-32 - 5] ^= 0xFF  # a byte of the last state tensor (the sha256 is the last 32 bytes)
    (tmp_path / "bad.kvb").write_bytes(raw)
    with pytest.raises(KVBlockError, match="its sha256 does not match"):
        KVBlock.load(tmp_path / "bad.kvb")

    with engine.session() as session:
        row, held = session.row, int(engine.lengths[session.row])
        before = {k: v[row].copy() for k, v in engine.cache.states.items()}
        other_layout = {k: np.zeros((32, 2), v.dtype) for k, v in block.state.items()}  # another conv width
        foreign = [
            (KVBlock(block.fingerprint, 0, block.token_ids, block.data, state=other_layout), "state of another layout"),
            (
                KVBlock({**block.fingerprint, "state": []}, 0, block.token_ids, block.data, state=block.state),
                "comes from another artifact",
            ),
            (KVBlock(block.fingerprint, 0, block.token_ids, block.data), "without the row's state at position"),
        ]
        for bad, message in foreign:
            with pytest.raises(KVBlockError, match=message):
                engine.import_kv(bad, row)
            assert int(engine.lengths[row]) == held
            for name, value in before.items():
                np.testing.assert_array_equal(engine.cache.states[name][row], value)


# ------------------------------------------------------------------ disaggregated hand-off


def _hand_off(engine: Engine, prompt, sampling, alloc=None):
    with engine.scheduler(block_alloc=alloc) as sched:
        return sched.submit(prompt, 10, sampling, hand_off=True).result(timeout=120).handoff


def test_a_hand_off_of_a_hybrid_row_between_two_engines_gives_one_engines_tokens(engine, plain, lfm2_artifact):
    prompt, sampling = [*PROMPT, 40, 41], SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    [want] = plain.generate([prompt], max_new_tokens=10, sampling=sampling)
    handoff = _hand_off(engine, prompt, sampling)  # in process: the block and its state as arrays
    assert handoff.block.state is not None and handoff.checksum is not None
    with plain.scheduler() as dec:
        assert dec.resume(handoff).result(timeout=120).token_ids == want.token_ids

    alloc = shm.SegmentAllocator(arena_bytes=2**20)  # through shared memory, as the disaggregated server
    try:
        refs = [alloc.put(_hand_off(engine, prompt, sampling, alloc)) for _ in range(3)]
        assert refs[0].nbytes == engine.kv_nbytes(len(prompt)) and refs[0].header["block"]["state"] is not None
        with plain.scheduler() as dec:
            taken = shm.take(refs[0], plain.kv_fingerprint, verify=False)
            assert dec.resume(taken).result(timeout=120).token_ids == want.token_ids
            for ref, verify in zip(refs[1:], (True, False)):  # a state changed in transit: its last byte
                _corrupt_last_byte(ref)
                if verify:  # checked when taken
                    with pytest.raises(KVBlockError, match="does not match its"):
                        shm.take(ref, plain.kv_fingerprint, verify=True)
                else:  # checked by the import as it copies: the request fails, nothing imported
                    taken = shm.take(ref, plain.kv_fingerprint, verify=False)
                    with pytest.raises(KVBlockError, match="does not match its"):
                        dec.resume(taken).result(timeout=120)
    finally:
        alloc.close()


def _corrupt_last_byte(ref: shm.ShmRef) -> None:
    """Flip the last byte of ``ref``'s memory in its arena (the last state tensor's)."""
    pages = shm.map_segment(ref.name, writable=True)
    pages[ref.offset + ref.nbytes - 1] ^= 0xFF
    pages.close()


def test_the_disaggregated_server_hands_a_hybrid_row_from_its_prefill_to_its_decode_worker(lfm2_artifact, plain):
    import httpx

    from kvforge.tools.serve.disagg.router import DisaggServer
    from tests.helpers import KEY
    from tests.tools.test_serve import metric, serving

    prompts = ["The for statement iterates", "A list is a mutable"]
    expected = plain.generate(prompts, max_new_tokens=10, sampling=GREEDY)
    # lend_rows defaults to on: the prefill worker of a hybrid exports into its arena instead
    server = DisaggServer.load(
        lfm2_artifact, threads_per_worker=1, model_name="lfm2", prefill_workers=1, decode_workers=1
    )
    with serving(server) as url:
        headers = {"authorization": f"Bearer {KEY}"}
        body = {"model": "lfm2", "prompt": prompts, "max_tokens": 10, "temperature": 0}
        answer = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        assert [c["text"] for c in answer.json()["choices"]] == [e.text for e in expected]
        metrics = httpx.get(url + "/metrics", headers=headers).text
    assert metric(metrics, "kvforge_handoffs_total") >= 1
