"""Where a prefill's time goes: ONNX Runtime's profiler over an artifact's step graph, per op type and per node.

For each artifact and prompt length M, the engine is loaded as ``Engine.load`` loads it (``--threads``
intra-op threads, prepacked weights, the ORT-optimized graph), its step session is made again with
ORT's profiler on (``SessionOptions.enable_profiling``), and ``--runs`` prefills of the same M random
token ids are timed after two warm-up calls. The report: each op type's kernel time per prefill and
share, the ``--top`` costliest nodes, and how many rows the lm_head ran on (the prefill graph takes
the logits of each row's last token only, so the lm_head runs on one row per prompt whatever M is)::

    python -m benchmarks prefill-profile OUT_FP32 OUT_INT4 --tokens 128 1024

An artifact's max_prompt bounds M (compile with ``--max-seq 2048`` for 1024). On a shared machine
the absolute times move with the load (printed before and after); the shares within one profile hold
better, and A/B questions (one setting against another) need the sides taking turns, as
``peer_genai.py``'s rounds do. Findings: benchmarks/FINDINGS.md ("Where a prefill goes").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def profile(artifact: Path, tokens: int, threads: int, runs: int, work: Path) -> dict[str, Any]:
    """Profile ``runs`` prefills of ``tokens`` ids through ``artifact``'s step graph."""
    from kvforge.runtime.engine import StepEngine

    engine = StepEngine.load(artifact, threads=threads, prefix_cache=0)
    try:
        limit = engine.manifest.limits.max_prompt
        if tokens > limit:
            raise SystemExit(
                f"{artifact}: a {tokens}-token prefill is over its max_prompt {limit}; compile with a larger --max-seq"
            )
        backend, graph = engine.backend, engine.step_graph
        prefix = str(work / f"{artifact.name}-{tokens}")
        backend.options = dataclasses.replace(backend.options, profile=prefix)
        backend.sessions.pop(graph)
        session = backend.session(graph)  # the same options, the profiler on
        prompt = np.random.default_rng(0).integers(100, engine.vocab_size - 1, tokens).tolist()
        for _ in range(2):
            engine.prefill([prompt])
        wall = []
        for _ in range(runs):
            start = time.perf_counter()
            engine.prefill([prompt])
            wall.append((time.perf_counter() - start) * 1e3)
        events = json.loads(Path(session.end_profiling()).read_text())
    finally:
        engine.close()
    return {"artifact": str(artifact), "tokens": tokens, "wall_ms": wall, **_aggregate(events, runs)}


def _aggregate(events: list[dict[str, Any]], runs: int) -> dict[str, Any]:
    """Kernel time per op type and per node over the last ``runs`` model runs, in ms per run."""
    run_ends = sorted(e["ts"] + e["dur"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    if len(run_ends) < runs:
        raise RuntimeError(f"the profile holds {len(run_ends)} runs, expected at least {runs}")
    first = run_ends[-runs - 1] if len(run_ends) > runs else 0  # events after the warm-up runs
    by_op: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    by_node: dict[str, tuple[str, float]] = {}
    lm_head_rows = None
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < first:
            continue
        op, node = e["args"]["op_name"], e["name"][: -len("_kernel_time")]
        by_op[op] += e["dur"] / 1e3 / runs
        count[op] += 1
        by_node[node] = (op, by_node.get(node, (op, 0.0))[1] + e["dur"] / 1e3 / runs)
        if "lm_head" in node and lm_head_rows is None:
            shapes = e["args"].get("input_type_shape") or [{}]
            dims = next(iter(shapes[0].values()), None)
            lm_head_rows = int(np.prod(dims[:-1])) if dims else None
    total = sum(by_op.values())
    ops = sorted(by_op, key=by_op.get, reverse=True)
    return {
        "kernel_ms": total,
        "ops": [{"op": op, "nodes": count[op] // runs, "ms": by_op[op], "share": by_op[op] / total} for op in ops],
        "nodes": [{"node": n, "op": op, "ms": ms} for n, (op, ms) in sorted(by_node.items(), key=lambda kv: -kv[1][1])],
        "lm_head_rows": lm_head_rows,
    }


def format_profile(report: dict[str, Any], top: int) -> str:
    wall = float(np.median(report["wall_ms"]))
    lines = [
        f"{report['artifact']}, M = {report['tokens']}: prefill {wall:.1f} ms (median of {len(report['wall_ms'])}), "
        f"kernels {report['kernel_ms']:.1f} ms; lm_head rows per prefill: {report['lm_head_rows']}",
        "| op | nodes | ms | share |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {o['op']} | {o['nodes']} | {o['ms']:.2f} | {100 * o['share']:.1f}% |" for o in report["ops"]]
    lines.append(f"costliest {top} nodes:")
    lines += [f"  {n['ms']:8.2f} ms  {n['op']:<28} {n['node']}" for n in report["nodes"][:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts", type=Path, nargs="+", help="kvforge compile outputs")
    p.add_argument("--tokens", type=int, nargs="+", default=[128], help="prompt lengths M (default 128)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="profiled prefills per artifact and M (after 2 warm-up)")
    p.add_argument("--top", type=int, default=8, help="costliest nodes listed")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    reports = []
    print(f"load before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvforge-profile-") as work:
        for artifact in args.artifacts:
            for tokens in args.tokens:
                reports.append(profile(artifact, tokens, args.threads, args.runs, Path(work)))
                print(format_profile(reports[-1], args.top), flush=True)
    print(f"load after: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"schema": "kvforge.prefill_profile", "reports": reports}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
