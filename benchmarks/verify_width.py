"""What a verify call costs per width, and a decode step per batch, against a one-token step
(the constants of runtime/speculative/cost.py).

    .venv/bin/python benchmarks/verify_width.py OUT [--threads 2] [--context 300] [--rounds 12]

One engine with ``speculative="prediction"`` (prediction_k 32), every cache row filled with
``--context`` tokens; per round, alternating: a batch-1 verify call of width 1, 2, 4, 8, 12, 17,
33, a decode step of batch 1, 2, 4 and a verify call of 2 and 4 rows of width 2, 3, 5, 9 (all
through the one verify graph, as in speculative decoding; the gqa lowering refuses several rows of
more than one token, ``exact`` and ``onnx`` run them). Median over rounds (the first two
dropped), as a multiple of the width-1 call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvforge.runtime import Engine
from kvforge.runtime.speculative import SpeculativeConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()
    config = SpeculativeConfig(method="prediction", prediction_k=32)
    engine = Engine.load(args.artifact, threads=args.threads, speculative=config)
    ctx = args.context
    prompt = [(i * 37) % 40000 + 100 for i in range(ctx)]
    rows = min(4, engine.max_batch)
    for r in range(rows):
        engine.prefill_rows([prompt], [0], r)
        engine.lengths[r] = ctx
    widths = (1, 2, 4, 8, 12, 17, 33)
    batches = tuple(b for b in (1, 2, 4) if b <= rows)
    wide = (2, 3, 5, 9)  # verify calls of several rows: every row pays the width (not in gqa: refused)
    several = batches[1:] if engine.verify_together else ()
    times: dict[tuple, list[float]] = {
        **{("width", w): [] for w in widths},
        **{("batch", b): [] for b in batches},
        **{("rows", b, w): [] for b in several for w in wide},
    }
    load = os.getloadavg()
    for _ in range(args.rounds):
        for w in widths:
            engine.verify_ids(1, w)[:] = 5
            t = time.perf_counter()
            engine.verify_rows(1, w, 0)
            times["width", w].append(time.perf_counter() - t)
            engine.lengths[0] = ctx
        for b in batches:
            engine.decode_ids(b)[:] = 5
            t = time.perf_counter()
            engine.decode_rows(b, 0)
            times["batch", b].append(time.perf_counter() - t)
            engine.lengths[:b] = ctx
        for b in several:
            for w in wide:
                engine.verify_ids(b, w)[:] = 5
                t = time.perf_counter()
                engine.verify_rows(b, w, 0)
                times["rows", b, w].append(time.perf_counter() - t)
                engine.lengths[:b] = ctx
    base = statistics.median(times["width", 1][2:])
    print(f"load {load[0]:.1f} -> {os.getloadavg()[0]:.1f}; {args.threads} threads; {ctx} cached positions")
    for (kind, n, *w), xs in times.items():
        m = statistics.median(xs[2:])
        label = {"width": f"verify, 1 row x {n} tokens", "batch": f"decode, {n} rows x 1 token"}.get(kind)
        label = label or f"verify, {n} rows x {w[0]} tokens"
        print(f"{label:26s} {m * 1000:7.1f} ms  x{m / base:.2f}")


if __name__ == "__main__":
    main()
