"""Speculative decoding (issue 23): tokens/s with and without drafts, one run, alternating.

    .venv/bin/python benchmarks/speculative.py OUT [OUT_INT4 ...] --threads 2 --new-tokens 128 \
        [--batch 4] [--draft DRAFT_OUT] [--json results.json]
    .venv/bin/python benchmarks/speculative.py --truncate MODEL_DIR LAYERS DRAFT_HF_DIR   # a draft model

Per artifact: two engines loaded side by side (plain, and ``--speculative``, default ``ngram`` (K 8);
``--draft`` measures a draft-model pair), the same threads. Each prompt is a chat turn (the model's
template) run greedily by both, alternating over ``--rounds``; the tokens should be identical (the
script says where they differ otherwise). Reported per prompt: decode tokens/s (after the first token) of each side,
their ratio, the acceptance rate and tokens per target call (``(n - 1) / (n - 1 - accepted)``: each
accepted draft saves one call). Input-grounded prompts (summarize, extract, rewrite a ~400-token
passage; edit a code snippet) and open-ended prompts. ``--batch 4``: the prompts in groups of four
through one in-flight batch (``Engine.generate``), wall tokens/s. With ``--draft`` every timed
single-turn request starts from an empty draft cache (``DraftModel.forget``): a first request pays
the draft's prefill of its prompt, inside its decode time. ``--second-turn``: each
input-grounded chat's next turn (its plain answer, then ``FOLLOW_UP``), which a chat client sends
with the whole conversation: every round runs the first turn, then times the second, on both
sides (a draft model's row still holds the first turn's tokens then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from kvforge.runtime import Engine, SamplingParams

PASSAGE = (
    "The city of Aldmoor sits where two rivers meet, the Venn from the northern hills and the slower, "
    "wider Oss from the marshes in the west. For most of its history the city lived from the rivers: "
    "mills on the Venn ground grain from the valley farms, and barges on the Oss carried wool, salt and "
    "timber down to the coast. In 1842 the council approved a railway line along the Oss, and within "
    "twenty years the barge trade had almost vanished. The mills survived longer, because the railway "
    "brought more grain to grind, but the last of them closed in 1931 when an electric mill opened near "
    "the station. Today the old mill buildings hold a library, a school of music and forty apartments. "
    "The council's 2019 plan for the riverside set three goals: to reopen the towpath along the Oss as a "
    "walking and cycling route, to restore the Venn weir so that fish can pass it again, and to build "
    "no new housing within fifty metres of either river, because both flood every few winters. The "
    "towpath reopened in 2022 and is used by about three thousand people a day in summer. The weir work "
    "began in 2023 and is expected to finish in 2026, two years late, at a cost of 4.1 million pounds "
    "instead of the planned 2.6 million. Critics of the plan, led by the Riverside Traders Association, "
    "argue that the housing rule pushes young families out of the centre and that the money spent on "
    "the weir would have been better spent on the bus network, which has lost a third of its routes "
    "since 2010. Supporters answer that the floods of 2015 damaged more than two hundred homes near the "
    "rivers and that the towpath has brought new cafes and shops to streets that had been empty."
)
CODE = """def load_scores(path):
    scores = {}
    with open(path) as f:
        for line in f:
            name, score = line.strip().split(",")
            if name in scores:
                scores[name].append(int(score))
            else:
                scores[name] = [int(score)]
    result = []
    for name in scores:
        total = 0
        for s in scores[name]:
            total = total + s
        result.append((name, total / len(scores[name])))
    result.sort(key=lambda x: x[1], reverse=True)
    return result
