"""Stage: the saved graphs + the source model -> the parity record of the manifest.

Two halves, run at different times so that the transformers model and the ONNX Runtime session
are never in memory together:

1. :func:`reference`, right after loading (before export): transformers eager on the compile's
   own model (its attention switched to ``"eager"`` for the call and back, so no second model is
   loaded) greedily extends a random 8-token prompt by 4 tokens and records its logits at the
   last prompt token and at each new one.
2. :func:`measure`, on the written artifact: ONE ONNX Runtime CPU session (no weight prepacking,
   no graph optimization, no arena: ``weights.data`` is memory-mapped and never copied) on the
   graph the runtime runs, prefill of the prompt, then
   the 4 decode steps through the same session (as the runtime's default ``one_session`` does),
   fed the reference's tokens. It reports the largest absolute logit difference of the prefill
   and of the decode steps, and whether every greedy token agrees (then both sides generated the
   same sequence).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge.graphs import contract
from kvforge.graphs.architectures import Dims

PROMPT_TOKENS = 8
DECODE_STEPS = 4
CAPACITY = PROMPT_TOKENS + DECODE_STEPS
EAGER = "eager"


def ort_dtype_ok(dtype: torch.dtype) -> bool:
    # ORT's CPU provider lacks bfloat16 kernels for most ops; parity is then measured on a GPU backend.
    return dtype in (torch.float32, torch.float16)


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of the parity prompt."""

    tokens: list[int]  # PROMPT_TOKENS prompt ids, then DECODE_STEPS greedy ids
    logits: np.ndarray  # (DECODE_STEPS + 1, V) float32: at the last prompt token, then at each new token


class ReferenceSwitchError(RuntimeError):
    """The model's attention implementation cannot be switched to eager in place."""


@contextlib.contextmanager
def as_transformers_eager(model: torch.nn.Module, default_experts: bool) -> Iterator[torch.nn.Module]:
    """``model`` with transformers' eager attention (and, with ``default_experts``, the experts
    implementation ``from_pretrained`` picks by default) for the duration of the block; the
    previous implementations are restored after it. The config is the model's own: nothing else
    may run this model meanwhile (DESIGN.md: a config switch switches every model built from it)."""
    attention = model.config._attn_implementation
    experts = model.get_experts_implementation() if default_experts else None
    try:
        model.set_attn_implementation(EAGER)
        if model.config._attn_implementation != EAGER:
            raise ReferenceSwitchError(f"{type(model).__name__} kept attention {model.config._attn_implementation!r}")
        if default_experts:
            model.set_experts_implementation(model.get_correct_experts_implementation(None))
        yield model
    finally:
        model.set_attn_implementation(attention)
        if experts is not None:
            model.set_experts_implementation(experts)


