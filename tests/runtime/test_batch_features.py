"""Every feature that meets in the batch loop, on at once in one scheduler batch.

Proves, on the bundled model in both lowerings (max_batch 8; under ``onnx`` a verify call checks
several rows' drafts at once, under ``gqa`` only a row decoding alone drafts): with
the prefix cache on (the default), n-gram speculative decoding on, and rows that are constrained
(a regex), sampled with a seed and a ``logit_bias``, greedy with a stop string, predicted
(``SamplingParams.prediction``), cancelled, and a later request that shares a finished request's
prompt (a prefix-cache hit), each request gives exactly what it gives alone on a plain engine (no
prefix cache, no drafts): the same tokens, text, finish reason and stop string. The hit takes its
prefix from the cache (``cached_tokens > 0``) and drafts are accepted somewhere in the batch.
A seeded request handed off after its first token (disaggregated prefill) in that batch and
resumed in a second batch beside a drafting row gives its solo answer too: under ``gqa`` its row
is lent (the KV cache in shared memory, lending schedulers: what a prefill worker does) and freed
once imported, under ``onnx`` its KV is exported by copy.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvforge.runtime import Engine, SamplingParams

pytest.importorskip("llguidance")

REPEAT = "The for statement runs the loop. The for statement runs the loop. The for statement runs"
GREEDY = SamplingParams(temperature=0.0)

# name -> (prompt, max_new_tokens, sampling, stop)
REQUESTS = {
    "drafts": (REPEAT, 24, GREEDY, None),
    "regex": ("A list is a mutable", 16, SamplingParams(temperature=0.0, regex=r"[a-z]+( [a-z]+){1,5}\."), None),
    "sampled": (
        "Exceptions are",
        12,
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, logit_bias={5: -100, 17: 3.0}, speculative=False),
        None,
    ),
    "stop": ("The import system", 20, GREEDY, ["."]),
    # vLLM's min_tokens and ignore_eos: no stop string matched (and no eos) before 6 tokens
    "min_tokens": ("The import system", 12, SamplingParams(temperature=0.0, min_tokens=6, ignore_eos=True), [" "]),
    "predicted": ("The while loop", 16, None, None),  # sampling filled in below: the plain answer as prediction
}


HANDOFF = ("The for loop", 14, SamplingParams(temperature=0.7, seed=3), ["zzz"])


def _run(
    engine: Engine, requests: dict, cancel: str | None = None, hand_off: str | None = None, lend: bool = False
) -> dict:
    with engine.scheduler(lend_rows=lend) as sched:
        handles = {
            name: sched.submit(p, max_new_tokens=n, sampling=s, stop=stop, hand_off=name == hand_off)
            for name, (p, n, s, stop) in requests.items()
        }
        if cancel is not None:
            victim = sched.submit(REPEAT, max_new_tokens=400, sampling=GREEDY)
            victim.cancel()
        results = {name: h.result(timeout=120) for name, h in handles.items()}
        if cancel is not None:
            results[cancel] = victim.result(timeout=120)
    return results


def _solo_answers(artifact, extra: dict | None = None, **load) -> tuple[dict, dict, object]:
    """REQUESTS (the predicted row's prediction: the plain answer's first 10 tokens, then 3 others),
    each request's answer alone on a plain engine (no prefix cache, no drafts; ``load``: more of
    Engine.load's arguments), also for ``extra``, and the answer to a prompt extending the drafting
    request's."""
    requests = dict(REQUESTS)
    with Engine.load(artifact, prefix_cache=0, threads=1, **load) as plain:
        predicted = plain.generate([requests["predicted"][0]], max_new_tokens=16, sampling=GREEDY)[0]
        requests["predicted"] = (
            requests["predicted"][0],
            16,
            SamplingParams(temperature=0.0, prediction=[*predicted.token_ids[:10], 3, 4, 5]),
            None,
        )
        solo = {name: _run(plain, {name: r})[name] for name, r in [*requests.items(), *(extra or {}).items()]}
        hit_solo = plain.generate([REPEAT + " again"], max_new_tokens=8, sampling=GREEDY)[0]
    return requests, solo, hit_solo


def _same(a, b) -> tuple:
    return (a.token_ids, a.text, a.finish_reason, a.stop_string), (b.token_ids, b.text, b.finish_reason, b.stop_string)


