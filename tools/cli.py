"""The ``kvforge`` command line: thin subcommands over the public APIs.

    kvforge compile MODEL_DIR|FILE.gguf|ORG/NAME -o OUT [--revision R] [--target cpu|cuda|tensorrt] [--dtype D]
                                     [--max-batch 4] [--max-seq 512] [--max-prompt N] [--lowering gqa|onnx|exact]
    kvforge plan MODEL_DIR|OUT [--dtype D] [--max-batch N] [--max-seq N] [--max-prompt N] [--gpu-memory 70GiB] [--json]
    kvforge plan --serve OUT --rate R --slo-ttft MS --slo-tpot MS [--prompt-lens ..] [--output-lens ..]
                 [--long-fraction F --long-lens ..] [--cores N] [--bench JSON ...] [--scale 8,16,32]
                 [--thread-speedup P,D] [--json]
    kvforge build OUT [--gpu-memory 70GiB]
    kvforge generate OUT "prompt" [--max-new-tokens 32] [--temperature T --top-p P --seed N --stop S ...]
    kvforge chat OUT [--system TEXT] [--max-new-tokens 256] [sampling flags]
    kvforge demo [--model DIR] [--prompt TEXT ...]
    kvforge compare OUT --reference MODEL_DIR [--prompts FILE] [--text FILE] [--steps N] [--json PATH] [--plot PATH]
    kvforge bench OUT [--reference MODEL_DIR] [--prompt-lens 32,128,512] [--batch-sizes 1,4] [--new-tokens N]
    kvforge inspect OUT [--json PATH]

User errors (bad paths, unsupported models, corrupted artifacts, bad prompts) print one line
``kvforge: error: ...`` and exit with status 2; no traceback. ``compare`` exits with 1 when it finds a
mismatch, ``plan`` when the plan does not fit its budget (``plan --serve``: when no layout meets the SLOs).
The JSON written by ``--json`` is documented in docs/tools.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Sequence
from typing import NoReturn


def _add_compile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a Hugging Face model directory into prefill + decode graphs")
    p.add_argument(
        "model_dir",
        metavar="MODEL",
        help="Hugging Face model directory (config.json + *.safetensors), a .gguf file (its Q4_0/Q8_0/Q4_1 blocks "
        "kept as they are; needs the gguf extra), or a Hub id ORG/NAME that is not a local path (from the Hub "
        "or its local cache; HF_HUB_OFFLINE=1: the cache only)",
    )
    p.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    p.add_argument("-o", "--out", required=True, help="output artifact directory")
    p.add_argument(
        "--target",
        default="cpu",
        choices=["cpu", "cuda", "tensorrt"],
        help="cpu: ORT CPU graphs (default); cuda: ORT's CUDA provider (gqa, float16); tensorrt: the onnx lowering "
        "(float16), engines built at once on a GPU with TensorRT, else by `kvforge build OUT` there",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="default: float32 for --target cpu, float16 for cuda and tensorrt",
    )
    p.add_argument("--max-batch", type=int, default=4, help="rows of the KV cache (default 4)")
    p.add_argument(
        "--max-seq",
        type=int,
        default=None,
        help="cache capacity per row, prompt + output (default 512, or the model's max positions if fewer)",
    )
    p.add_argument(
        "--max-prompt",
        type=int,
        default=None,
        help="longest prompt, TensorRT's prefill profile (default: max-seq)",
    )
    p.add_argument(
        "--lowering",
        default=None,
        choices=["onnx", "gqa", "exact"],
        help="attention lowering: gqa (ORT GroupQueryAttention, the fast one on ORT; default for cpu and cuda), "
        "onnx (standard opset 24, the graph for TensorRT; --target tensorrt's) or exact (onnx with attention in "
        "plain ops: speculative verification gives plain decoding's tokens exactly, fp32 and int4)",
    )
    p.add_argument(
        "--gpu-memory", default=None, metavar="SIZE", help="--target tensorrt: memory budget of the build, e.g. 70GiB"
    )
    p.add_argument(
        "--quantize",
        choices=["int4", "int8"],
        default=None,
        help="weight-only quantization of every MatMul (the lm_head in int8 unless --lm-head) to MatMulNBits; ORT only",
    )
    p.add_argument("--block-size", type=int, default=32, help="quantization block size (default 32)")
    p.add_argument(
        "--asymmetric",
        dest="symmetric",
        action="store_false",
        help="--quantize: a zero point per block (default: symmetric blocks; benchmarks/quality.py compares them)",
    )
    p.add_argument(
        "--quantize-lm-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--quantize: the lm_head too (default); --no-quantize-lm-head leaves it in --dtype (better "
        "perplexity, a slower step on a small model: benchmarks/quality.py)",
    )
    p.add_argument(
        "--lm-head",
        choices=["int4", "int8", "float"],
        default=None,
        help="--quantize: the lm_head's own precision (default int8, under int4 too: OpenVINO's int4 layout; "
        "int4 reads ~14 MiB less a step on SmolLM2 at +8%% perplexity); float keeps it in --dtype, as "
        "--no-quantize-lm-head (docs/performance.md weighs each one's perplexity against its decode step)",
    )
    p.add_argument(
        "--lm-head-block-size",
        type=int,
        default=None,
        help="--quantize: the quantized lm_head's block size (default: 128 where it divides the lm_head's input "
        "width, which reads 15%% fewer bytes at 8 bits; else --block-size's)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["float", "int8"],
        default="float",
        help="KV cache precision: float (default, --dtype) or int8 (a float32 scale per cached row and "
        "head: ~1/4 of float32's KV bytes; CPU target, onnx/exact lowering, onnx by default; "
        "docs/performance.md measures it)",
    )
    p.add_argument(
        "--no-optimize",
        dest="optimize",
        action="store_false",
        help="skip the ONNX Runtime-optimized <graph>.ort.onnx files",
    )
    p.add_argument(
        "--no-score-graph",
        dest="score_graph",
        action="store_false",
        help="skip score.onnx (all-position logits, used by kvforge compare for perplexity)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the modeling code a model directory ships (config.json's auto_map) for a family "
        "transformers does not include; without it such a directory is refused",
    )
    # Debugging: trace every decoder layer instead of copying a traced one (kvforge.compile.replicate).
    p.add_argument("--full-trace", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--pack-tied-lm-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ORT graphs: let ONNX Runtime pack a lm_head tied to the embedding table (default: a faster "
        "decode step; the table is held about once, the embedding lookup reading only the rows it needs); "
        "--no-pack-tied-lm-head reads the table in place, unpacked (slower, ~one table's size less memory)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(run=_run_compile)


def _run_compile(args: argparse.Namespace) -> int:
    # Importing torch, onnx, onnxscript and transformers' parts makes ~1M objects and almost no
    # garbage: without the collector meanwhile, its ~5 full collections (0.3 s) are not run.
    collecting = gc.isenabled()
    gc.disable()
    try:
        from kvforge.compile import compile_model
        from kvforge.compile.pipeline import stderr_progress
    finally:
        if collecting:
            gc.enable()

    manifest = compile_model(
        args.model_dir,
        args.out,
        dtype=args.dtype,
        max_batch=args.max_batch,
        max_seq=args.max_seq,
        lowering=args.lowering,
        score_graph=args.score_graph,
        quantize=args.quantize,
        block_size=args.block_size,
        optimize=args.optimize,
        target=args.target,
        max_prompt=args.max_prompt,
        gpu_memory=args.gpu_memory,
        trust_remote_code=args.trust_remote_code,
        full_trace=args.full_trace,
        pack_tied_lm_head=args.pack_tied_lm_head,
        revision=args.revision,
        symmetric=args.symmetric,
        quantize_lm_head=args.quantize_lm_head,
        lm_head=args.lm_head,
        lm_head_block_size=args.lm_head_block_size,
        kv_dtype=args.kv_dtype,
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
    if args.target == "tensorrt" and not manifest.engines:
        from kvforge.graphs.environment import BUILD_HINT

        print(f"TensorRT engines not built here: {BUILD_HINT}")
    return 0  # the kvforge command then ends without the interpreter's teardown (entry)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="GPU memory plan (weights, KV cache, activations) before any build; no GPU needed")
    p.add_argument("source", metavar="MODEL_DIR|OUT", help="a Hugging Face model directory or a kvforge artifact")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="default float16")
    p.add_argument("--max-batch", type=int, default=None, help="default 4 (an artifact: its own)")
    p.add_argument("--max-seq", type=int, default=None, help="default 512 (an artifact: its own)")
    p.add_argument("--max-prompt", type=int, default=None, help="default max-seq (an artifact: its own)")
    p.add_argument(
        "--gpu-memory", default=None, metavar="SIZE", help="budget, e.g. 70GiB (default: this GPU's free memory)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    g = p.add_argument_group(
        "serving plan (--serve OUT: colocated vs prefill/decode workers under Poisson load, simulated)"
    )
    g.add_argument("--serve", action="store_true", help="plan serving layouts for the artifact OUT instead")
    g.add_argument("--rate", type=float, default=None, help="mean arrivals per second (Poisson; required)")
    g.add_argument("--prompt-lens", type=_int_list, default=[16, 32], metavar="N,N,...", help="prompt tokens, drawn")
    g.add_argument("--output-lens", type=_int_list, default=[16, 32], metavar="N,N,...", help="output tokens, drawn")
    _add_mix(g)
    g.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="TTFT objective, ms (required)")
    g.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="time per output token, ms (required)")
    g.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both (0.9)")
    g.add_argument("--cores", type=int, default=None, help="cores to split (default: this machine's)")
    g.add_argument(
        "--bench",
        action="append",
        default=None,
        metavar="JSON",
        help="latencies from `kvforge bench OUT --json` reports (one per thread count; repeat the flag) "
        "instead of measuring the artifact here",
    )
    g.add_argument("--requests", type=int, default=1000, help="simulated requests (default 1000)")
    g.add_argument("--seed", type=int, default=0, help="seed of the arrivals and lengths (default 0)")
    g.add_argument(
        "--scale", type=_int_list, default=[], metavar="N,N,...", help="also predict larger machines (e.g. 8,16,32)"
    )
    g.add_argument(
        "--thread-speedup",
        type=_speedups,
        default=None,
        metavar="P,D",
        help="prefill and decode speed-up per doubling of threads beyond those measured (default: as measured "
        "from 1 to 2 threads)",
    )
    p.set_defaults(run=_run_plan)


_SERVE_PLAN_ONLY = ("rate", "slo_ttft", "slo_tpot", "cores", "bench", "scale", "thread_speedup")


def _speedups(text: str) -> tuple[float, float]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or not all(1 <= v <= 2 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected two speed-ups in [1, 2] such as 1.8,1.6 (prefill,decode), got {text!r}"
        )
    return values  # type: ignore[return-value]


_MEMORY_PLAN_ONLY = ("dtype", "max_batch", "max_seq", "max_prompt", "gpu_memory")


def _run_serve_plan(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvforge.graphs import manifest
    from kvforge.tools.serveplan import latency, planner

    given = [f"--{name.replace('_', '-')}" for name in _MEMORY_PLAN_ONLY if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} belong to the GPU memory plan, not to --serve; drop them")
    missing = [f"--{n.replace('_', '-')}" for n in ("rate", "slo_ttft", "slo_tpot") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"plan --serve needs {', '.join(missing)} (e.g. --rate 0.5 --slo-ttft 2000 --slo-tpot 150)")
    cores = args.cores if args.cores is not None else os.cpu_count() or 1
    if cores < 1:
        raise ValueError(f"--cores must be at least 1, got {cores}")
    workload = planner.Workload(
        rate=args.rate,
        prompt_lens=tuple(args.prompt_lens),
        output_lens=tuple(args.output_lens),
        requests=args.requests,
        long_fraction=args.long_fraction,
        long_lens=tuple(args.long_lens),
        seed=args.seed,
    )
    slo = planner.Objectives(args.slo_ttft, args.slo_tpot, args.attainment)
    slo.check()
    workload.check(manifest.read(Path(args.source), verify=False).limits.max_seq)  # before any measuring
    if args.bench:
        table = latency.from_bench(args.source, args.bench)
    else:
        threads = sorted({1, min(2, cores), min(cores, os.cpu_count() or 1)})
        print(f"measuring {args.source} on {', '.join(map(str, threads))} thread(s)...", file=sys.stderr)
        table = latency.measure(args.source, threads, seed=args.seed)
    table.speedup = args.thread_speedup
    result = planner.plan_serving(table, workload, slo, cores, tuple(args.scale))
    print(json.dumps(result, indent=2) if args.json else planner.format_plan(result))
    return 0 if result["recommended"] else 1  # a script can test it: 1 when no layout meets the SLOs


def _run_plan(args: argparse.Namespace) -> int:
    import json

    if args.serve:
        return _run_serve_plan(args)
    given = [f"--{name.replace('_', '-')}" for name in _SERVE_PLAN_ONLY if getattr(args, name)]
    if given:
        raise ValueError(f"{', '.join(given)} plan serving layouts: add --serve (kvforge plan --serve OUT ...)")

    from kvforge.compile import plan as memory_plan
    from kvforge.graphs import environment

    free, name = None, None
    if args.gpu_memory is None:
        gpu = environment.cuda_gpu()
        if not isinstance(gpu, str):
            free, name = gpu.free_bytes, gpu.name
    plan = memory_plan.plan_for(
        args.source,
        dtype=args.dtype,
        max_batch=args.max_batch,
        max_seq=args.max_seq,
        max_prompt=args.max_prompt,
        gpu_memory=args.gpu_memory,
        free_bytes=free,
        gpu_name=name,
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else memory_plan.format_plan(plan))
    return 1 if plan.fits is False else 0  # a script can test the fit: 1 when it does not fit


def _add_build(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build (or rebuild) an artifact's TensorRT engine on this GPU")
    p.add_argument("artifact", metavar="OUT", help="artifact compiled with --target tensorrt (the onnx lowering)")
    p.add_argument(
        "--gpu-memory", default=None, metavar="SIZE", help="memory budget, e.g. 70GiB (default: the GPU's free memory)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(run=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    from kvforge.compile import tensorrt as tensorrt_stage
    from kvforge.compile.pipeline import stderr_progress

    record = tensorrt_stage.build_checked(
        args.artifact, gpu_memory=args.gpu_memory, progress=None if args.quiet else stderr_progress
    )
    print(
        f"built {record.plan_file} for {record.gpu_name} (compute {record.compute_capability}, TensorRT "
        f"{record.tensorrt_version}) in {record.build_seconds:.1f}s -> {args.artifact}; KV cache "
        + ("aliased (updated in place)" if record.cache_aliased else "not aliased (two caches, alternated)")
    )
    return 0


def _add_sampling(p: argparse.ArgumentParser) -> None:
    """The sampling flags of generate and chat; each one left out takes the model's default
    (generation_config.json; greedy unless it says do_sample)."""
    g = p.add_argument_group("sampling (default: the model's generation_config.json; greedy without one)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="0 = off")
    g.add_argument("--top-p", type=float, default=None, help="(0, 1]; 1 = off")
    g.add_argument("--min-p", type=float, default=None, help="[0, 1]; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=None, help="> 0; 1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2] (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2] (default 0)")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: fresh entropy)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")


def _sampling(args: argparse.Namespace):
    from kvforge.runtime import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )


def _add_speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        default=None,
        metavar="ngram[:K]",
        help="speculative decoding: 'ngram' / 'ngram:K' (prompt-lookup drafts, up to K per step, default 8), "
        "'draft[:K]' (default 4) "
        "with --draft, 'prediction' (only requests' predictions; serve's default); greedy output stays "
        "plain decoding's, bit for bit with an artifact compiled with --lowering exact (gqa/onnx: up to near-ties)",
    )
    p.add_argument(
        "--draft", default=None, metavar="DRAFT_OUT", help="a draft model: a kvforge artifact, same tokenizer"
    )


def _add_prefill(p: argparse.ArgumentParser) -> None:
    from kvforge.runtime.ov_prefill import CHOICES

    p.add_argument(
        "--prefill",
        default="ort",
        choices=CHOICES,
        help="where prompts are prefilled: ONNX Runtime (default); int8: ONNX Runtime's integer GEMM for an int4 "
        "artifact's projections (prompts of 2+ tokens, ~a third of the time to first token, at a perplexity cost); "
        "fp32: float activations on an int4 artifact's projections (0.7x the time on CPUs without AMX, exact); "
        "openvino / openvino:bf16: OpenVINO's CPU plugin at f32 or bf16 (prompts of 32+ tokens; "
        "pip install 'kvforge[openvino]'); decode stays on ONNX Runtime",
    )


def _speculative(args: argparse.Namespace) -> dict:
    """Engine.load's speculative/draft arguments (checked before the model loads)."""
    from kvforge.runtime.speculative import parse_speculative

    parse_speculative(args.speculative, args.draft)
    return {"speculative": args.speculative, "draft": args.draft}


