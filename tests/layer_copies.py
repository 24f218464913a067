"""Every family of tests/families.py with 4 layers, compiled: parity against transformers, and how
compile traced the decoder stack (3 layers traced and 1 copied, or all traced and why).

tests/families.py's models have 2 layers, no more than the traced prefix, so the suite's family
tests never copy a layer; this script does, for every family, in ~3 minutes on 2 cores:

    .venv/bin/python -m tests.layer_copies [FAMILY_ID ...]      # from the repository root

A script beside tests/families.py, not a test (pytest does not collect it).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from kvforge.compile import compile_model
from tests import families

LAYERS = 4


def main(only: list[str]) -> int:
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for case_id, architecture, config_class, overrides in families.CASES:
            if only and case_id not in only:
                continue
            overrides = dict(overrides)
            overrides["n_layer" if config_class == "GPT2Config" else "num_hidden_layers"] = LAYERS
            if "layer_types" in overrides:  # a pattern of 2 repeated
                overrides["layer_types"] = overrides["layer_types"] * (LAYERS // len(overrides["layer_types"]))
            lines: list[str] = []
            say = lines.append
            started = time.perf_counter()
            try:
                model_dir = families.build(root / case_id, architecture, config_class, overrides)
                out = root / f"{case_id}-out"
                manifest = compile_model(model_dir, out, max_batch=2, max_seq=48, score_graph=False, progress=say)
            except Exception as e:  # one family's failure is a row, not the end of the run
                failed += 1
                print(f"{case_id}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            parity = manifest.parity
            [export] = [line for line in lines if " export took " in line]
            trace = export.rsplit("; ", 1)[-1].removesuffix(")")  # the details' closing parenthesis
            failed += parity["greedy_match"] is not True
            print(
                f"{case_id}: greedy match {parity['greedy_match']}, max|diff| prefill "
                f"{parity['prefill_max_abs_diff']:.1e} decode {parity['decode_max_abs_diff']:.1e}; {trace} "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
