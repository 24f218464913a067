"""``kvforge inspect``: the documented JSON of a real artifact (I/O as the KV contract names it, op
histograms, sizes, hashes), no TensorRT-unsupported op in the ``onnx`` lowering, and a contrib op
(``com.microsoft.GroupQueryAttention``) or a restricted use of ``Attention`` is reported."""

from __future__ import annotations

import json
import shutil

import onnx
from onnx import TensorProto, helper

from kvforge.graphs import contract
from kvforge.tools import inspect_artifact
from kvforge.tools.cli import main


def test_inspect_artifact_json(llama_onnx_artifact, tmp_path, capsys):
    assert main(["inspect", str(llama_onnx_artifact), "--json", str(tmp_path / "i.json")]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "i.json").read_text())
    manifest = json.loads((llama_onnx_artifact / "manifest.json").read_text())
    layers, vocab = manifest["model"]["num_layers"], manifest["model"]["vocab_size"]

    assert result["kind"] == "kvforge.inspect" and result["schema_version"] == 1
    assert set(result) == {"kind", "schema_version", "path", "manifest", "graphs", "files", "total_bytes", "tensorrt"}
    assert result["manifest"]["model"] == manifest["model"] and result["manifest"]["lowering"] == "onnx"
    assert result["manifest"]["kv_cache"]["bytes"] == manifest["kv_cache"]["bytes"]
    plain = {name: g for name, g in result["graphs"].items() if g["variant"] == "onnx"}
    assert set(plain) == set(contract.GRAPHS) and all(g["graph"] == name for name, g in plain.items())
    for name, graph in result["graphs"].items():
        if graph["variant"] == "ort":  # ONNX Runtime-optimized copy: same I/O as the graph it optimizes
            base = plain[graph["graph"]]
            assert name == f"{graph['graph']}.ort" and graph["file"] == manifest["graphs"][graph["graph"]]["ort_file"]
            assert (graph["inputs"], graph["outputs"]) == (base["inputs"], base["outputs"])
            assert graph["sha256_ok"] is True and sum(graph["ops"].values()) == graph["nodes"]
    for name, graph in plain.items():
        assert [t["name"] for t in graph["inputs"]] == contract.input_names(name, layers), name
        assert [t["name"] for t in graph["outputs"]] == contract.output_names(layers), name
        assert graph["inputs"][0] == {
            "name": "input_ids",
            "dtype": "int64",
            "shape": ["batch", 1 if name == "decode" else "seq"],
        }
        assert graph["sha256_ok"] is True and graph["opset"] == {"ai.onnx": 24}
        assert graph["ops"]["TensorScatter"] == 2 * layers and graph["ops"]["Attention"] == layers
        assert sum(graph["ops"].values()) == graph["nodes"]
        assert graph["bytes"] == (llama_onnx_artifact / graph["file"]).stat().st_size
        assert graph["external_bytes"] <= manifest["weights"]["bytes"]
    logits = {name: g["outputs"][0]["shape"] for name, g in plain.items()}
    assert logits == {
        "prefill": ["batch", vocab],
        "decode": ["batch", vocab],
        "score": ["batch", "seq", vocab],
        "verify": ["batch", "positions", vocab],
    }

    files = {f["file"]: f for f in result["files"]}
    assert files["weights.data"]["bytes"] == manifest["weights"]["bytes"] and files["weights.data"]["sha256_ok"]
    assert all(files[g["file"]]["sha256_ok"] for g in result["graphs"].values())
    assert files["manifest.json"]["sha256_ok"] is None  # no recorded hash
    assert result["total_bytes"] == sum(f.stat().st_size for f in llama_onnx_artifact.iterdir() if f.is_file())

    trt = result["tensorrt"]
    assert trt["tensorrt_version"] == "10.15" and "onnx/onnx-tensorrt" in trt["source"]
    assert trt["compatible"] is True and trt["unsupported_ops"] == []
    assert set(trt["graphs"]) == set(plain)  # TensorRT builds from the plain graphs, not ORT's copies
    assert all(not c["unsupported"] and not c["violations"] and c["opset_ok"] for c in trt["graphs"].values())
    assert "compatible: every op of every graph is supported" in printed
    assert "past_key_values.*.key" in printed and f"x{layers}" in printed  # per-layer tensors folded