def _note_near_ties(args: argparse.Namespace, lowering: str) -> None:
    """Say once, on stderr, what drafting keeps of greedy output when the user asked for drafts on
    an artifact whose verify calls round differently from its one-token steps."""
    if (args.speculative or args.draft) and lowering != "exact":
        print(
            f"kvforge: note: speculative decoding on a {lowering!r}-lowered artifact keeps greedy output up to "
            "near-ties (two best logits within ~1e-5 in float32, ~0.6 in int4 may swap); compile with "
            "--lowering exact for plain decoding's tokens bit for bit",
            file=sys.stderr,
        )


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a compiled artifact (streams one prompt)")
    p.add_argument("artifact", help="artifact directory written by kvforge compile")
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    _add_sampling(p)
    _add_speculative(p)
    _add_prefill(p)
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from kvforge.runtime import Engine

    sampling = _sampling(args)  # bad values fail before the model loads
    with Engine.load(args.artifact, threads=args.threads, prefill=args.prefill, **_speculative(args)) as engine:
        _note_near_ties(args, engine.manifest.lowering)
        if len(args.prompt) == 1:  # stream: prompt, then each chunk as it is produced
            chunks = engine.stream(args.prompt[0], args.max_new_tokens, sampling, args.stop)
            print(args.prompt[0], end="", flush=True)
            for chunk in chunks:
                print(chunk.text, end="", flush=True)
            print()
            return 0
        results = engine.generate(args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop)
    for prompt, result in zip(args.prompt, results):
        print(f"--- {prompt!r} ({result.finish_reason})")
        print(prompt + result.text)
    return 0


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat with a model that has a chat template")
    p.add_argument("artifact", help="artifact directory written by kvforge compile")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message before the first turn")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per reply (default 256)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    _add_sampling(p)
    _add_speculative(p)
    _add_prefill(p)
    p.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from kvforge.runtime import ChatTemplate, Engine
    from kvforge.tools.chat import chat_loop

    sampling = _sampling(args)
    ChatTemplate.require(args.artifact)  # a model without a template fails before reading stdin
    with Engine.load(args.artifact, threads=args.threads, prefill=args.prefill, **_speculative(args)) as engine:
        _note_near_ties(args, engine.manifest.lowering)
        chat_loop(engine, sys.stdin, sys.stdout, sys.stderr, args.system, args.max_new_tokens, sampling, args.stop)
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


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 32,128, got {text!r}")
    return values


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="accuracy of an artifact against transformers on the same inputs")
    p.add_argument("artifact", help="artifact directory written by kvforge compile")
    p.add_argument("--reference", required=True, metavar="MODEL_DIR", help="the Hugging Face model directory")
    p.add_argument("--prompts", default=None, metavar="FILE", help="one prompt per line (default: bundled prompts)")
    p.add_argument("--text", default=None, metavar="FILE", help="text for the perplexity (default: bundled text)")
    p.add_argument("--steps", type=int, default=None, help="decode and greedy steps per prompt (default 32)")
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="perplexity windows of max_seq tokens start this far apart; each scores only the tokens the "
        "previous did not (default max_seq: non-overlapping windows)",
    )
    p.add_argument("--atol", type=float, default=None, help="max |logit diff| allowed (default by dtype: fp32 1e-3)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON (docs/tools.md)")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the per-step differences")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the artifact's files")
    p.add_argument("--threads", type=int, default=None, help="threads for both sides (default: all cores)")
    _add_device_flags(p)
    p.set_defaults(run=_run_compare)


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where kvforge runs (default cpu)")
    p.add_argument(
        "--backend", default="ort", choices=["ort", "tensorrt"], help="ort (CPU or CUDA provider) or tensorrt (cuda)"
    )


