"""A hybrid family end to end on the runtime (LFM2: short-convolution layers with a conv state beside
an attention layer): the artifact records its state entries and KV only for the layer that attends;
its graphs lower the conv to an ``If`` on the call's length (one token: products over the window;
more: a grouped ``Conv`` over the state and the chunk), with no loop; chunked prefill equals
one-shot prefill; greedy output equals transformers' generate at both ends of ``max_seq`` (a 1-token
prompt run to a full row, a full-length prompt); in-flight batching with more requests than rows
(rows finish at different steps, survivors are compacted, a chunked prefill is moved) gives every
request its solo result; every batch-loop feature a hybrid runs (a regex-constrained row, seeded
sampling with a logit bias, a stop string, a cancellation, chunked prefills, a prefix-cache hit on a
state snapshot, n-gram drafts) on at once gives each request its solo answer; a session continues a
row's state turn by turn and re-prefills after a rewind; the features a state still keeps out refuse
up front, naming the state layers (shared KV, the GPU backends, a ragged score call; the prefix
cache, KV blocks, saved sessions and the hand-off carry the state:
tests/runtime/test_state_blocks.py; speculative decoding keeps each row's state at its accepted
tokens: tests/runtime/test_state_speculative.py); the memory plan counts KV for the attention layer
only and the state bytes beside it; inspect reports the state; the OpenAI server completes on it;
compare finds it exact (prefill, decode, perplexity, padded batches)."""

from __future__ import annotations

import re

import onnx
import pytest
import transformers

from kvforge.graphs import manifest as mf
from kvforge.runtime import Engine, SamplingParams
from tests.helpers import (
    assert_close,
    check_chunked_prefill,
    check_greedy_at_both_ends_of_max_seq,
    check_in_flight_batching,
    hf_greedy,
)

PROMPTS = [[3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101, 64], [7, 5, 9, 250, 31], [11, 2], [40, 41, 42, 43, 44, 45, 46]]
NEW = [20, 6, 25, 12]


