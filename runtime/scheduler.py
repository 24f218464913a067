"""In-flight batching on a background thread: ``sched.submit(...)`` from any thread, results as handles.

    with engine.scheduler() as sched:
        handles = [sched.submit(p, max_new_tokens=64) for p in prompts]   # thread-safe
        for chunk in handles[0]:                                          # streams
            print(chunk.text, end="")
        results = [h.result() for h in handles]

The scheduler holds the engine's rows ``[0, k)`` (the rows no session holds) from construction to
:meth:`Scheduler.close`; the engine's ``generate``/``stream``/step API refuse meanwhile. Its thread
runs a :class:`~kvforge.runtime.batching.BatchLoop`: between decode steps it admits queued requests
into free rows (chunked prefill, one chunk per step), and retires finished or cancelled rows at
once, so a stream of requests keeps the batch full. Each step holds the engine's lock, so sessions
on other rows interleave with it step by step.

Disaggregated prefill/decode (:mod:`kvforge.runtime.kv.handoff`). ``submit(..., hand_off=True)``
on a prefill worker's scheduler runs the prompt and the first token here; unless that token ends
the request (eos, a stop string, ``max_new_tokens=1``), the request ends with finish_reason
``"handoff"``: its one chunk (the first token, finish_reason ``"handoff"``) is streamed from the
handle and ``handle.result().handoff`` is a :class:`~kvforge.runtime.kv.handoff.Handoff` whose KV
was exported into memory from ``block_alloc`` (``Scheduler(engine, block_alloc=...)``; e.g.
:class:`kvforge.runtime.kv.shm.SegmentAllocator`), the row freed at once. ``resume(handoff)`` on
a decode worker's scheduler (another engine of the same artifact) imports the block into a free
row and continues the request in the batch: its chunks start after the first token, its result
is the whole request's as the colocated scheduler would give it (first token, all logprobs; the
timing is this side's: ``first_token`` is when the KV was imported).

Lent rows (``Scheduler(engine, lend_rows=True)`` on an engine loaded with ``kv_shared=True``):
a hand-off is not copied out of the cache; its block's data is a read-only view of the row,
hashed in place, and the row stays out of use until the hand-off is released (imported by a
taker: ``resume`` in this process, or :func:`kvforge.runtime.kv.shm.take` of
``engine.cache.segment.put(handoff)`` in another; or discarded; a hand-off dropped otherwise must
be released: ``handoff.release()``). While every row is lent, new
requests wait (back-pressure); :meth:`close` with requests still waiting for a row waits for
the takers too (``cancel=True`` does not).

Prompt scoring (:mod:`kvforge.runtime.scoring`). ``score(prompts, top)`` returns a future of
each prompt's token logprobs (the score graph's logits of every position); the scheduler thread
scores queued prompts between the batch loop's steps, in the rows no request uses, one score call
per turn.

Errors. ``submit`` validates everything it can (``max_new_tokens``, sampling parameters, stop
strings, prompt length and token ids) and raises ValueError there; a request that fails later
fails alone: its handle raises the error, the other requests go on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvforge.runtime import scoring, validate
from kvforge.runtime.batching import BatchLoop
from kvforge.runtime.generation import Generation, GenerationResult, StreamChunk

if TYPE_CHECKING:
    from kvforge.runtime.kv.handoff import Handoff
    from kvforge.runtime.requests import Engine, Prompt
    from kvforge.runtime.sampling import SamplingParams


LENT_POLL_S = 0.001  # how often a lending scheduler whose rows are all lent looks for a freed one


class RequestHandle:
    """One submitted request. ``result()`` waits for it; iterating yields its chunks as they are
    produced (once: the chunks are consumed); ``cancel()`` frees its row at the scheduler's next
    step (the result then has ``finish_reason="cancelled"`` and the tokens made so far)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._chunks: queue.SimpleQueue[StreamChunk | None] = queue.SimpleQueue()
        self.generation: Generation  # set by Scheduler.submit

    def _sink(self, chunk: StreamChunk | None) -> None:
        self._chunks.put(chunk)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The :class:`GenerationResult` (with ``timing``); raises the request's error if it
        failed, TimeoutError if it is not done after ``timeout`` seconds."""
        if not self.generation.wait(timeout):
            raise TimeoutError(f"the request is not finished after {timeout} s")
        return self.generation.result()

    def __iter__(self) -> Iterator[StreamChunk]:
        while True:
            chunk = self._chunks.get()
            if chunk is None:  # failed: result() raises its error
                self.generation.result()
                return
            yield chunk
            if chunk.finish_reason is not None:
                return

    def cancel(self) -> None:
        self.generation.cancel()
        self._scheduler._wake()

    @property
    def done(self) -> bool:
        return self.generation.done


class Scheduler:
    """See the module docstring. Create it with ``Engine.scheduler()``."""

    def __init__(
        self,
        engine: Engine,
        prefill_chunk: int | None = None,
        block_alloc: Callable[[int], object] | None = None,
        lend_rows: bool = False,
    ) -> None:
        """``block_alloc``: ``nbytes -> writable buffer`` a hand-off's KV is exported into (default:
        a new numpy array per hand-off). ``lend_rows``: hand-offs lend their cache rows instead
        (the engine loaded with ``kv_shared=True``; module docstring)."""
        self.engine = engine
        prefill_chunk = validate.optional_count("prefill_chunk", prefill_chunk)  # before the rows are taken
        lender = getattr(engine.cache, "segment", None) if lend_rows else None
        if lend_rows and (lender is None or block_alloc is not None):
            raise ValueError(
                "lend_rows=True lends hand-offs' rows of a cache in shared memory: load the engine with "
                "Engine.load(..., kv_shared=True), and give no block_alloc (nothing is exported by copy)"
                if lender is None
                else "lend_rows=True and block_alloc are exclusive: a lent hand-off is not exported by copy"
            )
        self._rows = engine.own_rows(self)
        rows = self._rows.__enter__()  # released in close()
        try:
            self._loop = BatchLoop(engine, rows, chunk=prefill_chunk, block_alloc=block_alloc, lender=lender)
        except BaseException:
            self._rows.__exit__(None, None, None)
            raise
        self._cond = threading.Condition()
        self._incoming: list[Generation] = []
        self._scoring: deque[scoring.ScoreJob] = deque()  # prompt scoring, first in first out
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvforge-scheduler", daemon=True)
        self._thread.start()

    @property
    def rows(self) -> int:
        """Cache rows the scheduler runs requests on (the batch's maximum)."""
        return self._loop.rows

    def submit(
        self,
        prompt: Prompt,
        max_new_tokens: int = 32,
        sampling: SamplingParams | Mapping | None = None,
        stop: str | Sequence[str] | None = None,
        hand_off: bool = False,
        cache_points: Sequence[int] = (),
    ) -> RequestHandle:
        """Queue one request (thread-safe); returns its :class:`RequestHandle` at once. Raises
        ValueError for bad parameters or prompts, RuntimeError after :meth:`close`. ``hand_off``:
        stop after the first token with a hand-off for a decode worker (module docstring).
        ``cache_points``: prompt positions worth a state snapshot in the prefix cache (on an
        artifact whose layers keep a state; e.g. the end of a shared system prompt): the prefill
        stops there once to leave one, so later prompts sharing that much resume from it."""
        gen = self.engine.request(self.engine.encode(prompt), max_new_tokens, sampling, stop)
        gen.hand_off = bool(hand_off)
        gen.cache_points = validate.cache_points(cache_points, len(gen.prompt_ids))
        return self._queue(gen)

    def resume(self, handoff: Handoff) -> RequestHandle:
        """Continue a request handed off by another engine of the same artifact (thread-safe; see
        the module docstring). Raises KVBlockError for a block of another artifact (or too long
        for a row), ValueError for parameters this engine refuses, before anything is imported;
        the hand-off is released then (``Handoff.release``: a shared-memory slot is freed)."""
        try:
            self.engine.check_kv(handoff.block)
            gen = self.engine.request(handoff.prompt_ids, handoff.max_new_tokens, handoff.sampling, handoff.stop)
            gen.replay_first(handoff)
            return self._queue(gen)
        except BaseException:
            handoff.release()  # refused: its memory (a shared-memory slot) is freed
            raise

    def score(self, prompts: Sequence[Sequence[int]], top: int = 0) -> Future[list[scoring.PromptScores]]:
        """Queue token-id prompts for scoring (thread-safe); the future gets one
        :class:`~kvforge.runtime.scoring.PromptScores` per prompt (``top``: alternatives per
        position, 0..20). Cancelling the future drops the prompts not yet scored. Raises
        ValueError for bad prompts, an artifact without a score graph or a lending scheduler,
        RuntimeError after :meth:`close`."""
        if "score" not in self.engine.manifest.graphs:
            raise ValueError("this artifact has no score graph; recompile without --no-score-graph")
        if self._loop.lender is not None:
            raise ValueError("a lending scheduler (lend_rows=True) does not score prompts: its free rows may be lent")
        prompts, top = scoring.check_prompts(prompts, top, self.engine.vocab_size, self.engine.max_seq)
        job = scoring.ScoreJob(prompts, top)
        with self._cond:
            if self._closing:
                raise RuntimeError("the scheduler is closed; create a new one with engine.scheduler()")
            self._scoring.append(job)
            self._cond.notify()
        return job.future

    def _score_turn(self) -> None:
        """One score call for the oldest job, in the rows above the loop's active ones (none free:
        after the next step). Under the engine's lock, on the scheduler thread."""
        job = self._scoring[0]
        loop = self._loop
        first = loop.first + loop.active
        free = loop.lo + loop.rows - first
        if job.future.cancelled():
            self._scoring.popleft()
            return
        if free < 1:
            return
        try:
            scoring.score_next(self.engine, job, first, free, loop.chunk)
        except Exception as error:  # this job fails alone
            self._scoring.popleft()
            job.finish(error)
            return
        if job.done == len(job.prompts):
            self._scoring.popleft()
            job.finish()

    def _queue(self, gen: Generation) -> RequestHandle:
        handle = RequestHandle(self)
        gen.sink = handle._sink
        handle.generation = gen
        with self._cond:
            if self._closing:
                raise RuntimeError("the scheduler is closed; create a new one with engine.scheduler()")
            self._incoming.append(gen)
            self._cond.notify()
        return handle

    def close(self, cancel: bool = False) -> None:
        """Stop taking requests, finish the submitted ones (or cancel them with ``cancel=True``),
        join the thread and give the rows back to the engine. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            if cancel:
                for gen in self._incoming:
                    gen.cancel()
                for gen in [*self._loop.waiting, *self._loop.resuming, *self._loop.decoding, self._loop.filling]:
                    if gen is not None:
                        gen.cancel()
                for job in self._scoring:
                    job.future.cancel()
            self._cond.notify()
        self._thread.join()
        self._closed = True
        self._rows.__exit__(None, None, None)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        loop, lock = self._loop, self.engine._lock
        while True:
            with self._cond:
                while not self._incoming and not self._scoring and loop.idle and not self._closing:
                    self._cond.wait()
                if loop.stalled and not self._incoming:
                    self._cond.wait(LENT_POLL_S)  # every row lent: poll the takers' state words (no busy loop)
                for gen in self._incoming:
                    loop.add(gen)
                self._incoming.clear()
                if self._closing and loop.idle and not self._scoring:
                    return
            try:
                with lock:
                    if self._scoring:  # first: the rows retired by the last step are free now, not yet re-filled
                        self._score_turn()
                    loop.step()
            except Exception as error:  # a bug outside any one request: fail what runs, keep serving
                loop.fail_all(error)
            time.sleep(0)  # let a session's thread waiting for the engine's lock take its step
