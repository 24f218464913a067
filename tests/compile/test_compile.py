"""kvforge compile: the artifact's files, graph I/O per the KV contract, one copy of the weights,
atomic output, and clear errors for bad input."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest
from safetensors.torch import load_file

from kvforge.compile import compile_model
from kvforge.compile.load import ModelDirError
from kvforge.graphs import contract
from kvforge.graphs.architectures import UnsupportedArchitectureError
from tests.helpers import make_llama


def _load(path):
    return onnx.load(str(path), load_external_data=False)


def test_artifact_files(llama_artifact):
    names = {p.name for p in llama_artifact.iterdir()}
    assert {"prefill.onnx", "decode.onnx", "weights.data", "manifest.json", "tokenizer.json"} <= names
    assert "generation_config.json" in names


@pytest.mark.parametrize("lowering", ["gqa", "onnx"])
@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_graphs_pass_checker_and_follow_contract(llama_artifact, llama_onnx_artifact, graph, lowering):
    artifact = llama_artifact if lowering == "gqa" else llama_onnx_artifact
    if lowering == "onnx":  # onnx's checker knows no com.microsoft schemas
        onnx.checker.check_model(str(artifact / f"{graph}.onnx"), full_check=True)
    model = _load(artifact / f"{graph}.onnx")
    inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    outputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.output}
    names = contract.prefill_input_names(2) if graph == "prefill" else contract.decode_input_names(2)
    assert list(inputs) == names
    assert list(outputs) == contract.output_names(2)
    assert inputs["input_ids"] == ["batch", "seq" if graph == "prefill" else 1]
    assert inputs["write_indices"] == ["batch"]
    # Past and present: full capacity, head-major [B, H_kv, S_max, D].
    assert inputs["past_key_values.1.value"] == ["batch", 2, "capacity", 16]
    assert outputs["present.1.value"] == ["batch", 2, "capacity", 16]
    assert outputs["logits"] == ["batch", 384]
    ops = Counter(n.op_type for n in model.graph.node)
    if lowering == "onnx":
        assert ops["TensorScatter"] == 4 and ops["Attention"] == 2, ops
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}, "the onnx lowering uses standard ops only"
    else:
        assert ops["GroupQueryAttention"] == 2 and ops["Attention"] == 0 and ops["TensorScatter"] == 0, ops
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx", "com.microsoft"}
    assert any(n.name.startswith("/model/layers.1/self_attn/") for n in model.graph.node), "HF-traceable names"


def test_weights_are_stored_once(llama_dir, llama_artifact):
    params = load_file(str(llama_dir / "model.safetensors"))
    param_bytes = sum(t.numel() * t.element_size() for t in params.values())
    stored = (llama_artifact / "weights.data").stat().st_size
    assert stored <= 1.02 * param_bytes, f"weights.data has {stored} bytes for {param_bytes} parameter bytes"
    for graph in ("prefill", "decode", "score"):  # no graph file keeps a large tensor of its own
        inline = [t for t in _load(llama_artifact / f"{graph}.onnx").graph.initializer if t.data_location == 0]
        biggest = max((len(t.raw_data) or 4 * len(t.float_data) for t in inline), default=0)
        assert biggest < 1024, f"{graph}.onnx keeps a {biggest}-byte tensor inline"
    # Both graphs point into the same file, at the same places: the big tensors are shared.
    refs = {}
    for graph in ("prefill", "decode"):
        refs[graph] = set()
        for init in _load(llama_artifact / f"{graph}.onnx").graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in init.external_data}
                assert info["location"] == "weights.data"
                refs[graph].add((info["offset"], info["length"]))
    assert refs["prefill"] and refs["prefill"] == refs["decode"]


def test_manifest_records_contract_and_parity(llama_artifact):
    m = json.loads((llama_artifact / "manifest.json").read_text())
    assert m["format"] == "kvforge" and m["schema_version"] == 3
    assert m["state"] == [] and "layers" not in m["kv_cache"]  # every layer attends: no state entries
    assert m["model"]["architecture"] == "LlamaForCausalLM"
    assert (m["model"]["num_layers"], m["model"]["num_kv_heads"], m["model"]["head_dim"]) == (2, 2, 16)
    assert m["limits"] == {"max_batch": 4, "max_seq": 96, "max_prompt": 96}
    assert m["kv_cache"]["shape"] == [2, 2, 4, 2, 96, 16]
    assert m["lowering"] == "gqa" and m["dtype"] == "float32"
    assert m["generation"]["eos_token_ids"] == [1]
    assert m["parity"]["greedy_match"] is True
    assert m["parity"]["prefill_max_abs_diff"] < 1e-4 and m["parity"]["decode_max_abs_diff"] < 1e-4
    assert [i["name"] for i in m["graphs"]["decode"]["inputs"]][:3] == [
        "input_ids",
        "position_ids",
        "write_indices",
    ]


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        compile_model(tmp_path / "nope", tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()


def test_not_a_hf_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelDirError, match="no config.json: it is not a Hugging Face model directory"):
        compile_model(tmp_path / "model", tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_lists_supported(tmp_path):
    model = tmp_path / "bert"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedArchitectureError, match="'BertForMaskedLM' is not supported.*LlamaForCausalLM"):
        compile_model(model, tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()


def test_truncated_model_weights(tmp_path):
    model = make_llama(tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelDirError, match="could not load"):
        compile_model(model, tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_a_foreign_directory(llama_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a kvforge artifact"):
        compile_model(llama_dir, out, progress=None)
    assert (out / "notes.txt").read_text() == "keep me"


def test_max_seq_beyond_model_positions(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=256"):
        compile_model(llama_dir, tmp_path / "out", max_seq=1000, progress=None)


def test_interrupted_compile_leaves_no_artifact(llama_dir, tmp_path):
    """A compile stopped mid-way (here: after the export, as the weights are written) leaves
    neither an artifact nor debris."""
    out = tmp_path / "out"
    messages = []

    def progress(message):
        messages.append(message)
        if "writing one shared weights file" in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compile_model(llama_dir, out, max_seq=32, progress=progress)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
    assert any("loading" in m for m in messages) and any("exporting the model once" in m for m in messages)
