"""Compile time and memory: ``kvforge compile`` vs onnxruntime-genai's builder vs Optimum's ONNX export.

One random Llama of a named shape (peer_genai.py's shapes and builder; nothing is downloaded) is
turned into ONNX by each tool, one after the other in the same run, each in a fresh process:

* ``kvforge``: ``python -m kvforge.tools.cli compile MODEL -o OUT`` (defaults: gqa lowering,
  max_seq 512, score graph, ORT-optimized graphs, parity check);
* ``genai``: ``python -m onnxruntime_genai.models.builder -i MODEL -o OUT -p fp32 -e cpu -c CACHE``;
* ``optimum``: ``optimum-cli export onnx --model MODEL --task text-generation-with-past OUT``
  (``python -m optimum.commands.optimum_cli``; optimum-onnx wants transformers 4.x, so it usually
  lives in a venv of its own: ``--optimum-python``; see benchmarks/README.md).

Each tool's process is started by a small runner process that waits for it and reads
``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``: that tool's peak RSS alone (its whole process,
imports included). Reported per tool: wall seconds, peak RSS, RSS / checkpoint bytes, seconds and
RSS relative to genai's builder, and for kvforge the time of each stage from its progress lines.
Hugging Face access is off (``HF_HUB_OFFLINE=1``). A tool that cannot run gets a row that says why.
The load average before and after is printed: on a shared machine it changes every figure.

    .venv/bin/python benchmarks/compile_time.py                      # smollm shape, every tool
    .venv/bin/python benchmarks/compile_time.py --tools kvforge genai --json compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import peer_genai as peer  # the shapes, the random-model builder, the offline env, the work dir

TOOLS = ("kvforge", "genai", "optimum")
STAGE_LINE = re.compile(r"\[\d+/\d+ +[\d.]+s\] (\w+) took ([\d.]+)s(?: \((.*)\))?")


def measure_child(argv: list[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``argv`` to completion (output to ``log``); its wall seconds, exit code and peak RSS.
    Called in a fresh runner process, whose only child is ``argv``: RUSAGE_CHILDREN is its own."""
    start = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - start
    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    return {"rc": rc, "seconds": seconds, "peak_rss_bytes": kib * 1024}


