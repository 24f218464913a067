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
   the runtime's own :class:`NgramDrafter` and :class:`RowDrafting` (the adaptive length from the
   cost of a call, the pauses after misses) as the batch loop drives them, each call's drafts
   checked against the recorded output. Greedy decoding with drafts gives the same tokens (fp32;
   int4 only up to near-ties), so the replay knows exactly which drafts a run would accept.
   Reported per prompt: tokens per call and the expected speed-up, ``(n - 1) / Σ cost(width of
   each call)``; per kind, the mean speed-up.
4. ``--batch N`` (an artifact that verifies several rows in one call: ``exact``, ``onnx``): the first
   N grounded prompts decoded together, as the batch loop does after their prefills (a row leaves
   when its output ends), every call priced by the measured cost of its rows × width. Three ways of
   choosing each call's width (every row pays it): plain (1), the batch loop's own rule
   (:func:`kvforge.runtime.speculative.verify._best_width`), and an oracle that knows which drafts
   will be accepted and takes the width with the most tokens per measured cost: the most any width
   rule could give with these drafts on this machine.

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
ROW_WIDTHS = (1, 2, 3, 5, 9, 17)
KINDS = ("grounded", "open")


def _matching(drafts: list[int], output: list[int]) -> int:
    """How many of ``drafts`` are right: the leading run equal to ``output``."""
    n = 0
    while n < len(drafts) and n < len(output) and drafts[n] == output[n]:
        n += 1
    return n


def replay(prompt: list[int], output: list[int], k: int, cost, max_width: int = 17) -> tuple[int, float]:
    """Verify calls and their summed cost (``cost(width)`` in steps) to produce ``output[1:]`` after
    ``prompt`` (the first token comes from the prefill) with ngram drafts of up to ``k`` tokens."""
    from kvforge.runtime.speculative.drafters import NgramDrafter, RowDrafting

    row = RowDrafting(NgramDrafter(prompt), k)
    i, calls, total = 1, 0, 0.0
    while i < len(output):
        fit = min(max_width, len(output) - i) - 1  # as Verifier.step: room for the fed token + drafts
        drafts = row.propose(output[:i], fit) if fit > 0 else []
        accepted = _matching(drafts, output[i:])
        row.learn(len(drafts), accepted)
        calls += 1
        total += cost(1 + len(drafts))
        i += accepted + 1
    return calls, total


def interpolate(table: dict[int, float]):
    """Piecewise-linear cost between the measured widths (proportional past the last)."""
    widths = sorted(table)

    def cost(width: int) -> float:
        for lo, hi in itertools.pairwise(widths):
            if width <= hi:
                return table[lo] + (table[hi] - table[lo]) * (width - lo) / (hi - lo)
        return table[widths[-1]] * width / widths[-1]

    return cost


def row_costs(table: dict[tuple[int, int], float]):
    """``cost(rows, width)`` from a measured ``{(rows, width): cost}``, interpolated per row count."""
    per_rows = {n: interpolate({w: c for (m, w), c in table.items() if m == n}) for n, _ in table}
    return lambda rows, width: per_rows[rows](width)


def measure_widths(engine, context: int, rounds: int, rows: int = 1) -> dict[tuple[int, int], float]:
    """A call of each width (1 row), and of 2 .. ``rows`` rows × ``ROW_WIDTHS``, at ``context``
    cached positions a row: ``{(rows, width): cost}`` in one-token calls."""
    prompt = [(i * 37) % 1000 + 100 for i in range(context)]
    for row in range(rows):
        engine.prefill_rows([prompt], [0], row)
    shapes = [(1, w) for w in WIDTHS] + [(n, w) for n in range(2, rows + 1) for w in ROW_WIDTHS]
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for _ in range(rounds + 2):
        for n, w in shapes:
            engine.verify_ids(n, w)[:] = 5
            engine.lengths[:n] = context
            t = time.perf_counter()
            engine.verify_rows(n, w, 0)
            times[n, w].append(time.perf_counter() - t)
    med = {s: statistics.median(ts[2:]) for s, ts in times.items()}
    return {s: med[s] / med[1, 1] for s in shapes}


