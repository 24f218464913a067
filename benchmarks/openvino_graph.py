"""Can OpenVINO run kvforge's own graphs? A kvforge artifact's prefill graph on OpenVINO's CPU plugin
with the KV cache bound in place, against the same artifact on kvforge's engine (ONNX Runtime).

The OpenVINO side reads ``prefill.onnx`` (the graph before ORT's optimization) and binds every
``past_key_values.*`` input and its ``present.*`` output to the same numpy buffer
(``ov.Tensor(array, shared_memory=True)``), as kvforge's ORT backend binds one pointer to both; the
logits go into a buffer of their own. It runs the prompt (two warm-up calls first: OpenVINO prepares
each new input shape on its first call), then greedy decode steps through the same graph (timed:
the median step after the first), and saves the logits of every call. Run each side in its own
venv, the sides taking turns::

    ~/.cache/kvforge/peers/openvino-venv/bin/python benchmarks/openvino_graph.py ov OUT --new-tokens 17
    .venv/bin/python benchmarks/openvino_graph.py ort OUT --new-tokens 17

``engine ARTIFACT --prefill ort|openvino`` (kvforge's venv) times what a user gets from
``Engine.load(prefill=...)``: 5 prompts of random ids, each followed by 8 greedy steps, the median
TTFT of prompts 2-5, the median step and the process's peak RSS; run each side in a process of its
own, taking turns::

    .venv/bin/python benchmarks/openvino_graph.py engine ART --prefill openvino --prompt-len 128

``quality ARTIFACT --prefills ort openvino openvino:bf16`` (kvforge's venv) measures what each
prefill costs in accuracy, on the project's quality text (Genesis, KJV) with the artifact's own
tokenizer: ``--windows`` windows of ``--context`` ids, each prefilled (a one-row call: the
OpenVINO side's) and followed by ``--continue`` ids teacher-forced through decode steps (ORT, fp32,
reading the K/V the prefill wrote); the perplexity of every token after each context (the first
from the prefill's logits), the top-1 agreement with the ``ort`` side at those positions, and
greedy generation of ``--new-tokens`` from each context: the tokens equal to the ``ort`` side's
before the first difference::

    .venv/bin/python benchmarks/openvino_graph.py quality ART --prefills ort openvino openvino:bf16

``compare OUT`` (either venv) prints the largest logit difference per call between the two saved
runs. Findings: benchmarks/FINDINGS.md ("OpenVINO on kvforge's graph").
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

PREFILLS = ("ort", "openvino", "openvino:bf16")  # Engine.load(prefill=...); this venv may lack kvforge


def run_openvino(artifact: Path, prompt: list[int], new_tokens: int, threads: int, precision: str):
    import openvino as ov

    manifest = json.loads((artifact / "manifest.json").read_text())
    model, limits = manifest["model"], manifest["limits"]
    config = {"INFERENCE_NUM_THREADS": threads}
    if precision != "default":
        config["INFERENCE_PRECISION_HINT"] = precision
    compiled = ov.Core().compile_model(str(artifact / "prefill.onnx"), "CPU", config)
    request = compiled.create_infer_request()
    kv_heads, head_dim = model["num_kv_heads"], model["head_dim"]
    cache = np.zeros((model["num_layers"], 2, 1, kv_heads, limits["max_seq"], head_dim), np.float32)
    logits = np.zeros((1, model["vocab_size"]), np.float32)
    for layer in range(model["num_layers"]):
        for i, kind in enumerate(("key", "value")):
            shared = ov.Tensor(cache[layer, i], shared_memory=True)  # past and present: one buffer
            request.set_tensor(f"past_key_values.{layer}.{kind}", shared)
            request.set_tensor(f"present.{layer}.{kind}", shared)
    request.set_tensor("logits", ov.Tensor(logits, shared_memory=True))

    def call(ids: list[int], start: int) -> np.ndarray:
        n = len(ids)
        request.set_tensor("input_ids", ov.Tensor(np.array([ids], np.int64)))
        request.set_tensor("position_ids", ov.Tensor(np.arange(start, start + n, dtype=np.int64)[None]))
        request.set_tensor("write_indices", ov.Tensor(np.array([start], np.int64)))
        request.set_tensor("input_lengths", ov.Tensor(np.array([n], np.int64)))
        request.infer()
        return logits[0].copy()

    call.keep = (compiled, cache)  # the request and the shared tensors need both alive
    return call


def run_ort(artifact: Path, threads: int):
    from kvforge.runtime.engine import StepEngine

    engine = StepEngine.load(artifact, threads=threads, prefix_cache=0)

    def call(ids: list[int], start: int) -> np.ndarray:
        if start == 0:
            return engine.prefill([ids])[0].copy()
        return engine.decode(ids)[0].copy()

    return call


def run_engine(artifact: Path, prompt_len: int, threads: int, prefill: str) -> str:
    import resource

    from kvforge.runtime.engine import StepEngine

    engine = StepEngine.load(artifact, threads=threads, prefix_cache=0, prefill=prefill)
    rng = np.random.default_rng(1)
    ttfts, steps = [], []
    for _ in range(5):
        start = time.perf_counter()
        token = int(engine.prefill([rng.integers(100, 40000, prompt_len).tolist()])[0].argmax())
        ttfts.append((time.perf_counter() - start) * 1e3)
        for _ in range(8):
            start = time.perf_counter()
            token = int(engine.decode([token])[0].argmax())
            steps.append((time.perf_counter() - start) * 1e3)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (
        f"engine, prefill={prefill}: prompt {prompt_len}, TTFT first {ttfts[0]:.0f} ms, median of the rest "
        f"{np.median(ttfts[1:]):.1f} ms, {np.median(steps):.2f} ms/step, peak RSS {rss:.0f} MiB; load {os.getloadavg()}"
    )


def run_quality(artifact: Path, prefills: list[str], args) -> str:
    """Each prefill's perplexity of the text after prefilled contexts, its top-1 and greedy
    agreement with the first prefill's (see the module docstring)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import load_text
    from tokenizers import Tokenizer

    from kvforge.runtime import Engine

    span = args.context + args.continue_ids
    ids = Tokenizer.from_file(str(artifact / "tokenizer.json")).encode(load_text(None)).ids
    if len(ids) < args.windows * span:
        raise SystemExit(f"the text has {len(ids)} ids, fewer than {args.windows} windows of {span}")
    windows = [ids[w * span : (w + 1) * span] for w in range(args.windows)]
    seen: dict[str, dict] = {}
    for prefill in prefills:
        engine = Engine.load(artifact, threads=args.threads, prefix_cache=0, prefill=prefill)
        nll, argmax, greedy = [], [], []
        for window in windows:
            context, rest = window[: args.context], window[args.context :]
            rows = [engine.prefill([context])[0].astype(np.float64)]
            for token in rest[:-1]:
                rows.append(engine.decode([token])[0].astype(np.float64))
            logits = np.stack(rows)
            logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
            nll.extend(logz - logits[np.arange(len(rest)), rest])
            argmax.extend(logits.argmax(1).tolist())
            greedy.append(engine.generate([context], max_new_tokens=args.new_tokens)[0].token_ids)
        engine.close()
        seen[prefill] = {"ppl": float(np.exp(np.mean(nll))), "argmax": argmax, "greedy": greedy}
    base = seen[prefills[0]]
    lines = [
        f"{artifact.name}: {args.windows} windows of {args.context} prefilled + {args.continue_ids} teacher-forced ids "
        f"(Genesis), greedy {args.new_tokens} tokens per context; {args.threads} threads"
    ]
    for prefill, r in seen.items():
        top1 = np.mean([a == b for a, b in zip(r["argmax"], base["argmax"])])
        same = [
            next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
            for x, y in zip(r["greedy"], base["greedy"])
        ]
        lines.append(
            f"  prefill={prefill:14} perplexity {r['ppl']:.4f} ({r['ppl'] / base['ppl'] - 1:+.2%}), top-1 agreement "
            f"{top1:.2%}, greedy identical {sum(n == args.new_tokens for n in same)}/{len(same)}, same tokens before "
            f"the first difference {same}"
        )
    return "\n".join(lines)


