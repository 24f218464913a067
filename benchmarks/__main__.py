"""The benchmark suite: ``python -m benchmarks [SUBCOMMAND] [ARGS]`` from the repository root.

``peers`` (the default) is the headline: kvforge against transformers, onnxruntime-genai,
llama.cpp and OpenVINO GenAI at equal threads, each side in a process of its own, the sides taking turns over rounds
(``peer_genai.py``, ``peer_llamacpp.py`` and ``peer_openvino.py`` measure; this merges their reports). It writes
``peers.json``, ``peers.md`` (the table the README quotes, every row's TTFT and step as a ratio to
kvforge's) and ``peers.png`` into ``--out`` (default ``benchmarks/results/``). ``--quick`` runs the
small 4-layer shape against transformers (and genai when installed) in a minute or two; the full
run needs ``make smollm2`` and builds llama-cpp-python once (minutes). A peer that is not installed
is left out and named in the report's ``skipped``.

The feature benchmarks are subcommands of the same entry point; each runs its script in a process
of its own with the arguments given after the subcommand (``python -m benchmarks speculative
--help`` lists them). Findings of experiments that are no longer scripts: ``FINDINGS.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the scripts import each other as top-level modules (python benchmarks/X.py)
    sys.path.append(str(HERE))  # last: benchmarks/coverage.py must not hide the coverage package

import common  # noqa: E402

# subcommand -> (script, what it measures)
FEATURES = {
    "genai": ("peer_genai", "kvforge vs onnxruntime-genai vs transformers on a random-weight shape"),
    "llamacpp": ("peer_llamacpp", "kvforge vs llama.cpp (built from source) vs genai on SmolLM2 and a 1.39B shape"),
    "openvino": ("peer_openvino", "kvforge vs OpenVINO GenAI (its own venv) on SmolLM2 and the 1.39B shape"),
    "quality": ("quality", "perplexity per precision on Genesis, kvforge against transformers and llama.cpp"),
    "kv-int8": ("kv_int8", "the 8-bit KV cache against the float cache: perplexity, greedy agreement, decode"),
    "speculative": ("speculative", "speculative decoding (ngram, draft model) against plain decoding, A/B rounds"),
    "spec-peers": ("spec_peers", "speculative decoding against llama.cpp's prompt lookup and genai"),
    "ngram-replay": ("ngram_replay", "the n-gram drafter replayed on greedy outputs, priced by measured call widths"),
    "prefix-cache": ("prefix_cache", "two servers, prefix cache off and on: multi-turn chat and a shared prompt"),
    "structured": ("structured", "the cost of a grammar-constrained row per decode step"),
    "scheduler": ("scheduler", "in-flight batching against sequential generate calls, Poisson arrivals"),
    "serving": ("serve_scale", "one kvforge serve against Ray Serve replicas"),
    "soak": ("soak", "random requests against a server for a while: errors and memory"),
    "predicted-outputs": ("predicted_outputs", "OpenAI predicted outputs through kvforge serve"),
    "handoff": ("handoff", "the disaggregated KV hand-off: lent rows, arena, copy"),
    "disagg": ("disagg", "colocated against prefill/decode workers, with kvforge plan --serve's prediction"),
    "compile": ("compile_time", "compile time and peak memory against genai's builder and Optimum"),
    "gemm": ("gemm_ceiling", "ORT's GEMM and MatMulNBits ceilings per projection shape"),
    "int8-prefill": ("int8_prefill", "the int8 prefill of int4 artifacts: kernels, prompt-pass perplexity, TTFT"),
    "prefill-profile": ("prefill_profile", "ORT's profiler over a prefill: time per op type and per node"),
    "artifact-ab": ("artifact_ab", "two compiles of one model taking turns in one process: decode and prefill, B / A"),
    "decode": ("decode_speed", "kvforge against transformers eager in one process, a random Llama or named shape"),
    "hybrid": ("hybrid_bench", "a hybrid shape (LFM2-350M) against transformers and a full-attention Llama twin"),
    "coverage": ("coverage", "every causal-LM family of transformers compiled tiny and checked token by token"),
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def peers(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks peers", description="the headline comparisons")
    p.add_argument("--quick", action="store_true", help="the 4-layer shape, 1 round, 16 new tokens (minutes)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every side (default 2)")
    p.add_argument("--rounds", type=int, default=None, help="turns every side takes (default 3; --quick 1)")
    p.add_argument("--max-seq", type=int, default=512, help="KV capacity a sequence on every side (default 512)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes (default 1 4)")
    p.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out (it builds once, minutes)")
    p.add_argument(
        "--openvino",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="OpenVINO GenAI (peer_openvino.py, its own venv, installed once; needs `make smollm2`): "
        "on by default, off with --quick unless given (then SmolLM2 only, 16 new tokens)",
    )
    p.add_argument("--out", type=Path, default=common.RESULTS, help="where the JSON, Markdown and plot go")
    p.add_argument("--work-dir", type=Path, default=None, help="the peers' cache of models and artifacts")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    args.out.mkdir(parents=True, exist_ok=True)
    skipped, sources, rows = {}, {}, []
    sides = ["transformers", "kvforge"]
    if _installed("onnxruntime_genai"):
        sides.insert(1, "genai")
    else:
        skipped["onnxruntime-genai"] = "not installed (pip install -e '.[peer]')"
    shape = "tiny4" if args.quick else "smollm"
    started = time.time()
    for batch in [1] if args.quick else args.batch:
        report = args.out / f"genai-{shape}-b{batch}.json"
        cmd = ["--shape", shape, "--batch", str(batch), "--threads", str(args.threads), "--rounds", str(rounds)]
        cmd += ["--max-seq", str(args.max_seq), "--sides", *sides, "--json", str(report)]
        if args.quick:
            cmd += ["--new-tokens", "16", "--prompt-len", "32"]
        if args.work_dir:
            cmd += ["--work-dir", str(args.work_dir)]
        if common.run_script("peer_genai", cmd) != 0 or not report.exists():
            print(f"peer_genai.py failed (batch {batch}); see its output above", file=sys.stderr)
            return 1
        sources[report.name] = json.loads(report.read_text())
        rows += common.peer_rows(sources[report.name], "peer_genai")
    if args.quick or args.no_llamacpp:
        skipped["llama.cpp"] = "--quick" if args.quick else "--no-llamacpp"
    elif not (Path(common.pg.__file__).parent / "peer_llamacpp.py").exists():
        skipped["llama.cpp"] = "peer_llamacpp.py missing"
    else:
        report = args.out / "llamacpp.json"
        cmd = ["--model", "smollm2", "large", "--threads", str(args.threads), "--rounds", str(rounds)]
        cmd += ["--max-seq", str(args.max_seq), "--batches", *map(str, args.batch), "--json", str(report)]
        if common.run_script("peer_llamacpp", cmd) != 0 or not report.exists():
            print("peer_llamacpp.py failed; see its output above (it needs `make smollm2`)", file=sys.stderr)
            return 1
        sources[report.name] = json.loads(report.read_text())
        rows += common.peer_rows(sources[report.name], "peer_llamacpp")
    run_openvino = not args.quick if args.openvino is None else args.openvino
    if not run_openvino:
        skipped["openvino"] = "--quick" if args.quick and args.openvino is None else "--no-openvino"
    elif not (smollm2_hf() / "config.json").exists():
        skipped["openvino"] = f"SmolLM2 missing at {smollm2_hf()} (make smollm2)"
    else:
        report = args.out / "openvino.json"
        if common.run_script("peer_openvino", openvino_args(args, rounds, report)) != 0 or not report.exists():
            print("peer_openvino.py failed; see its output above", file=sys.stderr)
            return 1
        sources[report.name] = json.loads(report.read_text())
        rows += common.peer_rows(sources[report.name], "peer_openvino")
    command = "python -m benchmarks peers" + (" --quick" if args.quick else "") + f" --threads {args.threads}"
    command += " --openvino" if args.quick and run_openvino else ""
    settings = (
        f"{args.threads} threads every side, each side in its own process, the sides taking turns over {rounds} "
        f"round(s) (medians); the same prompt ids on every side; kvforge's KV capacity {args.max_seq} a sequence "
        f"(llama.cpp's n_ctx likewise; genai's buffer is prompt + new tokens; OpenVINO's KV blocks hold kvforge's "
        f"max_batch 4 x max_seq, a prompt over max_seq a longer max_seq on both); prefix caches off; load "
        f"{common.pg.loadavg()} at the end."
    )
    report = {
        "schema": "kvforge.bench_suite",
        "schema_version": 1,
        "command": command,
        "settings": {"threads": args.threads, "rounds": rounds, "max_seq": args.max_seq, "quick": args.quick},
        "env": {"python": platform.python_version(), "loadavg_after": common.pg.loadavg()},
        "seconds": round(time.time() - started, 1),
        "skipped": skipped,
        "rows": common.with_ratios(rows),
        "sources": sorted(sources),
    }
    paths = common.write_report(report, args.out, command, settings)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(v) for v in paths.values()))
    return 0


def smollm2_hf() -> Path:
    """Where `make smollm2` puts SmolLM2's HF directory (peer_llamacpp.py's SMOLLM2_HF)."""
    import peer_llamacpp

    return peer_llamacpp.SMOLLM2_HF


def openvino_args(args: argparse.Namespace, rounds: int, report: Path) -> list[str]:
    """peer_openvino.py's arguments for the suite: SmolLM2 and the 1.39B shape, prompts of 128 and
    1024 tokens; ``--quick``: SmolLM2 only, 16 new tokens, 1,024 quality-text tokens scored."""
    cmd = ["--threads", str(args.threads), "--rounds", str(rounds), "--max-seq", str(args.max_seq)]
    cmd += ["--batches", *map(str, args.batch), "--prompt-lens", "128", "1024", "--json", str(report)]
    if args.quick:
        cmd += ["--model", "smollm2", "--new-tokens", "16", "--ppl-tokens", "1024"]
    else:
        cmd += ["--model", "smollm2", "large"]
    if args.work_dir:
        cmd += ["--work-dir", str(args.work_dir)]
    return cmd


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="kvforge's benchmark suite: every figure with a baseline measured in the same run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands:\n  peers                the headline table (default)\n"
        + "\n".join(f"  {name:20} {what}" for name, (_, what) in FEATURES.items()),
    )
    p.add_argument("subcommand", nargs="?", default="peers", choices=["peers", *FEATURES], metavar="SUBCOMMAND")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the subcommand's own arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["peers", *argv]  # python -m benchmarks --quick
    args = build_parser().parse_args(argv)
    if args.subcommand == "peers":
        return peers(args.args)
    script, _ = FEATURES[args.subcommand]
    return common.run_script(script, args.args)


if __name__ == "__main__":
    sys.exit(main())
