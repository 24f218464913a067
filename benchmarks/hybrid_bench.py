"""Hybrid shapes (issue 39): ``kvforge bench`` on a random model of a published hybrid's shape
against transformers in the same run, and its prefill against a full-attention Llama of the same size.

For ``--shape`` (a name of ``common.MODEL_SHAPES`` with twins: ``lfm2-350m``, ``qwen3.5-0.8b``,
``granite-4.0-h-350m``; or without: ``zamba2-1.2b``), its ``baseline`` (the same hidden size,
layers, heads, MLP and vocabulary, attention in every layer) and its ``matched`` twin (the
baseline with its MLP widened to the hybrid's parameter count: Qwen3.5's Gated DeltaNet
projections hold twice an attention layer's, so the same-dimension twin has 14% fewer
parameters), each a random float32 model built here (nothing is downloaded):

1. compile it (``--max-batch 1``, ``--max-seq`` the longest prompt + new tokens, ``--dtype``,
   ``--quantize``; a shape whose compile is refused is reported with compile's reason);
2. ``tools.bench.run_bench`` at batch 1 on every ``--prompt-lens`` (default 128, 512, 2048) with
   ``--new-tokens`` greedy tokens; transformers eager runs the same prompts for the hybrid at
   ``--reference-lens`` (default 128; ``--no-reference`` skips it), the twins run kvforge only;
3. reported per prompt length: TTFT and decode ms per step of both sides on the hybrid and the
   ratio (goal: transformers / kvforge decode >= 5 at batch 1), prefill tokens per second
   (prompt tokens / TTFT) of the hybrid and of each twin and their ratios (goal: the hybrid at
   most 1.5x slower than "a full attention model of the same size": both readings of "size" are
   reported, dimensions and parameters), and the memory a sequence costs: the state of the
   non-attention layers (``Layout.state_row_bytes``, fixed) and KV bytes per token of the
   attention layers, against the baseline's KV per token.

Both sides run on ``--threads`` threads (default 2). The load average is printed with the figures:
on a shared machine it changes every one of them.

    .venv/bin/python benchmarks/hybrid_bench.py --shape lfm2-350m --json hybrid-lfm2.json
    .venv/bin/python benchmarks/hybrid_bench.py --shape lfm2-350m --prompt-lens 128 --new-tokens 8 --repeat 1  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def say(message: str) -> None:
    print(f"[hybrid] {message}", file=sys.stderr, flush=True)


def compile_shape(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Build and compile the random model of ``name``; its paths, parameters, compile seconds and
    memory figures, or ``refused`` with compile's message."""
    from kvforge.compile import compile_model
    from kvforge.graphs import manifest as mf

    model_dir, out = work / f"model-{name}", work / f"out-{name}"
    max_seq = max(args.prompt_lens) + args.new_tokens
    options = dict(max_batch=1, max_seq=max_seq, dtype=args.dtype, quantize=args.quantize, score_graph=False)
    record = work / f"compiled-{name}.json"
    if args.reuse and (out / "manifest.json").exists() and (model_dir / "config.json").exists():
        # a --work-dir kept from an earlier run with the same options: its model and artifact
        manifest = mf.read(out, verify=False)
        done = json.loads(record.read_text()) if record.exists() else {}
        params, compile_s = done.get("params"), done.get("compile_s")
        say(f"reusing {out} (compiled earlier)")
    else:
        shutil.rmtree(out, ignore_errors=True)
        say(f"building a random {name} ({common.MODEL_SHAPES[name].source})")
        params = common.build_shape(name, model_dir)
        say(f"compiling {name} ({params / 1e6:.1f}M parameters): {options}")
        started = time.perf_counter()
        try:
            manifest = compile_model(model_dir, out, progress=None, **options)
        except Exception as e:  # a refusal (an unsupported layer kind) is a result here, not a crash
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return {"name": name, "params": params, "refused": f"{type(e).__name__}: {first}"}
        compile_s = time.perf_counter() - started
        record.write_text(json.dumps({"params": params, "compile_s": compile_s, "options": options}))
    layout = manifest.layout
    layers, two, _batch, kv_heads, _seq, head_dim = manifest.kv_cache["shape"]  # one row's KV per position:
    kv_per_token = layers * two * kv_heads * head_dim * _itemsize(manifest.kv_cache["dtype"])
    return {
        "name": name,
        "params": params,
        "model_dir": str(model_dir),
        "artifact": str(out),
        "compile_s": compile_s,
        "attention_layers": len(layout.attention),
        "state_layers": len(layout.states),
        "state_bytes_per_sequence": layout.state_row_bytes(),
        "kv_bytes_per_token": kv_per_token,
        "state_kinds": sorted({entry.kind for entry in layout.states}),
    }


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def bench(side: dict[str, Any], args: argparse.Namespace, reference_lens: list[int]) -> dict[str, Any]:
    """``run_bench`` at batch 1: transformers beside kvforge on ``reference_lens`` only, kvforge
    alone on the other prompt lengths; one report with every length's cell, in order."""
    from kvforge.tools.bench import BenchOptions, run_bench

    def run(lens: list[int], reference: bool) -> dict[str, Any]:
        options = BenchOptions(
            prompt_lens=tuple(lens),
            batch_sizes=(1,),
            new_tokens=args.new_tokens,
            repeat=args.repeat,
            warmup=args.warmup,
            threads=args.threads,
            prefill=args.prefill,
        )
        say(f"bench {side['name']} (prompts {lens}, transformers: {reference}, load {os.getloadavg()})")
        return run_bench(side["artifact"], side["model_dir"] if reference else None, options)

    with_reference = [p for p in args.prompt_lens if p in reference_lens]
    alone = [p for p in args.prompt_lens if p not in reference_lens]
    reports = ([run(with_reference, True)] if with_reference else []) + ([run(alone, False)] if alone else [])
    report = dict(reports[0])
    report["cells"] = sorted((c for r in reports for c in r["cells"]), key=lambda c: c["prompt_len"])
    report["environments"] = [r["environment"] for r in reports]
    return report


