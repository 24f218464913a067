"""How many tokens ngram drafting would draft: greedy outputs replayed through the drafter at several
``k``, priced by this artifact's measured verify-call costs (issue 23; how ``ngram``'s default K was
chosen).

    python benchmarks/ngram_replay.py OUT --hf-dir ~/.cache/kvforge/smollm2/hf [--new-tokens 128 256]

1. The prompts of benchmarks/speculative.py (spec_peers.py's encoding: the chat template, the same
   ids every side gets), decoded greedily by the artifact without drafting, up to the largest
   ``--new-tokens`` (eos ends a row).
2. The cost of a batch-1 call of each width 1 .. 17 at the prompts' context, in one-token steps
   (median over ``--rounds``, calls of every width interleaved).
3. For each ``--k`` and each ``--new-tokens`` (the output cut there): the output replayed through
   the runtime's own :class:`NgramDrafter` and :class:`RowDrafting` (the adaptive length, the pause
   after a miss) as the batch loop drives them, each call's drafts checked against the recorded
   output. Greedy decoding with drafts gives the same tokens (fp32; int4 only up to near-ties), so
   the replay knows exactly which drafts a run would accept. Reported per prompt: tokens per call and
   the expected speed-up, ``(n - 1) / Σ cost(width of each call)``; per kind, the mean speed-up.

The replay leaves out what drafting costs in Python (a few tenths of a millisecond a call) and the
noise of a live run; benchmarks/spec_peers.py measures the real thing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WIDTHS = (1, 2, 3, 5, 9, 13, 17)
KINDS = ("grounded", "open")


def replay(prompt: list[int], output: list[int], k: int, cost, max_width: int = 17) -> tuple[int, float]:
    """Verify calls and their summed cost (``cost(width)`` in steps) to produce ``output[1:]`` after
    ``prompt`` (the first token comes from the prefill) with ngram drafts of up to ``k`` tokens."""
    from kvforge.runtime.speculative.drafters import NgramDrafter, RowDrafting

    row = RowDrafting(NgramDrafter(prompt), k)
    i, calls, total = 1, 0, 0.0
    while i < len(output):
        fit = min(max_width, len(output) - i) - 1  # as Verifier.step: room for the fed token + drafts
        drafts = row.propose(output[:i], fit) if fit > 0 else []
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == output[i + accepted]:
            accepted += 1
        row.learn(len(drafts), accepted)
        calls += 1
        total += cost(1 + len(drafts))
        i += accepted + 1
    return calls, total


def interpolate(table: dict[int, float]):
    """Piecewise-linear cost between the measured widths."""
    widths = sorted(table)

    def cost(width: int) -> float:
        for lo, hi in itertools.pairwise(widths):
            if width <= hi:
                return table[lo] + (table[hi] - table[lo]) * (width - lo) / (hi - lo)
        return table[widths[-1]] * width / widths[-1]

    return cost


def measure_widths(engine, context: int, rounds: int) -> dict[int, float]:
    """A batch-1 call of each width at ``context`` cached positions, in one-token calls."""
    prompt = [(i * 37) % 1000 + 100 for i in range(context)]
    engine.prefill_rows([prompt], [0], 0)
    times: dict[int, list[float]] = {w: [] for w in WIDTHS}
    for _ in range(rounds + 2):
        for w in WIDTHS:
            engine.verify_ids(1, w)[:] = 5
            engine.lengths[0] = context
            t = time.perf_counter()
            engine.verify_rows(1, w, 0)
            times[w].append(time.perf_counter() - t)
    med = {w: statistics.median(ts[2:]) for w, ts in times.items()}
    return {w: med[w] / med[1] for w in WIDTHS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--hf-dir", type=Path, default=Path.home() / ".cache/kvforge/smollm2/hf")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[128, 256])
    p.add_argument("--k", type=int, nargs="+", default=[2, 4, 6, 8, 12, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    import spec_peers

    from kvforge.runtime import Engine, SamplingParams
    from kvforge.runtime.speculative import SpeculativeConfig

    prompts = spec_peers.chat_prompts(args.hf_dir)
    config = SpeculativeConfig(method="prediction")  # the verify graph, nothing drafted by itself
    load = os.getloadavg()[0]
    with Engine.load(args.artifact, threads=args.threads, prefix_cache=0, speculative=config) as engine:
        greedy = SamplingParams(temperature=0)
        for p_ in prompts:
            [r] = engine.generate([p_["ids"]], max_new_tokens=max(args.new_tokens), sampling=greedy)
            p_["output"] = list(r.token_ids)
        context = round(statistics.mean(len(p_["ids"]) for p_ in prompts))
        table = measure_widths(engine, context, args.rounds)
    cost = interpolate(table)
    print(f"{os.path.basename(os.path.normpath(args.artifact))}: {args.threads} threads, load {load:.1f}")
    print("verify call cost (steps), width " + ", ".join(f"{w}: {c:.2f}" for w, c in table.items()))
    rows = []
    for n in args.new_tokens:
        print(f"\nup to {n} new tokens: speed-up (tokens per call)")
        print("k   " + "".join(f"{p_['name'][:10]:>16s}" for p_ in prompts) + "   grounded      open")
        for k in args.k:
            per = []
            for p_ in prompts:
                out = p_["output"][:n]
                calls, total = replay(p_["ids"], out, k, cost)
                per.append(
                    dict(
                        prompt=p_["name"],
                        kind=p_["kind"],
                        new_tokens=len(out),
                        calls=calls,
                        tokens_per_call=(len(out) - 1) / calls,
                        speedup=(len(out) - 1) / total,
                    )
                )
            kinds = {kind: statistics.mean(x["speedup"] for x in per if x["kind"] == kind) for kind in KINDS}
            rows.append(dict(new_tokens=n, k=k, prompts=per, mean=kinds))
            print(
                f"{k:<4d}"
                + "".join(f"{x['speedup']:9.2f} ({x['tokens_per_call']:4.2f})" for x in per)
                + f"{kinds['grounded']:10.2f}{kinds['open']:10.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps(dict(artifact=args.artifact, load=load, width_cost=table, rows=rows), indent=1))


if __name__ == "__main__":
    main()
