"""Disaggregated prefill/decode in the runtime: ``submit(hand_off=True)``, ``resume(handoff)`` and
the shared-memory transport (runtime/kv/handoff.py, runtime/kv/shm.py), on the bundled model.

Two engines of one artifact stand for a prefill and a decode process (plus one real spawned
process); a third, colocated, gives the reference. Proves: a request prefilled (first token
sampled) on one engine and resumed on the other gives exactly the colocated tokens, text, stop
string, finish reason and logprobs for greedy, seeded sampling with penalties, logit bias and
logprobs, several seeds at once (``n``), a stop string right after the first token, one spanning
the first and second tokens, and a later one, and a grammar-constrained request; the prefill
handle streams one chunk (the first token, finish_reason ``handoff``) and the decode handle the
rest, together the colocated chunks' text; ``max_new_tokens=1``, eos or a stop string at the first
token end on the prefill side with no hand-off; a resume while another prompt is being filled in
chunks leaves both right; a resumed request can be cancelled; a decode engine that drafts
(speculative decoding) keeps the plain tokens; the prefix cache works on both
sides (hits counted in ``cached_tokens``, the decode side's finished rows offered); the header
round-trips through JSON; the block goes through ``/dev/shm`` with the export written straight
into the segment, the segment unlinked at take, a dead worker's segments found and unlinked by
pid; a foreign block (another artifact) and a corrupted segment are refused with KVBlockError
before anything is imported (by ``take``, or with the checksum fused into the export's and the
import's copies, by the import: one flipped byte fails the request, the row holds nothing); and
a real second process (multiprocessing spawn) continues a request from a ref alone, with the
colocated output.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import time

import pytest

from kvforge.runtime import Engine
from kvforge.runtime.kv import KVBlockError, shm
from kvforge.runtime.kv.handoff import Handoff

PROMPT = "Once upon a time there was"  # greedy: ' a', '\n', 're', 'cur', 'sively', ...
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=7, logprobs=3, repetition_penalty=1.2)
ARENA = 8 * 2**20  # the tests' blocks are ~2 KB per token
PENALTIES = dict(SAMPLED, frequency_penalty=0.4, presence_penalty=0.3, logit_bias={"199": 2.0})


@pytest.fixture(scope="module")
def engines(tiny_artifact):
    """(prefill, decode, colocated) engines of one artifact, without prefix caches."""
    with (
        Engine.load(tiny_artifact, threads=1, prefix_cache=0) as pre,
        Engine.load(tiny_artifact, threads=1, prefix_cache=0) as dec,
        Engine.load(tiny_artifact, threads=1, prefix_cache=0) as ref,
    ):
        yield pre, dec, ref


def colocated(engine, prompts, max_new_tokens, sampling=None, stop=None):
    with engine.scheduler() as sched:
        handles = [sched.submit(p, max_new_tokens, s, stop) for p, s in zip(prompts, sampling or [None] * len(prompts))]
        return [(list(h), h.result()) for h in handles]


def disaggregated(pre, dec, prompts, max_new_tokens, sampling=None, stop=None, through_shm=True):
    """Each prompt prefilled on ``pre`` (hand-offs exported into shared memory), resumed on ``dec``
    from its ref; returns (prefill chunks, prefill result, decode chunks, decode result) each."""
    alloc = shm.SegmentAllocator(ARENA)
    try:
        with pre.scheduler(block_alloc=alloc) as sp:
            firsts = [
                sp.submit(p, max_new_tokens, s, stop, hand_off=True)
                for p, s in zip(prompts, sampling or [None] * len(prompts))
            ]
            firsts = [(list(h), h.result()) for h in firsts]
        with dec.scheduler() as sd:
            handles = []
            for _, r in firsts:
                if r.handoff is None:
                    handles.append(None)
                    continue
                handoff = shm.take(alloc.put(r.handoff), dec.kv_fingerprint) if through_shm else r.handoff
                handles.append(sd.resume(handoff))
            rests = [([], None) if h is None else (list(h), h.result()) for h in handles]
    finally:
        alloc.close()
    return [(*f, *r) for f, r in zip(firsts, rests)]


def assert_same(ref, got) -> None:
    """``got`` (a decode-side result) is the colocated result ``ref`` (timing and cached tokens aside)."""
    assert got.token_ids == ref.token_ids
    assert got.text == ref.text
    assert (got.finish_reason, got.stop_string) == (ref.finish_reason, ref.stop_string)
    assert got.logprobs == ref.logprobs
    assert got.prompt_tokens == ref.prompt_tokens and got.handoff is None


def check_streams(ref_chunks, first_chunks, rest_chunks) -> None:
    """The prefill handle's one chunk (finish_reason handoff) and the decode handle's chunks join to
    the colocated chunks; the first token is never sent twice."""
    [first] = first_chunks
    assert first.finish_reason == "handoff" and len(first.token_ids) == 1
    assert [t for c in rest_chunks for t in c.token_ids] == [t for c in ref_chunks for t in c.token_ids][1:]
    assert first.text + "".join(c.text for c in rest_chunks) == "".join(c.text for c in ref_chunks)
    assert [c.finish_reason for c in rest_chunks] == [c.finish_reason for c in ref_chunks][1:]


@pytest.mark.parametrize("sampling", [None, SAMPLED, PENALTIES], ids=["greedy", "seeded", "penalties-bias"])
def test_resumed_equals_colocated(engines, sampling):
    pre, dec, ref = engines
    [(ref_chunks, expected)] = colocated(ref, [PROMPT], 24, [sampling])
    [(first, r1, rest, r2)] = disaggregated(pre, dec, [PROMPT], 24, [sampling])
    assert r1.finish_reason == "handoff" and r1.token_ids == expected.token_ids[:1]
    assert isinstance(r1.handoff, Handoff) and r1.handoff.block.n == r1.prompt_tokens
    assert 0 < r1.handoff.export_s < 5  # the export's own time, for the server's hand-off metrics
    if sampling is not None:
        assert r1.logprobs == expected.logprobs[:1]
    assert_same(expected, r2)
    check_streams(ref_chunks, first, rest)


def test_n_seeds_at_once(engines):
    """Four samples of one prompt (OpenAI's ``n``: one seed each), handed off and decoded together."""
    pre, dec, ref = engines
    samplings = [dict(PENALTIES, seed=s) for s in (1, 2, 3, 4)]
    expected = colocated(ref, [PROMPT] * 4, 16, samplings)
    got = disaggregated(pre, dec, [PROMPT] * 4, 16, samplings)
    assert len({tuple(r.token_ids) for _, r in expected}) > 1  # the seeds do differ
    for (_, e), (_, _, _, r2) in zip(expected, got):
        assert_same(e, r2)


@pytest.mark.parametrize(
    "stop, where",
    [("re", "second"), ("a\nre", "spans"), ("context", "later"), (" a", "first")],
)
def test_stop_strings(engines, stop, where):
    """Greedy continues ' a', '\\n', 're', ...: a stop string on the second token, one spanning the
    first two (held back in the first chunk), a later one, and one at the first token (no hand-off)."""
    pre, dec, ref = engines
    [(ref_chunks, expected)] = colocated(ref, [PROMPT], 24, stop=[stop])
    [(first, r1, rest, r2)] = disaggregated(pre, dec, [PROMPT], 24, stop=[stop])
    assert expected.finish_reason == "stop" and expected.stop_string == stop
    if where == "first":
        assert r1.handoff is None and r2 is None
        assert (r1.token_ids, r1.text, r1.stop_string) == (expected.token_ids, expected.text, stop)
        return
    if where == "spans":
        assert first[0].text == " "  # the 'a' is held back: it could start the stop string
    assert_same(expected, r2)
    check_streams(ref_chunks, first, rest)


def test_requests_ending_at_the_first_token_are_not_handed_off(engines):
    pre, dec, ref = engines
    cases = [(PROMPT, 1, None, "length"), (PROMPT, 8, dict(logit_bias={"0": 100.0}), "stop")]  # id 0 is eos
    for prompt, n, sampling, reason in cases:
        [(_, expected)] = colocated(ref, [prompt], n, [sampling])
        [(first, r1, _, r2)] = disaggregated(pre, dec, [prompt], n, [sampling])
        assert r1.finish_reason == expected.finish_reason == reason and r1.handoff is None and r2 is None
        assert r1.token_ids == expected.token_ids and len(r1.token_ids) == 1
        assert [c.finish_reason for c in first] == [reason]


def test_grammar_constrained(engines):
    pytest.importorskip("llguidance")
    pre, dec, ref = engines
    for sampling in (dict(regex=r"[a-z]{2,6}( [a-z]{2,6}){3,6}\."), dict(SAMPLED, regex=r"(yes|no), [a-z ]{4,30}\.")):
        [(ref_chunks, expected)] = colocated(ref, [PROMPT], 40, [sampling])
        [(first, r1, rest, r2)] = disaggregated(pre, dec, [PROMPT], 40, [sampling])
        assert r1.finish_reason == "handoff"
        assert_same(expected, r2)
        check_streams(ref_chunks, first, rest)


def test_resume_while_a_prompt_is_filled_in_chunks(engines):
    """A resumed request joins the decoding rows while a long prompt is prefilled chunk by chunk
    (that row moves up one): both give their colocated tokens."""
    pre, dec, ref = engines
    long_prompt = " ".join(["the list of the values in the context manager"] * 12)
    [(_, exp_long), (_, exp_short)] = colocated(ref, [long_prompt, PROMPT], 12)
    [(_, r1, _, _)] = disaggregated(pre, dec, [PROMPT], 12)
    with dec.scheduler(prefill_chunk=16) as sd:
        filling = sd.submit(long_prompt, 12)
        while sd._loop.filling is None and not filling.done:  # wait until it is being filled
            time.sleep(0.001)
        resumed = sd.resume(r1.handoff)
        assert filling.result().token_ids == exp_long.token_ids
        assert_same(exp_short, resumed.result())


def test_cancel_a_resumed_request(engines):
    pre, dec, _ = engines
    [(_, r1, _, _)] = disaggregated(pre, dec, [PROMPT], 400, through_shm=False)
    with dec.scheduler() as sd:
        h = sd.resume(r1.handoff)
        h.cancel()
        result = h.result(timeout=30)
    assert result.finish_reason == "cancelled" and result.token_ids[0] == r1.token_ids[0]


def test_prefix_cache_on_both_sides(tiny_artifact, engines):
    """With prefix caches (16-token blocks): the second hand-off of a prompt imports its cached
    prefix on the prefill side (``cached_tokens`` travels with the hand-off); the decode side
    offers its finished rows, so a colocated request there hits; the tokens stay the colocated ones."""
    _, _, ref = engines
    prompt = " ".join(["a list of values in the context"] * 6)  # > 32 tokens
    [(_, expected)] = colocated(ref, [prompt], 10)
    with Engine.load(tiny_artifact, threads=1) as pre, Engine.load(tiny_artifact, threads=1) as dec:
        [(_, a1, _, a2)] = disaggregated(pre, dec, [prompt], 10)
        [(_, b1, _, b2)] = disaggregated(pre, dec, [prompt], 10)
        assert a1.cached_tokens == 0 and b1.cached_tokens >= 32 and b2.cached_tokens == b1.cached_tokens
        assert a2.token_ids == b2.token_ids == expected.token_ids
        with dec.scheduler() as sd:
            local = sd.submit(prompt, 10).result()
        assert local.cached_tokens >= 32 and local.token_ids == expected.token_ids


def test_resumed_on_a_speculative_engine(tiny_onnx_artifact):
    """The decode side may draft (n-gram speculative decoding over prompt + first token): the
    tokens stay the plain ones."""
    prompt = " ".join(["the list of the values in the context manager"] * 4)
    with (
        Engine.load(tiny_onnx_artifact, threads=1, prefix_cache=0) as pre,
        Engine.load(tiny_onnx_artifact, threads=1, prefix_cache=0, speculative="ngram:4") as dec,
    ):
        [(_, expected)] = colocated(pre, [prompt], 40)
        [(_, r1, _, r2)] = disaggregated(pre, dec, [prompt], 40)
    assert r1.finish_reason == "handoff"
    assert r2.token_ids == expected.token_ids and r2.drafted_tokens > 0


def test_header_round_trips_through_json(engines):
    pre, dec, _ = engines
    [(_, r1, _, _)] = disaggregated(pre, dec, [PROMPT], 8, [PENALTIES], through_shm=False)
    h = r1.handoff
    header = json.loads(json.dumps(h.header()))
    again = Handoff.from_parts(header, h.block.data)
    assert again.block.data is h.block.data
    assert again.header() == h.header() and again.first_logprobs == h.first_logprobs
    with pytest.raises(KVBlockError, match="does not belong to this header"):
        Handoff.from_parts(header, h.block.data[:, :, :, :-1])


def test_shm_arena_export_in_place_and_slot_reuse(engines):
    """The export goes straight into an arena slot; take checks it and gives a read-only view; the
    scheduler's import frees the slot, which the next hand-off reuses; a second take is refused."""
    pre, dec, _ = engines
    pid = os.getpid()
    alloc = shm.SegmentAllocator(arena_bytes=4 * 2**20)
    try:
        assert shm.segments(pid) == [alloc.arena_name]
        with pre.scheduler(block_alloc=alloc) as sp, dec.scheduler() as sd:
            r1 = sp.submit(PROMPT, 8, hand_off=True).result()
            ref = alloc.put(r1.handoff)
            assert ref.name == alloc.arena_name and ref.nbytes == pre.kv_nbytes(r1.prompt_tokens)
            assert len(pickle.dumps(ref)) < 4096 + 8 * r1.prompt_tokens
            assert shm.pending(ref)
            handoff = shm.take(ref, dec.kv_fingerprint)
            assert not handoff.block.data.flags.writeable and (handoff.block.data == r1.handoff.block.data).all()
            assert sd.resume(handoff).result().token_ids[0] == r1.token_ids[0]
            assert not shm.pending(ref)
            with pytest.raises(KVBlockError, match="was freed"):
                shm.take(ref)
            again = alloc.put(sp.submit("Another prompt", 8, hand_off=True).result().handoff)
            assert (again.offset, again.slot) == (ref.offset, ref.slot) and again.slot_id != ref.slot_id
            assert shm.discard(again) and not shm.discard(again)
        assert shm.segments(pid) == [alloc.arena_name]
    finally:
        alloc.close()
    assert shm.segments(pid) == []


def test_shm_own_segments_unlinked_at_take(engines):
    """Without an arena (or for a block larger than it) each block has a segment of its own,
    unlinked at take; a dead worker's segments are found and unlinked by its pid."""
    pre = engines[0]
    pid = os.getpid()
    alloc = shm.SegmentAllocator(arena_bytes=0)
    with pre.scheduler(block_alloc=alloc) as sp:
        r1 = sp.submit(PROMPT, 8, hand_off=True).result()
    [name] = shm.segments(pid)  # the export went straight into it
    ref = alloc.put(r1.handoff)
    assert ref.name == name and ref.slot is None
    assert shm.pending(ref)
    handoff = shm.take(ref)
    assert not shm.pending(ref) and shm.segments(pid) == [] and (handoff.block.data == r1.handoff.block.data).all()
    with pytest.raises(KVBlockError, match="is gone"):
        shm.take(ref)
    refs = [alloc.put(r1.handoff) for _ in range(2)]  # copies: r1's data is not in new memory
    assert shm.segments(pid) == sorted(r.name for r in refs)
    assert shm.unlink_segments(pid) == sorted(r.name for r in refs) and shm.segments(pid) == []
    assert not shm.discard(refs[0])


def test_foreign_and_corrupted_blocks_are_refused(tiny_onnx_artifact, engines):
    pre, dec, _ = engines
    [(_, r1, _, _)] = disaggregated(pre, dec, [PROMPT], 8, through_shm=False)
    with Engine.load(tiny_onnx_artifact, threads=1, prefix_cache=0) as other, other.scheduler() as so:
        with pytest.raises(KVBlockError, match="another artifact.*lowering"):
            so.resume(r1.handoff)
        ref = shm.put(r1.handoff)
        with pytest.raises(KVBlockError, match="another artifact"):
            shm.take(ref, other.kv_fingerprint)
        assert not shm.discard(ref)  # freed by the take that refused it
    for arena_bytes in (2**20, 0):
        alloc = shm.SegmentAllocator(arena_bytes)
        ref = alloc.put(r1.handoff)
        with open(shm.SHM_DIR / ref.name, "r+b") as f:  # one flipped byte in the middle of the data
            f.seek(ref.offset + ref.nbytes // 2)
            byte = f.read(1)
            f.seek(ref.offset + ref.nbytes // 2)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(KVBlockError, match="does not match its .* checksum"):
            shm.take(ref, dec.kv_fingerprint)
        assert not shm.discard(ref)  # freed by the take that refused it
        alloc.close()


def _decode_in_child(artifact, refs, results) -> None:
    with Engine.load(artifact, threads=1, prefix_cache=0) as engine, engine.scheduler() as sched:
        handles = [sched.resume(shm.take(shm.ShmRef.from_dict(r), engine.kv_fingerprint)) for r in refs]
        results.put([(h.result().token_ids, h.result().text, h.result().logprobs) for h in handles])


def test_across_processes(tiny_artifact, engines):
    """A spawned process (its own engine) continues two requests from their refs alone."""
    pre, _, ref = engines
    samplings = [None, PENALTIES]
    expected = colocated(ref, [PROMPT, PROMPT], 16, samplings)
    alloc = shm.SegmentAllocator(ARENA)
    with pre.scheduler(block_alloc=alloc) as sp:
        handles = [sp.submit(PROMPT, 16, s, hand_off=True) for s in samplings]
        refs = [alloc.put(h.result().handoff).to_dict() for h in handles]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_decode_in_child, args=(str(tiny_artifact), refs, results))
    child.start()
    got = results.get(timeout=120)
    child.join(timeout=30)
    assert child.exitcode == 0
    for (_, e), (tokens, text, logprobs) in zip(expected, got):
        assert (tokens, text, logprobs) == (e.token_ids, e.text, e.logprobs)
    alloc.close()
    assert shm.segments(os.getpid()) == []


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_checksum_fused_into_the_copies(engines, algorithm):
    """The scheduler's export hashes the block layer by layer as it copies it: the same digest as
    one pass over the data. A decode worker's take (``verify=False``) leaves the check to the
    import, which hashes as it copies: a good block decodes exactly; a block with one flipped byte
    (in the last layer: found only after every earlier layer was written) fails its request with
    KVBlockError, the row imported nothing (the next request on that scheduler is exact) and its
    arena slot is freed."""
    pre, dec, ref = engines
    [(_, expected)] = colocated(ref, [PROMPT], 8)
    with pre.scheduler() as sp:
        handoff = sp.submit(PROMPT, 8, hand_off=True).result().handoff
    assert handoff.checksum == shm.checksum(handoff.block.data)
    handoff.checksum = shm.checksum(handoff.block.data, algorithm)  # as a producer without xxhash makes it
    alloc = shm.SegmentAllocator(ARENA)
    try:
        with dec.scheduler() as sd:
            good = shm.take(alloc.put(handoff), dec.kv_fingerprint, verify=False)
            assert good.checksum.startswith(f"{algorithm}:")
            assert_same(expected, sd.resume(good).result())

            bad_ref = alloc.put(handoff)
            with open(shm.SHM_DIR / bad_ref.name, "r+b") as f:
                f.seek(bad_ref.offset + bad_ref.nbytes - 5)
                byte = f.read(1)
                f.seek(bad_ref.offset + bad_ref.nbytes - 5)
                f.write(bytes([byte[0] ^ 0x01]))
            bad = shm.take(bad_ref, dec.kv_fingerprint, verify=False)  # not checked here
            with pytest.raises(KVBlockError, match=f"does not match its {algorithm} checksum.*not imported"):
                sd.resume(bad).result(timeout=30)
            assert not shm.pending(bad_ref) and not shm.discard(bad_ref)  # its slot was freed
            again = shm.take(alloc.put(handoff), dec.kv_fingerprint, verify=False)
            assert_same(expected, sd.resume(again).result())
    finally:
        alloc.close()


def test_a_failing_release_hook_does_not_lose_the_resumed_request(engines, caplog):
    """A hand-off whose release hook raises (its shared memory gone, say) after the import still
    decodes to the colocated answer, and the failure is logged instead of dropping the request."""
    pre, dec, ref = engines
    [(_, expected)] = colocated(ref, [PROMPT], 12)
    [(_, r1, _, _)] = disaggregated(pre, dec, [PROMPT], 12, through_shm=False)

    def broken() -> None:
        raise OSError("segment already unlinked")

    r1.handoff.on_release = broken
    with caplog.at_level("WARNING", logger="kvforge.runtime"), dec.scheduler() as sd:
        result = sd.resume(r1.handoff).result(timeout=60)
    assert_same(expected, result)
    assert "segment already unlinked" in caplog.text
