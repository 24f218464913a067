"""``ModelServer``: one engine and its in-flight scheduler, shared by every HTTP request.

The only place the server touches the runtime. A request becomes one or more scheduler requests
("sequences": ``n`` choices of each prompt); each sequence's handle is drained by a pump thread
(the scheduler's handles block) that posts its chunks and its final result to the request's
asyncio queue. The HTTP layer (:mod:`.completions`, :mod:`.chat`) only reads those events.

Admission. ``capacity = max_batch + max_queue`` sequences may be in flight (running in a cache row
or queued for one). A request that would exceed it gets 429; a draining server (SIGTERM) answers
503. A sequence counts until its pump has seen the scheduler finish it, so a cancelled one frees
its place when the scheduler has actually dropped it.

Cancellation. When the reader of a :class:`Flight`'s events goes away (client disconnect: the
ASGI task is cancelled, or the event iterator is closed), every unfinished handle is cancelled;
the scheduler frees the row at its next step.

Threads. The scheduler runs its own thread; pumps run in a pool of ``capacity`` threads (one per
admitted sequence, so a queued sequence never waits for a pump). Counters touched by the event
loop (``in_flight``) change on the loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kvforge.graphs import manifest as mf
from kvforge.runtime import Engine
from kvforge.runtime.chat import ChatTemplate
from kvforge.runtime.sampling import SamplingParams
from kvforge.tools.serve import parsers
from kvforge.tools.serve.metrics import ServeMetrics
from kvforge.tools.serve.parsers import ChatFormat
from kvforge.tools.serve.protocol import CompletionTokensDetails, PromptTokensDetails, UsageInfo

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's chat API allows
MIN_LOGPROB = -9999.0  # what an impossible token's logprob reads as in JSON (OpenAI's and vLLM's floor)
SSE_DONE = "data: [DONE]\n\n"


class ServingError(Exception):
    """A request the server refuses: becomes OpenAI's error object with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class SeqRequest:
    """One scheduler request: one choice of one prompt."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] | None
    cache_points: tuple[int, ...] = ()  # prompt positions worth a state snapshot (scheduler.submit)


@dataclass
class Event:
    """What a pump posts: ``kind`` "chunk" (payload: a stream chunk), "done" (payload: the
    GenerationResult) or "error" (payload: the exception); ``index`` is the sequence's position."""

    kind: str
    index: int
    payload: Any


