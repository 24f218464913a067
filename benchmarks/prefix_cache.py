"""The prefix cache off vs on, in one run: a resent chat, the cost of an import, many users.

Two ``kvforge serve`` processes on the same artifact with the same ``--threads``, one with
``--prefix-cache 0`` and one with the default cache, alive side by side; only one works at a time.

1. Conversation: the official ``openai`` client drives an 8-turn chat (a ~1,000-token system
   prompt of numbered rules, short user questions, greedy replies of ``--max-tokens``) through
   both servers, alternating which goes first each turn; the whole conversation is resent every
   turn, as every OpenAI-style client does. TTFT per turn (client side: request sent -> first
   content delta), the server's ``cached_tokens``, and whether both replies are identical.
2. Import cost, in this process: a ``--block-tokens`` KV block exported from a prefilled row and
   imported into another (``Engine.import_kv``: one strided copy), the same through the prefix
   pool's 16-token blocks, against the memcpy bandwidth of a contiguous buffer of the same size
   (``np.copyto``), medians of ``--repeat``.
3. Many users: ``kvforge loadtest``'s engine, ``--users`` requests at once (rate inf) that share a
   ``--shared-words``-word system prompt, after one warm-up request, against each server: TTFT
   p50/p99.

    python benchmarks/prefix_cache.py OUT --threads 2 --json prefix.json

The artifact: SmolLM2-135M-Instruct compiled with ``--max-seq 2048`` (``kvforge compile
~/.cache/kvforge/smollm2/hf -o OUT --max-seq 2048``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import openai

from kvforge.runtime import Engine
from kvforge.runtime.kv import PrefixPool
from kvforge.tools.loadtest import LoadOptions, run_loadtest

QUESTIONS = [
    "What does rule 3 ask of me?",
    "Summarise rules 1 to 5 in one sentence.",
    "Which rule is about lists?",
    "Give an example of a for loop.",
    "What is a tuple?",
    "How do I open a file?",
    "What is a dictionary comprehension?",
    "Thanks. Anything else I should know?",
]
TOPICS = [
    "lists", "tuples", "dictionaries", "sets", "strings", "functions", "classes", "modules", "exceptions",
    "generators", "decorators", "files", "loops", "comprehensions", "typing", "testing", "packaging",
    "iterators", "context managers", "recursion", "sorting", "slicing", "formatting", "closures",
]  # fmt: skip


def _common():
    spec = importlib.util.spec_from_file_location("serve_common", Path(__file__).with_name("serve_common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def system_prompt(tokenizer, target: int) -> str:
    """Numbered rules until the text has about ``target`` tokens."""
    rules, i = [], 0
    while len(tokenizer.encode(" ".join(rules), add_special_tokens=False)) < target:
        topic = TOPICS[i % len(TOPICS)]
        rules.append(
            f"Rule {i + 1}: when the user asks about {topic}, answer in plain English, give one short example, "
            f"and say which Python version introduced the feature if you know it."
        )
        i += 1
    return "You are a careful Python tutor. Follow these rules.\n" + "\n".join(rules)


def stream_turn(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[float, str, int, int]:
    """(TTFT s, reply text, prompt tokens, cached tokens) of one streamed greedy chat turn."""
    start, ttft, parts, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(
        model="bench",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                parts.append(choice.delta.content)
    details = usage.prompt_tokens_details
    return ttft, "".join(parts), usage.prompt_tokens, details.cached_tokens if details else 0


def conversation(clients: dict[str, openai.OpenAI], system: str, turns: int, max_tokens: int) -> list[dict]:
    """Both servers through the same conversation, alternating which goes first."""
    history = {name: [{"role": "system", "content": system}] for name in clients}
    rows = []
    for t in range(turns):
        order = list(clients) if t % 2 == 0 else list(reversed(clients))
        row = {"turn": t + 1}
        for name in order:
            history[name].append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            ttft, text, prompt, cached = stream_turn(clients[name], history[name], max_tokens)
            history[name].append({"role": "assistant", "content": text})
            row[name] = {"ttft_ms": ttft * 1e3, "prompt_tokens": prompt, "cached_tokens": cached, "reply": text}
        row["ratio_on_off"] = row["on"]["ttft_ms"] / row["off"]["ttft_ms"]
        row["same_reply"] = row["on"]["reply"] == row["off"]["reply"]
        rows.append(row)
        print(
            f"turn {t + 1}: prompt {row['off']['prompt_tokens']} tokens, TTFT off {row['off']['ttft_ms']:.0f} ms, "
            f"on {row['on']['ttft_ms']:.0f} ms ({row['on']['cached_tokens']} cached), ratio {row['ratio_on_off']:.3f}, "
            f"same reply: {row['same_reply']}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def import_cost(artifact: Path, threads: int, tokens: int, repeat: int) -> dict:
    """ms and GB/s of exporting/importing a ``tokens``-position block, through the pool too, and memcpy."""
    with Engine.load(artifact, threads=threads, prefix_cache=0) as engine:
        ids = [int(t) for t in np.random.default_rng(0).integers(100, engine.vocab_size, tokens)]
        engine.prefill_rows([ids], [0], first=0)

        def median_s(fn) -> float:
            fn()
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        block = engine.export_kv(0, ids)
        export_s = median_s(lambda: engine.export_kv(0, ids))
        import_s = median_s(lambda: engine.import_kv(block, 1))
        pool = PrefixPool(4 * block.nbytes)
        pool.offer(ids, lambda a, b: engine.export_kv(0, ids[a:b], start=a))

        def pool_import():
            hit = pool.acquire(ids)
            for b in hit.blocks:
                engine.import_kv(b, 1)
            pool.release(hit)

        pool_s = median_s(pool_import)
        src = np.ones(block.data.size, dtype=block.data.dtype)
        dst = np.empty_like(src)
        memcpy_s = median_s(lambda: np.copyto(dst, src))
    gb = block.nbytes / 1e9
    return {
        "tokens": tokens,
        "block_bytes": block.nbytes,
        "export_ms": export_s * 1e3,
        "import_ms": import_s * 1e3,
        "import_gb_per_s": gb / import_s,
        "export_gb_per_s": gb / export_s,
        "pool_import_ms": pool_s * 1e3,
        "pool_import_gb_per_s": gb / pool_s,
        "memcpy_ms": memcpy_s * 1e3,
        "memcpy_gb_per_s": gb / memcpy_s,
    }


def many_users(urls: dict[str, str], users: int, words: int, max_tokens: int, timeout_s: float, common) -> dict:
    out = {}
    for name, url in urls.items():
        load_before = common.load_average()
        # One request first (the shared words are drawn first from the seed: the same prefix).
        run_loadtest(url, LoadOptions(rate=float("inf"), requests=1, prompt_lens=(8,), shared_prefix=words))
        options = LoadOptions(
            rate=float("inf"),
            requests=users,
            prompt_lens=(12,),
            output_lens=(max_tokens,),
            shared_prefix=words,
            timeout_s=timeout_s,
        )
        s = run_loadtest(url, options)["summary"]
        out[name] = {
            "ttft_ms": s["ttft_ms"],
            "latency_ms": s["latency_ms"],
            "completed": s["completed"],
            "prompt_tokens": s["prompt_tokens"],
            "cached_tokens": s["cached_tokens"],
            "duration_s": s["duration_s"],
            "errors": s["errors"],
            "load_average_before": load_before,
            "load_average_after": common.load_average(),
        }
        print(
            f"{users} users [{name}]: TTFT p50 {s['ttft_ms']['p50']:.0f} ms, p99 {s['ttft_ms']['p99']:.0f} ms, "
            f"{s['completed']}/{users} completed, {s['cached_tokens']}/{s['prompt_tokens']} prompt tokens cached",
            file=sys.stderr,
            flush=True,
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", help="artifact directory (SmolLM2-135M-Instruct, --max-seq 2048)")
    ap.add_argument("--threads", type=int, default=2, help="ORT threads of each server (equal)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32, help="reply length per turn")
    ap.add_argument("--block-tokens", type=int, default=1000, help="block size of the import-cost figure")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--shared-words", type=int, default=800, help="shared system prompt of the users, words")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout of the users part, s")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: chat,import,users")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    common, art = _common(), Path(args.artifact)
    result: dict = {"artifact": str(art), "threads": args.threads, "load_average_before": common.load_average()}
    if "import" not in skip:
        result["import_cost"] = import_cost(art, args.threads, args.block_tokens, args.repeat)
        print(json.dumps(result["import_cost"], indent=1), file=sys.stderr, flush=True)
    threads = ["--threads", str(args.threads)]
    servers = {
        "off": common.Server(art, [*threads, "--prefix-cache", "0"], "bench"),
        "on": common.Server(art, threads, "bench"),
    }
    try:
        urls = {name: s.url for name, s in servers.items()}
        clients = {name: openai.OpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0) for name, u in urls.items()}
        if "chat" not in skip:
            with Engine.load(art, prefix_cache=0) as engine:
                system = system_prompt(engine.tokenizer, args.system_tokens)
            result["conversation"] = conversation(clients, system, args.turns, args.max_tokens)
        if "users" not in skip:
            result["many_users"] = many_users(urls, args.users, args.shared_words, 16, args.timeout, common)
    finally:
        for s in servers.values():
            s.stop()
    result["load_average_after"] = common.load_average()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    rows = result.get("conversation", [])
    for r in rows:
        print(
            f"| {r['turn']} | {r['off']['prompt_tokens']} | {r['off']['ttft_ms']:.0f} | {r['on']['ttft_ms']:.0f} | "
            f"{r['on']['cached_tokens']} | {r['ratio_on_off']:.3f} | {'yes' if r['same_reply'] else 'NO'} |"
        )
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
