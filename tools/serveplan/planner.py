"""``kvforge plan --serve OUT``: which server layout gives the most goodput on N cores?

Input: a :class:`~kvforge.tools.serveplan.latency.LatencyTable` (measured on the artifact or read
from bench reports), a workload (Poisson rate, prompt and output lengths, the long-prompt mix) and
the objectives (TTFT and TPOT SLOs). Output: a plan dict (JSON with ``--json``; printed as a table):
for the colocated server on N threads and every split of N cores into P prefill and D decode
workers of T threads each (``(P + D) · T = N``), the simulated TTFT/TPOT percentiles, SLO
attainment, goodput at the given rate, and capacity (the highest rate at which at least
``attainment`` of the requests meet both SLOs, DistServe's per-configuration goodput); a
recommendation; and the same comparison for larger machines (``scale``).

Recommendation: the layout with the most goodput at the given rate among those whose attainment
reaches the target; none when no layout reaches it (then the report says so and the command exits
with status 1).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvforge.tools.serveplan.latency import LatencyTable
from kvforge.tools.serveplan.simulate import Layout, poisson_requests, simulate, summarize

SCHEMA = "kvforge.serve_plan"


@dataclass(frozen=True)
class Workload:
    rate: float  # mean arrivals per second (Poisson)
    prompt_lens: tuple[int, ...]  # tokens, drawn
    output_lens: tuple[int, ...]  # tokens, drawn
    requests: int = 1000
    long_fraction: float = 0.0
    long_lens: tuple[int, ...] = (1000, 1500)
    seed: int = 0

    def check(self, max_seq: int) -> None:
        if not 0 < self.rate < math.inf:
            raise ValueError(f"--rate must be a positive number of requests per second, got {self.rate}")
        if self.requests < 1:
            raise ValueError(f"--requests must be at least 1, got {self.requests}")
        lens = [*self.prompt_lens, *(self.long_lens if self.long_fraction > 0 else ())]
        if not self.prompt_lens or not self.output_lens or min([*lens, *self.output_lens]) < 1:
            raise ValueError("--prompt-lens, --output-lens and --long-lens must be positive integers (tokens)")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")
        longest = max(lens) + max(self.output_lens)
        if longest > max_seq:
            raise ValueError(
                f"a prompt of {max(lens)} tokens with {max(self.output_lens)} output tokens needs {longest} cache "
                f"positions; this artifact was compiled with max_seq={max_seq} (recompile with --max-seq {longest} "
                "or more, or plan shorter requests)"
            )

    def draw(self, rate: float | None = None, requests: int | None = None):
        return poisson_requests(
            self.rate if rate is None else rate,
            self.requests if requests is None else requests,
            self.prompt_lens,
            self.output_lens,
            self.seed,
            self.long_fraction,
            self.long_lens,
        )


@dataclass(frozen=True)
class Objectives:
    slo_ttft_ms: float
    slo_tpot_ms: float
    attainment: float = 0.9  # share of requests that must meet both SLOs

    def check(self) -> None:
        for flag, value in (("--slo-ttft", self.slo_ttft_ms), ("--slo-tpot", self.slo_tpot_ms)):
            if not 0 < value < math.inf:
                raise ValueError(f"{flag} must be a positive number of milliseconds, got {value}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")


def layouts(cores: int, coarse: bool = False) -> list[Layout]:
    """Colocated on ``cores`` threads, then every P:D split with ``(P + D) · T = cores``. ``coarse``
    (the larger machines): T a power of two, and at most 7 values of P, evenly spread."""
    if cores < 1:
        raise ValueError(f"--cores must be at least 1, got {cores}")
    out = [Layout("colocated", cores)]
    for threads in range(1, cores + 1):
        if cores % threads or (coarse and threads & (threads - 1)):
            continue
        workers = cores // threads
        prefill = range(1, workers)
        if coarse and workers > 8:
            prefill = sorted({max(1, min(workers - 1, round(workers * k / 8))) for k in range(1, 8)})
        out += [Layout("disaggregated", threads, p, workers - p) for p in prefill]
    return out


def evaluate(table: LatencyTable, layout: Layout, workload: Workload, slo: Objectives, requests=None) -> dict:
    outcomes = simulate(
        requests if requests is not None else workload.draw(),
        layout,
        table.at(layout.threads),
        table.rows,
        table.chunk,
        table.kv_bytes_per_token,
        table.copy_bytes_per_s,
    )
    return summarize(outcomes, slo.slo_ttft_ms, slo.slo_tpot_ms)


def capacity(
    table: LatencyTable,
    layout: Layout,
    workload: Workload,
    slo: Objectives,
    requests: int = 300,
    steps: int = 8,
    start: float | None = None,
) -> float:
    """The highest Poisson rate (req/s, within a factor ``1 + 2^-steps``) at which at least
    ``slo.attainment`` of ``requests`` requests meet both SLOs; 0 when even ``start / 1024`` does not.
    Doubles or halves from ``start`` (default: the workload's rate) to a bracket ``[r, 2r]``, then bisects."""

    def meets(rate: float) -> bool:
        count = max(requests, min(int(rate * 60), 4 * requests))  # at least a minute of arrivals where affordable
        return evaluate(table, layout, workload, slo, workload.draw(rate, count))["attainment"] >= slo.attainment

    first = max(start or workload.rate, 1e-3)
    lo = first
    if meets(lo):
        while lo < 1e4 and meets(lo * 2):
            lo *= 2
    else:
        while not meets(lo / 2):
            lo /= 2
            if lo < first / 1024:
                return 0.0
        lo /= 2
    hi = lo * 2
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def plan_serving(
    table: LatencyTable, workload: Workload, slo: Objectives, cores: int, scale: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Every layout of ``cores`` at the workload's rate, a recommendation, and for each core count
    in ``scale`` the capacity of the colocated server and of the best split."""
    workload.check(table.max_seq)
    slo.check()
    requests = workload.draw()
    rows = []
    for layout in layouts(cores):
        row = {"layout": layout.name, **asdict(layout), "cores": layout.cores}
        row.update(evaluate(table, layout, workload, slo, requests))
        row["capacity_rps"] = capacity(table, layout, workload, slo)
        rows.append(row)
    eligible = [r for r in rows if r["attainment"] >= slo.attainment]
    best = max(eligible, key=lambda r: (r["goodput_rps"], r["capacity_rps"]), default=None)
    larger = [scaled_capacity(table, workload, slo, n) for n in scale]
    return {
        "kind": SCHEMA,
        "schema_version": 1,
        "workload": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(workload).items()},
        "objectives": asdict(slo),
        "cores": cores,
        "latency": table.to_dict(),
        "configurations": rows,
        "recommended": best["layout"] if best else None,
        "larger_machines": larger,
    }


def scaled_capacity(table: LatencyTable, workload: Workload, slo: Objectives, cores: int) -> dict[str, Any]:
    """Capacity of the colocated server and of the best P:D split on ``cores`` cores."""
    guess = workload.rate * cores
    found = [
        (capacity(table, lay, workload, slo, requests=150, steps=5, start=guess), lay) for lay in layouts(cores, True)
    ]
    colocated = found[0]
    split = max(found[1:], key=lambda f: f[0], default=(0.0, None))
    return {
        "cores": cores,
        "colocated_capacity_rps": colocated[0],
        "best_split": split[1].name if split[1] else None,
        "best_split_capacity_rps": split[0],
    }


def format_plan(plan: dict[str, Any]) -> str:
    w, o = plan["workload"], plan["objectives"]
    lat = plan["latency"]
    sources = ", ".join(f"{m['threads']} thr: {m['source']}" for m in lat["models"])
    mix = (
        f", {w['long_fraction']:.0%} long prompts of {','.join(map(str, w['long_lens']))} tokens"
        if w["long_fraction"]
        else ""
    )
    lines = [
        f"kvforge plan --serve: {plan['cores']} cores, Poisson {w['rate']:g} req/s, prompts "
        f"{','.join(map(str, w['prompt_lens']))} tokens{mix}, outputs {','.join(map(str, w['output_lens']))} tokens; "
        f"{w['requests']} simulated requests (seed {w['seed']})",
        f"  SLOs: TTFT <= {o['slo_ttft_ms']:g} ms, TPOT <= {o['slo_tpot_ms']:g} ms; capacity = highest rate with "
        f">= {o['attainment']:.0%} of requests meeting both",
        f"  latency model ({sources}); hand-off "
        f"{lat['kv_bytes_per_token'] / 1024:.1f} KiB/token at {lat['copy_bytes_per_s'] / 1e9:.2f} GB/s per side; "
        f"{lat['rows']} rows, prefill chunk {lat['chunk']} per engine",
        "",
        f"  {'layout':<26}{'TTFT p50':>9}{'p99':>9}{'TPOT p50':>9}{'p99':>8}{'attain':>8}{'goodput':>9}"
        f"{'capacity':>10}",
    ]
    for r in plan["configurations"]:
        t, p = r["ttft_ms"], r["tpot_ms"]

        def ms(value, width):
            return f"{value:{width}.0f}" if value is not None else f"{'-':>{width}}"

        lines.append(
            f"  {r['layout']:<26}{ms(t['p50'], 9)}{ms(t['p99'], 9)}{ms(p['p50'], 9)}{ms(p['p99'], 8)}"
            f"{r['attainment']:8.0%}{r['goodput_rps']:9.3f}{r['capacity_rps']:10.3f}"
        )
    lines.append("  (ms; goodput and capacity in req/s)")
    if plan["recommended"]:
        lines.append(f"recommended: {plan['recommended']}")
    else:
        lines.append(
            f"recommended: none: no layout has {o['attainment']:.0%} of requests meeting both SLOs at "
            f"{w['rate']:g} req/s (lower the rate, relax the SLOs, or add cores)"
        )
    if plan["larger_machines"]:
        lines += ["", f"larger machines ({lat['scaling']}; the same rows and chunk per engine):"]
        for m in plan["larger_machines"]:
            lines.append(
                f"  {m['cores']:3d} cores: colocated capacity {m['colocated_capacity_rps']:.3f} req/s, best split "
                f"{m['best_split']} {m['best_split_capacity_rps']:.3f} req/s"
            )
    lines.append(
        "not modelled: the HTTP front end's CPU time, memory-bandwidth contention between workers, pipe latency"
    )
    return "\n".join(lines)
