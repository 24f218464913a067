"""The attention-glue rules of the ORT graphs (kvforge.compile.fusions) remove the reshape/transpose
pairs around ``GroupQueryAttention`` and compute the lengths once per graph on a Llama, rotate a
q/k-norm (Qwen3) layer's normed heads in 3-D without its transposes, leave a partial-rotary
(GPT-NeoX) layer's structure alone, and in every case give the logits and caches of the graph
without them (within 1e-5)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from kvforge.compile import export as export_stage
from kvforge.compile import load as load_stage
from kvforge.compile.fusions import fuse_attention_glue
from kvforge.compile.optimize import fuse_rotary
from tests import families

BATCH, SEQ, CAPACITY = 2, 5, 16


def _fused(model_dir) -> tuple[ir.Model, ir.Model, dict[str, int]]:
    """The gqa prefill graph after the fusions that precede the glue rules, and a copy after them."""
    from onnxscript.rewriter import ort_fusions

    loaded = load_stage.load_model(model_dir, "float32")
    exported = export_stage.export_prefill(loaded, "gqa", max_batch=BATCH, max_seq=CAPACITY)
    before, _ = ort_fusions.optimize_for_ort(exported)
    fuse_rotary(before)
    proto = ir.to_proto(before)
    after = ir.from_proto(proto)
    counts = fuse_attention_glue(after)
    return ir.from_proto(proto), after, counts


def _run(model: ir.Model, dims, seq: int, start: list[int]) -> list[np.ndarray]:
    """Logits and presents of a call on a random cache: ``seq`` tokens per row written at
    ``start``; rows shorter by 2 when ``seq`` > 1 (a ragged prefill)."""
    rng = np.random.default_rng(0)
    cache = (BATCH, dims.num_kv_heads, CAPACITY, dims.head_dim)
    write = np.array(start, dtype=np.int64)
    feeds = {
        "input_ids": rng.integers(0, 256, (BATCH, seq)).astype(np.int64),
        "position_ids": write[:, None] + np.arange(seq, dtype=np.int64)[None, :],
        "write_indices": write,
        "input_lengths": np.array([seq, max(1, seq - 2)], dtype=np.int64),
    }
    for layer in range(dims.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = rng.standard_normal(cache, dtype=np.float32)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _ops(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    built = {}
    for case in families.CASES:
        if case[0] in ("llama", "qwen3-qk-norm", "gpt-neox"):
            model_dir = families.build(tmp_path_factory.mktemp(case[0]) / "model", *case[1:])
            built[case[0]] = (model_dir, load_stage.load_model(model_dir, "float32").dims)
    return built


def _assert_same_outputs(before: ir.Model, after: ir.Model, dims) -> None:
    """A ragged prefill from position 0 and a decode step (batch 2, rows at 3 and 7 tokens: ORT's
    GroupQueryAttention continues a sequence of several tokens at batch 1 only)."""
    names = [v.name for v in before.graph.outputs]
    for seq, start in ((SEQ, [0, 0]), (1, [3, 7])):
        for name, want, got in zip(names, _run(before, dims, seq, start), _run(after, dims, seq, start)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"{name}, {seq} tokens at {start}")


def test_llama_attention_reads_projections_directly_and_lengths_once(cases):
    model_dir, dims = cases["llama"]
    before, after, counts = _fused(model_dir)
    n = dims.num_layers
    assert counts["rotary_3d"] == 2 * n  # q and k in every layer
    ops_before, ops_after = _ops(before), _ops(after)
    assert ops_before["Transpose"] >= 4 * n and ops_before["ReduceMax"] == n
    assert ops_after["Transpose"] == 0 and ops_after["ReduceMax"] == 1 and ops_after["Shape"] <= 1
    for node in after.graph:
        if node.op_type == "GroupQueryAttention":  # q, k, v straight from the projections/rotaries
            assert [i.producer().op_type for i in node.inputs[:3]] == ["RotaryEmbedding", "RotaryEmbedding", "MatMul"]
            assert {u.op_type for u, _ in node.outputs[0].uses()} == {"MatMul"}  # o_proj, no Reshape between
        if node.op_type == "RotaryEmbedding":  # named after its layer: /model/layers.N/self_attn/rotary_q|k
            assert node.name.startswith("/model/layers.") and node.name.endswith(("/rotary_q", "/rotary_k"))
            assert len(node.inputs[0].shape) == 3 and node.attributes.get_int("num_heads") in (
                dims.num_heads,
                dims.num_kv_heads,
            )
    assert len(after.graph) < len(before.graph) - 12 * n
    _assert_same_outputs(before, after, dims)


def test_partial_rotary_is_left_alone(cases):
    """GPT-NeoX rotates a quarter of each head and concatenates the rest: neither 3-D rotary rule
    may match it."""
    model_dir, dims = cases["gpt-neox"]
    before, after, counts = _fused(model_dir)
    assert counts["rotary_3d"] == 0 and counts["normed_rotary_3d"] == 0
    assert _ops(after)["RotaryEmbedding"] == _ops(before)["RotaryEmbedding"]
    assert _ops(after)["ReduceMax"] == 1  # the lengths are still computed once
    _assert_same_outputs(before, after, dims)


def test_qk_norm_heads_are_rotated_in_3d_without_transposes(cases):
    """Qwen3 normalizes q/k per head between the view and the transpose, so the view is not the
    projection's: the normed heads are flattened and rotated in 3-D instead (NormedRotary3D), and
    the four transposes of each layer go, with the same logits and caches."""
    model_dir, dims = cases["qwen3-qk-norm"]
    before, after, counts = _fused(model_dir)
    n = dims.num_layers
    assert counts["rotary_3d"] == 0 and counts["normed_rotary_3d"] == 2 * n
    ops_before, ops_after = _ops(before), _ops(after)
    assert ops_before["Transpose"] >= 4 * n and ops_after["Transpose"] == 0, (ops_before, ops_after)
    assert ops_after["RotaryEmbedding"] == ops_before["RotaryEmbedding"] == 2 * n
    for node in after.graph:
        if node.op_type == "RotaryEmbedding":  # 3-D, on the normed heads flattened
            assert node.attributes.get_int("num_heads") in (dims.num_heads, dims.num_kv_heads)
            assert node.inputs[0].producer().op_type == "Reshape"
            assert node.name.endswith(("/rotary_q", "/rotary_k"))
    assert ops_after["ReduceMax"] == 1
    _assert_same_outputs(before, after, dims)


def test_saved_graph_counts_in_the_artifact(llama_artifact):
    """The compiled artifact's ORT graph carries the rewrite (optimize_graphs runs the rules)."""
    graph = onnx.load(str(llama_artifact / "prefill.ort.onnx"), load_external_data=False).graph
    ops = Counter(node.op_type for node in graph.node)
    assert ops["Transpose"] == 0 and ops["ReduceMax"] == 1 and ops["GroupQueryAttention"] >= 1
