"""One server process vs Ray Serve with N replicas, under the same Poisson load, in one run.

Compiles the bundled kvforge-tiny (or ``--model``, or serves ``--artifact``), then for each mode
starts ``kvforge serve`` as a subprocess, warms it up, replays the same request stream with
``kvforge loadtest``'s engine (streamed completions, Poisson arrivals at ``--rate``), and stops it
with SIGTERM (the graceful drain). Reported per mode: completed, lost (no complete answer), 5xx,
throughput (requests/s, output tokens/s), TTFT p50/p99, TPOT p50, goodput (requests/s meeting
both SLOs), and the load average.

Pick ``--rate`` above what one process sustains (run ``kvforge loadtest URL --rate inf`` against
one process to see its throughput), so the replicas have something to add. On a 2-core machine
the scaling is bounded by the cores: one process already runs ORT on every core, two replicas
split them (``--replica-cpus``, one ORT thread per CPU each) and pay Ray's proxy hop; the gain is
the second scheduler batching independently, not more arithmetic.

    python benchmarks/serve_scale.py --requests 8 --rate 4               # smoke test (~1-2 min)
    python benchmarks/serve_scale.py --requests 400 --rate 40 --json scale.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from kvforge.tools.loadtest import LoadOptions, run_loadtest


def _common():
    spec = importlib.util.spec_from_file_location("serve_common", Path(__file__).with_name("serve_common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_mode(common, art: Path, name: str, extra: list[str], replicas: int, options: LoadOptions) -> dict:
    print(f"[{name}] starting: kvforge serve {' '.join(extra)}", file=sys.stderr, flush=True)
    server = common.Server(art, extra, "bench", ready_replicas=replicas)
    try:
        warm = LoadOptions(**{**options.__dict__, "requests": 4, "rate": float("inf"), "seed": 99})
        run_loadtest(server.url, warm)
        load_before = common.load_average()
        result = run_loadtest(server.url, options)
        summary = result["summary"]
        summary["load_average_before"], summary["load_average_after"] = load_before, common.load_average()
        summary["replicas_seen"] = replicas
    finally:
        summary_rc = server.stop()
    summary["exit_status"] = summary_rc
    summary["five_xx"] = sum(v for k, v in summary["errors"].items() if k.startswith("5"))
    print(f"[{name}] done: {summary['completed']}/{summary['requests']} answered", file=sys.stderr, flush=True)
    return summary


def format_table(rows: dict[str, dict]) -> str:
    head = f"{'mode':<22}{'done':>6}{'lost':>6}{'5xx':>5}{'req/s':>8}{'tok/s':>9}"
    head += f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'goodput':>9}"
    lines = [head, "-" * len(head)]

    def ms(v):
        return f"{v:10.1f}" if v is not None else f"{'-':>10}"

    for name, s in rows.items():
        lines.append(
            f"{name:<22}{s['completed']:>6}{s['failed']:>6}{s['five_xx']:>5}{s['throughput_rps']:>8.2f}"
            f"{s['output_tokens_per_s']:>9.1f}{ms(s['ttft_ms']['p50'])}{ms(s['ttft_ms']['p99'])}"
            f"{ms(s['tpot_ms']['p50'])}{s['goodput_rps']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", default=None, help="serve this artifact (default: compile --model)")
    p.add_argument("--model", default=None, help="HF model dir to compile (default: the bundled kvforge-tiny)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-seq", type=int, default=512)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=None, help="default: the cores / replicas")
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second (default 20)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prompt-lens", default="16,32,64", help="words")
    p.add_argument("--output-lens", default="16,32,64", help="max_tokens")
    p.add_argument("--slo-ttft", type=float, default=1000.0, metavar="MS")
    p.add_argument("--slo-tpot", type=float, default=100.0, metavar="MS")
    p.add_argument("--max-queue", type=int, default=256, help="per server/replica (default 256: nothing refused)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    common = _common()
    cores = os.cpu_count() or 1
    replica_cpus = args.replica_cpus or max(0.5, cores / args.replicas)
    options = LoadOptions(
        rate=args.rate,
        requests=args.requests,
        prompt_lens=tuple(int(x) for x in args.prompt_lens.split(",")),
        output_lens=tuple(int(x) for x in args.output_lens.split(",")),
        slo_ttft_ms=args.slo_ttft,
        slo_tpot_ms=args.slo_tpot,
        timeout_s=600.0,
    )
    queue = ["--max-queue", str(args.max_queue)]
    rows: dict[str, dict] = {}
    with common.artifact(args.artifact, args.model, args.max_batch, args.max_seq) as art:
        rows["one process"] = run_mode(common, art, "one process", queue, 1, options)
        ray = ["--ray", "--replicas", str(args.replicas), "--num-cpus", str(cores)]
        ray += ["--replica-cpus", str(replica_cpus), *queue]
        rows[f"ray serve x{args.replicas}"] = run_mode(common, art, "ray", ray, args.replicas, options)
    print(
        f"{args.requests} requests, Poisson {args.rate}/s, prompts {args.prompt_lens} words, outputs "
        f"{args.output_lens} tokens, SLO TTFT <= {args.slo_ttft:g} ms and TPOT <= {args.slo_tpot:g} ms, "
        f"{cores} cores, {replica_cpus:g} CPU(s) per replica"
    )
    print(format_table(rows))
    for name, s in rows.items():
        print(f"  {name}: load average {s['load_average_before']} -> {s['load_average_after']}")
        for status, message in s["error_examples"].items():
            print(f"    {s['errors'][status]} x {status}: {message}")
    if args.json:
        Path(args.json).write_text(json.dumps({"options": vars(args), "modes": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(s["failed"] == 0 for s in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
