"""ONNX Runtime CUDA backend: the ``gqa`` graphs on the CUDA provider, the cache on the device.

One session (the prefill graph; decode is its one-token case, as on the CPU), so ORT holds one
copy of the weights on the device. Every input and output is bound through IOBinding **by
pointer** to the binding plan's device slices: each ``present.*`` output on its past input's
address (GroupQueryAttention shares past and present), the step tensors in the ``io`` buffer.
Decode runs as an ORT CUDA graph per row range (provider option ``enable_cuda_graph``; run option
``gpu_graph_id`` = ``first * max_batch + batch``, ``-1`` for prefill, which is not captured): ORT's rule is
fixed addresses and shapes per graph id, which the binding plan gives.

The session optimizes the graphs at load (``ORT_ENABLE_ALL``): ORT's offline optimization for the
CUDA provider needs that provider at compile time (see the manifest's ``ort_optimization``).

**Not yet run on a GPU**: written against onnxruntime-gpu's documented Python API
(``InferenceSession`` providers with options, ``io_binding().bind_input/bind_output`` with
``"cuda"`` and a pointer, ``RunOptions.add_run_config_entry("gpu_graph_id", ...)``,
``run_with_iobinding``); tested only by ``tests/gpu`` on a GPU.
"""

from __future__ import annotations

from pathlib import Path

from kvforge.graphs import contract, environment
from kvforge.graphs import manifest as mf
from kvforge.runtime import device
from kvforge.runtime.backends import binding_plan as bp
from kvforge.runtime.backends.base import GpuBackend, GpuBinding

NO_CAPTURE = "-1"  # gpu_graph_id that runs without capturing (ORT reserves 0)


class OrtCudaBackend(GpuBackend):
    name = "ort-cuda"

    def __init__(self, root: Path, manifest: mf.Manifest, *, cuda_graphs: bool = True) -> None:
        reason = environment.ort_cuda_provider()
        if reason:
            raise environment.DeviceUnavailableError(reason)
        import onnxruntime as ort

        gpu = device.open_device()
        super().__init__(manifest, bp.ALIAS)  # ORT binds one address to past and present: in place
        self.ort = ort
        self.cuda_graphs = cuda_graphs
        self.session, self.cuda_graphs, self.cuda_graphs_refused = _open_session(
            ort, root / manifest.graphs["prefill"].file, gpu.index, cuda_graphs
        )
        self._inputs = [i.name for i in self.session.get_inputs()]
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._run_options: dict[str, object] = {}
        print(f"[kvforge] {self.message}")

    def input_names(self, graph: str) -> list[str]:
        return list(self._inputs)

    def output_names(self, graph: str) -> list[str]:
        return list(self._outputs)

    def _options(self, graph_id: str):
        if graph_id not in self._run_options:
            ro = self.ort.RunOptions()
            ro.add_run_config_entry("gpu_graph_id", graph_id)
            self._run_options[graph_id] = ro
        return self._run_options[graph_id]

    def bind(self, graph: str, inputs: dict[str, object], outputs: dict[str, object]) -> GpuBinding:
        if graph != "prefill":
            raise ValueError(f"the ORT CUDA backend runs the prefill graph (decode is its one-token case), not {graph}")
        host, logits, batch, seq, first = self.step_arrays(inputs, outputs)
        plans = self.plans(self._inputs, self._outputs, batch, seq, first)
        io_binding = self.session.io_binding()
        plan = plans[0]
        for name, s in plan.inputs.items():
            io_binding.bind_input(name, "cuda", 0, _np_type(s.dtype), list(s.shape), self.address(s))
        for name, s in plan.outputs.items():
            io_binding.bind_output(name, "cuda", 0, _np_type(s.dtype), list(s.shape), self.address(s))
        binding = GpuBinding(graph, plans, host, logits, batch, seq, first)
        binding.tensors[contract.LOGITS] = logits
        binding.tensors["io_binding"] = io_binding
        return binding

    def run(self, binding: GpuBinding) -> None:
        self.upload(binding)
        self.stream.synchronize()  # ORT runs on its own stream: the inputs must have landed
        # One graph per row range; ids from 1 (ORT reserves 0): first * max_batch + batch is unique.
        graph_id = str(binding.first * self.layout.max_batch + binding.batch)
        graph_id = graph_id if (self.cuda_graphs and binding.seq == 1) else NO_CAPTURE
        self.session.run_with_iobinding(binding.tensors["io_binding"], self._options(graph_id))
        self.download(binding)

    def bound_addresses(self, binding: GpuBinding) -> dict[str, int]:
        return {name: self.address(s) for name, s in binding.plans[0].all().items()}

    def close(self) -> None:
        self._run_options.clear()
        self.session = None
        super().close()


CUDA_GRAPH_REFUSAL = "cannot use the graph capture feature"


def _open_session(ort, path: Path, device_id: int, cuda_graphs: bool):
    """The CUDA session, with CUDA graphs when asked and ORT accepts them: ``(session, cuda_graphs,
    refusal)``. ORT refuses graph capture when a node of the graph runs outside the CUDA provider
    (seen on an H200 with onnxruntime-gpu 1.31.1, 2026-12-04); then decode runs without graphs, said
    at load, and ``refusal`` keeps ORT's message (``bench`` reports it)."""

    def make(graphs: bool):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        options = {"device_id": str(device_id), "enable_cuda_graph": "1" if graphs else "0"}
        return ort.InferenceSession(str(path), so, providers=[("CUDAExecutionProvider", options)])

    if not cuda_graphs:
        return make(False), False, None
    try:
        return make(True), True, None
    except Exception as e:  # ORT raises its own Fail type; only the graph-capture refusal is retried
        if CUDA_GRAPH_REFUSAL not in str(e):
            raise
        why = str(e).split(" : ")[-1].strip()
        print(f"[kvforge] ORT refused CUDA graphs for {path.name} ({why}); decoding without them")
        return make(False), False, str(e)


def _np_type(dtype: str):
    import numpy as np

    return np.dtype(dtype).type
