"""A Gated DeltaNet hybrid end to end on the runtime (Qwen3.5: three linear-attention layers with a
conv state and a float32 recurrent state each, beside one attention layer): the artifact records
both states per linear layer and KV only for the layer that attends; its graphs run transformers'
swapped-out delta rule kernels as kvforge's rule, per linear layer one ORT ``LinearAttention``
(the default gqa lowering; the standard-op form is tested in tests/compile/test_op_translations.py
and, under the onnx lowering, in tests/runtime/test_families.py) and no loop; prefill and
decode logits are within the families' fp32 tolerance of transformers; a prompt prefilled in
chunks (across the rule's 64-token chunk) gives the logits of one call; greedy output equals
transformers' generate at both ends of ``max_seq`` (a 1-token prompt run to a full row, a
full-length prompt); a ragged batch and in-flight batching with more requests than rows give
every request its solo result; a one-token prompt in a used row starts from a zero state;
prompt-lookup drafting and the prefix cache (a chat's next turn resuming from a state snapshot)
give the tokens of a plain engine."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import transformers

from kvforge.graphs import manifest as mf
from kvforge.runtime import Engine
from tests.helpers import (
    assert_close,
    check_chunked_prefill,
    check_delta_rule_branches,
    check_greedy_at_both_ends_of_max_seq,
    check_in_flight_batching,
    check_prefill_and_decode_logits,
    check_state_features,
    hf_greedy,
    hf_logits,
)

ATOL, RTOL = 2e-4, 2e-4  # fp32, as tests/runtime/test_families.py
PROMPTS = [[3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101, 64], [7, 5, 9, 250, 31], [11, 2], [40, 41, 42, 43, 44, 45]]
NEW = [20, 6, 25, 12]
LONG = [(13 * i + 5) % 256 for i in range(70)]  # longer than one chunk of the delta rule


@pytest.fixture(scope="module")
def reference(qwen35_dir):
    return transformers.Qwen3_5ForCausalLM.from_pretrained(qwen35_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def engine(qwen35_artifact):
    with Engine.load(qwen35_artifact) as engine:
        yield engine


def test_manifest_records_both_states_and_one_linear_attention_per_linear_layer(qwen35_artifact):
    manifest = mf.read(qwen35_artifact)
    assert manifest.kv_cache["layers"] == [1]
    conv_channels = 2 * 2 * 16 + 4 * 16  # query and key (2 heads of 16), value (4 heads of 16)
    assert [
        (e["layer"], e["kind"], [(t["part"], t["shape"], t["dtype"]) for t in e["tensors"]]) for e in manifest.state
    ] == [
        (i, "gated_delta", [("conv", [conv_channels, 3], "float32"), ("recurrent", [4, 16, 16], "float32")])
        for i in (0, 2, 3)
    ]
    graph = onnx.load(str(qwen35_artifact / "prefill.onnx"), load_external_data=False).graph
    check_delta_rule_branches(graph, (0, 2, 3), fast=True)  # the gqa lowering: ORT's LinearAttention


def test_prefill_and_decode_logits_match_transformers(engine, reference):
    check_prefill_and_decode_logits(engine, reference, PROMPTS[0], ATOL, RTOL)


def test_chunked_prefill_equals_one_shot_prefill(engine):
    # chunks on, across and past a 64-token chunk of the delta rule
    check_chunked_prefill(engine, LONG, ((1, 70), (30, 64, 70), (65, 70), (3, 4, 70)))


def test_greedy_equals_transformers_at_both_ends_of_max_seq(engine, reference):
    check_greedy_at_both_ends_of_max_seq(engine, reference)


def test_ragged_batches_and_in_flight_batching_give_each_request_its_solo_result(engine, reference):
    batch = engine.generate([LONG, PROMPTS[1]], max_new_tokens=8)  # ragged: 70 and 5 tokens, one prefill
    assert [r.token_ids for r in batch] == [hf_greedy(reference, LONG, 8), hf_greedy(reference, PROMPTS[1], 8)]
    check_in_flight_batching(engine, reference, PROMPTS, NEW)


def test_drafting_and_the_prefix_cache_give_plain_tokens(qwen35_artifact):
    check_state_features(qwen35_artifact, [5, 6, 7, 8, 9] * 2, [40, 41, 42], new=10)


def test_a_one_token_prompt_in_a_used_row_starts_from_a_zero_state(engine, reference):
    """A new sequence whose prompt is one token runs the rule's one-token step with ``continues`` 0:
    it zeroes the row's state by scaling the step's factors, not by a pass over the state, so the
    row's previous sequence (a long prompt and decode steps) must leave no trace: the logits of
    the one token are transformers' for it alone, and equal whether the row was used before."""
    fresh = engine.prefill([[7]])[0].copy()
    engine.prefill([LONG])
    for token in (3, 9, 11):
        engine.decode([token])
    reused = engine.prefill([[7]])[0]
    np.testing.assert_array_equal(reused, fresh)
    assert_close(reused, hf_logits(reference, [7])[-1], ATOL, RTOL, "one token in a used row")