def run_measured(argv: list[str], log: Path) -> dict[str, Any]:
    """``measure_child`` in a fresh runner process (this script with ``--measure``)."""
    env = {**os.environ, **peer.OFFLINE_ENV}
    runner = [sys.executable, str(Path(__file__).resolve()), "--measure", str(log), "--", *argv]
    done = subprocess.run(runner, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def tool_command(tool: str, args: argparse.Namespace, model_dir: Path, out: Path) -> list[str] | str:
    """The command line of ``tool``, or why it cannot run here."""
    if tool == "kvforge":
        return [sys.executable, "-m", "kvforge.tools.cli", "compile", str(model_dir), "-o", str(out)]
    if tool == "genai":
        probe = subprocess.run([args.genai_python, "-c", "import onnxruntime_genai"], capture_output=True, text=True)
        if probe.returncode:
            return f"onnxruntime-genai is not importable by {args.genai_python} (pip install -e '.[peer]')"
        cache = out.parent / "genai-cache"
        builder = [args.genai_python, "-m", "onnxruntime_genai.models.builder"]
        return [*builder, "-i", str(model_dir), "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache)]
    python = args.optimum_python
    if python is None:
        return "no --optimum-python given and no .venv-optimum/ beside the repository (see benchmarks/README.md)"
    probe = subprocess.run([python, "-c", "import optimum.exporters.onnx"], capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"optimum's ONNX exporter is not importable by {python}: {last}"
    cli = [python, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(model_dir)]
    return [*cli, "--task", "text-generation-with-past", str(out)]


def kvforge_stages(log: Path) -> dict[str, dict[str, Any]]:
    """kvforge's per-stage seconds (and their details) from its progress lines."""
    stages = {}
    for match in STAGE_LINE.finditer(log.read_text(errors="replace")):
        stages[match.group(1)] = {"seconds": float(match.group(2)), "details": match.group(3) or ""}
    return stages


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(peer.SHAPES), default="smollm")
    p.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvforge-peer")
    p.add_argument("--out-dir", type=Path, default=None, help="where the tools write (default: a temp dir, removed)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached random model")
    p.add_argument("--genai-python", default=sys.executable, help="interpreter with onnxruntime-genai")
    repo_optimum = Path(__file__).resolve().parents[1] / ".venv-optimum" / "bin" / "python"
    p.add_argument(
        "--optimum-python",
        default=str(repo_optimum) if repo_optimum.exists() else None,
        help="interpreter with optimum-onnx (default: .venv-optimum/bin/python beside the repository)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_child(args.command, Path(args.measure), dict(os.environ))))
        return

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    load_before = peer.loadavg()
    model_dir = peer.ensure_model(args, peer.SHAPES[args.shape], work)
    checkpoint = peer.dir_bytes(model_dir, (".safetensors",))
    out_root = Path(tempfile.mkdtemp(prefix="compile-time-")) if args.out_dir is None else args.out_dir
    out_root.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    try:
        for tool in args.tools:
            out = out_root / tool
            shutil.rmtree(out, ignore_errors=True)
            command = tool_command(tool, args, model_dir, out)
            if isinstance(command, str):
                rows[tool] = {"ran": False, "why": command}
                peer.say(f"{tool}: not run: {command}")
                continue
            peer.say(f"{tool}: {' '.join(command)}  (load {peer.loadavg()})")
            log = out_root / f"{tool}.log"
            row = {"ran": True, "command": command, "load_before": peer.loadavg(), **run_measured(command, log)}
            row["rss_over_checkpoint"] = row["peak_rss_bytes"] / checkpoint
            if row["rc"]:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                row["why"] = f"exit code {row['rc']}: " + " | ".join(tail)
            if tool == "kvforge":
                row["stages"] = kvforge_stages(log)
            rows[tool] = row
            peer.say(f"{tool}: {row['seconds']:.1f}s, peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB, rc {row['rc']}")
    finally:
        if args.out_dir is None:
            shutil.rmtree(out_root, ignore_errors=True)
    genai = rows.get("genai", {})
    for row in rows.values():
        if row.get("ran") and genai.get("ran") and not genai["rc"]:
            row["seconds_vs_genai"] = row["seconds"] / genai["seconds"]
            row["rss_vs_genai"] = row["peak_rss_bytes"] / genai["peak_rss_bytes"]
    report = {
        "shape": args.shape,
        "checkpoint_bytes": checkpoint,
        "load_average_before": load_before,
        "load_average_after": peer.loadavg(),
        "cpus": os.cpu_count(),
        "versions": {
            d: peer.version(d) for d in ("kvforge", "torch", "transformers", "onnxruntime", "onnxruntime-genai")
        },
        "tools": rows,
    }
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"shape {report['shape']}: checkpoint {report['checkpoint_bytes'] / 2**20:.0f} MiB; "
        f"load average {report['load_average_before']} -> {report['load_average_after']} on {report['cpus']} CPUs",
        f"{'tool':<8} {'seconds':>8} {'peak RSS':>10} {'RSS/ckpt':>9} {'s/genai':>8} {'RSS/genai':>9}",
    ]
    for tool, row in report["tools"].items():
        if not row.get("ran") or row.get("rc"):
            lines.append(f"{tool:<8} not measured: {row.get('why')}")
            continue
        vs_genai = [f"{row[key]:.2f}x" if key in row else "-" for key in ("seconds_vs_genai", "rss_vs_genai")]
        lines.append(
            f"{tool:<8} {row['seconds']:>7.1f}s {row['peak_rss_bytes'] / 2**20:>6.0f} MiB "
            f"{row['rss_over_checkpoint']:>8.2f}x {vs_genai[0]:>8} {vs_genai[1]:>9}"
        )
    stages = report["tools"].get("kvforge", {}).get("stages")
    if stages:
        lines.append("kvforge stages: " + "; ".join(f"{name} {s['seconds']:.1f}s" for name, s in stages.items()))
        lines += [f"  {name}: {s['details']}" for name, s in stages.items() if s["details"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
