"""Where a kvforge decode step goes: an ONNX Runtime profile of the step, per op type, next to the
node counts of onnxruntime-genai's graph of the same model.

For each ``--max-seq`` (default 192 and 512, compile's default), peer_genai.py's builders give (and
cache, in the same work dir) the random Llama of ``--shape``, kvforge's artifact of it (``gqa``,
``--precision`` (fp32 or int4), ``max_batch`` ``--batch`` (default 1), that ``max_seq``) and
genai's model of that precision. A worker subprocess then:

1. loads the artifact with ``Engine.load(threads=--threads)`` with ONNX Runtime's profiler switched on
   (``SessionOptions.enable_profiling``; the engine's own session options otherwise, so the graph
   run is the one a user runs: the ``.ort.onnx`` graph, decode steps on the prefill graph's session);
2. prefills one random prompt of ``--prompt-len`` tokens, runs ``--warmup`` decode steps, then
   ``--steps`` decode steps (``--batch`` rows, greedy), timing each from Python;
3. reads the profile: the ``model_run`` events of the last ``--steps`` runs are the decode steps, and
   every kernel event (``*_kernel_time``) inside one of them is charged to its op type;
4. loads the artifact again without the profiler and times the same steps (the profiler's cost).

Printed per op type: kvforge's node count in the graph that runs, kernels run per step, ms per step
and share of the kernel time; beside it the node count of genai's ``model.onnx`` of the same model.
Then per step: wall time from Python, ORT's ``model_run`` time, the kernels' sum, and the unprofiled
wall time. ``--json PATH`` writes it all.

    python benchmarks/profile_decode.py                      # smollm, max_seq 192 and 512, 2 threads
    python benchmarks/profile_decode.py --shape tiny4 --max-seq 192 --steps 8   # smoke test
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_genai as peer  # the builders and the work dir cache

# ---------------------------------------------------------------------------- worker (subprocess)


def _profiled_session_options(prefix: str):
    """A stand-in for ``onnxruntime.SessionOptions`` that switches the profiler on; the engine sets
    every other option itself."""
    import onnxruntime as ort

    original = ort.SessionOptions

    def make():
        options = original()
        options.enable_profiling = True
        options.profile_file_prefix = prefix
        return options

    return original, make


def _decode_steps(engine, prompts: list[list[int]], warmup: int, steps: int) -> list[float]:
    """Prefill ``prompts`` (one row each), ``warmup`` untimed decode steps, then ``steps`` timed ones
    (seconds each)."""
    import numpy as np

    next_ids = np.zeros(len(prompts), dtype=np.int64)
    np.argmax(engine.prefill(prompts), axis=-1, out=next_ids)
    for _ in range(warmup):
        np.argmax(engine.decode(next_ids), axis=-1, out=next_ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        np.argmax(engine.decode(next_ids), axis=-1, out=next_ids)
        times.append(time.perf_counter() - start)
    return times


def op_counts(graph_file: str | Path) -> dict[str, int]:
    """Nodes by op type of an ONNX graph (the weights are not loaded)."""
    import onnx

    graph = onnx.load(str(graph_file), load_external_data=False).graph
    return dict(collections.Counter(node.op_type for node in graph.node))


def per_op_profile(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Charge the kernel events of the last ``steps`` ``model_run`` events to their op types.

    Returns ``{"model_run_ms": [per step], "ops": {op: {"kernels": n, "us": total}}}``; ``kernels``
    and ``us`` are totals over the steps."""
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    runs.sort(key=lambda e: e["ts"])
    if len(runs) < steps:
        raise RuntimeError(f"the profile holds {len(runs)} model_run events, fewer than the {steps} decode steps")
    runs = runs[-steps:]
    starts = [r["ts"] for r in runs]
    ends = [r["ts"] + r["dur"] for r in runs]
    ops: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"kernels": 0, "us": 0.0})
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        ts = e["ts"]
        if ts < starts[0] or ts > ends[-1]:
            continue
        # inside one of the decode runs (they do not overlap; between runs there are no kernels)
        if not any(s <= ts <= t for s, t in zip(starts, ends)):
            continue
        op = e.get("args", {}).get("op_name", "?")
        ops[op]["kernels"] += 1
        ops[op]["us"] += e["dur"]
    return {"model_run_ms": [r["dur"] / 1e3 for r in runs], "ops": dict(ops)}


