"""Two compiles of one model, A against B, in one process: their step graphs taking turns on the
same calls. The question it answers is "did this compile change make the graph faster?", which
two separate runs on a shared machine cannot (the load moves by more than the change).

Both artifacts are loaded as ``StepEngine.load`` loads them (``--threads`` each, prefix cache off);
each case runs ``--rounds`` times per side, A then B, and the report is each side's median with
the ratio B / A. Cases: a one-token call of ``--rows`` rows (``decode bN``: what a decode step
runs, through the graph the engine decodes with) and a prefill of ``--prompt-lens`` tokens::

    python -m benchmarks artifact-ab OUT_BEFORE OUT_AFTER --rows 1 4 --prompt-lens 128 512

Compile A from an older commit (``git worktree add /tmp/base COMMIT`` and the CLI run from it)
to measure a change; findings: benchmarks/FINDINGS.md ("The one-token branches, built").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def measure(a: Path, b: Path, rows: list[int], prompt_lens: list[int], rounds: int, threads: int) -> list[dict]:
    """``[{case, a_ms, b_ms, ratio}]``: each case's median call time per side and B / A."""
    from kvforge.runtime.engine import StepEngine

    engines = [StepEngine.load(path, threads=threads, prefix_cache=0) for path in (a, b)]
    try:
        for path, engine in zip((a, b), engines):
            if max(rows) > engine.max_batch:
                raise SystemExit(f"{path}: max_batch {engine.max_batch} < {max(rows)} rows; compile with --max-batch")
        rng = np.random.default_rng(0)
        vocab = min(e.vocab_size for e in engines)
        cases = [(f"decode b{n}", [[int(t)] for t in rng.integers(100, vocab - 1, n)], 10) for n in rows]
        cases += [(f"prefill {m}", [rng.integers(100, vocab - 1, m).tolist()], 1) for m in prompt_lens]
        results = []
        for case, prompt, calls in cases:
            for engine in engines:  # warm-up
                engine.prefill(prompt)
            times: list[list[float]] = [[], []]
            for _ in range(rounds):
                for side, engine in enumerate(engines):
                    start = time.perf_counter()
                    for _ in range(calls):
                        engine.prefill(prompt)
                    times[side].append((time.perf_counter() - start) * 1e3 / calls)
            a_ms, b_ms = (float(np.median(t)) for t in times)
            results.append({"case": case, "a_ms": a_ms, "b_ms": b_ms, "ratio": b_ms / a_ms})
            print(f"{case}: A {a_ms:.1f} ms, B {b_ms:.1f} ms, B/A x{b_ms / a_ms:.2f}", flush=True)
        return results
    finally:
        for engine in engines:
            engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="artifact A (the baseline)")
    p.add_argument("b", type=Path, help="artifact B")
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of the one-token calls (default 1)")
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[128], help="prefill lengths (default 128)")
    p.add_argument("--rounds", type=int, default=6, help="turns per side and case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    print(f"A = {args.a}, B = {args.b}; load before: {os.getloadavg()}", flush=True)
    results = measure(args.a, args.b, args.rows, args.prompt_lens, args.rounds, args.threads)
    load = os.getloadavg()
    print(f"load after: {load}")
    if args.json:
        report = {"schema": "kvforge.artifact_ab", "a": str(args.a), "b": str(args.b), "threads": args.threads}
        args.json.write_text(json.dumps({**report, "load_after": load, "cases": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
