"""ONNX Runtime backend: one ``InferenceSession`` per graph, run through IOBinding on torch buffers.

Every input and output is bound by pointer to a torch tensor the engine owns; each past-cache
input and its present output get the same pointer, so ``TensorScatter`` writes the new rows in
place and no step copies the cache. A :class:`Binding` is reusable: the decode binding is made once
per batch and each step only rewrites the values inside the bound input buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_NP_DTYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}


@dataclass(frozen=True)
class OrtOptions:
    """Session options (``Engine.load`` passes them through).

    threads: intra-op threads; None lets ORT use one per physical core.
    spin: let idle intra-op threads spin between ops (lower latency per step, burns CPU while
        waiting); ORT's default is on.
    prepack: let ORT repack constant MatMul weights into its kernels' layout at load (ORT's
        default; 1.6x faster fp32 decode and ~25x faster int4 MatMulNBits here). The repacked
        weights are anonymous memory owned by each session, so every graph (prefill, decode)
        holds its own packed copy. With ``prepack=False`` the sessions read the memory-mapped
        weights file directly: one copy of the weights in memory, shared by all graphs, slower.
    optimized: run the ORT-optimized ``<graph>.ort.onnx`` files when the artifact has them,
        without optimizing again at load.
    """

    threads: int | None = None
    spin: bool = True
    prepack: bool = True
    optimized: bool = True
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    log_severity: int = 3  # errors only


@dataclass
class Binding:
    graph: str
    io_binding: object  # onnxruntime.IOBinding
    tensors: dict[str, torch.Tensor]  # keeps the bound buffers alive while the binding exists


class OrtBackend:
    name = "ort"

    def __init__(self, graph_files: dict[str, Path], options: OrtOptions = OrtOptions(), preoptimized=()) -> None:
        """``graph_files``: graph name -> .onnx path; ``preoptimized``: the names whose file was
        optimized at compile time (loaded without optimizing again)."""
        import onnxruntime as ort

        self.sessions = {}
        for name, path in graph_files.items():
            so = ort.SessionOptions()
            so.log_severity_level = options.log_severity
            if options.threads is not None:
                so.intra_op_num_threads = options.threads
            so.add_session_config_entry("session.intra_op.allow_spinning", "1" if options.spin else "0")
            if not options.prepack:
                so.add_session_config_entry("session.disable_prepacking", "1")
            if name in preoptimized:
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            self.sessions[name] = ort.InferenceSession(str(path), so, providers=list(options.providers))
        self.device = "cpu"

    def input_names(self, graph: str) -> list[str]:
        return [i.name for i in self.sessions[graph].get_inputs()]

    def output_names(self, graph: str) -> list[str]:
        return [o.name for o in self.sessions[graph].get_outputs()]

    def bind(self, graph: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> Binding:
        """Bind contiguous torch tensors by name. Outputs are written into the given tensors."""
        binding = self.sessions[graph].io_binding()
        for name, tensor in inputs.items():
            binding.bind_input(name, "cpu", 0, _np_dtype(tensor), tuple(tensor.shape), _ptr(tensor))
        for name, tensor in outputs.items():
            binding.bind_output(name, "cpu", 0, _np_dtype(tensor), tuple(tensor.shape), _ptr(tensor))
        return Binding(graph, binding, {**inputs, **outputs})

    def run(self, binding: Binding) -> None:
        self.sessions[binding.graph].run_with_iobinding(binding.io_binding)

    def bound_output_pointers(self, binding: Binding) -> list[int]:
        """Data pointers of the outputs as ONNX Runtime sees them after a run (in binding order)."""
        return [value.data_ptr() for value in binding.io_binding.get_outputs()]

    def close(self) -> None:
        self.sessions.clear()


def _np_dtype(tensor: torch.Tensor):
    if tensor.dtype not in _NP_DTYPES:
        raise TypeError(f"ONNX Runtime's CPU binding does not support {tensor.dtype}")
    return _NP_DTYPES[tensor.dtype]


def _ptr(tensor: torch.Tensor) -> int:
    if not tensor.is_contiguous():
        raise ValueError("bound tensors must be contiguous")  # a programming error, not a user's
    return tensor.data_ptr()