"""
GROUNDED = {
    "summarize": f"Summarize the following text in a few sentences.\n\n{PASSAGE}",
    "extract": f"List every year and every amount of money mentioned in this text, each with what it refers "
    f"to, quoting the text.\n\n{PASSAGE}",
    "rewrite": f"Rewrite the following text in simpler English, keeping every fact.\n\n{PASSAGE}",
    "code-edit": f"Rename the function load_scores to read_average_scores and the variable result to "
    f"averages in this Python code. Return the whole code.\n\n```python\n{CODE}```",
}
FOLLOW_UP = "Now rewrite your answer once more, keeping every fact, for a ten-year-old."
OPEN = {
    "story": "Write a short story about a lighthouse keeper who finds a strange message in a bottle.",
    "ideas": "Give me some ideas for a weekend trip with children in autumn, and explain why each is fun.",
}


def _run(engine: Engine, prompt: list[int], new_tokens: int):
    t = time.perf_counter()
    [r] = engine.generate([prompt], max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0))
    return r, time.perf_counter() - t


def measure(artifact: str, args) -> list[dict]:
    spec_kw = {"speculative": args.speculative, "draft": args.draft}
    rows = []
    with (
        Engine.load(artifact, threads=args.threads) as plain,
        Engine.load(artifact, threads=args.threads, **spec_kw) as spec,
    ):
        prompts = {
            **{("grounded", k): v for k, v in GROUNDED.items()},
            **{("open", k): v for k, v in OPEN.items()},
        }
        ids = {k: plain.chat_prompt([{"role": "user", "content": v}]) for k, v in prompts.items()}
        for (kind, name), prompt in ids.items():
            if args.batch_only:
                break
            best, speeds = {}, {"plain": [], "spec": []}
            for _ in range(args.rounds):
                for side, engine in (("plain", plain), ("spec", spec)):
                    if engine.draft_model is not None:  # a first request: the draft cache holds no prompt
                        engine.draft_model.forget()
                    r, _ = _run(engine, prompt, args.new_tokens)
                    speeds[side].append(r.tokens_per_s or 0.0)
                    if side not in best or (r.tokens_per_s or 0) > (best[side].tokens_per_s or 0):
                        best[side] = r
            # Each round's two runs are next to each other in time: their ratio cancels most of the
            # machine's drift, so the rounds' ratios show how far the best-of ratio can be trusted
            round_ratios = [s / p if p else 0.0 for p, s in zip(speeds["plain"], speeds["spec"])]
            a, b = best["plain"], best["spec"]
            diverge = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            if diverge is None and len(a.token_ids) != len(b.token_ids):
                diverge = min(len(a.token_ids), len(b.token_ids))
            n = len(b.token_ids)
            calls = (n - 1) - b.accepted_tokens
            rows.append(
                dict(
                    artifact=artifact,
                    kind=kind,
                    prompt=name,
                    prompt_tokens=len(prompt),
                    new_tokens=n,
                    plain_tok_s=a.tokens_per_s,
                    spec_tok_s=b.tokens_per_s,
                    ratio=b.tokens_per_s / a.tokens_per_s,
                    acceptance=b.acceptance_rate,
                    tokens_per_call=(n - 1) / calls if calls else None,
                    identical=diverge is None,
                    first_difference=diverge,
                    round_ratios=round_ratios,
                )
            )
            r = rows[-1]
            print(
                f"{os.path.basename(artifact):8s} {kind:8s} {name:10s} p={len(prompt):4d} n={n:3d} "
                f"plain {r['plain_tok_s']:7.1f} tok/s  spec {r['spec_tok_s']:7.1f} tok/s  x{r['ratio']:.2f} "
                f"(rounds {min(round_ratios):.2f}-{max(round_ratios):.2f})  "
                f"accept {r['acceptance'] or 0:.2f}  tok/call {r['tokens_per_call'] or 1:.2f}  "
                f"{'identical' if diverge is None else f'DIFFERS from token {diverge}'}",
                flush=True,
            )
        _print_set_means(artifact, rows)
        if args.second_turn:
            rows += [_second_turn(plain, spec, artifact, name, text, args) for name, text in GROUNDED.items()]
        if args.batch > 1:
            group = [ids["grounded", k] for k in GROUNDED][: args.batch]
            sampling = SamplingParams(temperature=0)
            best = {}
            for _ in range(args.rounds):
                for side, engine in (("plain", plain), ("spec", spec)):
                    t = time.perf_counter()
                    res = engine.generate(group, max_new_tokens=args.new_tokens, sampling=sampling)
                    tok_s = sum(len(x.token_ids) for x in res) / (time.perf_counter() - t)
                    best[side] = max(best.get(side, (0, None)), (tok_s, res), key=lambda x: x[0])
            same = [x.token_ids for x in best["plain"][1]] == [x.token_ids for x in best["spec"][1]]
            ratio = best["spec"][0] / best["plain"][0]
            rows.append(
                dict(
                    artifact=artifact,
                    kind=f"batch{args.batch}",
                    plain_tok_s=best["plain"][0],
                    spec_tok_s=best["spec"][0],
                    ratio=ratio,
                    identical=same,
                )
            )
            print(
                f"{os.path.basename(artifact):8s} batch {args.batch} grounded (wall, prefill incl.): plain "
                f"{best['plain'][0]:.1f} tok/s  spec {best['spec'][0]:.1f} tok/s  x{ratio:.2f}  identical={same}"
            )
    return rows


def _print_set_means(artifact: str, rows: list[dict]) -> None:
    """Each prompt set's mean ratio: of the best-of-rounds runs, and of every round on its own (the
    spread says whether a goal such as x2 is met or within this machine's noise)."""
    for kind in ("grounded", "open"):
        own = [r for r in rows if r["artifact"] == artifact and r["kind"] == kind and r.get("round_ratios")]
        if not own:
            continue
        best = statistics.fmean(r["ratio"] for r in own)
        per_round = [statistics.fmean(ratios) for ratios in zip(*(r["round_ratios"] for r in own))]
        print(
            f"{os.path.basename(artifact):8s} {kind} mean: x{best:.2f} best-of-rounds; per round "
            f"{' '.join(f'x{m:.2f}' for m in per_round)} (median x{statistics.median(per_round):.2f})",
            flush=True,
        )