def _run_compare(args: argparse.Namespace) -> int:
    from kvforge.tools import compare
    from kvforge.tools.report import Progress, pyplot, write_json

    if args.plot:
        pyplot()  # fail before the work when matplotlib is missing
    result = compare.run_compare(
        args.artifact,
        args.reference,
        compare.load_prompts(args.prompts),
        compare.load_text(args.text),
        steps=compare.DEFAULT_STEPS if args.steps is None else args.steps,
        atol=args.atol,
        verify=not args.no_verify,
        threads=args.threads,
        progress=Progress("compare"),
        device=args.device,
        backend=args.backend,
        stride=args.stride,
    )
    print(compare.format_report(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    if args.plot:
        print(f"wrote {compare.plot_compare(result, args.plot)}")
    return 0 if result["verdict"]["ok"] else 1


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="latency, throughput and memory of an artifact (and of transformers)")
    p.add_argument("artifact", help="artifact directory written by kvforge compile")
    p.add_argument("--reference", default=None, metavar="MODEL_DIR", help="also time transformers eager on it")
    # Defaults live in BenchOptions; None here means "not given".
    p.add_argument(
        "--prompt-lens", type=_int_list, default=None, metavar="N,N,...", help="default 32,128,512 (capped to fit)"
    )
    p.add_argument("--batch-sizes", type=_int_list, default=None, metavar="N,N,...", help="default 1,4 (capped)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per row (default 32)")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per cell (default 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per cell first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="threads for both sides (default: all cores)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON (docs/tools.md)")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the timings")
    p.add_argument(
        "--speculative", default=None, metavar="ngram[:K]", help="also time generation with these drafts (and without)"
    )
    _add_device_flags(p)
    _add_prefill(p)
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from kvforge.tools import bench
    from kvforge.tools.report import pyplot, write_json

    if args.plot:
        pyplot()
    given = {
        "prompt_lens": tuple(args.prompt_lens) if args.prompt_lens else None,
        "batch_sizes": tuple(args.batch_sizes) if args.batch_sizes else None,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "warmup": args.warmup,
        "threads": args.threads,
        "device": args.device,
        "backend": args.backend,
        "speculative": args.speculative,
        "prefill": args.prefill,
    }
    options = bench.BenchOptions(**{name: value for name, value in given.items() if value is not None})
    result = bench.run_bench(args.artifact, args.reference, options)
    print(bench.format_report(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    if args.plot:
        print(f"wrote {bench.plot_bench(result, args.plot)}")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="graphs, I/O, op histogram, file sizes and a TensorRT compatibility check")
    p.add_argument("artifact", help="artifact directory (or a single .onnx file)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON (docs/tools.md)")
    p.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from kvforge.tools import inspect_artifact
    from kvforge.tools.report import write_json

    result = inspect_artifact.inspect(args.artifact)
    print(inspect_artifact.format_report(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from kvforge.graphs import manifest as mf

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (one process, or Ray Serve replicas)")
    p.add_argument("artifact", help="artifact directory written by kvforge compile")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="sequences that may wait for a cache row beyond max_batch; more get HTTP 429 (default 64)",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads per engine")
    p.add_argument(
        "--prefix-cache",
        default=None,
        metavar="SIZE",
        help="host memory for the automatic prefix cache, e.g. 512MiB, 2GB; 0 disables (default 512MiB on CPU)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the artifact dir's name)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse request fields outside OpenAI's schema with HTTP 400 (default: ignore them, log a warning "
        "and name them in the x-kvforge-ignored-fields response header)",
    )
    p.add_argument(
        "--tool-parser",
        default=None,
        choices=list(mf.TOOL_PARSERS),
        help="how the model writes tool calls (default: the manifest's, chosen at compile time from the chat "
        "template; hermes for artifacts compiled before)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=[*mf.REASONING_PARSERS, "none"],
        help="how the model writes its reasoning, returned as reasoning_content (default: the manifest's; none: "
        "leave it in the content)",
    )
    _add_speculative(p)
    _add_prefill(p)
    disagg = p.add_argument_group("disaggregated prefill/decode (worker processes on this machine)")
    disagg.add_argument(
        "--prefill-workers",
        type=int,
        default=None,
        metavar="P",
        help="prefill worker processes (with --decode-workers: prompts are prefilled there, their KV handed to a "
        "decode worker through shared memory)",
    )
    disagg.add_argument("--decode-workers", type=int, default=None, metavar="D", help="decode worker processes")
    disagg.add_argument(
        "--threads-per-worker", type=int, default=None, metavar="T", help="ONNX Runtime threads of each worker"
    )
    disagg.add_argument(
        "--worker-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="a worker silent this many seconds (no heartbeat) leaves routing until it answers again (default 5)",
    )
    disagg.add_argument(
        "--no-lend-rows",
        dest="lend_rows",
        action="store_false",
        help="prefill workers copy each hand-off's KV into a shared-memory arena (two copies) instead of lending "
        "the decode worker their cache row (one copy; the default)",
    )
    ray = p.add_argument_group("Ray Serve (scale-out)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="deploy on Ray Serve instead of one process (with --prefill-workers/--decode-workers: the two roles "
        "and an ingress as deployments, the KV through Ray's object store)",
    )
    ray.add_argument("--replicas", type=int, default=1, help="replicas, each with its own engine (default 1)")
    ray.add_argument("--address", default=None, help="join this Ray cluster (auto, ray://HOST:10001); default: local")
    ray.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local cluster (default: all)")
    ray.add_argument(
        "--replica-cpus", type=float, default=None, help="CPUs reserved per replica or worker (fractions allowed)"
    )
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:  # before anything loads
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.num_cpus is not None and args.num_cpus < 1:
        raise ValueError(f"--num-cpus must be at least 1, got {args.num_cpus}")
    if args.replica_cpus is not None and not 0 < args.replica_cpus < float("inf"):
        raise ValueError(f"--replica-cpus must be a positive number, got {args.replica_cpus}")
    try:
        from kvforge.tools.serve import runner, serving
    except ImportError as e:
        raise ValueError(f"kvforge serve needs the serve extra: pip install 'kvforge[serve]' ({e})") from e
    speculative = _speculative(args)
    if args.prefill != "ort" and (args.ray or args.prefill_workers is not None or args.decode_workers is not None):
        raise ValueError(
            f"--prefill {args.prefill} runs in the one-process server for now; drop it or --ray and the worker flags"
        )
    if (args.tool_parser or args.reasoning_parser) and (
        args.ray or args.prefill_workers is not None or args.decode_workers is not None
    ):
        raise ValueError(
            "--tool-parser/--reasoning-parser run in the one-process server for now; drop them (the manifest's "
            "parsers are used) or --ray and the worker flags"
        )
    if args.ray:
        if args.speculative or args.draft:
            raise ValueError("--speculative/--draft run in the one-process server for now; drop --ray or them")
        from kvforge.tools.serve.ray_app import ReplicaSettings, serve_ray

        disagg = args.prefill_workers is not None or args.decode_workers is not None
        settings = ReplicaSettings(
            args.artifact,
            args.threads_per_worker if disagg else args.threads,
            args.served_model_name,
            args.max_queue,
            args.api_key,
            args.strict_fields,
            args.prefix_cache,
        )
        cluster = dict(host=args.host, port=args.port, address=args.address, num_cpus=args.num_cpus)
        if disagg:  # the prefill, decode and ingress roles as Ray Serve deployments
            if args.prefill_workers is None or args.decode_workers is None:
                raise ValueError("--ray with workers needs both --prefill-workers and --decode-workers (each >= 1)")
            from kvforge.tools.serve.disagg.ray_roles import serve_disagg_ray

            serve_disagg_ray(
                settings,
                prefill_workers=args.prefill_workers,
                decode_workers=args.decode_workers,
                worker_cpus=args.replica_cpus,
                **cluster,
            )
            return 0
        serve_ray(settings, replicas=args.replicas, replica_cpus=args.replica_cpus, **cluster)
        return 0
    runner.log_like_uvicorn(args.log_level)  # from here: the load's own lines in the server's layout
    if args.prefill_workers is not None or args.decode_workers is not None:
        server = _disaggregated(args)
    else:
        server = serving.ModelServer.load(
            args.artifact,
            threads=args.threads,
            model_name=args.served_model_name,
            max_queue=args.max_queue,
            prefix_cache=args.prefix_cache,
            tool_parser=args.tool_parser,
            reasoning_parser=args.reasoning_parser,
            prefill=args.prefill,
            **speculative,
        )
        _note_near_ties(args, server.engine.manifest.lowering)
    runner.serve_local(
        server,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        log_level=args.log_level,
        strict_fields=args.strict_fields,
    )
    return 0


def _disaggregated(args: argparse.Namespace):
    """The router over ``--prefill-workers`` + ``--decode-workers`` worker processes (started and
    loaded when this returns)."""
    if args.prefill_workers is None or args.decode_workers is None:
        raise ValueError("a disaggregated server needs both --prefill-workers and --decode-workers (each >= 1)")
    if args.speculative or args.draft:
        raise ValueError("--speculative/--draft run in the one-process server for now; drop them or the worker flags")
    if args.threads is not None:
        raise ValueError("--threads is the one-process server's; with worker processes use --threads-per-worker")
    from kvforge.tools.serve.disagg.router import DisaggServer

    return DisaggServer.load(
        args.artifact,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        threads_per_worker=args.threads_per_worker,
        model_name=args.served_model_name,
        max_queue=args.max_queue,
        prefix_cache=args.prefix_cache,
        worker_timeout=args.worker_timeout,
        lend_rows=args.lend_rows,
    )


def _add_loadtest(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="Poisson load against an OpenAI-compatible endpoint: throughput, TTFT, goodput")
    p.add_argument("url", help="base URL of the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson; inf: all at once)")
    p.add_argument("--requests", type=int, default=32, help="requests to send (default 32)")
    p.add_argument(
        "--prompt-lens", type=_int_list, default=[16, 32], metavar="N,N,...", help="prompt lengths in words, drawn"
    )
    p.add_argument(
        "--output-lens", type=_int_list, default=[16, 32], metavar="N,N,...", help="max_tokens values, drawn"
    )
    p.add_argument("--slo-ttft", type=float, default=1000.0, metavar="MS", help="TTFT objective, ms (default 1000)")
    p.add_argument("--slo-tpot", type=float, default=100.0, metavar="MS", help="time per output token, ms (100)")
    p.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="WORDS",
        help="every prompt starts with the same WORDS words (a shared system prompt; default 0)",
    )
    _add_mix(p)
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server needs one")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and lengths (default 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, s (default 300)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of latencies over time")
    p.set_defaults(run=_run_loadtest)


def _add_mix(p: argparse.ArgumentParser) -> None:
    """The mixed workload's flags (loadtest and plan --serve): long prompts among short ones."""
    p.add_argument(
        "--long-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="share of requests with a long prompt drawn from --long-lens (a mixed workload; default 0)",
    )
    p.add_argument(
        "--long-lens", type=_int_list, default=[1000, 1500], metavar="N,N,...", help="long prompt lengths, drawn"
    )


def _run_loadtest(args: argparse.Namespace) -> int:
    from kvforge.tools import loadtest
    from kvforge.tools.report import pyplot, write_json

    if args.plot:
        pyplot()
    options = loadtest.LoadOptions(
        rate=args.rate,
        requests=args.requests,
        prompt_lens=tuple(args.prompt_lens),
        output_lens=tuple(args.output_lens),
        slo_ttft_ms=args.slo_ttft,
        slo_tpot_ms=args.slo_tpot,
        concurrency=args.concurrency,
        model=args.model,
        api_key=args.api_key,
        seed=args.seed,
        timeout_s=args.timeout,
        shared_prefix=args.shared_prefix,
        long_fraction=args.long_fraction,
        long_lens=tuple(args.long_lens),
    )
    result = loadtest.run_loadtest(args.url, options)
    print(loadtest.format_report(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    if args.plot:
        print(f"wrote {loadtest.plot_loadtest(result, args.plot)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_compile(sub)
    _add_plan(sub)
    _add_build(sub)
    _add_generate(sub)
    _add_chat(sub)
    _add_demo(sub)
    _add_compare(sub)
    _add_bench(sub)
    _add_inspect(sub)
    _add_serve(sub)
    _add_loadtest(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand in this process; returns its exit status."""
    return _run(build_parser().parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    try:
        return args.run(args)
    except ValueError as e:  # every user-facing error (ModelDirError, ArtifactError, ...) is a ValueError
        print(f"kvforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvforge: interrupted", file=sys.stderr)
        return 130


def entry() -> NoReturn:
    """The ``kvforge`` command (and ``python -m kvforge.tools.cli``): one subcommand, then the exit.

    A compile that succeeded ends the process at once, stdout and stderr flushed, without the
    interpreter's teardown. The artifact is written and closed by then; the teardown would only
    walk the ~700k objects that tracing leaves in torch's, sympy's and the exporter's caches in each
    of its final garbage collections (seconds: 4 s on the SmolLM-135M shape), and extension
    libraries would report what is still alive as leaks (where torch finds triton installed, as
    with CUDA builds of torch, it imports it, and triton's nanobind bindings print "nanobind:
    leaked ... instances/types/functions" at exit). Other subcommands exit normally: ``serve
    --ray``'s teardown stops its local Ray cluster."""
    args = build_parser().parse_args()
    code = _run(args)
    if code == 0 and args.command == "compile":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    entry()
