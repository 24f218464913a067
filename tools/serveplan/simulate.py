"""A discrete-event simulation of kvforge's servers under Poisson arrivals (DistServe's method).

Input: the requests (arrival time, prompt tokens, output tokens), a latency model of the two phases
(:class:`~kvforge.tools.serveplan.latency.PhaseModel`, one per worker's thread count) and a server
layout. Output: per request, when its first token and its last token came; :func:`summarize` turns
them into TTFT / TPOT percentiles, SLO attainment and goodput, as ``kvforge loadtest`` defines them.

Each worker replays :class:`~kvforge.runtime.batching.BatchLoop`'s step, with modelled durations
instead of engine calls:

- ``colocated`` (``kvforge serve``, one engine): a step is at most one prefill call (the queued
  prompts that fit whole into the free rows and one chunk, ``count × longest ≤ chunk``, as one
  ragged call; else the next chunk of one prompt), whose requests get their first token at its end,
  then one decode step over every decoding row (a request prefilled in this step included);
- ``prefill`` worker: the same prefill calls; after its first token a request's KV is exported
  (one copy of ``prompt × kv_bytes_per_token`` at the measured copy bandwidth, on this worker's
  time) and handed to the least-loaded decode worker; its row is free at once;
- ``decode`` worker: at a step's start it imports waiting hand-offs into free rows (one copy each),
  then runs one decode step over its rows.

A request arriving (or handed over) during a step waits for the next one, as in the scheduler's
thread; requests arriving at the same instant are queued together before a step starts. Routing
picks the worker with the fewest requests waiting or running (ties: the lowest index). Durations
are deterministic, so the same requests always give the same result.

Not modelled (stated in the planner's report): the HTTP front end's CPU time, contention for
memory bandwidth between workers on one machine, and per-message pipe latency beyond the copies.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvforge.tools.serveplan.latency import PhaseModel


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt: int  # tokens
    output: int  # tokens generated (max_tokens; the simulation never stops early)


@dataclass
class Outcome:
    """What happened to one request (seconds from the start of the run)."""

    request: Request
    first_s: float = math.nan  # its first token
    done_s: float = math.nan  # its last token

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """``(latency - TTFT) / (tokens - 1)``, as loadtest measures it; None for one token."""
        n = self.request.output
        return (self.done_s - self.first_s) / (n - 1) if n >= 2 else None


def poisson_requests(
    rate: float,
    count: int,
    prompt_lens: tuple[int, ...],
    output_lens: tuple[int, ...],
    seed: int = 0,
    long_fraction: float = 0.0,
    long_lens: tuple[int, ...] = (),
) -> list[Request]:
    """``count`` requests with exponential gaps of mean ``1/rate``; each prompt from ``long_lens``
    with probability ``long_fraction``, else from ``prompt_lens``, and its output from
    ``output_lens`` (uniform choices). The same draws, in the same order, as ``kvforge loadtest``'s
    schedule with the same seed and options, so a prediction and a load test see the same requests
    (lengths in tokens here, words there)."""
    from kvforge.tools.loadtest import LoadOptions, schedule

    options = LoadOptions(
        rate=rate,
        requests=count,
        prompt_lens=prompt_lens,
        output_lens=output_lens,
        seed=seed,
        long_fraction=long_fraction,
        long_lens=long_lens,
    )
    options.check()
    return [Request(p["arrival_s"], p["prompt_words"], p["max_tokens"]) for p in schedule(options)]


def constant_gaps(rate: float, count: int, prompt: int, output: int, seed: int = 0) -> list[Request]:
    """Poisson arrivals of identical requests (the M/D/1 check's workload)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(Request(t, prompt, output))
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------- workers


@dataclass
class _Live:
    outcome: Outcome
    context: int = 0  # cache positions written
    prefilled: int = 0  # prompt tokens prefilled
    made: int = 0  # tokens generated

    @property
    def remaining_prompt(self) -> int:
        return self.outcome.request.prompt - self.prefilled


@dataclass
class _Worker:
    role: str  # "colocated" | "prefill" | "decode"
    model: PhaseModel
    rows: int
    chunk: int
    kv_bytes_per_token: float
    copy_bytes_per_s: float
    waiting: deque = field(default_factory=deque)
    decoding: list = field(default_factory=list)
    filling: _Live | None = None
    busy: bool = False

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.decoding) + (self.filling is not None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.decoding or self.filling)

    def _copy_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.copy_bytes_per_s

    def step(self, t: float, handoffs: list[tuple[float, _Live]]) -> float:
        """Run one step from ``t``; returns its end. A prefill worker appends its hand-offs
        ``(time, request)`` to ``handoffs``."""
        if self.role == "decode":
            while self.waiting and len(self.decoding) < self.rows:
                live = self.waiting.popleft()
                t += self._copy_s(live.context)  # import_kv: one copy into the cache row
                self.decoding.append(live)
        else:
            t = self._prefill(t, handoffs)
        if self.decoding and self.role != "prefill":
            t += self.model.decode_s(len(self.decoding), sum(g.context for g in self.decoding))
            for g in self.decoding:
                g.context += 1
                self._token(g, t)
            self.decoding = [g for g in self.decoding if g.made < g.outcome.request.output]
        return t

    def _token(self, g: _Live, t: float) -> None:
        g.made += 1
        if g.made == 1:
            g.outcome.first_s = t
        if g.made == g.outcome.request.output:
            g.outcome.done_s = t

    def _prefill(self, t: float, handoffs: list[tuple[float, _Live]]) -> float:
        if self.filling is None:
            free = self.rows - len(self.decoding)
            group: list[_Live] = []
            longest = 0
            while self.waiting and len(group) < free:
                need = self.waiting[0].remaining_prompt
                if max(longest, need) * (len(group) + 1) > self.chunk:
                    break
                longest = max(longest, need)
                group.append(self.waiting.popleft())
            if group:
                t += self.model.prefill_s(len(group), longest, 0)
                for g in group:
                    g.prefilled = g.context = g.outcome.request.prompt
                return self._first_tokens(t, group, handoffs)
            if self.waiting and len(self.decoding) < self.rows:
                self.filling = self.waiting.popleft()
        if self.filling is None:
            return t
        g = self.filling
        piece = min(self.chunk, g.remaining_prompt)
        t += self.model.prefill_s(1, piece, g.prefilled)
        g.prefilled += piece
        g.context = g.prefilled
        if g.remaining_prompt:
            return t
        self.filling = None
        return self._first_tokens(t, [g], handoffs)

    def _first_tokens(self, t: float, group: list[_Live], handoffs: list[tuple[float, _Live]]) -> float:
        for g in group:
            self._token(g, t)
        going = [g for g in group if g.made < g.outcome.request.output]
        if self.role != "prefill":
            self.decoding.extend(going)
            return t
        for g in going:  # export_kv into shared memory, then the decode side takes it
            t += self._copy_s(g.context)
            handoffs.append((t, g))
        return t


