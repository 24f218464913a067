"""OpenVINO GenAI vs kvforge, one run, equal threads, equal KV capacity (issue 41).

OpenVINO GenAI is what many users of x86 CPUs run an LLM with. This benchmark puts it in a venv of
its own (``--ov-venv``, default ``~/.cache/kvforge/peers/openvino-venv``, made on first use:
``OV_PACKAGES`` pinned, torch the CPU wheel, optimum-intel with ``--no-deps`` because its unpinned
torch/torchvision requirement would pull a CUDA torch), exports each model with optimum-intel
(``optimum-cli export openvino``: ``--weight-format fp32``, and ``int4 --sym --group-size 32
--ratio 1.0``; optimum-intel keeps the embedding and lm_head in int8, its default) and runs every
side in a process of its own, the sides taking turns over ``--rounds`` rounds
(benchmarks/peer_genai.py's workers, rounds and medians). Rows, per ``--model`` and prompt length:

* ``kvforge (fp32|int4)``: ``kvforge compile`` of the HF directory at compile's defaults
  (max_batch 4, int4 = symmetric blocks of 32) with ``--max-seq`` (a longer prompt gets the next
  power of two that holds it and the new tokens);
* ``kvforge (fp32|int4), prefill=int8|fp32|openvino|openvino:bf16`` (``--kvforge-prefill``): the
  same artifact with its prefill calls on ORT's integer GEMM or with float activations (int4 only;
  kvforge.runtime.int8_prefill) or its long prefill calls on OpenVINO (``Engine.load(prefill=...)``,
  kvforge.runtime.ov_prefill), compared with the ``kvforge`` row; the bf16 row is the peer of OV's
  defaults row (bf16 execution), not of the matched one;
* ``OpenVINO GenAI (fp32|int4), f32 execution and KV``: ``openvino_genai.LLMPipeline`` with
  ``INFERENCE_PRECISION_HINT=f32`` and ``KV_CACHE_PRECISION=f32``, kvforge's arithmetic: the
  matched row, the one the ratios headline;
* ``OpenVINO GenAI (fp32|int4), its defaults (...)``: no precision hints: what the CPU plugin picks
  on this CPU (bf16 execution where the CPU has AVX512-BF16/AMX, an f16 or u8 KV cache), read from
  the compiled model and written into the label. Never the headline (``defaults: true`` in the JSON).

Equal resources: ``INFERENCE_NUM_THREADS = --threads`` (kvforge: ``Engine.load(threads=)``); OV's
KV cache (``SchedulerConfig.num_kv_blocks``) holds what kvforge's holds, max_batch x max_seq tokens
in blocks of ``OV_KV_BLOCK`` (the CPU plugin's); ``enable_prefix_caching=False``;
``max_num_batched_tokens`` unbounded, so a prompt goes in one call on both sides (LLMPipeline's own
default). The same prompt ids every side (SmolLM2: slices of the quality text; the 1.39B shape:
random ids). ``--model``: ``smollm2`` (SmolLM2-135M-Instruct from ``make smollm2``) and ``large``
(benchmarks/peer_llamacpp.py's random 1.39B Llama, built the same way, in the same work folder;
int4 only unless ``--precisions`` says otherwise, as in peer_llamacpp.py: its int4 compile alone
peaks at 13.4 GiB, issue 41).

What each side times: kvforge ``Engine.prefill_prompt`` + argmax (TTFT: calls of ``chunk_tokens``
tokens, as generation prefills), then ``Engine.decode`` + argmax
per step; OV ``LLMPipeline.generate`` of ``TokenizedInputs`` with ``ignore_eos``, greedy: TTFT is
a call with ``max_new_tokens=1``, a step is ``(t(N) - t(1)) / (N - 1)`` from a call of N (as
peer_genai.py times transformers); OV's own ``perf_metrics`` TTFT and TPOT go beside them in the
JSON. Peak RSS: each worker's ``VmHWM``. Greedy agreement against kvforge's row of the same
precision.

Quality: the perplexity of each side's int4 on the quality text (benchmarks/common.py
``load_text``: Genesis, KJV), the first ``--ppl-tokens`` ids in windows of 512
(kvforge.tools.perplexity): kvforge's ``Engine.score``, OV's exported IR through ``openvino.Core``
(a stateful model, its state reset every window) at the matched and at the default hints.

    python benchmarks/peer_openvino.py --model smollm2 --json openvino.json
    python benchmarks/peer_openvino.py --model smollm2 large --prompt-lens 128 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_genai as pg
import peer_llamacpp as peers
from common import PEERS_CACHE, load_text

SCRIPT = Path(__file__).resolve()
# The OpenVINO venv, exactly (what the README's figures were measured with). optimum-intel is
# installed after these with --no-deps: its requirements name torch and torchvision unpinned.
OV_PACKAGES = (
    "torch==2.13.0",  # the CPU wheel (find-links / the CPU index, as `make setup` installs it)
    "openvino==2026.4.1",
    "openvino-genai==2026.4.1.0",
    "openvino-tokenizers==2026.4.1.0",
    "nncf==3.4.0",
    "optimum==2.3.0",
    "transformers==5.5.4",
    "huggingface-hub==1.21.0",
    "tokenizers==0.22.2",
    "safetensors==0.8.0",
    "numpy==2.4.6",
    "setuptools==84.2.1",
    "requests==2.34.2",
)
OPTIMUM_INTEL = "optimum-intel==2.2.0"
OV_DISTS = ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "optimum", "nncf", "transformers")
OV_KV_BLOCK = 32  # tokens per KV block of the CPU plugin's paged attention
MAX_BATCH = 4  # kvforge compile's default: its KV cache holds MAX_BATCH x max_seq tokens
PPL_WINDOW = 512
MATCHED = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
EXPORT_FLAGS = {
    "fp32": ["--weight-format", "fp32"],
    "int4": ["--weight-format", "int4", "--sym", "--group-size", "32", "--ratio", "1.0"],
}


# ---------------------------------------------------------------------------- the OpenVINO venv


def install_commands(venv: Path) -> list[list[str]]:
    """The pip commands that make the OpenVINO venv: the pinned set, then optimum-intel alone."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    return [[*pip, *OV_PACKAGES], [*pip, "--no-deps", OPTIMUM_INTEL]]


