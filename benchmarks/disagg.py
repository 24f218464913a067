"""Issue 25's "Measure": colocated vs 1 prefill + 1 decode worker on the same cores, and the
planner's prediction of each next to the measurement.

One run, one machine, the same total cores (2):

1. the planner's latency model is measured on the artifact at 1 and 2 threads
   (:func:`kvforge.tools.serveplan.latency.measure`), the machine's memcpy bandwidth and a
   hand-off side's speed as the planner models it;
2. the mixed workload (short chats among long prompts of ``--long-lens`` words, Poisson arrivals,
   ``kvforge loadtest``'s plan) is tokenized with the artifact's tokenizer, so the planner
   simulates exactly the requests the load test sends, in tokens;
3. for each round, alternating: ``kvforge serve OUT --threads 2`` (colocated), then
   ``kvforge serve OUT --prefill-workers 1 --decode-workers 1 --threads-per-worker 1`` (skipped, and
   said so, where this checkout's serve has no ``--prefill-workers``), each warmed up and then
   loaded with the same requests; the hand-off figures of the disaggregated server come from its
   ``/metrics`` (count, bytes, export and import seconds): ms and GB/s per hand-off, against
   memcpy and against the prefill of the same tokens it saves;
4. the report: per layout, measured and predicted TTFT p50/p99, TPOT p50/p99, SLO attainment and
   goodput, predicted / measured goodput, the load average before and after each run; then the
   planner's capacity of the colocated server and of the best split on ``--scale`` cores, with
   the thread scaling as measured here, as a plausible quiet machine (1.8x prefill, 1.6x decode
   per doubling) and ideal (2x).

    python benchmarks/disagg.py --artifact /work/tmp-x/out --quick          # ~5 min on 2 cores
    python benchmarks/disagg.py --artifact OUT --json disagg.json           # the full run (~15-20 min)

The artifact needs ``max_seq`` >= the longest prompt + output (``kvforge compile MODEL -o OUT
--max-seq 2048``); ``--model DIR`` compiles one into a temporary directory instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvforge.tools.loadtest import LoadOptions, plan, run_loadtest
from kvforge.tools.serveplan import latency, planner
from kvforge.tools.serveplan.simulate import Layout, Request


def _common():
    spec = importlib.util.spec_from_file_location("serve_common", Path(__file__).with_name("serve_common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def has_disaggregated_serve() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "kvforge.tools.cli", "serve", "--help"], capture_output=True, text=True
    ).stdout
    return "--prefill-workers" in out


MODES = {
    "colocated": (["--threads", "2"], Layout("colocated", 2)),
    "1P:1D": (
        ["--prefill-workers", "1", "--decode-workers", "1", "--threads-per-worker", "1"],
        Layout("disaggregated", 1, 1, 1),
    ),
}


class Server:
    """``kvforge serve`` as a subprocess (serve_common.Server's start and stop), ready when
    ``/v1/models`` answers (the disaggregated front end answers once its workers are up)."""

    def __init__(self, common, artifact: Path, extra: list[str]) -> None:
        self.common = common
        self.port = common.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvforge.tools.cli", "serve", str(artifact), "--port", str(self.port)]
        cmd += ["--served-model-name", "bench", "--log-level", "warning", *extra]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvforge-disagg-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"the server did not come up:\n{self.log.read()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            time.sleep(0.3)

    def stop(self) -> int | None:
        return self.common.Server.stop(self)  # SIGTERM, then the session killed


def handoff_metrics(url: str) -> dict[str, float]:
    """The ``/metrics`` counters, histogram sums and counts whose name contains ``handoff``
    (summed over labels): ``kvforge_handoffs_total``, ``kvforge_handoff_bytes_total``,
    ``kvforge_handoff_export_seconds_sum`` (the prefill worker's export), ``kvforge_handoff_seconds_sum``
    (from the hand-off to the decode worker's resume: the pipe, any wait for a row, the import)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "handoff" not in line:
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        if name.endswith(("_total", "_sum", "_count")):
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
    return out


def handoff_figures(metrics: dict[str, float], memcpy_bytes_per_s: float, prefill_s: float) -> dict:
    """Per hand-off: bytes, ms of the export and from the hand-off to the resume (which includes
    waiting for a decode row: an upper bound on the import), GB/s over both, that against a
    plain memcpy of the same bytes, and against the prefill it saves (the decode side would
    otherwise prefill the prompt again: ``bytes / kv_bytes_per_token`` tokens)."""
    count = metrics.get("kvforge_handoffs_total") or 0
    if not count:
        return {}
    nbytes = metrics.get("kvforge_handoff_bytes_total", 0.0) / count
    export = metrics.get("kvforge_handoff_export_seconds_sum", 0.0) / count
    other = metrics.get("kvforge_handoff_seconds_sum", 0.0) / count
    seconds = export + other
    return {
        "count": int(count),
        "mb_per_handoff": nbytes / 1e6,
        "export_ms": export * 1e3,
        "to_resume_ms": other * 1e3,
        "gb_per_s": nbytes / seconds / 1e9 if seconds else None,
        "share_of_memcpy": (nbytes / seconds) / memcpy_bytes_per_s if seconds else None,
        "prefill_saved_ms": prefill_s * 1e3,
    }


def requests_in_tokens(artifact: Path, options: LoadOptions) -> list[Request]:
    """The load test's requests (same seed and options), prompts counted by the artifact's tokenizer."""
    from kvforge.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(artifact / "tokenizer.json")
    return [Request(i["arrival_s"], len(tokenizer.encode(i["prompt"])), i["max_tokens"]) for i in plan(options)]


def run_mode(common, artifact: Path, name: str, options: LoadOptions) -> dict:
    extra, _ = MODES[name]
    print(f"[{name}] kvforge serve {' '.join(extra)}", file=sys.stderr, flush=True)
    server = Server(common, artifact, extra)
    try:
        warm = LoadOptions(**{**options.__dict__, "requests": 2, "rate": float("inf"), "seed": 99, "long_fraction": 0})
        run_loadtest(server.url, warm)
        before = common.load_average()
        metrics_before = handoff_metrics(server.url) if name != "colocated" else {}
        result = run_loadtest(server.url, options)
        summary = result["summary"]
        summary["load_average_before"], summary["load_average_after"] = before, common.load_average()
        if name != "colocated":  # this run's hand-offs: the warm-up's taken out
            after = handoff_metrics(server.url)
            summary["handoff_metrics"] = {k: v - metrics_before.get(k, 0.0) for k, v in after.items()}
        done = [r for r in result["requests"] if r["ok"]]
        summary["mean_completion_tokens"] = sum(r["completion_tokens"] for r in done) / max(len(done), 1)
    finally:
        server.stop()
    print(f"[{name}] {summary['completed']}/{summary['requests']} answered", file=sys.stderr, flush=True)
    return summary


def _ms(p: dict, key: str) -> str:
    return f"{p[key]:8.0f}" if p.get(key) is not None else f"{'-':>8}"


def format_report(report: dict) -> str:
    o = report["options"]
    lines = [
        f"disaggregated vs colocated on {report['artifact']}: {o['requests']} requests, Poisson {o['rate']} req/s, "
        f"{o['long_fraction']:.0%} long prompts of {o['long_lens']} words among {o['prompt_lens']}, outputs "
        f"{o['output_lens']}; SLOs TTFT <= {o['slo_ttft_ms']:g} ms, TPOT <= {o['slo_tpot_ms']:g} ms",
        f"  memcpy {report['memcpy_gbps']:.2f} GB/s, a hand-off side as modelled (fresh copy + crc32) "
        f"{report['copy_gbps']:.2f} GB/s; KV {report['kv_bytes_per_token']} bytes/token; "
        f"planner's latency model measured in {report['measure_s']:.0f} s ({report['scaling']})",
        "",
        f"  {'layout':<12}{'':10}{'TTFT p50':>8}{'p99':>8}{'TPOT p50':>9}{'p99':>8}{'attain':>8}{'goodput':>9}"
        f"{'pred/meas':>10}  load before/after",
    ]
    for run in report["runs"]:
        for side in ("measured", "predicted"):
            s = run[side]
            lead = f"  {run['layout']:<12}" if side == "measured" else f"  {'':<12}"
            ratio = ""
            if side == "predicted" and run["measured"]["goodput_rps"]:
                ratio = f"{s['goodput_rps'] / run['measured']['goodput_rps']:10.2f}"
            load = f"  {s['load_average_before']} / {s['load_average_after']}" if side == "measured" else ""
            lines.append(
                f"{lead}{side:<10}{_ms(s['ttft_ms'], 'p50')}{_ms(s['ttft_ms'], 'p99')} {_ms(s['tpot_ms'], 'p50')}"
                f"{_ms(s['tpot_ms'], 'p99')}{s.get('attainment', s['meeting_slo'] / s['requests']):8.0%}"
                f"{s['goodput_rps']:9.4f}{ratio:>10}{load}"
            )
        h = run.get("handoff")
        if h:
            lines.append(
                f"  {'':<12}hand-off: {h['count']} of {h['mb_per_handoff']:.1f} MB on average, export "
                f"{h['export_ms']:.1f} ms + to resume {h['to_resume_ms']:.1f} ms = {h['gb_per_s']:.2f} GB/s "
                f"({h['share_of_memcpy']:.0%} of memcpy); the prefill of those tokens: {h['prefill_saved_ms']:.0f} ms "
                "(1 thread, modelled)"
            )
    for scale in report["larger_machines"]:
        lines.append(f"  larger machines, capacity at >= {scale['attainment']:.0%} attainment ({scale['scaling']}):")
        for m in scale["machines"]:
            lines.append(
                f"    {m['cores']:3d} cores: colocated {m['colocated_capacity_rps']:.3f} req/s, best split "
                f"{m['best_split']} {m['best_split_capacity_rps']:.3f} req/s"
            )
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", default=None, help="artifact to serve (max_seq >= 1600 for the default mix)")
    ap.add_argument("--model", default=None, help="compile this HF directory with --max-seq 2048 instead")
    ap.add_argument("--quick", action="store_true", help="fewer requests at a higher rate (a few minutes)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.1, help="Poisson arrivals per second")
    ap.add_argument("--prompt-lens", default="16,32", help="short chats' prompt words")
    ap.add_argument("--output-lens", default="32,64", help="max_tokens values")
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--long-lens", default="1000,1500", help="long prompts' words")
    ap.add_argument("--slo-ttft", type=float, default=15000.0, help="ms")
    ap.add_argument("--slo-tpot", type=float, default=250.0, help="ms")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two layouts this many times")
    ap.add_argument("--seed", type=int, default=1, help="seed 1: 25%% of the 40 default requests are long")
    ap.add_argument("--scale", default="8,16,32", help="cores of the larger machines to predict ('' for none)")
    ap.add_argument("--scale-attainment", type=float, default=0.8, help="share meeting both SLOs for capacity")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rate = min(args.requests, 16), max(args.rate, 0.2)
    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    options = LoadOptions(
        rate=args.rate,
        requests=args.requests,
        prompt_lens=ints(args.prompt_lens),
        output_lens=ints(args.output_lens),
        slo_ttft_ms=args.slo_ttft,
        slo_tpot_ms=args.slo_tpot,
        seed=args.seed,
        timeout_s=1200.0,
        long_fraction=args.long_fraction,
        long_lens=ints(args.long_lens),
    )
    options.check()
    common = _common()
    notes = []
    modes = ["colocated", "1P:1D"]
    if not has_disaggregated_serve():
        modes = ["colocated"]
        notes.append("this checkout's `kvforge serve` has no --prefill-workers: the 1P:1D run was skipped")
    with contextlib.ExitStack() as stack:
        if args.artifact:
            artifact = Path(args.artifact)
        else:
            if not args.model:
                ap.error("give --artifact OUT or --model HF_DIR")
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvforge-disagg-")))
            artifact = tmp / "out"
            cmd = [sys.executable, "-m", "kvforge.tools.cli", "compile", args.model, "-o", str(artifact), "-q"]
            subprocess.run([*cmd, "--max-seq", "2048"], check=True)
        print(f"measuring the latency model (1, 2 threads); load {common.load_average()}", file=sys.stderr)
        start = time.perf_counter()
        table = latency.measure(artifact, [1, 2], seed=args.seed)
        measure_s = time.perf_counter() - start
        requests = requests_in_tokens(artifact, options)
        longest = max(r.prompt + r.output for r in requests)
        if longest > table.max_seq:
            raise SystemExit(f"a request needs {longest} positions; the artifact's max_seq is {table.max_seq}")
        runs = []
        for _ in range(args.rounds):
            for name in modes:
                measured = run_mode(common, artifact, name, options)
                # the planner on exactly these requests; options carries the SLOs
                predicted = planner.evaluate(table, MODES[name][1], None, options, requests=requests)
                run = {"layout": name, "measured": measured, "predicted": predicted}
                if measured.get("handoff_metrics"):
                    metrics = measured["handoff_metrics"]
                    count = metrics.get("kvforge_handoffs_total") or 1
                    tokens = round(metrics.get("kvforge_handoff_bytes_total", 0.0) / count / table.kv_bytes_per_token)
                    prefill = table.at(1).prefill_s(1, max(tokens, 1))
                    run["handoff"] = handoff_figures(metrics, table.memcpy_bytes_per_s, prefill)
                runs.append(run)
    larger = []
    workload = planner.Workload(
        options.rate, options.prompt_lens, options.output_lens, options.requests, options.long_fraction,
        options.long_lens, options.seed,
    )  # fmt: skip
    slo = planner.Objectives(options.slo_ttft_ms, options.slo_tpot_ms, args.scale_attainment)
    for speedup in (None, (1.8, 1.6), (2.0, 2.0)):  # as measured here, a plausible quiet machine, ideal
        table.speedup = speedup
        machines = [planner.scaled_capacity(table, workload, slo, n) for n in ints(args.scale)] if args.scale else []
        larger.append({"scaling": table.assumption(), "attainment": slo.attainment, "machines": machines})
    table.speedup = None
    report = {
        "artifact": str(artifact),
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.__dict__.items() if k != "api_key"},
        "cpu_count": os.cpu_count(),
        "copy_gbps": table.copy_bytes_per_s / 1e9,
        "memcpy_gbps": table.memcpy_bytes_per_s / 1e9,
        "kv_bytes_per_token": table.kv_bytes_per_token,
        "measure_s": measure_s,
        "scaling": table.assumption(),
        "latency": table.to_dict(),
        "prompt_tokens": [r.prompt for r in requests],
        "runs": runs,
        "larger_machines": larger if args.scale else [],
        "notes": notes,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
