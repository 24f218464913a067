"""ONNX Runtime backend: one ``InferenceSession`` per graph, run through IOBinding on numpy buffers.

Every input and output is bound by pointer to a numpy array the engine owns; each past-cache
input and its present output get the same pointer, so ``TensorScatter`` writes the new rows in
place and no step copies the cache. A :class:`Binding` is reusable: the decode binding is made once
per batch and each step only rewrites the values inside the bound input buffers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.graphs import contract
from kvforge.graphs.manifest import ArtifactError
from kvforge.runtime.cache import KVCache
from kvforge.runtime.embedding_rows import EmbeddingRows, gather_only_tables


@dataclass(frozen=True)
class OrtOptions:
    """Session options (``Engine.load`` passes them through).

    threads: intra-op threads; None lets ORT use one per physical core.
    spin: let idle intra-op threads spin between ops (lower latency per step, burns CPU while
        waiting); ORT's default is on.
    prepack: let ORT repack constant MatMul weights into its kernels' layout at load (ORT's
        default; 1.6x faster fp32 decode and ~25x faster int4 MatMulNBits here). The repacked
        weights are anonymous memory owned by each session, so each session holds its own
        packed copy (the engine runs generation on one session for this reason). With
        ``prepack=False`` the sessions read the memory-mapped weights file directly: one copy of
        the weights in memory, shared by all graphs, slower.
    optimized: run the ORT-optimized ``<graph>.ort.onnx`` files when the artifact has them,
        without optimizing again at load.
    spin_stop: the intra-op threads stop spinning when a run ends (ORT's
        ``session.force_spinning_stop``); they still spin between the ops of a run. For sessions
        that take turns on the same cores (a draft model and its target): otherwise the threads of
        the session that just ran spin on the cores the next one needs (SmolLM2 fp32 drafted by its
        int4: each call ~2× slower, benchmarks/README.md).
    mem_pattern: ORT's memory pattern (``enable_mem_pattern``): one block planned per input shape,
        kept in the arena. Off by default: each shape (a prefill of B x S tokens, a decode step of B
        rows) would keep a block of its own: +22-24 MiB peak RSS at batch 4 on the SmolLM-135M shape,
        1.27x -> 1.32x the checkpoint; its effect on the decode step was within the noise of this
        machine (p10 0.97-1.0x in two runs, 0.85x in one under load 4; benchmarks/README.md).
    profile: a file prefix: ORT's profiler records every node of every run
        (``SessionOptions.enable_profiling``; ``session.end_profiling()`` writes the JSON and says
        where). Off by default; ``benchmarks/prefill_profile.py`` turns it on.
    flush_denormals: compute with denormal floats flushed to zero (ORT's
        ``session.set_denormal_as_zero``: the FTZ/DAZ flags of the session's pool threads and, in
        the process's first session only, of the thread that creates it, which runs its share of
        each call). A denormal operand costs the CPU ~100x a normal one; the recurrent families'
        decays make them (the delta rules floor their decays in the graph,
        ``gated_delta.LOG_DECAY_FLOOR``; Mamba's do not). Values under 1.2e-38 are too small to
        move a logit. On by default; the flags stay on the loading thread, so numpy and torch
        there flush denormals too; ``False`` leaves every flag as it is.
    """

    threads: int | None = None
    spin: bool = True
    spin_stop: bool = False
    prepack: bool = True
    optimized: bool = True
    mem_pattern: bool = False
    profile: str | None = None
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    log_severity: int = 3  # errors only
    flush_denormals: bool = True


@dataclass
class Binding:
    graph: str
    io_binding: object  # onnxruntime.IOBinding
    tensors: dict[str, np.ndarray]  # keeps the bound buffers alive while the binding exists


class GraphRunError(RuntimeError):
    """ONNX Runtime failed while running a graph the engine had validated inputs for: the graph
    does not run with the manifest's shapes (a corrupted graph loaded with ``verify=False``, or an
    ONNX Runtime fault). The engine's rows are released; the call that ran it fails."""

    def __init__(self, graph: str, error: Exception) -> None:
        detail = str(error).strip().splitlines()[0][:240] if str(error).strip() else type(error).__name__
        super().__init__(
            f"ONNX Runtime failed running the {graph} graph ({detail}); the artifact's graph does not run as its "
            "manifest says: load it with verify=True to detect a corrupted file, or recompile the model"
        )


