"""The ``kvforge`` command line: thin subcommands over the public APIs.

    kvforge compile MODEL_DIR -o OUT [--dtype float32] [--max-batch 4] [--max-seq 512] [--lowering onnx]
    kvforge generate OUT "prompt" [--max-new-tokens 32]
    kvforge demo [--model DIR] [--prompt TEXT ...]

User errors (bad paths, unsupported models, corrupted artifacts, bad prompts) print one line
``kvforge: error: ...`` and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_compile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a Hugging Face model directory into prefill + decode graphs")
    p.add_argument("model_dir", help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("-o", "--out", required=True, help="output artifact directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--max-batch", type=int, default=4, help="rows of the KV cache (default 4)")
    p.add_argument(
        "--max-seq",
        type=int,
        default=None,
        help="cache capacity per row, prompt + output (default 512, or the model's max positions if fewer)",
    )
    p.add_argument("--lowering", default="onnx", choices=["onnx"], help="attention lowering (default onnx)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(run=_run_compile)


def _run_compile(args: argparse.Namespace) -> int:
    from kvforge.compile import compile_model
    from kvforge.compile.pipeline import stderr_progress

    manifest = compile_model(
        args.model_dir,
        args.out,
        dtype=args.dtype,
        max_batch=args.max_batch,
        max_seq=args.max_seq,
        lowering=args.lowering,
        progress=None if args.quiet else stderr_progress,
    )
    parity = manifest.parity
    if "skipped" in parity:
        print(f"compiled {manifest.model.architecture} -> {args.out} (parity not measured: {parity['skipped']})")
    else:
        print(
            f"compiled {manifest.model.architecture} -> {args.out}: parity vs transformers "
            f"prefill max|diff| {parity['prefill_max_abs_diff']:.2e}, decode {parity['decode_max_abs_diff']:.2e}, "
            f"greedy match {parity['greedy_match']}"
        )
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a compiled artifact (greedy)")
    p.add_argument("artifact", help="artifact directory written by kvforge compile")
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from kvforge.runtime import Engine

    with Engine.load(args.artifact, threads=args.threads) as engine:
        results = engine.generate(args.prompt, max_new_tokens=args.max_new_tokens)
    for prompt, result in zip(args.prompt, results):
        if len(args.prompt) > 1:
            print(f"--- {prompt!r} ({result.finish_reason})")
        print(prompt + result.text)
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="compile the bundled model and compare it with transformers")
    p.add_argument("--model", default=None, help="model directory (default: the bundled models/kvforge-tiny)")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    p.add_argument("--out", default=None, help="artifact directory (default: a temporary directory)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from kvforge.tools.demo import run_demo

    return run_demo(args.model, args.prompt, args.out, args.max_new_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_compile(sub)
    _add_generate(sub)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:  # every user-facing error (ModelDirError, ArtifactError, ...) is a ValueError
        print(f"kvforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
