"""Decode step time of two or more kvforge artifacts of the same model, interleaved in one process.

A lever's effect (a compile change) is a few percent of a step on a machine whose load moves the
step by 20%; timing "before" and "after" in separate runs measures the load. Here every artifact is
loaded once (one engine each, all held at once), then each round prefills the same prompt on each
engine in turn and times ``--steps`` greedy decode steps; the median step over all rounds is
reported per artifact with its node count and the ratio to the first artifact. Tokens must match
across artifacts (the levers change no value): the script says when they do not.

    python benchmarks/ab_decode.py BEFORE_DIR AFTER_DIR --threads 2 --rounds 5 --steps 32
    python benchmarks/ab_decode.py DIR DIR:spin=0 DIR:prepack=0    # one artifact, Engine.load options

``--genai DIR`` adds onnxruntime-genai's model of the same checkpoint (peer_genai.py builds one in its
work dir, with ``intra_op_num_threads`` in its genai_config.json) as one more side of every round:
the same prompt, the same number of ``generate_next_token`` steps, timed the same way.

An artifact may carry ``Engine.load`` options after a colon (``DIR:spin=0,prepack=0``; 0/1 for the
boolean options), so one artifact can also be compared with itself under other session settings.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from pathlib import Path

import numpy as np
import onnx

from kvforge.runtime import Engine


def nodes(artifact: Path) -> tuple[int, dict[str, int]]:
    graph = artifact / "prefill.ort.onnx"
    if not graph.exists():
        graph = artifact / "prefill.onnx"
    ops = collections.Counter(n.op_type for n in onnx.load(str(graph), load_external_data=False).graph.node)
    return sum(ops.values()), dict(ops.most_common())


def _spec(text: str) -> tuple[Path, dict[str, bool]]:
    """``DIR`` or ``DIR:spin=0,prepack=0`` -> (path, Engine.load options)."""
    path, _, options = text.partition(":")
    pairs = (item.split("=", 1) for item in options.split(",") if item)
    return Path(path), {key: bool(int(value)) for key, value in pairs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="+", help="DIR or DIR:option=value,... (Engine.load options)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--genai", type=Path, default=None, help="also time onnxruntime-genai's model in DIR")
    args = p.parse_args()
    print(f"load before: {os.getloadavg()}")
    specs = [_spec(a) for a in args.artifacts]
    engines = [Engine.load(path, threads=args.threads, **options) for path, options in specs]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, min(engines[0].vocab_size, 1000), args.prompt_len).tolist() for _ in range(args.batch)]
    steps: list[list[float]] = [[] for _ in engines]
    ttft: list[list[float]] = [[] for _ in engines]
    tokens: list[list[list[int]]] = [[] for _ in engines]
    genai_steps: list[float] = []
    genai_tokens: list[list[int]] = []
    for _ in range(args.rounds + 1):  # round 0: warm-up, untimed
        if args.genai:
            times, genai_tokens = _genai_round(args.genai, prompts, args.steps)
            genai_steps.extend(times if _ else [])
        for i, engine in enumerate(engines):
            ids = np.zeros(args.batch, dtype=np.int64)
            start = time.perf_counter()
            np.argmax(engine.prefill(prompts), axis=-1, out=ids)
            ttft[i].append(time.perf_counter() - start)
            out = [ids.tolist()]
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                np.argmax(engine.decode(ids), axis=-1, out=ids)
                times.append(time.perf_counter() - start)
                out.append(ids.tolist())
            steps[i].extend(times if len(ttft[i]) > 1 else [])
            tokens[i] = out
    print(f"load after: {os.getloadavg()}")
    base = statistics.median(steps[0])
    for i, (artifact, label) in enumerate(zip((path for path, _ in specs), args.artifacts)):
        n, _ = nodes(artifact)
        med = statistics.median(steps[i])
        same = "same tokens" if tokens[i] == tokens[0] else "TOKENS DIFFER"
        print(
            f"{Path(label).name}: nodes {n}, step p50 {med * 1e3:.2f} ms (mean {statistics.mean(steps[i]) * 1e3:.2f},"
            f" p10 {_p10(steps[i]) * 1e3:.2f}, min {min(steps[i]) * 1e3:.2f};"
            f" p10 ratio {_p10(steps[i]) / _p10(steps[0]):.3f}),"
            f" ttft p50 {statistics.median(ttft[i][1:]) * 1e3:.1f} ms, ratio {med / base:.3f}, {same}"
        )
    if args.genai:
        med = statistics.median(genai_steps)
        same = "same tokens" if genai_tokens == [list(col) for col in zip(*tokens[0])] else "tokens differ"
        print(
            f"genai {args.genai.name}: step p50 {med * 1e3:.2f} ms (p10 {_p10(genai_steps) * 1e3:.2f},"
            f" min {min(genai_steps) * 1e3:.2f}), ratio {med / base:.3f} (vs the first), {same}"
        )
        for i, label in enumerate(args.artifacts):
            p50, p10 = statistics.median(steps[i]) / med, _p10(steps[i]) / _p10(genai_steps)
            print(f"  {Path(label).name} / genai: p50 {p50:.3f}, p10 {p10:.3f}")
    for engine in engines:
        engine.close()


def _p10(times: list[float]) -> float:
    """The 10th percentile: on a shared machine the fast steps are the ones that had the cores."""
    return statistics.quantiles(times, n=10)[0]


_GENAI: dict = {}


def _genai_round(model_dir: Path, prompts: list[list[int]], steps: int) -> tuple[list[float], list[list[int]]]:
    """Prefill ``prompts`` with onnxruntime-genai, then ``steps`` timed decode steps (seconds each)
    and every row's generated ids."""
    import onnxruntime_genai as og

    model = _GENAI.setdefault("model", og.Model(str(model_dir)))
    ids = np.asarray(prompts, dtype=np.int32)
    batch, length = ids.shape
    params = og.GeneratorParams(model)
    total = length + steps + 1
    params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=batch)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    generator.generate_next_token()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - start)
    tokens = [generator.get_sequence(b)[length:].tolist() for b in range(batch)]
    del generator
    return times, tokens


if __name__ == "__main__":
    main()
