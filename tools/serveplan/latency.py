"""The planner's latency model: prefill and decode step times of one engine, by threads.

Input: an artifact (measured here, a few seconds per thread count) or ``kvforge bench --json``
reports (one per thread count). Output: a :class:`LatencyTable`, one :class:`PhaseModel` per
thread count, the bytes of KV per token and the hand-off's speed per side (a copy into fresh
memory and a crc32, as the shared-memory transport does; a plain memcpy's speed for reference).

The model, fitted by least squares on the measured points (coefficients in ms, none negative):

- a prefill call of ``batch`` rows of ``length`` new tokens at cache position ``start``:
  ``p0 + p1·tokens + p2·tokens·mid/1000`` where ``tokens = batch·length`` and
  ``mid = start + length/2`` (the weights' work grows with the tokens, attention's with the tokens
  times the positions they attend to);
- a decode step of ``batch`` rows holding ``context`` positions in all:
  ``d0 + d1·batch + d2·context/1000`` (the weights are read once per step; each row adds its
  sampling and output work, each cached position its attention read).

Thread counts that were not measured (a larger machine) are extrapolated: from a measured count
(the one that gives the fastest result, so more threads are never modelled slower than fewer were
measured), each doubling of threads divides a phase's times by that phase's measured speed-up from
``m/2`` to ``m`` threads, ``m`` the largest count measured (from 1 to 2 on a 2-core machine), at
least 1 (a loaded machine may show none), or by the speed-ups given (``speedup``, the CLI's
``--thread-speedup``). With one measured count, times scale as ``1/threads`` (ideal).
:meth:`LatencyTable.assumption` says which applied.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Measured cells: prefill (batch, length); decode runs on rows holding each listed context.
PREFILL_CELLS = ((1, 16), (4, 16), (1, 64), (1, 128), (4, 128), (1, 512))
DECODE_BATCHES = (1, 2, 4)
DECODE_STEPS = 4


@dataclass(frozen=True)
class PhaseModel:
    """Step times of one engine on ``threads`` threads (coefficients in ms, see the module docstring)."""

    threads: int
    prefill: tuple[float, float, float]
    decode: tuple[float, float, float]
    source: str = "measured"  # measured | bench JSON path | extrapolated

    def prefill_s(self, batch: int, length: int, start: int = 0) -> float:
        p0, p1, p2 = self.prefill
        tokens, mid = batch * length, start + length / 2
        return (p0 + p1 * tokens + p2 * tokens * mid / 1000) / 1000

    def decode_s(self, batch: int, context: int) -> float:
        d0, d1, d2 = self.decode
        return (d0 + d1 * batch + d2 * context / 1000) / 1000

    def scaled(self, prefill: float, decode: float, threads: int, source: str) -> PhaseModel:
        """Times divided by ``prefill`` and ``decode`` speed-ups."""
        p = tuple(c / prefill for c in self.prefill)
        d = tuple(c / decode for c in self.decode)
        return PhaseModel(threads, p, d, source)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return {"threads": self.threads, "prefill_ms": list(self.prefill), "decode_ms": list(self.decode),
                "source": self.source}  # fmt: skip


def fit_nonnegative(features: np.ndarray, times: np.ndarray) -> tuple[float, ...]:
    """Least squares ``features @ c ≈ times`` with every ``c >= 0``: a negative coefficient's
    feature is dropped and the rest refitted (enough for three features)."""
    keep = list(range(features.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(features[:, keep], times, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * features.shape[1]
            for k, c in zip(keep, coef):
                out[k] = max(float(c), 0.0)
            return tuple(out)
        keep.pop(int(np.argmin(coef)))


def fit(threads: int, prefill: list[tuple[int, int, int, float]], decode: list[tuple[int, int, float]],
        source: str = "measured") -> PhaseModel:  # fmt: skip
    """A model from points: prefill ``(batch, length, start, ms)``, decode ``(batch, context, ms)``."""
    if len(prefill) < 1 or len(decode) < 1:
        raise ValueError(f"a latency model needs prefill and decode timings, got {len(prefill)} and {len(decode)}")
    pf = np.array([[1.0, b * n, b * n * (s + n / 2) / 1000] for b, n, s, _ in prefill])
    df = np.array([[1.0, b, c / 1000] for b, c, _ in decode])
    return PhaseModel(
        threads,
        fit_nonnegative(pf, np.array([p[-1] for p in prefill])),  # type: ignore[arg-type]
        fit_nonnegative(df, np.array([d[-1] for d in decode])),  # type: ignore[arg-type]
        source,
    )


@dataclass
class LatencyTable:
    """Measured (or read) models by thread count, with hand-off figures; :meth:`at` extrapolates."""

    models: dict[int, PhaseModel]
    kv_bytes_per_token: int
    copy_bytes_per_s: float  # one side of a hand-off (handoff_bandwidth): export, or import
    rows: int  # the artifact's max_batch: cache rows per engine
    chunk: int  # tokens per prefill call (the artifact's max_prompt)
    max_seq: int
    memcpy_bytes_per_s: float | None = None  # a plain memcpy, for reference (copy_bandwidth)
    notes: list[str] = field(default_factory=list)
    speedup: tuple[float, float] | None = None  # (prefill, decode) per doubling, given: instead of measured

    def speedups(self) -> tuple[float, float, int]:
        """(prefill, decode) speed-up per doubling of threads, from the two largest measured
        counts ``m/2`` and ``m`` (or ``speedup`` where given); and ``m``. (2.0, 2.0) with one count
        (ideal scaling)."""
        top = max(self.models)
        if self.speedup is not None:
            return self.speedup[0], self.speedup[1], top
        half = self.models.get(top // 2) if top >= 2 else None
        if half is None:
            return 2.0, 2.0, top
        hi, lo = self.models[top], half
        prefill = max(lo.prefill_s(1, 256) / hi.prefill_s(1, 256), 1.0)
        decode = max(lo.decode_s(1, 256) / hi.decode_s(1, 256), 1.0)
        return prefill, decode, top

    def assumption(self) -> str:
        prefill, decode, top = self.speedups()
        if self.speedup is not None:
            return (
                f"beyond {top} threads, each doubling of threads divides prefill times by {prefill:.2f} and decode "
                f"steps by {decode:.2f} (given with --thread-speedup)"
            )
        if len(self.models) == 1:
            return f"only {top} thread(s) measured: more threads assumed to scale ideally (time ∝ 1/threads)"
        return (
            f"beyond {top} threads, each doubling of threads divides prefill times by {prefill:.2f} and decode "
            f"steps by {decode:.2f} (the speed-ups measured from {top // 2} to {top} threads, at least 1)"
        )

    def at(self, threads: int) -> PhaseModel:
        if threads in self.models:
            return self.models[threads]
        prefill, decode, _ = self.speedups()
        below = [self.models[t] for t in self.models if t < threads] or [self.models[min(self.models)]]

        def scaled(base: PhaseModel) -> PhaseModel:
            doublings = math.log2(threads / base.threads)
            return base.scaled(prefill**doublings, decode**doublings, threads, "extrapolated")

        # From the measured count that extrapolates fastest: more threads are never modelled slower
        # than fewer were measured (a loaded machine can time 2 threads slower than 1).
        return min((scaled(b) for b in below), key=lambda m: m.prefill_s(1, 256) + 32 * m.decode_s(1, 256))

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": [m.to_dict() for _, m in sorted(self.models.items())],
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "memcpy_bytes_per_s": self.memcpy_bytes_per_s,
            "rows": self.rows,
            "chunk": self.chunk,
            "scaling": self.assumption(),
            "speedup_per_doubling": list(self.speedups()[:2]),
            "notes": self.notes,
        }


# ---------------------------------------------------------------- sources


def copy_bandwidth(nbytes: int = 64 * 2**20, repeat: int = 5) -> float:
    """Bytes per second of one large memcpy (``np.copyto``, best of ``repeat``): the hand-off's
    export and import each copy a block once."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def handoff_bandwidth(nbytes: int = 16 * 2**20, repeat: int = 3) -> float:
    """Bytes per second of one side of a hand-off as the shared-memory transport does it: a copy
    into freshly mapped memory (its pages faulted in on first touch) and a crc32 over the data
    (written on export, checked on import); best of ``repeat``."""
    import zlib

    src = np.ones(nbytes, dtype=np.uint8)
    best = math.inf
    for _ in range(repeat):
        dst = np.empty_like(src)
        start = time.perf_counter()
        np.copyto(dst, src)
        zlib.crc32(dst)
        best = min(best, time.perf_counter() - start)
        del dst
    return nbytes / best