class OrtBackend:
    name = "ort"

    def __init__(
        self,
        graph_files: dict[str, Path],
        options: OrtOptions = OrtOptions(),
        preoptimized=(),
        weights_file: Path | None = None,
        lazy=(),
    ) -> None:
        """``graph_files``: graph name -> .onnx path; ``preoptimized``: the names whose file was
        optimized at compile time (loaded without optimizing again); ``weights_file``: the
        artifact's shared external-data file, mapped once and handed to every session; ``lazy``:
        graphs whose session is created on first use (each session holds its own prepacked
        weights, so a graph that a run never uses should not cost memory)."""
        self.options = options
        self.graph_files = dict(graph_files)
        self.preoptimized = set(preoptimized)
        self.sessions = {}
        self._weights = _SharedInitializers(weights_file) if weights_file is not None else None
        # Tables only a Gather of input_ids reads, filled row by row (with prepacking; see
        # kvforge.runtime.embedding_rows): by (file, offset, length), and the ones each graph reads.
        self.embedding_rows: dict[tuple[str, int, int], EmbeddingRows] = {}
        self._rows_of: dict[str, list[EmbeddingRows]] = {}
        self._rows_lock = threading.Lock()
        # An OpenVinoPrefill or PrefillSession that runs prefill calls of many tokens (Engine.load's prefill=)
        self.long_prefill = None
        for name in graph_files:
            if name not in lazy:
                self.session(name)
        self.device = "cpu"

    def session(self, name: str):
        """The ``InferenceSession`` of graph ``name``, created on first use."""
        if name in self.sessions:
            return self.sessions[name]
        path = self.graph_files[name]
        so = self._session_options(path, preoptimized=name in self.preoptimized)
        if self._weights is not None:
            self._weights.add_to(so, path)
        elif self.options.prepack:
            self._rows_of[name] = self._add_embedding_rows(so, path)
        self.sessions[name] = self._create(str(path), so, path.name)
        return self.sessions[name]

    def add_session(self, name: str, model: bytes, graph_file: Path, preoptimized: bool, data_folder: Path) -> None:
        """A session of graph ``name`` made from ``model`` (serialized bytes): a rewrite of
        ``graph_file`` (whose embedding tables it shares) with its external data paths relative to
        ``data_folder``."""
        so = self._session_options(graph_file, preoptimized=preoptimized)
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_folder))
        if self.options.prepack:
            self._rows_of[name] = self._add_embedding_rows(so, graph_file)
        self.sessions[name] = self._create(model, so, graph_file.name)

    def drop_session(self, name: str) -> None:
        """Close graph ``name``'s session."""
        self.sessions.pop(name, None)
        self._rows_of.pop(name, None)

    def _session_options(self, path: Path, preoptimized: bool):
        import onnxruntime as ort

        options = self.options
        so = ort.SessionOptions()
        so.log_severity_level = options.log_severity
        if options.threads is not None:
            so.intra_op_num_threads = options.threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if options.spin else "0")
        if options.spin_stop:
            so.add_session_config_entry("session.force_spinning_stop", "1")
        if not options.prepack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        so.enable_mem_pattern = options.mem_pattern
        if options.flush_denormals:
            so.add_session_config_entry("session.set_denormal_as_zero", "1")
        if options.profile is not None:
            so.enable_profiling, so.profile_file_prefix = True, options.profile
        if preoptimized:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return so

    def _create(self, model, so, label: str):
        import onnxruntime as ort

        try:
            return ort.InferenceSession(model, so, providers=list(self.options.providers))
        except Exception as e:  # ORT's errors (InvalidProtobuf, Fail, ...) are not ValueErrors: say what it means
            detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise ArtifactError(
                f"ONNX Runtime cannot load {label} ({detail}): the file is corrupted or not a graph of this "
                "kvforge; recompile the model (Engine.load checks sha256 unless verify=False)"
            ) from e

    def _add_embedding_rows(self, session_options, graph_path: Path) -> list[EmbeddingRows]:
        """Hand ``session_options`` an :class:`EmbeddingRows` for each table of the graph that only
        a ``Gather`` of ``input_ids`` reads (a tied embedding whose lm_head ORT packs from views of
        its own); ORT maps every other initializer itself."""
        import onnx
        import onnxruntime as ort

        try:
            graph = onnx.load(str(graph_path), load_external_data=False).graph
        except Exception:  # not a graph (a corrupted file loaded with verify=False): ORT's load says so
            return []
        tables = []
        for init in gather_only_tables(graph, contract.INPUT_IDS):
            file, offset, length = external_location(init, graph_path)
            key = (str(file), offset, length)
            if key not in self.embedding_rows:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
                try:
                    rows = EmbeddingRows(file, offset, tuple(init.dims), dtype)
                except (OSError, ValueError) as e:  # a missing or truncated weights file (verify=False)
                    raise ArtifactError(
                        f"{graph_path.name}: cannot read the table {init.name} from {file.name} ({e}); "
                        "the artifact is incomplete or corrupted: recompile the model"
                    ) from e
                if rows.array.nbytes != length:
                    raise ArtifactError(
                        f"{graph_path.name}: initializer {init.name} holds {length} bytes, not {rows.array.nbytes}"
                    )
                rows.value = ort.OrtValue.ortvalue_from_numpy(rows.array)
                self.embedding_rows[key] = rows
            session_options.add_initializer(init.name, self.embedding_rows[key].value)
            tables.append(self.embedding_rows[key])
        return tables

    def tensor_shapes(self, graph: str) -> dict[str, list[int | str | None]]:
        """Every input's and output's shape as the graph declares it (ints, or symbolic names)."""
        session = self.session(graph)
        return {t.name: list(t.shape) for t in [*session.get_inputs(), *session.get_outputs()]}

    def allocate_cache(self, manifest, shared: bool = False) -> KVCache:
        """The KV cache of this backend: one numpy array in host memory (see :mod:`kvforge.runtime.cache`);
        ``shared``: in a named shared-memory segment whose rows can be lent to another process."""
        return KVCache(manifest, shared=shared)

    def input_names(self, graph: str) -> list[str]:
        return [i.name for i in self.session(graph).get_inputs()]

    def output_names(self, graph: str) -> list[str]:
        return [o.name for o in self.session(graph).get_outputs()]

    def bind(self, graph: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> Binding:
        """Bind contiguous arrays by name. Outputs are written into the given arrays. A prefill call
        of many tokens is bound to the engine's long prefill when it has one (OpenVINO, or the int8 graph)."""
        if self.long_prefill is not None and self.long_prefill.wants(graph, inputs):
            return self.long_prefill.bind(graph, inputs, outputs)
        return self.bind_session(graph, inputs, outputs)

    def bind_session(self, graph: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> Binding:
        """Bind to the session of ``graph`` itself, whatever the long prefill would take."""
        binding = self.session(graph).io_binding()
        for name, array in inputs.items():
            binding.bind_input(name, "cpu", 0, array.dtype.type, array.shape, _ptr(array))
        for name, array in outputs.items():
            binding.bind_output(name, "cpu", 0, array.dtype.type, array.shape, _ptr(array))
        return Binding(graph, binding, {**inputs, **outputs})

    def run(self, binding: Binding) -> None:
        if not isinstance(binding, Binding):  # an OpenVINO prefill's binding
            self.long_prefill.run(binding)
            return
        session = self.session(binding.graph)
        tables = self._rows_of.get(binding.graph)
        if tables:
            with self._rows_lock:  # no table is emptied while a run reads it
                for table in tables:
                    table.ensure(binding.tensors[contract.INPUT_IDS])
                self._run(session, binding)
        else:
            self._run(session, binding)

    def _run(self, session, binding: Binding) -> None:
        try:
            session.run_with_iobinding(binding.io_binding)
        except Exception as e:  # the inputs were validated: a failing run means the graph itself is wrong
            raise GraphRunError(binding.graph, e) from e

    def bound_output_pointers(self, binding: Binding) -> list[int]:
        """Data pointers of the outputs as ONNX Runtime sees them after a run (in binding order)."""
        return [value.data_ptr() for value in binding.io_binding.get_outputs()]

    def close(self) -> None:
        if self.long_prefill is not None:
            self.long_prefill.close()
            self.long_prefill = None
        self.sessions.clear()
        self._weights = None
        for rows in self.embedding_rows.values():
            rows.close()
        self.embedding_rows.clear()
        self._rows_of.clear()


class _SharedInitializers:
    """The weights file mapped ONCE (read-only) and handed to every session as user-owned
    initializers (``SessionOptions.add_initializer``), so all graphs read the same pages. Left to
    itself, each session maps the file on its own, and the resident set counts the weights once
    per session. Used with ``prepack=False``: with prepacking, ORT makes its own packed copies
    and releases what it read, so a shared mapping would only stay resident beside them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        self.values: dict[tuple[int, int, str], object] = {}  # (offset, length, dtype) -> OrtValue

    def add_to(self, session_options, graph_path: Path) -> None:
        import onnx
        import onnxruntime as ort

        graph = onnx.load(str(graph_path), load_external_data=False)
        for init in graph.graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
                continue
            file, offset, length = external_location(init, graph_path)
            if file != self.path.resolve():
                continue
            dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
            key = (offset, length, dtype.str, tuple(init.dims))
            if key not in self.values:
                array = self.map[offset : offset + length].view(dtype).reshape(tuple(init.dims))
                self.values[key] = ort.OrtValue.ortvalue_from_numpy(array)
            session_options.add_initializer(init.name, self.values[key])


def external_location(init, graph_path: Path) -> tuple[Path, int, int]:
    """Where an externally stored initializer's bytes are: (file, offset, length)."""
    info = {e.key: e.value for e in init.external_data}
    return (graph_path.parent / info["location"]).resolve(), int(info.get("offset", 0)), int(info["length"])


def _ptr(array: np.ndarray) -> int:
    if not array.flags.c_contiguous:
        raise ValueError("bound arrays must be contiguous")  # a programming error, not a user's
    return array.ctypes.data
