"""benchmarks/gemm_ceiling.py's decode chains: the 4-bit chain is what it says (MatMulNBits blocks
that ONNX Runtime multiplies as a numpy dequantization does) and its byte count is the file's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def gc():
    return load_benchmark("gemm_ceiling")


def test_file_bytes_count_nibbles_and_one_fp32_scale_a_block(gc):
    assert gc.nbits_file_bytes(64, 10, 32) == 10 * 2 * (16 + 4)  # 5 bits a weight at block 32
    assert gc.nbits_file_bytes(64, 10, 64) == 10 * (32 + 4)  # 4.5 at block 64
    assert gc.nbits_file_bytes(576, 1, 128) == 5 * (64 + 4)  # K not a multiple: the last block padded
    assert gc.projection_shapes(576, 1536, 192) == [
        ("qkv", 576, 960),
        ("o", 576, 576),
        ("gate_up", 576, 3072),
        ("down", 1536, 576),
    ]


def _dequantized(inits: dict[str, np.ndarray], name: str, k: int, n: int, block: int) -> np.ndarray:
    """(K, N) float weights of the symmetric blocks: low nibble first, zero point 8."""
    data, scales = inits[f"{name}_blocks"], inits[f"{name}_scales"].reshape(n, -1)
    q = np.stack([data & 15, data >> 4], axis=-1).reshape(n, data.shape[1], block).astype(np.float32)
    return ((q - 8) * scales[:, :, None]).reshape(n, -1)[:, :k].T


@pytest.mark.parametrize("block", [32, 64])
def test_four_bit_chain_computes_the_dequantized_projections(gc, block):
    import onnxruntime as ort

    h, i, kv = 64, 96, 32
    model, total = gc.decode_chain(h, i, kv, layers=2, block=block)
    assert total == 2 * sum(gc.nbits_file_bytes(k, n, block) for _, k, n in gc.projection_shapes(h, i, kv))
    proto = onnx.load_from_string(model)
    assert [n.op_type for n in proto.graph.node].count("MatMulNBits") == 8
    assert {a.name: a.i for a in proto.graph.node[0].attribute}["accuracy_level"] == 4
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    x = np.random.default_rng(3).standard_normal((2, h)).astype(np.float32)
    expected = x
    for layer in range(2):
        for (name, k, n), width in zip(gc.projection_shapes(h, i, kv), (h, h, i, h)):
            expected = (expected @ _dequantized(inits, f"{name}{layer}", k, n, block))[:, :width]
    (got,) = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    # accuracy_level 4 multiplies int8-quantized activations: ~1% of the output's scale, chained 8 times
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=0.05 * np.abs(expected).max())


def test_one_weight_read_by_both_kernels(gc):
    """--accuracy-levels' memory probe: one initializer, one MatMulNBits per accuracy level, each
    computing the dequantized product (level 1 in float to 1e-5, level 4 through int8 activations)."""
    import onnxruntime as ort

    proto = onnx.load_from_string(gc._nbits_model(64, 64, 32, (4, 1)))
    assert [n.op_type for n in proto.graph.node] == ["MatMulNBits", "MatMulNBits"]
    assert [{a.name: a.i for a in n.attribute}["accuracy_level"] for n in proto.graph.node] == [4, 1]
    assert [list(n.input) for n in proto.graph.node] == [["x", "w_blocks", "w_scales"]] * 2
    assert len(proto.graph.initializer) == 2
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    x = np.random.default_rng(4).standard_normal((1, 64)).astype(np.float32)
    expected = x @ _dequantized(inits, "w", 64, 64, 32)
    level4, level1 = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    np.testing.assert_allclose(level1, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(level4, expected, atol=0.05 * np.abs(expected).max())
    assert not np.array_equal(level4, level1)  # two kernels, not one result read twice
