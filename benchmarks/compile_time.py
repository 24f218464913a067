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

A shape of :data:`SHARDED` (``llama2-7b``: Llama-2-7B's layout, 6.74B parameters, 13.5 GB of bf16)
is too large to build as a torch model here: its checkpoint is written tensor by tensor into
safetensors shards of ``--shard-mib`` (random normal * 0.02 in bfloat16, norms ones; at most one
shard in memory), and only kvforge runs on it (``--kvforge-args`` pass its options). While a tool
runs, the runner samples its RSS every 0.5 s, so the report also says which kvforge stage held
the peak. ``--remove`` deletes the checkpoint and the outputs afterwards.

    .venv/bin/python benchmarks/compile_time.py                      # smollm shape, every tool
    .venv/bin/python benchmarks/compile_time.py --tools kvforge genai --json compile.json
    .venv/bin/python benchmarks/compile_time.py --shape llama2-7b --tools kvforge \
        --kvforge-args="--quantize int4" --remove --json compile-7b-int4.json
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
# Shapes whose checkpoint is written shard by shard (never a whole torch model in memory).
SHARDED = {
    # meta-llama/Llama-2-7b-hf's layout: 32 layers, hidden 4096, MHA 32 heads, SwiGLU 11008, vocab 32000.
    "llama2-7b": peer.Shape(
        layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000, tied=False, max_positions=4096
    ),
}
SHAPES = {**peer.SHAPES, **SHARDED}
SAMPLE_SECONDS = 0.5
STAGE_START = re.compile(r"\[\d+/\d+ +[\d.]+s\] (.*)")
STAGE_LINE = re.compile(r"\[\d+/\d+ +[\d.]+s\] (\w+) took ([\d.]+)s(?: \((.*)\))?")


def measure_child(argv: list[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``argv`` to completion (output to ``log``); its wall seconds, exit code and peak RSS.
    Called in a fresh runner process, whose only child is ``argv``: RUSAGE_CHILDREN is its own."""
    start = time.perf_counter()
    samples = []  # (seconds since start, RSS bytes, of which file-backed, the stage line last seen)
    stage = "start-up"
    with open(log, "w") as out, open(log) as progress:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            for line in progress.read().splitlines():  # the progress lines written since the last sample
                started = STAGE_START.search(line)
                if started and " took " not in line:
                    stage = started.group(1)[:60]
            rss = rss_bytes_of(proc.pid)
            if rss is not None:
                samples.append((round(time.perf_counter() - start, 1), *rss, stage))
            time.sleep(SAMPLE_SECONDS)
        rc = proc.returncode
    seconds = time.perf_counter() - start
    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    return {"rc": rc, "seconds": seconds, "peak_rss_bytes": kib * 1024, "rss_samples": samples}


def rss_bytes_of(pid: int) -> tuple[int, int] | None:
    """The process's resident bytes now, ``(VmRSS, RssFile)`` (RssFile: pages of mapped files, such
    as a memory-mapped checkpoint or weights file: clean, so the kernel can drop them under
    pressure), or None once it is gone."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return None
    return (fields["VmRSS"], fields.get("RssFile", 0)) if "VmRSS" in fields else None


def checkpoint_tensors(shape: peer.Shape) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama's tensor names and shapes, in the order transformers saves them."""
    d = shape.hidden // shape.heads
    names = [("model.embed_tokens.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        names += [
            (p + "self_attn.q_proj.weight", (shape.heads * d, shape.hidden)),
            (p + "self_attn.k_proj.weight", (shape.kv_heads * d, shape.hidden)),
            (p + "self_attn.v_proj.weight", (shape.kv_heads * d, shape.hidden)),
            (p + "self_attn.o_proj.weight", (shape.hidden, shape.heads * d)),
            (p + "mlp.gate_proj.weight", (shape.intermediate, shape.hidden)),
            (p + "mlp.up_proj.weight", (shape.intermediate, shape.hidden)),
            (p + "mlp.down_proj.weight", (shape.hidden, shape.intermediate)),
            (p + "input_layernorm.weight", (shape.hidden,)),
            (p + "post_attention_layernorm.weight", (shape.hidden,)),
        ]
    names.append(("model.norm.weight", (shape.hidden,)))
    if not shape.tied:
        names.append(("lm_head.weight", (shape.vocab, shape.hidden)))
    return names


def write_sharded(shape: peer.Shape, model_dir: Path, shard_bytes: int) -> None:
    """A random Llama checkpoint of ``shape`` in bfloat16 safetensors shards of at most
    ``shard_bytes`` (one tensor more when a single one is larger), with its index and config.json;
    generated tensor by tensor, so at most one shard is in memory. Norm weights are ones, the rest
    normal * 0.02 (seeded)."""
    import torch
    from safetensors.torch import save_file

    tmp = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in checkpoint_tensors(shape):
        nbytes = 2 * int(torch.Size(dims).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims in shard:
            if len(dims) == 1:
                tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(dims, generator=generator) * 0.02).to(torch.bfloat16)
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
        peer.say(f"shard {k}/{len(shards)} written ({total / 2**30:.1f} GiB so far)")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": shape.tied,
        "bos_token_id": None,
        "eos_token_id": shape.eos_token_id,
        "torch_dtype": "bfloat16",
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)


def ensure_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    """The random model of ``args.shape``: peer_genai's builder, or shard by shard for :data:`SHARDED`."""
    if args.shape not in SHARDED:
        return peer.ensure_model(args, SHAPES[args.shape], work)
    model_dir = work / f"model-{args.shape}-bf16"
    if not (model_dir / "model.safetensors.index.json").exists() or args.rebuild:
        peer.say(f"writing the random {args.shape} checkpoint shard by shard in {model_dir}")
        started = time.perf_counter()
        write_sharded(SHAPES[args.shape], model_dir, args.shard_mib << 20)
        peer.say(f"checkpoint written in {time.perf_counter() - started:.0f}s")
    return model_dir


def peak_stage(row: dict[str, Any]) -> str | None:
    """The kvforge stage (its progress line) running when the sampled RSS peaked."""
    samples = row.get("rss_samples")
    return max(samples, key=lambda sample: sample[1])[3] if samples else None


def run_measured(argv: list[str], log: Path) -> dict[str, Any]:
    """``measure_child`` in a fresh runner process (this script with ``--measure``)."""
    env = {**os.environ, **peer.OFFLINE_ENV}
    runner = [sys.executable, str(Path(__file__).resolve()), "--measure", str(log), "--", *argv]
    done = subprocess.run(runner, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def tool_command(tool: str, args: argparse.Namespace, model_dir: Path, out: Path) -> list[str] | str:
    """The command line of ``tool``, or why it cannot run here."""
    if tool == "kvforge":
        extra = args.kvforge_args.split() if args.kvforge_args else []
        return [sys.executable, "-m", "kvforge.tools.cli", "compile", str(model_dir), "-o", str(out), *extra]
    if args.shape in SHARDED:
        return f"the {args.shape} shape is measured with kvforge only (its checkpoint is written shard by shard)"
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
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm")
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
    p.add_argument("--kvforge-args", default="", help='options added to kvforge compile, e.g. "--quantize int4"')
    p.add_argument("--shard-mib", type=int, default=2048, help="a sharded checkpoint's shard size (default 2048)")
    p.add_argument("--remove", action="store_true", help="delete the checkpoint (and outputs) afterwards")
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
    model_dir = ensure_checkpoint(args, work)
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
            if row["rss_samples"]:
                top = max(row["rss_samples"], key=lambda sample: sample[1])
                row["sampled_peak"] = {"seconds": top[0], "rss_bytes": top[1], "file_backed_bytes": top[2]}
            if tool == "kvforge":
                row["stages"] = kvforge_stages(log)
                row["peak_stage"] = peak_stage(row)
            rows[tool] = row
            peer.say(f"{tool}: {row['seconds']:.1f}s, peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB, rc {row['rc']}")
    finally:
        if args.out_dir is None or args.remove:
            shutil.rmtree(out_root, ignore_errors=True)
        if args.remove:
            shutil.rmtree(model_dir, ignore_errors=True)
    genai = rows.get("genai", {})
    for row in rows.values():
        if row.get("ran") and genai.get("ran") and not genai["rc"]:
            row["seconds_vs_genai"] = row["seconds"] / genai["seconds"]
            row["rss_vs_genai"] = row["peak_rss_bytes"] / genai["peak_rss_bytes"]
    report = {
        "shape": args.shape,
        "kvforge_args": args.kvforge_args,
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
        f"shape {report['shape']} {report.get('kvforge_args') or ''}: "
        f"checkpoint {report['checkpoint_bytes'] / 2**20:.0f} MiB; "
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
        kv = report["tools"]["kvforge"]
        top = kv.get("sampled_peak")
        if top:
            lines.append(
                f"kvforge's sampled RSS peaked at {top['rss_bytes'] / 2**30:.2f} GiB "
                f"({top['file_backed_bytes'] / 2**30:.2f} GiB of it file-backed) in its {kv.get('peak_stage')} stage"
            )
        lines += [f"  {name}: {s['details']}" for name, s in stages.items() if s["details"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