def installed_versions(python: Path) -> dict[str, str | None]:
    """The venv's versions of ``OV_DISTS`` ({} when it has no python)."""
    if not python.exists():
        return {}
    code = (
        "import importlib.metadata as m, json\n"
        "def v(d):\n    try: return m.version(d)\n    except m.PackageNotFoundError: return None\n"
        f"print(json.dumps({{d: v(d) for d in {list(OV_DISTS)!r}}}))"
    )
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def wanted_versions() -> dict[str, str]:
    pins = dict(p.split("==") for p in (*OV_PACKAGES, OPTIMUM_INTEL))
    return {d: pins[d] for d in OV_DISTS}


def ensure_ov_venv(venv: Path) -> str:
    """The venv's python, installing ``OV_PACKAGES`` and optimum-intel first unless it has them."""
    python = venv / "bin" / "python"
    if installed_versions(python) == wanted_versions():
        return str(python)
    pg.say(f"installing OpenVINO GenAI and optimum-intel into {venv} (minutes; once)")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for step, cmd in enumerate(install_commands(venv)):
        log = venv.parent / f"openvino-install-{step}.log"
        pg.run_logged(cmd, log, f"pip install into {venv}")
    have = installed_versions(python)
    if have != wanted_versions():
        raise pg.StepFailed(
            f"the OpenVINO venv {venv} has {have}, expected {wanted_versions()}; "
            f"pip's logs: {venv.parent}/openvino-install-*.log"
        )
    return str(python)