def profile_worker(job: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime as ort

    from kvforge.runtime import Engine

    prompt = peer.prompts(job["batch"], job["prompt_len"], job["vocab"])
    prefix = str(Path(job["profile_dir"]) / "kvforge-decode")
    original, make = _profiled_session_options(prefix)
    ort.SessionOptions = make
    try:
        engine = Engine.load(job["artifact"], threads=job["threads"])
    finally:
        ort.SessionOptions = original
    with engine:
        wall = _decode_steps(engine, prompt, job["warmup"], job["steps"])
        graph = engine.decode_graph
        graph_file = engine.backend.graph_files[graph]
        session = engine.backend.sessions[graph]
        profile_file = session.end_profiling()
    events = json.loads(Path(profile_file).read_text())
    profile = per_op_profile(events, job["steps"])
    with Engine.load(job["artifact"], threads=job["threads"]) as engine:
        plain = _decode_steps(engine, prompt, job["warmup"], job["steps"])
    return {
        "graph": graph,
        "graph_file": str(graph_file),
        "graph_op_counts": op_counts(graph_file),
        "profile_file": profile_file,
        "wall_ms": [1e3 * t for t in wall],
        "unprofiled_wall_ms": [1e3 * t for t in plain],
        **profile,
    }


def _genai_copy(source: Path, copy: Path, threads: int, profile_prefix: str | None) -> Path:
    """A directory of links to the cached genai model's files with its own genai_config.json: the
    thread count and, with ``profile_prefix``, ``enable_profiling`` (the cached config is left alone)."""
    copy.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name != "genai_config.json" and not (copy / f.name).exists():
            (copy / f.name).symlink_to(f)
    config = json.loads((source / "genai_config.json").read_text())
    options = config["model"]["decoder"]["session_options"]
    options["intra_op_num_threads"] = threads
    options.pop("enable_profiling", None)
    if profile_prefix:
        options["enable_profiling"] = profile_prefix
    (copy / "genai_config.json").write_text(json.dumps(config, indent=4))
    return copy


def _genai_steps(model_dir: Path, job: dict[str, Any]) -> list[float]:
    """genai: append the prompt, ``warmup`` untimed steps, ``steps`` timed ones (seconds each); the
    model is released before returning (its session ends, so a profile is written)."""
    import gc

    import numpy as np
    import onnxruntime_genai as og

    prompt = np.asarray(peer.prompts(job["batch"], job["prompt_len"], job["vocab"]), dtype=np.int32)
    total = job["prompt_len"] + 1 + job["warmup"] + job["steps"]
    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=job["batch"])
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    generator.generate_next_token()  # the first token: no model run
    for _ in range(job["warmup"]):
        generator.generate_next_token()
    wall = []
    for _ in range(job["steps"]):
        start = time.perf_counter()
        generator.generate_next_token()
        wall.append(time.perf_counter() - start)
    del generator, params, model
    gc.collect()
    return wall


def genai_profile_worker(job: dict[str, Any]) -> dict[str, Any]:
    """The same steps through onnxruntime-genai, its profiler on (``enable_profiling`` in a linked copy
    of the cached model's directory, same threads; ORT writes the profile when genai's session ends),
    then again without the profiler."""
    source, profile_dir = Path(job["genai_dir"]), Path(job["profile_dir"])
    prefix = str(profile_dir / "genai-decode")
    before = {f.name for f in profile_dir.glob("genai-decode*.json")}
    wall = _genai_steps(_genai_copy(source, profile_dir / "genai-model", job["threads"], prefix), job)
    plain = _genai_steps(_genai_copy(source, profile_dir / "genai-model-plain", job["threads"], None), job)
    written = [f for f in Path(job["profile_dir"]).glob("genai-decode*.json") if f.name not in before]
    if len(written) != 1:
        raise RuntimeError(f"expected one new genai profile in {job['profile_dir']}, found {written}")
    events = json.loads(written[0].read_text())
    return {
        "profile_file": str(written[0]),
        "wall_ms": [1e3 * t for t in wall],
        "unprofiled_wall_ms": [1e3 * t for t in plain],
        **per_op_profile(events, job["steps"]),
    }


def worker_main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    worker = genai_profile_worker if job.get("side") == "genai" else profile_worker
    Path(job["result_file"]).write_text(json.dumps(worker(job)))


# ---------------------------------------------------------------------------- parent