@pytest.mark.parametrize("lowering", ["gqa", "onnx"])
def test_all_batch_loop_features_at_once_give_each_requests_solo_answer(request, lowering):
    tiny_artifact = request.getfixturevalue("tiny_artifact" if lowering == "gqa" else "tiny_onnx_artifact")
    requests, solo, hit_solo = _solo_answers(tiny_artifact, {"handoff": HANDOFF})

    assert re.fullmatch(r"[a-z]+( [a-z]+){1,5}\.", solo["regex"].text), solo["regex"].text
    assert solo["stop"].finish_reason == "stop" and solo["stop"].stop_string == "."
    held = solo["min_tokens"]  # the stop string " " held back for 6 tokens, then matched
    assert held.finish_reason == "stop" and held.stop_string == " " and len(held.token_ids) > 6, held

    lend = lowering == "gqa"
    with Engine.load(tiny_artifact, speculative="ngram", threads=1, kv_shared=lend) as engine:
        assert engine.prefix_pool is not None  # the default: on
        together = _run(engine, {**requests, "handoff": HANDOFF}, cancel="cancelled", hand_off="handoff", lend=lend)
        assert together["handoff"].finish_reason == "handoff"
        handoff = together["handoff"].handoff
        lent = [r for r in range(engine.max_batch) if lend and engine.cache.segment.lent(r)]
        assert len(lent) == lend  # gqa: the row is lent (a view of it), onnx: a copy
        assert np.shares_memory(handoff.block.data, engine.cache.buffer) == lend
        with engine.scheduler(lend_rows=lend) as sched:  # the decode side: beside a drafting row
            drafting = sched.submit(REPEAT, max_new_tokens=24, sampling=GREEDY)
            together["handoff"] = sched.resume(handoff).result(timeout=120)
            assert drafting.result(timeout=120).token_ids == solo["drafts"].token_ids
        assert not any(lend and engine.cache.segment.lent(r) for r in range(engine.max_batch))  # freed once imported
        for name in [*requests, "handoff"]:
            got, want = _same(together[name], solo[name])
            assert got == want, name
        assert together["cancelled"].finish_reason == "cancelled"
        if lowering == "onnx":  # several rows verified in one call
            assert sum(r.accepted_tokens for r in together.values()) > 0
            assert together["predicted"].prediction_accepted >= 1

        # The drafting request finished: its prompt is in the pool, and a prompt that extends it hits.
        hit = engine.generate([REPEAT + " again"], max_new_tokens=8, sampling=GREEDY)[0]
        assert hit.cached_tokens > 0
        assert hit.token_ids == hit_solo.token_ids and hit.text == hit_solo.text


@pytest.mark.parametrize("lowering", ["gqa", "onnx"])
def test_draft_model_with_every_batch_loop_feature(request, lowering):
    """The same batch with a draft model (the artifact drafting for itself: same tokenizer) instead
    of n-grams: drafting, constrained, sampled, stop-string, predicted and cancelled rows at once,
    each request's solo answer; the draft rows held by running requests are never taken, and a later
    request extending a finished one finds its prefix in the target's prefix cache and in a draft row."""
    tiny_artifact = request.getfixturevalue("tiny_artifact" if lowering == "gqa" else "tiny_onnx_artifact")
    requests, solo, hit_solo = _solo_answers(tiny_artifact)

    with Engine.load(tiny_artifact, speculative="draft:3", draft=tiny_artifact, threads=1) as engine:
        model = engine.draft_model
        taken = []
        take_row = model.take_row

        def spy(drafter):  # every row handed out is free: no running request holds it
            busy = [r for r, h in enumerate(model.rows) if h is not None and not h.finished()]
            row = take_row(drafter)
            taken.append((row, busy))
            return row

        model.take_row = spy
        model.token_cost = lambda: None  # never measured: every drafting row drafts K from its first step
        together = _run(engine, requests, cancel="cancelled")
        for name in requests:
            got, want = _same(together[name], solo[name])
            assert got == want, name
        assert together["cancelled"].finish_reason == "cancelled"
        assert sum(r.drafted_tokens for r in together.values()) > 0
        assert any(busy for _, busy in taken)  # rows were taken while others drafted
        assert all(row is None or row not in busy for row, busy in taken)

        # REPEAT's request finished: its prompt is in the target's pool and in a draft row, so the
        # request extending it prefills only its new tokens there too.
        starts, prefill = [], model.engine.prefill_rows

        def prefill_spy(rows, at, row):
            starts.append(at[0])
            return prefill(rows, at, row)

        model.engine.prefill_rows = prefill_spy
        hit = engine.generate([REPEAT + " again"], max_new_tokens=8, sampling=GREEDY)[0]
        assert hit.cached_tokens > 0 and starts and starts[0] > 0
        assert hit.token_ids == hit_solo.token_ids and hit.text == hit_solo.text


