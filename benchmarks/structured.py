"""What structured output costs a decode step: kvforge with and without a JSON-schema constraint,
beside onnxruntime-genai's guidance on the same model, schema and threads.

kvforge side (one process, one engine): a :class:`~kvforge.runtime.batching.BatchLoop` on the
artifact's rows runs each case, greedy: ``b1 free`` (one unconstrained row), ``b1 json`` (one row
constrained by ``SCHEMA``), ``b8 free``, ``b8 1json`` (one constrained row among seven free ones) and
``b8 json`` (eight constrained rows). Every step is timed (``loop.step()``: decode, mask, sample,
accept, detokenize), and only the steps where every row of the case is decoding count (no prefill,
no row finished). The cases take turns ``--rounds`` times, so the machine's load falls on each
alike; a case's figure is the median over all its counted steps; ratios are to the free case of the
same batch. Mask time: each constrained row's tokens are replayed through a fresh constraint and
``fill_mask`` (llguidance's bitmask) and ``mask`` (bitmask + applying it to a ``[V]`` row) timed per
step: p50 and p99.

genai side (``--genai DIR``, a model from its builder; the ``peer`` extra): batch 1, greedy, the
same prompt tokens, ``--steps`` steps with ``set_guidance("json_schema", SCHEMA)`` and without, on
``--threads`` intra-op threads (written into its genai_config.json), alternating with kvforge's
rounds.

    kvforge compile ~/.cache/kvforge/smollm2/hf -o /tmp/smollm2 --max-seq 512 --max-batch 8
    python -m onnxruntime_genai.models.builder -i ~/.cache/kvforge/smollm2/hf -o /tmp/genai -p fp32 -e cpu
    python benchmarks/structured.py /tmp/smollm2 --genai /tmp/genai --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.batching import BatchLoop

# A long free-text field keeps a constrained row alive for every timed step.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "skills": {"type": "array", "items": {"enum": ["python", "rust", "c", "go"]}, "maxItems": 4},
        "bio": {"type": "string", "minLength": 600},
    },
    "required": ["name", "age", "skills", "bio"],
    "additionalProperties": False,
}
FREE_PROMPT = "Write a long story about a dragon who learns to cook."
JSON_PROMPT = "Describe a software engineer as a JSON object with name, age, skills and a long bio."
CASES = (("b1 free", 1, 0), ("b1 json", 1, 1), ("b8 free", 8, 0), ("b8 1json", 8, 1), ("b8 json", 8, 8))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def chat_ids(engine: Engine, text: str) -> list[int]:
    return engine.chat_prompt([{"role": "user", "content": text}])


def run_case(engine: Engine, batch: int, constrained: int, steps: int) -> tuple[list[float], list]:
    """Step times (s) of the steps with every row decoding, and the constrained generations."""
    free = SamplingParams(temperature=0.0)
    json_sp = SamplingParams(temperature=0.0, json_schema=SCHEMA)
    gens = [
        engine.request(
            chat_ids(engine, JSON_PROMPT if i < constrained else FREE_PROMPT),
            steps + 4,
            json_sp if i < constrained else free,
        )
        for i in range(batch)
    ]
    times = []
    with engine.own_rows(gens) as rows:
        loop = BatchLoop(engine, rows)
        for g in gens:
            g.sink = lambda chunk: None
            loop.add(g)
        while not loop.idle and len(times) < steps:
            full = len(loop.decoding) == batch and loop.filling is None and not loop.waiting
            start = time.perf_counter()
            loop.step()
            elapsed = time.perf_counter() - start
            if full and len(loop.decoding) == batch:
                times.append(elapsed)
        while not loop.idle:
            for g in gens:
                g.cancel()
            loop.step()
    return times, gens[:constrained]


def mask_times(engine: Engine, gens: list) -> tuple[list[float], list[float]]:
    """Per step: llguidance's bitmask alone, and bitmask + applying it to a logits row (s)."""
    fill, full = [], []
    row = np.zeros(engine.vocab_size, dtype=np.float32)
    for g in gens:
        for measure, out in ((False, fill), (True, full)):
            c = engine.grammars.new("json_schema", SCHEMA)
            for token in g.token_ids:
                start = time.perf_counter()
                c.mask(row) if measure else c.fill_mask()
                out.append(time.perf_counter() - start)
                c.accept([token])
    return fill, full


def genai_run(model, ids: list[int], steps: int, guided: bool) -> list[float]:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + steps + 2, do_sample=False)
    if guided:
        params.set_guidance("json_schema", json.dumps(SCHEMA))
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([ids], dtype=np.int32))
    generator.generate_next_token()
    times = []
    for _ in range(steps):
        if generator.is_done():
            break
        start = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - start)
    return times


def set_genai_threads(genai_dir: Path, threads: int) -> None:
    config_file = genai_dir / "genai_config.json"
    config = json.loads(config_file.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config_file.write_text(json.dumps(config, indent=4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--genai", type=Path, help="onnxruntime-genai model directory of the same checkpoint")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    engine = Engine.load(args.artifact, threads=args.threads)
    engine.grammars.tokenizer()  # built once per engine: not part of any step
    times: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    constrained_gens: list = []
    og_model, genai_times = None, {"genai free": [], "genai json": []}
    if args.genai:
        import onnxruntime_genai as og

        set_genai_threads(args.genai, args.threads)
        og_model = og.Model(str(args.genai))
    json_ids = chat_ids(engine, JSON_PROMPT)
    run_case(engine, 1, 1, 4)  # warm-up
    for _ in range(args.rounds):
        for name, batch, constrained in CASES:
            t, gens = run_case(engine, batch, constrained, args.steps)
            times[name] += t
            constrained_gens += gens
        if og_model is not None:
            for guided in (False, True):
                genai_times["genai json" if guided else "genai free"] += genai_run(
                    og_model, json_ids, args.steps, guided
                )
    fill, full = mask_times(engine, constrained_gens[:8])
    out: dict = {"threads": args.threads, "vocab": engine.vocab_size, "steps": args.steps, "rounds": args.rounds}
    for name, ts in {**times, **(genai_times if og_model is not None else {})}.items():
        out[name] = {"ms_step_p50": statistics.median(ts) * 1e3 if ts else None, "steps_counted": len(ts)}
    for name, base in (
        ("b1 json", "b1 free"),
        ("b8 1json", "b8 free"),
        ("b8 json", "b8 free"),
        ("genai json", "genai free"),
    ):
        if name in out and out[name]["ms_step_p50"] and out[base]["ms_step_p50"]:
            out[name]["vs_free"] = out[name]["ms_step_p50"] / out[base]["ms_step_p50"]
    out["mask_fill_ms"] = {"p50": pct(fill, 50) * 1e3, "p99": pct(fill, 99) * 1e3, "n": len(fill)}
    out["mask_fill_apply_ms"] = {"p50": pct(full, 50) * 1e3, "p99": pct(full, 99) * 1e3, "n": len(full)}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")
    engine.close()


if __name__ == "__main__":
    main()
