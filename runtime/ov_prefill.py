"""Prefill on OpenVINO's CPU plugin, decode on ONNX Runtime: ``Engine.load(prefill="openvino")``.

Why. On a CPU with AMX / AVX512-VNNI, ORT's int4 kernel (``MatMulNBits``) prefills slower than
ORT's own fp32 GEMM, while OpenVINO runs the same int4 ``MatMulNBits`` nodes with int8 activations
in its brgemm kernels: SmolLM2-135M int4, 128 tokens, 2 threads: 80.7 ms on OpenVINO against
166.4 ms on ORT, the same greedy tokens (benchmarks/FINDINGS.md, "OpenVINO on kvforge's graph").
Its decode step through the same graph is ~3.5x ORT's, so only calls of many tokens go to it.

Precision. ``"openvino"`` compiles the graph at f32, kvforge's arithmetic. ``"openvino:bf16"``
compiles it at bf16 (OpenVINO's own default on such CPUs, what OpenVINO GenAI runs): the weights
and activations of the prompt's pass in bfloat16 on the AMX / AVX512-BF16 units, the cache it
writes still float32. About twice as fast again (SmolLM2 int4: 53 against 80 ms at 128 tokens,
405 against 766 ms at 1024), at bfloat16's rounding of the prompt's logits and K/V (its cost in
perplexity and greedy agreement: benchmarks/FINDINGS.md, "The bf16 prefill"). Refused on a CPU
without bf16 arithmetic, where OpenVINO would quietly run f32 instead.

How. OpenVINO reads the artifact's ``prefill.onnx`` (the graph before ORT's optimization; its
``gqa`` lowering: the ``onnx`` lowering's ``TensorScatter`` has no OpenVINO conversion) and
compiles it once. A call binds the engine's own arrays by pointer (``ov.Tensor(array,
shared_memory=True)``): the step inputs, the logits and each layer's cache view as the past input.
The present outputs cannot share those views: OpenVINO's translation of ``GroupQueryAttention``
returns the keys of positions ``[0, past + S)`` as a tensor of that length, not the ``S_max``
buffer written in place, so a present bound to the view would be laid out at the wrong pitch.
OpenVINO keeps the presents, and after the call the new positions of each row (its prompt's K/V,
``[start, start + length)``) are copied into the engine's cache: the cache stays the engine's one
allocation, whichever runtime wrote a row.

Rows. OpenVINO 2026.4's translation of the graph fails at batch > 1 (a ``Reshape`` to one row
inside its GroupQueryAttention), so a prefill call of B rows, each of at least ``min_tokens``
tokens, runs as B one-row calls, each of its row's own length (no padding), into its own cache row
and logits row. A call with a shorter row, and every decode step, stays on ORT.

Limits (refused at load by :func:`check_artifact`): float32 artifacts of the ``gqa`` lowering
with a KV cache only (no model state, no 8-bit KV); the CPU; no speculative decoding (its step
graph is the verify graph, which stays on ORT). Cost: OpenVINO holds its own compiled copy of
the model (SmolLM2-135M: +550 MiB resident at int4, +1.2 GiB at fp32 and f32; of the int4
compile's ~480 MiB, ~260 MiB are the memory-mapped weights file, clean pages the kernel may drop
under pressure, ~220 MiB OpenVINO's own). Each new prompt
length costs OpenVINO a shape preparation on its first call (SmolLM2 int4 bf16: +20 ms at 130
tokens, +130-190 ms near 1024; ORT has no such cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.graphs import contract
from kvforge.graphs import manifest as mf

# Calls of fewer tokens (B x S) stay on ORT: OpenVINO beat ORT from ~32 tokens (FINDINGS.md).
MIN_TOKENS = 32
INSTALL = "pip install 'kvforge[openvino]'"
# Engine.load's prefill= choices that run here -> OpenVINO's INFERENCE_PRECISION_HINT.
PRECISIONS = {"openvino": "f32", "openvino:bf16": "bf16"}
CHOICES = ("ort", *PRECISIONS)  # Engine.load(prefill=...) and the CLI's --prefill


def check_artifact(manifest: mf.Manifest, choice: str = "openvino") -> None:
    """Refuse, before anything loads, an artifact the OpenVINO prefill cannot run exactly."""
    why = None
    if manifest.layout.has_state:
        why = "it keeps model state (a hybrid or recurrent family), which only the ORT lowering runs"
    elif manifest.layout.quantized_kv:
        why = "its KV cache is 8-bit with scales (--kv-dtype int8)"
    elif manifest.lowering != "gqa":
        why = f"its lowering is {manifest.lowering!r}; OpenVINO reads only the gqa lowering's graph"
    elif manifest.dtype != "float32":
        why = f"it is {manifest.dtype}; the OpenVINO prefill binds float32 caches"
    if why:
        raise ValueError(
            f"prefill={choice!r} cannot run this artifact: {why}; load it with prefill='ort' (the default)"
        )


@dataclass
class OvBinding:
    calls: list[dict[str, object]]  # one per row: input or logits name -> ov.Tensor over the engine's array
    spans: list[tuple[int, int]]  # each row's new positions: (start, length)
    presents: dict[str, np.ndarray]  # present output -> the cache view [B, H, S_max, D] its rows go to
    arrays: list[np.ndarray]  # keeps the bound arrays alive while the binding exists


class OpenVinoPrefill:
    """The prefill graph compiled by OpenVINO, for prefill calls whose rows have at least
    ``min_tokens`` tokens each; ``precision``: ``"f32"`` or ``"bf16"`` (see the module docstring)."""

    def __init__(
        self, graph_file: Path, threads: int | None = None, min_tokens: int = MIN_TOKENS, precision: str = "f32"
    ) -> None:
        try:
            import openvino as ov
        except ImportError as e:
            raise ValueError(f"prefill='openvino' needs OpenVINO: {INSTALL}") from e
        self._ov = ov
        core = ov.Core()
        if precision == "bf16" and "BF16" not in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
            raise ValueError(
                "prefill='openvino:bf16' needs a CPU with bfloat16 arithmetic (AVX512-BF16 or AMX), and OpenVINO "
                "finds none on this one; load with prefill='openvino' (f32)"
            )
        config = {"INFERENCE_PRECISION_HINT": precision}  # stated: OpenVINO's own default would be bf16
        if threads is not None:
            config["INFERENCE_NUM_THREADS"] = threads
        try:
            self.compiled = core.compile_model(str(graph_file), "CPU", config)
        except Exception as e:  # OpenVINO's conversion errors are RuntimeErrors of many lines
            detail = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
            raise mf.ArtifactError(
                f"OpenVINO cannot compile {graph_file.name} ({detail}); load the artifact with prefill='ort'"
            ) from e
        self.request = self.compiled.create_infer_request()
        self.precision = precision
        self.min_tokens = min_tokens
        self.calls = 0  # one-row calls run here (bench and the tests read it)

    def wants(self, graph: str, inputs: dict[str, np.ndarray]) -> bool:
        """Whether a call of ``graph`` with these inputs runs here: prefill calls whose every row has
        at least ``min_tokens`` tokens."""
        return graph == "prefill" and int(inputs[contract.INPUT_LENGTHS].min()) >= self.min_tokens

    def bind(self, graph: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> OvBinding:
        """One call per row: that row's ids and positions (its own length), its cache row as the past,
        its logits row, wrapped by pointer; the presents are copied out after each call."""
        presents = {name: array for name, array in outputs.items() if name != contract.LOGITS}
        steps = (contract.INPUT_IDS, contract.POSITION_IDS, contract.WRITE_INDICES, contract.INPUT_LENGTHS)
        pasts = {name: array for name, array in inputs.items() if name not in steps}  # the cache views
        starts = inputs[contract.WRITE_INDICES].tolist()
        lengths = inputs[contract.INPUT_LENGTHS].tolist()
        calls, arrays = [], []
        for b, n in enumerate(lengths):
            row = {
                contract.INPUT_IDS: inputs[contract.INPUT_IDS][b : b + 1, :n],
                contract.POSITION_IDS: inputs[contract.POSITION_IDS][b : b + 1, :n],
                contract.WRITE_INDICES: inputs[contract.WRITE_INDICES][b : b + 1],
                contract.INPUT_LENGTHS: inputs[contract.INPUT_LENGTHS][b : b + 1],
                contract.LOGITS: outputs[contract.LOGITS][b : b + 1],
                **{name: array[b : b + 1] for name, array in pasts.items()},
            }
            row = {name: np.ascontiguousarray(array) for name, array in row.items()}  # ids/positions: copies
            calls.append({name: self._ov.Tensor(array, shared_memory=True) for name, array in row.items()})
            arrays.extend(row.values())
        return OvBinding(calls, list(zip(starts, lengths)), presents, arrays)

    def run(self, binding: OvBinding) -> None:
        for b, (tensors, (s0, n)) in enumerate(zip(binding.calls, binding.spans)):
            for name, tensor in tensors.items():
                self.request.set_tensor(name, tensor)
            self.request.infer()
            for name, view in binding.presents.items():
                present = self.request.get_tensor(name).data  # [1, H_kv, past + S, D]: positions from 0
                if present.shape[2] < s0 + n:
                    raise RuntimeError(
                        f"OpenVINO's {name} holds {present.shape[2]} positions, not the {s0 + n} of row {b}: "
                        "this OpenVINO translates GroupQueryAttention differently; load with prefill='ort'"
                    )
                view[b, :, s0 : s0 + n] = present[0, :, s0 : s0 + n]
            self.calls += 1

    def close(self) -> None:
        self.request = self.compiled = None
