"""OpenAI predicted outputs (issue 27): a code edit with the original code as ``prediction``.

    .venv/bin/python benchmarks/predicted_outputs.py OUT --threads 2 --rounds 3 [--json P]

``OUT``: a kvforge artifact of SmolLM2-135M-Instruct (``make smollm2``, then ``kvforge compile
~/.cache/kvforge/smollm2/hf -o OUT --max-seq 1024``: the ~300-token snippet and its edited copy do
not fit compile's default 512). One ``kvforge serve OUT --threads N`` (its defaults: prefix cache
on, ``speculative="prediction"``), driven by the official ``openai`` client, greedy, streamed. Per
round, alternating: the edit without a prediction, with the original code as the prediction (the
case OpenAI built predicted outputs for), with a mostly right prediction (the plain answer with
three line edits: a line left out, a line changed, a line added: what a prediction is when the
model makes the edit asked and little else; SmolLM2-135M rewrites more of the code than asked, so
the original code matches ~60% of its answer), and with an unrelated prediction. Reported per case:
decode tokens/s (completion tokens after the first, over the time from the first to the last
chunk), end-to-end seconds, accepted/rejected prediction tokens, and whether the text equals the
plain answer. The median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from openai import OpenAI

CODE = '''def load_scores(path):
    """Read "name,score" lines and return (name, mean score) pairs, best first."""
    scores = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, score = line.split(",")
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


def print_table(rows, width=20):
    """Print the pairs as a two-column table."""
    print("name".ljust(width) + "mean")
    for name, mean in rows:
        print(name.ljust(width) + f"{mean:.2f}")


if __name__ == "__main__":
    import sys

    print_table(load_scores(sys.argv[1]))
'''
INSTRUCTION = (
    "Rename the function load_scores to read_scores everywhere in this code and change nothing else. "
    "Reply with the whole code only.\n\n"
)
UNRELATED = "The weather in the mountains changes quickly; bring a coat, water and a map. " * 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(artifact: str, threads: int, port: int) -> subprocess.Popen:
    kvforge = Path(sys.executable).with_name("kvforge")
    cmd = [str(kvforge), "serve", artifact, "--port", str(port), "--threads", str(threads), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    for _ in range(600):
        try:
            client.models.list()
            return proc
        except Exception:
            if proc.poll() is not None:
                raise SystemExit(f"kvforge serve exited with {proc.returncode}") from None
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("kvforge serve did not answer in 300 s")


def one(client: OpenAI, model: str, max_tokens: int, prediction: str | None) -> dict:
    kw = dict(model=model, messages=[{"role": "user", "content": INSTRUCTION + CODE}], max_tokens=max_tokens)
    if prediction is not None:
        kw["prediction"] = {"type": "content", "content": prediction}
    start = time.perf_counter()
    first = None
    parts = []
    usage = None
    for chunk in client.chat.completions.create(
        **kw, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    n = usage.completion_tokens
    details = usage.completion_tokens_details
    return {
        "text": "".join(parts),
        "completion_tokens": n,
        "ttft_s": first - start,
        "total_s": end - start,
        "decode_tokens_per_s": (n - 1) / (end - first) if n > 1 and end > first else None,
        "accepted": details.accepted_prediction_tokens,
        "rejected": details.rejected_prediction_tokens,
    }


def mostly_right(text: str) -> str:
    """``text`` with three line edits: its 5th line left out, its 12th changed, a line added after
    its 20th (a prediction that is right but for a few lines)."""
    lines = text.split("\n")
    if len(lines) > 20:
        lines.insert(20, "    # checked")
        lines[12] = lines[12] + "  # note"
        del lines[5]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    port = free_port()
    load_before = os.getloadavg()
    proc = start_server(args.artifact, args.threads, port)
    cases = {
        "plain": None,
        "right prediction": CODE,
        "mostly right prediction": None,
        "unrelated prediction": UNRELATED,
    }
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        cases["mostly right prediction"] = mostly_right(one(client, model, args.max_tokens, None)["text"])
        # Warm-up, discarded: one whole request of each case (ORT's arena grows to the longest
        # context once; the first long request in a process ran ~2x slower here), and the prompt
        # in the prefix cache for every case.
        for prediction in cases.values():
            one(client, model, args.max_tokens, prediction)
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for case in order:
                runs[case].append(one(client, model, args.max_tokens, cases[case]))
                print(f"round {r + 1} {case}: {runs[case][-1]['decode_tokens_per_s']:.1f} tok/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    plain_text = runs["plain"][0]["text"]
    plain_rate = statistics.median(x["decode_tokens_per_s"] for x in runs["plain"])
    report = {"threads": args.threads, "load_before": load_before, "load_after": os.getloadavg(), "cases": {}}
    print(f"\nload {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print("\n| case | decode tok/s | vs plain | end-to-end s | accepted / rejected | text identical |")
    print("|---|---:|---:|---:|---|---|")
    for case, xs in runs.items():
        rate = statistics.median(x["decode_tokens_per_s"] for x in xs)
        row = {
            "decode_tokens_per_s": rate,
            "ratio": rate / plain_rate,
            "total_s": statistics.median(x["total_s"] for x in xs),
            "accepted": xs[0]["accepted"],
            "rejected": xs[0]["rejected"],
            "completion_tokens": xs[0]["completion_tokens"],
            "identical": all(x["text"] == plain_text for x in xs),
        }
        report["cases"][case] = row
        print(
            f"| {case} | {rate:.1f} | {row['ratio']:.2f} | {row['total_s']:.2f} | "
            f"{row['accepted']} / {row['rejected']} | {row['identical']} |"
        )
    print(f"load {load_before[0]:.1f} -> {report['load_after'][0]:.1f}; {args.threads} threads; greedy")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
