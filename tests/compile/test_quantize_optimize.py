"""--quantize int4|int8 (MatMulNBits through ORT's quantizer, lm_head included, embedding kept; or
asymmetric, or the lm_head left float) and
the ORT-optimized graphs (fusions, offline optimization) that share the one weights file."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch

from kvforge.compile import compile_model
from kvforge.runtime import Engine
from tests.helpers import assert_close


def _ops(path):
    model = onnx.load(str(path), load_external_data=False)
    return Counter(n.op_type for n in model.graph.node), model


def _external_refs(model):
    refs = set()
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            assert info["location"] == "weights.data"
            refs.add((info["offset"], info["length"]))
    return refs


def test_optimized_graphs_share_weights_and_match_the_portable_ones(llama_artifact):
    ops, model = _ops(llama_artifact / "decode.ort.onnx")
    portable_ops, portable = _ops(llama_artifact / "decode.onnx")
    assert ops["SkipSimplifiedLayerNormalization"] > 0 and ops["SimplifiedLayerNormalization"] > 0
    assert "SimplifiedLayerNormalization" not in portable_ops, "the portable graph stays standard ONNX"
    # Rotary: inside each of the 2 layers' attention (do_rotary), no rotate-half left.
    assert ops["RotaryEmbedding"] == 0 and ops["Neg"] == 0 and portable_ops["Neg"] == 4
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 2 and all(a.i == 1 for n in attention for a in n.attribute if a.name == "do_rotary")
    assert [i.name for i in model.graph.input] == [i.name for i in portable.graph.input]
    assert [o.name for o in model.graph.output] == [o.name for o in portable.graph.output]
    # The big tensors of the optimized graph are the portable graph's, in the same file, and the
    # rotary's cos/sin tables (the only tensors the optimization adds).
    tables = {n.input[i] for n in attention for i in (7, 8)}
    assert len(tables) == 2
    added = _external_refs(model) - _external_refs(portable) - _external_refs(_ops(llama_artifact / "prefill.onnx")[1])
    table_info = [{e.key: e.value for e in i.external_data} for i in model.graph.initializer if i.name in tables]
    assert added == {(info["offset"], info["length"]) for info in table_info} and len(added) == 2
    prompt = [[0, 17, 201, 33, 90, 4]]
    with Engine.load(llama_artifact) as fast, Engine.load(llama_artifact, optimized=False) as plain:
        assert fast.backend.sessions["prefill"]._model_path.endswith("prefill.ort.onnx")
        assert plain.backend.sessions["prefill"]._model_path.endswith("prefill.onnx")
        assert_close(fast.prefill(prompt), plain.prefill(prompt), 1e-5, 1e-5, "optimized vs portable prefill")
        assert (
            fast.generate(prompt, max_new_tokens=16)[0].token_ids
            == plain.generate(prompt, max_new_tokens=16)[0].token_ids
        )


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_artifact(llama_dir, tmp_path, scheme):
    out = tmp_path / scheme
    manifest = compile_model(llama_dir, out, max_batch=2, max_seq=32, quantize=scheme, block_size=32, progress=None)
    # the lm_head in int8 under either scheme (compile's default, kvforge.compile.quantize.DEFAULT_LM_HEAD)
    assert manifest.quantization["scheme"] == scheme and manifest.quantization["lm_head"] == "int8"
    for graph in ("prefill.onnx", "decode.onnx", "decode.ort.onnx"):
        ops, model = _ops(out / graph)
        # 2 layers x 4 projections (q|k|v and gate|up packed: compile/packing.py) + the lm_head, all
        # quantized; no float MatMul/Gemm on weights left.
        assert ops["MatMulNBits"] == 9, (graph, ops)
        assert ops["Gemm"] == 0
        bits = Counter(
            a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"
        )
        assert bits == ({4: 8, 8: 1} if scheme == "int4" else {8: 9}), (graph, bits)
        # The embedding lookup still reads the float table.
        gather = next(n for n in model.graph.node if n.op_type == "Gather")
        table = next(i for i in model.graph.initializer if i.name == gather.input[0])
        assert table.data_type == onnx.TensorProto.FLOAT
    # Every graph points into the one weights file, and it holds each tensor once.
    refs = [_external_refs(_ops(out / g)[1]) for g in ("prefill.onnx", "decode.onnx", "score.onnx")]
    assert refs[0] == refs[1] == refs[2]
    float_bytes = sum(p.numel() * 4 for p in _float_params(llama_dir))
    assert (out / "weights.data").stat().st_size < 0.75 * float_bytes
    with Engine.load(out) as engine:
        [result] = engine.generate([[0, 5, 9, 100]], max_new_tokens=8)
    assert len(result.token_ids) == 8
    assert manifest.parity["decode_max_abs_diff"] < (0.1 if scheme == "int8" else 1.0)


def test_asymmetric_blocks_and_float_lm_head(llama_dir, tmp_path):
    """--asymmetric: every MatMulNBits carries zero points; --no-quantize-lm-head: the lm_head stays
    a float Gemm (8 quantized projections, not 9); the manifest says both, and the artifact runs
    closer to transformers than the all-int4 one does."""
    out = tmp_path / "int4-asym-lm"
    manifest = compile_model(
        llama_dir, out, max_batch=1, max_seq=32, quantize="int4", symmetric=False, quantize_lm_head=False,
        score_graph=False, progress=None,
    )  # fmt: skip
    assert manifest.quantization["symmetric"] is False and manifest.quantization["lm_head"] == "float32"
    ops, model = _ops(out / "decode.onnx")
    assert ops["MatMulNBits"] == 8 and ops["Gemm"] == 1, ops
    assert all(len(n.input) >= 4 and n.input[3] for n in model.graph.node if n.op_type == "MatMulNBits")
    with Engine.load(out) as engine:
        [result] = engine.generate([[0, 5, 9, 100]], max_new_tokens=4)
    assert len(result.token_ids) == 4
    assert manifest.parity["decode_max_abs_diff"] < 1.0


def _float_params(model_dir):
    from safetensors.torch import load_file

    return [t for t in load_file(str(model_dir / "model.safetensors")).values() if t.dtype == torch.float32]


def test_bad_quantize_options(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        compile_model(llama_dir, tmp_path / "o", quantize="int3", progress=None)
