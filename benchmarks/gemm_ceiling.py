"""How fast can fp32 prefill be here? GFLOP/s of one ONNX Runtime MatMul and one torch linear on
the prefill GEMM shapes of a model, in the same run.

A prefill of S tokens through a Llama costs 2 x S x (non-embedding parameters) FLOPs in its
projections; at the MatMul rate this script measures, that is the floor under TTFT whatever the
graph around it does. Example (the SmolLM-135M shape of peer_genai.py, 128-token prompt):

    python benchmarks/gemm_ceiling.py --hidden 576 --intermediate 1536 --kv-dim 192 --layers 30 --tokens 128
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def ort_matmul_gflops(m: int, k: int, n: int, repeat: int) -> float:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"x": np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)}
    return _rate(lambda: session.run(None, feed), 2 * m * k * n, repeat)


def torch_linear_gflops(m: int, k: int, n: int, repeat: int) -> float:
    import torch

    weight, x = torch.randn(n, k), torch.randn(m, k)
    return _rate(lambda: torch.nn.functional.linear(x, weight), 2 * m * k * n, repeat)


def _rate(run, flops: int, repeat: int) -> float:
    for _ in range(5):
        run()
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return flops * repeat / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv-dim", type=int, default=192, help="KV heads x head dim")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=50)
    a = p.parse_args()
    h, i, kv, s = a.hidden, a.intermediate, a.kv_dim, a.tokens
    # (K, N, how many per layer): q and o, k and v, gate and up, down.
    shapes = [(h, h, 2), (h, kv, 2), (h, i, 2), (i, h, 1)]
    total_flops = sum(2 * s * k * n * count for k, n, count in shapes) * a.layers
    ort_ms = torch_ms = 0.0
    print(f"{'M x K x N':>18}{'ORT GFLOP/s':>13}{'torch GFLOP/s':>15}")
    for k, n, count in shapes:
        ort_rate, torch_rate = ort_matmul_gflops(s, k, n, a.repeat), torch_linear_gflops(s, k, n, a.repeat)
        flops = 2 * s * k * n * count * a.layers
        ort_ms += flops / ort_rate / 1e6
        torch_ms += flops / torch_rate / 1e6
        print(f"{f'{s} x {k} x {n}':>18}{ort_rate:13.0f}{torch_rate:15.0f}")
    gflop = total_flops / 1e9
    print(f"prefill projections: {gflop:.1f} GFLOP -> {ort_ms:.0f} ms at ORT's rate, {torch_ms:.0f} ms at torch's")


if __name__ == "__main__":
    main()
