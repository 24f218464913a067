"""Soak one ``kvforge serve`` process with random requests: valid, invalid, streamed, cancelled.

Compiles the bundled kvforge-tiny (or ``--model``, or serves ``--artifact``), starts one server,
and sends ``--requests`` requests (at most ``--concurrency`` at once, below the server's
capacity so no valid request is refused), each drawn at random (``--seed``):

* valid (completions, and chat when the model has a chat template; whole or streamed): random
  ``max_tokens``, ``temperature`` (0 or sampled), ``top_p``, ``seed``, ``n`` (1-2), ``stop``,
  ``logprobs``, penalties. Checked: 200, one choice per ``n`` each with a finish_reason, streams
  end with ``[DONE]``, ``usage`` adds up.
* invalid: malformed JSON, unknown model, unknown field, out-of-range values, a prompt longer
  than the model's context, too many ``max_tokens``. Checked: 400 with OpenAI's error object.
* cancelled: a stream the client closes after a few chunks. Checked afterwards: nothing stays in
  flight (``/health``: in_flight, queued and running all 0).

The server's RSS is sampled after a warm-up and at the end (and its maximum on the way): memory
must stay flat. The script exits 1 if any check fails or the server dies.

    python benchmarks/soak.py --requests 40                 # smoke test (~1 min)
    python benchmarks/soak.py --requests 2000 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

MODEL = "soak"
_TEXT = "the for statement iterates over the items of a list and a while loop repeats"
WORDS = tuple(_TEXT.split())


def _common():
    spec = importlib.util.spec_from_file_location("serve_common", Path(__file__).with_name("serve_common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def draw(rng: random.Random, max_seq: int, chat: bool) -> dict[str, Any]:
    """One random request: {"kind": valid|invalid|cancel, "path", "body" (dict or raw bytes), "stream"}."""
    kind = rng.choices(["valid", "invalid", "cancel"], weights=[6, 3, 1])[0]
    use_chat = chat and rng.random() < 0.4
    path = "/v1/chat/completions" if use_chat else "/v1/completions"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(1, 32)}
    if use_chat:
        body["messages"] = [{"role": "user", "content": prompt(rng, rng.randint(1, 20))}]
    else:
        body["prompt"] = prompt(rng, rng.randint(1, 20))
    if rng.random() < 0.5:
        body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.3:
        body["n"] = 2
    if rng.random() < 0.3:
        body["stop"] = rng.choice(["\n", " the", ["a", "list"]])
    if rng.random() < 0.2:
        if use_chat:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        body["presence_penalty"], body["frequency_penalty"] = rng.uniform(-1, 1), rng.uniform(-1, 1)
    stream = kind == "cancel" or rng.random() < 0.5
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if kind == "cancel":
        body["max_tokens"] = rng.randint(16, 64)
    if kind == "invalid":
        breakers = [
            lambda b: b.update(model="no-such-model"),
            lambda b: b.update(temperature=-1.0),
            lambda b: b.update(top_p=1.5),
            lambda b: b.update(n=0),
            lambda b: b.update(max_tokens=0),
            lambda b: b.update(max_tokens=max_seq + 1),
            lambda b: b.update(frobnicate=True),
            lambda b: b.update(presence_penalty=3.0),
            lambda b: b.update(stop=[""]),
            lambda b: b.update(prompt=prompt(rng, 2 * max_seq)) if "prompt" in b else b.update(messages=[]),
        ]
        if rng.random() < 0.1:
            return {"kind": kind, "path": path, "body": b'{"model": "soak", "prompt": ', "stream": False}
        rng.choice(breakers)(body)
    return {"kind": kind, "path": path, "body": body, "stream": stream}


def check_answer(req: dict[str, Any], status: int, events: list, whole: dict | None) -> str | None:
    """None if the answer is what the request deserves, else what is wrong."""
    body = req["body"]
    if req["kind"] == "invalid":
        if status != 400:
            return f"invalid request answered {status}, expected 400"
        error = (whole or {}).get("error", {})
        return None if {"message", "type", "param", "code"} <= set(error) else f"no error object: {whole}"
    if status != 200:
        return f"valid request answered {status}: {whole}"
    n = body.get("n", 1)
    if req["stream"]:
        if not events or events[-1] != "[DONE]":
            return "stream without data: [DONE]"
        chunks = [e for e in events[:-1] if isinstance(e, dict)]
        if any("error" in e for e in chunks):
            return f"error in stream: {chunks}"
        finished = {c["index"] for e in chunks for c in e.get("choices", []) if c.get("finish_reason")}
        if finished != set(range(n)):
            return f"choices finished: {sorted(finished)}, expected {n}"
        return None
    choices = whole.get("choices", [])
    if [c["index"] for c in choices] != list(range(n)) or not all(c.get("finish_reason") for c in choices):
        return f"choices {choices}"
    u = whole["usage"]
    if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"] or u["completion_tokens"] < n:
        return f"usage does not add up: {u}"
    return None


async def send(client: httpx.AsyncClient, url: str, req: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    body = req["body"]
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    start = time.perf_counter()
    try:
        if not req["stream"]:
            r = await client.post(url + req["path"], **kw)
            problem = check_answer(req, r.status_code, [], r.json())
            return {"kind": req["kind"], "status": r.status_code, "problem": problem, "s": time.perf_counter() - start}
        async with client.stream("POST", url + req["path"], **kw) as r:
            if r.status_code != 200:
                whole = json.loads(await r.aread())
                problem = check_answer(req, r.status_code, [], whole)
                return {"kind": req["kind"], "status": r.status_code, "problem": problem}
            events: list = []
            stop_after = rng.randint(1, 4) if req["kind"] == "cancel" else None
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if stop_after is not None and len(events) >= stop_after:
                        return {"kind": "cancel", "status": 200, "problem": None}  # closing: the client leaves
            return {"kind": req["kind"], "status": 200, "problem": check_answer(req, 200, events, None)}
    except Exception as e:
        return {"kind": req["kind"], "status": type(e).__name__, "problem": f"{type(e).__name__}: {e}"}


async def soak(url: str, requests: list[dict[str, Any]], concurrency: int, seed: int, on_progress) -> list[dict]:
    rng = random.Random(seed + 1)
    gate = asyncio.Semaphore(concurrency)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(req):
            async with gate:
                result = await send(client, url, req, rng)
            results.append(result)
            on_progress(len(results))

        await asyncio.gather(*(one(r) for r in requests))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", default=None, help="serve this artifact (default: compile --model)")
    p.add_argument("--model", default=None, help="HF model dir to compile (default: the bundled kvforge-tiny)")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-seq", type=int, default=128)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=int, default=50, help="requests before the first RSS sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    common = _common()
    rng = random.Random(args.seed)
    with common.artifact(args.artifact, args.model, args.max_batch, args.max_seq) as art:
        manifest = json.loads((Path(art) / "manifest.json").read_text())
        max_seq = manifest["limits"]["max_seq"]
        server = common.Server(art, ["--max-queue", str(max(64, 2 * args.concurrency))], MODEL)
        try:
            probe = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            has_chat = httpx.post(server.url + "/v1/chat/completions", json=probe).status_code == 200
            warm = [draw(rng, max_seq, has_chat) for _ in range(args.warmup)]
            asyncio.run(soak(server.url, warm, args.concurrency, args.seed, lambda n: None))
            rss = {"start_mb": common.rss_mb(server.proc.pid)}
            peak = [rss["start_mb"]]

            def progress(n: int) -> None:
                if n % 100 == 0:
                    peak.append(common.rss_mb(server.proc.pid))
                    print(f"[soak] {n}/{args.requests} RSS {peak[-1]:.1f} MiB", file=sys.stderr, flush=True)

            reqs = [draw(rng, max_seq, has_chat) for _ in range(args.requests)]
            begin = time.perf_counter()
            results = asyncio.run(soak(server.url, reqs, args.concurrency, args.seed, progress))
            elapsed = time.perf_counter() - begin
            time.sleep(0.5)  # cancelled rows are freed at the scheduler's next step
            health = httpx.get(server.url + "/health").json()
            rss["end_mb"] = common.rss_mb(server.proc.pid)
            rss["max_mb"] = max([*peak, rss["end_mb"]])
            alive = server.proc.poll() is None
        finally:
            exit_status = server.stop()
    kinds = Counter(r["kind"] for r in results)
    statuses = Counter(f"{r['kind']}:{r['status']}" for r in results)
    problems = [r["problem"] for r in results if r["problem"]]
    leftover = {k: health[k] for k in ("in_flight", "queued", "running")}
    ok = alive and not problems and not any(leftover.values()) and exit_status == 0
    report = {
        "requests": len(results),
        "kinds": dict(kinds),
        "statuses": dict(sorted(statuses.items())),
        "problems": len(problems),
        "problem_examples": problems[:10],
        "left_in_flight": leftover,
        "rss": rss,
        "server_alive_at_end": alive,
        "server_exit_status": exit_status,
        "elapsed_s": elapsed,
        "ok": ok,
    }
    print(
        f"soak: {len(results)} requests in {elapsed:.1f} s ({dict(kinds)}); problems: {len(problems)}; "
        f"left in flight: {leftover}; RSS start {rss['start_mb']:.1f} MiB, end {rss['end_mb']:.1f} MiB, "
        f"max {rss['max_mb']:.1f} MiB; server alive: {alive}, exit status after SIGTERM: {exit_status}"
    )
    print(f"  statuses: {dict(sorted(statuses.items()))}")
    for problem in problems[:10]:
        print(f"  problem: {problem}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
