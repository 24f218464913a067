"""``kvforge compare``: is a compiled artifact exact? kvforge against transformers on the same inputs.

Input: an artifact directory, the Hugging Face model directory it was compiled from, prompts and a
text (bundled defaults under ``tools/data``). Output: a report dict (JSON schema in docs/tools.md),
printed as a table, optionally written as JSON and plotted per step. Sections:

* ``prefill``: the prefill graph's last-token logits of each prompt (batch 1);
* ``decode``: teacher-forced decode steps: both sides see the prompt followed by the reference's
  own greedy continuation; kvforge runs prefill + one ``decode`` per token, transformers one
  forward over the whole sequence; step i compares the logits after continuation token i;
* ``greedy``: free greedy generation on both sides, and the first step where they diverge;
* ``perplexity``: the text's perplexity on both sides, from the score graph's all-position logits
  (the prefill graph only returns last-token logits), in windows of ``max_seq`` tokens;
* ``batch``: the prompts as padded (ragged) batches of up to ``max_batch`` rows: each row's
  prefill and teacher-forced decode logits and its greedy tokens against its batch-1 run;
* ``layers``: each layer's cache after each prompt and its teacher-forced continuation (batch 1)
  against transformers' cache after the same tokens: an attention layer's keys and values at
  every position, a state layer's state (conv, recurrent), so that a difference can be bisected
  to the layer where it starts. Reported, not judged: the logits are.

The verdict fails (``MISMATCH``) when a maximum absolute logit difference exceeds ``atol`` or a
batched row differs from its batch-1 run; top-1/top-5 and greedy divergence are reported as
measured (a near-tie may flip under rounding within tolerance).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge.graphs import contract
from kvforge.runtime import Engine
from kvforge.tools import metrics, reference
from kvforge.tools import perplexity as ppl
from kvforge.tools.report import (
    Progress,
    artifact_summary,
    data_file,
    describe_artifact,
    pyplot,
    read_user_file,
    save_figure,
    torch_threads,
)

SCHEMA = "kvforge.compare"
SCHEMA_VERSION = 1
DEFAULT_STEPS = 32
# Default tolerance on the max absolute logit difference, by the artifact's dtype.
DEFAULT_ATOL = {"float32": 1e-3, "float16": 1e-1, "bfloat16": 5e-1}


def load_prompts(path: str | Path | None) -> list[str]:
    """One prompt per non-blank line of ``path`` (default: the bundled ``prompts.txt``)."""
    text = read_user_file(path, "--prompts file") if path else data_file("prompts.txt").read_text(encoding="utf-8")
    prompts = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts file {str(path)!r} has no prompts; write one prompt per line")
    return prompts


def load_text(path: str | Path | None) -> str:
    """The text whose perplexity is measured (default: the bundled ``text.txt``)."""
    return read_user_file(path, "--text file") if path else data_file("text.txt").read_text(encoding="utf-8")


def run_compare(
    artifact: str | Path,
    reference_dir: str | Path,
    prompts: list[str],
    text: str,
    *,
    steps: int = DEFAULT_STEPS,
    atol: float | None = None,
    verify: bool = True,
    threads: int | None = None,
    progress: Progress | None = None,
    device: str = "cpu",
    backend: str = "ort",
    stride: int | None = None,
) -> dict[str, Any]:
    """Run both sides and return the report (see docs/tools.md). ``verify=False`` skips the sha256
    check of the artifact's files (to measure a modified artifact); ``threads`` sets ONNX Runtime's
    and torch's thread counts (None: each library's default); ``device``/``backend`` go to
    :meth:`Engine.load` (the transformers side stays on the CPU); ``stride``: the perplexity
    windows' starts lie this far apart (default ``max_seq``: non-overlapping windows;
    :mod:`kvforge.tools.perplexity`)."""
    with torch_threads(threads):
        return _run_compare(
            artifact, reference_dir, prompts, text, steps, atol, verify, threads, progress, device, backend, stride
        )


def _run_compare(
    artifact: str | Path,
    reference_dir: str | Path,
    prompts: list[str],
    text: str,
    steps: int,
    atol: float | None,
    verify: bool,
    threads: int | None,
    progress: Progress | None,
    device: str = "cpu",
    backend: str = "ort",
    stride: int | None = None,
) -> dict[str, Any]:
    say = progress or Progress("compare", enabled=False)
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    if not prompts:
        raise ValueError("no prompts given")
    with Engine.load(artifact, threads=threads, verify=verify, device=device, backend=backend) as engine:
        if engine.tokenizer is None:
            raise ValueError(f"artifact {str(artifact)!r} has no tokenizer.json; compare needs text prompts")
        manifest = engine.manifest
        atol = DEFAULT_ATOL[manifest.dtype] if atol is None else atol
        rows = [engine.encode(p) for p in prompts]
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens")
            if len(row) + steps > engine.max_seq:
                raise ValueError(
                    f"prompt {i} has {len(row)} tokens; with --steps {steps} it needs {len(row) + steps} cache "
                    f"rows but this artifact was compiled with max_seq={engine.max_seq} "
                    "(use fewer --steps or shorter prompts)"
                )
        text_ids = engine.encode(text)
        if len(text_ids) < 2:
            raise ValueError("the --text file needs at least 2 tokens to measure a perplexity")
        if stride is not None and not 1 <= stride <= engine.max_seq:
            raise ValueError(
                f"--stride {stride} must lie in 1..{engine.max_seq} (the artifact's max_seq, the perplexity window)"
            )

        say.say(f"loading the reference {reference_dir} (transformers eager, {manifest.dtype})")
        model = reference.load(reference_dir, manifest)
        eos = set(manifest.generation.get("eos_token_ids", []))
        say.say(f"reference greedy continuations ({len(rows)} prompts x {steps} steps)")
        continuations = [reference.greedy(model, row, steps) for row in rows]
        ref_logits = [reference.all_logits(model, row + cont) for row, cont in zip(rows, continuations)]

        say.say("kvforge: prefill and teacher-forced decode, batch 1, and each layer's cache after it")
        ours, layer_parts = [], []
        for row, cont in zip(rows, continuations):
            ours.append(_teacher_forced(engine, [row], [cont])[0])
            layer_parts.append(_layer_diffs(engine, model, row + cont))
        ours_greedy = [engine.generate([row], max_new_tokens=steps)[0].token_ids for row in rows]
        say.say("kvforge: padded batches")
        batch = _batch_check(engine, rows, continuations, ours, ours_greedy, atol)
        if "score" in manifest.graphs:
            say.say(f"perplexity of the text ({len(text_ids)} tokens)")
            perplexity = _perplexity(engine, model, text_ids, stride)
        else:
            perplexity = {
                "skipped": "the artifact has no score graph (all-position logits); recompile it "
                "without --no-score-graph to measure perplexity"
            }

    prefill_parts, decode_parts = [], []
    for row, mine, theirs in zip(rows, ours, ref_logits):
        n = len(row)
        prefill_parts.append(metrics.per_position(mine[:1], theirs[n - 1 : n]))
        decode_parts.append(metrics.per_position(mine[1:], theirs[n : n + steps]))
    result = {
        "kind": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "artifact": artifact_summary(artifact, manifest),
        "reference": {
            "path": str(reference_dir),
            "implementation": "transformers eager, default cache",
            "dtype": manifest.dtype,
            "transformers_version": _transformers_version(),
            "matches_source": reference.matches_source(manifest, reference_dir),
        },
        "settings": {
            "prompts": list(prompts),
            "prompt_tokens": [len(r) for r in rows],
            "steps": steps,
            "text_tokens": len(text_ids),
            "atol": atol,
            "verified_hashes": verify,
        },
        "prefill": {
            **metrics.summarize(metrics.concat(prefill_parts)),
            "per_prompt": [metrics.summarize(p) for p in prefill_parts],
        },
        "decode": {
            **metrics.summarize(metrics.concat(decode_parts)),
            "per_step": _per_step(decode_parts),
            "per_prompt": [
                {
                    **metrics.summarize(p),
                    "max_abs_diff_per_step": p["max_abs_diff"].tolist(),
                    "kl_per_step": p["kl"].tolist(),
                }
                for p in decode_parts
            ],
        },
        "greedy": _greedy(ours_greedy, continuations, eos, steps),
        "perplexity": perplexity,
        "batch": batch,
        "layers": _layers(layer_parts),
    }
    result["verdict"] = _verdict(result, atol)
    return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _teacher_forced(engine: Engine, rows: list[list[int]], tokens: list[list[int]]) -> list[torch.Tensor]:
    """kvforge's logits for a batch: the prefill's, then one decode step per teacher token.
    Returns per row ``[1 + steps, V]`` float32 (row 0: prefill)."""
    steps = len(tokens[0])
    # float32 copies (torch.tensor copies): the engine reuses its logits buffer every step.
    out = [torch.tensor(engine.prefill(rows), dtype=torch.float32)]  # (B, V)
    for i in range(steps):
        out.append(torch.tensor(engine.decode([t[i] for t in tokens]), dtype=torch.float32))
    stacked = torch.stack(out, dim=1)  # (B, 1 + steps, V)
    return list(stacked.unbind(0))


def _our_cache(engine: Engine, n: int) -> dict[tuple[int, str], np.ndarray] | None:
    """Cache row 0's first ``n`` positions by ``(layer, part)``: ``key``/``value`` ``[H_kv, n, D]`` of
    each attention layer, and each state tensor (``conv``, ``recurrent``) of the other layers;
    None when the cache is not in host memory (a GPU backend)."""
    cache = engine.cache
    if not isinstance(getattr(cache, "buffer", None), np.ndarray):
        return None
    out = {}
    for i, layer in enumerate(cache.attention_layers):
        out[layer, "key"], out[layer, "value"] = cache.buffer[i, 0, 0, :, :n], cache.buffer[i, 1, 0, :, :n]
    for entry, tensor in engine.manifest.layout.state_tensors():
        out[entry.layer, tensor.part] = cache.states[contract.past_state_name(entry.layer, tensor.part)][0]
    return out


def _layer_diffs(engine: Engine, model: torch.nn.Module, tokens: list[int]) -> dict[tuple[int, str], float] | None:
    """Max |kvforge - transformers| of each cache tensor after ``tokens`` (None for a tensor that
    transformers' cache does not hold in the same shape); None when kvforge's cache is on a device."""
    ours = _our_cache(engine, len(tokens))
    if ours is None:
        return None
    theirs = reference.cache_tensors(model, tokens)
    # kvforge's Mamba2 recurrent state is transformers' [H, P, N] transposed (StateTensor.axes)
    transposed = {(e.layer, t.part) for e, t in engine.manifest.layout.state_tensors() if t.axes == "hnp"}
    diffs = {}
    for (layer, part), array in ours.items():
        mine, ref = torch.from_numpy(np.asarray(array, dtype=np.float32)), theirs.get((layer, part))
        if ref is not None and (layer, part) in transposed:
            ref = ref.transpose(-1, -2)
        if ref is not None and part in ("key", "value") and ref.shape[-2] < mine.shape[-2]:
            mine = mine[..., -ref.shape[-2] :, :]  # a sliding window's cache layer keeps the last positions
        if ref is not None and part == "conv" and ref.shape[:-1] == mine.shape[:-1] and ref.shape[-1] > mine.shape[-1]:
            ref = ref[..., -mine.shape[-1] :]  # transformers keeps the last K inputs, kvforge the K-1 the next needs
        diffs[layer, part] = float((mine - ref).abs().max()) if ref is not None and ref.shape == mine.shape else None
    return diffs


def _layers(parts: list[dict[tuple[int, str], float] | None]) -> dict[str, Any]:
    """The ``layers`` section: per cache tensor, the max difference over the prompts."""
    if any(p is None for p in parts):
        return {"skipped": "the artifact's cache is on the device (a GPU backend), not readable here"}
    rows = []
    for layer, part in parts[0]:
        values = [p[layer, part] for p in parts]
        rows.append(
            {"layer": layer, "part": part, "max_abs_diff": None if None in values else max(values, default=0.0)}
        )
    rows.sort(key=lambda r: (r["layer"], PARTS.index(r["part"])))
    known = [r["max_abs_diff"] for r in rows if r["max_abs_diff"] is not None]
    return {"max_abs_diff": max(known, default=None), "per_layer": rows}


PARTS = ("key", "value", "conv", "recurrent")


def _per_step(decode_parts: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Decode metrics at each step, over all prompts (step 0: the first decode step)."""
    steps = len(decode_parts[0]["kl"])
    per_step = []
    for s in range(steps):
        at = {key: torch.stack([p[key][s] for p in decode_parts]) for key in decode_parts[0]}
        per_step.append({"step": s, **metrics.summarize(at)})
    return per_step


def _greedy(ours: list[list[int]], continuations: list[list[int]], eos: set[int], steps: int) -> dict[str, Any]:
    rows = []
    for i, (mine, cont) in enumerate(zip(ours, continuations)):
        theirs = list(cont)
        cut = next((j for j, t in enumerate(theirs) if t in eos), None)
        if cut is not None:
            theirs = theirs[: cut + 1]  # transformers' generate stops at eos, keeping it
        diverged = metrics.first_divergence(mine, theirs)
        rows.append({"prompt": i, "diverged_at": diverged, "kvforge_tokens": mine, "reference_tokens": theirs})
    return {
        "max_new_tokens": steps,
        "all_identical": all(r["diverged_at"] is None for r in rows),
        "per_prompt": rows,
    }


def _batch_check(
    engine: Engine,
    rows: list[list[int]],
    continuations: list[list[int]],
    batch1_logits: list[torch.Tensor],
    batch1_greedy: list[list[int]],
    atol: float,
) -> dict[str, Any]:
    if engine.max_batch < 2 or len(rows) < 2:
        reason = "the artifact's max_batch is 1" if engine.max_batch < 2 else "only one prompt"
        return {"skipped": reason}
    size = min(engine.max_batch, len(rows))
    steps = len(continuations[0])
    results = []
    batched_greedy = engine.generate(rows, max_new_tokens=steps)
    for start in range(0, len(rows), size):
        chunk = range(start, min(start + size, len(rows)))
        logits = _teacher_forced(engine, [rows[i] for i in chunk], [continuations[i] for i in chunk])
        for i, mine in zip(chunk, logits):
            diff = (mine - batch1_logits[i]).abs().amax(-1)  # (1 + steps,)
            results.append(
                {
                    "prompt": i,
                    "prefill_max_abs_diff": float(diff[0]),
                    "decode_max_abs_diff": float(diff[1:].max()),
                    "tokens_identical": batched_greedy[i].token_ids == batch1_greedy[i],
                }
            )
    consistent = all(
        r["tokens_identical"] and r["prefill_max_abs_diff"] <= atol and r["decode_max_abs_diff"] <= atol
        for r in results
    )
    lengths = {len(r) for r in rows}
    return {"batch_size": size, "ragged": len(lengths) > 1, "all_consistent": consistent, "rows": results}


def _perplexity(engine: Engine, model: torch.nn.Module, ids: list[int], stride: int | None = None) -> dict[str, Any]:
    """Perplexity on both sides over windows of ``max_seq`` tokens, ``stride`` apart (default:
    non-overlapping, the first token of each window context only; :mod:`kvforge.tools.perplexity`),
    with the logit metrics of every scored position."""
    window = engine.max_seq
    nll_ours, nll_ref, parts = [], [], []
    plan = ppl.windows(len(ids), window, stride)
    for w in plan:
        chunk = ids[w.start : w.end]
        rows = slice(w.first - 1 - w.start, w.end - 1 - w.start)  # row i predicts chunk[i + 1]
        mine = torch.from_numpy(engine.score([chunk])[0, rows]).float()
        theirs = reference.all_logits(model, chunk)[rows]
        targets = torch.tensor(ids[w.first : w.end])
        nll_ours.append(metrics.token_nll(mine, targets))
        nll_ref.append(metrics.token_nll(theirs, targets))
        parts.append(metrics.per_position(mine, theirs))
    ours, ref = torch.cat(nll_ours).mean(), torch.cat(nll_ref).mean()
    ppl_ours, ppl_ref = float(ours.exp()), float(ref.exp())
    return {
        "tokens": len(ids),
        "scored_tokens": sum(w.scored for w in plan),
        "windows": len(plan),
        "window_tokens": window,
        "stride": stride or window,
        "kvforge": ppl_ours,
        "reference": ppl_ref,
        "abs_diff": abs(ppl_ours - ppl_ref),
        "rel_diff": abs(ppl_ours - ppl_ref) / ppl_ref if ppl_ref else None,
        **metrics.summarize(metrics.concat(parts)),
    }


def _verdict(result: dict[str, Any], atol: float) -> dict[str, Any]:
    failures = []
    for section in ("prefill", "decode", "perplexity"):
        if "skipped" in result[section]:
            continue
        value = result[section].get("max_abs_diff")
        if value is None or not value <= atol:  # NaN fails too
            shown = "NaN" if value is None or value != value else f"{value:.3g}"
            failures.append(f"{section} max|diff| {shown} > atol {atol:g}")
    batch = result["batch"]
    if "skipped" not in batch and not batch["all_consistent"]:
        bad = [r["prompt"] for r in batch["rows"] if not r["tokens_identical"]]
        worst = max(max(r["prefill_max_abs_diff"], r["decode_max_abs_diff"]) for r in batch["rows"])
        failures.append(f"padded batch differs from batch-1 runs (max|diff| {worst:.3g}; tokens differ: {bad})")
    return {"ok": not failures, "atol": atol, "failures": failures}


# ---------------------------------------------------------------- terminal


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"kvforge compare: {describe_artifact(result['artifact'])}",
        f"  vs {result['reference']['implementation']} ({result['reference']['path']}, {result['reference']['dtype']})",
    ]
    if result["reference"]["matches_source"] is False:
        lines.append(
            "  note: the reference is not the model directory this artifact was compiled from (sha256 differs)"
        )
    lines.append("")
    header = f"{'':28}{'positions':>9}{'max|diff|':>11}{'mean|diff|':>11}{'KL(ref|kvf)':>12}{'top-1':>7}{'top-5':>7}"
    lines.append(header)
    sections = (
        ("prefill (last token)", result["prefill"]),
        (f"decode ({result['settings']['steps']} teacher-forced)", result["decode"]),
        ("text (score graph)", result["perplexity"]),
    )
    for name, s in sections:
        if "skipped" in s:
            continue
        lines.append(
            f"{name:28}{s['positions']:9d}{_fmt(s.get('max_abs_diff'), '11.2e')}{_fmt(s.get('mean_abs_diff'), '11.2e')}"
            f"{_fmt(s.get('kl_mean'), '12.2e')}{_fmt(s.get('top1_agreement'), '7.3f')}"
            f"{_fmt(s.get('top5_agreement'), '7.3f')}"
        )
    p = result["perplexity"]
    lines.append("")
    if "skipped" in p:
        lines.append(f"perplexity: skipped ({p['skipped']})")
    else:
        stride = "" if p.get("stride", p["window_tokens"]) == p["window_tokens"] else f", stride {p['stride']}"
        lines.append(
            f"perplexity ({p['scored_tokens']} tokens, {p['windows']} window(s) of {p['window_tokens']}{stride}): "
            f"kvforge {_fmt(p['kvforge'], '.4f')}, transformers {_fmt(p['reference'], '.4f')} "
            f"(|diff| {_fmt(p['abs_diff'], '.2e')})"
        )
    g = result["greedy"]
    diverged = [r for r in g["per_prompt"] if r["diverged_at"] is not None]
    lines.append(
        f"greedy ({g['max_new_tokens']} new tokens, {len(g['per_prompt'])} prompts): "
        + ("identical for every prompt" if not diverged else "")
        + "; ".join(f"prompt {r['prompt']} diverges at step {r['diverged_at']}" for r in diverged)
    )
    b = result["batch"]
    if "skipped" in b:
        lines.append(f"padded batch: skipped ({b['skipped']})")
    else:
        worst = max(max(r["prefill_max_abs_diff"], r["decode_max_abs_diff"]) for r in b["rows"])
        same = all(r["tokens_identical"] for r in b["rows"])
        lines.append(
            f"padded batch of {b['batch_size']}{' (ragged)' if b['ragged'] else ''}: "
            f"max|diff| vs batch-1 {worst:.2e}, greedy tokens {'identical' if same else 'DIFFER'}"
        )
    lines += _format_layers(result.get("layers"))
    v = result["verdict"]
    lines.append("")
    if v["ok"]:
        lines.append(f"OK: every logit difference within atol={v['atol']:g}; padded batches match batch-1 runs")
    else:
        lines += [f"MISMATCH: {failure}" for failure in v["failures"]]
    return "\n".join(lines)