def _gqa_graph(path) -> None:
    """A tiny decode-like graph with ORT's contrib GroupQueryAttention (the ``gqa`` lowering's op)."""
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [
        helper.make_tensor_value_info("query", f, ["batch", 1, 64]),
        helper.make_tensor_value_info("key", f, ["batch", 1, 32]),
        helper.make_tensor_value_info("value", f, ["batch", 1, 32]),
        helper.make_tensor_value_info("past_key_values.0.key", f, ["batch", 2, "capacity", 16]),
        helper.make_tensor_value_info("past_key_values.0.value", f, ["batch", 2, "capacity", 16]),
        helper.make_tensor_value_info("seqlens_k", i32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", f, ["batch", 1, 64]),
        helper.make_tensor_value_info("present.0.key", f, ["batch", 2, "capacity", 16]),
        helper.make_tensor_value_info("present.0.value", f, ["batch", 2, "capacity", 16]),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        [i.name for i in inputs],
        [o.name for o in outputs],
        name="/model/layers.0/self_attn/GroupQueryAttention",
        domain="com.microsoft",
        num_heads=4,
        kv_num_heads=2,
    )
    graph = helper.make_graph([node], "decode", inputs, outputs)
    opsets = [helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))


def test_inspect_lists_a_contrib_op_as_unsupported(llama_onnx_artifact, tmp_path, capsys):
    art = tmp_path / "art"
    shutil.copytree(llama_onnx_artifact, art)
    _gqa_graph(art / "decode.onnx")
    assert main(["inspect", str(art), "--json", str(tmp_path / "i.json")]) == 0  # informational: exit 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "i.json").read_text())
    trt = result["tensorrt"]
    assert trt["compatible"] is False and trt["unsupported_ops"] == ["com.microsoft.GroupQueryAttention"]
    [problem] = trt["graphs"]["decode"]["unsupported"]
    assert problem["op"] == "com.microsoft.GroupQueryAttention" and problem["count"] == 1
    assert "plugin" in problem["reason"]
    assert trt["graphs"]["prefill"]["compatible"] and trt["graphs"]["score"]["compatible"]
    assert result["graphs"]["decode"]["ops"] == {"com.microsoft.GroupQueryAttention": 1}
    assert result["graphs"]["decode"]["opset"] == {"ai.onnx": 24, "com.microsoft": 1}
    assert result["graphs"]["decode"]["sha256_ok"] is False  # modified since compile: reported, not refused
    assert "NOT compatible" in printed and "decode: com.microsoft.GroupQueryAttention x1" in printed
    assert "sha256 MISMATCH" in printed

    single = inspect_artifact.inspect(art / "decode.onnx")  # one .onnx file works too
    assert single["manifest"] is None and list(single["graphs"]) == ["decode"]
    assert single["tensorrt"]["unsupported_ops"] == ["com.microsoft.GroupQueryAttention"]


def test_inspect_checks_attention_restrictions_and_functions(tmp_path):
    """Attention with softcap and a TensorScatter on another axis, inside a local function."""
    f, i64, b = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    body = [
        helper.make_node("TensorScatter", ["past", "update", "idx"], ["present"], axis=1, name="scatter"),
        helper.make_node("Attention", ["q", "present", "present", "mask"], ["y"], softcap=30.0, name="attn"),
    ]
    function = helper.make_function(
        "local", "layer", ["q", "past", "update", "idx", "mask"], ["y"], body, [helper.make_opsetid("", 24)]
    )
    call = helper.make_node("layer", ["q", "past", "update", "idx", "mask"], ["y"], domain="local")
    inputs = [
        helper.make_tensor_value_info("q", f, [1, 2, 1, 4]),
        helper.make_tensor_value_info("past", f, [1, 2, 8, 4]),
        helper.make_tensor_value_info("update", f, [1, 2, 1, 4]),
        helper.make_tensor_value_info("idx", i64, [1]),
        helper.make_tensor_value_info("mask", b, [1, 1, 1, 8]),
    ]
    graph = helper.make_graph([call], "g", inputs, [helper.make_tensor_value_info("y", f, [1, 2, 1, 4])])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("local", 1)], functions=[function]
    )
    onnx.save(model, str(tmp_path / "g.onnx"))

    result = inspect_artifact.inspect(tmp_path / "g.onnx")
    assert result["graphs"]["g"]["ops"] == {"Attention": 1, "TensorScatter": 1}  # the function's body, not the call
    check = result["tensorrt"]["graphs"]["g"]
    assert check["unsupported"] == [] and check["compatible"] is False
    problems = {(v["op"], v["problem"]) for v in check["violations"]}
    assert problems == {("Attention", "softcap=30.0"), ("TensorScatter", "axis=1 (TensorRT needs -2)")}


