"""The int8 prefill (``Engine.load(prefill="int8")``) against the int4 graph it is made from: what
each projection costs on each kernel, what the prompt's pass costs in perplexity, and what it
saves in time to first token.

* ``kernels``: one projection of each of a model's shapes (q|k|v packed, o, gate|up packed, down)
  at M = ``--rows`` tokens, ms a call, 2 threads, best of 3 x 20 calls: ORT's int4 kernel
  (``MatMulNBits``, block 32, accuracy level 4: what ``--quantize int4`` writes), the int8
  prefill's rewrite of that node (per-token int8 activations, ``MatMulInteger``), and fp32
  ``MatMul``, in one process.
* ``quality``: the artifact's score graph (logits at every position) as compiled, and rewritten as
  the int8 and fp32 prefills rewrite the prefill graph (:mod:`kvforge.runtime.int8_prefill`), scored
  on the project's quality text (Genesis, KJV: :func:`common.load_text`), ``--tokens`` ids in
  windows of ``--window``, each from an empty cache: perplexity of the prompt's pass on each, and
  how often the two argmaxes agree (teacher-forced).
* ``ttft``: ``--prompt-lens`` prompts of random ids through ``Engine.prefill_prompt``, the artifact
  loaded with ``prefill="ort"`` and ``"int8"`` in processes of their own, taking turns over
  ``--rounds`` rounds; median of prompts 2-5 per round, then of the rounds; decode ms a step
  after each prompt (16 steps) and the worker's load time and peak RSS beside them.

    python -m benchmarks int8-prefill ART --json int8_prefill.json   # ART: an int4 artifact

(``benchmarks/peer_openvino.py --kvforge-prefill ort int8`` runs it against OpenVINO GenAI.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _session(model: bytes, threads: int, data_folder: Path | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if data_folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_folder))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _best_ms(session, x: np.ndarray) -> float:
    for _ in range(3):
        session.run(None, {"x": x})
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(20):
            session.run(None, {"x": x})
        best = min(best, (time.perf_counter() - start) / 20)
    return 1e3 * best


def kernels(hidden: int, intermediate: int, kv_dim: int, heads_dim: int, rows: list[int], threads: int) -> list[dict]:
    """ms a call of each projection shape on the three kernels (see the module docstring)."""
    from gemm_ceiling import _nbits_model
    from onnx import TensorProto, helper, numpy_helper

    from kvforge.runtime.int8_prefill import rewrite

    shapes = {
        "q|k|v": (hidden, heads_dim + 2 * kv_dim),
        "o": (heads_dim, hidden),
        "gate|up": (hidden, 2 * intermediate),
        "down": (intermediate, hidden),
    }
    out = []
    for name, (k, n) in shapes.items():
        nbits = _nbits_model(k, n, 32, (4,), rows="m")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "one.onnx"
            path.write_bytes(nbits)
            int8, root, _ = rewrite(path, Path(tmp) / "int8.data")
            int8_session = _session(int8, threads, root)  # reads the file now
        w = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y4"])],
            "fp32",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
            [helper.make_tensor_value_info("y4", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(w, "w")],
        )
        fp32 = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
        sessions = {
            "int4": _session(nbits, threads),
            "int8": int8_session,
            "fp32": _session(fp32, threads),
        }
        for m in rows:
            x = np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)
            row = {"projection": name, "K": k, "N": n, "M": m}
            row.update({f"{kind}_ms": round(_best_ms(s, x), 4) for kind, s in sessions.items()})
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def quality(artifact: Path, tokens: int, window: int, threads: int) -> dict:
    """Perplexity of the score graph as compiled and as the int8 and fp32 prefills rewrite it."""
    from common import load_text

    from kvforge.runtime import Engine
    from kvforge.runtime.int8_prefill import activation_ranges, float_activations, rewrite
    from kvforge.tools import perplexity as ppl

    kinds = ("int8", "int8_unsmoothed", "fp32")
    result = {}
    with Engine.load(artifact, threads=threads) as engine:
        ids = engine.tokenizer.encode(load_text(None))[:tokens]
        plan = ppl.windows(len(ids), window)
        logits = {"int4": [engine.score([ids[w.start : w.end]])[0].copy() for w in plan]}
        graph = engine.manifest.graphs["score"]
        source = artifact / (graph.ort_file or graph.file)
        ranges = activation_ranges(engine, "score")  # as Engine.load(prefill="int8") does for the prefill graph
        for kind in kinds:
            with tempfile.TemporaryDirectory() as tmp:
                if kind == "fp32":
                    model, root, _ = float_activations(source)
                else:
                    model, root, _ = rewrite(source, Path(tmp) / "int8.data", ranges if kind == "int8" else None)
                engine.backend.add_session("score", model, source, preoptimized=bool(graph.ort_file), data_folder=root)
            logits[kind] = [engine.score([ids[w.start : w.end]])[0].copy() for w in plan]
    for kind, per_window in logits.items():
        nll = np.concatenate([ppl.window_nll(lg, ids, w) for lg, w in zip(per_window, plan)])
        result[f"{kind}_perplexity"] = round(ppl.perplexity(nll), 4)
    for kind in kinds:
        same = [np.mean(a.argmax(-1) == b.argmax(-1)) for a, b in zip(logits["int4"], logits[kind])]
        result[f"{kind}_argmax_agreement"] = round(float(np.mean(same)), 4)
    result.update(tokens=len(ids), window=window)
    print(json.dumps(result), flush=True)
    return result


def _ttft_worker(artifact: str, prefill: str, lengths: list[int], threads: int) -> None:
    from kvforge.runtime import Engine

    rng = np.random.default_rng(0)
    result = {"prefill": prefill}
    start = time.perf_counter()
    with Engine.load(artifact, threads=threads, prefix_cache=0, prefill=prefill) as engine:
        result["load_s"] = time.perf_counter() - start
        vocab = engine.vocab_size
        for n in lengths:
            times, steps = [], []
            for _ in range(5):
                ids = rng.integers(2, vocab, n).tolist()
                start = time.perf_counter()
                token = engine.prefill_prompt([ids]).argmax(axis=1)
                times.append(time.perf_counter() - start)
                for _ in range(16):
                    start = time.perf_counter()
                    token = engine.decode(token).argmax(axis=1)
                    steps.append(time.perf_counter() - start)
            result[f"ttft_ms_{n}"] = 1e3 * statistics.median(times[1:])
            result[f"step_ms_{n}"] = 1e3 * statistics.median(steps)
    status = Path("/proc/self/status").read_text().splitlines()
    result["peak_rss_mib"] = int(next(line for line in status if line.startswith("VmHWM")).split()[1]) // 1024
    print(json.dumps(result), flush=True)


def ttft(artifact: Path, lengths: list[int], rounds: int, threads: int) -> dict:
    runs: dict[str, list[dict]] = {"ort": [], "int8": []}
    for _ in range(rounds):
        for prefill in runs:
            cmd = [sys.executable, __file__, "--ttft-worker", str(artifact), prefill, *map(str, lengths)]
            cmd += ["--threads", str(threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[prefill].append(json.loads(out.strip().splitlines()[-1]))
    medians = {p: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "prefill"} for p, rs in runs.items()}
    for n in lengths:
        medians[f"ratio_ttft_{n}"] = medians["int8"][f"ttft_ms_{n}"] / medians["ort"][f"ttft_ms_{n}"]
    print(json.dumps(medians), flush=True)
    return {"medians": medians, "rounds": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path, nargs="?", help="an int4 artifact (quality, ttft)")
    p.add_argument("--parts", nargs="+", choices=("kernels", "quality", "ttft"), default=["kernels", "quality", "ttft"])
    p.add_argument("--shape", type=int, nargs=4, default=[576, 1536, 192, 576], help="hidden intermediate kv_dim q_dim")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 128, 1024], help="kernels: tokens a call")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--ttft-worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ttft_worker:
        artifact, prefill, *lengths = args.ttft_worker
        _ttft_worker(artifact, prefill, [int(n) for n in lengths], args.threads)
        return 0
    if {"quality", "ttft"} & set(args.parts) and args.artifact is None:
        p.error("quality and ttft need an int4 artifact")
    report = {"uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    if "kernels" in args.parts:
        report["kernels"] = kernels(*args.shape, rows=args.rows, threads=args.threads)
    if "quality" in args.parts:
        report["quality"] = quality(args.artifact, args.tokens, args.window, args.threads)
    if "ttft" in args.parts:
        report["ttft"] = ttft(args.artifact, args.prompt_lens, args.rounds, args.threads)
    report["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
