"""Perplexity of several kvforge artifacts of one model on the same tokens, without transformers.

Each artifact's score graph scores non-overlapping windows of its ``max_seq`` tokens (the first
token of a window is context only), the artifacts taking turns window by window, so a loaded
machine slows them alike; the kvforge side of ``kvforge compare --text``, for when the
transformers side is not needed (benchmarks/README.md, "GGUF blocks"):

    python benchmarks/gguf_perplexity.py TEXT_FILE smol-fp32 smol-gguf smol-int4 [--tokens N] [--threads 2]

The text is tokenized by the first artifact's ``tokenizer.json``; every artifact must share it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from kvforge.runtime import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", type=Path)
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(Path(args.artifacts[0]) / "tokenizer.json"))
    ids = tokenizer.encode(args.text.read_text()).ids[: args.tokens]
    engines = {a: Engine.load(a, threads=args.threads) for a in args.artifacts}
    window = min(e.max_seq for e in engines.values())
    nll = dict.fromkeys(engines, 0.0)
    seconds = dict.fromkeys(engines, 0.0)
    scored = 0
    for start in range(0, len(ids), window):
        tokens = ids[start : start + window]
        if len(tokens) < 2:
            break
        for name, engine in engines.items():
            began = time.perf_counter()
            logits = engine.score([tokens])[0, : len(tokens) - 1].astype(np.float64)  # (S-1, V)
            seconds[name] += time.perf_counter() - began
            logits -= logits.max(axis=-1, keepdims=True)
            log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
            nll[name] -= log_probs[np.arange(len(tokens) - 1), tokens[1:]].sum()
        scored += len(tokens) - 1
        print(f"{scored} tokens: " + "  ".join(f"{a} {np.exp(nll[a] / scored):.3f}" for a in engines), flush=True)
    for engine in engines.values():
        engine.close()
    first = next(iter(engines))
    for name in engines:
        ppl = float(np.exp(nll[name] / scored))
        ratio = ppl / float(np.exp(nll[first] / scored))
        print(f"{name}: perplexity {ppl:.4f} over {scored} tokens (x{ratio:.3f} the first; {seconds[name]:.1f}s)")


if __name__ == "__main__":
    main()
