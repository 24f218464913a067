"""How fast can fp32 prefill be here? GFLOP/s of one ONNX Runtime MatMul and one torch linear on
the prefill GEMM shapes of a model, in the same run.

A prefill of S tokens through a Llama costs 2 x S x (non-embedding parameters) FLOPs in its
projections; at the MatMul rate this script measures, that is the floor under TTFT whatever the
graph around it does. Example (the SmolLM-135M shape of peer_genai.py, 128-token prompt):

    python benchmarks/gemm_ceiling.py --hidden 576 --intermediate 1536 --kv-dim 192 --layers 30 --tokens 128

``--decode`` asks the decode question instead: how fast does ORT's MatMul stream a model's weights
at M = 1..8 rows? One graph chains every layer's projections (q|k|v packed, o, gate|up packed, down;
fp32, prepacked by ORT as in a session the engine makes) and runs on ``--threads`` threads; the
script prints GB/s of weights read per run next to the memory-read bandwidth measured in the same
run (``np.sum`` over a 1 GiB buffer by ``--threads`` threads, as ``peer_genai.py``'s roofline):

    python benchmarks/gemm_ceiling.py --decode --threads 2
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


def decode_ceiling(h: int, i: int, kv: int, layers: int, threads: int, repeat: int) -> None:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x, total = [], [], "x", 0
    for layer in range(layers):
        for name, (k, n) in zip(("qkv", "o", "gate_up", "down"), [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]):
            weight = rng.standard_normal((k, n), dtype=np.float32) * 0.02
            inits.append(numpy_helper.from_array(weight, f"{name}{layer}"))
            total += weight.nbytes
        # each projection's input is the previous output cut to its width (a Slice costs ~nothing)
        for name, width in (("qkv", h), ("o", h), ("gate_up", i), ("down", h)):
            nodes.append(helper.make_node("MatMul", [x, f"{name}{layer}"], [f"{name}{layer}_y"]))
            nodes.append(
                helper.make_node("Slice", [f"{name}{layer}_y", "zero", f"w{width}", "last"], [f"{name}{layer}_s"])
            )
            x = f"{name}{layer}_s"
    for name, value in (("zero", 0), (f"w{h}", h), (f"w{i}", i), ("last", -1)):
        inits.append(numpy_helper.from_array(np.array([value], dtype=np.int64), name))
    graph = helper.make_graph(
        nodes,
        "decode_ceiling",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", h])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    print(f"{layers} layers, {total / 2**20:.0f} MiB of fp32 projection weights, {threads} threads")
    print(f"memory read bandwidth (np.sum, 1 GiB): {_bandwidth(threads) / 1e9:.1f} GB/s")
    for m in (1, 2, 4, 8):
        feed = {"x": rng.standard_normal((m, h), dtype=np.float32)}
        for _ in range(3):
            session.run(None, feed)
        times = sorted(_time(lambda feed=feed: session.run(None, feed)) for _ in range(repeat))
        best = times[len(times) // 10]  # p10: the runs that had the cores
        print(f"M={m}: p10 {best * 1e3:.2f} ms per pass -> {total / best / 1e9:.1f} GB/s of weights")
    print(f"memory read bandwidth again: {_bandwidth(threads) / 1e9:.1f} GB/s")


def _time(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _bandwidth(threads: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    buffer = np.ones(2**27)  # 1 GiB of float64
    chunks = np.array_split(buffer, threads)
    with ThreadPoolExecutor(threads) as pool:
        best = min(_time(lambda: list(pool.map(np.sum, chunks))) for _ in range(5))
    return buffer.nbytes / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv-dim", type=int, default=192, help="KV heads x head dim")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--decode", action="store_true", help="GB/s of ORT's MatMul streaming the weights at M = 1..8")
    p.add_argument("--threads", type=int, default=2, help="--decode: ORT intra-op threads and bandwidth threads")
    a = p.parse_args()
    if a.decode:
        decode_ceiling(a.hidden, a.intermediate, a.kv_dim, a.layers, a.threads, a.repeat)
        return
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
