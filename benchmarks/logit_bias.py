"""What ``logit_bias`` costs (issue 27): the sampler per step, and greedy decoding end to end.

1. The sampler alone on one logits row of the artifact's vocabulary: a greedy row without a bias
   (``np.argmax``: what the batch loop does for plain-greedy rows), the same row with a bias (copy
   to the sampler's scratch row, one in-place add of the dense bias row, argmax), and a sampled row
   (temperature 0.7, top-p 0.9) without and with a bias. Variants alternate, repeat after repeat.
2. End to end: greedy ``engine.generate`` tokens/s without and with a one-token bias (a token the
   answer does not contain, so both produce the same tokens), alternating, in one process.

    .venv/bin/python benchmarks/logit_bias.py OUT [--threads 2] [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvforge.runtime import Engine, Sampler, SamplingParams
from kvforge.runtime.sampling import GenerationDefaults

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def sampler_step_us(vocab: int, repeats: int, steps: int = 200) -> dict[str, float]:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    bias = {int(t): -100.0 for t in rng.integers(0, vocab, 10)}
    defaults = GenerationDefaults()
    variants = {
        "greedy": SamplingParams(temperature=0.0),
        "greedy+bias": SamplingParams(temperature=0.0, logit_bias=bias),
        "sampled": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
        "sampled+bias": SamplingParams(temperature=0.7, top_p=0.9, seed=1, logit_bias=bias),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, params in variants.items():
            sampler = Sampler(params.resolve(defaults), [], vocab)
            step = (lambda s=sampler: int(np.argmax(logits))) if sampler.plain_greedy else sampler
            step(logits)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(logits)
            times[name].append((time.perf_counter() - t0) / steps * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def decode_tokens_per_s(engine: Engine, tokens: int, repeats: int) -> dict[str, float]:
    [plain] = engine.generate([PROMPT], max_new_tokens=tokens, sampling=SamplingParams(temperature=0.0))
    absent = next(t for t in range(1000, engine.vocab_size) if t not in plain.token_ids)
    variants = {
        "greedy": SamplingParams(temperature=0.0),
        "greedy+bias": SamplingParams(temperature=0.0, logit_bias={absent: -100.0}),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, params in variants.items():
            [r] = engine.generate([PROMPT], max_new_tokens=tokens, sampling=params)
            assert r.token_ids == plain.token_ids, f"{name}: the bias on an absent token changed the output"
            rates[name].append(r.tokens_per_s)
    return {name: statistics.median(v) for name, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with Engine.load(args.artifact, threads=args.threads) as engine:
        us = sampler_step_us(engine.vocab_size, args.repeats)
        print(f"sampler step, V={engine.vocab_size} (median of {args.repeats}):")
        for name, v in us.items():
            print(f"  {name:13s} {v:8.1f} us")
        print(
            f"  bias adds {us['greedy+bias'] - us['greedy']:.1f} us to a greedy row, "
            f"{us['sampled+bias'] - us['sampled']:.1f} us to a sampled one"
        )
        rates = decode_tokens_per_s(engine, args.tokens, args.repeats)
        print(f"greedy decode, {args.tokens} tokens, {args.threads} threads (median of {args.repeats}):")
        for name, v in rates.items():
            print(f"  {name:13s} {v:8.2f} tokens/s")
        print(f"  ratio with/without bias: {rates['greedy+bias'] / rates['greedy']:.3f}")


if __name__ == "__main__":
    main()