def _cells(side: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    return {c["prompt_len"]: c for c in side["report"]["cells"]} if side and "report" in side else {}


def summarize(
    hybrid: dict[str, Any], baseline: dict[str, Any] | None, matched: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """One row per prompt length: the figures the issue's goals name (``baseline``: the twin of the
    same dimensions, ``matched``: of the same parameter count)."""
    base_cells, matched_cells = _cells(baseline), _cells(matched)
    rows = []
    for cell in hybrid["report"]["cells"]:
        p, ours, ref = cell["prompt_len"], cell["kvforge"], cell["transformers"]
        row: dict[str, Any] = {
            "prompt_len": p,
            "kvforge_ttft_ms": ours["ttft_ms"],
            "kvforge_decode_ms": ours["decode_ms_per_token_p50"],
            "kvforge_prefill_tok_s": p / ours["ttft_ms"] * 1e3,
        }
        if ref is not None:
            row.update(
                transformers_ttft_ms=ref["ttft_ms"],
                transformers_decode_ms=ref["decode_ms_per_token_p50"],
                decode_speedup=ref["decode_ms_per_token_p50"] / ours["decode_ms_per_token_p50"],
                ttft_speedup=ref["ttft_ms"] / ours["ttft_ms"],
                greedy_tokens_identical=cell.get("greedy_tokens_identical"),
            )
        base = base_cells.get(p)
        if base is not None:
            row["baseline_ttft_ms"] = base["kvforge"]["ttft_ms"]
            row["baseline_decode_ms"] = base["kvforge"]["decode_ms_per_token_p50"]
            row["baseline_prefill_tok_s"] = p / base["kvforge"]["ttft_ms"] * 1e3
            row["prefill_slowdown_vs_baseline"] = ours["ttft_ms"] / base["kvforge"]["ttft_ms"]
        twin = matched_cells.get(p)
        if twin is not None:
            row["matched_prefill_tok_s"] = p / twin["kvforge"]["ttft_ms"] * 1e3
            row["prefill_slowdown_vs_matched"] = ours["ttft_ms"] / twin["kvforge"]["ttft_ms"]
        rows.append(row)
    return rows


def format_report(report: dict[str, Any]) -> str:
    h, b, m = report["hybrid"], report.get("baseline"), report.get("matched")
    lines = [
        f"{h['name']}: {(h['params'] or 0) / 1e6:.1f}M parameters, {report['settings']}; "
        f"load average {report['load_before']} -> {report['load_after']} on {report['cpus']} CPUs",
    ]
    for side in (h, b, m):
        if side is None:
            continue
        if "refused" in side:
            lines.append(f"  {side['name']}: compile refused: {side['refused']}")
            continue
        lines.append(
            f"  {side['name']} ({(side['params'] or 0) / 1e6:.1f}M): compiled in {side['compile_s'] or 0:.0f}s; "
            f"{side['attention_layers']} attention layers "
            f"({side['kv_bytes_per_token'] / 1024:.1f} KiB KV per token), {side['state_layers']} state layers "
            f"{side['state_kinds']} ({side['state_bytes_per_sequence'] / 1024:.1f} KiB per sequence)"
        )
    header = (
        f"{'prompt':>6} {'TTFT ms':>9} {'hf TTFT':>9} {'ms/step':>8} {'hf ms/step':>10} {'decode x':>8} "
        f"{'prefill tok/s':>13} {'twin tok/s':>10} {'slower x':>8} {'params twin':>11} {'slower x':>8} "
        f"{'tokens eq':>9}"
    )
    lines.append(header)

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        return format(value, fmt) if value is not None else "-"

    for row in report.get("rows", []):
        lines.append(
            f"{row['prompt_len']:>6} {cell(row, 'kvforge_ttft_ms', '9.1f')} "
            f"{cell(row, 'transformers_ttft_ms', '9.1f')} "
            f"{cell(row, 'kvforge_decode_ms', '8.2f')} {cell(row, 'transformers_decode_ms', '10.2f')} "
            f"{cell(row, 'decode_speedup', '8.2f')} {cell(row, 'kvforge_prefill_tok_s', '13.0f')} "
            f"{cell(row, 'baseline_prefill_tok_s', '10.0f')} {cell(row, 'prefill_slowdown_vs_baseline', '8.2f')} "
            f"{cell(row, 'matched_prefill_tok_s', '11.0f')} {cell(row, 'prefill_slowdown_vs_matched', '8.2f')} "
            f"{row.get('greedy_tokens_identical', '-')!s:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hybrids = sorted(name for name, shape in common.MODEL_SHAPES.items() if shape.baseline or shape.hybrid)
    p.add_argument("--shape", choices=hybrids, default="lfm2-350m")
    p.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 2048])
    p.add_argument(
        "--reference-lens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[128],
        help="prompt lengths transformers also runs (default 128; its eager prefill of 2048 takes minutes)",
    )
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantize", choices=["int4", "int8"], default=None)
    p.add_argument(
        "--prefill",
        choices=["ort", "int8", "fp32"],
        default="ort",
        help="Engine.load(prefill=...) for kvforge's prompts (int8, fp32: int4 artifacts; default ort)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip transformers")
    p.add_argument("--no-baseline", action="store_true", help="skip the full-attention twins")
    p.add_argument("--work-dir", type=Path, default=None, help="models and artifacts (default: a temp dir, removed)")
    p.add_argument("--reuse", action="store_true", help="reuse the models and artifacts left in --work-dir")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvforge-hybrid-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = common.MODEL_SHAPES[args.shape]
    load_before = os.getloadavg()
    try:
        hybrid = compile_shape(args.shape, work, args)
        baseline = matched = None
        if "refused" in hybrid:
            say(f"{args.shape} is refused ({hybrid['refused']}); needs: {shape.needs or '?'}")
        else:
            hybrid["report"] = bench(hybrid, args, [] if args.no_reference else args.reference_lens)
            if not args.no_baseline and shape.baseline is None:
                say(f"{args.shape} has no full-attention twins: its prefill is not compared")
            elif not args.no_baseline:
                baseline, matched = (compile_shape(name, work, args) for name in (shape.baseline, shape.matched))
                for twin in (baseline, matched):
                    if "refused" not in twin:
                        twin["report"] = bench(twin, args, [])
        report = {
            "shape": args.shape,
            "needs": shape.needs,
            "settings": {
                "threads": args.threads,
                "new_tokens": args.new_tokens,
                "repeat": args.repeat,
                "dtype": args.dtype,
                "quantize": args.quantize,
                "prefill": args.prefill,
                "batch": 1,
            },
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
            "hybrid": hybrid,
            "baseline": baseline,
            "matched": matched,
            "rows": summarize(hybrid, baseline, matched) if "report" in hybrid else [],
        }
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