def generate(call, prompt: list[int], new_tokens: int) -> dict:
    call(prompt, 0)
    call(prompt, 0)  # warm-up: each side prepares the prompt's shape once
    start = time.perf_counter()
    rows = [call(prompt, 0)]
    ttft = (time.perf_counter() - start) * 1e3
    tokens = [int(rows[0].argmax())]
    steps = []
    for i in range(new_tokens - 1):
        start = time.perf_counter()
        rows.append(call([tokens[-1]], len(prompt) + i))
        steps.append((time.perf_counter() - start) * 1e3)
        tokens.append(int(rows[-1].argmax()))
    step = float(np.median(steps[1:] or steps))  # the first step prepares the one-token shape
    return {"ttft_ms": ttft, "step_ms": step, "tokens": tokens, "logits": np.stack(rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("side", choices=("ov", "ort", "engine", "quality", "compare"))
    p.add_argument("artifact", type=Path)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=17)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="f32", help="OpenVINO's INFERENCE_PRECISION_HINT, or 'default'")
    p.add_argument("--prefill", choices=PREFILLS, default="openvino", help="the engine side's prefill")
    p.add_argument(
        "--prefills", nargs="+", choices=PREFILLS, default=list(PREFILLS), help="quality: the first is the base"
    )
    p.add_argument("--windows", type=int, default=8, help="quality: contexts from the text")
    p.add_argument("--context", type=int, default=448, help="quality: prefilled ids per window")
    p.add_argument("--continue-ids", type=int, default=64, help="quality: teacher-forced ids after each context")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    saved = {side: args.out / f"openvino-graph-{args.artifact.name}-{side}.npy" for side in ("ov", "ort")}
    if args.side == "compare":
        ov_logits, ort_logits = (np.load(saved[s]) for s in ("ov", "ort"))
        n = min(len(ov_logits), len(ort_logits))
        print("max |logit difference| per call:", np.abs(ov_logits[:n] - ort_logits[:n]).max(axis=1).round(6).tolist())
        return 0
    if args.side == "quality":
        print(run_quality(args.artifact, args.prefills, args))
        return 0
    if args.side == "engine":
        print(run_engine(args.artifact, args.prompt_len, args.threads, args.prefill))
        return 0
    prompt = np.random.default_rng(3).integers(100, 40000, args.prompt_len).tolist()
    if args.side == "ov":
        call = run_openvino(args.artifact, prompt, args.new_tokens, args.threads, args.precision)
    else:
        call = run_ort(args.artifact, args.threads)
    result = generate(call, prompt, args.new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(saved[args.side], result["logits"])
    print(
        f"{args.side}: prompt {args.prompt_len}, TTFT {result['ttft_ms']:.1f} ms, {result['step_ms']:.1f} ms/step, "
        f"tokens {result['tokens']}; load {os.getloadavg()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
