"""``kvforge loadtest URL``: Poisson arrivals against any OpenAI-compatible endpoint.

Input: a server's base URL (kvforge's own or any other that speaks ``/v1/completions`` with
``stream: true``). Output: a result dict (printed as a report, ``--json``, ``--plot``) with
throughput, TTFT / TPOT / end-to-end latency percentiles, errors by status, and goodput.

Each request is a streamed completion (``stream_options.include_usage``, so token counts are the
server's own): a prompt of ``prompt_len`` words (drawn from ``prompt_lens``; the client does not
know the server's tokenizer, the server's ``usage.prompt_tokens`` is reported) and ``max_tokens``
drawn from ``output_lens``; greedy (``temperature: 0``). With ``shared_prefix`` > 0, every prompt
starts with the same ``shared_prefix`` words (a system prompt many users share: what a prefix
cache reuses), then its own words; the server's ``usage.prompt_tokens_details.cached_tokens`` is
recorded per request and summed. A mixed workload (long documents among short chats): with
``long_fraction`` F > 0, each request's prompt length is drawn from ``long_lens`` with probability F
(e.g. 1,000-1,500 words), else from ``prompt_lens``. Arrivals are a Poisson process of mean
``rate`` per second (exponential gaps, seeded): a request is sent at its arrival time whatever
the others are doing (open loop), unless ``concurrency`` caps the requests in flight. The schedule
(arrivals and lengths, :func:`schedule`) and the prompts' words come from two generators seeded
alike (the shared prefix is the first words drawn, as before the two were split), so
``kvforge plan --serve`` simulates exactly the schedule a load test with the same options sends
without drawing any words.

Definitions (per request, times from the moment it is sent):
- TTFT: until the first chunk carrying text; TPOT: ``(latency - TTFT) / (completion_tokens - 1)``
  (requests of 2+ tokens); latency: until ``data: [DONE]``.
- ok: status 200, a complete stream (``[DONE]``, a finish_reason, no error object).
- goodput: ok requests with TTFT <= ``slo_ttft_ms`` and TPOT <= ``slo_tpot_ms`` (a 1-token answer
  has no TPOT and meets that objective), per second of the run (first send to last answer).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Prompt words, drawn at random: plain English the bundled and test tokenizers know.
_TEXT = (
    "the for statement iterates over the items of any sequence a list is a mutable sequence exceptions are "
    "raised when an error occurs the while loop repeats while a condition holds functions are defined with def"
)
WORDS = tuple(_TEXT.split())


@dataclass(frozen=True)
class LoadOptions:
    rate: float = 4.0  # mean arrivals per second; math.inf: all at once
    requests: int = 32
    prompt_lens: tuple[int, ...] = (16, 32)  # words
    output_lens: tuple[int, ...] = (16, 32)  # max_tokens
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    concurrency: int | None = None  # cap on requests in flight; None: open loop
    model: str | None = None  # None: the first model of GET /v1/models
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 300.0
    shared_prefix: int = 0  # words every prompt starts with (a shared system prompt); 0: none
    long_fraction: float = 0.0  # share of requests whose prompt length is drawn from long_lens
    long_lens: tuple[int, ...] = (1000, 1500)  # words

    def check(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0 requests/s (inf: all at once), got {self.rate}")
        if self.requests < 1:
            raise ValueError(f"--requests must be at least 1, got {self.requests}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.shared_prefix < 0:
            raise ValueError(f"--shared-prefix must be >= 0 words, got {self.shared_prefix}")
        if not self.prompt_lens or not self.output_lens or min(self.prompt_lens) < 1 or min(self.output_lens) < 1:
            raise ValueError("--prompt-lens and --output-lens must be positive integers")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"--long-fraction must be in [0, 1] (the share of long prompts), got {self.long_fraction}")
        if self.long_fraction > 0 and (not self.long_lens or min(self.long_lens) < 1):
            raise ValueError("--long-lens must be positive integers when --long-fraction is above 0")
        for flag, value in (
            ("--timeout", self.timeout_s),
            ("--slo-ttft", self.slo_ttft_ms),
            ("--slo-tpot", self.slo_tpot_ms),
        ):
            if not 0 < value < float("inf"):
                raise ValueError(f"{flag} must be a positive number, got {value}")


def base_url(url: str) -> str:
    """``http://host:port`` from a URL given with or without ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def schedule(options: LoadOptions) -> list[dict[str, Any]]:
    """When each request is sent and how long it is: arrival offset (s), prompt words (the shared
    prefix not counted) and max_tokens, drawn from ``seed`` (no text: see :func:`plan`)."""
    rng = random.Random(options.seed)
    t, out = 0.0, []
    for i in range(options.requests):
        lens = options.prompt_lens
        if options.long_fraction > 0 and rng.random() < options.long_fraction:
            lens = options.long_lens
        words = rng.choice(lens)
        out.append({"index": i, "arrival_s": t, "prompt_words": words, "max_tokens": rng.choice(options.output_lens)})
        if not math.isinf(options.rate):
            t += rng.expovariate(options.rate)
    return out