def test_openvino_prefill_with_every_batch_loop_feature_it_allows(tiny_artifact):
    """``prefill="openvino"`` (speculation is refused with it): the prefix cache, a regex row, a
    seeded sampled row with a logit bias, a stop string, min_tokens, a cancellation and a later
    prefix hit in one scheduler batch, every one-row prefill on OpenVINO (its token threshold lowered
    to 2 here; the test prompts are short), each request's answer its solo one on a plain ORT engine."""
    pytest.importorskip("openvino")
    requests, solo, hit_solo = _solo_answers(tiny_artifact)
    del requests["predicted"]  # a prediction drafts: refused with prefill="openvino"
    with Engine.load(tiny_artifact, threads=1, prefill="openvino") as engine:
        engine.backend.long_prefill.min_tokens = 2  # every prompt; a one-token decode step stays on ORT
        assert engine.prefix_pool is not None  # the default: on
        together = _run(engine, requests, cancel="cancelled")
        # Prompts admitted together are prefilled as one batch, which stays on ORT (OpenVINO runs one
        # row a call); a prompt admitted alone (here the cancelled one, after the batch) runs on OpenVINO.
        assert engine.backend.long_prefill.calls >= 1
        for name in requests:
            got, want = _same(together[name], solo[name])
            assert got == want, name
        assert together["cancelled"].finish_reason == "cancelled"
        calls = engine.backend.long_prefill.calls
        hit = engine.generate([REPEAT + " again"], max_new_tokens=8, sampling=GREEDY)[0]
        assert hit.cached_tokens > 0  # the suffix after the cached prefix: prefilled on OpenVINO too
        assert engine.backend.long_prefill.calls == calls + 1
        assert hit.token_ids == hit_solo.token_ids and hit.text == hit_solo.text


@pytest.fixture(scope="module")
def tiny_int4_artifact(tmp_path_factory):
    from kvforge.compile import compile_model
    from tests.conftest import BUNDLED_MODEL

    out = tmp_path_factory.mktemp("artifacts") / "kvforge-tiny-int4"
    compile_model(BUNDLED_MODEL, out, max_batch=8, max_seq=512, score_graph=False, quantize="int4", progress=None)
    return out


@pytest.mark.parametrize("compute", ["int8", "fp32"])
def test_int8_and_fp32_prefills_with_every_batch_loop_feature(tiny_int4_artifact, compute):
    """``prefill="int8"`` (and ``"fp32"``) on an int4 compile of the bundled model, with n-gram drafts, the prefix
    cache, a regex row, a seeded sampled row with a logit bias, a stop string, min_tokens, a
    prediction, a cancellation and a later prefix hit in one scheduler batch: each request's answer
    is its solo answer on a plain engine with the same prefill (no prefix cache, no drafts). Prompts
    run the int8 graph, whether admitted together or alone; steps and verify calls the int4 graphs."""
    requests, solo, hit_solo = _solo_answers(tiny_int4_artifact, prefill=compute)
    with Engine.load(tiny_int4_artifact, speculative="ngram", threads=1, prefill=compute) as engine:
        assert engine.prefix_pool is not None
        runs, bind = [], engine.backend.long_prefill.bind

        def spy(graph, inputs, outputs):  # the prompts the int8 graph takes
            runs.append(len(inputs["input_lengths"]))
            return bind(graph, inputs, outputs)

        engine.backend.long_prefill.bind = spy
        together = _run(engine, requests, cancel="cancelled")
        assert runs, f"no prompt ran the {compute} graph"
        for name in requests:
            got, want = _same(together[name], solo[name])
            assert got == want, name
        assert together["cancelled"].finish_reason == "cancelled"
        assert sum(r.drafted_tokens for r in together.values()) > 0
        hit = engine.generate([REPEAT + " again"], max_new_tokens=8, sampling=GREEDY)[0]
        assert hit.cached_tokens > 0
        assert hit.token_ids == hit_solo.token_ids and hit.text == hit_solo.text
