"""``kvforge bench``: how fast is an artifact, and how fast is transformers on the same prompts?

Input: an artifact directory and, optionally, the Hugging Face model directory it was compiled
from. Output: a report dict (JSON schema in docs/tools.md), printed as a table, optionally written
as JSON and plotted.

For every cell (prompt length P, batch size B) both sides get the same B random prompts of exactly
P tokens (seeded; equal lengths, so transformers needs no padding) and decode ``new_tokens`` greedy
tokens per row, never stopping at eos. kvforge runs through the engine's step API (``prefill``,
then ``decode``); transformers eager runs its own forward with its default cache (``DynamicCache``),
``logits_to_keep=1`` at prefill as its ``generate`` does, without ``generate``'s per-step
bookkeeping. Each cell runs ``warmup`` untimed times, then ``repeat`` timed times:

* ``ttft_ms``: prefill (``Engine.prefill_prompt``: as generation prefills) until the first token of
  every row is known (median over repeats);
* ``decode_ms_per_token_p50/p90``: one decode step, i.e. the time between two consecutive tokens of
  a row (over every step of every repeat); ``decode_tokens_per_s = B * 1000 / p50``;
* ``e2e_ms``: TTFT plus every decode step (median over repeats);
* ``rss_peak_bytes``: the process's peak resident memory during the cell (``VmHWM``, reset before
  the cell where the kernel allows, see ``rss_peak_reset``); it is process-wide, so it includes
  Python, torch and whatever the process already held. kvforge's cells run before the reference
  model is loaded. ``rss_added_bytes``: that peak minus the resident memory just before the side's
  engine or model was loaded: what the side costs. ``device_peak_bytes``: torch's CUDA peak where
  the side runs on CUDA, else null;
* ``kv_cache_bytes``: kvforge's one cache allocation (fixed by the artifact's limits); for
  transformers, the bytes of its cache tensors at the end of the run (B x (P + new_tokens - 1) positions).

``prefix_cache`` (kvforge only; null when the engine's prefix cache is off): for each prompt
length, one prompt through ``generate`` (one new token) with the cache emptied first (``cold_ttft_ms``)
and then again (``warm_ttft_ms``: its prefix imported from the cache), the tokens the warm run took
from the cache, and the pool's hit rate over these runs (prompt tokens found / looked up).
``speculative`` (``--speculative ngram[:K]``): each cell's prompts also run through generation
(in-flight batching, greedy) with and without drafts, alternating, ``repeat`` times each:
``tokens_per_s`` of both (wall, prefill included; best run), ``acceptance_rate`` (accepted /
drafted tokens), ``tokens_per_target_call`` (decode tokens per engine call after the first token:
each accepted draft saves a call) and ``greedy_tokens_identical``. Random prompts give drafts
little to copy: this row shows the cost of drafting where it cannot help; real prompts are in
``benchmarks/speculative.py``.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge.runtime import Engine
from kvforge.tools import reference
from kvforge.tools.report import Progress, artifact_summary, describe_artifact, pyplot, save_figure, torch_threads

SCHEMA = "kvforge.bench"
SCHEMA_VERSION = 1
SIDES = ("kvforge", "transformers")
RATIO_KEYS = (
    "ttft_ms",
    "decode_ms_per_token_p50",
    "decode_ms_per_token_p90",
    "decode_tokens_per_s",
    "e2e_ms",
    "rss_peak_bytes",
    "rss_added_bytes",
    "kv_cache_bytes",
)


DEFAULT_PROMPT_LENS = (32, 128, 512)
DEFAULT_BATCH_SIZES = (1, 4)


@dataclass(frozen=True)
class BenchOptions:
    # None: the defaults above, each capped to what the artifact holds (max_seq - new_tokens, max_batch)
    prompt_lens: tuple[int, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    new_tokens: int = 32
    repeat: int = 3
    warmup: int = 1
    # ORT intra-op threads and torch threads alike; None: the machine's cores (os.cpu_count()) for both,
    # so the two sides always run on equal threads (see equal_threads)
    threads: int | None = None
    seed: int = 0
    device: str = "cpu"  # Engine.load(device=...): "cpu" | "cuda"
    backend: str = "ort"  # Engine.load(backend=...): "ort" | "tensorrt"
    speculative: str | None = None  # Engine.load(speculative=...): also time generation with drafts
    prefill: str = "ort"  # Engine.load(prefill=...): where kvforge's long prompts are prefilled

    def resolve(self, max_batch: int, max_seq: int) -> BenchOptions:
        """These options with the default cells filled in for an artifact, and checked: a default
        length or batch is capped to what the artifact holds; a length or batch given explicitly
        that does not fit is an error."""
        longest = max_seq - self.new_tokens
        prompt_lens = self.prompt_lens or tuple(sorted({min(p, longest) for p in DEFAULT_PROMPT_LENS if longest >= 1}))
        batch_sizes = self.batch_sizes or tuple(sorted({min(b, max_batch) for b in DEFAULT_BATCH_SIZES}))
        resolved = replace(self, prompt_lens=prompt_lens, batch_sizes=batch_sizes)
        resolved._check(max_batch, max_seq)
        return resolved

    def _check(self, max_batch: int, max_seq: int) -> None:
        if self.new_tokens < 1:
            raise ValueError(f"--new-tokens must be at least 1, got {self.new_tokens}")
        if self.repeat < 1 or self.warmup < 0:
            raise ValueError(f"--repeat must be at least 1 and --warmup at least 0, got {self.repeat}, {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if not self.prompt_lens:
            raise ValueError(f"--new-tokens {self.new_tokens} leaves no room for a prompt in max_seq={max_seq}")
        too_big = [b for b in self.batch_sizes if b > max_batch]
        if too_big:
            raise ValueError(
                f"batch size {too_big[0]} exceeds this artifact's max_batch={max_batch} "
                "(recompile with --max-batch, or pass smaller --batch-sizes)"
            )
        too_long = [p for p in self.prompt_lens if p + self.new_tokens > max_seq]
        if too_long:
            raise ValueError(
                f"prompt length {too_long[0]} + {self.new_tokens} new tokens exceeds this artifact's "
                f"max_seq={max_seq} (recompile with --max-seq, or pass shorter --prompt-lens / fewer --new-tokens)"
            )


# ---------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def reset_rss_peak() -> bool:
    """Reset the process's peak RSS (Linux ``clear_refs`` 5); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def rss_bytes() -> int | None:
    """Current resident set size of this process, bytes (``VmRSS``; None where /proc is absent)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def _add_rss_before(side: dict[str, Any], before: int | None) -> None:
    """What loading and running the side added to the process's resident memory."""
    side["rss_before_load_bytes"] = before
    peak = side["rss_peak_bytes"]
    side["rss_added_bytes"] = max(peak - before, 0) if before is not None and peak is not None else None