class Flight:
    """The sequences of one HTTP request in the scheduler: their handles and the queue their pumps
    post to. Made by :meth:`ModelServer.start`; read with :meth:`events`; :meth:`cancel` cancels
    every sequence the scheduler has not finished (idempotent)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.handles: list[Any] = []
        self.finished: set[int] = set()
        self._peeked: list[Event] = []

    async def peek(self) -> Event:
        """The first event, without taking it (:meth:`events` yields it first)."""
        if not self._peeked:
            self._peeked.append(await self.queue.get())
        return self._peeked[0]

    async def events(self) -> AsyncIterator[Event]:
        """Every sequence's events as they come, until each is done or failed. Closing or cancelling
        the iterator early cancels what has not finished."""
        try:
            while len(self.finished) < self.count:
                event = self._peeked.pop() if self._peeked else await self.queue.get()
                if event.kind != "chunk":
                    self.finished.add(event.index)
                yield event
        finally:
            self.cancel()

    def cancel(self) -> None:
        for index, handle in enumerate(self.handles):
            if index not in self.finished:
                handle.cancel()


def sampling_params(
    *,
    temperature: float | None,
    top_p: float | None,
    presence_penalty: float,
    frequency_penalty: float,
    seed: int | None,
    logprobs: int | None,
    logit_bias: Mapping[str, float] | None,
    vocab_size: int,
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> SamplingParams:
    """The runtime's SamplingParams for OpenAI's fields (and vLLM's ``ignore_eos``, ``min_tokens``);
    invalid values -> ServingError 400 naming the field (the runtime's own message says what is
    accepted). ``logit_bias`` keys are token ids as JSON strings; an id outside ``[0, vocab_size)``
    is a 400 too."""
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ServingError(
            f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs", code="invalid_value"
        )
    values = dict(
        logit_bias=logit_bias,
        temperature=temperature,
        top_p=top_p,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        seed=seed,
        logprobs=logprobs,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )
    try:
        params = SamplingParams(**values)
    except ValueError as e:
        message = str(e)
        param = next((name for name in values if name in message), None)
        raise ServingError(message, param=param, code="invalid_value") from e
    outside = sorted(t for t in params.logit_bias or {} if t >= vocab_size)
    if outside:
        raise ServingError(
            f"logit_bias has token id {outside[0]} outside this model's vocabulary [0, {vocab_size}): use ids of "
            "the served model's tokenizer",
            param="logit_bias",
            code="invalid_value",
        )
    return params


def with_prediction(params: SamplingParams, draft: Sequence[int]) -> SamplingParams:
    """``params`` carrying ``draft`` (a tokenized predicted output) as ``SamplingParams.prediction``,
    the draft the speculative verify step checks first (unchanged when the draft is empty). A
    prediction changes speed only, never the output."""
    if not draft:
        return params
    try:
        return replace(params, prediction=list(draft))
    except ValueError as e:  # the runtime's own check of the draft
        raise ServingError(str(e), param="prediction", code="invalid_value") from e


def prediction_tokens(result: Any) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens of one GenerationResult (its request's
    ``SamplingParams.prediction`` drafted and verified)."""
    return result.prediction_accepted, result.prediction_rejected


def choices(
    req: Any,
    ids: list[int],
    max_tokens: int,
    base: SamplingParams,
    count: int | None = None,
    cache_points: tuple[int, ...] = (),
) -> list[SeqRequest]:
    """The ``req.n`` (or ``count``) choices of one prompt, each its own scheduler request with
    ``base``'s sampling and ``req.stop``; choice ``j`` of a seeded request uses ``seed + j``
    (reproducible, yet distinct)."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if base.min_tokens > max_tokens:
        raise ServingError(
            f"min_tokens={base.min_tokens} is more than max_tokens={max_tokens}: lower min_tokens to at most "
            "max_tokens, or raise max_tokens",
            param="min_tokens",
            code="invalid_value",
        )
    return [
        SeqRequest(
            ids, max_tokens, base if req.seed is None else replace(base, seed=req.seed + j), stop or None, cache_points
        )
        for j in range(req.n if count is None else count)
    ]


async def final_results(flight: Flight) -> dict[int, Any]:
    """Each sequence's GenerationResult from a flight's events, by sequence index (a failure -> 500)."""
    results = {}
    async with contextlib.aclosing(flight.events()) as events:
        async for event in events:
            raise_on_error(event)
            if event.kind == "done":
                results[event.index] = event.payload
    return results


def finite_logprob(value: float) -> float:
    """A logprob JSON can carry: ``-inf`` (or NaN) reads as :data:`MIN_LOGPROB`."""
    return value if math.isfinite(value) else MIN_LOGPROB


def possible_top(top: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The top alternatives that have a finite logprob (the runtime leaves out the tokens a
    grammar forbids; this keeps ``-inf`` out of JSON whatever produced it)."""
    return [(t, v) for t, v in top if math.isfinite(v)]


def running_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The usage so far of a streamed request (``stream_options.continuous_usage_stats``)."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def continuous_usage(req: Any) -> bool:
    """Whether every streamed chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def sse(body: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying a JSON body."""
    text = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return f"data: {text}\n\n"


def usage(prompt_tokens: int, results: Sequence[Any], cached_tokens: int = 0) -> UsageInfo:
    """OpenAI's usage for the finished ``results`` (GenerationResults) of one request; ``cached_tokens``:
    its prompt tokens taken from the prefix cache (:func:`cached_tokens`). With speculative decoding
    also ``speculative`` (a kvforge extension): ``drafted_tokens``, ``accepted_tokens``,
    ``acceptance_rate`` and ``tokens_per_target_call`` (decode tokens per engine call: each accepted
    draft saved one) over the request's results."""
    completion = sum(len(r.token_ids) for r in results)
    counts = [prediction_tokens(r) for r in results]
    extra = {}
    drafted = sum(r.drafted_tokens for r in results)
    if drafted:
        accepted = sum(r.accepted_tokens for r in results)
        decode = sum(max(len(r.token_ids) - 1, 0) for r in results)
        extra["speculative"] = {
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4),
            "tokens_per_target_call": round(decode / (decode - accepted), 4) if decode > accepted else None,
        }
    details = CompletionTokensDetails(
        accepted_prediction_tokens=sum(a for a, _ in counts), rejected_prediction_tokens=sum(r for _, r in counts)
    )
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        completion_tokens_details=details,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        **extra,
    )