def ensure_export(venv: Path, model_dir: Path, out: Path, precision: str) -> tuple[Path, float | None]:
    """optimum-intel's export of ``model_dir`` at ``precision`` (cached): the IR and its tokenizer."""
    if (out / "openvino_model.xml").exists():
        return out, None
    cmd = [str(venv / "bin" / "optimum-cli"), "export", "openvino", "-m", str(model_dir)]
    cmd += ["--task", "text-generation-with-past", *EXPORT_FLAGS[precision], str(out)]
    pg.say(" ".join(cmd[1:]))
    start = time.perf_counter()
    pg.run_logged(cmd, out.parent / f"export-{out.name}.log", f"optimum-cli export openvino -> {out}")
    return out, time.perf_counter() - start


# ---------------------------------------------------------------------------- workers (subprocesses)


def _ov_properties(job: dict[str, Any]) -> dict[str, Any]:
    """The plugin properties of a row: threads, and the matched row's precision hints."""
    return {"INFERENCE_NUM_THREADS": job["threads"], **job["hints"]}


def run_openvino(job: dict[str, Any]) -> dict[str, Any]:
    """peer_genai's timing loop for ``openvino_genai.LLMPipeline``: TTFT from a call of one new token,
    a step from a call of N minus it, greedy, eos ignored; the KV capacity of kvforge's cache."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    before = pg.rss_bytes()
    scheduler = og.SchedulerConfig()
    scheduler.num_kv_blocks = math.ceil(job["kv_tokens"] / OV_KV_BLOCK)
    scheduler.enable_prefix_caching = False
    scheduler.max_num_batched_tokens = 2**31 - 1  # a prompt in one call (LLMPipeline's own default)
    scheduler.max_num_seqs = len(job["prompts"])
    pipe = og.LLMPipeline(job["ov_dir"], "CPU", {"scheduler_config": scheduler, **_ov_properties(job)})
    ids = np.asarray(job["prompts"], dtype=np.int64)
    inputs = og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
    n, length = job["new_tokens"], ids.shape[1]

    def generate(k: int):
        config = og.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.do_sample = k, True, False
        start = time.perf_counter()
        out = pipe.generate(inputs, config)
        return time.perf_counter() - start, out

    _, out = generate(n)  # warm-up
    tokens = [list(map(int, t))[-n:] if len(t) > n else list(map(int, t)) for t in out.tokens]
    ttft, step_mean, ov_ttft, ov_tpot = [], [], [], []
    for _ in range(job["repeat"]):
        t1, _ = generate(1)
        tn, out = generate(n)
        ttft.append(t1)
        step_mean.append((tn - t1) / (n - 1))
        metrics = out.perf_metrics
        ov_ttft.append(metrics.get_ttft().mean)
        ov_tpot.append(metrics.get_tpot().mean)
    result = pg._result(ttft, step_mean, [], tokens, before)
    result.update(
        ov_ttft_ms=float(np.median(ov_ttft)),
        ov_tpot_ms=float(np.median(ov_tpot)),
        prompt_len=length,
        kv_blocks=scheduler.num_kv_blocks,
        properties=_ov_properties(job),
        openvino=ov.get_version(),
    )
    return result


def openvino_probe(job: dict[str, Any]) -> dict[str, Any]:
    """What the CPU plugin resolves the IR to with no precision hints (the defaults row's label)."""
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(str(Path(job["ov_dir"]) / "openvino_model.xml"), "CPU", _ov_properties(job))

    def name(value) -> str:  # an element type (ov.Type.bf16 -> "bf16") or a plain value
        return value.get_type_name() if hasattr(value, "get_type_name") else str(value)

    read = {k: name(compiled.get_property(k)) for k in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION")}
    read["cpu"] = str(core.get_property("CPU", "FULL_DEVICE_NAME"))
    read["capabilities"] = [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
    return read


def _perplexity_module(path: str):
    """kvforge.tools.perplexity by file (numpy only; the OpenVINO venv has no kvforge)."""
    return peers._load_perplexity_module(path)


def openvino_nll(job: dict[str, Any]) -> dict[str, Any]:
    """The NLL of ``job["windows"]`` of ``job["ids"]`` under the exported IR (every position's
    logits), its state (the KV cache) reset before each window."""
    import numpy as np
    import openvino as ov

    ppl = _perplexity_module(job["perplexity_module"])
    compiled = ov.Core().compile_model(str(Path(job["ov_dir"]) / "openvino_model.xml"), "CPU", _ov_properties(job))
    request = compiled.create_infer_request()
    names = {n for port in compiled.inputs for n in port.get_names()}
    ids, nll, start = job["ids"], [], time.perf_counter()
    for first_token, end, first in job["windows"]:
        w = ppl.Window(first_token, end, first)
        request.reset_state()
        x = np.asarray([ids[w.start : w.end]], dtype=np.int64)
        feed = {"input_ids": x, "attention_mask": np.ones_like(x)}
        if "position_ids" in names:
            feed["position_ids"] = np.arange(x.shape[1], dtype=np.int64)[None]
        if "beam_idx" in names:
            feed["beam_idx"] = np.zeros(1, dtype=np.int32)
        logits = request.infer(feed)[compiled.output("logits")][0]
        if logits.shape[0] != x.shape[1]:
            raise RuntimeError(f"the IR returns logits for {logits.shape[0]} positions of {x.shape[1]}")
        nll.append(ppl.window_nll(logits, ids, w))
    nll = np.concatenate(nll)
    return {"nll_sum": float(nll.sum()), "scored": len(nll), "seconds": time.perf_counter() - start}


def kvforge_nll(job: dict[str, Any]) -> dict[str, Any]:
    """The same windows under a kvforge artifact's score graph (``Engine.score``)."""
    import numpy as np

    from kvforge.runtime import Engine
    from kvforge.tools import perplexity as ppl

    ids, nll, start = job["ids"], [], time.perf_counter()
    with Engine.load(job["out"], threads=job["threads"]) as engine:
        for first_token, end, first in job["windows"]:
            w = ppl.Window(first_token, end, first)
            nll.append(ppl.window_nll(engine.score([ids[w.start : w.end]])[0], ids, w))
    nll = np.concatenate(nll)
    return {"nll_sum": float(nll.sum()), "scored": len(nll), "seconds": time.perf_counter() - start}


WORKERS = {
    "openvino": run_openvino,
    "openvino-probe": openvino_probe,
    "openvino-nll": openvino_nll,
    "kvforge-nll": kvforge_nll,
}


def worker_main(name: str, job_file: str) -> None:
    pg.answer_job(WORKERS, name, job_file)


# ---------------------------------------------------------------------------- parent: plan, run, report


def max_seq_for(prompt_len: int, new_tokens: int, floor: int) -> int:
    """kvforge's max_seq for a prompt: ``floor`` (--max-seq) when the prompt and the new tokens fit
    in it, else the next power of two that holds them."""
    need = prompt_len + new_tokens
    return floor if need <= floor else 1 << (need - 1).bit_length()


def defaults_label(precision: str, probe: dict[str, Any]) -> str:
    """The defaults row's label: what the plugin picked, read from the compiled model."""
    execution, kv = probe.get("INFERENCE_PRECISION_HINT", "?"), probe.get("KV_CACHE_PRECISION", "?")
    return f"OpenVINO GenAI ({precision}), its defaults ({execution} execution, {kv} KV)"


def kvforge_prefills(asked: list[str]) -> list[str]:
    """kvforge's rows: ``"ort"`` first, always (the reference of every ratio), then the others asked."""
    return ["ort", *dict.fromkeys(p for p in asked if p != "ort")]


def kvforge_label(precision: str, prefill: str) -> str:
    """kvforge's row at Engine.load's ``prefill`` (the reference row: ``"ort"``, the default)."""
    return f"kvforge ({precision})" if prefill == "ort" else f"kvforge ({precision}), prefill={prefill}"


def matched_label(precision: str) -> str:
    return f"OpenVINO GenAI ({precision}), f32 execution and KV"


def ensure_model(model: str, work: Path) -> Path:
    """SmolLM2's HF directory (``make smollm2``) or peer_llamacpp's random 1.39B Llama (built here if
    peer_llamacpp.py has not built it yet, in the same folder)."""
    if model == "smollm2":
        if not (peers.SMOLLM2_HF / "config.json").exists():
            raise SystemExit(f"SmolLM2-135M-Instruct is not at {peers.SMOLLM2_HF}: run `make smollm2` first")
        return peers.SMOLLM2_HF
    model_dir = work / "model-large"
    if not (model_dir / "config.json").exists():
        pg.say(f"building the random 1.39B Llama in {model_dir}")
        job = {"shape": peers.LARGE, "model_dir": str(model_dir), "tokenizer_dir": str(peers.SMOLLM2_HF)}
        pg.run_worker(sys.executable, "build-large", job, work, peers.SCRIPT)
    return model_dir


def quality_ids(model_dir: Path, tokens: int) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(load_text(None)).ids
    if len(ids) < tokens:
        raise SystemExit(f"the quality text has {len(ids)} tokens, fewer than --ppl-tokens {tokens}")
    return ids[:tokens]


def perplexities(args, model: str, model_dir: Path, sides: dict, ov_python: str, work: Path) -> dict[str, Any]:
    """Each int4 side's perplexity on the first ``--ppl-tokens`` ids of the quality text."""
    from kvforge.tools import perplexity as ppl

    ids = quality_ids(model_dir, args.ppl_tokens)
    plan = ppl.windows(len(ids), PPL_WINDOW)
    base = {"ids": ids, "windows": [(w.start, w.end, w.first) for w in plan], "threads": args.threads}
    base["perplexity_module"] = str(Path(ppl.__file__).resolve())
    out: dict[str, Any] = {}
    for label, (kind, path, hints) in sides.items():
        pg.say(f"{model}: perplexity of {label} ({len(plan)} windows of {PPL_WINDOW})")
        try:
            if kind == "kvforge":
                r = pg.run_worker(sys.executable, "kvforge-nll", {**base, "out": str(path)}, work, SCRIPT)
            else:
                job = {**base, "ov_dir": str(path), "hints": hints}
                r = pg.run_worker(ov_python, "openvino-nll", job, work, SCRIPT)
        except pg.StepFailed as e:
            out[label] = {"error": str(e)}
            continue
        out[label] = {**r, "perplexity": math.exp(r["nll_sum"] / r["scored"])}
    return {"tokens": len(ids), "window": PPL_WINDOW, "windows": len(plan), "rows": out}


def run_model(args, model: str, work: Path, ov_python: str, venv: Path) -> Iterator[dict[str, Any]]:
    """Every side of ``model`` at every prompt length and batch size: one report per prompt length,
    each yielded as soon as it is measured."""
    model_dir = ensure_model(model, work)
    precisions = args.precisions or peers.DEFAULT_PRECISIONS[model]  # the 1.39B shape: int4 only
    builds: dict[str, Any] = {}
    exports = {}
    for precision in precisions:
        out = work / f"openvino-{model}-{precision}"
        exports[precision], builds[f"openvino_export_{precision}_s"] = ensure_export(venv, model_dir, out, precision)
    probes = {}
    for precision, path in exports.items():
        job = {"ov_dir": str(path), "threads": args.threads, "hints": {}}
        probes[precision] = pg.run_worker(ov_python, "openvino-probe", job, work, SCRIPT)
    quality = None
    if args.ppl_tokens and "int4" in precisions and not (model_dir / "tokenizer.json").exists():
        # the random 1.39B shape has no tokenizer, and the perplexity of random weights says nothing
        quality = {"skipped": f"{model} has random weights and no tokenizer: perplexity measures nothing here"}
    elif args.ppl_tokens and "int4" in precisions:
        artifact = peers.ensure_kvforge_artifact(model_dir, work / f"kvforge-{model}-int4", "int4")
        sides = {
            "kvforge (int4)": ("kvforge", artifact, None),
            matched_label("int4"): ("openvino", exports["int4"], MATCHED),
            defaults_label("int4", probes["int4"]): ("openvino", exports["int4"], {}),
        }
        quality = perplexities(args, model, model_dir, sides, ov_python, work)
    for prompt_len in args.prompt_lens:
        max_seq = max_seq_for(prompt_len, args.new_tokens, args.max_seq)
        suffix = "" if max_seq == pg.DEFAULT_MAX_SEQ else f"-s{max_seq}"
        flags = () if max_seq == pg.DEFAULT_MAX_SEQ else ("--max-seq", str(max_seq))
        artifacts = {
            p: peers.ensure_kvforge_artifact(
                model_dir, work / f"kvforge-{model}-{p}{suffix}", None if p == "fp32" else p, flags
            )
            for p in precisions
        }
        uptime_before, load_before = peers.uptime(), pg.loadavg()
        pg.say(f"{model}, prompt {prompt_len}: {uptime_before}")
        tables = {}
        for batch in [b for b in args.batches if prompt_len <= args.long_prompt_batch_limit or b == 1]:
            if model == "smollm2":
                rows_in = peers.text_prompts(batch, prompt_len, model_dir)
            else:
                rows_in = pg.prompts(batch, prompt_len, peers.LARGE["vocab"])
            base = {"prompts": rows_in, "new_tokens": args.new_tokens, "repeat": args.repeat, "threads": args.threads}
            plan, meta = [], {}
            for precision in precisions:
                for prefill in kvforge_prefills(args.kvforge_prefill):
                    if prefill in ("int8", "fp32") and precision != "int4":
                        continue  # the int8 prefill rewrites int4 projections; an fp32 artifact has none
                    label = kvforge_label(precision, prefill)
                    kvforge_job = {**base, "out": str(artifacts[precision]), "prefill": prefill}
                    plan.append((label, sys.executable, "kvforge", kvforge_job, None))
                    meta[label] = {"precision": precision, "defaults": False, "prefill": prefill}
                ov_job = {**base, "ov_dir": str(exports[precision]), "kv_tokens": MAX_BATCH * max_seq}
                for label, hints, defaults in (
                    (matched_label(precision), MATCHED, False),
                    (defaults_label(precision, probes[precision]), {}, True),
                ):
                    if defaults and not args.ov_defaults:
                        continue
                    plan.append((label, ov_python, "openvino", {**ov_job, "hints": hints}, SCRIPT))
                    meta[label] = {"precision": precision, "defaults": defaults}
            per_round, rows = pg.run_rounds(plan, args.rounds, work)
            for label, *_ in plan:
                if label not in rows:
                    rows[label] = pg.combine_rounds(per_round[label])
                    rows[label]["decode_tokens_per_s"] = batch * 1e3 / rows[label]["decode_ms_step"]
                rows[label].update(meta[label])
            for label, r in rows.items():
                reference = f"kvforge ({r['precision']})"
                if "tokens" in r and label != reference and "tokens" in rows.get(reference, {}):
                    r["agreement_vs"] = reference
                    r["agreement"] = pg.agreement(r["tokens"], rows[reference]["tokens"])
                q = (quality or {}).get("rows", {}).get(label, {})
                r["perplexity"] = q.get("perplexity") if prompt_len == args.prompt_lens[0] else None
            tables[f"batch {batch}"] = rows
        yield {
            "model_name": model if prompt_len == 128 else f"{model}, prompt {prompt_len}",
            "model": str(model_dir),
            "prompt_len": prompt_len,
            "max_seq": max_seq,
            "kv_tokens": MAX_BATCH * max_seq,
            "probes": probes,
            "builds": builds,
            "quality": quality,
            "uptime_before": uptime_before,
            "uptime_after": peers.uptime(),
            "loadavg_before": load_before,
            "loadavg_after": pg.loadavg(),
            "tables": tables,
        }


def format_report(report: dict[str, Any]) -> str:
    env, cfg = report["env"], report["config"]
    lines = [
        f"{report['model_name']}: prompt {report['prompt_len']}, {cfg['new_tokens']} new tokens, threads "
        f"{cfg['threads']}, KV capacity {report['kv_tokens']} tokens every side ({MAX_BATCH} x {report['max_seq']}), "
        f"prefix caches off, {cfg['rounds']} rounds (medians); openvino {env['openvino']['openvino']}, "
        f"openvino-genai {env['openvino']['openvino-genai']}, optimum-intel {env['openvino']['optimum-intel']}; "
        f"commit {env['commit']}",
        f"uptime before: {report['uptime_before']}",
        f"uptime after:  {report['uptime_after']}",
    ]
    for name, rows in report["tables"].items():
        lines.append(f"\n{name}")
        lines.append(f"{'':58}{'TTFT ms':>9}{'ms/step':>9}{'peak RSS':>9}{'ppl':>8}  vs kvforge   greedy")
        for label, r in rows.items():
            if "error" in r:
                lines.append(f"{label:58}  failed: {r['error'].splitlines()[0]}")
                continue
            ours = rows.get(f"kvforge ({r['precision']})", {})
            ratio = ""
            if label != kvforge_label(r["precision"], "ort") and ours.get("ttft_ms"):
                ratio = f"x{r['ttft_ms'] / ours['ttft_ms']:.2f} x{r['decode_ms_step'] / ours['decode_ms_step']:.2f}"
            ppl_text = f"{r['perplexity']:8.2f}" if r.get("perplexity") else f"{'-':>8}"
            agree = f"{r['agreement']} vs {r['agreement_vs']}" if r.get("agreement") else ""
            lines.append(
                f"{label:58}{r['ttft_ms']:9.1f}{r['decode_ms_step']:9.2f}{r['rss_peak_bytes'] / 2**20:9.0f}"
                f"{ppl_text}  {ratio:12} {agree}"
            )
    lines.append("(vs kvforge: TTFT and ms/step over kvforge's of the same precision, < 1 faster than kvforge)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", choices=("smollm2", "large"), default=["smollm2"])
    p.add_argument(
        "--precisions",
        nargs="+",
        choices=("int4", "fp32"),
        default=None,
        help="kvforge's and OV's rows (default: int4 fp32 for smollm2, int4 for large, as peer_llamacpp.py)",
    )
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024], help="one report each")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="one table per batch size")
    p.add_argument(
        "--long-prompt-batch-limit",
        type=int,
        default=128,
        help="prompts longer than this run at batch 1 only (TTFT is what they measure)",
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-seq", type=int, default=pg.DEFAULT_MAX_SEQ, help="kvforge's max_seq for short prompts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--ppl-tokens", type=int, default=4096, help="quality-text ids scored per int4 side (0: skip)")
    p.add_argument(
        "--kvforge-prefill",
        nargs="+",
        choices=("ort", "int8", "fp32", "openvino", "openvino:bf16"),
        default=["ort"],
        help="kvforge rows at Engine.load(prefill=...); the 'ort' row (the default) is always run: the reference",
    )
    p.add_argument("--no-ov-defaults", dest="ov_defaults", action="store_false", help="leave OV's defaults rows out")
    p.add_argument("--ov-venv", type=Path, default=PEERS_CACHE / "openvino-venv")
    p.add_argument("--work-dir", type=Path, default=PEERS_CACHE / "work")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.job)
        return
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (one decode step)")
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    ov_python = ensure_ov_venv(args.ov_venv)
    env = {
        "cpu_count": os.cpu_count(),
        "openvino": installed_versions(Path(ov_python)),
        **{d: pg.version(d) for d in ("onnxruntime", "kvforge")},
        "commit": peers._commit(),
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("worker", "job")}
    reports = []
    for model in args.model:
        for report in run_model(args, model, work, ov_python, args.ov_venv):
            report = {"schema": "kvforge.peer_openvino", "config": config, "env": env, **report}
            reports.append(report)
            print(format_report(report), flush=True)
            if args.json:  # after every report: a later one may fail
                args.json.write_text(json.dumps(reports, indent=2))
                pg.say(f"wrote {args.json}")


if __name__ == "__main__":
    main()
