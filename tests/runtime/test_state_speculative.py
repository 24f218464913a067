"""Speculative decoding on a hybrid family (LFM2: conv states beside an attention layer) is exact:
verify leaves each row's state as if only its accepted tokens had run.

* n-gram drafts, partly accepted and partly rejected, give plain greedy tokens in both lowerings
  (onnx: rows verify in one call; gqa: the split step's batch-1 calls), batched and alone; without
  the fix (verify writing the rows' states in place) they do not;
* predictions wrong at different tokens make the rows of shared verify calls accept different
  counts, with plain greedy tokens;
* one verify call of three rows that keep 2, 4 and 1 of their 4 tokens (and 4, 2, 4) leaves each
  row's states and next logits as a plain prefill of the kept tokens does;
* a hybrid draft model resumes each proposal from the state snapshot of where the target's
  rejection left it: its drafts are its greedy tokens after every partial acceptance; drafting
  with it gives plain greedy tokens;
* the OpenAI server drafts a chat's ``prediction`` on a hybrid by default: the answer is the plain
  one, with accepted and rejected prediction tokens in the usage;
* a rejection's re-run is priced: prompt lookup alone drafts shorter, or not at all, on a hybrid;
* every batch-loop feature at once with prompt-lookup drafting gives each request its solo answer.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.speculative import SpeculativeConfig
from kvforge.runtime.speculative.cost import best_k, rerun_cost
from kvforge.runtime.speculative.draft_model import DraftModel
from kvforge.runtime.speculative.states import keep_accepted
from tests.conftest import CHATML_TEMPLATE
from tests.helpers import assert_close

# Seeds of prompts p + (the model's greedy continuation of p) + p: prompt lookup drafts the
# continuation again after the second p, which the model partly repeats (found on the tiny LFM2).
SEEDS = [[249, 208, 156, 245, 184], [362, 309, 76, 159, 51], [287, 52, 182, 223, 162]]


@pytest.fixture(scope="module")
def lfm2_onnx(lfm2_dir, tmp_path_factory):
    """The tiny LFM2 with a ChatML template, compiled with the onnx lowering (several rows verify
    in one call), max_batch 3, max_seq 64, no score graph."""
    from kvforge.compile import compile_model

    root = tmp_path_factory.mktemp("lfm2-onnx")
    model = root / "model"
    shutil.copytree(lfm2_dir, model)
    config = {"chat_template": CHATML_TEMPLATE, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    compile_model(model, root / "out", max_batch=3, max_seq=64, lowering="onnx", score_graph=False, progress=None)
    return root / "out"


@pytest.fixture(scope="module")
def prompts(lfm2_artifact):
    with Engine.load(lfm2_artifact, threads=1) as plain:
        return [p + plain.generate([p], max_new_tokens=12)[0].token_ids + p for p in SEEDS]


@pytest.mark.parametrize("lowering", ["onnx", "gqa"])
def test_ngram_drafts_give_plain_greedy_tokens(request, lowering, prompts):
    out = request.getfixturevalue("lfm2_onnx" if lowering == "onnx" else "lfm2_artifact")
    with (
        Engine.load(out, threads=1) as plain,
        Engine.load(out, threads=1, speculative="ngram:4") as spec,
        Engine.load(out, threads=1, speculative="ngram:4") as broken_engine,
    ):
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=16)]
        batch = spec.generate(prompts, max_new_tokens=16)
        single = [spec.generate([p], max_new_tokens=16)[0] for p in prompts]
        broken_engine.verify_states = {}  # verify writes the rows' states in place: the drafts' states stay
        broken = [broken_engine.generate([p], max_new_tokens=16)[0].token_ids for p in prompts]
    assert [r.token_ids for r in batch] == want
    assert [r.token_ids for r in single] == want
    accepted = sum(r.accepted_tokens for r in single)
    assert 0 < accepted < sum(r.drafted_tokens for r in single)  # drafts accepted and rejected
    # rows that rejected a draft go wrong without keeping their accepted state
    assert broken != want


def test_rows_of_one_verify_call_accept_different_counts(lfm2_onnx, prompts):
    """Three rows predicted right but for one token at 3, at 6 and nowhere: each rejects where its
    prediction is wrong, in calls shared with rows that accept all their drafts."""
    config = SpeculativeConfig(method="prediction", prediction_k=4, adaptive=False)
    with Engine.load(lfm2_onnx, threads=1) as plain, Engine.load(lfm2_onnx, threads=1, speculative=config) as spec:
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=16)]
        predictions = [list(w) for w in want]
        for row, at in ((0, 3), (1, 6)):
            predictions[row][at] = (predictions[row][at] + 1) % 384
        sampling = [SamplingParams(temperature=0.0, prediction=p) for p in predictions]
        got = spec.generate(prompts, max_new_tokens=16, sampling=sampling)
    assert [r.token_ids for r in got] == want
    assert [r.prediction_rejected > 0 for r in got] == [True, True, False]
    assert all(r.prediction_accepted >= 8 for r in got)


@pytest.mark.parametrize("kept", [[2, 4, 1], [4, 2, 4]], ids=["full-row-between", "short-row-between"])
def test_one_verify_call_keeps_each_rows_state_at_its_accepted_tokens(lfm2_onnx, prompts, kept):
    width = 4
    drafts = [[7, 16, 16, 339], [254, 203, 301, 165], [170, 179, 152, 188]]
    with Engine.load(lfm2_onnx, threads=1) as plain, Engine.load(lfm2_onnx, threads=1, speculative="ngram:4") as spec:
        spec.prefill(prompts)
        base = [len(p) for p in prompts]
        spec.verify_ids(3, width)[:] = drafts
        spec.verify_rows(3, width, 0)
        after_all = {name: s[:3].copy() for name, s in spec.verify_states.items()}  # each row after all 4
        spec.lengths[:3] = [b + k for b, k in zip(base, kept)]
        keep_accepted(spec, 0, base, spec.verify_ids(3, width))
        plain.prefill([p + d[:k] for p, d, k in zip(prompts, drafts, kept)])
        for name, state in plain.cache.states.items():
            assert_close(spec.cache.states[name][:3], state[:3], 1e-5, 1e-5, name)
            for row in range(3):  # a row that kept fewer tokens has another state than after all 4
                assert np.allclose(after_all[name][row], state[row], atol=1e-4) == (kept[row] == width), (name, row)
        assert_close(spec.decode([5, 6, 7]), plain.decode([5, 6, 7]), 1e-4, 1e-4, "the next step's logits")


def test_a_hybrid_draft_model_resumes_from_its_state_snapshots(lfm2_artifact):
    with Engine.load(lfm2_artifact, threads=1) as draft, Engine.load(lfm2_artifact, threads=1) as plain:
        model = DraftModel(draft, plain)
        prompt = SEEDS[0]
        drafter = model.drafter(prompt, lambda: False)
        generated = [7]
        # (drafts the target accepts, k): a rejection after each, so the draft row resumes mid-proposal
        for accept, k in [(2, 4), (0, 4), (3, 4), (1, 3), (4, 4), (1, 1), (0, 2), (2, 5)]:
            proposed = drafter.propose(generated, k)
            assert proposed == plain.generate([prompt + generated], max_new_tokens=k)[0].token_ids, generated
            generated += [*proposed[:accept], (proposed[accept] + 1) % 384 if accept < k else 11]


def test_openai_prediction_on_a_hybrid(lfm2_onnx):
    from fastapi.testclient import TestClient

    from kvforge.tools.serve.app import build_app
    from kvforge.tools.serve.serving import ModelServer

    messages = [{"role": "user", "content": "The for statement"}]
    with Engine.load(lfm2_onnx, threads=1) as plain:
        expected = plain.chat(messages, max_new_tokens=16, sampling=SamplingParams(temperature=0.0))
    server = ModelServer.load(lfm2_onnx, threads=1, model_name="lfm2")
    assert server.engine.speculative is not None  # served with speculative="prediction" by default
    half = expected.text[: len(expected.text) // 2] + " something else entirely"
    with TestClient(build_app(server)) as client:
        for content in (expected.text, half):
            prediction = {"type": "content", "content": content}
            body = {"model": "lfm2", "messages": messages, "max_tokens": 16, "temperature": 0, "prediction": prediction}
            answer = client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == expected.text
            details = answer.json()["usage"]["completion_tokens_details"]
            if content == half:
                assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] > 0


def test_draft_model_on_a_hybrid_gives_plain_greedy_tokens(lfm2_onnx, lfm2_artifact, prompts):
    with (
        Engine.load(lfm2_onnx, threads=1) as plain,
        Engine.load(lfm2_onnx, threads=1, speculative="draft:3", draft=lfm2_artifact) as spec,
    ):
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=16)]
        got = spec.generate(prompts, max_new_tokens=16)
    assert [r.token_ids for r in got] == want
    assert sum(r.accepted_tokens for r in got) > 0  # the same model compiled again: its drafts are accepted


def test_a_rejection_on_a_hybrid_is_priced_as_a_second_call():
    """Prompt lookup alone (and a draft model, and the gqa split step's own calls) on a hybrid
    weigh the re-run a rejection costs: shorter drafts, none at a moderate acceptance rate."""
    assert rerun_cost(0.0, 4) == pytest.approx(1.0)  # a sure rejection: one more call of one token
    assert [best_k(a, 8, 0.0) for a in (0.5, 0.7, 0.9)] == [3, 5, 8]
    assert [best_k(a, 8, 0.0, rerun=True) for a in (0.5, 0.7, 0.9)] == [0, 3, 8]
    assert [best_k(a, 8, 0.2, rerun=True) for a in (0.7, 0.9)] == [1, 4]  # a draft model's tokens cost too


@pytest.mark.parametrize("artifact", ["lfm2_artifact", "qwen35_artifact", "granite_artifact"])
def test_every_batch_loop_feature_with_ngram_drafts_gives_each_request_its_solo_answer(artifact, request):
    """test_state_model's feature batch (greedy, regex, seeded sampling, a stop string, a
    cancellation, chunked prefills on 2 rows, a prefix-cache hit on a state snapshot) with
    prompt-lookup drafting on, plus a row whose prediction (its greedy answer with one token
    changed) is drafted for certain, accepted up to the change and rejected there: each request as
    when it runs alone on the same engine. On LFM2 (short convolutions), Qwen3.5 (Gated DeltaNet)
    and Granite 4 (Mamba2), whose rule and scan are each one ORT ``LinearAttention`` under the
    default gqa lowering: one-token decode steps, 3-token prefill chunks and verify calls through
    it in the same batch, new rows reset by the op's first-token decay."""
    pytest.importorskip("llguidance")
    from tests.runtime.test_state_model import FEATURES, _features

    with Engine.load(request.getfixturevalue(artifact), threads=1, speculative="ngram:4") as spec:
        solo = {name: _features(spec, {name: r})[name] for name, r in FEATURES.items()}
        prompt, new, _, _ = FEATURES["greedy"]
        wrong = list(solo["greedy"].token_ids)
        wrong[new // 2] = (wrong[new // 2] + 1) % 384
        predicted = SamplingParams(temperature=0.0, prediction=wrong)
        requests = {**FEATURES, "predicted": (prompt, new, predicted, None)}
        solo["predicted"] = solo["greedy"]  # a prediction changes the calls, never the tokens
        spec.prefill_chunk = 3
        together = _features(spec, requests, cancel=True)
    for name in requests:
        got, want = together[name], solo[name]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), name
    assert together["cancelled"].finish_reason == "cancelled"
    verified = together["predicted"]  # its drafts were verified beside the other rows
    assert verified.prediction_accepted >= new // 2 - 1 and verified.prediction_rejected > 0, verified
    assert solo["prefix"].cached_tokens == 6  # resumed from the snapshot its lead-in left
    assert together["prefix"].cached_tokens == 9  # its whole prompt, with the logits its solo run kept
