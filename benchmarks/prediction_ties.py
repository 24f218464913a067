"""Where a prediction's greedy output leaves plain decoding, and why: the plain logits' top-2 margins.

    .venv/bin/python benchmarks/prediction_ties.py OUT [--max-tokens 400]

``OUT``: the artifact of benchmarks/predicted_outputs.py (SmolLM2-135M-Instruct, ``--max-seq
1024``). Decodes that benchmark's code edit plainly, one step at a time, recording each position's
margin between the two best logits; then runs it with the original code and with an unrelated
text as ``SamplingParams(prediction=...)`` and prints the first token where each differs from the
plain answer, with the plain margin there. A difference only at positions whose margin is ~1e-5
is float32 summation order (a verify call of several tokens against a one-token step), not a wrong
acceptance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predicted_outputs import CODE, INSTRUCTION, UNRELATED

from kvforge.runtime import Engine, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    greedy = SamplingParams(temperature=0)
    with Engine.load(args.artifact, threads=args.threads, speculative="prediction", prefix_cache=0) as e:
        ids = e.chat_prompt([{"role": "user", "content": INSTRUCTION + CODE}])
        [plain] = e.generate([ids], max_new_tokens=args.max_tokens, sampling=greedy)
        a = plain.token_ids
        margins = []
        logits = e.prefill([ids])[0]
        for token in a:
            top = np.sort(logits)[-2:]
            margins.append(float(top[1] - top[0]))
            logits = e.decode([token])[0]
        m = np.array(margins)
        close = np.flatnonzero(m < 1e-4).tolist()
        print(f"plain: {len(a)} tokens; top-2 margin < 1e-4 at {close}; smallest {m.min():.2e} at {int(m.argmin())}")
        for name, text in [("original code", CODE), ("unrelated", UNRELATED)]:
            draft = e.tokenizer.encode(text, add_special_tokens=False)
            [r] = e.generate(
                [ids], max_new_tokens=args.max_tokens, sampling=SamplingParams(temperature=0, prediction=draft)
            )
            b = r.token_ids
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is None:
                print(f"{name}: identical ({len(b)} tokens, {r.prediction_accepted} accepted)")
            else:
                print(
                    f"{name}: first difference at token {i} of {len(a)} (plain {a[i]}, with the prediction {b[i]}); "
                    f"plain top-2 margin there {margins[i]:.2e}; {r.prediction_accepted} accepted"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
