"""Prefill on OpenVINO's CPU plugin, decode on ONNX Runtime: ``Engine.load(prefill="openvino")``.

Why. On a CPU with AMX / AVX512-VNNI, ORT's int4 kernel (``MatMulNBits``) prefills slower than
ORT's own fp32 GEMM, while OpenVINO runs the same int4 ``MatMulNBits`` nodes with int8 activations
in its brgemm kernels: SmolLM2-135M int4, 128 tokens, 2 threads: 80.7 ms on OpenVINO against
166.4 ms on ORT, the same greedy tokens (benchmarks/FINDINGS.md, "OpenVINO on kvforge's graph").
Its decode step through the same graph is ~3.5x ORT's, so only calls of many tokens go to it.

How. OpenVINO reads the artifact's ``prefill.onnx`` (the graph before ORT's optimization; its
``gqa`` lowering: the ``onnx`` lowering's ``TensorScatter`` has no OpenVINO conversion) and
compiles it once, at f32 precision (kvforge's arithmetic; never its bf16 default). A call binds
the engine's own arrays by pointer (``ov.Tensor(array, shared_memory=True)``): the step inputs,
the logits and each layer's cache view as the past input. The present outputs cannot share those
views: OpenVINO's translation of ``GroupQueryAttention`` returns the keys of positions
``[0, past + S)`` as a tensor of that length, not the ``S_max`` buffer written in place, so a
present bound to the view would be laid out at the wrong pitch. OpenVINO keeps the presents, and
after the call the new positions of each row (its prompt's K/V, ``[start, start + length)``) are
copied into the engine's cache: the cache stays the engine's one allocation, whichever runtime
wrote a row.

Calls of one row only (what a prompt's time to first token is; a batch of prompts stays on ORT,
including the prompts a scheduler admits together).
Limits (refused at load by :func:`check_artifact`): float32 artifacts of the ``gqa`` lowering
with a KV cache only (no model state, no 8-bit KV); the CPU; no speculative decoding (its step
graph is the verify graph, which stays on ORT). Cost: OpenVINO holds its own compiled copy of
the model (SmolLM2-135M: +550 MiB resident at int4, +1.2 GiB at fp32, where it is also slower).
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


def check_artifact(manifest: mf.Manifest) -> None:
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
            f"prefill='openvino' cannot run this artifact: {why}; load it with prefill='ort' (the default)"
        )


@dataclass
class OvBinding:
    graph: str
    tensors: dict[str, object]  # name -> ov.Tensor over the engine's array (inputs and logits)
    arrays: dict[str, np.ndarray]  # keeps the bound arrays alive while the binding exists
    presents: dict[str, np.ndarray]  # present output -> the cache view its new positions go to


class OpenVinoPrefill:
    """The prefill graph compiled by OpenVINO, for calls of at least :data:`MIN_TOKENS` tokens."""

    def __init__(self, graph_file: Path, threads: int | None = None, min_tokens: int = MIN_TOKENS) -> None:
        try:
            import openvino as ov
        except ImportError as e:
            raise ValueError(f"prefill='openvino' needs OpenVINO: {INSTALL}") from e
        self._ov = ov
        config = {"INFERENCE_PRECISION_HINT": "f32"}  # kvforge's arithmetic, not OpenVINO's bf16 default
        if threads is not None:
            config["INFERENCE_NUM_THREADS"] = threads
        try:
            self.compiled = ov.Core().compile_model(str(graph_file), "CPU", config)
        except Exception as e:  # OpenVINO's conversion errors are RuntimeErrors of many lines
            detail = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
            raise mf.ArtifactError(
                f"OpenVINO cannot compile {graph_file.name} ({detail}); load the artifact with prefill='ort'"
            ) from e
        self.request = self.compiled.create_infer_request()
        self.min_tokens = min_tokens
        self.calls = 0  # calls run here (bench and the tests read it)

    def wants(self, graph: str, inputs: dict[str, np.ndarray]) -> bool:
        """Whether a call of ``graph`` with these inputs runs here: prefill calls of one row of many
        tokens (OpenVINO 2026.4's translation of the graph fails at batch > 1: a ``Reshape`` to one
        row inside its GroupQueryAttention)."""
        ids = inputs[contract.INPUT_IDS]
        return graph == "prefill" and ids.shape[0] == 1 and ids.size >= self.min_tokens

    def bind(self, graph: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> OvBinding:
        """Wrap the engine's inputs and logits by pointer; the presents are copied out after the call."""
        presents = {name: array for name, array in outputs.items() if name != contract.LOGITS}
        arrays = {**inputs, contract.LOGITS: outputs[contract.LOGITS]}
        tensors = {}
        for name, array in arrays.items():
            if not array.flags.c_contiguous:
                raise ValueError("bound arrays must be contiguous")  # a programming error, not a user's
            tensors[name] = self._ov.Tensor(array, shared_memory=True)
        return OvBinding(graph, tensors, arrays, presents)

    def run(self, binding: OvBinding) -> None:
        for name, tensor in binding.tensors.items():
            self.request.set_tensor(name, tensor)
        self.request.infer()
        starts = binding.arrays[contract.WRITE_INDICES]
        lengths = binding.arrays[contract.INPUT_LENGTHS]
        for name, view in binding.presents.items():
            present = self.request.get_tensor(name).data  # [B, H_kv, past + S, D]: positions from 0
            for b, (s0, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
                if present.shape[2] < s0 + n:
                    raise RuntimeError(
                        f"OpenVINO's {name} holds {present.shape[2]} positions, not the {s0 + n} of row {b}: "
                        "this OpenVINO translates GroupQueryAttention differently; load with prefill='ort'"
                    )
                view[b, :, s0 : s0 + n] = present[b, :, s0 : s0 + n]
        self.calls += 1

    def close(self) -> None:
        self.request = self.compiled = None
