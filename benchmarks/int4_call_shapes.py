"""Why int4 greedy output is not token-identical under drafting (issue 23): where call-shape
differences come from, per MatMulNBits accuracy_level.

    .venv/bin/python benchmarks/int4_call_shapes.py OUT_INT4 [--threads 2]

1. One MatMulNBits node (SmolLM2's shapes, random int4 weights, accuracy_level 4: int8
   activations): each row of an M-row call against the same row alone, M = 2..17.
2. The artifact, and a copy of its graphs with accuracy_level 0 (fp32 compute on the same int4
   weights; the weights file hard-linked, not copied): 8 positions' logits from one 8-token verify
   call against 8 one-token steps, and the keys written per layer (where a difference starts and
   how it grows).
3. Per accuracy level: the time of a verify call per width against a one-token step (the
   artifact's graphs are loaded unoptimized in both, so the two are like for like).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from kvforge.runtime import Engine
from kvforge.runtime.speculative import SpeculativeConfig


def node_rows(threads: int) -> None:
    rng = np.random.default_rng(0)
    for k, n in ((576, 960), (576, 3072), (1536, 576), (576, 49152)):
        b = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
        s = (rng.random(n * k // 32, dtype=np.float32) * 0.02).astype(np.float32)
        node = helper.make_node(
            "MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=32,
            accuracy_level=4,
        )  # fmt: skip
        graph = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
            initializer=[
                helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
                helper.make_tensor("S", TensorProto.FLOAT, s.shape, s.tobytes(), raw=True),
            ],
        )  # fmt: skip
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        a = rng.standard_normal((17, k), dtype=np.float32)
        alone = np.stack([sess.run(None, {"A": a[r : r + 1]})[0][0] for r in range(17)])
        worst = {m: float(np.abs(sess.run(None, {"A": a[:m]})[0] - alone[:m]).max()) for m in (2, 4, 8, 17)}
        print(f"MatMulNBits K={k} N={n} level 4: max|row in an M-row call - the row alone| {worst}")


def level_copy(src: Path, level: int) -> Path:
    dst = src.parent / f"{src.name}-accuracy{level}"
    if dst.exists():
        return dst
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".onnx" or f.name.endswith(".ort.onnx"):
            os.link(f, dst / f.name)
    for g in ("prefill", "decode", "score", "verify"):
        if not (src / f"{g}.onnx").exists():
            continue
        m = onnx.load(src / f"{g}.onnx", load_external_data=False)
        for n in m.graph.node:
            for a in n.attribute:
                if n.op_type == "MatMulNBits" and a.name == "accuracy_level":
                    a.i = level
        onnx.save(m, dst / f"{g}.onnx")  # the same size: the manifest's size check passes
    return dst


def shapes(path: Path, threads: int, label: str) -> None:
    config = SpeculativeConfig(method="prediction", prediction_k=16)
    e = Engine.load(path, threads=threads, speculative=config, optimized=False, verify=False)
    p = [(i * 7919) % 40000 + 50 for i in range(300)]
    n0 = 280

    def keys():
        return {k: np.array(v[0, :, n0 : n0 + 8]) for k, v in e.cache.views(1, 0).items() if k.endswith(".key")}

    e.prefill_rows([p[:n0]], [0], 0)
    e.lengths[0] = n0
    e.verify_ids(1, 8)[0] = p[n0 : n0 + 8]
    one = e.verify_rows(1, 8, 0)[0].copy()
    k_one = keys()
    e.lengths[0] = n0
    steps = []
    for t in p[n0 : n0 + 8]:
        e.decode_ids(1)[0] = t
        steps.append(e.decode_rows(1, 0)[0].copy())
    k_steps = keys()
    diff = np.abs(one - np.array(steps)).max(-1)
    print(f"{label}: max|logits, one 8-token call - 8 steps| per position {np.round(diff, 5).tolist()}")
    layers = e.manifest.model.num_layers
    first = next(
        (
            i
            for i in range(layers)
            if np.abs(k_one[f"past_key_values.{i}.key"] - k_steps[f"past_key_values.{i}.key"]).max() > 0
        ),
        None,
    )
    grow = [
        float(np.abs(k_one[f"past_key_values.{i}.key"] - k_steps[f"past_key_values.{i}.key"]).max())
        for i in range(layers)
    ]
    print(f"{label}: keys differ first at layer {first}; max|key diff| per layer {[f'{g:.1g}' for g in grow]}")
    times = {w: [] for w in (1, 2, 4, 8, 17)}
    for _ in range(6):
        for w in times:
            e.lengths[0] = n0
            e.verify_ids(1, w)[0] = 5
            t = time.perf_counter()
            e.verify_rows(1, w, 0)
            times[w].append(time.perf_counter() - t)
    base = statistics.median(times[1])
    print(
        f"{label}: verify call time / a one-token call: "
        + ", ".join(f"width {w} x{statistics.median(v) / base:.2f}" for w, v in times.items())
    )
    e.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    print(f"load {os.getloadavg()}; onnxruntime {ort.__version__}")
    node_rows(args.threads)
    src = Path(args.artifact)
    shapes(src, args.threads, "accuracy_level 4 (as compiled)")
    shapes(level_copy(src, 0), args.threads, "accuracy_level 0")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