def rss_peak_bytes() -> int | None:
    """Peak resident set size of this process, bytes (``VmHWM``; ``ru_maxrss`` where /proc is absent)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if platform.system() == "Darwin":
            kib //= 1024  # bytes there
    return kib * 1024


# ---------------------------------------------------------------- timing


def _kvforge_run(engine: Engine, rows: list[list[int]], new_tokens: int) -> reference.TimedRun:
    start = time.perf_counter()
    next_ids = engine.prefill_prompt(rows).argmax(-1)  # (B,): in chunks, as generation prefills
    ttft = time.perf_counter() - start
    generated, steps = [next_ids], []
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        next_ids = engine.decode(next_ids).argmax(-1)
        steps.append(time.perf_counter() - t)
        generated.append(next_ids)
    e2e = time.perf_counter() - start
    return reference.TimedRun(ttft, steps, e2e, np.stack(generated, 1).tolist(), engine.cache.nbytes)


def _measure(run, options: BenchOptions, device: str, progress: Progress, what: str) -> tuple[dict[str, Any], list]:
    """Warm up, then time ``run()`` ``repeat`` times: the side's metrics for one cell, and the
    tokens of its last run (``[B][new_tokens]``)."""
    peak_reset = reset_rss_peak()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(options.warmup):
        run()
        progress.advance(f"{what} (warm-up)")
    runs = []
    for _ in range(options.repeat):
        runs.append(run())
        progress.advance(what)
    steps_ms = [s * 1e3 for r in runs for s in r.step_s]
    p50 = statistics.median(steps_ms) if steps_ms else None
    batch = len(runs[0].tokens)
    e2e_ms = statistics.median(r.e2e_s * 1e3 for r in runs)
    side = {
        "ttft_ms": statistics.median(r.ttft_s * 1e3 for r in runs),
        "decode_ms_per_token_p50": p50,
        "decode_ms_per_token_p90": float(np.percentile(steps_ms, 90)) if steps_ms else None,
        "decode_tokens_per_s": batch * 1e3 / p50 if p50 else None,
        "e2e_ms": e2e_ms,
        "e2e_tokens_per_s": batch * options.new_tokens * 1e3 / e2e_ms,
        "rss_peak_bytes": rss_peak_bytes(),
        "rss_peak_reset": peak_reset,
        "device_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "kv_cache_bytes": runs[-1].cache_bytes,
        "ttft_ms_runs": [r.ttft_s * 1e3 for r in runs],
        "e2e_ms_runs": [r.e2e_s * 1e3 for r in runs],
    }
    return side, runs[-1].tokens


def _prompts(options: BenchOptions, vocab: int) -> dict[tuple[int, int], torch.Tensor]:
    """The same random prompts for both sides: ``[B, P]`` int64 per cell."""
    generator = torch.Generator().manual_seed(options.seed)
    return {
        (p, b): torch.randint(0, vocab, (b, p), generator=generator)
        for p in options.prompt_lens
        for b in options.batch_sizes
    }


def run_bench(
    artifact: str | Path,
    reference_dir: str | Path | None = None,
    options: BenchOptions = BenchOptions(),
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Time kvforge (and transformers with ``reference_dir``) on every cell; the report dict.

    Both sides run on ``equal_threads(options.threads)`` threads (ORT's intra-op pool and torch's);
    ``settings.threads`` keeps what was asked (null: not given), ``environment`` the counts used."""
    threads = equal_threads(options.threads)
    with torch_threads(threads):
        return _run_bench(artifact, reference_dir, options, progress, threads)


