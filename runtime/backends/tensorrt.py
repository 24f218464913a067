"""TensorRT backend: one plan, two execution contexts (prefill and decode profiles), one device cache.

Load: the manifest's engine record is checked against this machine (TensorRT version, GPU,
compute capability; the plan's sha256 by :func:`kvforge.graphs.manifest.read`), then the plan is
deserialized once. Context 0 runs the ``prefill`` profile (1..max_prompt tokens), context 1 the
``decode`` profile (one token); both share one activation scratch (they never run at once: one
stream) and both are bound to the same cache through the binding plan. Whether each
``present.*`` output aliases its past input is asked of the engine
(``get_aliased_input_tensor``): yes -> one cache, updated in place; no -> two caches,
alternated each step (the load message says which).

Decode runs as a CUDA graph per row range (first row and batch size; and per cache parity when
alternating), captured on its first use after one eager run: the binding plan keeps every address
fixed, and a step only rewrites the values in the bound input buffers. The plan also outputs ``next_token_ids``
(argmax over V), so greedy decoding can read back ``4 * B`` bytes instead of ``[B, V]`` logits.

**Not yet run on a GPU**: written against TensorRT's documented Python API (>= 10.15:
``deserialize_cuda_engine``, ``create_execution_context``, ``set_optimization_profile_async``,
``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``,
``get_aliased_input_tensor``) and tested only by ``tests/gpu`` on a GPU.
"""

from __future__ import annotations

from pathlib import Path

from kvforge.graphs import contract, environment
from kvforge.graphs import manifest as mf
from kvforge.runtime import device
from kvforge.runtime.backends import binding_plan as bp
from kvforge.runtime.backends.base import GpuBackend, GpuBinding

MIN_TENSORRT = (10, 15)


class TensorRTBackend(GpuBackend):
    name = "tensorrt"

    def __init__(self, root: Path, manifest: mf.Manifest, *, cuda_graphs: bool = True) -> None:
        trt = environment.require_tensorrt(MIN_TENSORRT)
        gpu = device.open_device()
        record = mf.engine_record(manifest)
        mf.check_engine(
            record, tensorrt_version=trt.__version__, gpu_name=gpu.name, compute_capability=gpu.compute_capability
        )
        self.record = record
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine((root / record.plan_file).read_bytes())
        if self.engine is None:
            raise mf.ArtifactError(f"TensorRT could not deserialize {record.plan_file}; {mf.REBUILD}")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.device_argmax = bp.NEXT_TOKEN_IDS in self._outputs  # greedy reads back [B] ids (Engine.decode_rows_argmax)
        n = manifest.model.num_layers
        aliases = {present: self.engine.get_aliased_input_tensor(present) for present in contract.present_names(n)}
        super().__init__(manifest, bp.cache_mode(aliases, n))
        self.cuda_graphs = cuda_graphs
        self._scratch = device.DeviceBuffer(int(self.engine.device_memory_size_v2), zero=False)
        self.contexts = {}
        for profile in ("prefill", "decode"):
            ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            ctx.set_device_memory(self._scratch.ptr, self._scratch.nbytes)
            ctx.set_optimization_profile_async(record.profile(profile).index, self.stream.ptr)
            self.contexts[profile] = ctx
        self.stream.synchronize()
        self._applied: dict[str, tuple[int, ...]] = {}  # profile -> (first, batch, seq, parity) bound now
        self._graphs: dict[tuple[int, int, int], device.CudaGraph] = {}  # (first, batch, parity) -> graph
        print(f"[kvforge] {self.message}")

    # ------------------------------------------------------------ interface

    def input_names(self, graph: str) -> list[str]:
        return list(self._inputs)

    def output_names(self, graph: str) -> list[str]:
        return [n for n in self._outputs if n != bp.NEXT_TOKEN_IDS]  # the contract's outputs

    def bind(self, graph: str, inputs: dict[str, object], outputs: dict[str, object]) -> GpuBinding:
        if graph != "prefill":
            raise ValueError(f"the TensorRT plan runs the prefill graph (decode is its one-token profile), not {graph}")
        host, logits, batch, seq, first = self.step_arrays(inputs, outputs)
        if seq > 1:
            self.check_prompt(seq)
        plans = self.plans(self._inputs, self._outputs, batch, seq, first)
        binding = GpuBinding(graph, plans, host, logits, batch, seq, first)
        binding.tensors[contract.LOGITS] = logits
        return binding

    def run(self, binding: GpuBinding) -> None:
        profile = "decode" if binding.seq == 1 else "prefill"
        ctx = self.contexts[profile]
        self.upload(binding)
        key = (binding.first, binding.batch, self.parity)
        if profile == "decode" and self.cuda_graphs and key in self._graphs:
            self._graphs[key].launch(self.stream)
        else:
            self._apply(profile, ctx, binding)
            if not ctx.execute_async_v3(self.stream.ptr):
                raise RuntimeError(f"TensorRT {profile} execution failed (see the TensorRT log above)")
            if profile == "decode" and self.cuda_graphs:
                # Captured after one eager run (TensorRT's rule: flush deferred shape updates first).
                self._graphs[key] = device.CudaGraph.capture(self.stream, lambda: ctx.execute_async_v3(self.stream.ptr))
        self.download(binding)
        self.advance(binding)

    def _apply(self, profile: str, ctx, binding: GpuBinding) -> None:
        """Set the context's input shapes and every tensor address, unless already bound so."""
        state = (binding.first, binding.batch, binding.seq, self.parity)  # all the plan's addresses hang on
        if self._applied.get(profile) == state:
            return
        plan = self.current(binding)
        for name, s in plan.inputs.items():
            if not ctx.set_input_shape(name, s.shape):
                raise ValueError(f"TensorRT refused shape {s.shape} for {name} in the {profile} profile; {mf.REBUILD}")
            ctx.set_tensor_address(name, self.address(s))
        for name, s in plan.outputs.items():
            ctx.set_tensor_address(name, self.address(s))
        self._applied[profile] = state

    def bound_addresses(self, binding: GpuBinding) -> dict[str, int]:
        """Device address of every bound tensor in the coming run (tests: fixed over steps)."""
        return {name: self.address(s) for name, s in self.current(binding).all().items()}

    def close(self) -> None:
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        self.contexts.clear()
        self.engine = None
        self._scratch.close()
        super().close()