def reference(model: torch.nn.Module, dims: Dims) -> Reference:
    """transformers' greedy continuation of the parity prompt (seeded) on ``model``, which must
    already run transformers' own attention (see :func:`as_transformers_eager`)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, dims.vocab_size, (1, PROMPT_TOKENS), generator=generator)[0].tolist()
    threads = torch.get_num_threads()
    # A dozen tokens: one thread does it. Two threads on a busy 2-core machine spin against each
    # other and took 20 s instead of 1 s here (SmolLM-135M shape, load average 6).
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(DECODE_STEPS):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            logits = model(torch.tensor([tokens])).logits[0].float().numpy()  # (T, V)
    finally:
        torch.set_num_threads(threads)
    return Reference(tokens, np.ascontiguousarray(logits[PROMPT_TOKENS - 1 :]))


def weight_cast_order(ort: Any, graph_file: str) -> Any:
    """The node order that keeps a float16 graph's weight casts short-lived on the CPU provider.

    The CPU provider runs most float16 nodes in float32 and casts each weight in a Cast node of
    its own, whose output lives from that node to its consumer. Cast nodes of weights depend on
    nothing, so the order decides how many float32 copies live at once (all of them: 2x the
    float16 weights on top of their mapped pages; 25 GB at 7B):

    * a graph as exported (``prefill.onnx``): ORT inserts the casts as it loads it, after every
      node of the file. The priority order (ready nodes by index) runs each just before its
      consumer; the default order (reverse depth-first) ran them all first. Measured on a 12-layer
      float16 Llama: RSS grew by 1.16x the weights against 2.77x.
    * a graph ORT optimized offline (``.ort.onnx``): the casts are saved at the front of the file,
      so the priority order would run them first (3.2x), the default one beside their consumers
      (1.3-1.5x).

    float32 and int4 graphs have no weight casts; either order serves them."""
    if graph_file.endswith(".ort.onnx"):
        return ort.ExecutionOrder.DEFAULT
    return ort.ExecutionOrder.PRIORITY_BASED


def measure(
    out_dir: Path,
    graph_file: str,
    ref: Reference | None,
    dims: Dims,
    dtype: torch.dtype,
    layout: contract.Layout | None = None,
) -> dict[str, Any]:
    """Run ``graph_file`` (a prefill graph) in ``out_dir`` on ``ref``'s tokens and compare its
    logits with ``ref``'s (None only where ``dtype`` cannot run on the CPU provider: skipped).
    ``layout``: which layers keep KV and which a state (None: every layer attends)."""
    if not ort_dtype_ok(dtype) or ref is None:
        return {"skipped": f"ONNX Runtime's CPU provider cannot run {dtype} graphs"}
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # A dozen tokens through a session that must not copy the weights: no prepacking (a packed
    # copy per MatMul), no graph optimization (a float16 graph on the CPU provider would get its
    # weights cast to float32 and constant-folded: 1.6x the weights in memory; the .ort.onnx
    # graphs are optimized already, and the runtime loads them so), no arena (the casts' buffers
    # go back as each node ends), one thread (see reference()).
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.execution_order = weight_cast_order(ort, graph_file)
    options.add_session_config_entry("session.set_denormal_as_zero", "1")  # as the runtime computes (OrtOptions)
    options.enable_cpu_mem_arena = False
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(out_dir / graph_file), options, providers=["CPUExecutionProvider"])

    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    shape = (1, dims.num_kv_heads, CAPACITY, dims.head_dim)
    layout = layout if layout is not None else contract.Layout.all_attention(dims.num_layers)
    kv_dtype = np.int8 if layout.quantized_kv else np_dtype
    past = [np.zeros(shape, kv_dtype) for _ in range(2 * len(layout.attention))]
    past += [np.zeros((1, *t.shape), np.dtype(t.dtype)) for _, t in layout.state_tensors()]
    past += [np.zeros((*shape[:3], 1), np.float32) for _ in contract.kv_scale_past_names(layout)]
    past_names = contract.past_names(layout)
    ours = []
    start, count = 0, PROMPT_TOKENS
    for _ in range(DECODE_STEPS + 1):  # the prefill, then one token per decode step
        outputs = session.run(
            None,
            {
                contract.INPUT_IDS: np.array([ref.tokens[start : start + count]], np.int64),
                contract.POSITION_IDS: np.arange(start, start + count, dtype=np.int64)[None],
                contract.WRITE_INDICES: np.array([start], np.int64),
                contract.INPUT_LENGTHS: np.array([count], np.int64),
                **dict(zip(past_names, past)),
            },
        )
        ours.append(outputs[0][0].astype(np.float32))
        past = outputs[1:]
        start, count = start + count, 1
    diffs = [float(np.abs(a - b).max()) for a, b in zip(ours, ref.logits)]
    return {
        "reference": "transformers eager",
        "provider": "CPUExecutionProvider",
        "graphs": [graph_file],
        "session": "one session: the decode steps run through the prefill graph, as the runtime does by default",
        "prompt_tokens": PROMPT_TOKENS,
        "decode_steps": DECODE_STEPS,
        "prefill_max_abs_diff": diffs[0],
        "decode_max_abs_diff": max(diffs[1:]),
        "greedy_match": bool(all(int(a.argmax()) == int(b.argmax()) for a, b in zip(ours, ref.logits))),
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
