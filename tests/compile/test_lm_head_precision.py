"""--lm-head int4|int8|float under --quantize (kvforge.compile.quantize): the lm_head gets its own
precision beside the body's. An int8 lm_head is a MatMulNBits of 8 bits whose logits are the
dequantized weight's to within the kernel's int8 activations; a tiny Llama compiled with each
choice has the nodes and the manifest record it says; a tied lm_head left float is still the packed
view of the embedding table; the CLI parses the flag and refuses a bad value or a contradiction.
--lm-head-block-size gives the quantized lm_head blocks of its own beside the body's."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from kvforge.compile import compile_model
from kvforge.compile.quantize import quantize
from kvforge.runtime import Engine

VOCAB, HIDDEN, BLOCK = 256, 128, 32


def _head_graph() -> ir.Model:
    """logits = Gemm(x, W, transB=1), W [VOCAB, HIDDEN]: the lm_head as kvforge exports it, beside
    the embedding lookup that reads the same table (a tied lm_head)."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array((0.05 * rng.standard_normal((VOCAB, HIDDEN))).astype(np.float32), "table")
    nodes = [
        oh.make_node("Gather", ["table", "ids"], ["h"], name="embed"),
        oh.make_node("Gemm", ["x", "table"], ["logits"], name="lm_head", transB=1),
    ]
    inputs = [
        oh.make_tensor_value_info("ids", TensorProto.INT64, [3]),
        oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HIDDEN]),
    ]
    outputs = [
        oh.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", VOCAB]),
        oh.make_tensor_value_info("h", TensorProto.FLOAT, None),
    ]
    graph = oh.make_graph(nodes, "head", inputs, outputs, [table])
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]))


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"ids": np.array([0, 1, 2]), "x": x})[0]  # the logits (renamed by the rewrite)


