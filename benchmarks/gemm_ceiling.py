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

``--bits 4`` runs the same chain as ``MatMulNBits`` (4-bit, symmetric, no zero points,
``accuracy_level`` 4: what ``compile --quantize int4`` writes) once per ``--block-size``, and says
how many bytes a weight ORT's packed copy holds: the session's resident memory with prepacking, less
the same session's without (the 4-bit data is repacked in place of the file's; what grows is per
block). ORT 1.32's x86 int8 kernel keeps two fp32 numbers a block, the scale and the block sum
(minus the zero point times the scale, which it multiplies by the activations' block sums), and
reads both every step: 6 bits a weight at block 32, where llama.cpp's Q4_0 reads 4.5 (an fp16
scale a block). The 1.39B Llama of ``peer_llamacpp.py --model large``:

    python benchmarks/gemm_ceiling.py --decode --bits 4 --block-size 32 64 128 --hidden 1536 \
        --intermediate 8960 --kv-dim 256 --layers 28

``--accuracy-levels [M ...]`` times each projection shape's int4 ``MatMulNBits`` at
``accuracy_level`` 4 against 1 (float activations: ORT unpacks blocks into an fp32 GEMM) at those
row counts, and the resident memory of a weight packed for one kernel or both. Level 1 is the faster
one for prefill-sized M and the slower one for decode; one node runs one kernel, so a graph that
wanted both would hold two packed copies:

    python benchmarks/gemm_ceiling.py --accuracy-levels --hidden 1536 --intermediate 8960 --kv-dim 256
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def projection_shapes(h: int, i: int, kv: int) -> list[tuple[str, int, int]]:
    """(name, K, N) of one Llama layer's projections as kvforge packs them: q|k|v, o, gate|up, down."""
    return [("qkv", h, h + 2 * kv), ("o", h, h), ("gate_up", h, 2 * i), ("down", i, h)]