def plan(options: LoadOptions) -> list[dict[str, Any]]:
    """The requests: :func:`schedule`'s items with their prompts, whose words are drawn from a
    second generator seeded with ``seed`` (the shared prefix first)."""
    rng = random.Random(options.seed)
    shared = [rng.choice(WORDS) for _ in range(options.shared_prefix)]
    out = schedule(options)
    for item in out:
        item["prompt"] = " ".join([*shared, *rng.choices(WORDS, k=item["prompt_words"])])
    return out


async def _one(client, url: str, model: str, item: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": item["prompt"],
        "max_tokens": item["max_tokens"],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record: dict[str, Any] = {k: item[k] for k in ("index", "arrival_s", "prompt_words", "max_tokens")}
    record.update(status=None, ok=False, ttft_s=None, latency_s=None, tpot_s=None)
    record.update(prompt_tokens=None, completion_tokens=None, cached_tokens=None, finish_reason=None, error=None)
    start = time.perf_counter()
    record["sent_s"] = start
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            record["status"] = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    record["error"] = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    record["error"] = text[:200]
                return record
            done, chunks = False, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    record["error"] = event["error"].get("message")
                    continue
                for choice in event.get("choices") or []:
                    if choice.get("text") and record["ttft_s"] is None:
                        record["ttft_s"] = time.perf_counter() - start
                    chunks += 1 if choice.get("text") else 0
                    record["finish_reason"] = choice.get("finish_reason") or record["finish_reason"]
                if event.get("usage"):
                    record["prompt_tokens"] = event["usage"]["prompt_tokens"]
                    record["completion_tokens"] = event["usage"]["completion_tokens"]
                    details = event["usage"].get("prompt_tokens_details") or {}
                    record["cached_tokens"] = details.get("cached_tokens")
            record["latency_s"] = time.perf_counter() - start
            if record["completion_tokens"] is None:  # a server without include_usage: count text chunks
                record["completion_tokens"] = chunks
            record["ok"] = done and record["error"] is None and record["finish_reason"] is not None
            n, ttft = record["completion_tokens"], record["ttft_s"]
            if record["ok"] and ttft is not None and n >= 2:
                record["tpot_s"] = (record["latency_s"] - ttft) / (n - 1)
    except Exception as e:  # connection refused, reset, timeout: counted, the run goes on
        record["status"] = type(e).__name__
        record["error"] = str(e) or type(e).__name__
    return record


async def _run(url: str, options: LoadOptions) -> tuple[list[dict[str, Any]], float, str]:
    import httpx

    headers = {"authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=options.timeout_s, limits=limits) as client:
        model = options.model
        if model is None:
            try:
                r = await client.get(url + "/v1/models", headers=headers)
            except httpx.TransportError as e:
                raise ValueError(f"cannot reach {url} ({type(e).__name__}: {e}); is the server up?") from e
            if r.status_code != 200:
                raise ValueError(f"GET {url}/v1/models answered {r.status_code}; pass --model (and --api-key?)")
            model = r.json()["data"][0]["id"]
        gate = asyncio.Semaphore(options.concurrency) if options.concurrency else None
        begin = time.perf_counter()

        async def arrive(item):
            await asyncio.sleep(max(0.0, item["arrival_s"] - (time.perf_counter() - begin)))
            if gate is None:
                return await _one(client, url, model, item, headers)
            async with gate:
                return await _one(client, url, model, item, headers)

        records = await asyncio.gather(*(arrive(item) for item in plan(options)))
        for rec in records:
            rec["sent_s"] -= begin
        end = max((r["sent_s"] + (r["latency_s"] or 0.0) for r in records), default=0.0)
        return list(records), end, model


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean())}


