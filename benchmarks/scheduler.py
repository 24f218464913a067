"""In-flight batching vs sequential generate: one Poisson request stream, both ways, in one run.

Builds a random Llama of a named shape (peer_genai.py's builder, in a subprocess; nothing is
downloaded), compiles it with ``max_batch`` rows, loads ONE engine, and replays the same requests
(random prompt and output lengths, Poisson arrivals) twice on it:

* sequential: one ``Engine.generate([prompt])`` per request, in arrival order, each starting when
  its request has arrived and the previous one is done (a server without batching);
* scheduler: a client thread submits each request to ``Engine.scheduler()`` at its arrival time.

Both are greedy and never stop at eos (the engine's eos set is emptied), so every request
generates exactly its drawn output length, and the tokens of each request must be identical both
ways (checked). Reported per mode: throughput (output tokens / (last finish - first arrival)),
TTFT p50/p99 (arrival -> first token, queueing included), time per output token (decode time /
(tokens - 1), mean and p50), and the load average before and after.

    python benchmarks/scheduler.py --shape tiny                 # ~1 minute, a smoke test of the figure
    python benchmarks/scheduler.py --shape smollm --json sched.json

Setup and options: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def _peer():
    """benchmarks/peer_genai.py (model builder, compile worker, load average), loaded by path."""
    spec = importlib.util.spec_from_file_location("peer_genai", Path(__file__).with_name("peer_genai.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Workload:
    max_batch: int
    requests: int
    rate: float  # requests per second (Poisson arrivals)
    prompt_len: tuple[int, int]  # uniform, inclusive
    new_tokens: tuple[int, int]  # uniform, inclusive

    @property
    def max_seq(self) -> int:
        return self.prompt_len[1] + self.new_tokens[1]


WORKLOADS = {
    "smollm": Workload(max_batch=8, requests=48, rate=6.0, prompt_len=(16, 192), new_tokens=(16, 128)),
    "tiny": Workload(max_batch=8, requests=32, rate=200.0, prompt_len=(4, 48), new_tokens=(4, 40)),
}


def tiny_shape(peer):
    return peer.Shape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=384, vocab=2048, tied=False)


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds after the start of the replay
    prompt: list[int]
    new_tokens: int


def make_requests(w: Workload, vocab: int, seed: int) -> list[Request]:
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / w.rate, w.requests)
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at 0
    out = []
    for t in arrivals:
        n = int(rng.integers(w.prompt_len[0], w.prompt_len[1] + 1))
        m = int(rng.integers(w.new_tokens[0], w.new_tokens[1] + 1))
        out.append(Request(float(t), rng.integers(2, vocab, n).tolist(), m))
    return out


def _wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_sequential(engine, requests: list[Request]) -> list[dict[str, Any]]:
    start = time.perf_counter()
    rows = []
    for r in requests:
        _wait_until(start + r.arrival)
        [result] = engine.generate([r.prompt], max_new_tokens=r.new_tokens)
        rows.append(_row(result, start + r.arrival))
    return rows


def run_scheduler(engine, requests: list[Request], prefill_chunk: int | None) -> list[dict[str, Any]]:
    handles: list[tuple[Any, float]] = []
    with engine.scheduler(prefill_chunk=prefill_chunk) as sched:
        start = time.perf_counter()

        def client() -> None:
            for r in requests:
                _wait_until(start + r.arrival)
                handles.append((sched.submit(r.prompt, max_new_tokens=r.new_tokens), start + r.arrival))

        thread = threading.Thread(target=client)
        thread.start()
        thread.join()
        return [_row(h.result(), arrival) for h, arrival in handles]


def _row(result, arrival: float) -> dict[str, Any]:
    t = result.timing
    n = len(result.token_ids)
    return {
        "tokens": result.token_ids,
        "arrival": arrival,
        "ttft_s": t.first_token - arrival,
        "queue_s": t.admitted - arrival,
        "tpot_s": t.decode_s / (n - 1) if n > 1 else None,
        "finished": t.finished,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    import numpy as np

    tokens = sum(len(r["tokens"]) for r in rows)
    span = max(r["finished"] for r in rows) - min(r["arrival"] for r in rows)
    ttft = np.array([r["ttft_s"] for r in rows])
    tpot = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    return {
        "output_tokens": tokens,
        "wall_s": span,
        "throughput_tok_s": tokens / span,
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
        "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
        "tpot_mean_ms": 1e3 * statistics.fmean(tpot),
        "tpot_p50_ms": 1e3 * statistics.median(tpot),
        "queue_p50_ms": 1e3 * statistics.median(r["queue_s"] for r in rows),
    }


def ensure_artifact(peer, args, shape, w: Workload, work: Path) -> Path:
    model_dir = work / f"model-{args.shape}"
    if not (model_dir / "tokenizer.json").exists() or args.rebuild:
        peer.say(f"building the random {args.shape} Llama in {model_dir}")
        peer.run_worker(sys.executable, "build-model", {"shape": asdict(shape), "model_dir": str(model_dir)}, work)
    tag = f"{args.shape}-b{w.max_batch}-s{w.max_seq}-{peer.source_hash('kvforge.compile', 'kvforge.graphs')}"
    out = work / f"kvforge-sched-{tag}"
    if not (out / "manifest.json").exists() or args.rebuild:
        peer.say(f"compiling {out}")
        job = {"model_dir": str(model_dir), "out": str(out), "batch": w.max_batch, "max_seq": w.max_seq}
        peer.run_worker(sys.executable, "compile-kvforge", {**job, "lowering": "gqa", "quantize": None}, work)
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"shape {report['shape']}: {report['workload']['requests']} requests, Poisson {report['workload']['rate']}/s, "
        f"prompts {report['workload']['prompt_len']}, outputs {report['workload']['new_tokens']}, "
        f"max_batch {report['workload']['max_batch']}, threads {report['threads'] or 'all cores'}",
        f"{'mode':<11} {'tok/s':>8} {'wall s':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT mean':>10} {'TPOT p50':>9}",
    ]
    for mode in ("sequential", "scheduler"):
        s = report[mode]
        lines.append(
            f"{mode:<11} {s['throughput_tok_s']:>8.1f} {s['wall_s']:>8.2f} {s['ttft_p50_ms']:>8.1f}ms "
            f"{s['ttft_p99_ms']:>8.1f}ms {s['tpot_mean_ms']:>8.2f}ms {s['tpot_p50_ms']:>7.2f}ms"
        )
    lines.append(
        f"scheduler / sequential throughput: {report['speedup']:.2f}x; greedy tokens identical for "
        f"{report['identical']}/{report['workload']['requests']} requests"
    )
    lines.append(f"load average before {report['loadavg_before']}, after {report['loadavg_after']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(WORKLOADS), default="tiny")
    p.add_argument("--requests", type=int, default=None, help="default: 48 smollm, 32 tiny")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: 6 smollm, 200 tiny)")
    p.add_argument("--max-batch", type=int, default=None, help="cache rows (default 8)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="scheduler's prefill chunk (default: max_prompt)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request stream")
    p.add_argument("--work-dir", default=None, help="default $TMPDIR/kvforge-peer (shared with peer_genai.py)")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    peer = _peer()
    base = WORKLOADS[args.shape]
    w = Workload(
        max_batch=args.max_batch or base.max_batch,
        requests=args.requests or base.requests,
        rate=args.rate or base.rate,
        prompt_len=base.prompt_len,
        new_tokens=base.new_tokens,
    )
    shape = peer.SHAPES["smollm"] if args.shape == "smollm" else tiny_shape(peer)
    work = Path(args.work_dir or Path(tempfile.gettempdir()) / "kvforge-peer")
    work.mkdir(parents=True, exist_ok=True)
    artifact = ensure_artifact(peer, args, shape, w, work)

    from kvforge.runtime import Engine

    requests = make_requests(w, shape.vocab, args.seed)
    report: dict[str, Any] = {"shape": args.shape, "workload": asdict(w), "threads": args.threads}
    report["loadavg_before"] = peer.loadavg()
    with Engine.load(artifact, threads=args.threads) as engine:
        engine.eos_token_ids = frozenset()  # every request generates exactly its drawn length
        engine.generate([requests[0].prompt], max_new_tokens=4)  # warm-up: first-run allocations
        peer.say("sequential generate")
        sequential = run_sequential(engine, requests)
        peer.say("scheduler")
        scheduled = run_scheduler(engine, requests, args.prefill_chunk)
    report["loadavg_after"] = peer.loadavg()
    report["sequential"], report["scheduler"] = summarize(sequential), summarize(scheduled)
    report["speedup"] = report["scheduler"]["throughput_tok_s"] / report["sequential"]["throughput_tok_s"]
    report["identical"] = sum(a["tokens"] == b["tokens"] for a, b in zip(sequential, scheduled))
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "requests": [asdict(r) for r in requests]}, indent=2))
        print(f"wrote {args.json}")
    return 0 if report["identical"] == w.requests else 1


if __name__ == "__main__":
    sys.exit(main())