def _format_layers(section: dict[str, Any] | None) -> list[str]:
    """One line per layer: each cache tensor's max |diff| (``-`` where transformers has no counterpart)."""
    if not section:
        return []
    if "skipped" in section:
        return [f"cache per layer: skipped ({section['skipped']})"]
    by_layer: dict[int, list[str]] = {}
    for r in section["per_layer"]:
        by_layer.setdefault(r["layer"], []).append(f"{r['part']} {_fmt(r['max_abs_diff'], '.2e')}")
    lines = [f"cache per layer (max|diff| after prompt + continuation, worst {_fmt(section['max_abs_diff'], '.2e')}):"]
    return lines + [f"  layer {layer}: " + ", ".join(parts) for layer, parts in sorted(by_layer.items())]


def _positive(values: list[float | None]) -> list[float]:
    """Values for a log axis: zero or missing values are not drawn."""
    return [v if v is not None and v > 0 else float("nan") for v in values]


def plot_compare(result: dict[str, Any], path: str | Path) -> Path:
    """Per-step max |diff| and KL: step 0 is the prefill, then each teacher-forced decode step."""
    plt = pyplot()
    fig, (ax_diff, ax_kl) = plt.subplots(1, 2, figsize=(11, 4))
    prefill, decode = result["prefill"], result["decode"]
    steps = [0] + [s["step"] + 1 for s in decode["per_step"]]
    panels = (
        (ax_diff, "max |logit diff|", "max_abs_diff", "max_abs_diff_per_step"),
        (ax_kl, "KL(reference ‖ kvforge), nats", "kl_max", "kl_per_step"),
    )
    for ax, title, key, per_step_key in panels:
        for i, (first, rest) in enumerate(zip(prefill["per_prompt"], decode["per_prompt"])):
            values = _positive([first[key], *rest[per_step_key]])
            ax.plot(steps, values, linewidth=0.8, alpha=0.6, label=f"prompt {i}" if ax is ax_kl else None)
        worst = _positive([prefill[key]] + [s[key] for s in decode["per_step"]])
        ax.plot(steps, worst, color="black", linewidth=1.8, marker="o", markersize=3, label="max over prompts")
        ax.set_yscale("log")
        ax.set_xlabel("step (0 = prefill, then teacher-forced decode)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax_diff.axhline(result["verdict"]["atol"], color="red", linestyle="--", label="atol")
    ax_diff.legend(fontsize=7)
    ax_kl.legend(fontsize=7, ncol=2)
    artifact = result["artifact"]
    fig.suptitle(f"kvforge vs transformers: {artifact['architecture']} {artifact['dtype']} ({artifact['path']})")
    return save_figure(fig, path)