@pytest.fixture(scope="module")
def reference(lfm2_dir):
    return transformers.Lfm2ForCausalLM.from_pretrained(lfm2_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def engine(lfm2_artifact):
    with Engine.load(lfm2_artifact) as engine:  # the default prefix cache, with state snapshots
        yield engine


def test_manifest_records_the_state_and_kv_only_where_layers_attend(lfm2_artifact):
    manifest = mf.read(lfm2_artifact)
    assert manifest.schema_version == 3
    assert manifest.kv_cache["layers"] == [1] and manifest.kv_cache["shape"][0] == 1
    assert [(e["layer"], e["kind"], e["tensors"][0]["shape"]) for e in manifest.state] == [
        (0, "conv", [64, 2]),
        (2, "conv", [64, 2]),
        (3, "conv", [64, 2]),
    ]
    inputs = [t.name for t in manifest.graphs["prefill"].inputs]
    assert "past_key_values.0.key" not in inputs and "past_key_values.1.key" in inputs
    assert inputs[-3:] == ["past_state.0.conv", "past_state.2.conv", "past_state.3.conv"]
    graph = onnx.load(str(lfm2_artifact / "prefill.onnx"), load_external_data=False).graph
    branches = [n for n in graph.node if n.op_type == "If"]
    convs = [c for n in branches for a in n.attribute if a.g.node for c in a.g.node if c.op_type == "Conv"]
    assert len(branches) == 3 and len(convs) == 3
    assert all(a.i == 64 for n in convs for a in n.attribute if a.name == "group")
    assert not {"Loop", "Scan", "Conv"} & {n.op_type for n in graph.node}


def test_chunked_prefill_equals_one_shot_prefill(engine):
    check_chunked_prefill(engine, PROMPTS[0], ((1, 12), (2, 5, 12), (4, 7, 11, 12)))  # chunks < and > the kernel


def test_greedy_equals_transformers_at_both_ends_of_max_seq(engine, reference):
    check_greedy_at_both_ends_of_max_seq(engine, reference)


def test_in_flight_batching_moves_states_with_their_rows(engine, reference):
    check_in_flight_batching(engine, reference, PROMPTS, NEW)
    batch = engine.generate(PROMPTS[:2], max_new_tokens=10)  # a ragged batch of 2
    assert [r.token_ids for r in batch] == [hf_greedy(reference, p, 10) for p in PROMPTS[:2]]


def test_score_of_equal_rows_runs_and_ragged_rows_are_refused(engine, reference):
    import torch

    logits = engine.score([PROMPTS[0]])
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    assert_close(logits[0], theirs, 2e-4, 2e-4, "score logits")
    with pytest.raises(ValueError, match=r"score: this artifact's layers \[0, 2, 3\] keep a conv state"):
        engine.score(PROMPTS[:2])


REFUSALS = [
    (dict(kv_shared=True), "kv_shared=True: .*which lent KV rows do not carry"),
]


@pytest.mark.parametrize(("options", "message"), REFUSALS, ids=["kv-shared"])
def test_features_without_state_snapshots_refuse_at_load(lfm2_artifact, options, message):
    with pytest.raises(ValueError, match=message):
        Engine.load(lfm2_artifact, **options)


def test_a_session_continues_its_state_and_re_prefills_after_a_rewind(engine, reference):
    greedy = SamplingParams(temperature=0.0)
    with engine.session() as session:
        session.append(PROMPTS[0])
        first = session.generate(max_new_tokens=6, sampling=greedy)
        assert first.token_ids == hf_greedy(reference, PROMPTS[0], 6)
        session.append(PROMPTS[1])  # the next turn prefills only its new tokens, from the row's state
        conversation = session.tokens
        second = session.generate(max_new_tokens=6, sampling=greedy)
        assert second.token_ids == hf_greedy(reference, conversation, 6)
        session.rewind(9)  # below the cached tokens: the state cannot go back, the row is dropped
        assert session.cached == 0
        rewound = session.tokens
        third = session.generate(max_new_tokens=6, sampling=greedy)
        assert third.token_ids == hf_greedy(reference, rewound, 6)


def test_memory_plan_counts_kv_of_attention_layers_and_the_state(lfm2_artifact):
    from kvforge.compile.plan import format_plan, plan_for

    plan = plan_for(lfm2_artifact)
    assert plan.kv_cache_bytes == 1 * 2 * 2 * 2 * 48 * 16 * 4  # one attention layer: [1, 2, B, H_kv, S, D] fp32
    assert plan.state_bytes == 2 * 3 * 64 * 2 * 4  # B rows x three conv layers' [C, K-1] fp32
    assert plan.total_bytes == plan.weights_bytes + plan.kv_cache_bytes + plan.state_bytes + plan.activation_bytes + (
        plan.reserve_bytes
    )
    assert "model state" in format_plan(plan)


# name -> (prompt, max_new_tokens, sampling, stop): every batch-loop feature a hybrid runs
FEATURES = {
    "greedy": ("The for statement iterates", 14, SamplingParams(temperature=0.0), None),
    "regex": ("A list is a mutable", 12, SamplingParams(temperature=0.0, regex=r"[a-z]+( [a-z]+){1,4}\."), None),
    "sampled": ("Exceptions are", 10, SamplingParams(temperature=0.8, top_p=0.9, seed=7, logit_bias={5: -100}), None),
    "stop": ("The while loop repeats", 16, SamplingParams(temperature=0.0), ["e"]),
    # extends "greedy"'s prompt: a prefix hit on the state snapshot at that prompt's end
    "prefix": ("The for statement iterates over the items", 8, SamplingParams(temperature=0.0), None),
}


def _features(engine: Engine, requests: dict, cancel: bool = False) -> dict:
    with engine.scheduler() as sched:
        handles = {name: sched.submit(p, n, s, stop) for name, (p, n, s, stop) in requests.items()}
        if cancel:
            victim = sched.submit("The for statement", max_new_tokens=40)
            victim.cancel()
        results = {name: h.result(timeout=120) for name, h in handles.items()}
        if cancel:
            results["cancelled"] = victim.result(timeout=120)
    return results


def test_every_batch_loop_feature_at_once_gives_each_request_its_solo_answer(engine):
    pytest.importorskip("llguidance")
    solo = {name: _features(engine, {name: r})[name] for name, r in FEATURES.items()}
    # the constraint holds on every token (a random model may not finish the sentence in 12 tokens)
    assert re.fullmatch(r"[a-z]+( [a-z]*){0,4}\.?", solo["regex"].text), solo["regex"].text
    assert solo["stop"].finish_reason == "stop" and solo["stop"].stop_string == "e"
    # chunked prefills beside decoding rows, on 2 rows for 5 requests
    saved_chunk, engine.prefill_chunk = engine.prefill_chunk, 3
    try:
        together = _features(engine, FEATURES, cancel=True)
    finally:
        engine.prefill_chunk = saved_chunk
    for name in FEATURES:
        got, want = together[name], solo[name]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_string) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_string,
        ), name
    assert together["cancelled"].finish_reason == "cancelled"
    assert solo["prefix"].cached_tokens == 6  # "The for statement iterates": greedy's prompt's snapshot
    assert together["prefix"].cached_tokens == 9  # its whole prompt, with the logits its solo run kept


def test_inspect_and_the_openai_server_run_on_a_hybrid(lfm2_artifact, engine):
    from fastapi.testclient import TestClient

    from kvforge.tools.inspect_artifact import format_report, inspect
    from kvforge.tools.serve.app import build_app
    from kvforge.tools.serve.serving import ModelServer

    report = inspect(lfm2_artifact)
    assert [e["layer"] for e in report["manifest"]["state"]] == [0, 2, 3]
    assert "state (conv) of layers [0, 2, 3]" in format_report(report)

    [expected] = engine.generate(["The for statement"], max_new_tokens=8, sampling=SamplingParams(temperature=0.0))
    server = ModelServer.load(lfm2_artifact, threads=1, model_name="lfm2")  # the default prefix cache: on
    with TestClient(build_app(server)) as client:
        body = {"model": "lfm2", "prompt": "The for statement", "max_tokens": 8, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected.text


def test_compare_checks_a_hybrid_against_transformers(lfm2_artifact, lfm2_dir):
    from kvforge.tools import compare

    text = compare.load_text(None)[:400]
    result = compare.run_compare(
        lfm2_artifact, lfm2_dir, ["The for statement", "A list"], text, steps=4, threads=1, stride=None
    )
    assert result["verdict"]["ok"], result["verdict"]
    assert result["batch"]["all_consistent"]  # a padded batch equals the batch-1 runs
    assert result["perplexity"]["kvforge"] == pytest.approx(result["perplexity"]["reference"], rel=1e-5)
    # per layer: the conv layers' states and the attention layer's KV, each as transformers' cache holds it
    rows = result["layers"]["per_layer"]
    assert [(r["layer"], r["part"]) for r in rows] == [(0, "conv"), (1, "key"), (1, "value"), (2, "conv"), (3, "conv")]
    assert all(0.0 <= r["max_abs_diff"] < 1e-4 for r in rows), rows
    assert "  layer 2: conv " in compare.format_report(result)
