"""A tied lm_head in the ORT graphs with ``pack_tied_lm_head`` (kvforge.compile.optimize.alias_tied_gemm_weights):
the Gemm that reads the embedding table reads row views of it instead, initializers of its own that point at the
table's bytes in weights.data (the file holds the table once), split into parts of at most the
given size that start on a page of the file, joined by a Concat; ORT runs the rewritten graph with
prepacking on and gives the same logits as the original (the same dot products); the Gather still
reads the table itself. A Gemm of another layout is left alone. A tiny tied Llama compiled with
``pack_tied_lm_head=True`` reads a view in its ORT graphs (no Identity), stores the table once and
generates transformers' greedy tokens; a non-bool flag is refused."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from kvforge.compile.optimize import PAGE, alias_tied_gemm_weights
from kvforge.compile.weights import SharedWeights

VOCAB, HIDDEN = 96, 32  # rows of 128 bytes: 32 rows per page


def _graph(trans_b: int = 1) -> onnx.ModelProto:
    """Gather(table, ids) -> h; logits = Gemm(h, table, transB) (``transB=0`` reads a [HIDDEN, VOCAB] table)."""
    rng = np.random.default_rng(0)
    shape = (VOCAB, HIDDEN) if trans_b else (HIDDEN, VOCAB)
    table = numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), "table")
    nodes = [
        oh.make_node("Gather", ["table", "ids"], ["h"], name="embed"),
        oh.make_node("Gemm", ["x", "table"], ["logits"], name="lm_head", transB=trans_b),
    ]
    inputs = [
        oh.make_tensor_value_info("ids", TensorProto.INT64, [3]),
        oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HIDDEN if trans_b else VOCAB]),
    ]
    outputs = [
        oh.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", VOCAB if trans_b else HIDDEN]),
        oh.make_tensor_value_info("h", TensorProto.FLOAT, None),
    ]
    graph = oh.make_graph(nodes, "tied", inputs, outputs, [table])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])


def _externalized(tmp_path, proto: onnx.ModelProto) -> tuple[ir.Model, SharedWeights]:
    weights = SharedWeights(tmp_path)
    model = ir.from_proto(proto)
    weights.externalize(model)
    return model, weights


def _run(path, trans_b: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {
        "ids": np.array([0, 40, VOCAB - 1]),
        "x": rng.standard_normal((4, HIDDEN if trans_b else VOCAB)).astype(np.float32),
    }
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as the runtime loads them
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_gemm_reads_page_aligned_row_views_of_the_table_in_parts(tmp_path):
    model, weights = _externalized(tmp_path, _graph())
    ir.save(model, tmp_path / "before.onnx")
    size_before = weights.path.stat().st_size
    assert alias_tied_gemm_weights(model.graph, weights, part_bytes=5000) == 1  # 39 rows -> 32-row parts
    weights.save(model, "after")
    assert weights.path.stat().st_size == size_before  # views, not copies

    graph = onnx.load(str(tmp_path / "after.onnx"), load_external_data=False).graph
    ops = Counter(n.op_type for n in graph.node)
    assert ops == {"Gather": 1, "Gemm": 3, "Concat": 1}
    inits = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
    table = inits["table"]
    gemms = [n for n in graph.node if n.op_type == "Gemm"]
    spans = [(int(inits[g.input[1]]["offset"]), int(inits[g.input[1]]["length"])) for g in gemms]
    start = int(table["offset"])
    assert spans == [(start, 32 * 128), (start + 32 * 128, 32 * 128), (start + 64 * 128, 32 * 128)]
    assert all(offset % PAGE == 0 for offset, _ in spans)
    assert next(n for n in graph.node if n.op_type == "Gather").input[0] == "table"
    concat = next(n for n in graph.node if n.op_type == "Concat")
    assert list(concat.input) == [g.output[0] for g in gemms] and concat.output[0] == "logits"

    for got, want in zip(_run(tmp_path / "after.onnx"), _run(tmp_path / "before.onnx")):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_table_within_one_part_is_one_view(tmp_path):
    model, weights = _externalized(tmp_path, _graph())
    assert alias_tied_gemm_weights(model.graph, weights) == 1
    weights.save(model, "after")
    graph = onnx.load(str(tmp_path / "after.onnx"), load_external_data=False).graph
    assert Counter(n.op_type for n in graph.node) == {"Gather": 1, "Gemm": 1}
    inits = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
    [gemm] = [n for n in graph.node if n.op_type == "Gemm"]
    assert gemm.input[1] != "table"
    view, table = inits[gemm.input[1]], inits["table"]
    assert (view["offset"], view["length"]) == (table["offset"], table["length"])


def test_a_gemm_of_another_layout_is_left_alone(tmp_path):
    model, weights = _externalized(tmp_path, _graph(trans_b=0))
    assert alias_tied_gemm_weights(model.graph, weights) == 0
    assert [n.inputs[1].name for n in model.graph if n.op_type == "Gemm"] == ["table"]


def test_a_row_view_needs_a_tensor_of_the_file(tmp_path):
    weights = SharedWeights(tmp_path)
    foreign = ir.tensor(np.zeros((4, 4), dtype=np.float32), name="foreign")
    with pytest.raises(ValueError, match="stored in weights.data"):
        weights.row_view(foreign, 0, 2, "foreign/rows")


def test_compiled_with_pack_tied_lm_head(tmp_path):
    from kvforge.compile import compile_model
    from kvforge.runtime import Engine
    from tests.helpers import hf_greedy, make_llama

    model_dir = make_llama(tmp_path / "model", tie_word_embeddings=True)
    out = tmp_path / "packed"
    compile_model(model_dir, out, max_batch=2, max_seq=48, score_graph=False, pack_tied_lm_head=True, progress=None)
    graph = onnx.load(str(out / "prefill.ort.onnx"), load_external_data=False).graph
    inits = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
    [gather] = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits]
    [gemm] = [n for n in graph.node if n.op_type == "Gemm"]
    assert gemm.input[1] != gather.input[0] and not [n for n in graph.node if n.op_type == "Identity"]
    view, table = inits[gemm.input[1]], inits[gather.input[0]]
    assert (view["offset"], view["length"]) == (table["offset"], table["length"])

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    prompts = [[1, 17, 42, 99, 5], [3, 4, 5]]
    with Engine.load(out, threads=1) as engine:
        got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=12)]
    assert got == [hf_greedy(reference, p, 12) for p in prompts]


def test_pack_tied_lm_head_must_be_a_bool(tmp_path):
    from kvforge.compile import compile_model

    with pytest.raises(TypeError, match="pack_tied_lm_head"):
        compile_model(tmp_path, tmp_path / "out", pack_tied_lm_head="yes", progress=None)
