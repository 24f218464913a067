"""Stage 4: the saved graphs + the source model -> the parity record of the manifest.

Runs the freshly written prefill and decode graphs on ONNX Runtime's CPU provider (plain feeds, a
small cache capacity) and transformers eager on the same tokens, and reports the largest absolute
logit difference of the prefill and of each decode step, and whether greedy tokens agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge.graphs import contract
from kvforge.graphs.architectures import Dims

PROMPT_TOKENS = 8
DECODE_STEPS = 4
CAPACITY = PROMPT_TOKENS + DECODE_STEPS


def _ort_dtype_ok(dtype: torch.dtype) -> bool:
    # ORT's CPU provider lacks bfloat16 kernels for most ops; parity is then measured on a GPU backend.
    return dtype in (torch.float32, torch.float16)


def measure(
    out_dir: Path, files: dict[str, str], reference: torch.nn.Module, dims: Dims, dtype: torch.dtype
) -> dict[str, Any]:
    """Compare the ``files["prefill"]`` and ``files["decode"]`` graphs in ``out_dir`` with
    ``reference`` (a transformers model, eager attention)."""
    if not _ort_dtype_ok(dtype):
        return {"skipped": f"ONNX Runtime's CPU provider cannot run {dtype} graphs"}
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    prefill = ort.InferenceSession(str(out_dir / files["prefill"]), options, providers=["CPUExecutionProvider"])
    decode = ort.InferenceSession(str(out_dir / files["decode"]), options, providers=["CPUExecutionProvider"])

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dims.vocab_size, (1, PROMPT_TOKENS), generator=generator)
    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    shape = (1, dims.num_kv_heads, CAPACITY, dims.head_dim)
    past = [np.zeros(shape, np_dtype) for _ in range(2 * dims.num_layers)]
    past_names = contract.past_names(dims.num_layers)

    outputs = prefill.run(
        None,
        {
            contract.INPUT_IDS: ids.numpy(),
            contract.POSITION_IDS: np.arange(PROMPT_TOKENS, dtype=np.int64)[None],
            contract.WRITE_INDICES: np.zeros(1, np.int64),
            contract.INPUT_LENGTHS: np.array([PROMPT_TOKENS], np.int64),
            **dict(zip(past_names, past)),
        },
    )
    ours = [outputs[0][0].astype(np.float32)]
    past = outputs[1:]
    tokens = ids[0].tolist()
    for step in range(DECODE_STEPS):
        tokens.append(int(ours[-1].argmax()))
        pos = PROMPT_TOKENS + step
        outputs = decode.run(
            None,
            {
                contract.INPUT_IDS: np.array([[tokens[-1]]], np.int64),
                contract.POSITION_IDS: np.array([[pos]], np.int64),
                contract.WRITE_INDICES: np.array([pos], np.int64),
                **dict(zip(past_names, past)),
            },
        )
        ours.append(outputs[0][0].astype(np.float32))
        past = outputs[1:]

    with torch.no_grad():
        logits = reference(torch.tensor([tokens])).logits[0].float().numpy()  # (T, V)
    theirs = logits[PROMPT_TOKENS - 1 :]
    diffs = [float(np.abs(a - b).max()) for a, b in zip(ours, theirs)]
    return {
        "reference": "transformers eager",
        "provider": "CPUExecutionProvider",
        "graphs": [files["prefill"], files["decode"]],
        "prompt_tokens": PROMPT_TOKENS,
        "decode_steps": DECODE_STEPS,
        "prefill_max_abs_diff": diffs[0],
        "decode_max_abs_diff": max(diffs[1:]),
        "greedy_match": bool(all(int(a.argmax()) == int(b.argmax()) for a, b in zip(ours, theirs))),
    }


# Largest max |logit diff| the generic path accepts, per dtype (verified families are held to the
# tighter tolerances of the test matrix).
GENERIC_TOLERANCE = {"float32": 1e-3, "float16": 5e-2}


def failure(parity: dict[str, Any], dtype: str) -> str | None:
    """Why ``parity`` is not good enough for an unverified family, or None if it is."""
    if "skipped" in parity or dtype not in GENERIC_TOLERANCE:
        return f"parity cannot be measured for {dtype} on CPU; compile it in float32 first"
    worst = max(parity["prefill_max_abs_diff"], parity["decode_max_abs_diff"])
    if worst > GENERIC_TOLERANCE[dtype]:
        return f"max |logit diff| {worst:.3g} > {GENERIC_TOLERANCE[dtype]}"
    if not parity["greedy_match"]:
        return "greedy tokens differ"
    return None