def equal_threads(threads: int | None) -> int:
    """The thread count both sides get: ``threads``, or the machine's cores (``os.cpu_count()``) when
    None. Left to themselves ORT and torch each pick their own default, which need not agree."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    return threads if threads is not None else os.cpu_count() or 1


def _run_bench(
    artifact: str | Path,
    reference_dir: str | Path | None,
    options: BenchOptions,
    progress: Progress | None,
    threads: int,
) -> dict[str, Any]:
    load_before = _load_average()
    rss_before = rss_bytes()
    with Engine.load(
        artifact, threads=threads, device=options.device, backend=options.backend, prefill=options.prefill
    ) as engine:
        manifest = engine.manifest
        options = options.resolve(engine.max_batch, engine.max_seq)
        cells = [(p, b) for p in options.prompt_lens for b in options.batch_sizes]
        progress = progress or Progress("bench")
        progress.total = len(cells) * (2 if reference_dir else 1) * (options.warmup + options.repeat)
        prompts = _prompts(options, manifest.model.vocab_size)
        device = str(engine.backend.device)
        ours, tokens = {}, {}
        for p, b in cells:
            rows = prompts[p, b].tolist()
            run = lambda rows=rows: _kvforge_run(engine, rows, options.new_tokens)  # noqa: E731
            ours[p, b], tokens["kvforge", p, b] = _measure(run, options, device, progress, _cell("kvforge", p, b))
            _add_rss_before(ours[p, b], rss_before)
        gpu = _gpu_figures(engine, manifest) if device == "cuda" else None
        first_rows = [prompts[p, options.batch_sizes[0]][0].tolist() for p in options.prompt_lens]
        prefix = _prefix_cache_figures(engine, first_rows)
        speculative = {}
        if options.speculative:
            with Engine.load(artifact, threads=threads, speculative=options.speculative) as spec:
                for p, b in cells:
                    speculative[p, b] = _speculative_cell(engine, spec, prompts[p, b].tolist(), options)
    gc.collect()

    # kvforge's sessions flush denormals (OrtOptions.flush_denormals), a flag that stays on this
    # thread: transformers, run next here, then computes with it too (its delta rules make
    # denormals as kvforge's do), which only narrows the ratio. The report says which it was.
    flushed = float(np.float32(1e-39) * np.float32(1.0)) == 0.0
    theirs: dict[tuple[int, int], dict[str, Any]] = {}
    if reference_dir:
        # On a GPU transformers runs its fast attention (SDPA); on CPU eager, as every CPU figure so far.
        attention = "sdpa" if device.startswith("cuda") else "eager"
        progress.say(f"loading the reference {reference_dir} (transformers {attention}, {manifest.dtype})")
        rss_before = rss_bytes()
        model = reference.load(reference_dir, manifest, attention).to(device)
        for p, b in cells:
            ids = prompts[p, b].to(device)
            run = lambda ids=ids: reference.timed_greedy(model, ids, options.new_tokens)  # noqa: E731
            theirs[p, b], tokens["transformers", p, b] = _measure(
                run, options, device, progress, _cell("transformers", p, b)
            )
            _add_rss_before(theirs[p, b], rss_before)
        del model
        gc.collect()

    results = []
    for p, b in cells:
        mine, ref = ours[p, b], theirs.get((p, b))
        cell = {"prompt_len": p, "batch_size": b, "kvforge": mine, "transformers": ref, "ratio": None}
        if speculative:
            cell["speculative"] = speculative[p, b]
        if ref is not None:
            cell["ratio"] = {k: _ratio(mine[k], ref[k]) for k in RATIO_KEYS}
            cell["greedy_tokens_identical"] = tokens["kvforge", p, b] == tokens["transformers", p, b]
        results.append(cell)
    return {
        "kind": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "artifact": artifact_summary(artifact, manifest),
        "reference": (
            {
                "path": str(reference_dir),
                "implementation": f"transformers {attention}, default cache (DynamicCache)",
                "dtype": manifest.dtype,
                "matches_source": reference.matches_source(manifest, reference_dir),
            }
            if reference_dir
            else None
        ),
        "settings": {
            **asdict(options),
            "prompt_lens": list(options.prompt_lens),
            "batch_sizes": list(options.batch_sizes),
        },
        "environment": {
            **_environment(device, load_before),
            "ort_threads": threads,
            "denormals_flushed_for_transformers": flushed if reference_dir else None,
        },
        "gpu": gpu,
        "cells": results,
        "prefix_cache": prefix,
    }


def _prefix_cache_figures(engine: Engine, prompts: list[list[int]]) -> dict[str, Any] | None:
    """TTFT of each prompt through ``generate`` without (cache emptied) and with its prefix cached."""
    pool = engine.prefix_pool
    if pool is None:
        return None
    before, rows = pool.stats(), []
    for prompt in prompts:
        pool.clear()
        [cold] = engine.generate([prompt], max_new_tokens=1)
        [warm] = engine.generate([prompt], max_new_tokens=1)
        rows.append(
            {
                "prompt_len": len(prompt),
                "cold_ttft_ms": cold.timing.ttft_s * 1e3,
                "warm_ttft_ms": warm.timing.ttft_s * 1e3,
                "cached_tokens": warm.cached_tokens,
            }
        )
    after = pool.stats()
    queries, hits = after.queries - before.queries, after.hits - before.hits
    return {
        "budget_bytes": after.budget,
        "block_tokens": after.block_tokens,
        "hit_rate": hits / queries if queries else None,
        "rows": rows,
    }


def _speculative_cell(plain: Engine, spec: Engine, rows: list[list[int]], options: BenchOptions) -> dict[str, Any]:
    """Generation with and without drafts on one cell's prompts (see the module docstring)."""
    from kvforge.runtime import SamplingParams

    greedy = SamplingParams(temperature=0)
    best: dict[str, tuple[float, list]] = {}
    for _ in range(options.repeat):
        for side, engine in (("plain", plain), ("speculative", spec)):
            start = time.perf_counter()
            results = engine.generate(rows, max_new_tokens=options.new_tokens, sampling=greedy)
            tok_s = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
            if side not in best or tok_s > best[side][0]:
                best[side] = (tok_s, results)
    results = best["speculative"][1]
    drafted = sum(r.drafted_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    decode_tokens = sum(len(r.token_ids) - 1 for r in results)
    calls = decode_tokens - accepted  # each accepted draft saved one call of its row
    return {
        "method": options.speculative,
        "plain_tokens_per_s": best["plain"][0],
        "tokens_per_s": best["speculative"][0],
        "ratio": best["speculative"][0] / best["plain"][0],
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_target_call": decode_tokens / calls if calls else None,
        "greedy_tokens_identical": [r.token_ids for r in results] == [r.token_ids for r in best["plain"][1]],
    }


def _gpu_figures(engine, manifest) -> dict[str, Any]:
    """Device-side figures of a GPU run (not yet run on a GPU): bytes copied each way per step,
    device memory, and the bandwidth roofline: weight bytes / a device-copy bandwidth measured
    now = the least time a decode step can take, since it reads every weight once."""
    from kvforge.runtime import device as dev

    backend = engine.backend
    bandwidth = dev.measure_copy_bandwidth()
    free, total = dev.memory_info()
    weights = manifest.weights.bytes
    return {
        "backend": backend.name,
        "cache_mode": backend.mode,
        **backend.stats.per_step(),
        "steps_counted": backend.stats.steps,
        "device_memory_used_bytes": total - free,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weights_bytes": weights,
        "roofline_decode_ms_per_step": 1e3 * weights / bandwidth,
    }


def _cell(side: str, p: int, b: int) -> str:
    return f"{side} prompt {p} batch {b}"


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def _load_average() -> float | None:
    """The 1-minute load average: other processes on the machine skew every timing."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _environment(device: str, load_before: float | None) -> dict[str, Any]:
    import onnxruntime
    import transformers

    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "load_average_1m_before": load_before,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "transformers": transformers.__version__,
    }


# ---------------------------------------------------------------- terminal


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def format_report(result: dict[str, Any]) -> str:
    s, env = result["settings"], result["environment"]
    lines = [
        f"kvforge bench: {describe_artifact(result['artifact'])}",
        f"  on {env['device']} ({env['cpu_count']} CPUs, load average {_fmt(env['load_average_1m_before'], '.1f')} "
        f"before the run, "
        f"ORT threads {env.get('ort_threads', '-')}, torch threads {env['torch_threads']}); "
        f"{s['new_tokens']} new tokens per row; median of {s['repeat']} runs after {s['warmup']} warm-up(s); "
        f"random prompts (seed {s['seed']})",
    ]
    if s.get("prefill", "ort") == "int8":
        lines.append("  kvforge's prompts of 2+ tokens prefilled on ORT's integer GEMM (--prefill int8)")
    elif s.get("prefill", "ort") == "fp32":
        lines.append("  kvforge's prompts of 2+ tokens prefilled with float activations (--prefill fp32)")
    elif s.get("prefill", "ort") != "ort":
        lines.append(f"  kvforge's prompts of 32+ tokens prefilled on OpenVINO (--prefill {s['prefill']})")
    if result["reference"]:
        lines.append(f"  reference: {result['reference']['implementation']} ({result['reference']['path']})")
    lines.append("")
    lines.append(
        f"{'prompt':>6}{'batch':>6}  {'':14}{'TTFT ms':>9}{'decode ms/tok p50':>19}{'p90':>8}{'tok/s':>9}"
        f"{'e2e ms':>9}{'peak RSS MiB':>13}{'added MiB':>11}{'KV MiB':>8}"
    )
    for cell in result["cells"]:
        rows = [("kvforge", cell["kvforge"])]
        if cell["transformers"]:
            rows.append(("transformers", cell["transformers"]))
        for i, (name, m) in enumerate(rows):
            lead = f"{cell['prompt_len']:6d}{cell['batch_size']:6d}" if i == 0 else " " * 12
            lines.append(
                f"{lead}  {name:14}{_fmt(m['ttft_ms'], '9.2f')}{_fmt(m['decode_ms_per_token_p50'], '19.3f')}"
                f"{_fmt(m['decode_ms_per_token_p90'], '8.3f')}{_fmt(m['decode_tokens_per_s'], '9.1f')}"
                f"{_fmt(m['e2e_ms'], '9.1f')}{_mib(m['rss_peak_bytes']):>13}{_mib(m['rss_added_bytes']):>11}"
                f"{_mib(m['kv_cache_bytes']):>8}"
            )
        sp = cell.get("speculative")
        if sp:
            lines.append(
                f"{'':12}  {'speculative':14}{sp['method']}: {_fmt(sp['tokens_per_s'], '.1f')} vs "
                f"{_fmt(sp['plain_tokens_per_s'], '.1f')} tok/s ({_fmt(sp['ratio'], '.2f')}x), acceptance "
                f"{_fmt(sp['acceptance_rate'], '.2f')}, {_fmt(sp['tokens_per_target_call'], '.2f')} tokens per "
                f"target call, identical {sp['greedy_tokens_identical']}"
            )
        if cell["ratio"]:
            r = cell["ratio"]
            lines.append(
                f"{'':12}  {'kvforge/hf':14}{_fmt(r['ttft_ms'], '8.2f')}x{_fmt(r['decode_ms_per_token_p50'], '18.2f')}x"
                f"{_fmt(r['decode_ms_per_token_p90'], '7.2f')}x{_fmt(r['decode_tokens_per_s'], '8.2f')}x"
                f"{_fmt(r['e2e_ms'], '8.2f')}x{_fmt(r['rss_peak_bytes'], '12.2f')}x"
                f"{_fmt(r['rss_added_bytes'], '10.2f')}x{_fmt(r['kv_cache_bytes'], '7.2f')}x"
            )
    prefix = result.get("prefix_cache")
    if prefix:
        budget = _mib(prefix["budget_bytes"])
        lines += ["", f"prefix cache (budget {budget} MiB, {prefix['block_tokens']}-token blocks):"]
        for row in prefix["rows"]:
            lines.append(
                f"{row['prompt_len']:6d} tokens: TTFT {row['cold_ttft_ms']:.2f} ms cold, {row['warm_ttft_ms']:.2f} ms "
                f"with {row['cached_tokens']} tokens cached"
            )
        rate = _fmt(prefix["hit_rate"], ".1%")
        lines.append(f"  hit rate {rate} (prompt tokens found / looked up, over the cold and warm runs)")
    if result["reference"]:
        same = all(c.get("greedy_tokens_identical") for c in result["cells"])
        lines += [
            "",
            "ratio = kvforge / transformers: below 1 is faster (times) or smaller (memory); tok/s above 1 is faster",
            f"greedy tokens identical on both sides in every cell: {'yes' if same else 'NO'}",
        ]
    return "\n".join(lines)


def plot_bench(result: dict[str, Any], path: str | Path) -> Path:
    """TTFT and decode time per token of each cell, kvforge next to transformers."""
    plt = pyplot()
    cells = result["cells"]
    labels = [f"P{c['prompt_len']} B{c['batch_size']}" for c in cells]
    sides = [s for s in SIDES if all(c[s] for c in cells)]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(cells) + 4), 4))
    width = 0.8 / len(sides)
    x = np.arange(len(cells))
    for ax, key, title in (
        (axes[0], "ttft_ms", "time to first token (ms)"),
        (axes[1], "decode_ms_per_token_p50", "decode ms / token (p50; bar: p90)"),
    ):
        for i, side in enumerate(sides):
            values = [c[side][key] or 0.0 for c in cells]
            bars = ax.bar(x + (i - (len(sides) - 1) / 2) * width, values, width, label=side)
            if key == "decode_ms_per_token_p50":
                p90 = [c[side]["decode_ms_per_token_p90"] or 0.0 for c in cells]
                ax.errorbar(
                    [b.get_x() + b.get_width() / 2 for b in bars],
                    values,
                    yerr=[[0] * len(p90), [max(q - v, 0) for q, v in zip(p90, values)]],
                    fmt="none",
                    ecolor="black",
                    capsize=2,
                )
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    artifact = result["artifact"]
    fig.suptitle(f"kvforge bench: {artifact['architecture']} {artifact['dtype']} on {result['environment']['device']}")
    return save_figure(fig, path)