def kv_bytes_per_token(manifest: Any) -> int:
    """Bytes of one position's keys and values over every layer that attends (a hybrid model's
    state layers keep no KV per position)."""
    m = manifest.model
    itemsize = np.dtype(manifest.dtype).itemsize
    layers = len(manifest.layout.attention) if hasattr(manifest, "layout") else m.num_layers
    return layers * 2 * m.num_kv_heads * m.head_dim * itemsize


def measure(artifact: str | Path, threads: list[int], seed: int = 0) -> LatencyTable:
    """Time the artifact's prefill and decode calls on each thread count (see PREFILL_CELLS)."""
    from kvforge.runtime import Engine

    models, rows, chunk, max_seq, kv = {}, 0, 0, 0, 0
    rng = np.random.default_rng(seed)
    for t in threads:
        with Engine.load(artifact, threads=t, prefix_cache=0) as engine:
            rows, chunk, max_seq = engine.max_batch, engine.chunk_tokens, engine.max_seq
            kv = kv_bytes_per_token(engine.manifest)
            models[t] = _measure_engine(engine, t, rng)
    return LatencyTable(models, kv, handoff_bandwidth(), rows, chunk, max_seq, memcpy_bytes_per_s=copy_bandwidth())


def _measure_engine(engine, threads: int, rng: np.random.Generator) -> PhaseModel:
    prefill, decode = [], []
    engine.prefill(rng.integers(0, engine.vocab_size, (1, 8)).tolist())  # warm-up
    for b, n in PREFILL_CELLS:
        if b > engine.max_batch or n >= engine.max_seq - DECODE_STEPS:
            continue
        start = time.perf_counter()
        logits = engine.prefill(rng.integers(0, engine.vocab_size, (b, n)).tolist())
        prefill.append((b, n, 0, (time.perf_counter() - start) * 1e3))
        if b != 1:
            continue
        # Decode at this context on 1, 2, 4 rows: row 0's KV imported into the others (a copy), not prefilled.
        block = engine.export_kv(0, [0] * n)
        token = int(logits[0].argmax())
        for batch in (d for d in DECODE_BATCHES if d <= engine.max_batch):
            for row in range(batch):
                engine.import_kv(block, row)  # each row holds [0, n) again
            steps = []
            for _ in range(DECODE_STEPS):
                engine.decode_ids(batch)[:] = token
                start = time.perf_counter()
                engine.decode_rows(batch, 0)  # the batch loop's step call
                steps.append((time.perf_counter() - start) * 1e3)
            decode.append((batch, batch * (n + DECODE_STEPS // 2), float(np.median(steps))))
    return fit(threads, prefill, decode)


def read_bench(paths: list[str | Path], artifact_manifest: Any) -> dict[int, PhaseModel]:
    """Models from ``kvforge bench --json`` reports, one per thread count (``environment.ort_threads``):
    a cell's ``ttft_ms`` is a prefill of ``batch_size`` rows of ``prompt_len`` tokens, its
    ``decode_ms_per_token_p50`` a decode step of that batch at about ``prompt_len + new_tokens/2``
    positions per row."""
    models: dict[int, PhaseModel] = {}
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--bench {path}: cannot read it as JSON ({e}); give a file written by "
                             "`kvforge bench OUT --json PATH`") from e  # fmt: skip
        if not isinstance(report, dict) or report.get("kind") != "kvforge.bench":
            raise ValueError(f"--bench {path} is not a kvforge bench report (kind 'kvforge.bench'); "
                             "write one with `kvforge bench OUT --json PATH`")  # fmt: skip
        threads = (report.get("environment") or {}).get("ort_threads")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"--bench {path} does not say its thread count (environment.ort_threads)")
        if threads in models:
            raise ValueError(f"--bench: two reports for {threads} thread(s); give one per thread count")
        timed = report.get("artifact") or {}
        ours = {"architecture": artifact_manifest.model.architecture, "num_layers": artifact_manifest.model.num_layers,
                "hidden_size": artifact_manifest.model.hidden_size, "dtype": artifact_manifest.dtype}  # fmt: skip
        differ = [f"{k} {timed[k]} (this artifact: {v})" for k, v in ours.items() if timed.get(k, v) != v]
        if differ:
            raise ValueError(f"--bench {path} timed another model: {', '.join(differ)}; bench this artifact")
        new = report["settings"]["new_tokens"]
        cells = report.get("cells") or []
        prefill = [(c["batch_size"], c["prompt_len"], 0, c["kvforge"]["ttft_ms"]) for c in cells]
        decode = [
            (c["batch_size"], c["batch_size"] * (c["prompt_len"] + new // 2), c["kvforge"]["decode_ms_per_token_p50"])
            for c in cells
            if c["kvforge"].get("decode_ms_per_token_p50") is not None
        ]
        if not prefill or not decode:
            raise ValueError(f"--bench {path} has no cells with prefill and decode timings")
        models[threads] = fit(threads, prefill, decode, source=str(path))
    return models


def from_bench(artifact: str | Path, paths: list[str | Path]) -> LatencyTable:
    """A table from bench reports of ``artifact`` (its manifest gives the rows, chunk and KV size:
    the chunk a CPU engine prefills in, ``min(max_prompt, CPU_PREFILL_CHUNK)``, as bench reports
    are of ORT threads; the copy bandwidth is measured here, a fraction of a second)."""
    from kvforge.graphs import manifest as mf
    from kvforge.runtime.engine import CPU_PREFILL_CHUNK

    manifest = mf.read(Path(artifact), verify=False)
    limits = manifest.limits
    return LatencyTable(
        read_bench(paths, manifest),
        kv_bytes_per_token(manifest),
        handoff_bandwidth(),
        limits.max_batch,
        min(limits.max_prompt, CPU_PREFILL_CHUNK),
        limits.max_seq,
        memcpy_bytes_per_s=copy_bandwidth(),
    )
