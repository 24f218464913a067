"""KV blocks and the automatic prefix cache on the tiny Llama (fp32).

Proves: a KV block exported from a row and imported into another gives the logits of a
from-scratch prefill (within 1e-5) and round-trips through a file byte for byte; a block from
another artifact (lowering), another dtype, or longer than a row is refused, and so is a truncated
or corrupted file; through ``generate`` and the scheduler, a hit, a miss and a partial hit import
exactly the cached whole blocks (``cached_tokens``), prefill the rest and give the same greedy
tokens and first-token logprobs (1e-5) as an engine without the cache; two requests sharing a
prefix in one batch are both correct; rows offered before compaction moves them hold their own
KV; a small budget evicts least recently used leaves and never a pinned block; a saved session
restored (in another row or another engine) continues exactly as the uninterrupted one; the
pool's statistics count queries and hits as vLLM's do."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.kv import KVBlock, KVBlockError, PrefixPool, parse_bytes
from kvforge.runtime.kv.prefix_pool import common_prefix

BT = 4  # tokens per pool block in these tests (the rows hold 96 positions)
PROMPT = [0, *range(20, 40)]  # 21 tokens
OTHER = [0, *range(200, 215)]
PARTIAL = [*PROMPT[:10], 300, 301, 302, 303, 304]  # shares 10 tokens (2 whole blocks + 2) with PROMPT
LOGPROBS = SamplingParams(logprobs=3)


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact) as engine:
        yield engine


@pytest.fixture(scope="module")
def plain(llama_artifact):
    """The same artifact without a prefix cache: the reference."""
    with Engine.load(llama_artifact, prefix_cache=0) as engine:
        yield engine


@pytest.fixture
def pool(engine):
    """A fresh pool of 4-token blocks on ``engine`` for each test."""
    engine.prefix_pool = PrefixPool(parse_bytes("64MiB"), block_tokens=BT)
    yield engine.prefix_pool
    engine.prefix_pool = None


def test_default_pool_and_parse_bytes(llama_artifact, engine, plain):
    assert plain.prefix_pool is None
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2GB") == 2 * 10**9 and parse_bytes(0) == 0
    with pytest.raises(ValueError, match="'512 parsecs' is not accepted"):
        parse_bytes("512 parsecs")
    with Engine.load(llama_artifact) as fresh:
        assert fresh.prefix_pool.budget == 512 * 2**20 and fresh.prefix_pool.block_tokens == 16


# ------------------------------------------------------------------ KV blocks


def test_common_prefix_of_token_sequences():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix((1, 2, 3), (1, 2, 3, 4)) == 3
    assert common_prefix([5], [6]) == 0 and common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], (1, 2, 7)) == 2  # a list against a tuple: compared as the first's type
    a = list(range(1000))
    assert common_prefix(a, [*a[:777], -1, *a[778:]]) == 777


def test_block_import_gives_the_logits_of_a_full_prefill(engine, plain):
    engine.prefix_pool = None
    full = plain.prefill([PROMPT])[0].copy()
    k = 13
    engine.prefill_rows([PROMPT[:k]], [0], first=0)
    block = engine.export_kv(0, PROMPT[:k])
    assert block.data.shape == (2, 2, 2, k, 16) and block.data.flags.c_contiguous and block.n == k
    engine.prefill_rows([OTHER], [0], first=2)  # row 2 holds something else first
    engine.import_kv(block, 2)
    assert engine.lengths[2] == k
    logits = engine.prefill_rows([PROMPT[k:]], [k], first=2)[0]
    np.testing.assert_allclose(logits, full, atol=1e-5, rtol=0)


def test_block_file_round_trip(engine, tmp_path):
    engine.prefill_rows([PROMPT], [0], first=1)
    block = engine.export_kv(1, PROMPT[5:12], start=5)
    loaded = KVBlock.load(block.save(tmp_path / "b.kvb"))
    assert loaded.start == 5 and loaded.token_ids == tuple(PROMPT[5:12]) and loaded.fingerprint == block.fingerprint
    assert loaded.data.dtype == block.data.dtype and np.array_equal(loaded.data, block.data)


def test_truncated_or_corrupted_file_refused(engine, tmp_path):
    engine.prefill_rows([PROMPT], [0], first=0)
    path = engine.export_kv(0, PROMPT).save(tmp_path / "b.kvb")
    raw = path.read_bytes()
    (tmp_path / "short.kvb").write_bytes(raw[:-100])
    with pytest.raises(KVBlockError, match="sha256 does not match .*truncated or corrupted"):
        KVBlock.load(tmp_path / "short.kvb")
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x40
    (tmp_path / "flip.kvb").write_bytes(bytes(flipped))
    with pytest.raises(KVBlockError, match="truncated or corrupted"):
        KVBlock.load(tmp_path / "flip.kvb")
    (tmp_path / "tiny.kvb").write_bytes(raw[:20])
    with pytest.raises(KVBlockError, match="does not start with|truncated"):
        KVBlock.load(tmp_path / "tiny.kvb")
    (tmp_path / "text.kvb").write_text("not a block" * 10)
    with pytest.raises(KVBlockError, match="does not start with b'KVFBLOCK'"):
        KVBlock.load(tmp_path / "text.kvb")


def test_block_of_another_artifact_dtype_or_length_refused(engine, llama_onnx_artifact):
    engine.prefill_rows([PROMPT], [0], first=0)
    block = engine.export_kv(0, PROMPT)
    with (
        Engine.load(llama_onnx_artifact, prefix_cache=0) as other,
        pytest.raises(KVBlockError, match="another artifact .*lowering: block 'gqa', engine 'onnx'"),
    ):
        other.import_kv(block, 0)
    half = KVBlock({**block.fingerprint, "dtype": "float16"}, 0, block.token_ids, block.data.astype(np.float16))
    with pytest.raises(KVBlockError, match="dtype: block 'float16', engine 'float32'"):
        engine.import_kv(half, 1)
    late = KVBlock(block.fingerprint, 90, block.token_ids, block.data)
    with pytest.raises(KVBlockError, match=r"positions \[90, 111\), longer than a cache row .*max_seq=96"):
        engine.import_kv(late, 1)
    with pytest.raises(ValueError, match=r"positions \[0, 30\) are not in cache row 0, which holds \[0, 21\)"):
        engine.export_kv(0, [1] * 30)
    for bad in (-1, engine.max_batch, 1.0):  # not a cache row, either way
        with pytest.raises(ValueError, match=rf"row={bad!r} is not a cache row: rows are 0\.\.{engine.max_batch - 1}"):
            engine.export_kv(bad, PROMPT[:2])
        with pytest.raises(ValueError, match=rf"row={bad!r} is not a cache row"):
            engine.import_kv(block, bad)


# ------------------------------------------------------------------ the pool through generation


def _first_logprobs(result):
    return np.array([lp for _, lp in result.logprobs[0].top])


def test_hit_miss_and_partial_hit_equal_the_uncached_engine(engine, plain, pool):
    ref = {name: plain.generate([p], 8, LOGPROBS)[0] for name, p in [("p", PROMPT), ("o", OTHER), ("x", PARTIAL)]}
    first = engine.generate([PROMPT], 8, LOGPROBS)[0]
    assert first.cached_tokens == 0  # miss: the pool is empty
    assert pool.stats().blocks == (len(PROMPT) + 7) // BT  # prompt + 7 generated tokens fed back
    again = engine.generate([PROMPT], 8, LOGPROBS)[0]
    assert again.cached_tokens == len(PROMPT) - 1  # hit: all but the last token, which is prefilled
    other = engine.generate([OTHER], 8, LOGPROBS)[0]
    assert other.cached_tokens == 0  # miss: only the first token is shared, less than a block
    partial = engine.generate([PARTIAL], 8, LOGPROBS)[0]
    assert partial.cached_tokens == 8  # partial hit: the two whole blocks PARTIAL shares
    for result, name in [(first, "p"), (again, "p"), (other, "o"), (partial, "x")]:
        assert result.token_ids == ref[name].token_ids
        np.testing.assert_allclose(_first_logprobs(result), _first_logprobs(ref[name]), atol=1e-5, rtol=0)
    stats = pool.stats()
    assert stats.requests == 4 and stats.hit_requests == 2
    assert stats.queries == 20 + 20 + 15 + 14 and stats.hits == 20 + 8  # tokens, as vLLM counts them


def test_a_generated_continuation_is_reused(engine, plain, pool):
    """The offered KV holds the generated tokens too: a follow-up prompt that extends the first
    reply (as a chat client sends) hits beyond the first prompt."""
    first = engine.generate([PROMPT], 12)[0]
    follow = [*PROMPT, *first.token_ids, 5, 6, 7]
    result = engine.generate([follow], 6)[0]
    assert result.cached_tokens == (len(PROMPT) + 11) // BT * BT
    assert result.token_ids == plain.generate([follow], 6)[0].token_ids


def test_two_requests_sharing_a_prefix_in_one_batch(engine, plain, pool):
    shared = [0, *range(50, 70)]
    prompts = [[*shared, 1, 2, 3], [*shared, 9, 8], [*shared, 4]]
    ref = [r.token_ids for r in plain.generate(prompts, 10)]
    cold = engine.generate(prompts, 10)  # one ragged prefill, nothing cached yet
    assert [r.token_ids for r in cold] == ref and all(r.cached_tokens == 0 for r in cold)
    with engine.scheduler() as sched:  # now the shared prefix is cached; both run in one batch
        handles = [sched.submit(p, max_new_tokens=10) for p in prompts]
        warm = [h.result(timeout=60) for h in handles]
    assert [r.token_ids for r in warm] == ref
    assert [r.cached_tokens for r in warm] == [23, 20, 20]  # the first prompt itself was cached whole


def test_rows_offered_before_compaction_moves_them(engine, plain, pool):
    """The first request finishes first and the last one moves into its row: what the pool holds
    for each is its own KV (follow-ups that extend each reply hit and match the uncached engine)."""
    prompts = [[0, *range(70, 84)], [0, *range(90, 104)], [0, *range(140, 154)]]
    with engine.scheduler() as sched:
        handles = [sched.submit(p, max_new_tokens=n) for p, n in zip(prompts, [2, 12, 12])]
        results = [h.result(timeout=60) for h in handles]
    for prompt, result in zip(prompts, results):
        follow = [*prompt, *result.token_ids, 3, 4]
        [again] = engine.generate([follow], 5)
        assert again.cached_tokens == (len(prompt) + len(result.token_ids) - 1) // BT * BT
        assert again.token_ids == plain.generate([follow], 5)[0].token_ids


def test_eviction_under_a_small_budget(engine, plain, pool):
    engine.prefill_rows([PROMPT], [0], first=0)
    block_bytes = engine.export_kv(0, PROMPT[:BT]).nbytes
    engine.prefix_pool = small = PrefixPool(5 * block_bytes, block_tokens=BT)
    a, b = [0, *range(100, 112)], [0, *range(120, 132)]  # 13 tokens: 3 blocks offered each (with 1 generated)
    engine.generate([a], 2)
    assert small.stats().blocks == 3
    engine.generate([b], 2)  # needs 3 blocks: the 2 least recent leaves of a's chain go
    stats = small.stats()
    assert stats.blocks == 5 and stats.bytes <= 5 * block_bytes and stats.evictions == 1
    assert small.match_length(b) == 12 and small.match_length(a) == 8
    result = engine.generate([a], 4)[0]
    assert result.cached_tokens == 8 and result.token_ids == plain.generate([a], 4)[0].token_ids
    assert small.stats().bytes <= 5 * block_bytes


def test_pinned_blocks_are_not_evicted(engine, pool):
    engine.prefill_rows([PROMPT], [0], first=0)
    blocks = {}

    def export(start, stop):
        blocks[start] = engine.export_kv(0, PROMPT[start:stop], start=start)
        return blocks[start]

    small = PrefixPool(2 * export(0, BT).nbytes, block_tokens=BT)
    assert small.offer(PROMPT[:8], export) == 2
    hit = small.acquire(PROMPT[:8])
    assert hit.tokens == 8
    assert small.offer([9, 9, 9, 9], export) == 0  # no room: both blocks are pinned
    small.release(hit)
    assert small.offer([9, 9, 9, 9], export) == 1 and small.stats().evictions == 1
    assert small.match_length(PROMPT[:8]) == 4  # the leaf went, its parent stayed


# ------------------------------------------------------------------ sessions


def _uninterrupted(engine, path):
    with engine.session() as s:
        s.append(PROMPT)
        first = s.generate(max_new_tokens=6)
        s.save(path)
        s.append([7, 8, 9])
        return first, s.generate(max_new_tokens=8, sampling=SamplingParams(temperature=0.9, seed=3))


def test_saved_session_continues_as_if_never_stopped(engine, llama_artifact, tmp_path):
    path = tmp_path / "chat.kvs"
    _, expected = _uninterrupted(engine, path)
    for target in (engine, None):
        if target is None:  # another process would load the artifact again: another engine
            target = Engine.load(llama_artifact)
        with target.session(restore=path) as s:
            assert s.cached == len(PROMPT) + 5 and len(s.tokens) == len(PROMPT) + 6
            s.append([7, 8, 9])
            resumed = s.generate(max_new_tokens=8, sampling=SamplingParams(temperature=0.9, seed=3))
        assert resumed.token_ids == expected.token_ids
        if target is not engine:
            target.close()


def test_restore_refuses_another_artifact_and_plain_blocks(engine, llama_onnx_artifact, tmp_path):
    path = tmp_path / "chat.kvs"
    _uninterrupted(engine, path)
    with Engine.load(llama_onnx_artifact, prefix_cache=0) as other:
        with pytest.raises(KVBlockError, match="another artifact"):
            other.session(restore=path)
        assert other.general_rows() == other.max_batch  # the refused session gave its row back
    engine.prefill_rows([PROMPT], [0], first=0)
    engine.export_kv(0, PROMPT).save(tmp_path / "plain.kvb")
    with pytest.raises(KVBlockError, match="not a saved session"):
        engine.session(restore=tmp_path / "plain.kvb")
