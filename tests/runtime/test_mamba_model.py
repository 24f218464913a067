"""A Mamba (v1) model end to end on the runtime: no layer attends, every layer keeps a conv state
and a float32 selective-scan state. The artifact records both per layer and no KV; its graphs (the
CPU default ``gqa`` lowering) run the scan as one ONNX Runtime ``LinearAttention`` per layer (no
loop; the ``onnx`` lowering's one ``Scan`` over chunks: tests/graphs/test_state.py); prefill and
decode logits are within fp32 tolerance of transformers; greedy output equals transformers'
``generate`` at both ends of ``max_seq``; a ragged batch and in-flight batching (more requests
than rows, chunked prefills beside decoding rows) give each request its solo tokens; a prompt
prefilled in chunks (shorter than, equal to and across the scan's 32-token chunk) equals one
prefill of it; prompt-lookup drafting and the prefix cache (a chat's next turn resuming from a
state snapshot) give the tokens of a plain engine."""

from __future__ import annotations

import onnx
import pytest
import torch
import transformers

from kvforge.graphs import manifest as mf
from tests.helpers import (
    assert_close,
    check_chunked_prefill,
    check_greedy_at_both_ends_of_max_seq,
    check_in_flight_batching,
    check_state_features,
    hf_greedy,
)

PROMPTS = [[3, 17, 201, 33, 90, 4, 150, 77, 12, 9, 101, 64], [7, 5, 9, 250, 31], [11, 2], [40, 41, 42, 43, 44, 45, 46]]
NEW = [20, 6, 25, 12]
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def reference(mamba_dir):
    return transformers.MambaForCausalLM.from_pretrained(mamba_dir).eval()


@pytest.fixture(scope="module")
def engine(mamba_artifact):
    from kvforge.runtime import Engine

    with Engine.load(mamba_artifact) as engine:
        yield engine


def test_manifest_records_both_states_of_every_layer_and_no_kv(mamba_artifact):
    manifest = mf.read(mamba_artifact)
    assert manifest.kv_cache["layers"] == [] and manifest.kv_cache["shape"][0] == 0
    assert [(e["layer"], e["kind"]) for e in manifest.state] == [(0, "mamba"), (1, "mamba")]
    assert [(t["part"], t["shape"], t["dtype"]) for t in manifest.state[0]["tensors"]] == [
        ("conv", [128, 3], "float32"),
        ("recurrent", [128, 8], "float32"),
    ]
    for name in ("prefill", "decode"):  # the gqa lowering: one ORT LinearAttention per layer, no loop
        ops = [n.op_type for n in onnx.load(str(mamba_artifact / f"{name}.onnx"), load_external_data=False).graph.node]
        assert ops.count("LinearAttention") == 2 and not {"Scan", "Loop"} & set(ops), name


def _hf_steps(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """transformers' logits as its generate sees them: the prompt, then one step per token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
        logits = [out.logits[0, -1]]
        for token in tokens:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return logits


def test_prefill_and_decode_logits_are_within_tolerance_of_transformers(engine, reference):
    tokens = [5, 250, 19, 7]
    expected = _hf_steps(reference, PROMPTS[0], tokens)
    got = [engine.prefill([PROMPTS[0]])[0].copy()]
    got += [engine.decode([t])[0].copy() for t in tokens]
    for step, (ours, theirs) in enumerate(zip(got, expected)):
        assert_close(ours, theirs.numpy(), ATOL, RTOL, f"step {step}")


def test_chunked_prefill_equals_one_shot_prefill(engine):
    prompt = [(11 * i + 5) % 256 for i in range(40)]  # longer than the 32-token scan chunk
    check_chunked_prefill(engine, prompt, ((1, 40), (3, 35, 40), (32, 40), (7, 20, 33, 39, 40)))


def test_greedy_equals_transformers_at_both_ends_of_max_seq(engine, reference):
    check_greedy_at_both_ends_of_max_seq(engine, reference)


def test_ragged_batches_and_in_flight_batching_give_each_request_its_solo_tokens(engine, reference):
    batch = engine.generate(PROMPTS[:2], max_new_tokens=10)  # a ragged batch of 2: padding after row 1
    assert [r.token_ids for r in batch] == [hf_greedy(reference, p, 10) for p in PROMPTS[:2]]
    check_in_flight_batching(engine, reference, PROMPTS, NEW)


def test_drafting_and_the_prefix_cache_give_plain_tokens(mamba_artifact):
    """No layer attends: the prefix cache keeps only state snapshots (blocks of no KV)."""
    check_state_features(mamba_artifact, [5, 6, 7, 8] * 2, [40, 41, 42])