# ---------------------------------------------------------------- the run


@dataclass(frozen=True)
class Layout:
    """A server: one colocated engine, or ``prefill`` + ``decode`` workers."""

    kind: str  # "colocated" | "disaggregated"
    threads: int  # per engine (per worker)
    prefill: int = 0
    decode: int = 0

    @property
    def cores(self) -> int:
        return self.threads if self.kind == "colocated" else (self.prefill + self.decode) * self.threads

    @property
    def name(self) -> str:
        if self.kind == "colocated":
            return f"colocated ({self.threads} threads)"
        return f"{self.prefill}P:{self.decode}D ({self.threads} thread{'s' * (self.threads > 1)} each)"


def simulate(
    requests: list[Request],
    layout: Layout,
    model: PhaseModel,
    rows: int,
    chunk: int,
    kv_bytes_per_token: float = 0.0,
    copy_bytes_per_s: float = math.inf,
) -> list[Outcome]:
    """Run ``requests`` through ``layout`` (every engine with ``model``'s latencies, ``rows`` cache
    rows and prefill chunks of ``chunk`` tokens); the outcomes in the requests' order."""
    if rows < 1 or chunk < 1:
        raise ValueError(f"a worker needs at least one row and a chunk of at least one token, got {rows}, {chunk}")

    def worker(role: str) -> _Worker:
        return _Worker(role, model, rows, chunk, kv_bytes_per_token, copy_bytes_per_s)

    if layout.kind == "colocated":
        front, back = [worker("colocated")], []
    else:
        front = [worker("prefill") for _ in range(layout.prefill)]
        back = [worker("decode") for _ in range(layout.decode)]
    workers = front + back
    outcomes = [Outcome(r) for r in requests]
    events: list[tuple[float, int, str, Any]] = []  # (time, order, kind, payload)
    order = 0

    def push(time: float, kind: str, payload: Any) -> None:
        nonlocal order
        heapq.heappush(events, (time, order, kind, payload))
        order += 1

    def start(index: int, t: float) -> None:
        w = workers[index]
        if w.busy or not w.has_work:
            return
        w.busy = True
        handoffs: list[tuple[float, _Live]] = []
        end = w.step(t, handoffs)
        for when, live in handoffs:
            push(when, "handoff", live)
        push(end, "step_end", index)

    def least_loaded(pool: list[_Worker], offset: int) -> int:
        return offset + min(range(len(pool)), key=lambda i: pool[i].load)

    for out in outcomes:
        push(out.request.arrival_s, "arrive", out)
    while events:
        t, touched = events[0][0], set()
        while events and events[0][0] == t:  # everything at this instant, then the steps it starts
            _, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                index = least_loaded(front, 0)
                workers[index].waiting.append(_Live(payload))
            elif kind == "handoff":
                index = least_loaded(back, len(front))
                workers[index].waiting.append(payload)
            else:
                index = payload
                workers[index].busy = False
            touched.add(index)
        for index in sorted(touched):
            start(index, t)
    return outcomes


# ---------------------------------------------------------------- figures


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean())}


def summarize(outcomes: list[Outcome], slo_ttft_ms: float, slo_tpot_ms: float) -> dict[str, Any]:
    """TTFT / TPOT percentiles (ms), SLO attainment (share of requests meeting both objectives; a
    one-token answer has no TPOT and meets that one) and goodput (those requests per second of the
    run, first arrival to last token), as ``kvforge loadtest`` reports them."""
    if not outcomes:
        raise ValueError("no requests to summarize")
    good = sum(o.ttft_s * 1e3 <= slo_ttft_ms and (o.tpot_s is None or o.tpot_s * 1e3 <= slo_tpot_ms) for o in outcomes)
    begin = min(o.request.arrival_s for o in outcomes)
    duration = max(o.done_s for o in outcomes) - begin
    return {
        "requests": len(outcomes),
        "duration_s": duration,
        "ttft_ms": _percentiles([o.ttft_s for o in outcomes]),
        "tpot_ms": _percentiles([o.tpot_s for o in outcomes if o.tpot_s is not None]),
        "meeting_slo": good,
        "attainment": good / len(outcomes),
        "goodput_rps": good / duration if duration > 0 else 0.0,
        "throughput_rps": len(outcomes) / duration if duration > 0 else 0.0,
    }
