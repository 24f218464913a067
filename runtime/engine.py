"""``Engine``: a compiled artifact -> text, with one persistent KV cache bound to both graphs.

    from kvforge.runtime import Engine
    with Engine.load("out") as engine:
        [result] = engine.generate(["The for statement"], max_new_tokens=32)
        print(result.text, result.finish_reason)

Ownership. The engine owns every buffer the graphs read or write: the KV cache (one tensor, see
:mod:`kvforge.runtime.cache`), the input buffers (token ids, positions, write indices, lengths)
and the logits buffer, all allocated once at load. A step writes values into the input buffers
and runs a binding; the decode binding is made once per batch size and reused by every step.

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

import torch

from kvforge.graphs import contract
from kvforge.graphs import manifest as mf
from kvforge.runtime.cache import KVCache
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
    def __init__(self, artifact_dir: Path, manifest: mf.Manifest, backend: OrtBackend) -> None:
        self.artifact_dir = artifact_dir
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = Tokenizer(artifact_dir / "tokenizer.json") if manifest.tokenizer.get("has_tokenizer") else None
        self.eos_token_ids = frozenset(manifest.generation.get("eos_token_ids", []))
        self._check_io()

        limits, vocab = manifest.limits, manifest.model.vocab_size
        self.max_batch, self.max_seq, self.vocab_size = limits.max_batch, limits.max_seq, vocab
        self.cache = KVCache(manifest, backend.device)
        # Persistent input/output buffers; a call binds the leading elements as [B, S] views.
        n = limits.max_batch * limits.max_seq
        self._ids = torch.zeros(n, dtype=torch.int64)
        self._pos = torch.zeros(n, dtype=torch.int64)
        self._write = torch.zeros(limits.max_batch, dtype=torch.int64)
        self._input_lengths = torch.zeros(limits.max_batch, dtype=torch.int64)
        self._dec_ids = torch.zeros(limits.max_batch, dtype=torch.int64)
        self._dec_pos = torch.zeros(limits.max_batch, dtype=torch.int64)
        self._dec_write = torch.zeros(limits.max_batch, dtype=torch.int64)
        self._logits = torch.zeros(limits.max_batch * vocab, dtype=self.cache.buffer.dtype)
        self._next = torch.zeros(limits.max_batch, dtype=torch.int64)
        self.lengths = torch.zeros(limits.max_batch, dtype=torch.int64)  # cache rows in use, per row
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
        verify: bool = True,
    ) -> Engine:
        """Load an artifact on ONNX Runtime's CPU provider.

        ``threads``, ``spin``, ``prepack``, ``optimized``: ONNX Runtime session settings, see
        :class:`kvforge.runtime.ort_backend.OrtOptions` (the defaults favour speed: ORT repacks
        weights per session; ``prepack=False`` keeps one shared copy in memory). The score graph's
        session is created on first use of :meth:`score`. ``verify`` checks every file's sha256
        against the manifest (sizes are always checked). Raises
        :class:`kvforge.graphs.manifest.ArtifactError` for a missing, foreign, corrupted or
        incompatible artifact.
        """
        root = Path(artifact_dir)
        manifest = mf.read(root, verify=verify)
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
        backend = OrtBackend(graph_files, options, preoptimized=use_ort, weights_file=shared, lazy=("score",))
        return cls(root, manifest, backend)

    def _check_io(self) -> None:
        """The graphs must have exactly the I/O the manifest and the KV contract name."""
        for graph in ("prefill", "decode"):  # the score graph is checked when first used
            self._check_graph_io(graph)

    def _check_graph_io(self, graph: str) -> None:
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

    def close(self) -> None:
        self._decode_bindings.clear()
        self.last_bindings.clear()
        self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- steps

    def _outputs(self, batch: int) -> dict[str, torch.Tensor]:
        """Logits and present caches; each present shares its past input's buffer."""
        views = self.cache.views(batch)
        n = self.manifest.model.num_layers
        presents = {present: views[past] for past, present in zip(contract.past_names(n), contract.present_names(n))}
        return {
            contract.LOGITS: self._logits[: batch * self.vocab_size].view(batch, self.vocab_size),
            **presents,
        }

    def prefill(self, rows: Sequence[Sequence[int]], start: Sequence[int] | None = None) -> torch.Tensor:
        """Write each row's tokens into its cache row at ``start`` (default 0) and return the logits
        of each row's last token, ``[B, V]`` (a view of the engine's logits buffer, valid until the
        next step). Starts a new batch of ``len(rows)`` rows; ``start > 0`` continues a sequence
        already in the cache (chunked prefill, multi-turn)."""
        batch = len(rows)
        start = list(start) if start is not None else [0] * batch
        self._check_rows(rows, start)
        inputs = self._fill_inputs(rows, start, max(len(r) for r in rows))
        binding = self.backend.bind("prefill", inputs, self._outputs(batch))
        self.backend.run(binding)
        self.batch = batch
        self.last_bindings["prefill"] = binding
        return binding.tensors[contract.LOGITS]

    def score(self, rows: Sequence[Sequence[int]], start: Sequence[int] | None = None) -> torch.Tensor:
        """Like :meth:`prefill`, but returns the logits of every position, ``[B, S, V]`` (a new
        tensor; positions past a row's length are padding). Runs the separate score graph, for
        tools such as perplexity; the cache is updated as by :meth:`prefill`."""
        if "score" not in self.manifest.graphs:
            raise ValueError("this artifact has no score graph; recompile without --no-score-graph")
        if "score" not in self.backend.sessions:  # loaded on first use: generation never needs it
            self._check_graph_io("score")
        batch = len(rows)
        start = list(start) if start is not None else [0] * batch
        self._check_rows(rows, start)
        seq = max(len(r) for r in rows)
        inputs = self._fill_inputs(rows, start, seq)
        del inputs[contract.INPUT_LENGTHS]
        outputs = self._outputs(batch)
        logits = outputs[contract.LOGITS] = torch.empty(batch, seq, self.vocab_size, dtype=self._logits.dtype)
        binding = self.backend.bind("score", inputs, outputs)
        self.backend.run(binding)
        self.batch = batch
        return logits

    def _fill_inputs(self, rows: Sequence[Sequence[int]], start: list[int], seq: int) -> dict[str, torch.Tensor]:
        """Write a ragged batch, right-padded to ``seq``, into the persistent input buffers."""
        batch = len(rows)
        if max(start) + seq > self.max_seq:
            # Padding is written too: a short row at a late start would write past its cache row.
            raise ValueError(
                f"rows padded to {seq} tokens at start {max(start)} would write past max_seq={self.max_seq}; "
                "prefill such rows in separate calls"
            )
        ids = self._ids[: batch * seq].view(batch, seq)
        pos = self._pos[: batch * seq].view(batch, seq)
        ids.zero_()  # padding id 0: padded positions are written, masked, then overwritten
        for b, (row, s0) in enumerate(zip(rows, start)):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
            pos[b] = torch.arange(s0, s0 + seq)
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

    def decode(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Append one token to each row of the current batch; return the next logits ``[B, V]``."""
        batch = self.batch
        if batch == 0:
            raise RuntimeError("decode needs a batch: call prefill first")
        if (self.lengths[:batch] >= self.max_seq).any():
            raise ValueError(f"a row's cache is full (max_seq={self.max_seq}); recompile with a larger --max-seq")
        self._dec_ids[:batch] = torch.as_tensor(tokens, dtype=torch.int64)
        return self._decode_step(batch)

    def _decode_step(self, batch: int) -> torch.Tensor:
        """One decode step on the tokens already in ``_dec_ids``. Allocates nothing: the binding is
        reused and the positions are written into the bound buffers. A row whose cache is full
        (finished in ``generate``) writes into its last slot instead of past the end."""
        torch.clamp(self.lengths[:batch], max=self.max_seq - 1, out=self._dec_write[:batch])
        self._dec_pos[:batch] = self._dec_write[:batch]
        binding = self._decode_bindings.get(batch)
        if binding is None:
            inputs = {
                contract.INPUT_IDS: self._dec_ids[:batch].view(batch, 1),
                contract.POSITION_IDS: self._dec_pos[:batch].view(batch, 1),
                contract.WRITE_INDICES: self._dec_write[:batch],
                **self.cache.views(batch),
            }
            binding = self._decode_bindings[batch] = self.backend.bind("decode", inputs, self._outputs(batch))
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
            torch.argmax(logits, dim=-1, out=next_ids)
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
