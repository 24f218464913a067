"""``StepEngine``: the step machine under :class:`~kvforge.runtime.Engine` — a compiled artifact's
graphs, one persistent KV cache bound to them, and the steps that run on cache rows.

    from kvforge.runtime import Engine, SamplingParams
    with Engine.load("out") as engine:
        [result] = engine.generate(["The for statement"], max_new_tokens=32)
        print(result.text, result.finish_reason)
        for chunk in engine.stream("The for statement", sampling=SamplingParams(temperature=0.7, seed=1)):
            print(chunk.text, end="")

Layers. This module owns buffers, bindings, rows and the steps (``prefill``/``decode``/``verify``/
``score``, KV ``export_kv``/``import_kv``); it imports nothing of the generation layer above it.
:mod:`kvforge.runtime.requests` turns prompts into validated Generations for a step engine;
:mod:`kvforge.runtime.batching` runs them on a range of rows through the steps;
:mod:`kvforge.runtime.scheduler` and :mod:`kvforge.runtime.session` drive the batch loop or one row;
:class:`kvforge.runtime.facade.Engine` (what users import as ``kvforge.runtime.Engine``) is this
class plus the calls users make (``generate``, ``stream``, ``chat``, ``session()``,
``scheduler()``). The narrow interface they use: the steps on rows (``prefill_rows``,
``decode_rows``, ``verify_rows``, ``decode_ids``, ``move_row``), the rows' owners (``own_rows``,
``reserve_row``, ``release_row``, ``_check_rows``, the lock), the cache's KV (``export_kv``,
``import_kv``, ``kv_nbytes``, ``lengths``) and what an artifact gives a request (tokenizer,
generation defaults, grammar factory, drafting set-up).

Ownership. The engine owns every buffer the graphs read or write: the KV cache (one array, see
:mod:`kvforge.runtime.cache`), the input buffers (token ids, positions, write indices, lengths)
and the logits buffer, all numpy arrays allocated once at load. A step writes values into the
input buffers and runs a binding; the decode binding is made once per range of cache rows and
reused by every step. Nothing in generation, sessions or the scheduler reallocates the cache.

One session. A decode step is the prefill graph's ``S = 1`` case (one token per row, written at
``write_indices``, ``input_lengths`` all ones), so by default decode steps run through the prefill
graph's session: ONNX Runtime then loads and repacks the weights once, not once per graph. The
artifact's decode graph (``one_session=False``) gives the same logits from a second session.

Rows. A step runs on a contiguous range of cache rows ``[first, first + B)`` (the graphs take
contiguous ``[B, H_kv, S_max, D]`` views). Who may use which rows:

* a :class:`~kvforge.runtime.session.Session` reserves one row for its lifetime, taken from the
  top (``max_batch - 1`` down), so the free rows stay a contiguous range ``[0, k)``;
* ``generate``, ``stream``, ``chat``, the step API (``prefill``/``decode``/``score``) and a
  :class:`~kvforge.runtime.scheduler.Scheduler` use rows ``[0, k)``, ``k`` = the lowest row a
  session holds (``max_batch`` without sessions); while a scheduler is open (or a ``stream`` is
  being iterated) those rows are its own and the others refuse with ``RuntimeError``;
* every step takes the engine's lock, so sessions and a scheduler on other threads interleave
  whole steps, never halves of one.

Threads (without a scheduler). One engine may be called from several threads; each call either
runs whole or is refused, never mixed with another thread's:

* ``generate`` (and ``chat``) holds the engine's lock for the whole call: concurrent calls
  *serialize* and each returns what it would alone;
* ``stream`` holds rows ``[0, k)`` while iterated: ``generate``/``stream``/the step API/a new
  scheduler or session from another thread are *refused* (``RuntimeError``: the rows belong to
  the running Generation) until it ends;
* the step API holds one batch: ``decode`` from a thread other than the one whose ``prefill``
  (or ``score``) made the batch is *refused* (``RuntimeError``), since it would continue another
  thread's sequences; each ``prefill``/``decode`` call is atomic;
* a session takes one call at a time: a call while another thread's (or an unfinished stream's)
  turn runs on it is *refused* (``RuntimeError``); different sessions run side by side.

The calls users make (``generate``, ``stream``, ``chat``, ``session()``, ``scheduler()``, and
``request``, which validates a prompt and its parameters into a Generation) are
:class:`~kvforge.runtime.facade.Engine`'s, a subclass of this step machine.

KV blocks. ``export_kv`` copies a row's positions out as a :class:`~kvforge.runtime.kv.KVBlock`
and ``import_kv`` copies one in (one strided copy each way); they are
:class:`~kvforge.runtime.kv.transfer.KVTransfer`'s, which ``StepEngine`` inherits (on a hybrid
artifact a block at its row's length carries the row's state too). The prefix pool
(``prefix_pool``, made by ``load(prefix_cache=...)``) is held here for the batch loop, which
imports cached prefixes at admission and offers finished rows; the engine never calls it.

Generation (:mod:`kvforge.runtime.batching`) runs requests through in-flight batching: rows that
finish are retired at once and the queued prompts take their rows; decode steps run on the
contiguous range of active rows only. Stopping: an eos id of the artifact (kept as the last of
``token_ids``, as in transformers), a stop string (``finish_reason="stop"`` and ``stop_string``),
``max_new_tokens`` or a full cache row (``"length"``), ``cancel`` (``"cancelled"``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvforge.graphs import contract
from kvforge.graphs import manifest as mf
from kvforge.runtime import backends
from kvforge.runtime import validate as check
from kvforge.runtime.constraints import GrammarFactory
from kvforge.runtime.kv import PrefixPool, fingerprint, parse_bytes
from kvforge.runtime.kv.transfer import KVTransfer
from kvforge.runtime.ort_backend import OrtBackend, OrtOptions
from kvforge.runtime.ov_prefill import CHOICES as PREFILL_CHOICES
from kvforge.runtime.sampling import GenerationDefaults
from kvforge.runtime.speculative import parse_speculative, setup
from kvforge.runtime.speculative.cost import width_cost
from kvforge.runtime.tokenizer import Tokenizer

__all__ = ["StepEngine"]

# The prefix pool's default budget on the CPU: 512 MiB of host memory holds ~11,600 tokens of a
# 135M-parameter model (30 layers, 3 KV heads of 64, float32: 45 KiB a token), i.e. the system
# prompt and recent turns of a few dozen conversations, for less memory than the model's weights.
DEFAULT_PREFIX_CACHE = "512MiB"

# Tokens per prefill call in generation on the CPU (``prefill_chunk``'s default there). ORT's CPU
# attention (``GroupQueryAttention``) computes a call's whole query x key square and then masks its
# upper half, so one call of M tokens does M^2 attention work where causal attention needs M^2/2;
# calls of 256 tokens do (M/256 + 1)/2 of it. SmolLM2-135M, 2 threads, prompts of 1024 / 2000
# tokens: fp32 x0.92 / x0.90 the one-call time, int4 x0.93 / x0.94, prefill="int8" x0.79 / x0.84;
# 512 tokens x0.97-0.99 (benchmarks/FINDINGS.md, "Chunked prompts"). GPU attention kernels skip
# the masked blocks themselves, as OpenVINO's paged kernel does (``prefill="openvino"``, x1.11-1.13
# slower in 256-token calls): there a call takes the whole prompt (the artifact's max_prompt).
CPU_PREFILL_CHUNK = 256


class StepEngine(KVTransfer):
    """The step machine (see the module docstring); users load :class:`kvforge.runtime.Engine`."""

    def __init__(
        self,
        artifact_dir: Path,
        manifest: mf.Manifest,
        backend: OrtBackend,
        decode_graph: str = "prefill",
        kv_shared: bool = False,
    ) -> None:
        self.artifact_dir = artifact_dir
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = _load_tokenizer(artifact_dir) if manifest.tokenizer.get("has_tokenizer") else None
        self.eos_token_ids = frozenset(manifest.generation.get("eos_token_ids", []))
        self.decode_graph = decode_graph
        # The graph of prefill steps: the prefill graph, or with speculative decoding the verify graph
        # (logits at logit_indices), which then serves prefill, decode and verify in one session.
        self.step_graph = "verify" if decode_graph == "verify" else "prefill"
        self._checked: set[str] = set()
        self._check_graph_io(self.step_graph)

        limits, vocab = manifest.limits, manifest.model.vocab_size
        self.max_batch, self.max_seq, self.vocab_size = limits.max_batch, limits.max_seq, vocab
        # On the backend's device, owned by the backend; kv_shared: host memory in a named shared-memory
        # segment whose rows a lending scheduler lends to another process (kvforge.runtime.kv.shm).
        self.cache = backend.allocate_cache(manifest, shared=True) if kv_shared else backend.allocate_cache(manifest)
        # Persistent input/output buffers; a call binds the leading elements as [B, S] views.
        n, b = limits.max_batch * limits.max_seq, limits.max_batch
        self._ids = np.zeros(n, dtype=np.int64)
        self._pos = np.zeros(n, dtype=np.int64)
        self._write = np.zeros(b, dtype=np.int64)
        self._input_lengths = np.zeros(b, dtype=np.int64)
        self._dec_ids = np.zeros(b, dtype=np.int64)
        self._dec_pos = np.zeros(b, dtype=np.int64)
        self._dec_write = np.zeros(b, dtype=np.int64)
        self._dec_lengths = np.ones(b, dtype=np.int64)  # a decode step through the prefill graph
        # in the model's dtype: the cache's, except for an 8-bit KV cache (int8)
        self._logits = np.zeros(b * vocab, dtype=getattr(self.cache, "model_dtype", self.cache.buffer.dtype))
        # The verify graph's one logit position per row: each row's last real token (prefill), 0 (decode).
        self._pre_picks = np.zeros(b, dtype=np.int64)
        self._dec_picks = np.zeros(b, dtype=np.int64)
        # Speculative decoding (set by load): its config, the draft model, the verify call's buffers.
        self.speculative = None
        self.draft_model = None
        # One more token of a row's own verify call, in steps (prompt lookup's length rule)
        self.width_cost = width_cost(self.manifest.quantization is not None)
        self.verify_width = 1
        self._verify_bindings: dict[tuple[int, int, int], object] = {}
        self.verify_states: dict[str, np.ndarray] = {}  # a hybrid's verify writes its states here
        self.lengths = np.zeros(b, dtype=np.int64)  # cache rows in use, per row
        self.batch = 0  # rows of the current sequence batch (set by prefill)
        self._batch_thread: int | None = None  # the thread whose prefill/score made the batch
        self._decode_bindings: dict[tuple[int, int], object] = {}  # (first row, batch) -> binding
        self.last_bindings: dict[str, object] = {}  # the binding of the latest call, per graph
        # Generation: defaults from generation_config.json, the prefill chunk, row ownership.
        self.generation_defaults = GenerationDefaults.from_artifact(artifact_dir)
        # Tokens per prefill call in generation; see chunk_tokens and CPU_PREFILL_CHUNK.
        whole = backend.device != "cpu" or getattr(getattr(backend, "long_prefill", None), "whole_prompts", False)
        self.prefill_chunk = limits.max_prompt if whole else min(limits.max_prompt, CPU_PREFILL_CHUNK)
        self._chat_template: object = None  # loaded on first use of chat
        tokenizer_json = artifact_dir / "tokenizer.json" if self.tokenizer is not None else None
        self.grammars = GrammarFactory(tokenizer_json, vocab, self.eos_token_ids)  # structured output
        self._lock = threading.RLock()  # one step at a time, whichever thread runs it
        self._session_rows: set[int] = set()
        self._rows_owner: object | None = None  # the scheduler or stream that holds rows [0, k)
        # KV blocks: what this artifact's KV must match to be imported; the prefix pool the batch
        # loop reuses prompts from (set by load's prefix_cache; the engine itself never calls it).
        self.kv_fingerprint = fingerprint(manifest)
        self.prefix_pool: PrefixPool | None = None

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        artifact_dir: str | Path,
        *,
        threads: int | None = None,
        spin: bool = True,
        spin_stop: bool | None = None,
        prepack: bool = True,
        optimized: bool = True,
        mem_pattern: bool = False,
        one_session: bool = True,
        verify: bool = True,
        device: str = "cpu",
        backend: str = "ort",
        prefix_cache: int | str | None = None,
        speculative: object = None,
        draft: str | Path | None = None,
        kv_shared: bool = False,
        flush_denormals: bool = True,
        prefill: str = "ort",
    ) -> StepEngine:
        """Load an artifact on ONNX Runtime's CPU provider, or on a GPU.

        ``device="cuda"`` with ``backend="tensorrt"`` runs the artifact's TensorRT plan (built by
        ``kvforge build OUT``), with ``backend="ort"`` ONNX Runtime's CUDA provider; both keep the
        cache on the device (:mod:`kvforge.runtime.backends`; not yet run on a GPU). Without CUDA
        (or TensorRT, or ORT's CUDA provider) they raise
        :class:`kvforge.graphs.environment.DeviceUnavailableError` naming what is missing.

        ``threads``, ``spin``, ``prepack``, ``optimized``, ``mem_pattern``, ``flush_denormals``: ONNX Runtime
        session settings, see
        :class:`kvforge.runtime.ort_backend.OrtOptions` (the defaults favour speed: ORT repacks
        the weights into its kernels' layout, once per session). ``spin_stop`` (None: on with a
        ``draft`` model, for both engines, and with any ``prefill`` but ``"ort"``, whose second
        runtime or session takes turns on the same cores; off otherwise): the intra-op threads stop
        spinning when a run ends (an OpenVINO prefill of 128 tokens right after decode steps: 60-62
        against 67-68 ms, the steps within 1%). ``one_session`` runs decode steps
        through the prefill graph's session, so generation holds one packed copy of the weights;
        ``False`` runs them on the decode graph in a session of its own (a second copy). The
        score graph's session is created on first use of :meth:`score`. ``verify`` checks every
        file's sha256 against the manifest (sizes are always checked).

        ``prefix_cache``: the byte budget of the automatic prefix cache (:mod:`kvforge.runtime.kv`),
        an int or a string such as ``"512MiB"``; ``0`` disables it. ``None`` (the default) means
        ``"512MiB"`` on the CPU and off on a GPU (the device caches have no KV export yet). Raises
        :class:`kvforge.graphs.manifest.ArtifactError` for a missing, foreign, corrupted or
        incompatible artifact.

        ``speculative``: ``"ngram"`` / ``"ngram:K"`` (prompt-lookup drafts), ``"draft"`` with
        ``draft=DRAFT_OUT`` (a draft model: another kvforge artifact with the same tokenizer, loaded
        with the same settings), ``"prediction"`` (only requests' ``SamplingParams(prediction=...)``)
        or a :class:`~kvforge.runtime.speculative.SpeculativeConfig`; see
        :mod:`kvforge.runtime.speculative`. The one session then runs the artifact's verify graph
        (schema 2) for every step; greedy output is token-identical to plain decoding (bit for bit
        with ``--lowering exact``; with ``gqa``/``onnx`` up to near-ties: README, "Greedy identity,
        and the near-tie caveat").

        ``kv_shared``: the KV cache in a named POSIX shared-memory segment (``/dev/shm``, the same
        memory use) whose rows a lending scheduler (``scheduler(lend_rows=True)``) lends to a
        decode worker's import instead of copying a hand-off out (:mod:`kvforge.runtime.kv.shm`);
        CPU only. Only a lending scheduler keeps lent rows out of use (generate, sessions and other
        schedulers do not read the rows' state words; a taker refuses an overwritten row by its
        checksum). :meth:`close` unlinks the segment.

        ``prefill="openvino"`` (CPU, ``pip install 'kvforge[openvino]'``): prefill calls whose rows have
        at least 32 tokens each run the artifact's prefill graph on OpenVINO's CPU plugin at f32, the
        batch in one call, bound to the same cache; decode steps and shorter calls stay on ORT (with
        ``speculative``, the verify steps; :mod:`kvforge.runtime.ov_prefill`: what it refuses, and why
        it pays for int4 artifacts on CPUs with AMX/VNNI). ``"openvino:bf16"``: the same at bfloat16
        (CPUs with AVX512-BF16 or AMX), about twice as fast, the prompt's logits and K/V rounded as
        bf16 computes them. ``"int8"`` (CPU, int4 artifacts): prefill calls whose rows have at least 2
        tokens each run a second ORT graph made at load from the prefill graph, its int4 projections
        on ORT's integer GEMM (the same weights in 8 bits, activations rounded to int8 per token after
        a smoothing measured on the bundled text at the first such load, then kept in
        ``$KVFORGE_CACHE/calibration``, default ``~/.cache/kvforge``; ``KVFORGE_CALIBRATION`` names
        another folder, or ``off`` to measure it at every load): about a third of the time to first
        token, at a perplexity cost in the prompt's pass (+1.5-1.8% on SmolLM2;
        :mod:`kvforge.runtime.int8_prefill`). ``"fp32"`` (CPU, int4 artifacts): the same calls on
        the same graph with its 4-bit projections at ``MatMulNBits``' accuracy level 1 (the int4
        weights, float activations: no rounding of the prompt's activations): 0.7x the time to first
        token on CPUs without AMX, slower with it. ``"ort"``: everything on ORT.
        """
        check.path("artifact_dir", artifact_dir, "the directory written by kvforge compile")
        threads = check.optional_count("threads", threads)
        for name, value in [
            ("spin", spin),
            ("prepack", prepack),
            ("optimized", optimized),
            ("mem_pattern", mem_pattern),
            ("flush_denormals", flush_denormals),
        ]:
            check.flag(name, value)
        if spin_stop is not None:
            check.flag("spin_stop", spin_stop)
        check.flag("one_session", one_session)
        check.flag("verify", verify)
        check.flag("kv_shared", kv_shared)
        if not isinstance(device, str) or not isinstance(backend, str):
            raise check.WrongType(
                f"device={check.short_repr(device)}, backend={check.short_repr(backend)} are not accepted: "
                "both must be strings (device 'cpu' or 'cuda', backend 'ort' or 'tensorrt')"
            )
        backends.check_choice(device, backend)
        if prefill not in PREFILL_CHOICES:
            raise check.InvalidValue(
                f"prefill={check.short_repr(prefill)} is not accepted: one of {', '.join(map(repr, PREFILL_CHOICES))}"
            )
        if prefill != "ort" and device != "cpu":
            raise ValueError(
                f"prefill={prefill!r} runs the prefill graph on the CPU, and device={device!r}; "
                "load it with prefill='ort'"
            )
        budget = parse_bytes(DEFAULT_PREFIX_CACHE if prefix_cache is None and device == "cpu" else prefix_cache or 0)
        if budget and device == "cuda":
            raise ValueError(
                f"prefix_cache={prefix_cache!r}: the prefix cache needs KV export from the cache, which the GPU "
                "backends do not have yet; pass prefix_cache=0 (or leave it unset) on device='cuda'"
            )
        spec = parse_speculative(speculative, draft)
        root = Path(artifact_dir)
        manifest = mf.read(root, verify=verify)
        if manifest.layout.has_state:
            _check_state_options(manifest, device, kv_shared)
        if manifest.layout.quantized_kv and (device != "cpu" or kv_shared):
            raise ValueError(
                f"{'kv_shared=True' if kv_shared else f'device={device!r}'}: this artifact's KV cache is 8-bit "
                "with per-row scales (--kv-dtype int8), which only the CPU backend binds and lent rows do not carry "
                "yet; load it with device='cpu' and without kv_shared, or recompile with --kv-dtype float"
            )
        if spec is not None:
            setup.check_artifact(manifest, device, one_session)
        if device == "cuda":
            if kv_shared:
                raise ValueError(
                    "kv_shared=True puts the KV cache in host shared memory, which the GPU backends do not use; "
                    "leave it off on device='cuda'"
                )
            return cls(root, manifest, backends.open_gpu_backend(root, manifest, backend))
        if manifest.dtype == "bfloat16":
            raise mf.ArtifactError(
                "this artifact is bfloat16, which ONNX Runtime's CPU provider cannot run; "
                "recompile with --dtype float32 (or float16) for CPU"
            )
        if spin_stop is None:
            # Two engines (or two runtimes, or two sessions) taking turns: none may spin on the others' cores.
            spin_stop = draft is not None or prefill != "ort"
        options = OrtOptions(
            threads=threads,
            spin=spin,
            spin_stop=spin_stop,
            prepack=prepack,
            optimized=optimized,
            mem_pattern=mem_pattern,
            flush_denormals=flush_denormals,
        )
        use_ort = {name for name, g in manifest.graphs.items() if optimized and g.ort_file}
        graph_files = {name: root / (g.ort_file if name in use_ort else g.file) for name, g in manifest.graphs.items()}
        # Without prepacking, every session reads the weights as they are: map them once for all.
        # With it, ORT packs its own copies and frees what it read, so sharing would only add.
        shared = None if prepack else root / manifest.weights.file
        # Sessions are made on first use (each holds its own packed weights); the step graph is used at once.
        step = "verify" if spec is not None else "prefill"
        lazy = tuple(name for name in graph_files if name != step)
        backend = OrtBackend(graph_files, options, preoptimized=use_ort, weights_file=shared, lazy=lazy)
        if prefill != "ort" and prefill not in ("int8", "fp32"):
            from kvforge.runtime import ov_prefill  # imports OpenVINO when it runs

            ov_prefill.check_artifact(manifest, prefill)
            precision = ov_prefill.PRECISIONS[prefill]
            graph = root / manifest.graphs["prefill"].file
            backend.long_prefill = ov_prefill.OpenVinoPrefill(graph, threads, precision=precision)
        engine = cls(root, manifest, backend, decode_graph=step if one_session else "decode", kv_shared=kv_shared)
        if prefill in ("int8", "fp32"):
            from kvforge.runtime import int8_prefill

            try:  # int8: each projection's input smoothed by its ranges over the bundled text
                ranges = int8_prefill.cached_ranges(engine) if prefill == "int8" and engine.tokenizer else None
                backend.long_prefill = int8_prefill.PrefillSession(
                    backend, graph_files["prefill"], "prefill" in use_ort, compute=prefill, ranges=ranges
                )
            except BaseException:
                engine.close()
                raise
        engine.prefix_pool = PrefixPool(budget, needs_state=manifest.layout.has_state) if budget else None
        if spec is not None:
            try:
                drafter = None
                if draft is not None:
                    drafter = cls.load(
                        draft,
                        threads=threads,
                        spin=spin,
                        spin_stop=spin_stop,
                        prepack=prepack,
                        optimized=optimized,
                        verify=verify,
                        flush_denormals=flush_denormals,
                    )
                engine.enable_speculative(spec, drafter)
            except BaseException:
                engine.close()
                raise
        return engine

    def enable_speculative(self, config, draft_engine: StepEngine | None = None) -> None:
        """Turn on drafting (called by :meth:`load`): the verify call's buffers (``max_batch ×
        config.max_width`` positions of logits), and the draft model, whose tokenizer must be
        this artifact's."""
        from kvforge.runtime.speculative.draft_model import DraftModel

        if draft_engine is not None:
            self.draft_model = DraftModel(draft_engine, self)
        self.speculative = config
        self.verify_width = w = config.max_width
        n = self.max_batch * w
        self._ver_ids = np.zeros(n, dtype=np.int64)
        self._ver_pos = np.zeros(n, dtype=np.int64)
        self._ver_write = np.zeros(self.max_batch, dtype=np.int64)
        self._ver_picks = np.zeros(n, dtype=np.int64)
        self._ver_offsets = np.arange(w, dtype=np.int64)
        self._ver_logits = np.zeros(n * self.vocab_size, dtype=self._logits.dtype)
        # A hybrid artifact's verify call writes each state here, not over the row's own, which stays
        # at the row's length: a row keeps the state of the tokens it accepts (speculative.states).
        self.verify_states = {name: np.zeros_like(state) for name, state in self.cache.states.items()}

    def _check_graph_io(self, graph: str) -> None:
        """The graph must have exactly the I/O the manifest and the KV contract name (checked once,
        when the graph is first used)."""
        if graph in self._checked:
            return
        n = self.manifest.layout
        if graph not in self.manifest.graphs:
            raise mf.ArtifactError(f"the artifact has no {graph} graph; recompile the model with this kvforge")
        inputs, outputs = contract.input_names(graph, n), contract.output_names(n)
        got = (self.backend.input_names(graph), self.backend.output_names(graph))
        if sorted(got[0]) != sorted(inputs) or sorted(got[1]) != sorted(outputs):
            raise mf.ArtifactError(
                f"{graph} graph I/O does not follow the KV contract (inputs {got[0]}, outputs {got[1]}); "
                "recompile the model with this kvforge"
            )
        if hasattr(self.backend, "tensor_shapes"):
            self._check_static_dims(graph, self.backend.tensor_shapes(graph))
        self._checked.add(graph)

    def _check_static_dims(self, graph: str, shapes: Mapping[str, list]) -> None:
        """The graph's fixed dims must be the manifest's: KV heads and head size of every cache
        tensor, the vocabulary of the logits (a manifest edited after compile would otherwise make
        buffers of the wrong size, and ONNX Runtime fail mid-step)."""
        m = self.manifest.model
        layout = self.manifest.layout
        expected = {name: {1: m.num_kv_heads, 3: m.head_dim} for name in contract.kv_past_names(layout)}
        expected.update({name: {1: m.num_kv_heads, 3: m.head_dim} for name in contract.kv_present_names(layout)})
        for entry, t in layout.state_tensors():  # [B, *shape]
            dims = {axis + 1: d for axis, d in enumerate(t.shape)}
            expected[contract.past_state_name(entry.layer, t.part)] = dims
            expected[contract.present_state_name(entry.layer, t.part)] = dims
        expected[contract.LOGITS] = {-1: m.vocab_size}
        for name, dims in expected.items():
            shape = shapes.get(name, [])
            for axis, want in dims.items():
                got = shape[axis] if -len(shape) <= axis < len(shape) else None
                if isinstance(got, int) and got != want:
                    raise mf.ArtifactError(
                        f"{graph} graph's {name} has shape {shape}, but the manifest says {want} at axis {axis} "
                        "(model.num_kv_heads/head_dim/vocab_size): the manifest does not describe this graph; "
                        "recompile the model"
                    )

    def close(self) -> None:
        """Free the sessions' bindings, the backend and the cache (a scheduler holding the rows is
        closed first by :meth:`kvforge.runtime.facade.Engine.close`)."""
        if self.draft_model is not None:
            self.draft_model.close()
        self._decode_bindings.clear()
        self._verify_bindings.clear()
        self.last_bindings.clear()
        self.backend.close()
        if hasattr(self.cache, "close"):
            self.cache.close()  # a shared cache's segment is unlinked (mapped views stay valid)

    def __enter__(self) -> StepEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- steps

    def _outputs(self, batch: int, first: int = 0) -> dict[str, np.ndarray]:
        """Logits and present caches of rows ``[first, first + batch)``; each present shares its
        past input's buffer."""
        views = self.cache.views(batch, first)
        n = self.manifest.layout
        presents = {present: views[past] for past, present in zip(contract.past_names(n), contract.present_names(n))}
        return {
            contract.LOGITS: self._logits[: batch * self.vocab_size].reshape(batch, self.vocab_size),
            **presents,
        }

    def prefill(self, rows: Sequence[Sequence[int]], start: Sequence[int] | None = None) -> np.ndarray:
        """Write each row's tokens into its cache row at ``start`` (default 0) and return the logits
        of each row's last token, ``[B, V]`` (a view of the engine's logits buffer, valid until the
        next step; copy it to keep it). Starts a new batch of ``len(rows)`` rows (cache rows
        ``[0, B)``); ``start > 0`` continues a sequence already in the cache (chunked prefill,
        multi-turn). Refused while a scheduler or stream holds the rows or a session holds one of them."""
        rows, start = self._step_inputs(rows, start)
        with self._lock:
            self._check_step_rows(len(rows))
            self._check_rows(rows, start)
            logits = self.prefill_rows(rows, start, first=0)
            self.batch, self._batch_thread = len(rows), threading.get_ident()
            return logits

    def prefill_prompt(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """:meth:`prefill` of prompts of one length as generation prefills them: in one call when
        they fit in one chunk together (rows x length <= :attr:`chunk_tokens`, the batch loop's
        group rule), else each row alone in consecutive calls of ``chunk_tokens`` tokens. Returns
        the logits of each row's last token, ``[B, V]`` (what ``bench`` and the peer benchmarks
        time as the first token)."""
        if len({len(row) for row in rows}) != 1:
            raise ValueError("prefill_prompt takes prompts of one length; prefill ragged rows with prefill()")
        chunk, n = self.chunk_tokens, len(rows[0])
        if len(rows) * n <= chunk:
            return self.prefill(rows)
        with self._lock:
            self._check_step_rows(len(rows))
            self._check_rows(rows, [0] * len(rows))
            last = []
            for i, row in enumerate(rows):
                for s0 in range(0, n, chunk):
                    logits = self.prefill_rows([row[s0 : s0 + chunk]], [s0], first=i)
                last.append(logits[0].copy())
            self.batch, self._batch_thread = len(rows), threading.get_ident()
            return np.stack(last)

    def prefill_rows(self, rows: Sequence[Sequence[int]], start: Sequence[int], first: int) -> np.ndarray:
        """:meth:`prefill` into cache rows ``[first, first + len(rows))``, without the ownership
        and token checks (the caller has made them; used by generation and sessions). Returns the
        last token's logits per row, ``[B, V]``, a view of the logits buffer."""
        batch = len(rows)
        inputs = self._fill_inputs(rows, list(start), max(len(r) for r in rows), first)
        outputs = self._outputs(batch, first)
        graph = self.step_graph
        long_prefill = getattr(self.backend, "long_prefill", None)
        if graph == "verify" and long_prefill is not None and long_prefill.wants("prefill", inputs):
            graph = "prefill"  # a prompt OpenVINO takes: its prefill graph, the steps stay on verify
        if graph == "verify":  # logits at each row's last real token, [B, 1, V]
            picks = self._pre_picks[:batch]
            np.subtract(inputs.pop(contract.INPUT_LENGTHS), 1, out=picks)
            inputs[contract.LOGIT_INDICES] = picks.reshape(batch, 1)
            outputs[contract.LOGITS] = outputs[contract.LOGITS].reshape(batch, 1, self.vocab_size)
        binding = self.backend.bind(graph, inputs, outputs)
        self.backend.run(binding)
        self.last_bindings["prefill"] = binding
        return self._logits[: batch * self.vocab_size].reshape(batch, self.vocab_size)

    def score(self, rows: Sequence[Sequence[int]], start: Sequence[int] | None = None) -> np.ndarray:
        """Like :meth:`prefill`, but returns the logits of every position, ``[B, S, V]`` (a new
        array; positions past a row's length are padding). Runs the separate score graph, for
        tools such as perplexity; the cache is updated as by :meth:`prefill`."""
        rows, start = self._step_inputs(rows, start)
        if self.manifest.layout.has_state and len({len(r) for r in rows}) > 1:
            raise ValueError(
                f"score: this artifact's {state_summary(self.manifest)}, written after each row's last token, and "
                "the score graph has no row lengths: a shorter row's padding would enter its state; score rows "
                "of equal length (or one at a time)"
            )
        with self._lock:
            self._check_step_rows(len(rows))
            self._check_rows(rows, start)
            logits = self.score_rows(rows, start, first=0)
            self.batch, self._batch_thread = len(rows), threading.get_ident()
            return logits

    def score_rows(self, rows: Sequence[Sequence[int]], start: Sequence[int], first: int) -> np.ndarray:
        """:meth:`score` into cache rows ``[first, first + len(rows))``, without the ownership and
        token checks (the caller has made them; used by the scheduler's prompt scoring). Returns
        the logits of every position, ``[B, S, V]``, a new array."""
        if "score" not in self.manifest.graphs:
            raise ValueError("this artifact has no score graph; recompile without --no-score-graph")
        self._check_graph_io("score")
        batch, seq = len(rows), max(len(r) for r in rows)
        inputs = self._fill_inputs(rows, list(start), seq, first)
        del inputs[contract.INPUT_LENGTHS]
        outputs = self._outputs(batch, first)
        logits = outputs[contract.LOGITS] = np.empty((batch, seq, self.vocab_size), dtype=self._logits.dtype)
        binding = self.backend.bind("score", inputs, outputs)
        self.backend.run(binding)
        return logits

    def _step_inputs(self, rows: object, start: object) -> tuple[list[list[int]], list[int]]:
        """The step API's ``rows`` and ``start`` checked for type: ``list[list[int]]`` and one
        non-negative int per row (values are checked by :meth:`_check_rows`)."""
        rows = check.id_rows("rows", rows)
        if start is None:
            return rows, [0] * len(rows)
        starts = check.token_ids("start", start, rule="start must be a list of ints, one cache position per row")
        if len(starts) != len(rows):
            raise check.InvalidValue(
                f"start={check.short_repr(start)} is not accepted: start must hold one position per row "
                f"({len(rows)} rows, got {len(starts)} positions)"
            )
        self._check_continuation(rows, starts)
        return rows, starts

    def _check_continuation(self, rows: list[list[int]], start: list[int]) -> None:
        """ORT's GroupQueryAttention (the gqa lowering) continues cached sequences only one row at a
        time when more than one token is fed (it fails with "batch_size must be 1 when
        sequence_length > 1 and past context is given"; found by tests/test_fuzz.py): refuse it
        here, before anything runs, saying what works."""
        seq = max(map(len, rows), default=0)
        if max(start, default=0) + seq > self.max_seq:
            return  # refused by the padding check of _fill_inputs, with its own message
        if self.manifest.lowering == "gqa" and len(rows) > 1 and max(start) > 0 and seq > 1:
            raise check.InvalidValue(
                f"start={check.short_repr(start)} is not accepted with {len(rows)} rows of up to "
                f"{max(map(len, rows))} tokens: this artifact's gqa lowering (ONNX Runtime's GroupQueryAttention) "
                "continues cached sequences (start > 0) one row at a time when a row has more than one token; "
                "prefill those rows in separate calls (sessions do), or compile with --lowering onnx"
            )

    def _fill_inputs(
        self, rows: Sequence[Sequence[int]], start: list[int], seq: int, first: int = 0
    ) -> dict[str, np.ndarray]:
        """Write a ragged batch, right-padded to ``seq``, into the persistent input buffers, for
        cache rows ``[first, first + len(rows))``."""
        batch = len(rows)
        if max(start) + seq > self.max_seq:
            # Padding is written too: a short row at a late start would write past its cache row.
            raise ValueError(
                f"rows padded to {seq} tokens at start {max(start)} would write past max_seq={self.max_seq}; "
                "prefill such rows in separate calls"
            )
        ids = self._ids[: batch * seq].reshape(batch, seq)
        pos = self._pos[: batch * seq].reshape(batch, seq)
        ids.fill(0)  # padding id 0: padded positions are written, masked, then overwritten
        for b, (row, s0) in enumerate(zip(rows, start)):
            ids[b, : len(row)] = row
            pos[b] = np.arange(s0, s0 + seq)
            self._write[b] = s0
            self._input_lengths[b] = len(row)
            self.lengths[first + b] = s0 + len(row)
        return {
            contract.INPUT_IDS: ids,
            contract.POSITION_IDS: pos,
            contract.WRITE_INDICES: self._write[:batch],
            contract.INPUT_LENGTHS: self._input_lengths[:batch],
            **self.cache.views(batch, first),
        }

    def decode(self, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        """Append one token to each row of the current batch; return the next logits ``[B, V]``.

        ``tokens``: exactly ``B`` ids (the batch of the last :meth:`prefill`), Python or numpy ints in
        ``[0, vocab_size)``; a bare int is one row's token. Anything else raises ValueError/TypeError
        (:mod:`kvforge.runtime.validate`) before the step runs."""
        if check.is_int(tokens):
            tokens = [tokens]  # one row: a bare id is accepted as a list of one
        ids = check.token_ids("tokens", tokens, vocab_size=self.vocab_size)
        with self._lock:
            batch = self.batch
            if batch == 0:
                raise RuntimeError("decode needs a batch: call prefill first")
            if self._batch_thread != threading.get_ident():
                raise RuntimeError(
                    "the current batch was prefilled by another thread: the step API holds one batch, and "
                    "decode continues the last prefill, whichever thread made it. Drive prefill/decode from one "
                    "thread, or use a session per thread (engine.session()) or a scheduler (engine.scheduler())"
                )
            self._check_step_rows(batch)
            if len(ids) != batch:
                raise check.InvalidValue(
                    f"tokens={check.short_repr(tokens)} is not accepted: decode takes one token per row of the "
                    f"current batch, {batch} (set by the last prefill), got {len(ids)}"
                )
            if (self.lengths[:batch] >= self.max_seq).any():
                raise ValueError(f"a row's cache is full (max_seq={self.max_seq}); recompile with a larger --max-seq")
            self._dec_ids[:batch] = ids
            return self.decode_rows(batch)

    def decode_rows(self, batch: int, first: int = 0) -> np.ndarray:
        """One decode step on cache rows ``[first, first + batch)`` with the tokens already written
        into ``decode_ids(batch)``; returns the logits ``[batch, V]`` (a view of the logits buffer).
        Allocates nothing: the binding of this row range is made once and reused, and the positions
        are written into the bound buffers. A row whose cache is full (finished in generation)
        writes into its last slot instead of past the end."""
        binding = self._decode_binding(batch, first)
        self.backend.run(binding)
        self.lengths[first : first + batch] += 1
        self.last_bindings["decode"] = binding
        return self._logits[: batch * self.vocab_size].reshape(batch, self.vocab_size)

    @property
    def verify_together(self) -> bool:
        """Whether several rows can verify in one call: not in the gqa lowering (ONNX Runtime's
        GroupQueryAttention takes several tokens per row only for one row)."""
        return self.manifest.lowering != "gqa"

    def verify_ids(self, batch: int, width: int) -> np.ndarray:
        """The bound token-id input of the next :meth:`verify_rows` call, ``[batch, width]`` int64
        (a view of the engine's buffer: write each row's last token and its drafts into it)."""
        return self._ver_ids[: batch * width].reshape(batch, width)

    def verify_rows(self, batch: int, width: int, first: int = 0) -> np.ndarray:
        """Speculative verification: ``width`` tokens per row (already in :meth:`verify_ids`) written
        at each row's length in cache rows ``[first, first + batch)``, with logits at every one of
        them: returns ``[batch, width, V]`` (a view of the engine's verify logits, valid until the
        next call). Every row's length grows by ``width``; the caller sets each row's length back to
        the tokens it accepted (positions past a row's length are stale and never attended).
        A hybrid artifact's states after the ``width`` tokens go to :attr:`verify_states` (by
        past-input name, ``[B_max, *shape]``), the rows' own states stay as they were: the caller
        keeps each row's by :func:`kvforge.runtime.speculative.states.keep_accepted`.
        The binding of each ``(first, batch, width)`` is made once and reused."""
        if self.speculative is None:
            raise RuntimeError("verify_rows needs speculative decoding: load the engine with speculative=...")
        if not 1 <= width <= self.verify_width:
            raise ValueError(f"verify width {width} is outside 1..{self.verify_width} (the speculative config's)")
        if batch > 1 and width > 1 and not self.verify_together:
            raise ValueError("the gqa lowering verifies one row per call; compile with --lowering onnx for batches")
        lengths = self.lengths[first : first + batch]
        if int(lengths.max()) + width > self.max_seq:
            raise ValueError(f"verifying {width} tokens would write past max_seq={self.max_seq}")
        write, pos = self._ver_write[:batch], self._ver_pos[: batch * width].reshape(batch, width)
        picks = self._ver_picks[: batch * width].reshape(batch, width)  # logits at every position
        np.copyto(write, lengths)
        np.add(write[:, None], self._ver_offsets[:width], out=pos)
        picks[:] = self._ver_offsets[:width]
        binding = self._verify_bindings.get((first, batch, width))
        if binding is None:
            inputs = {
                contract.INPUT_IDS: self.verify_ids(batch, width),
                contract.POSITION_IDS: pos,
                contract.WRITE_INDICES: write,
                contract.LOGIT_INDICES: picks,
                **self.cache.views(batch, first),
            }
            outputs = self._outputs(batch, first)
            outputs[contract.LOGITS] = self._ver_logits[: batch * width * self.vocab_size].reshape(
                batch, width, self.vocab_size
            )
            for past, scratch in self.verify_states.items():
                outputs[self.cache.present_of[past]] = scratch[first : first + batch]
            binding = self._verify_bindings[(first, batch, width)] = self.backend.bind("verify", inputs, outputs)
        self.backend.run(binding)
        lengths += width
        self.last_bindings["verify"] = binding
        return binding.tensors[contract.LOGITS]

    @property
    def device_argmax(self) -> bool:
        """Whether the backend computes each row's argmax on the device (TensorRT's
        ``next_token_ids`` output), so greedy decoding can read back ``[B]`` ids, not ``[B, V]`` logits."""
        return bool(getattr(self.backend, "device_argmax", False))

    def decode_rows_argmax(self, batch: int, first: int = 0) -> np.ndarray:
        """:meth:`decode_rows` for rows that all decode greedily, on a backend with
        :attr:`device_argmax`: returns each row's argmax token id ``[batch]`` (int32, a view of the
        backend's buffer, valid until the next step); only those ``4·batch`` bytes cross from the
        device, and the logits buffer is left as it was."""
        if not self.device_argmax:
            raise RuntimeError(f"the {self.backend.name} backend has no device argmax; use decode_rows")
        binding = self._decode_binding(batch, first)
        binding.read_logits = False
        try:
            self.backend.run(binding)
        finally:
            binding.read_logits = True
        self.lengths[first : first + batch] += 1
        self.last_bindings["decode"] = binding
        return self.backend.next_token_ids(binding)

    def _decode_binding(self, batch: int, first: int):
        """The reusable decode binding of rows ``[first, first + batch)``, with this step's write
        indices and positions written into its bound buffers."""
        lengths = self.lengths[first : first + batch]
        np.minimum(lengths, self.max_seq - 1, out=self._dec_write[:batch])
        self._dec_pos[:batch] = self._dec_write[:batch]
        binding = self._decode_bindings.get((first, batch))
        if binding is None:
            graph = self.decode_graph
            self._check_graph_io(graph)
            inputs = {
                contract.INPUT_IDS: self._dec_ids[:batch].reshape(batch, 1),
                contract.POSITION_IDS: self._dec_pos[:batch].reshape(batch, 1),
                contract.WRITE_INDICES: self._dec_write[:batch],
                **self.cache.views(batch, first),
            }
            outputs = self._outputs(batch, first)
            if graph == "prefill":
                inputs[contract.INPUT_LENGTHS] = self._dec_lengths[:batch]
            elif graph == "verify":  # logits at index 0, the one new token: [B, 1, V]
                inputs[contract.LOGIT_INDICES] = self._dec_picks[:batch].reshape(batch, 1)
                outputs[contract.LOGITS] = outputs[contract.LOGITS].reshape(batch, 1, self.vocab_size)
            binding = self._decode_bindings[(first, batch)] = self.backend.bind(graph, inputs, outputs)
        return binding

    def decode_ids(self, batch: int) -> np.ndarray:
        """The bound token-id input of the next :meth:`decode_rows` step, ``[batch]`` int64 (a view
        of the engine's buffer: write the tokens into it)."""
        return self._dec_ids[:batch]

    def move_row(self, src: int, dst: int) -> None:
        """Move cache row ``src``'s filled positions (``lengths[src]`` of them) into row ``dst``,
        and its length: one copy, used to keep the active rows of a batch contiguous."""
        self.cache.copy_row(src, dst, int(self.lengths[src]))
        self.lengths[dst] = self.lengths[src]

    @property
    def chunk_tokens(self) -> int:
        """Tokens per prefill call in generation, sessions and the scheduler: ``prefill_chunk``
        (settable; default :data:`CPU_PREFILL_CHUNK` on the CPU, the artifact's ``max_prompt`` on a
        GPU), never more than ``max_prompt``. Longer prompts are prefilled in consecutive chunks
        (``start > 0``), which gives the same logits."""
        chunk = check.count("prefill_chunk", self.prefill_chunk)
        return min(chunk, self.manifest.limits.max_prompt)

    def _check_rows(self, rows: Sequence[Sequence[int]], start: Sequence[int], first_index: int = 0) -> None:
        if not 1 <= len(rows) <= self.max_batch:
            raise ValueError(f"a step takes 1..{self.max_batch} rows (the artifact's max_batch), got {len(rows)}")
        for i, (row, s0) in enumerate(zip(rows, start), start=first_index):
            if len(row) == 0:
                raise ValueError(f"prompt {i} is empty; give at least one token")
            if s0 < 0 or s0 + len(row) > self.max_seq:
                raise ValueError(
                    f"prompt {i} has {len(row)} tokens at cache position {s0}; this artifact was compiled "
                    f"with max_seq={self.max_seq} (recompile with --max-seq)"
                )
            bad = [t for t in row if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")

    # ---------------------------------------------------------------- rows

    def general_rows(self) -> int:
        """``k``: generation, the step API and a scheduler use cache rows ``[0, k)``, the rows below
        the lowest one a session holds (``max_batch`` without sessions)."""
        return min(self._session_rows, default=self.max_batch)

    def _check_step_rows(self, batch: int) -> None:
        if self._rows_owner is not None:
            raise RuntimeError(
                f"the engine's rows belong to its running {type(self._rows_owner).__name__}; "
                "finish or close it first (a scheduler takes requests through submit)"
            )
        k = self.general_rows()
        if batch > k:
            raise RuntimeError(
                f"{batch} rows asked, but sessions hold rows [{k}, {self.max_batch}); close sessions to free them"
            )

    @contextmanager
    def own_rows(self, owner: object) -> Iterator[int]:
        """Hold rows ``[0, k)`` for ``owner`` (a scheduler, a stream, a generate call); yields ``k``.
        Raises RuntimeError when another owner holds them or sessions hold every row."""
        with self._lock:
            self._check_step_rows(1)
            self._rows_owner = owner
            self.batch = 0  # the step API's batch is overwritten: decode() needs a new prefill
        try:
            yield self.general_rows()
        finally:
            with self._lock:
                if self._rows_owner is owner:
                    self._rows_owner = None

    def reserve_row(self) -> int:
        """Reserve the highest row no session holds, for a session (refused while rows are owned)."""
        with self._lock:
            self._check_step_rows(0)
            free = [r for r in range(self.max_batch) if r not in self._session_rows]
            if len(free) < 1:
                raise RuntimeError(f"every cache row (max_batch={self.max_batch}) is held by a session; close one")
            self._session_rows.add(free[-1])
            return free[-1]

    def release_row(self, row: int) -> None:
        with self._lock:
            self._session_rows.discard(row)


def state_summary(manifest: mf.Manifest) -> str:
    """``"layers [0, 2, 3] keep a conv state"``: what a refusal names of a hybrid artifact."""
    states = manifest.layout.states
    return f"layers {[e.layer for e in states]} keep a {'/'.join(sorted({e.kind for e in states}))} state"


def _check_state_options(manifest: mf.Manifest, device: str, kv_shared: bool) -> None:
    """Refuse, before anything is allocated, the load options an artifact with state layers
    cannot run yet (the prefix pool keeps state snapshots; verify keeps the accepted tokens' state)."""
    what = f"this artifact's {state_summary(manifest)} beside the KV cache"
    if device != "cpu":
        raise ValueError(
            f"device={device!r}: {what}, which the GPU backends do not bind yet; load it with device='cpu'"
        )
    if kv_shared:
        raise ValueError(f"kv_shared=True: {what}, which lent KV rows do not carry; load it without kv_shared")


def _load_tokenizer(artifact_dir: Path) -> Tokenizer:
    """The artifact's tokenizer.json; a file the tokenizers library cannot read is an ArtifactError."""
    path = artifact_dir / "tokenizer.json"
    if not path.is_file():
        raise mf.ArtifactError(f"the manifest says the artifact has a tokenizer, but {path} is missing; recompile")
    try:
        return Tokenizer(path)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise mf.ArtifactError(
            f"{path} cannot be read by the tokenizers library ({str(e)[:160]}): it is corrupted; recompile the model"
        ) from e
