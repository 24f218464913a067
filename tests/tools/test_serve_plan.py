"""``kvforge plan --serve``'s simulator and planner on hand-computable cases (no artifact).

Proves: the simulator's queueing agrees with M/D/1 theory (Poisson arrivals, deterministic service,
one server: mean wait W = ρ / (2μ(1 - ρ))) within 5% over 40,000 requests, for the colocated server
and for a prefill worker alike; a two-request run gives, to the millisecond, the TTFT, TPOT,
attainment and goodput worked out by hand, for the colocated loop (rows shared, ragged group
prefill) and for 1 prefill + 1 decode worker (export and import copies on each side); the planner
recommends the split when long prompts stall the colocated decode steps, recommends colocated when
the split's single-thread prefill misses the TTFT objective (the split is listed, not recommended),
and recommends nothing when no layout meets the SLOs; the layouts of N cores; the latency fit
recovers known coefficients and extrapolates threads as its report says (measured, ideal with one
thread count, or the speed-ups given).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.tools.serveplan import latency, planner
from kvforge.tools.serveplan.latency import LatencyTable, PhaseModel
from kvforge.tools.serveplan.simulate import Layout, Request, constant_gaps, simulate, summarize

COLOCATED = Layout("colocated", 1)
SPLIT = Layout("disaggregated", 1, 1, 1)


def service(prefill_ms: float = 0.0, decode_ms: float = 0.0, threads: int = 1) -> PhaseModel:
    """Every prefill call takes ``prefill_ms``, every decode step ``decode_ms``, whatever the sizes."""
    return PhaseModel(threads, (prefill_ms, 0.0, 0.0), (decode_ms, 0.0, 0.0))


@pytest.mark.parametrize("layout", [COLOCATED, SPLIT], ids=["colocated", "prefill-worker"])
@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_mean_wait(layout, rho):
    s = 0.1  # seconds of service: one prefill call, and the request ends at its first token
    rate = rho / s
    requests = constant_gaps(rate, 40_000, prompt=8, output=1, seed=1)
    outcomes = simulate(requests, layout, service(prefill_ms=s * 1e3), rows=1, chunk=64)
    wait = np.mean([o.ttft_s for o in outcomes]) - s
    mu = 1 / s
    theory = rho / (2 * mu * (1 - rho))
    assert wait == pytest.approx(theory, rel=0.05)


def test_two_requests_by_hand_colocated():
    model = service(prefill_ms=100, decode_ms=50)
    requests = [Request(0.0, 4, 3), Request(0.0, 4, 3)]
    # One row: A is prefilled (first token at 0.10) and decodes at 0.15, 0.20 (done); B then the same from 0.20.
    a, b = simulate(requests, COLOCATED, model, rows=1, chunk=64)
    assert (a.first_s, a.done_s, b.first_s, b.done_s) == pytest.approx((0.10, 0.20, 0.30, 0.40))
    assert (a.tpot_s, b.tpot_s) == pytest.approx((0.05, 0.05))
    s = summarize([a, b], slo_ttft_ms=200, slo_tpot_ms=60)
    assert (s["meeting_slo"], s["attainment"]) == (1, 0.5)
    assert s["goodput_rps"] == pytest.approx(1 / 0.40)  # one good request over 0.4 s
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)  # the median of 100 and 300
    # Two rows: one ragged prefill of both (first tokens at 0.10), then two shared decode steps.
    a, b = simulate(requests, COLOCATED, model, rows=2, chunk=64)
    assert (a.first_s, a.done_s, b.first_s, b.done_s) == pytest.approx((0.10, 0.20, 0.10, 0.20))
    s = summarize([a, b], slo_ttft_ms=200, slo_tpot_ms=60)
    assert (s["attainment"], s["goodput_rps"]) == (1.0, pytest.approx(2 / 0.20))
    # A chunk of 4 tokens holds one prompt: B's prefill waits for the next step, after A's first decode.
    a, b = simulate(requests, COLOCATED, model, rows=2, chunk=4)
    assert (a.first_s, b.first_s, b.done_s) == pytest.approx((0.10, 0.25, 0.35))


def test_two_requests_by_hand_split():
    model = service(prefill_ms=100, decode_ms=40)
    requests = [Request(0.0, 4, 3), Request(0.0, 4, 3)]
    # A copy of 4 tokens x 750 bytes at 100 kB/s: 30 ms, on the exporting and on the importing side.
    a, b = simulate(requests, SPLIT, model, rows=4, chunk=4, kv_bytes_per_token=750, copy_bytes_per_s=1e5)
    # Prefill worker: A 0-0.10 (first token), export -> 0.13; B 0.13-0.23, export -> 0.26.
    # Decode worker: A import 0.13-0.16, tokens at 0.20, 0.24; B import 0.26-0.29, tokens at 0.33, 0.37.
    assert (a.first_s, a.done_s, b.first_s, b.done_s) == pytest.approx((0.10, 0.24, 0.23, 0.37))
    s = summarize([a, b], slo_ttft_ms=150, slo_tpot_ms=100)
    assert (s["meeting_slo"], s["goodput_rps"]) == (1, pytest.approx(1 / 0.37))
    assert s["tpot_ms"]["p50"] == pytest.approx(70.0)


def table(models: dict[int, PhaseModel], rows: int = 4, chunk: int = 2048) -> LatencyTable:
    return LatencyTable(models, kv_bytes_per_token=46080, copy_bytes_per_s=5e9, rows=rows, chunk=chunk, max_seq=2048)


# Prefill ~4 ms per token on one thread, 2.2 on two; a decode step ~45 ms (1 thread), ~30 (2).
MEASURED = {1: PhaseModel(1, (10.0, 4.0, 0.5), (45.0, 3.0, 5.0)), 2: PhaseModel(2, (8.0, 2.2, 0.3), (30.0, 3.0, 3.0))}
MIXED = planner.Workload(rate=0.2, prompt_lens=(16, 32), output_lens=(32, 64), requests=300, long_fraction=0.3)


def test_split_recommended_when_long_prompts_stall_decode():
    # A long prompt's prefill (2.5-3.6 s on two threads) stalls the colocated decode steps: TPOT fails.
    plan = planner.plan_serving(table(MEASURED), MIXED, planner.Objectives(60_000, 80), cores=2)
    rows = {r["layout"]: r for r in plan["configurations"]}
    assert list(rows) == ["colocated (2 threads)", "1P:1D (1 thread each)"]
    assert rows["colocated (2 threads)"]["attainment"] < 0.9 <= rows["1P:1D (1 thread each)"]["attainment"]
    assert rows["colocated (2 threads)"]["tpot_ms"]["p99"] > 2 * rows["1P:1D (1 thread each)"]["tpot_ms"]["p99"]
    assert plan["recommended"] == "1P:1D (1 thread each)"
    assert "recommended: 1P:1D (1 thread each)" in planner.format_plan(plan)


def test_split_that_misses_the_ttft_slo_is_not_recommended():
    # Short prompts only: nothing stalls decode, and one thread's prefill misses a tight TTFT objective.
    slow_one = {1: PhaseModel(1, (300.0, 4.0, 0.5), (45.0, 3.0, 5.0)), 2: MEASURED[2]}
    short = planner.Workload(rate=0.5, prompt_lens=(16, 32), output_lens=(24, 48), requests=300)
    plan = planner.plan_serving(table(slow_one), short, planner.Objectives(250, 200), cores=2)
    rows = {r["layout"]: r for r in plan["configurations"]}
    assert rows["1P:1D (1 thread each)"]["attainment"] == 0.0  # every TTFT > 300 ms
    assert rows["colocated (2 threads)"]["attainment"] >= 0.9
    assert plan["recommended"] == "colocated (2 threads)"


def test_nothing_recommended_when_no_layout_meets_the_slos():
    plan = planner.plan_serving(table(MEASURED), MIXED, planner.Objectives(50, 10), cores=2)
    assert plan["recommended"] is None
    assert all(r["attainment"] < 0.9 for r in plan["configurations"])
    assert "recommended: none: no layout has 90% of requests meeting both SLOs" in planner.format_plan(plan)


def test_layouts_of_n_cores():
    names = [lay.name for lay in planner.layouts(4)]
    assert names == [
        "colocated (4 threads)",
        "1P:3D (1 thread each)",
        "2P:2D (1 thread each)",
        "3P:1D (1 thread each)",
        "1P:1D (2 threads each)",
    ]
    assert all(lay.cores == 4 for lay in planner.layouts(4))
    assert [lay.name for lay in planner.layouts(1)] == ["colocated (1 threads)"]
    with pytest.raises(ValueError, match="--cores must be at least 1"):
        planner.layouts(0)


def test_fit_recovers_coefficients_and_threads_extrapolate():
    truth = PhaseModel(1, (12.0, 4.0, 0.5), (45.0, 3.0, 5.0))
    prefill = [
        (b, n, s, truth.prefill_s(b, n, s) * 1e3) for b, n, s in [(1, 16, 0), (4, 16, 0), (1, 512, 0), (1, 64, 64)]
    ]
    decode = [(b, c, truth.decode_s(b, c) * 1e3) for b, c in [(1, 16), (2, 600), (4, 64), (4, 2000)]]
    fitted = latency.fit(1, prefill, decode)
    assert fitted.prefill == pytest.approx(truth.prefill, rel=1e-6)
    assert fitted.decode == pytest.approx(truth.decode, rel=1e-6)
    t = table(MEASURED)
    speed_prefill, speed_decode, top = t.speedups()
    assert top == 2 and speed_decode == pytest.approx(MEASURED[1].decode_s(1, 256) / MEASURED[2].decode_s(1, 256))
    eight = t.at(8)  # two doublings beyond 2 threads
    assert eight.source == "extrapolated"
    assert eight.prefill_s(1, 256) == pytest.approx(MEASURED[2].prefill_s(1, 256) / speed_prefill**2)
    assert "each doubling of threads divides prefill times by" in t.assumption()
    single = table({1: MEASURED[1]})
    assert single.at(4).decode_s(1, 10) == pytest.approx(MEASURED[1].decode_s(1, 10) / 4)
    assert "scale ideally" in single.assumption()
    t.speedup = (1.5, 1.25)  # --thread-speedup: given instead of measured
    assert t.at(8).decode_s(1, 10) == pytest.approx(MEASURED[2].decode_s(1, 10) / 1.25**2)
    assert "by 1.50 and decode steps by 1.25 (given with --thread-speedup)" in t.assumption()