def nbits_file_bytes(k: int, n: int, block: int) -> int:
    """Bytes of a 4-bit symmetric MatMulNBits weight in the artifact: the packed nibbles and one fp32
    scale a block (no zero points)."""
    blocks = -(-k // block)
    return n * blocks * (block // 2 + 4)


def _nbits_inits(name: str, k: int, n: int, block: int, rng) -> list:
    """Random 4-bit blocks and fp32 scales of a (K, N) weight, in MatMulNBits' layout."""
    from onnx import numpy_helper

    blocks = -(-k // block)
    data = rng.integers(0, 256, size=(n, blocks, block // 2), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.01 + 0.001).astype(np.float32)
    return [numpy_helper.from_array(data, f"{name}_blocks"), numpy_helper.from_array(scales, f"{name}_scales")]


def decode_chain(h: int, i: int, kv: int, layers: int, block: int | None):
    """The decode projections of ``layers`` layers as one ONNX model (each layer's weights its own, so
    a pass streams them all from memory): fp32 ``MatMul`` when ``block`` is None, else 4-bit
    ``MatMulNBits`` of that block size. Returns (model bytes, weight bytes in the file)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x, total = [], [], "x", 0
    for layer in range(layers):
        for name, k, n in projection_shapes(h, i, kv):
            if block is None:
                weight = rng.standard_normal((k, n), dtype=np.float32) * 0.02
                inits.append(numpy_helper.from_array(weight, f"{name}{layer}"))
                total += weight.nbytes
            else:
                inits += _nbits_inits(f"{name}{layer}", k, n, block, rng)
                total += nbits_file_bytes(k, n, block)
        # each projection's input is the previous output cut to its width (a Slice costs ~nothing)
        for (name, k, n), width in zip(projection_shapes(h, i, kv), (h, h, i, h)):
            y = f"{name}{layer}_y"
            if block is None:
                nodes.append(helper.make_node("MatMul", [x, f"{name}{layer}"], [y]))
            else:
                nodes.append(
                    helper.make_node(
                        "MatMulNBits",
                        [x, f"{name}{layer}_blocks", f"{name}{layer}_scales"],
                        [y],
                        domain="com.microsoft",
                        K=k,
                        N=n,
                        bits=4,
                        block_size=block,
                        accuracy_level=4,
                    )
                )
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
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString(), total


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _session(model: bytes, threads: int, prepack: bool = True):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _nbits_model(k: int, n: int, block: int, levels: tuple[int, ...] = (4,), rows: int | str = 1) -> bytes:
    """One (K, N) 4-bit weight read by one MatMulNBits node per accuracy level in ``levels`` (several
    nodes share the one initializer, as two kernels of one session would); input ``x`` [rows, K]."""
    from onnx import TensorProto, helper

    inits = _nbits_inits("w", k, n, block, np.random.default_rng(0))
    attrs = {"domain": "com.microsoft", "K": k, "N": n, "bits": 4, "block_size": block}
    inputs = ["x", "w_blocks", "w_scales"]
    nodes = [helper.make_node("MatMulNBits", inputs, [f"y{lv}"], accuracy_level=lv, **attrs) for lv in levels]
    graph = helper.make_graph(
        nodes,
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info(f"y{level}", TensorProto.FLOAT, None) for level in levels],
        inits,
    )
    # opset 21: the int8 prefill's rewrite of this node (benchmarks/int8_prefill.py) quantizes in blocks
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def _grown_in_child(model: bytes, prepack: bool, threads: int) -> int:
    """Resident growth of a session of ``model`` made and run in a fresh process (a freed arena would
    blur a second session in this one); Linux only."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "one.onnx"
        path.write_bytes(model)
        cmd = [sys.executable, __file__, "--resident-child", str(path), str(int(prepack)), "--threads", str(threads)]
        return int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])


def packed_bytes_per_block(block: int, threads: int, size: int = 8192) -> float:
    """Bytes a block of 4-bit weights costs beyond its nibbles once ORT has prepacked it: one
    ``size`` x ``size`` MatMulNBits, whose session's resident growth with prepacking less without is
    divided by its blocks."""
    model = _nbits_model(size, size, block)
    grown = [_grown_in_child(model, prepack, threads) for prepack in (True, False)]
    return (grown[0] - grown[1]) / (size * (size // block))


def accuracy_levels(h: int, i: int, kv: int, threads: int, repeat: int, rows: list[int], block: int = 32) -> None:
    """int4 ``MatMulNBits`` at ``accuracy_level`` 4 (int8 activations: what compile writes) against 1
    (float activations): ms per call of each projection shape at each M in ``rows``, and the resident
    memory of one 8192 x 8192 weight packed for either kernel or for both (two nodes, one weight)."""
    rng = np.random.default_rng(1)
    print(f"{threads} threads, block {block}; ms per call (p10 of max(9, 16 x {repeat} / M) calls), level 4 / level 1")
    print(f"{'K x N':>14}" + "".join(f"{f'M={m}':>18}" for m in rows))
    for _, k, n in projection_shapes(h, i, kv):
        cells = []
        sessions = {level: _session(_nbits_model(k, n, block, (level,), "M"), threads) for level in (4, 1)}
        for m in rows:
            feed = {"x": rng.standard_normal((m, k), dtype=np.float32)}
            best = []
            for level in (4, 1):
                run = sessions[level].run
                for _ in range(2):
                    run(None, feed)
                calls = max(9, repeat * 16 // m)
                times = sorted(_time(lambda run=run, feed=feed: run(None, feed)) for _ in range(calls))
                best.append(times[len(times) // 10])
            cells.append(f"{best[0] * 1e3:.2f} / {best[1] * 1e3:.2f}")
        print(f"{f'{k} x {n}':>14}" + "".join(f"{c:>18}" for c in cells))
    size = 8192
    file_mib = nbits_file_bytes(size, size, block) / 2**20
    print(f"resident growth of one {size} x {size} weight ({file_mib:.0f} MiB in the file), prepacked for:")
    for levels in ((4,), (1,), (4, 1)):
        grown = _grown_in_child(_nbits_model(size, size, block, levels), True, threads)
        print(f"  level {' and '.join(map(str, levels))}: {grown / 2**20:.0f} MiB")


def _resident_child(path: str, prepack: bool, threads: int) -> None:
    model = Path(path).read_bytes()
    before = _resident_bytes()
    session = _session(model, threads, prepack)
    del model
    gc.collect()
    session.run(None, {"x": np.ones((1, session.get_inputs()[0].shape[1]), np.float32)})
    print(_resident_bytes() - before)


def decode_ceiling(
    h: int, i: int, kv: int, layers: int, threads: int, repeat: int, blocks: list[int | None] | None = None
) -> None:
    """Time the chain at M = 1..8 for each of ``blocks`` (None: fp32 MatMul)."""
    rng = np.random.default_rng(1)
    print(f"{layers} layers, {threads} threads")
    print(f"memory read bandwidth (np.sum, 1 GiB): {_bandwidth(threads) / 1e9:.1f} GB/s")
    for block in blocks or [None]:
        model, total = decode_chain(h, i, kv, layers, block)
        weights = sum(k * n for _, k, n in projection_shapes(h, i, kv)) * layers
        if block is None:
            print(f"fp32 MatMul: {total / 2**20:.0f} MiB of projection weights")
        else:
            print(
                f"4-bit MatMulNBits, block {block}: {total / 2**20:.0f} MiB in the file"
                f" ({8 * total / weights:.2f} bits a weight); prepacking adds"
                f" {packed_bytes_per_block(block, threads):.1f} bytes a block (8192 x 8192)"
            )
        session = _session(model, threads)
        for m in (1, 2, 4, 8):
            feed = {"x": rng.standard_normal((m, h), dtype=np.float32)}
            for _ in range(3):
                session.run(None, feed)
            times = sorted(_time(lambda run=session.run, feed=feed: run(None, feed)) for _ in range(repeat))
            best = times[len(times) // 10]  # p10: the runs that had the cores
            print(f"  M={m}: p10 {best * 1e3:.2f} ms per pass -> {total / best / 1e9:.1f} GB/s of the file's bytes")
        del session
        gc.collect()
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
    p.add_argument("--bits", type=int, choices=[4, 32], default=32, help="--decode: 4 = MatMulNBits, 32 = fp32 MatMul")
    p.add_argument("--block-size", type=int, nargs="+", default=[32], help="--decode --bits 4: block sizes to run")
    p.add_argument(
        "--accuracy-levels",
        type=int,
        nargs="*",
        default=None,
        metavar="M",
        help="int4 MatMulNBits at accuracy level 4 vs 1 for these row counts (default 1 4 16 64 128 512)",
    )
    p.add_argument("--resident-child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.resident_child:
        _resident_child(a.resident_child[0], a.resident_child[1] == "1", a.threads)
        return
    if a.accuracy_levels is not None:
        rows = a.accuracy_levels or [1, 4, 16, 64, 128, 512]
        accuracy_levels(a.hidden, a.intermediate, a.kv_dim, a.threads, a.repeat, rows, a.block_size[0])
        return
    if a.decode:
        blocks = [None] if a.bits == 32 else a.block_size
        decode_ceiling(a.hidden, a.intermediate, a.kv_dim, a.layers, a.threads, a.repeat, blocks)
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