def _second_turn(plain: Engine, spec: Engine, artifact: str, name: str, text: str, args) -> dict:
    """The chat's next turn: the first turn's plain answer and FOLLOW_UP appended; per round each
    side runs the first turn, then the timed second; the best second turn of each side is kept."""
    first_messages = [{"role": "user", "content": text}]
    first = plain.chat_prompt(first_messages)
    answer, _ = _run(plain, first, args.new_tokens)
    messages = [
        *first_messages,
        {"role": "assistant", "content": plain.tokenizer.decode(answer.token_ids)},
        {"role": "user", "content": FOLLOW_UP},
    ]
    second = plain.chat_prompt(messages)
    best = {}
    for _ in range(args.rounds):
        for side, engine in (("plain", plain), ("spec", spec)):
            _run(engine, first, args.new_tokens)
            r, _ = _run(engine, second, args.new_tokens)
            if side not in best or (r.tokens_per_s or 0) > (best[side].tokens_per_s or 0):
                best[side] = r
    a, b = best["plain"], best["spec"]
    row = dict(
        artifact=artifact,
        kind="second-turn",
        prompt=name,
        prompt_tokens=len(second),
        new_tokens=len(b.token_ids),
        plain_tok_s=a.tokens_per_s,
        spec_tok_s=b.tokens_per_s,
        ratio=b.tokens_per_s / a.tokens_per_s,
        acceptance=b.acceptance_rate,
        identical=a.token_ids == b.token_ids,
    )
    print(
        f"{os.path.basename(artifact):8s} turn 2   {name:10s} p={len(second):4d} n={len(b.token_ids):3d} "
        f"plain {a.tokens_per_s:7.1f} tok/s  spec {b.tokens_per_s:7.1f} tok/s  x{row['ratio']:.2f}  "
        f"accept {b.acceptance_rate or 0:.2f}  {'identical' if row['identical'] else 'DIFFERS'}",
        flush=True,
    )
    return row


def truncate(model_dir: str, layers: int, out_dir: str) -> None:
    """A draft model for the pair measurement: ``model_dir``'s first ``layers`` decoder layers, its
    embeddings, final norm and head, and its tokenizer (a Llama-style HF directory with one
    model.safetensors). Compile it with kvforge compile like any model."""
    import shutil
    from pathlib import Path

    from safetensors.numpy import load_file, save_file

    src, dst = Path(model_dir), Path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            shutil.copy(f, dst / f.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="*")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--batch-only", action="store_true", help="with --batch: only the batch measurement")
    p.add_argument("--second-turn", action="store_true", help="also each grounded chat's next turn")
    p.add_argument("--speculative", default=None, help="default: ngram (K 8), or draft (K 4) with --draft")
    p.add_argument("--draft", default=None)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--truncate",
        nargs=3,
        metavar=("MODEL_DIR", "LAYERS", "OUT_DIR"),
        help="only write a draft model: MODEL_DIR's first LAYERS layers (then kvforge compile it)",
    )
    args = p.parse_args()
    if args.truncate:
        truncate(args.truncate[0], int(args.truncate[1]), args.truncate[2])
        return
    if args.speculative is None:
        args.speculative = "draft" if args.draft else "ngram"
    print(f"load: {os.getloadavg()}", flush=True)
    rows = [row for artifact in args.artifacts for row in measure(artifact, args)]
    print(f"load: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