def _dequantized(model: ir.Model, block: int = BLOCK) -> np.ndarray:
    """The [VOCAB, HIDDEN] weight the 8-bit MatMulNBits holds: symmetric int8 blocks stored as
    uint8 offset by 128 (ORT's default zero point), times one scale per block."""
    [node] = [n for n in model.graph if n.op_type == "MatMulNBits"]
    packed = node.inputs[1].const_value.numpy().astype(np.float32)  # (VOCAB, HIDDEN / block, block)
    scales = node.inputs[2].const_value.numpy().reshape(VOCAB, HIDDEN // block, 1)
    return ((packed - 128) * scales).reshape(VOCAB, HIDDEN)


def test_int8_lm_head_gives_the_dequantized_weights_logits():
    x = np.random.default_rng(1).standard_normal((4, HIDDEN)).astype(np.float32)
    table = _head_graph().graph.initializers["table"].const_value.numpy()
    exact = x @ table.T
    errors = {}
    for head in ("int8", "int4"):
        model = quantize({"g": _head_graph()}, "int4", BLOCK, lm_head=head, lm_head_block_size=BLOCK)["g"]
        [node] = [n for n in model.graph if n.op_type == "MatMulNBits"]
        assert node.attributes["bits"].value == int(head[3:]) and node.attributes["accuracy_level"].value == 4
        # The embedding lookup still reads the float table.
        assert next(n for n in model.graph if n.op_type == "Gather").inputs[0].const_value.dtype == ir.DataType.FLOAT
        got = _run(model, x)
        errors[head] = np.abs(got - exact).max()
        if head == "int8":
            # accuracy_level 4: the kernel rounds each block of x to int8 (a scale of max|x_block| / 127)
            # and multiplies by the dequantized weight; emulated, the logits agree to float rounding.
            blocks = x.reshape(len(x), -1, BLOCK)  # (B, HIDDEN / BLOCK, BLOCK)
            step = np.abs(blocks).max(axis=-1, keepdims=True) / 127
            x_int8 = (np.round(blocks / step) * step).reshape(x.shape)
            reference = x_int8 @ _dequantized(model).T
            tolerance = 1e-5 + 1e-5 * np.abs(reference)
            worst = np.unravel_index(np.argmax(np.abs(got - reference) - tolerance), got.shape)
            assert (np.abs(got - reference) <= tolerance).all(), (worst, got[worst], reference[worst])
            # and against the dequantized weight with float x: at most half an activation step per
            # element times the weights it meets, per block
            bound = 0.5 * (step * np.abs(_dequantized(model)).T.reshape(1, -1, BLOCK, VOCAB).sum(2)).sum(1)
            assert (np.abs(got - x @ _dequantized(model).T) <= bound + 1e-5).all()
    assert errors["int8"] < errors["int4"] / 4, errors  # 8 bits: ~16x finer steps than 4


@pytest.mark.parametrize(
    ("width", "block", "given", "want"),
    [(128, 32, None, 128), (4096, 32, None, 128), (576, 32, None, 32), (96, 16, None, 16), (256, 256, None, 256),
     (576, 32, 64, 64), (1024, 32, 32, 32)],
)  # fmt: skip
def test_lm_head_block_rule(width, block, given, want):
    """128 where it divides the lm_head's input width (no padded block) and is coarser than the
    body's blocks; else the body's; --lm-head-block-size over both."""
    from kvforge.compile.quantize import lm_head_blocks

    assert lm_head_blocks(block, given, width) == want


def test_lm_head_blocks_of_its_own():
    """An 8-bit lm_head in blocks of 64 under a body's 32: the node says 64, holds HIDDEN / 64 scales
    a row, and its logits are the dequantized weight's with x rounded to int8 per 64-wide block."""
    x = np.random.default_rng(2).standard_normal((3, HIDDEN)).astype(np.float32)
    default = quantize({"g": _head_graph()}, "int4", BLOCK)["g"]  # HIDDEN 128: the rule's 128
    assert [n.attributes["block_size"].value for n in default.graph if n.op_type == "MatMulNBits"] == [128]
    model = quantize({"g": _head_graph()}, "int4", BLOCK, lm_head_block_size=64)["g"]
    [node] = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert (node.attributes["bits"].value, node.attributes["block_size"].value) == (8, 64)
    assert node.inputs[1].const_value.shape == (VOCAB, HIDDEN // 64, 64)
    assert node.inputs[2].const_value.shape == (VOCAB, HIDDEN // 64)  # a scale a block
    blocks = x.reshape(len(x), -1, 64)
    step = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    reference = (np.round(blocks / step) * step).reshape(x.shape) @ _dequantized(model, 64).T
    np.testing.assert_allclose(_run(model, x), reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lm_head block size must be a power of two >= 16, got 48"):
        quantize({"g": _head_graph()}, "int4", BLOCK, lm_head_block_size=48)


@pytest.mark.parametrize(("scheme", "head", "bits"), [("int8", "int4", 4), ("int8", None, 8), ("int4", None, 8)])
def test_lm_head_bits_under_either_scheme(scheme, head, bits):
    model = quantize({"g": _head_graph()}, scheme, BLOCK, lm_head=head)["g"]
    [node] = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert node.attributes["bits"].value == bits


@pytest.mark.parametrize("head", ["int4", "int8", "float"])
def test_compiled_with_each_lm_head(llama_dir, tmp_path, head):
    out = tmp_path / head
    manifest = compile_model(
        llama_dir, out, max_batch=1, max_seq=32, quantize="int4", lm_head=head, score_graph=False, progress=None
    )
    assert manifest.quantization["lm_head"] == ("float32" if head == "float" else head)
    assert manifest.quantization["scheme"] == "int4"
    # hidden 64: 128 does not divide it, so the lm_head keeps the body's blocks (a float one has none)
    assert manifest.quantization.get("lm_head_block_size") == (None if head == "float" else 32)
    for graph in ("decode.onnx", "decode.ort.onnx"):
        model = onnx.load(str(out / graph), load_external_data=False)
        bits = Counter(
            a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"
        )
        gemms = sum(n.op_type == "Gemm" for n in model.graph.node)
        # 2 layers x 4 projections (packed q|k|v and gate|up) at 4 bits, and the lm_head
        want = {"int4": ({4: 9}, 0), "int8": ({4: 8, 8: 1}, 0), "float": ({4: 8}, 1)}[head]
        assert (dict(bits), gemms) == want, (graph, bits, gemms)
    with Engine.load(out) as engine:
        [result] = engine.generate([[0, 5, 9, 100]], max_new_tokens=6)
    assert len(result.token_ids) == 6
    assert manifest.parity["decode_max_abs_diff"] < 1.0


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_default_lm_head_is_int8(llama_dir, tmp_path, scheme):
    """int8 under int4 too: docs/performance.md's lm_head table chose it (OpenVINO's int4 layout)."""
    manifest = compile_model(
        llama_dir, tmp_path / "o", max_batch=1, max_seq=32, quantize=scheme, score_graph=False, optimize=False,
        progress=None,
    )  # fmt: skip
    assert manifest.quantization["lm_head"] == "int8"
    model = onnx.load(str(tmp_path / "o" / "decode.onnx"), load_external_data=False)
    bits = Counter(a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits")
    assert bits == ({4: 8, 8: 1} if scheme == "int4" else {8: 9})


def test_tied_lm_head_float_is_still_the_packed_view_and_int8_reads_its_own_blocks(tmp_path):
    from tests.helpers import make_llama

    model_dir = make_llama(tmp_path / "model", tie_word_embeddings=True)
    compile_model(
        model_dir, tmp_path / "float", max_batch=1, max_seq=32, quantize="int4", lm_head="float",
        score_graph=False, progress=None,
    )  # fmt: skip
    graph = onnx.load(str(tmp_path / "float" / "decode.ort.onnx"), load_external_data=False).graph
    inits = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
    [gather] = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits]
    [gemm] = [n for n in graph.node if n.op_type == "Gemm"]
    view, table = inits[gemm.input[1]], inits[gather.input[0]]
    assert gemm.input[1] != gather.input[0]  # a view of the table, packed by ORT
    assert (view["offset"], view["length"]) == (table["offset"], table["length"])

    compile_model(
        model_dir, tmp_path / "int8", max_batch=1, max_seq=32, quantize="int4", lm_head="int8",
        score_graph=False, progress=None,
    )  # fmt: skip
    graph = onnx.load(str(tmp_path / "int8" / "decode.ort.onnx"), load_external_data=False).graph
    assert not [n for n in graph.node if n.op_type == "Gemm"]
    bits = [a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"]
    assert sorted(bits) == [4] * 8 + [8]  # the lm_head: its own 8-bit blocks of the table
    tables = {i.name: i for i in graph.initializer}
    gather = next(n for n in graph.node if n.op_type == "Gather" and n.input[0] in tables)
    assert tables[gather.input[0]].data_type == TensorProto.FLOAT  # the embedding lookup: the float table
    with Engine.load(tmp_path / "int8") as engine:
        assert len(engine.generate([[1, 17, 42]], max_new_tokens=4)[0].token_ids) == 4


def test_cli_parses_lm_head_and_refuses_a_bad_value(capsys):
    from kvforge.tools.cli import build_parser

    args = build_parser().parse_args(["compile", "m", "-o", "o", "--quantize", "int4", "--lm-head", "int8"])
    assert (args.quantize, args.lm_head, args.quantize_lm_head) == ("int4", "int8", True)
    assert build_parser().parse_args(["compile", "m", "-o", "o"]).lm_head is None
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["compile", "m", "-o", "o", "--quantize", "int4", "--lm-head", "int2"])
    assert info.value.code == 2
    assert "argument --lm-head: invalid choice: 'int2' (choose from 'int4', 'int8', 'float')" in capsys.readouterr().err


def test_lm_head_refusals(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="--lm-head int8 sets the lm_head's precision under --quantize, and there"):
        compile_model(llama_dir, tmp_path / "o", lm_head="int8", progress=None)
    with pytest.raises(ValueError, match="--no-quantize-lm-head keeps the lm_head float, but --lm-head is int8"):
        compile_model(llama_dir, tmp_path / "o", quantize="int4", quantize_lm_head=False, lm_head="int8", progress=None)
    with pytest.raises(ValueError, match="unknown lm_head precision 'bf16'; choose one of int4, int8, float"):
        compile_model(llama_dir, tmp_path / "o", quantize="int4", lm_head="bf16", progress=None)
    assert not (tmp_path / "o").exists()


def test_compiled_with_lm_head_block_size(llama_dir, tmp_path):
    from kvforge.tools.cli import build_parser

    args = build_parser().parse_args(["compile", "m", "-o", "o", "--quantize", "int4", "--lm-head-block-size", "64"])
    assert args.lm_head_block_size == 64
    assert build_parser().parse_args(["compile", "m", "-o", "o"]).lm_head_block_size is None
    manifest = compile_model(
        llama_dir, tmp_path / "o", max_batch=1, max_seq=32, quantize="int4", lm_head_block_size=64,
        score_graph=False, progress=None,
    )  # fmt: skip
    assert (manifest.quantization["block_size"], manifest.quantization["lm_head_block_size"]) == (32, 64)
    for graph in ("decode.onnx", "decode.ort.onnx"):
        model = onnx.load(str(tmp_path / "o" / graph), load_external_data=False)
        blocks = Counter(
            (a.i, b.i)
            for n in model.graph.node
            if n.op_type == "MatMulNBits"
            for a in n.attribute
            if a.name == "bits"
            for b in n.attribute
            if b.name == "block_size"
        )
        assert blocks == {(4, 32): 8, (8, 64): 1}, graph  # the body's 4-bit blocks of 32, the lm_head's of 64
    with Engine.load(tmp_path / "o") as engine:
        assert len(engine.generate([[0, 5, 9, 100]], max_new_tokens=4)[0].token_ids) == 4
    assert manifest.parity["decode_max_abs_diff"] < 1.0


def test_compiled_lm_head_takes_blocks_of_128_where_they_divide_its_width(tmp_path):
    from tests.helpers import make_llama

    model_dir = make_llama(tmp_path / "model", hidden_size=128, num_hidden_layers=1)
    manifest = compile_model(
        model_dir, tmp_path / "o", max_batch=1, max_seq=32, quantize="int4", score_graph=False, optimize=False,
        progress=None,
    )  # fmt: skip
    assert (manifest.quantization["block_size"], manifest.quantization["lm_head_block_size"]) == (32, 128)
    model = onnx.load(str(tmp_path / "o" / "decode.onnx"), load_external_data=False)
    attributes = [{a.name: a.i for a in n.attribute} for n in model.graph.node if n.op_type == "MatMulNBits"]
    blocks = Counter((a["bits"], a["block_size"]) for a in attributes)
    assert blocks == {(4, 32): 4, (8, 128): 1}, blocks  # q|k|v, o, gate|up, down; the lm_head


def test_lm_head_block_size_refusals(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="--lm-head-block-size sets the lm_head's blocks under --quantize, and there"):
        compile_model(llama_dir, tmp_path / "o", lm_head_block_size=64, progress=None)
    with pytest.raises(ValueError, match="--lm-head-block-size sets a quantized lm_head's blocks, and the lm_head st"):
        compile_model(llama_dir, tmp_path / "o", quantize="int4", lm_head="float", lm_head_block_size=64, progress=None)
    with pytest.raises(ValueError, match="lm_head block size must be a power of two >= 16, got 100"):
        compile_model(llama_dir, tmp_path / "o", quantize="int4", lm_head_block_size=100, progress=None)
    assert not (tmp_path / "o").exists()


def test_no_quantize_lm_head_still_means_float(llama_dir, tmp_path):
    manifest = compile_model(
        llama_dir, tmp_path / "o", max_batch=1, max_seq=32, quantize="int4", quantize_lm_head=False,
        lm_head="float", score_graph=False, optimize=False, progress=None,
    )  # fmt: skip
    assert manifest.quantization["lm_head"] == "float32"
