"""Hand-offs in one copy: a prefill engine's KV cache in shared memory lends the hand-off's row
(runtime/kv/lend.py SharedCache, its refs through runtime/kv/shm.py; ``Engine.load(kv_shared=True)``,
``scheduler(lend_rows=True)``).

Proves: the streaming digest of a strided view (a cache row, any strides) equals the checksum of
its contiguous copy (xxh3 and crc32); the cache lives in a named segment
``kvforge-<pid>-cache-*``, unlinked by ``Engine.close``, and one larger than /dev/shm's free
space is refused up front; a lent hand-off's block is a read-only view of the prefill engine's
row (no copy) whose checksum matches the data, and resumed on another engine (in this process, or
taken from its ref) it gives exactly the colocated tokens (greedy and seeded, several at once); a
lent row is out of use until its taker releases it (the loop runs the next requests on other
rows; with every row lent they wait, a cancel still served, then run once one is freed) and is
used again after; a lent row corrupted in place is refused by the import's checksum
(KVBlockError, nothing imported) and its row is still freed; ``discard`` frees a row nobody took;
a request decoding above a hand-off in the same batch makes that hand-off go out by copy, with the
right tokens on both sides.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvforge.runtime import Engine
from kvforge.runtime.batching import BatchLoop
from kvforge.runtime.kv import KVBlockError, shm
from kvforge.runtime.kv.digest import Digest, checksum
from kvforge.runtime.kv.lend import SharedCache

PROMPT = "Once upon a time there was"
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=7, logprobs=3, repetition_penalty=1.2)


@pytest.fixture(scope="module")
def lending(tiny_artifact):
    """(prefill engine with a shared cache, decode engine, colocated engine)."""
    with (
        Engine.load(tiny_artifact, threads=1, prefix_cache=0, kv_shared=True) as pre,
        Engine.load(tiny_artifact, threads=1, prefix_cache=0) as dec,
        Engine.load(tiny_artifact, threads=1, prefix_cache=0) as ref,
    ):
        yield pre, dec, ref


def colocated(engine, prompts, n, sampling=None):
    with engine.scheduler() as sched:
        handles = [sched.submit(p, n, s) for p, s in zip(prompts, sampling or [None] * len(prompts))]
        return [h.result() for h in handles]


def lent_rows(engine) -> list[int]:
    return [r for r in range(engine.max_batch) if engine.cache.segment.lent(r)]


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_strided_digest_equals_contiguous(algorithm):
    cache = np.random.default_rng(0).standard_normal((3, 2, 4, 2, 16, 8)).astype(np.float32)
    view = cache[:, :, 1, :, :5]  # a row's first 5 positions: [L, 2, H, n, D], strided
    assert not view.flags.c_contiguous
    digest = Digest(algorithm)
    for layer in range(3):
        for kv in range(2):
            digest.update(view[layer, kv])  # [H, n, D] pieces, strided
    assert digest.value() == checksum(view, algorithm) == checksum(np.ascontiguousarray(view), algorithm)
    for odd in (cache[:, :, :, :, ::2], cache[..., ::3], cache[1:, :, 2:3]):  # any strides: the contiguous copy's
        assert checksum(odd, algorithm) == checksum(np.ascontiguousarray(odd), algorithm)


def test_cache_segment_named_and_unlinked(tiny_artifact):
    pid = os.getpid()
    before = set(shm.segments(pid))
    engine = Engine.load(tiny_artifact, threads=1, prefix_cache=0, kv_shared=True)
    [name] = set(shm.segments(pid)) - before
    assert name.startswith(f"kvforge-{pid}-cache-") and name == engine.cache.segment.name
    assert engine.cache.buffer.shape == engine.cache.shape and not engine.cache.buffer.any()
    engine.close()
    assert set(shm.segments(pid)) == before
    with Engine.load(tiny_artifact, threads=1, prefix_cache=0) as plain, pytest.raises(ValueError, match="kv_shared"):
        plain.scheduler(lend_rows=True)
    with pytest.raises(OSError, match="needs 8388608 MiB, but /dev/shm has .* MiB free: enlarge it"):
        SharedCache((1, 2, 1, 1, 2**40, 1), np.float32)  # 8 TiB: refused before anything is created
    assert set(shm.segments(pid)) == before


def test_lent_handoffs_equal_colocated(lending):
    """Greedy and seeded requests, four at once: each hand-off's block is a view of its lent row
    (no copy), its checksum that of the data; resumed in-process and from a taken ref they give
    the colocated tokens, and every row is free again afterwards."""
    pre, dec, ref = lending
    samplings = [None, SAMPLED, dict(SAMPLED, seed=8), None]
    prompts = [PROMPT, PROMPT, PROMPT, "The list of values in the context"]
    expected = colocated(ref, prompts, 16, samplings)
    with pre.scheduler(lend_rows=True) as sp, dec.scheduler() as sd:
        firsts = [sp.submit(p, 16, s, hand_off=True).result() for p, s in zip(prompts, samplings)]
        handoffs = [r.handoff for r in firsts]
        assert len(lent_rows(pre)) == 4
        for h in handoffs:
            data = h.block.data
            assert not data.flags.writeable and not data.flags.owndata and np.shares_memory(data, pre.cache.buffer)
            assert h.checksum == checksum(np.ascontiguousarray(data))
        seg = pre.cache.segment
        in_process = [sd.resume(h) for h in handoffs[:2]]
        refs = [seg.put(h) for h in handoffs[2:]]
        assert all(r.name == seg.name and r.cache == list(pre.cache.shape) for r in refs)
        taken = [sd.resume(shm.take(shm.ShmRef.from_dict(r.to_dict()), dec.kv_fingerprint, verify=False)) for r in refs]
        got = [h.result() for h in in_process + taken]
    for e, g in zip(expected, got):
        assert (g.token_ids, g.text, g.logprobs) == (e.token_ids, e.text, e.logprobs)
    assert lent_rows(pre) == []
    assert not any(shm.pending(r) for r in refs)


def test_lent_row_not_reused_until_released(lending):
    """Rows lent stay intact while the loop runs other requests; with every row lent a new request
    waits, and runs once one is released, on the freed row."""
    pre, dec, ref = lending
    [expected] = colocated(ref, [PROMPT], 8)
    with pre.scheduler(lend_rows=True) as sp, dec.scheduler() as sd:
        handoffs = [sp.submit(PROMPT, 8, hand_off=True).result().handoff for _ in range(pre.max_batch)]
        assert len(lent_rows(pre)) == pre.max_batch  # one row each: none was reused
        copies = [np.array(h.block.data) for h in handoffs]
        waiting = sp.submit("Another prompt, another day", 8, hand_off=True)
        time.sleep(0.2)
        assert not waiting.done  # back-pressure: every row is lent
        cancelled = sp.submit(PROMPT, 8, hand_off=True)
        cancelled.cancel()  # a stalled loop still retires what is cancelled while it waits
        assert cancelled.result(timeout=5).finish_reason == "cancelled"
        assert all((h.block.data == c).all() for h, c in zip(handoffs, copies))  # untouched
        [row] = [r for r in range(pre.max_batch) if np.shares_memory(handoffs[3].block.data, pre.cache.buffer[:, :, r])]
        assert sd.resume(handoffs[3]).result().token_ids == expected.token_ids  # imported, then released
        late = waiting.result(timeout=30).handoff
        assert np.shares_memory(late.block.data, pre.cache.buffer[:, :, row])  # the freed row, used again
        others = [h for i, h in enumerate(handoffs) if i != 3]
        dropped = [r for r in range(pre.max_batch) if np.shares_memory(others[0].block.data, pre.cache.buffer[:, :, r])]
        others[0].release()  # a hand-off dropped in this process frees its row
        assert [r for r in range(pre.max_batch) if r not in lent_rows(pre)] == dropped
        plain = sp.submit(PROMPT, 8).result()  # runs (prefill and decode) on that row alone
        assert plain.token_ids == expected.token_ids
        others = others[1:]
        copies = copies[1:3] + copies[4:]
        assert all((h.block.data == c).all() for h, c in zip(others, copies))
        for h in [*others, late]:
            h.release()
    assert lent_rows(pre) == []


def test_corrupted_lent_row_refused_and_freed(lending):
    """A byte flipped in the lent row (through the segment, as a stray writer would) fails the
    import with KVBlockError, nothing imported; the row is freed; the next hand-off is exact."""
    pre, dec, ref = lending
    [expected] = colocated(ref, [PROMPT], 8)
    with pre.scheduler(lend_rows=True) as sp, dec.scheduler() as sd:
        handoff = sp.submit(PROMPT, 8, hand_off=True).result().handoff
        ref_ = pre.cache.segment.put(handoff)
        row = ref_.row
        pre.cache.buffer[-1, 1, row, -1, handoff.block.n - 1, 0] += 1.0  # the last piece hashed
        bad = shm.take(ref_, dec.kv_fingerprint, verify=False)
        with pytest.raises(KVBlockError, match="does not match its .* checksum.*not imported"):
            sd.resume(bad).result(timeout=30)
        assert not shm.pending(ref_) and lent_rows(pre) == []
        with pytest.raises(KVBlockError, match="was freed"):
            shm.take(ref_)
        again = pre.cache.segment.put(sp.submit(PROMPT, 8, hand_off=True).result().handoff)
        assert again.row == row and again.slot_id != ref_.slot_id  # the freed row, lent again
        assert sd.resume(shm.take(again, dec.kv_fingerprint)).result().token_ids == expected.token_ids


def test_discard_frees_a_lent_row(lending):
    pre, _, _ = lending
    with pre.scheduler(lend_rows=True) as sp:
        ref_ = pre.cache.segment.put(sp.submit(PROMPT, 8, hand_off=True).result().handoff)
        assert shm.pending(ref_) and lent_rows(pre) == [ref_.row]
        assert shm.discard(ref_) and not shm.pending(ref_) and not shm.discard(ref_)
        assert lent_rows(pre) == []


def test_handoff_below_a_decoding_request_goes_by_copy(lending):
    """In one batch, a hand-off whose row a still-decoding request would be compacted into is
    exported by copy (not lent); both requests give their colocated tokens. The loop is driven
    step by step (deterministic grouping: both prompts prefilled in one call, rows 0 and 1)."""
    pre, dec, ref = lending
    prompts = [PROMPT, "The list of values"]
    [long_exp, short_exp] = colocated(ref, prompts, 24)
    owner = object()
    with pre.own_rows(owner) as rows:
        loop = BatchLoop(pre, rows, lender=pre.cache.segment)
        gens = [pre.request(pre.encode(p), 24, None, None) for p in prompts]
        gens[0].hand_off = True
        for g in gens:
            loop.add(g)
        while not loop.idle:
            loop.step()
    handoff, stays = gens[0].result().handoff, gens[1].result()
    assert handoff.block.data.flags.owndata and lent_rows(pre) == []  # copied: it sat below row 1
    with dec.scheduler() as sd:
        got = sd.resume(handoff).result()
    assert got.token_ids == long_exp.token_ids and stays.token_ids == short_exp.token_ids