def cached_tokens(results: dict[int, Any], n: int) -> int:
    """Prompt tokens a request took from the prefix cache: sequences ``i`` with the same ``i // n``
    are choices of one prompt, which counts once (its best choice), as ``prompt_tokens`` does."""
    best: dict[int, int] = {}
    for index, result in results.items():
        best[index // n] = max(best.get(index // n, 0), result.cached_tokens)
    return sum(best.values())


def raise_on_error(event: Event) -> None:
    """A pump's "error" event as a 500 ServingError (the runtime failed; the request cannot finish);
    a ServingError payload (a disaggregated worker refused the request: 400) is raised as it is."""
    if event.kind == "error":
        error = event.payload
        if isinstance(error, ServingError):
            raise error
        raise ServingError(
            f"generation failed: {type(error).__name__}: {error}", status=500, type="internal_error", code="internal"
        ) from error


class ModelServer:
    """An engine, its scheduler and the chat template of one artifact, served under one model name.

    Owns the engine (closed by :meth:`close`). Built once per process or per Ray Serve replica.
    """

    # Whether a request can be refused after :meth:`start` (its scheduler is in another process):
    # the app then holds a stream's 200 until the first event says it was not.
    late_refusals = False

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str | None = None,
        max_queue: int = 64,
        replica_id: str | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        if engine.tokenizer is None:
            raise ValueError(f"{engine.artifact_dir} has no tokenizer; the server needs one to take text prompts")
        if max_queue < 0:
            raise ValueError(f"--max-queue must be at least 0, got {max_queue}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name or Path(engine.artifact_dir).name
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}"
        self.max_seq = engine.max_seq
        # None: the model has no template, and /v1/chat/completions answers 400 saying so.
        self.chat_template = ChatTemplate.from_artifact(Path(engine.artifact_dir))
        # How the model writes tool calls and reasoning: the manifest's choice, or the overrides.
        self.chat_format = ChatFormat.choose(engine.manifest, tool_parser, reasoning_parser)
        self.scheduler = engine.scheduler()
        engine.grammars.warm()  # structured output's tokenizer, off the event loop (None without llguidance)
        self.capacity = self.scheduler.rows + max_queue  # sequences in flight: in a row or queued for one
        self.in_flight = 0  # sequences admitted and not yet finished by the scheduler (loop thread)
        self.live: set[Any] = set()  # RequestHandles submitted and not yet drained by their pump (loop thread)
        self.draining = False
        self.metrics = ServeMetrics(self)
        self._pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="kvforge-pump")
        self._closed = False

    @classmethod
    def load(
        cls,
        artifact_dir: str | Path,
        *,
        threads: int | None = None,
        model_name: str | None = None,
        max_queue: int = 64,
        replica_id: str | None = None,
        prefix_cache: int | str | None = None,
        speculative: object = None,
        draft: str | Path | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        prefill: str = "ort",
    ) -> ModelServer:
        """Load the artifact (``prefix_cache``: the engine's prefix-cache budget; ``speculative``,
        ``draft``: drafting; ``prefill``: where long prompts are prefilled; see ``Engine.load``) and
        serve it. Without ``speculative`` or
        ``draft`` (and with ``prefill="ort"``), an artifact with a verify graph (schema 2) is served with
        ``speculative="prediction"``: requests that send OpenAI's ``prediction`` have it verified as
        a draft, the others decode plainly through the same one session (an artifact whose layers
        keep a state too: verify keeps each row's state at its accepted tokens).
        ``tool_parser``, ``reasoning_parser``: override the manifest's parsers (:mod:`.parsers`;
        ``"none"``: no reasoning parsing)."""
        parsers.check_names(tool_parser, reasoning_parser)
        manifest = mf.read(artifact_dir, verify=False)
        if speculative is None and draft is None and "verify" in manifest.graphs and prefill == "ort":
            speculative = "prediction"  # (an OpenVINO prefill runs the prefill graph, not verify's)
        engine = Engine.load(
            artifact_dir,
            threads=threads,
            prefix_cache=prefix_cache,
            speculative=speculative,
            draft=draft,
            prefill=prefill,
        )
        try:
            return cls(
                engine,
                model_name=model_name,
                max_queue=max_queue,
                replica_id=replica_id,
                tool_parser=tool_parser,
                reasoning_parser=reasoning_parser,
            )
        except BaseException:
            engine.close()
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish what the scheduler holds, then release the pumps and the engine (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.close()
        self._pool.shutdown(wait=True)
        self.engine.close()

    # ------------------------------------------------------------------------------ scheduler state

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        """The prefix cache for ``/health``: hit rate (prompt tokens found / looked up), bytes in
        use and budget; None when it is off."""
        pool = self.engine.prefix_pool
        if pool is None:
            return None
        s = pool.stats()
        rate = None if s.hit_rate is None else round(s.hit_rate, 4)
        return {"hit_rate": rate, "queries": s.queries, "hits": s.hits, "bytes": s.bytes, "budget_bytes": s.budget}

    def scheduler_stats(self) -> tuple[int, int]:
        """(sequences waiting for a cache row, rows generating) among this server's live requests,
        from each handle's ``generation.state`` (the scheduler has no public counters)."""
        states = [handle.generation.state for handle in self.live]
        queued = states.count("waiting")
        return queued, len(states) - queued - states.count("done")

    # ------------------------------------------------------------------------------------- requests

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ServingError(
                f"model {model!r} does not exist; this server serves {self.model_name!r} (GET /v1/models lists it)",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special)

    def check_lengths(
        self, prompt_ids: Sequence[int], max_tokens: int | None, *, what: str = "the prompt", param: str = "prompt"
    ) -> int:
        """Validate one prompt against the artifact's limits; return the max_tokens to use (the rest of
        the row when None). ``what``/``param`` name the prompt in the error (e.g. "prompt 2")."""
        n = len(prompt_ids)
        if n == 0:
            raise ServingError(f"{what} is empty; send at least one token", param=param, code="invalid_value")
        # A cache row holds prompt + completion (prompts longer than the artifact's max_prompt are
        # prefilled in chunks by the scheduler); a prompt must leave room for one token.
        limit = self.max_seq - 1
        if n > limit:
            raise ServingError(
                f"{what} has {n} tokens; this model accepts at most {limit} prompt tokens (its context is "
                f"max_seq={self.max_seq} tokens, prompt + completion): shorten the prompt, or recompile the model "
                "with a larger --max-seq",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return self.max_seq - n
        if max_tokens < 1:
            raise ServingError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if n + max_tokens > self.max_seq:
            raise ServingError(
                f"this model's context is {self.max_seq} tokens; the request asks for {n + max_tokens} "
                f"({n} in the prompt + {max_tokens} max_tokens): lower max_tokens to at most {self.max_seq - n} "
                "or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def check_n(self, n: int, prompts: int = 1) -> None:
        if n < 1:
            raise ServingError(f"n must be at least 1, got {n}", param="n", code="invalid_value")
        if n * prompts > self.capacity:
            raise ServingError(
                f"the request needs {n * prompts} sequences (n={n} × {prompts} prompt(s)); this server holds at most "
                f"{self.capacity} at once (max_batch + --max-queue): lower n or send fewer prompts per request",
                param="n",
                code="invalid_value",
            )

    def admit(self, need: int) -> None:
        """Reserve ``need`` places, or refuse: 503 while draining, 429 when the queue is full."""
        if self.draining:
            raise ServingError(
                "the server is shutting down and takes no new requests; retry on another replica",
                status=503,
                type="service_unavailable",
                code="draining",
            )
        if self.in_flight + need > self.capacity:
            raise ServingError(
                f"the server is at capacity ({self.in_flight} sequences in flight, limit {self.capacity} = "
                "max_batch + --max-queue); retry later",
                status=429,
                type="rate_limit_error",
                code="queue_full",
            )
        self.in_flight += need

    def _release(self, count: int, handle: Any = None) -> None:
        self.in_flight -= count
        self.live.discard(handle)

    def start(self, sequences: Sequence[SeqRequest]) -> Flight:
        """Submit ``sequences`` (admitted by :meth:`admit`) to the scheduler and start their pumps.
        A submission the scheduler refuses (ValueError) cancels the ones before it: 400."""
        loop = asyncio.get_running_loop()
        flight = Flight(len(sequences))
        for index, seq in enumerate(sequences):
            try:
                points = {"cache_points": seq.cache_points} if seq.cache_points else {}
                handle = self.scheduler.submit(
                    seq.prompt_ids, max_new_tokens=seq.max_tokens, sampling=seq.sampling, stop=seq.stop, **points
                )
            except ValueError as e:
                flight.cancel()
                self._release(len(sequences) - index)  # never submitted: no pump will release them
                raise ServingError(str(e), code="invalid_value") from e
            flight.handles.append(handle)
            self.live.add(handle)
            self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
            self._pool.submit(self._pump, handle, index, loop, flight.queue, time.perf_counter())
        return flight

    def _pump(self, handle: Any, index: int, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, started: float):
        """Pool thread: drain one handle into the request's queue; record TTFT, TPOT and tokens."""

        def call(fn, *args) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                loop.call_soon_threadsafe(fn, *args)

        def post(event: Event) -> None:
            call(queue.put_nowait, event)

        first = None
        try:
            for chunk in handle:
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
                    self.metrics.ttft.observe(first - started)
                post(Event("chunk", index, chunk))
            result = handle.result()
            tokens = len(result.token_ids)
            self.metrics.generation_tokens.inc(tokens)
            self.metrics.cached_tokens.inc(result.cached_tokens)
            self.metrics.observe_speculative(result)
            self.metrics.finished.labels(reason=result.finish_reason).inc()
            if first is not None and tokens > 1:
                self.metrics.tpot.observe((time.perf_counter() - first) / (tokens - 1))
            post(Event("done", index, result))
        except Exception as e:  # reported to the request, which answers 500; the server stays up
            post(Event("error", index, e))
        finally:
            call(self._release, 1, handle)

    def check_scoring(self) -> None:
        """400 unless the artifact can compute prompt logprobs (it has a score graph)."""
        if "score" not in self.engine.manifest.graphs:
            raise ServingError(
                "prompt logprobs (echo with logprobs, prompt_logprobs) cannot be computed: this artifact has no "
                "score graph; recompile without --no-score-graph",
                param="logprobs",
                code="invalid_value",
            )

    async def score(self, prompts: Sequence[Sequence[int]], top: int) -> list[Any]:
        """Prompt token logprobs (:class:`kvforge.runtime.scoring.PromptScores`, one per prompt) from
        the scheduler's score turns (the score graph, in batches between decode steps). 400 for an
        artifact without a score graph; cancelled with the request (the prompts not yet scored are
        dropped); a runtime failure is a 500."""
        try:
            future = self.scheduler.score(prompts, top)
        except ValueError as e:
            raise ServingError(
                f"prompt logprobs (echo with logprobs, prompt_logprobs) cannot be computed: {e}",
                param="logprobs",
                code="invalid_value",
            ) from e
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
        try:
            return await asyncio.wrap_future(future)  # cancelling this await cancels the future
        except (asyncio.CancelledError, ServingError):
            raise
        except Exception as error:
            raise ServingError(
                f"scoring the prompt failed: {type(error).__name__}: {error}",
                status=500,
                type="internal_error",
                code="internal",
            ) from error

    # ------------------------------------------------------------------------------------ helpers

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
