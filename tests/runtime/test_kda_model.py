"""KDA hybrids end to end on the runtime (Kimi-Linear and Bailing-hybrid: three linear-attention
layers whose gated delta rule decays each key channel on its own, a conv state and a float32
recurrent state each, beside one latent-attention layer and MoE MLPs): the artifact records both
states per KDA layer and expanded KV only for the layer that attends; its graphs run kvforge's
per-channel rule, per KDA layer one ORT ``LinearAttention`` with the decay per key channel (the
default gqa lowering; the standard-op form, an ``If`` on the length over a one-token step and a
chunked rule with one ``Scan`` over 16-token chunks, runs under the onnx lowering) and no loop;
prefill and decode logits are within the families' fp32 tolerance of transformers; a prompt
prefilled in chunks (on, across and past the rule's chunk) gives the logits of one call; greedy
output equals transformers' generate at both ends of ``max_seq``; a ragged batch and in-flight
batching give every request its solo result; prompt-lookup drafting and the prefix cache give the
tokens of a plain engine."""

from __future__ import annotations

import onnx
import pytest
import transformers

from kvforge.compile import compile_model
from kvforge.graphs import manifest as mf
from kvforge.runtime import Engine
from tests import families
from tests.helpers import (
    check_chunked_prefill,
    check_delta_rule_branches,
    check_greedy_at_both_ends_of_max_seq,
    check_in_flight_batching,
    check_prefill_and_decode_logits,
    check_state_features,
    hf_greedy,
)

ATOL, RTOL = 2e-4, 2e-4  # fp32, as tests/runtime/test_families.py
PROMPTS = [[3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101, 64], [7, 5, 9, 250, 31], [11, 2], [40, 41, 42, 43, 44, 45]]
NEW = [20, 6, 25, 12]
LONG = [(13 * i + 5) % 256 for i in range(40)]  # two 16-token chunks of the KDA rule and a ragged third


@pytest.fixture(scope="module", params=["kimi-linear", "bailing-hybrid"])
def family(request, tmp_path_factory):
    """(case, model dir, artifact): the tiny config of tests/families.py compiled with the default
    lowering (gqa, ORT-optimized graphs), max_batch 2, max_seq 48, no score graph."""
    [(case, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == request.param]
    root = tmp_path_factory.mktemp(case)
    model_dir = families.build(root / "model", architecture, config_class, overrides)
    compile_model(model_dir, root / "out", max_batch=2, max_seq=48, score_graph=False, progress=None)
    return case, model_dir, root / "out"


@pytest.fixture(scope="module")
def reference(family):
    return transformers.AutoModelForCausalLM.from_pretrained(family[1], attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def engine(family):
    with Engine.load(family[2]) as engine:
        yield engine


def test_manifest_records_both_states_and_one_linear_attention_per_kda_layer(family):
    case, _, artifact = family
    manifest = mf.read(artifact)
    assert manifest.kv_cache["layers"] == [1]
    heads = 2 if case == "kimi-linear" else 4  # Bailing's KDA takes its attention's head count
    assert [
        (e["layer"], e["kind"], [(t["part"], t["shape"], t["dtype"]) for t in e["tensors"]]) for e in manifest.state
    ] == [
        (i, "gated_delta", [("conv", [3 * heads * 16, 3], "float32"), ("recurrent", [heads, 16, 16], "float32")])
        for i in (0, 2, 3)
    ]
    graph = onnx.load(str(artifact / "prefill.onnx"), load_external_data=False).graph
    check_delta_rule_branches(graph, (0, 2, 3), fast=True)  # the gqa lowering: ORT's LinearAttention


def test_prefill_and_decode_logits_match_transformers(engine, reference):
    check_prefill_and_decode_logits(engine, reference, LONG, ATOL, RTOL)


def test_chunked_prefill_equals_one_shot_prefill(engine):
    check_chunked_prefill(engine, LONG, ((1, 40), (10, 16, 40), (17, 40), (3, 4, 33, 40)))


def test_greedy_equals_transformers_at_both_ends_of_max_seq(engine, reference):
    check_greedy_at_both_ends_of_max_seq(engine, reference)


def test_ragged_batches_and_in_flight_batching_give_each_request_its_solo_result(engine, reference):
    batch = engine.generate([LONG, PROMPTS[1]], max_new_tokens=8)  # ragged: 40 and 5 tokens, one prefill
    assert [r.token_ids for r in batch] == [hf_greedy(reference, LONG, 8), hf_greedy(reference, PROMPTS[1], 8)]
    check_in_flight_batching(engine, reference, PROMPTS, NEW)


def test_drafting_and_the_prefix_cache_give_plain_tokens(family):
    check_state_features(family[2], [5, 6, 7, 8, 9] * 2, [40, 41, 42], new=8)