def test_tensorrt_table_is_data_with_its_source():
    table = inspect_artifact.tensorrt_table()
    assert table["tensorrt_version"] == "10.15" and "docs/operators.md" in table["source"]
    assert {"TensorScatter", "Attention", "MatMul", "RMSNormalization"} <= set(table["supported"])
    assert not set(table["supported"]) & set(table["unsupported"])
    assert "GroupQueryAttention" not in table["supported"]


def test_inspect_refuses_what_is_not_an_artifact(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a kvforge artifact" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "neither an artifact directory nor an .onnx file" in capsys.readouterr().err


def test_inspect_flags_the_default_gqa_artifact_for_tensorrt(llama_artifact, tmp_path):
    """The default lowering is ORT's GroupQueryAttention: inspect says TensorRT needs ``--lowering onnx``
    (one GQA node per layer in every graph)."""
    assert main(["inspect", str(llama_artifact), "--json", str(tmp_path / "i.json")]) == 0
    result = json.loads((tmp_path / "i.json").read_text())
    assert result["manifest"]["lowering"] == "gqa"
    trt = result["tensorrt"]
    assert trt["compatible"] is False and trt["unsupported_ops"] == ["com.microsoft.GroupQueryAttention"]
    for name in contract.GRAPHS:
        [problem] = trt["graphs"][name]["unsupported"]
        assert problem["op"] == "com.microsoft.GroupQueryAttention" and problem["count"] == 2
        assert "--lowering onnx" in problem["reason"]


def test_inspect_a_hybrid_shows_its_state_entries(lfm2_artifact, tmp_path, capsys):
    """The tiny LFM2 (conv layers 0, 2, 3; attention layer 1): the JSON's manifest lists each state
    entry, every graph's I/O names its past/present state tensors after the KV, and the printed
    report gives the state's layers, bytes, and each kind's per-row tensors."""
    assert main(["inspect", str(lfm2_artifact), "--json", str(tmp_path / "i.json")]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "i.json").read_text())
    conv = {"part": "conv", "shape": [64, 2], "dtype": "float32"}
    assert result["manifest"]["state"] == [{"layer": i, "kind": "conv", "tensors": [conv]} for i in (0, 2, 3)]
    layout = contract.Layout((1,), tuple(contract.StateEntry.from_dict(e) for e in result["manifest"]["state"]))
    for name in contract.GRAPHS:
        graph = result["graphs"][name]
        assert [t["name"] for t in graph["inputs"]] == contract.input_names(name, layout), name
        assert [t["name"] for t in graph["outputs"]] == contract.output_names(layout), name
        state = [t for t in graph["inputs"] if t["name"].startswith("past_state.")]
        assert [(t["dtype"], t["shape"][1:]) for t in state] == [("float32", [64, 2])] * 3, name
    # 2 rows x three conv layers' [64, 2] float32 = 3 KiB
    assert "  state (conv) of layers [0, 2, 3], KV only for layers that attend; state = 3.0 KiB" in printed
    assert "    conv: conv [64, 2] float32 per row, layers [0, 2, 3]" in printed
    assert "    past_state.*.conv              float32   [batch, 64, 2]  x3" in printed


def test_inspect_says_how_the_weights_are_quantized(llama_int4_artifact, llama_artifact, capsys):
    """The printed report gives an int4 artifact's blocks, its lm_head's precision and blocks, and
    the embedding's dtype (the tiny Llama's hidden 64: 128 does not divide it, so the lm_head keeps
    32); a float artifact prints no such line; a record from before the lm_head's own blocks and a
    GGUF's kept blocks read as they are."""
    assert main(["inspect", str(llama_int4_artifact)]) == 0
    assert (
        "  weights: int4 com.microsoft.MatMulNBits (blocks of 32, symmetric, accuracy level 4); "
        "lm_head int8 in blocks of 32; embedding float32\n"
    ) in capsys.readouterr().out
    assert main(["inspect", str(llama_artifact)]) == 0
    assert "  weights: " not in capsys.readouterr().out
    older = {"scheme": "int4", "block_size": 32, "op": "MatMulNBits", "symmetric": True, "lm_head": "quantized"}
    assert inspect_artifact._quantization_lines(older) == [
        "  weights: int4 MatMulNBits (blocks of 32, symmetric); lm_head quantized"
    ]
    gguf = {"scheme": "gguf", "op": "MatMulNBits", "embedding": "float32", "gguf": {"file": "m.gguf"}}
    assert inspect_artifact._quantization_lines(gguf) == [
        "  weights: a GGUF file's own blocks (m.gguf), MatMulNBits; embedding float32"
    ]