def replay_batch(prompts, outputs, k: int, cost, rule: str, max_width: int = 17) -> float:
    """Summed cost (``cost(rows, width)`` in steps) of decoding ``outputs`` (after their first
    tokens) as one batch with ngram drafts of up to ``k``; ``rule``: ``"plain"`` (width 1),
    ``"loop"`` (the batch loop's ``_best_width``) or ``"oracle"`` (hindsight: the most tokens per cost)."""
    from types import SimpleNamespace

    from kvforge.runtime.speculative.drafters import NgramDrafter, RowDrafting
    from kvforge.runtime.speculative.verify import _best_width

    rows = [SimpleNamespace(drafting=RowDrafting(NgramDrafter(p), k)) for p in prompts]
    at = [1] * len(outputs)
    total = 0.0
    while True:
        live = [i for i, out in enumerate(outputs) if at[i] < len(out)]
        if not live:
            return total
        drafts = []
        for i in live:
            fit = min(max_width, len(outputs[i]) - at[i]) - 1
            alone = len(live) == 1  # as Verifier.step: a row alone in its step drafts by the cost rule
            draft = rows[i].drafting.propose(outputs[i][: at[i]], fit, alone) if fit > 0 and rule != "plain" else []
            drafts.append(draft)
        hits = [_matching(d, outputs[i][at[i] :]) for d, i in zip(drafts, live)]  # right drafts, in order
        widest = 1 + max(len(d) for d in drafts)
        if rule == "plain" or widest == 1:
            width = 1
        elif rule == "loop":
            width = _best_width([rows[i] for i in live], drafts, widest) if len(live) > 1 else widest
        else:
            width = max(
                range(1, widest + 1),
                key=lambda w: sum(1 + min(h, w - 1) for h in hits) / cost(len(live), w),
            )
        total += cost(len(live), width)
        for j, i in enumerate(live):
            a = min(hits[j], width - 1)
            if width > 1 and drafts[j]:
                rows[i].drafting.learn(min(len(drafts[j]), width - 1), a)
            at[i] += a + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--hf-dir", type=Path, default=Path.home() / ".cache/kvforge/smollm2/hf")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[128, 256])
    p.add_argument("--k", type=int, nargs="+", default=[2, 4, 6, 8, 12, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batch", type=int, default=1, help="> 1: also the first N grounded prompts as one batch")
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
        batch = args.batch if args.batch > 1 and engine.verify_together else 1
        if args.batch > 1 and batch == 1:
            print("--batch: this artifact verifies one row per call (gqa); no batch replay")
        table = measure_widths(engine, context, args.rounds, rows=min(batch, engine.max_batch))
    cost = interpolate({w: c for (n, w), c in table.items() if n == 1})
    print(f"{os.path.basename(os.path.normpath(args.artifact))}: {args.threads} threads, load {load:.1f}")
    for n in sorted({n for n, _ in table}):
        print(
            f"verify call cost (steps), {n} row(s) x width "
            + ", ".join(f"{w}: {c:.2f}" for (m, w), c in table.items() if m == n)
        )
    rows, batches = [], []
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
    if batch > 1:
        group = [p_ for p_ in prompts if p_["kind"] == "grounded"][:batch]
        costs = row_costs(table)
        print(f"\n{len(group)} grounded prompts in one batch: expected speed-up over plain decoding (decode only)")
        print("new   k   the loop's width rule   oracle width")
        for n in args.new_tokens:
            outs = [p_["output"][:n] for p_ in group]
            plain = replay_batch([p_["ids"] for p_ in group], outs, 1, costs, "plain")
            for k in args.k:
                got = {
                    r: plain / replay_batch([p_["ids"] for p_ in group], outs, k, costs, r) for r in ("loop", "oracle")
                }
                batches.append(dict(new_tokens=n, k=k, **got))
                print(f"{n:<6d}{k:<4d}{got['loop']:14.2f}{got['oracle']:17.2f}")
    if args.json:
        width_cost = {f"{n}x{w}": c for (n, w), c in table.items()}
        args.json.write_text(
            json.dumps(
                dict(artifact=args.artifact, load=load, width_cost=width_cost, rows=rows, batch=batches), indent=1
            )
        )


if __name__ == "__main__":
    main()
