"""GGUF files as compile sources: the conversion, and the Q4_0/Q8_0/Q4_1 blocks kept as they are.

Proves, on a tiny Llama GGUF the test writes itself (``tests/gguf_files.py``, tensors quantized by
the ``gguf`` package): the HF directory ``kvforge.compile.gguf.convert`` writes holds exactly the
``gguf`` package's dequantized tensors and the chat template; MatMulNBits' weights repacked from
the blocks equal ``gguf.quants.dequantize`` value for value (by MatMulNBits' definition in numpy,
and by ORT running the repacked node alone on an identity input); the compiled artifact's every
MatMulNBits row is a row of the file (Q4_1: plus its block minimums; its extra rows sum the
input's blocks of 32); its greedy tokens equal transformers' on the GGUF-loaded
model; the manifest records which tensors kept their blocks.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from kvforge.compile import compile_model, gguf_exact
from kvforge.compile import gguf as gguf_stage
from kvforge.runtime import Engine
from tests.gguf_files import write_llama_gguf
from tests.helpers import assert_close, hf_greedy

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

# Every exact type, in packed groups of one type (q+k Q4_0, gate+up Q4_1) and alone; one F16 tensor.
TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
    "blk.1.attn_output.weight": "F16",
}
PROMPT = [0, 17, 42, 9, 120, 33, 7]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", TYPES)


@pytest.fixture(scope="module")
def gguf_artifact(gguf_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-artifact") / "out"
    lines: list[str] = []
    compile_model(gguf_file, out, max_batch=2, max_seq=64, progress=lines.append)
    return out, lines


@pytest.fixture(scope="module")
def gguf_reference(gguf_file):
    """transformers' own model of the GGUF file (dequantized by its GGUF reader), eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype="float32", attn_implementation="eager"
    ).eval()


def _gguf_tensors(path) -> dict[str, tuple[str, np.ndarray]]:
    """Every 2-D tensor of the file: name -> (type, dequantized [N, K] float32), by the gguf package."""
    reader = gguf.GGUFReader(str(path))
    return {
        t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0])))
        for t in reader.tensors
        if len(t.shape) == 2
    }


def _matmulnbits_weight(q: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int) -> np.ndarray:
    """MatMulNBits' B as its spec defines it: ``W[n, k] = scale[n, b] · (q[n, k] − zero_point[n, b])``,
    4-bit weights 2i / 2i+1 in the low / high nibble of byte i, default zero point 2^(bits−1)."""
    n, nb, _ = q.shape
    if bits == 4:
        values = np.stack([q & 15, q >> 4], axis=-1).reshape(n, nb, 32).astype(np.float32)
    else:
        values = q.astype(np.float32)
    if zero_points is None:
        zp = np.float32(2 ** (bits - 1))
    else:  # 4-bit zero points: two blocks a byte, low nibble first
        zp = np.stack([zero_points & 15, zero_points >> 4], axis=-1).reshape(n, -1)[:, :nb, None].astype(np.float32)
    return (scales.reshape(n, nb, 1) * (values - zp)).reshape(n, nb * 32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_1"])
def test_dequantize_and_repacked_blocks_equal_gguf_dequantize(qtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 96), dtype=np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, kind)
    expected = gguf.quants.dequantize(raw, kind)
    np.testing.assert_array_equal(gguf_stage.dequantize(raw.reshape(24, 3, -1), qtype), expected)  # bit for bit
    found = gguf_stage.BlockRows(qtype, raw.reshape(24, 3, -1), ("t",))
    q, scales, zero_points, mins = gguf_exact.repack(found)
    got = _matmulnbits_weight(q, scales, zero_points, gguf_stage.EXACT_TYPES[qtype][0])
    if mins is not None:  # Q4_1: + m per block
        got = got + np.repeat(mins.T, 32, axis=1)
    np.testing.assert_array_equal(got, expected)


def _one_projection(rows: np.ndarray) -> ir.Model:
    """``y = x @ rows^T`` as one MatMul on a constant ``[K, N]`` weight (x ``[1, S, K]``)."""
    n, k = rows.shape
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, "s", k]))
    weight = ir.Value(name="w", const_value=ir.Tensor(np.ascontiguousarray(rows.T), name="w"))
    weight.shape, weight.type = ir.Shape([k, n]), ir.TensorType(ir.DataType.FLOAT)
    node = ir.node("MatMul", [x, weight], name="/proj")
    y = node.outputs[0]
    y.name, y.type, y.shape = "y", ir.TensorType(ir.DataType.FLOAT), ir.Shape([1, "s", n])
    graph = ir.Graph([x], [y], nodes=[node], initializers=[weight], opset_imports={"": 21}, name="g")
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_up.weight"])
def test_repacked_node_alone_in_ort_reproduces_the_tensor(gguf_file, name):
    """The pass on one projection (rows permuted, as a converter may): ORT runs the MatMulNBits on an
    identity input (accuracy level 0: float activations) and returns the GGUF tensor exactly."""
    import onnxruntime as ort

    qtype, dequantized = _gguf_tensors(gguf_file)[name]
    rows = dequantized[::-1].copy()  # another row order: rows are matched by value, not by position
    model = _one_projection(rows)
    report = gguf_exact.keep_gguf_blocks(model, gguf_stage.GGUFBlocks(gguf_file))
    assert report.kept[name] == qtype and list(report.nodes) == [f"/proj/gguf_{qtype.lower()}"]
    for node in model.graph:
        if node.op_type == "MatMulNBits":
            node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", 0)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    k = rows.shape[1]
    [y] = session.run(None, {"x": np.eye(k, dtype=np.float32)[None]})
    np.testing.assert_array_equal(y[0], rows.T)