def summarize(records: list[dict[str, Any]], duration_s: float, options: LoadOptions) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in records:
        if not r["ok"]:
            key = str(r["status"]) if r["status"] != 200 else "incomplete"
            errors[key] = errors.get(key, 0) + 1
            examples.setdefault(key, r["error"] or "the stream ended without [DONE] or a finish_reason")
    for r in records:
        r["meets_slo"] = bool(
            r["ok"]
            and r["ttft_s"] is not None
            and r["ttft_s"] * 1000 <= options.slo_ttft_ms
            and (r["tpot_s"] is None or r["tpot_s"] * 1000 <= options.slo_tpot_ms)
        )
    good = sum(r["meets_slo"] for r in records)
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "error_examples": dict(sorted(examples.items())),  # the first message of each status
        "duration_s": duration_s,
        "throughput_rps": per_s(len(ok)),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),  # usage.prompt_tokens_details, where given
        "output_tokens_per_s": per_s(out_tokens),
        "ttft_ms": _percentiles([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "tpot_ms": _percentiles([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "latency_ms": _percentiles([r["latency_s"] for r in ok]),
        "meeting_slo": good,
        "goodput_rps": per_s(good),
    }


def run_loadtest(url: str, options: LoadOptions) -> dict[str, Any]:
    """Run the load and return the result document (docs/tools.md, ``kvforge loadtest``)."""
    options.check()
    url = base_url(url)
    records, duration, model = asyncio.run(_run(url, options))
    summary = summarize(records, duration, options)
    for r in records:
        r.pop("prompt", None)
    opts = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items() if k != "api_key"}
    return {
        "kind": "kvforge.loadtest",
        "schema_version": 1,
        "url": url,
        "model": model,
        "options": opts,
        "summary": summary,
        "requests": records,
    }


def format_report(result: dict[str, Any]) -> str:
    s, o = result["summary"], result["options"]

    def row(name: str, p: dict[str, float | None]) -> str:
        cells = [f"{p[k]:9.1f}" if p[k] is not None else "        -" for k in ("p50", "p90", "p99", "mean")]
        return f"  {name:<13}" + " ".join(cells)

    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    return "\n".join(
        [
            f"loadtest {result['url']} (model {result['model']}): {s['requests']} requests, Poisson rate "
            f"{o['rate']}/s"
            + (f", concurrency <= {o['concurrency']}" if o["concurrency"] else "")
            + (
                f", {o['long_fraction']:.0%} long prompts of {','.join(map(str, o['long_lens']))} words"
                if o.get("long_fraction")
                else ""
            ),
            f"  completed {s['completed']}, failed {s['failed']} ({errors}) in {s['duration_s']:.2f} s",
            f"  throughput    {s['throughput_rps']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tokens/s",
            f"  prompt tokens {s['prompt_tokens']}, of which cached by the server {s['cached_tokens']}"
            + (f" (shared prefix of {o['shared_prefix']} words)" if o.get("shared_prefix") else ""),
            "  ms                 p50       p90       p99      mean",
            row("TTFT", s["ttft_ms"]),
            row("TPOT", s["tpot_ms"]),
            row("latency", s["latency_ms"]),
            f"  goodput       {s['goodput_rps']:.2f} req/s ({s['meeting_slo']}/{s['requests']} meet TTFT <= "
            f"{o['slo_ttft_ms']:g} ms and TPOT <= {o['slo_tpot_ms']:g} ms)",
        ]
    )


def plot_loadtest(result: dict[str, Any], path: str | Path) -> Path:
    """TTFT and end-to-end latency of each request against its send time (failures marked)."""
    from kvforge.tools.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    reqs = result["requests"]
    ok = [r for r in reqs if r["ok"]]
    ax.scatter([r["sent_s"] for r in ok], [r["latency_s"] * 1000 for r in ok], s=10, label="latency")
    ax.scatter([r["sent_s"] for r in ok if r["ttft_s"]], [r["ttft_s"] * 1000 for r in ok if r["ttft_s"]], s=10,
               label="TTFT")  # fmt: skip
    failed = [r for r in reqs if not r["ok"]]
    if failed:
        ax.scatter([r["sent_s"] for r in failed], [0] * len(failed), marker="x", color="red", label="failed")
    ax.axhline(result["options"]["slo_ttft_ms"], linestyle="--", linewidth=0.8, color="gray", label="TTFT SLO")
    ax.set_xlabel("sent at (s)")
    ax.set_ylabel("ms")
    ax.set_title(f"loadtest {result['model']}: goodput {result['summary']['goodput_rps']:.2f} req/s")
    ax.legend()
    return save_figure(fig, path)
