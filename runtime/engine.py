"""``Engine``: a compiled artifact -> text, with one persistent KV cache bound to both graphs.

    from kvforge.runtime import Engine
    with Engine.load("out") as engine:
        [result] = engine.generate(["The for statement"], max_new_tokens=32)
        print(result.text, result.finish_reason)

Ownership. The engine owns every buffer the graphs read or write: the KV cache (one array, see
:mod:`kvforge.runtime.cache`), the input buffers (token ids, positions, write indices, lengths)
and the logits buffer, all numpy arrays allocated once at load. A step writes values into the
input buffers and runs a binding; the decode binding is made once per batch size and reused by
every step.

One session. A decode step is the prefill graph's ``S = 1`` case (one token per row, written at
``write_indices``, ``input_lengths`` all ones), so by default decode steps run through the prefill
graph's session: ONNX Runtime then loads and repacks the weights once, not once per graph. The
artifact's decode graph (``one_session=False``) gives the same logits from a second session.

Batches. ``generate`` takes any number of prompts and runs them in batches of at most the
artifact's ``max_batch``, in order. Rows of a batch have their own lengths (no padding inside the
cache); a row that finishes keeps its slot until the batch is done.

Stopping. A row stops with ``finish_reason="stop"`` when it generates one of the artifact's eos
ids (the eos token is the last of ``token_ids``, as in transformers' ``generate``), and with
``"length"`` after ``max_new_tokens`` tokens or when its cache row is full (``max_seq``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.graphs import contract
from kvforge.graphs import manifest as mf
from kvforge.runtime import backends
from kvforge.runtime.ort_backend import OrtBackend, OrtOptions
from kvforge.runtime.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated ids only (the prompt excluded)
    text: str | None  # decoded token_ids, special tokens skipped; None without a tokenizer
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int


class Engine:
    def __init__(
        self, artifact_dir: Path, manifest: mf.Manifest, backend: OrtBackend, decode_graph: str = "prefill"
    ) -> None:
        self.artifact_dir = artifact_dir
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = Tokenizer(artifact_dir / "tokenizer.json") if manifest.tokenizer.get("has_tokenizer") else None
        self.eos_token_ids = frozenset(manifest.generation.get("eos_token_ids", []))
        self.decode_graph = decode_graph
        self._checked: set[str] = set()
        self._check_graph_io("prefill")

        limits, vocab = manifest.limits, manifest.model.vocab_size
        self.max_batch, self.max_seq, self.vocab_size = limits.max_batch, limits.max_seq, vocab
        self.cache = backend.allocate_cache(manifest)  # on the backend's device, owned by the backend
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
        self._logits = np.zeros(b * vocab, dtype=self.cache.buffer.dtype)
        self._next = np.zeros(b, dtype=np.int64)
        self.lengths = np.zeros(b, dtype=np.int64)  # cache rows in use, per row
        self.batch = 0  # rows of the current sequence batch (set by prefill)
        self._decode_bindings: dict[int, object] = {}
        self.last_bindings: dict[str, object] = {}  # the binding of the latest call, per graph

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        artifact_dir: str | Path,
        *,
        threads: int | None = None,
        spin: bool = True,
        prepack: bool = True,
        optimized: bool = True,
        one_session: bool = True,
        verify: bool = True,
        device: str = "cpu",
        backend: str = "ort",
    ) -> Engine:
        """Load an artifact on ONNX Runtime's CPU provider, or on a GPU.

        ``device="cuda"`` with ``backend="tensorrt"`` runs the artifact's TensorRT plan (built by
        ``kvforge build OUT``), with ``backend="ort"`` ONNX Runtime's CUDA provider; both keep the
        cache on the device (:mod:`kvforge.runtime.backends`; not yet run on a GPU). Without CUDA
        (or TensorRT, or ORT's CUDA provider) they raise
        :class:`kvforge.graphs.environment.DeviceUnavailableError` naming what is missing.

        ``threads``, ``spin``, ``prepack``, ``optimized``: ONNX Runtime session settings, see
        :class:`kvforge.runtime.ort_backend.OrtOptions` (the defaults favour speed: ORT repacks
        the weights into its kernels' layout, once per session). ``one_session`` runs decode steps
        through the prefill graph's session, so generation holds one packed copy of the weights;
        ``False`` runs them on the decode graph in a session of its own (a second copy). The
        score graph's session is created on first use of :meth:`score`. ``verify`` checks every
        file's sha256 against the manifest (sizes are always checked). Raises
        :class:`kvforge.graphs.manifest.ArtifactError` for a missing, foreign, corrupted or
        incompatible artifact.
        """
        backends.check_choice(device, backend)
        root = Path(artifact_dir)
        manifest = mf.read(root, verify=verify)
        if device == "cuda":
            return cls(root, manifest, backends.open_gpu_backend(root, manifest, backend))
        if manifest.dtype == "bfloat16":
            raise mf.ArtifactError(
                "this artifact is bfloat16, which ONNX Runtime's CPU provider cannot run; "
                "recompile with --dtype float32 (or float16) for CPU"
            )
        options = OrtOptions(threads=threads, spin=spin, prepack=prepack, optimized=optimized)
        use_ort = {name for name, g in manifest.graphs.items() if optimized and g.ort_file}
        graph_files = {name: root / (g.ort_file if name in use_ort else g.file) for name, g in manifest.graphs.items()}
        # Without prepacking, every session reads the weights as they are: map them once for all.
        # With it, ORT packs its own copies and frees what it read, so sharing would only add.
        shared = None if prepack else root / manifest.weights.file
        # Sessions are made on first use (each holds its own packed weights); prefill is used at once.
        backend = OrtBackend(graph_files, options, preoptimized=use_ort, weights_file=shared, lazy=("decode", "score"))
        return cls(root, manifest, backend, decode_graph="prefill" if one_session else "decode")

    def _check_graph_io(self, graph: str) -> None:
        """The graph must have exactly the I/O the manifest and the KV contract name (checked once,
        when the graph is first used)."""
        if graph in self._checked:
            return
        n = self.manifest.model.num_layers
        if graph not in self.manifest.graphs:
            raise mf.ArtifactError(f"the artifact has no {graph} graph; recompile the model with this kvforge")
        inputs, outputs = contract.input_names(graph, n), contract.output_names(n)
        got = (self.backend.input_names(graph), self.backend.output_names(graph))
        if sorted(got[0]) != sorted(inputs) or sorted(got[1]) != sorted(outputs):
            raise mf.ArtifactError(
                f"{graph} graph I/O does not follow the KV contract (inputs {got[0]}, outputs {got[1]}); "
                "recompile the model with this kvforge"
            )
        self._checked.add(graph)

    def close(self) -> None:
        self._decode_bindings.clear()
        self.last_bindings.clear()
        self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- steps

    def _outputs(self, batch: int) -> dict[str, np.ndarray]:
        """Logits and present caches; each present shares its past input's buffer."""
        views = self.cache.views(batch)
        n = self.manifest.model.num_layers
        presents = {present: views[past] for past, present in zip(contract.past_names(n), contract.present_names(n))}
        return {
            contract.LOGITS: self._logits[: batch * self.vocab_size].reshape(batch, self.vocab_size),
            **presents,
        }

    def prefill(self, rows: Sequence[Sequence[int]], start: Sequence[int] | None = None) -> np.ndarray:
        """Write each row's tokens into its cache row at ``start`` (default 0) and return the logits
        of each row's last token, ``[B, V]`` (a view of the engine's logits buffer, valid until the
        next step; copy it to keep it). Starts a new batch of ``len(rows)`` rows; ``start > 0``
        continues a sequence already in the cache (chunked prefill, multi-turn)."""
        batch = len(rows)
        start = list(start) if start is not None else [0] * batch
        self._check_rows(rows, start)
        inputs = self._fill_inputs(rows, start, max(len(r) for r in rows))
        binding = self.backend.bind("prefill", inputs, self._outputs(batch))
        self.backend.run(binding)
        self.batch = batch
        self.last_bindings["prefill"] = binding
        return binding.tensors[contract.LOGITS]

    def score(self, rows: Sequence[Sequence[int]], start: Sequence[int] | None = None) -> np.ndarray:
        """Like :meth:`prefill`, but returns the logits of every position, ``[B, S, V]`` (a new
        array; positions past a row's length are padding). Runs the separate score graph, for
        tools such as perplexity; the cache is updated as by :meth:`prefill`."""
        if "score" not in self.manifest.graphs:
            raise ValueError("this artifact has no score graph; recompile without --no-score-graph")
        self._check_graph_io("score")
        batch = len(rows)
        start = list(start) if start is not None else [0] * batch
        self._check_rows(rows, start)
        seq = max(len(r) for r in rows)
        inputs = self._fill_inputs(rows, start, seq)
        del inputs[contract.INPUT_LENGTHS]
        outputs = self._outputs(batch)
        logits = outputs[contract.LOGITS] = np.empty((batch, seq, self.vocab_size), dtype=self._logits.dtype)
        binding = self.backend.bind("score", inputs, outputs)
        self.backend.run(binding)
        self.batch = batch
        return logits

    def _fill_inputs(self, rows: Sequence[Sequence[int]], start: list[int], seq: int) -> dict[str, np.ndarray]:
        """Write a ragged batch, right-padded to ``seq``, into the persistent input buffers."""
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
            self.lengths[b] = s0 + len(row)
        return {
            contract.INPUT_IDS: ids,
            contract.POSITION_IDS: pos,
            contract.WRITE_INDICES: self._write[:batch],
            contract.INPUT_LENGTHS: self._input_lengths[:batch],
            **self.cache.views(batch),
        }

    def decode(self, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        """Append one token to each row of the current batch; return the next logits ``[B, V]``."""
        batch = self.batch
        if batch == 0:
            raise RuntimeError("decode needs a batch: call prefill first")
        if (self.lengths[:batch] >= self.max_seq).any():
            raise ValueError(f"a row's cache is full (max_seq={self.max_seq}); recompile with a larger --max-seq")
        self._dec_ids[:batch] = tokens
        return self._decode_step(batch)

    def _decode_step(self, batch: int) -> np.ndarray:
        """One decode step on the tokens already in ``_dec_ids``. Allocates nothing: the binding is
        reused and the positions are written into the bound buffers. A row whose cache is full
        (finished in ``generate``) writes into its last slot instead of past the end."""
        np.minimum(self.lengths[:batch], self.max_seq - 1, out=self._dec_write[:batch])
        self._dec_pos[:batch] = self._dec_write[:batch]
        binding = self._decode_bindings.get(batch)
        if binding is None:
            graph = self.decode_graph
            self._check_graph_io(graph)
            inputs = {
                contract.INPUT_IDS: self._dec_ids[:batch].reshape(batch, 1),
                contract.POSITION_IDS: self._dec_pos[:batch].reshape(batch, 1),
                contract.WRITE_INDICES: self._dec_write[:batch],
                **self.cache.views(batch),
            }
            if graph == "prefill":
                inputs[contract.INPUT_LENGTHS] = self._dec_lengths[:batch]
            binding = self._decode_bindings[batch] = self.backend.bind(graph, inputs, self._outputs(batch))
        self.backend.run(binding)
        self.lengths[:batch] += 1
        self.last_bindings["decode"] = binding
        return binding.tensors[contract.LOGITS]

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

    # ---------------------------------------------------------------- generation

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this artifact has no tokenizer; pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int = 32) -> list[GenerationResult]:
        """Greedy generation: one :class:`GenerationResult` per prompt, in order.

        ``prompts`` are strings (needs the artifact's tokenizer) or lists of token ids. More prompts
        than ``max_batch`` run as consecutive batches. Every prompt is checked before any runs.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings or of token-id lists, not one string")
        if not prompts:
            raise ValueError("no prompts given")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        rows = [self.encode(p) for p in prompts]
        batches = [rows[i : i + self.max_batch] for i in range(0, len(rows), self.max_batch)]
        for i, chunk in enumerate(batches):
            self._check_rows(chunk, [0] * len(chunk), first_index=i * self.max_batch)
        results = []
        for chunk in batches:
            results.extend(self._generate_batch(chunk, max_new_tokens))
        return results

    def _generate_batch(self, rows: list[list[int]], max_new_tokens: int) -> list[GenerationResult]:
        batch = len(rows)
        generated: list[list[int]] = [[] for _ in rows]
        reasons: list[str | None] = [None] * batch
        logits = self.prefill(rows)
        next_ids = self._next[:batch]
        while True:
            np.argmax(logits, axis=-1, out=next_ids)
            for b, token in enumerate(next_ids.tolist()):
                if reasons[b] is not None:
                    continue
                generated[b].append(token)
                if token in self.eos_token_ids:
                    reasons[b] = "stop"
                elif len(generated[b]) >= max_new_tokens or self.lengths[b] >= self.max_seq:
                    reasons[b] = "length"
            if all(reasons):
                break
            self._dec_ids[:batch] = next_ids
            logits = self._decode_step(batch)
        return [
            GenerationResult(ids, self.tokenizer.decode(ids) if self.tokenizer else None, reason, len(row))
            for ids, reason, row in zip(generated, reasons, rows)
        ]
