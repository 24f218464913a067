"""Q4_1 on ONNX Runtime's MatMulNBits: which exact form keeps the fast kernel?

GGUF's Q4_1 block is ``w = d·q + m`` (q in 0..15). Three single-node graphs per matrix shape, on
the same random blocks, timed in alternating rounds (best of each round, ms per call):

* ``zp0+rows`` (what ``kvforge compile FILE.gguf`` keeps, compile/gguf_exact.py): MatMulNBits with
  uint8 zero points 0 computes ``x·(d·q)ᵀ`` and, from ``K/32`` extra rows of ones (one per block),
  the block sums of x; a Split, one MatMul with ``M [K/32, N]`` and an Add put the minimums
  ``Σ_b m[n,b]·Σ_{k∈b} x_k`` on. Exact weights, up to float rounding.
* ``zp0+min`` (the earlier form): the same, the block sums by Reshape + ReduceSum of x.
* ``float-zp``: MatMulNBits with float zero points ``−m/d``: exact, ORT's reference kernel.
* ``plain``: symmetric MatMulNBits without zero points, the kernel ``--quantize int4`` makes (not
  Q4_1: a second rounding of the weights); the speed to match.

* ``zp0+min acc0``: the same at ``accuracy_level=0`` (float activations in the kernel).

The others at ``accuracy_level=4`` (int8 activations, kvforge's setting). Also checks each exact
form against ``x @ (d·q + m)ᵀ`` in float64 (its max error relative to the largest output).
Run: ``python benchmarks/gguf_q41.py [--threads 2]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx import numpy_helper as nh

SHAPES = {  # name: (K, N)
    "1536x8960 (issue 21's node)": (1536, 8960),
    "SmolLM2 gate+up 576x3072": (576, 3072),
    "SmolLM2 down 1536x576": (1536, 576),
}


def _blocks(k: int, n: int, rng: np.random.Generator):
    nb = k // 32
    q = rng.integers(0, 16, (n, nb, 32), dtype=np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    d = (rng.random((n, nb), dtype=np.float32) * 0.02 + 0.001).astype(np.float16).astype(np.float32)
    m = (-(rng.random((n, nb), dtype=np.float32)) * 0.1).astype(np.float16).astype(np.float32)
    return q, packed, d, m


def _session(form: str, k: int, n: int, packed, d, m, threads: int) -> ort.InferenceSession:
    nb = k // 32
    level = 0 if form.endswith("acc0") else 4
    form = form.removesuffix(" acc0")
    inits = [nh.from_array(packed, "B"), nh.from_array(d, "S")]
    inputs = ["x", "B", "S"]
    out = "y0" if form == "zp0+min" else "y"
    if form == "zp0+rows":
        return _rows_session(k, n, packed, d, m, threads)
    if form == "zp0+min":
        inits.append(nh.from_array(np.zeros((n, (nb + 1) // 2), np.uint8), "Z"))
        inputs.append("Z")
    elif form == "float-zp":
        inits.append(nh.from_array((-m / d).astype(np.float32), "Z"))
        inputs.append("Z")
    attrs = dict(K=k, N=n, bits=4, block_size=32, accuracy_level=level)
    nodes = [helper.make_node("MatMulNBits", inputs, [out], domain="com.microsoft", **attrs)]
    if form == "zp0+min":
        inits += [
            nh.from_array(np.array([0, 0, nb, 32], np.int64), "blocked"),
            nh.from_array(np.array([-1], np.int64), "last"),
            nh.from_array(np.ascontiguousarray(m.T), "M"),
        ]
        nodes += [
            helper.make_node("Reshape", ["x", "blocked"], ["xb"]),
            helper.make_node("ReduceSum", ["xb", "last"], ["sums"], keepdims=0),
            helper.make_node("MatMul", ["sums", "M"], ["corr"]),
            helper.make_node("Add", ["y0", "corr"], ["y"]),
        ]
    return _graph_session(nodes, form, inits, k, n, threads)


def _rows_session(k: int, n: int, packed, d, m, threads: int) -> ort.InferenceSession:
    from kvforge.compile.gguf_exact import block_sum_rows

    nb = k // 32
    b, scales, zero_points = block_sum_rows(packed, d, np.zeros((n, (nb + 1) // 2), np.uint8))
    inits = [nh.from_array(b, "B"), nh.from_array(scales, "S"), nh.from_array(zero_points, "Z")]
    inits += [nh.from_array(np.array([n, nb], np.int64), "sizes"), nh.from_array(np.ascontiguousarray(m.T), "M")]
    attrs = dict(K=k, N=n + nb, bits=4, block_size=32, accuracy_level=4)
    nodes = [
        helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["yy"], domain="com.microsoft", **attrs),
        helper.make_node("Split", ["yy", "sizes"], ["y0", "sums"], axis=-1),
        helper.make_node("MatMul", ["sums", "M"], ["corr"]),
        helper.make_node("Add", ["y0", "corr"], ["y"]),
    ]
    return _graph_session(nodes, "zp0+rows", inits, k, n, threads)


def _graph_session(nodes, name: str, inits, k: int, n: int, threads: int) -> ort.InferenceSession:
    """An ORT CPU session of ``nodes`` mapping ``x [1, m, k]`` to ``y [1, m, n]``."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "m", n])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _time(session, x, seconds: float = 0.15) -> float:
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < 2:
        session.run(None, {"x": x})
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    forms = ["zp0+rows", "zp0+min", "plain", "zp0+min acc0", "float-zp"]
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, best of {args.rounds} alternating rounds (ms/call)")
    for label, (k, n) in SHAPES.items():
        q, packed, d, m = _blocks(k, n, rng)
        w = (d[..., None].astype(np.float64) * q + m[..., None]).reshape(n, k)  # Q4_1 in float64
        sessions = {form: _session(form, k, n, packed, d, m, args.threads) for form in forms}
        for rows in (1, 4):
            x = rng.standard_normal((1, rows, k), dtype=np.float32)
            exact = x[0].astype(np.float64) @ w.T
            errors = {
                f: float(np.abs(sessions[f].run(None, {"x": x})[0][0] - exact).max() / np.abs(exact).max())
                for f in ("zp0+rows", "zp0+min", "zp0+min acc0", "float-zp")
            }
            best = {form: float("inf") for form in forms}
            for _ in range(args.rounds):
                for form in forms:
                    if form == "float-zp" and rows > 1 and best[form] != float("inf"):
                        continue  # the reference kernel: one round is enough to see it
                    best[form] = min(best[form], _time(sessions[form], x))
            print(
                f"{label:28s} M={rows}: " + "  ".join(f"{f} {best[f]:.3f}" for f in forms) + "  | "
                f"zp0+rows/plain {best['zp0+rows'] / best['plain']:.2f}, "
                f"zp0+min/plain {best['zp0+min'] / best['plain']:.2f}, "
                f"acc0/plain {best['zp0+min acc0'] / best['plain']:.2f}, "
                f"float-zp/zp0+min {best['float-zp'] / best['zp0+min']:.0f}x | max rel. error vs Q4_1: "
                + ", ".join(f"{f} {e:.1e}" for f, e in errors.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