def run_profile(job: dict[str, Any], work: Path, tag: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        job = {**job, "result_file": str(Path(tmp) / "result.json")}
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--job", str(job_file)]
        peer.run_logged(cmd, work / f"profile-{tag}.log", "profile worker")
        return json.loads(Path(job["result_file"]).read_text())


def summarize(
    result: dict[str, Any], steps: int, genai_ops: dict[str, int], genai: dict[str, Any] | None
) -> dict[str, Any]:
    """Per op type: graph nodes, kernels per step, ms per step, share of the kernel time; genai's
    nodes (and, with ``genai``, its ms per step)."""
    kernel_us = sum(v["us"] for v in result["ops"].values())
    genai_prof = genai["ops"] if genai else {}
    rows = []
    for op in set(result["ops"]) | set(result["graph_op_counts"]) | set(genai_ops) | set(genai_prof):
        prof = result["ops"].get(op, {"kernels": 0, "us": 0.0})
        rows.append(
            {
                "op": op,
                "kvforge_nodes": result["graph_op_counts"].get(op, 0),
                "kernels_per_step": prof["kernels"] / steps,
                "ms_per_step": prof["us"] / 1e3 / steps,
                "share": prof["us"] / kernel_us if kernel_us else 0.0,
                "genai_nodes": genai_ops.get(op, 0),
                "genai_kernels_per_step": genai_prof.get(op, {"kernels": 0})["kernels"] / steps if genai else None,
                "genai_ms_per_step": genai_prof[op]["us"] / 1e3 / steps
                if op in genai_prof
                else (0.0 if genai else None),
            }
        )
    rows.sort(key=lambda r: (-r["ms_per_step"], -r["kvforge_nodes"], r["op"]))
    genai_summary = None
    if genai:
        genai_summary = {
            "wall_ms_step": statistics.mean(genai["wall_ms"]),
            "wall_ms_step_p50": statistics.median(genai["wall_ms"]),
            "model_run_ms_step": statistics.mean(genai["model_run_ms"]),
            "kernels_ms_step": sum(v["us"] for v in genai["ops"].values()) / 1e3 / steps,
            "unprofiled_wall_ms_step": statistics.mean(genai["unprofiled_wall_ms"]),
            "unprofiled_wall_ms_step_p50": statistics.median(genai["unprofiled_wall_ms"]),
        }
    return {
        "genai": genai_summary,
        "ops": rows,
        "kvforge_nodes": sum(result["graph_op_counts"].values()),
        "genai_nodes": sum(genai_ops.values()),
        "wall_ms_step": statistics.mean(result["wall_ms"]),
        "wall_ms_step_p50": statistics.median(result["wall_ms"]),
        "model_run_ms_step": statistics.mean(result["model_run_ms"]),
        "kernels_ms_step": kernel_us / 1e3 / steps,
        "unprofiled_wall_ms_step": statistics.mean(result["unprofiled_wall_ms"]),
        "unprofiled_wall_ms_step_p50": statistics.median(result["unprofiled_wall_ms"]),
    }


def print_summary(max_seq: int, s: dict[str, Any], cfg: dict[str, Any], load: tuple) -> None:
    print(
        "\n(kvforge nodes: in the graph its session runs, compile-time optimized; genai nodes: in its model.onnx, "
        "which ORT fuses further at load: genai kernels/step are the nodes it runs)"
    )
    print(
        f"kvforge decode step, {cfg['shape']} gqa {cfg['precision']} b{cfg['batch']}, max_seq {max_seq}, "
        f"{cfg['threads']} threads, "
        f"prompt {cfg['prompt_len']} + {cfg['warmup']} warm-up + {cfg['steps']} profiled steps; "
        f"load avg {load[0]} -> {load[1]}"
    )
    print(
        f"per step: wall {s['wall_ms_step']:.2f} ms (p50 {s['wall_ms_step_p50']:.2f}), ORT model_run "
        f"{s['model_run_ms_step']:.2f}, kernels {s['kernels_ms_step']:.2f}; without the profiler: wall "
        f"{s['unprofiled_wall_ms_step']:.2f} ms (p50 {s['unprofiled_wall_ms_step_p50']:.2f})"
    )
    g = s["genai"]
    if g:
        print(
            f"genai, same threads and steps, profiler on: wall {g['wall_ms_step']:.2f} ms (p50 "
            f"{g['wall_ms_step_p50']:.2f}), ORT model_run {g['model_run_ms_step']:.2f}, "
            f"kernels {g['kernels_ms_step']:.2f}; without the profiler: wall {g['unprofiled_wall_ms_step']:.2f} ms "
            f"(p50 {g['unprofiled_wall_ms_step_p50']:.2f})"
        )
    print(
        f"{'op type':34}{'kvforge nodes':>14}{'kernels/step':>13}{'ms/step':>9}{'share':>7}{'genai nodes':>12}"
        f"{'genai kernels/step':>19}{'genai ms/step':>14}"
    )
    for r in s["ops"]:
        gms = "-" if r["genai_ms_per_step"] is None else f"{r['genai_ms_per_step']:.3f}"
        gk = "-" if r["genai_kernels_per_step"] is None else f"{r['genai_kernels_per_step']:.0f}"
        print(
            f"{r['op']:34}{r['kvforge_nodes']:14d}{r['kernels_per_step']:13.0f}{r['ms_per_step']:9.3f}"
            f"{r['share']:7.1%}{r['genai_nodes']:12d}{gk:>19}{gms:>14}"
        )
    total_g = f"{g['kernels_ms_step']:.3f}" if g else "-"
    print(
        f"{'total':34}{s['kvforge_nodes']:14d}{'':13}{s['kernels_ms_step']:9.3f}{1:7.0%}{s['genai_nodes']:12d}"
        f"{'':19}{total_g:>14}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(peer.SHAPES), default="smollm")
    p.add_argument("--max-seq", type=int, nargs="+", default=[192, 512], help="one artifact and profile each")
    p.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    p.add_argument("--steps", type=int, default=40, help="profiled decode steps")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps before them")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="rows per decode step (the artifact's max_batch)")
    p.add_argument("--precision", choices=["fp32", "int4"], default="fp32", help="kvforge --quantize and genai -p")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvforge-peer")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached model and artifacts")
    p.add_argument(
        "--no-genai-profile",
        dest="genai_profile",
        action="store_false",
        help="skip profiling genai's steps (its node counts are still shown)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.job)
        return
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--steps and --threads must be at least 1, --warmup at least 0")
    too_long = [s for s in args.max_seq if args.prompt_len + args.warmup + args.steps + 1 > s]
    if too_long:
        p.error(f"--max-seq {too_long[0]} cannot hold {args.prompt_len} + {args.warmup} + {args.steps} + 1 positions")

    shape = peer.SHAPES[args.shape]
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    build = argparse.Namespace(
        shape=args.shape,
        batch=args.batch,
        precision=args.precision,
        prompt_len=args.prompt_len,
        new_tokens=args.steps,
        rebuild=args.rebuild,
        genai_python=sys.executable,
        max_seq=None,
    )
    model_dir = peer.ensure_model(build, shape, work)
    genai_dir, _ = peer.ensure_genai(build, model_dir, work)
    genai_ops = op_counts(genai_dir / "model.onnx")
    cfg = {k: getattr(args, k) for k in ("shape", "threads", "steps", "warmup", "prompt_len", "batch", "precision")}
    report: dict[str, Any] = {
        "schema": "kvforge.profile_decode",
        "schema_version": 1,
        "config": cfg,
        "model": asdict(shape),
        "genai": {"dir": str(genai_dir), "op_counts": genai_ops},
        "env": {
            "cpu_count": os.cpu_count(),
            **{d: peer.version(d) for d in ("onnxruntime", "onnxruntime-genai", "kvforge")},
        },
        "runs": {},
    }
    for max_seq in args.max_seq:
        build.max_seq = max_seq
        quantize = None if args.precision == "fp32" else args.precision
        artifact, _ = peer.ensure_kvforge(build, model_dir, work, "gqa", quantize)
        batch_tag = f"-b{args.batch}" if args.batch > 1 else ""
        profile_dir = work / f"profiles-{args.shape}-{args.precision}-s{max_seq}{batch_tag}"
        profile_dir.mkdir(exist_ok=True)
        job = {
            "artifact": str(artifact),
            "threads": args.threads,
            "steps": args.steps,
            "warmup": args.warmup,
            "prompt_len": args.prompt_len,
            "batch": args.batch,
            "vocab": shape.vocab,
            "profile_dir": str(profile_dir),
        }
        peer.say(f"profiling {artifact.name}: {args.steps} decode steps on {args.threads} threads")
        load_before = peer.loadavg()
        result = run_profile(job, work, f"{args.shape}-s{max_seq}")
        genai = None
        if args.genai_profile:
            peer.say(f"profiling genai: the same {args.steps} decode steps (its buffer: prompt + warm-up + steps)")
            genai_job = {**job, "side": "genai", "genai_dir": str(genai_dir)}
            genai = run_profile(genai_job, work, f"{args.shape}-genai")
        load = (load_before, peer.loadavg())
        summary = summarize(result, args.steps, genai_ops, genai)
        print_summary(max_seq, summary, cfg, load)
        report["runs"][str(max_seq)] = {
            "artifact": str(artifact),
            "loadavg_before": load[0],
            "loadavg_after": load[1],
            "summary": summary,
            "raw": result,
            "genai_raw": genai,
        }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        peer.say(f"wrote {args.json}")


if __name__ == "__main__":
    main()