def test_conversion_writes_the_dequantized_tensors_and_chat_template(gguf_file, tmp_path, capsys):
    from safetensors.numpy import load_file

    out = gguf_stage.convert(gguf_file, tmp_path / "hf")
    assert "GGUF tensors" not in capsys.readouterr().err  # transformers' tqdm bar is held back
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 2
    weights = load_file(out / "model.safetensors")
    tensors = _gguf_tensors(gguf_file)
    np.testing.assert_array_equal(weights["model.layers.0.mlp.down_proj.weight"], tensors["blk.0.ffn_down.weight"][1])
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], tensors["token_embd.weight"][1])
    from transformers import AutoTokenizer

    assert "<|im_start|>assistant" in AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )


def test_compile_keeps_every_exact_tensor_and_says_so(gguf_artifact, gguf_file):
    out, lines = gguf_artifact
    record = json.loads((out / "manifest.json").read_text())
    kept = record["quantization"]["gguf"]["kept"]
    types = {name: qtype for name, (qtype, _) in _gguf_tensors(gguf_file).items()}
    assert kept == {name: t for name, t in types.items() if t in gguf_stage.EXACT_TYPES}
    assert record["quantization"]["gguf"]["dequantized"]["blk.1.attn_output.weight"] == "F16"
    assert record["source"]["path"] == str(gguf_file.resolve()) and record["source"]["gguf"]["sha256"]
    summary = "14 tensors kept as GGUF blocks (Q4_0 ×5, Q4_1 ×4, Q8_0 ×5), 6 dequantized (F16 ×1, F32 ×5)"
    assert any(summary in line for line in lines), lines


def test_every_matmulnbits_row_is_a_row_of_the_gguf_file(gguf_artifact, gguf_file):
    out, _ = gguf_artifact
    model = onnx.load(str(out / "prefill.onnx"))
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    rows_of = {}
    for qtype, rows in _gguf_tensors(gguf_file).values():
        rows_of.setdefault((qtype, rows.shape[1]), set()).update(r.tobytes() for r in rows)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 5 + 4 + 1  # q+k, v, o (layer 0: layer 1's is F16), gate+up, down; the lm_head
    for node in nodes:
        attrs = {a.name: a.i for a in node.attribute}
        zero_points = values[node.input[3]] if len(node.input) > 3 else None
        w = _matmulnbits_weight(values[node.input[1]], values[node.input[2]], zero_points, attrs["bits"])
        qtype = {8: "Q8_0"}.get(attrs["bits"], "Q4_1" if zero_points is not None else "Q4_0")
        if qtype == "Q4_1":  # the last K/32 rows sum x's blocks; the first N get the block minimums
            [minimums] = [n for n in model.graph.node if n.name == f"{node.name}/block_minimums"]
            blocks = attrs["K"] // 32
            np.testing.assert_array_equal(w[-blocks:], np.repeat(np.eye(blocks, dtype=np.float32), 32, axis=1))
            w = w[:-blocks] + np.repeat(values[minimums.input[1]].T, 32, axis=1)
        missing = [i for i, row in enumerate(w) if row.tobytes() not in rows_of[(qtype, attrs["K"])]]
        assert not missing, f"{node.name}: rows {missing[:5]} are not {qtype} rows of the file"


def test_greedy_equals_transformers_on_the_gguf_model(gguf_artifact, gguf_reference):
    import torch

    out, _ = gguf_artifact
    expected = hf_greedy(gguf_reference, PROMPT, 12)
    with Engine.load(out) as engine:
        [result] = engine.generate([PROMPT], max_new_tokens=12)
        logits = engine.prefill([PROMPT])
    assert result.token_ids == expected
    with torch.no_grad():
        reference = gguf_reference(torch.tensor([PROMPT])).logits[0, -1]
    # int8 activations inside MatMulNBits (accuracy level 4): the weights are exact, x is rounded per block
    assert_close(logits[0], reference, atol=2e-2, rtol=2e-2)


def test_the_int8_prefill_takes_the_q4_0_blocks_and_fp32_every_4_bit_block(gguf_artifact):
    from kvforge.runtime.int8_prefill import GRAPH

    out, _ = gguf_artifact
    with Engine.load(out) as plain, Engine.load(out, prefill="int8") as int8:
        # Q4_0 (symmetric blocks): q|k in both layers, layer 0's o; Q4_1 (zero points), Q8_0, F16 stay
        assert int8.backend.long_prefill.projections == 3
        got, want = int8.prefill([PROMPT]).copy(), plain.prefill([PROMPT]).copy()
        assert int8.last_bindings["prefill"].graph == GRAPH
        assert_close(got, want, atol=2e-2, rtol=0, what="int8 prefill logits vs the Q4_0 graph's")
        assert np.abs(got - want).max() > 1e-6, "no rounding: the block graph ran"
    with Engine.load(out, prefill="fp32") as fp32:  # every 4-bit node, Q4_1's zero points too
        assert fp32.backend.long_prefill.projections > 3
        assert_close(fp32.prefill([PROMPT]), want, atol=2e-2, rtol=0, what="fp32 prefill logits vs the block graph's")
