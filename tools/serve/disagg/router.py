"""``DisaggServer``: what :class:`~..serving.ModelServer` offers the HTTP layer, over prefill and
decode worker processes (``kvforge serve OUT --prefill-workers P --decode-workers D``).

    server = DisaggServer.load("out", prefill_workers=1, decode_workers=1, threads_per_worker=1)
    app = build_app(server)          # completions.py and chat.py unchanged

The front end holds the tokenizer and the chat template (no engine): it validates, encodes and
admits requests exactly as the one-process server does (the same ``check_*`` and ``admit``), then
each sequence goes

    least-loaded ready prefill worker -> first chunk streamed -> "handoff" (a shared-memory ref)
    -> least-loaded ready decode worker -> chunks -> "done"

A sequence that ends at its first token (eos, a stop string, max_tokens=1) ends on the prefill
worker. A prefix hit skips the prefill worker: a new sequence whose prompt starts with most of
it (in whole prefix-cache blocks; the rest at most ``PREFIX_REST_MAX`` tokens) as a sequence a
decode worker finished (a chat's previous turn it decoded) goes to that decode worker whole; its
prefix cache serves the common part and it prefills the short rest itself. Load is the number of
sequences a worker holds now (ties: the one given fewer so far). With no ready worker in a pool
(all restarting or unresponsive), sequences wait in the router.

Cancellation (the client went away) is sent to whichever worker holds the sequence; one caught
between the two pools has its block freed by the router (its segment unlinked, or its arena slot
or lent cache row marked free).

Faults (:mod:`.workers` reports a dead process; the supervisor thread checks heartbeats):

- a worker process that dies: each sequence it held that has streamed nothing yet is re-run (from
  prefill; or, if its block is still in shared memory, resumed on another decode worker); the
  others end with an "error" event naming the worker, its pid and how it died (the request
  answers 500). The router unlinks the segments the dead worker left and starts a new process in
  its slot (at most ``MAX_RESTARTS`` in a row that die before "ready").
- a request the worker's scheduler refuses at submit (a ValueError the front end's checks did not
  catch) answers 400 with the scheduler's message, as the one-process server does (a streamed
  one: the same error object in the stream, whose 200 is sent before the worker answers).
- a worker that sends nothing for ``worker_timeout`` seconds (stopped, hung) is "unresponsive":
  out of routing; its sequences that streamed nothing are re-run elsewhere (it is told to cancel
  them). It is routed to again when it answers again.

Threads: each worker's reader thread calls :meth:`DisaggServer._on_event`; the supervisor thread
checks liveness; the event loop calls ``admit``/``start``/cancel. One lock guards the router's
state; events reach a request's asyncio queue through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.graphs import manifest as mf
from kvforge.runtime.chat import ChatTemplate
from kvforge.runtime.kv import shm
from kvforge.runtime.kv.prefix_pool import PrefixPoolStats, common_prefix
from kvforge.runtime.tokenizer import Tokenizer
from kvforge.tools.serve.disagg.metrics import DisaggMetrics
from kvforge.tools.serve.disagg.workers import DECODE, PREFILL, ROLES, PipeWorker, WorkerEvent, WorkerSpec
from kvforge.tools.serve.metrics import ServeMetrics
from kvforge.tools.serve.parsers import ChatFormat
from kvforge.tools.serve.serving import Event, Flight, ModelServer, SeqRequest, ServingError

log = logging.getLogger("kvforge.serve")

DEFAULT_WORKER_TIMEOUT = 5.0  # seconds without a message before a worker leaves routing
MAX_RESTARTS = 3  # restarts in a row of a slot whose process dies before it is ready
MAX_TRIES = 3  # times one sequence is started (re-runs after its worker died)
REMEMBERED = 64  # finished sequences remembered per decode worker (for prefix-hit routing)
PREFIX_REST_MAX = 256  # prompt tokens at most a decode worker prefills itself after a prefix hit


def _ref_name(ref: Any) -> str | None:
    """The shared-memory segment a block ref points into (None for a Ray object)."""
    return ref.name if isinstance(ref, shm.ShmRef) else None


def _pending(ref: Any) -> bool:
    """Whether a block is still there to take (a Ray object: while referenced)."""
    return shm.pending(ref) if isinstance(ref, shm.ShmRef) else True


def _discard(ref: Any) -> None:
    """Free a block nobody will take (Ray frees an object with its last reference)."""
    if isinstance(ref, shm.ShmRef):
        shm.discard(ref)


class WorkerError(RuntimeError):
    """A worker failed, refused or died while holding a sequence (that could not be re-run)."""


@dataclass
class ArtifactView:
    """The engine attributes the HTTP layer reads, without loading an engine."""

    artifact_dir: Path
    vocab_size: int
    max_seq: int
    max_batch: int
    prefix_pool: Any = None  # :class:`_PrefillPools` when the prefill workers have prefix caches


class _PrefillPools:
    """The prefill workers' prefix caches, summed from their latest heartbeats (``stats()`` as
    ``PrefixPool.stats`` gives it, for /health and /metrics)."""

    def __init__(self, slots: list[_Slot]) -> None:
        self.slots = slots

    def stats(self) -> PrefixPoolStats:
        beats = [s.worker.stats.get("prefix_cache") for s in self.slots if s.role == PREFILL]
        beats = [b for b in beats if b is not None]
        names = [f.name for f in dataclasses.fields(PrefixPoolStats)]
        total = {n: sum(getattr(b, n) for b in beats) for n in names}
        total["block_tokens"] = beats[0].block_tokens if beats else 0
        return PrefixPoolStats(**total)


@dataclass(eq=False)
class _Seq:
    """One sequence (one choice of one prompt) on its way through the pools."""

    id: int
    index: int  # its position in its Flight
    request: SeqRequest
    flight: Flight
    loop: asyncio.AbstractEventLoop
    router: DisaggServer
    slot: _Slot | None = None  # the slot whose worker holds it now
    phase: str = PREFILL  # PREFILL, DECODE, "done"
    ref: Any = None  # its block in shared memory, from "handoff" until "resumed"
    streamed: bool = False  # a chunk reached its request
    cancelled: bool = False
    tries: int = 0
    wire: int | None = None  # the id its current worker knows it by (new at each routing: a retried
    # sequence never takes the events of an earlier attempt, even from the same worker)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    handed: float | None = None  # when its "handoff" arrived

    def cancel(self) -> None:
        """Flight.cancel's verb: stop it wherever it is."""
        self.router._cancel(self)


@dataclass(eq=False)
class _Slot:
    """A place in a pool: its current worker process, replaced when one dies."""

    role: str
    index: int
    worker: PipeWorker
    held: set[_Seq] = field(default_factory=set)
    given: int = 0  # sequences routed here so far (the tie-break)
    restarts: int = 0
    failures: int = 0  # processes in a row that died before "ready"
    restart_at: float | None = None  # when to start the next process (a dead slot)
    # decode: the token ids whose KV the worker's prefix cache was offered (finished sequences:
    # prompt + output but the last token), newest last: where a prompt's prefix may be (LRU, capped)
    finished: OrderedDict[tuple[int, ...], None] = field(default_factory=OrderedDict)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


class DisaggServer:
    """See the module docstring. Build it with :meth:`load`; ``close()`` stops the workers."""

    # The request checks are the one-process server's own: same limits, same messages.
    late_refusals = True  # a worker's scheduler refuses what the front end cannot check (ModelServer's)
    check_model = ModelServer.check_model
    encode = ModelServer.encode
    check_lengths = ModelServer.check_lengths
    check_n = ModelServer.check_n
    token_text = ModelServer.token_text

    def __init__(
        self,
        artifact_dir: str | Path,
        *,
        prefill_workers: int,
        decode_workers: int,
        threads_per_worker: int | None = None,
        model_name: str | None = None,
        max_queue: int = 64,
        replica_id: str | None = None,
        prefix_cache: int | str | None = None,
        worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
        lend_rows: bool = True,
    ) -> None:
        for flag, count in (("--prefill-workers", prefill_workers), ("--decode-workers", decode_workers)):
            if count < 1:
                raise ValueError(f"{flag} must be at least 1 for a disaggregated server, got {count}")
        if max_queue < 0:
            raise ValueError(f"--max-queue must be at least 0, got {max_queue}")
        if not worker_timeout > 0:
            raise ValueError(f"--worker-timeout must be a positive number of seconds, got {worker_timeout}")
        artifact_dir = Path(artifact_dir)
        manifest = mf.read(artifact_dir, verify=False)
        if not manifest.tokenizer.get("has_tokenizer"):
            raise ValueError(f"{artifact_dir} has no tokenizer; the server needs one to take text prompts")
        limits = manifest.limits
        self.engine = ArtifactView(artifact_dir, manifest.model.vocab_size, limits.max_seq, limits.max_batch)
        self.tokenizer = Tokenizer(artifact_dir / "tokenizer.json")
        self.chat_template = ChatTemplate.from_artifact(artifact_dir)
        self.chat_format = ChatFormat.choose(manifest)  # the manifest's tool-call and reasoning parsers
        self.model_name = model_name or artifact_dir.name
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}"
        self.max_seq = limits.max_seq
        # A sequence holds a decode row for most of its life: the decode pool's rows bound the batch.
        self.capacity = decode_workers * limits.max_batch + max_queue
        self.in_flight = 0
        self.draining = False
        self.worker_timeout = worker_timeout
        self._threads, self._prefix_cache, self._lend_rows = threads_per_worker, prefix_cache, bool(lend_rows)
        self._heartbeat_s = min(0.5, worker_timeout / 4)
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._seqs: dict[int, _Seq] = {}  # wire id -> sequence, while a worker holds it
        self._live: set[_Seq] = set()  # every unfinished sequence, held or waiting in the router
        self._pending: dict[str, deque[_Seq]] = {role: deque() for role in ROLES}
        self._orphans: list[PipeWorker] = []  # dead workers whose shared memory is not unlinked yet
        self._closed = False
        self._stop = threading.Event()
        self.slots: list[_Slot] = []
        for role, count in ((PREFILL, prefill_workers), (DECODE, decode_workers)):
            for index in range(count):
                self.slots.append(_Slot(role, index, self._new_worker(role, index)))
        if prefix_cache not in (0, "0"):
            self.engine.prefix_pool = _PrefillPools(self.slots)
        self.metrics = ServeMetrics(self)
        self.disagg_metrics = DisaggMetrics(self.metrics.registry, self)
        self._supervisor = threading.Thread(target=self._supervise, name="kvforge-supervisor", daemon=True)

    @classmethod
    def load(cls, artifact_dir: str | Path, *, start_timeout: float = 300.0, **options) -> DisaggServer:
        """Start the workers (see ``__init__`` for ``options``) and wait until each has loaded its
        engine; a worker that cannot start stops them all and raises ValueError with its error."""
        server = cls(artifact_dir, **options)
        try:
            server.start_workers(start_timeout)
        except BaseException:
            server.close()
            raise
        return server

    def start_workers(self, timeout: float) -> None:
        for slot in self.slots:
            slot.worker.start(self._on_event)
        deadline = time.monotonic() + timeout
        while True:
            states = {slot.name: slot.worker for slot in self.slots}
            failed = [(n, w) for n, w in states.items() if w.state in ("failed", "dead")]
            if failed:
                name, worker = failed[0]
                raise ValueError(f"worker {name} could not start: {worker.exit_reason}")
            if all(w.state == "ready" for w in states.values()):
                break
            if time.monotonic() > deadline:
                slow = [n for n, w in states.items() if w.state != "ready"]
                raise ValueError(f"workers {', '.join(slow)} did not load the model within {timeout:.0f} s")
            time.sleep(0.05)
        self._supervisor.start()

    def _new_worker(self, role: str, index: int) -> PipeWorker:
        """A new worker client for slot ``role``-``index`` (at the start, and at each restart)."""
        spec = WorkerSpec(
            role=role,
            name=f"{role}-{index}",
            artifact_dir=str(self.engine.artifact_dir),
            threads=self._threads,
            prefix_cache=self._prefix_cache,
            heartbeat_s=self._heartbeat_s,
            lend_rows=self._lend_rows,
        )
        return PipeWorker(spec)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the supervisor, then every worker (each cancels what it holds); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        for slot in self.slots:
            slot.worker.close()
        for slot in self.slots:
            slot.worker.unlink_segments()

    # ------------------------------------------------------------------------------- admission

    def admit(self, need: int) -> None:
        with self._lock:
            ModelServer.admit(self, need)

    def start(self, sequences: Sequence[SeqRequest]) -> Flight:
        """Route each of ``sequences`` (admitted by :meth:`admit`) to a prefill worker."""
        loop = asyncio.get_running_loop()
        flight = Flight(len(sequences))
        with self._lock:
            for index, request in enumerate(sequences):
                seq = _Seq(next(self._ids), index, request, flight, loop, self)
                self._live.add(seq)
                flight.handles.append(seq)
                self.metrics.prompt_tokens.inc(len(request.prompt_ids))
                self._route(seq, PREFILL)
        return flight

    def scheduler_stats(self) -> tuple[int, int]:
        """(sequences queued, rows running) over every worker's latest heartbeat, plus the
        sequences waiting in the router for a worker."""
        with self._lock:
            queued = sum(len(p) for p in self._pending.values())
            queued += sum(s.worker.stats.get("queued", 0) for s in self.slots)
            running = sum(s.worker.stats.get("running", 0) for s in self.slots)
        return queued, running

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        return ModelServer.prefix_cache_stats(self)

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's name, role, pid, state, rows, scheduler queue and running rows (its latest
        heartbeat), sequences it holds (of which ``decoding``: resumed from their block) and routed to it so
        far, restarts of its slot: for ``/health``."""
        with self._lock:
            return [
                {
                    **s.worker.health(),
                    "held": len(s.held),
                    "decoding": sum(1 for q in s.held if q.phase == DECODE and q.ref is None),
                    "routed": s.given,
                    "restarts": s.restarts,
                }
                for s in self.slots
            ]

    def degraded(self) -> str | None:
        """For ``/health`` (503 "degraded"): which pools have no ready worker, with their workers'
        states; None while each pool has one (requests for an empty pool wait in the router)."""
        with self._lock:
            empty = []
            for role in ROLES:
                pool = [s for s in self.slots if s.role == role]
                if not any(s.worker.state == "ready" for s in pool):
                    states = ", ".join(f"{s.name} {s.worker.state}" for s in pool)
                    empty.append(f"the {role} pool has no ready worker ({states})")
        if not empty:
            return None
        return "; ".join(empty) + ": its requests wait in the router until one is ready"

    # ---------------------------------------------------------------------------------- routing

    def _prefix_slot(self, prompt: Sequence[int]) -> _Slot | None:
        """A ready decode worker whose prefix cache should hold most of ``prompt`` (in whole blocks:
        a chat's previous turn it decoded; the rest at most as long as the hit and at most
        ``PREFIX_REST_MAX`` tokens, a short prefill for a decode worker), else None. Its memory of what it
        finished may be stale (evicted blocks): then it prefills more itself; the tokens are the same."""
        prompt = tuple(prompt)
        best, best_len = None, 0
        for slot in self.slots:
            pool = slot.worker.stats.get("prefix_cache")
            if slot.role != DECODE or slot.worker.state != "ready" or pool is None or not pool.block_tokens:
                continue
            for ids in slot.finished:
                n = min(common_prefix(ids, prompt), len(prompt) - 1)  # at least one token to prefill
                n = n // pool.block_tokens * pool.block_tokens  # the pool holds whole blocks
                if n > best_len or (n == best_len and best is not None and len(slot.held) < len(best.held)):
                    best, best_len = slot, n
        rest = len(prompt) - best_len
        return best if best_len > 0 and rest <= min(best_len, PREFIX_REST_MAX) else None

    def _route(self, seq: _Seq, role: str) -> None:
        """Give ``seq`` to the least-loaded ready worker of ``role``, or queue it until one is ready.
        A new sequence whose prompt is mostly in a decode worker's prefix cache goes to that worker
        whole (no prefill worker, no hand-off)."""
        if role == PREFILL and seq.tries == 0 and (direct := self._prefix_slot(seq.request.prompt_ids)) is not None:
            direct.held.add(seq)
            direct.given += 1
            seq.slot, seq.phase, seq.wire, seq.tries = direct, DECODE, next(self._ids), 1
            self._seqs[seq.wire] = seq
            self.disagg_metrics.prefix_routed.inc()
            direct.worker.submit(seq.wire, seq.request)
            return
        ready = [s for s in self.slots if s.role == role and s.worker.state == "ready"]
        if not ready:
            self._seqs.pop(seq.wire, None)  # what its last worker still sends about it is stale
            self._pending[role].append(seq)
            return
        slot = min(ready, key=lambda s: (len(s.held), s.given))
        slot.held.add(seq)
        slot.given += 1
        self._seqs.pop(seq.wire, None)
        seq.slot, seq.phase, seq.wire = slot, role, next(self._ids)
        self._seqs[seq.wire] = seq
        if role == PREFILL:
            seq.tries += 1
            slot.worker.submit(seq.wire, seq.request)
        else:
            slot.worker.resume(seq.wire, seq.ref)

    def _drain_pending(self) -> None:
        for role, waiting in self._pending.items():
            while waiting and any(s.role == role and s.worker.state == "ready" for s in self.slots):
                seq = waiting.popleft()
                if seq.cancelled:
                    self._finish(seq, cancelled=True)
                else:
                    self._route(seq, role)

    def _cancel(self, seq: _Seq) -> None:
        with self._lock:
            if seq.phase == "done" or seq.cancelled:
                return
            seq.cancelled = True
            if seq.slot is not None:
                seq.slot.worker.cancel(seq.wire)  # it ends with "done" (cancelled) from there
                return
            for waiting in self._pending.values():  # waiting in the router for a worker
                if seq in waiting:
                    waiting.remove(seq)
            self._finish(seq, cancelled=True)

    def _finish(self, seq: _Seq, event: Event | None = None, *, cancelled: bool = False) -> None:
        """``seq`` is over: post its last event, free its place and its segment. ``cancelled``: it
        was cancelled while no worker held it (counted as the scheduler counts a cancel)."""
        if seq.phase == "done":
            return
        if cancelled:
            self.metrics.finished.labels(reason="cancelled").inc()
        seq.phase = "done"
        self._live.discard(seq)
        if seq.slot is not None:
            seq.slot.held.discard(seq)
        if seq.ref is not None:
            _discard(seq.ref)
            seq.ref = None
        self._seqs.pop(seq.wire, None)
        if event is not None:
            self._post(seq, event)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is going away
            seq.loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _post(self, seq: _Seq, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            seq.loop.call_soon_threadsafe(seq.flight.queue.put_nowait, event)

    # ----------------------------------------------------------------------------------- events

    def _on_event(self, worker: PipeWorker, event: WorkerEvent) -> None:
        """A worker's reader thread: apply one event (see :mod:`.workers` for the kinds)."""
        with self._lock:
            slot = next((s for s in self.slots if s.worker is worker), None)
            if slot is None:  # a replaced process's last words
                return
            kind = event.kind
            if kind in ("ready", "beat", "failed", "exit"):
                self._on_worker(slot, event)
                return
            seq = self._seqs.get(event.seq)
            if seq is None or seq.slot is not slot:  # finished, or re-run elsewhere meanwhile
                if kind == "handoff":
                    _discard(event.payload["ref"])
                return
            if kind == "chunk":
                self._on_chunk(seq, event.payload)
            elif kind == "handoff":
                self._on_handoff(slot, seq, event.payload)
            elif kind == "resumed":
                seq.ref = None  # the decode worker took the block (it frees the memory once imported)
                self.disagg_metrics.handoff_seconds.observe(time.perf_counter() - seq.handed)
            elif kind == "done":
                self._on_done(seq, event.payload)
            elif kind == "error" and event.payload.get("refused"):
                # the worker's scheduler refused the request (ValueError at submit): the colocated
                # server's 400, with the same message
                self.disagg_metrics.sequence_errors.labels(role=slot.role).inc()
                error = ServingError(event.payload["message"], code="invalid_value")
                self._finish(seq, Event("error", seq.index, error))
            elif kind == "error":
                what = "refused the sequence's KV block" if event.payload["type"] == "KVBlockError" else "failed"
                error = WorkerError(
                    f"{slot.role} worker {slot.name} (pid {worker.pid}) {what}: "
                    f"{event.payload['type']}: {event.payload['message']}"
                )
                self.disagg_metrics.sequence_errors.labels(role=slot.role).inc()
                self._finish(seq, Event("error", seq.index, error))

    def _on_chunk(self, seq: _Seq, chunk: Any) -> None:
        if chunk.token_ids and seq.first_token is None:
            seq.first_token = time.perf_counter()
            self.metrics.ttft.observe(seq.first_token - seq.submitted)
        seq.streamed = True
        if chunk.finish_reason == "handoff":  # the prefill side's end, not the sequence's
            chunk = dataclasses.replace(chunk, finish_reason=None)
        self._post(seq, Event("chunk", seq.index, chunk))

    def _on_handoff(self, slot: _Slot, seq: _Seq, payload: dict[str, Any]) -> None:
        slot.held.discard(seq)
        seq.slot, seq.ref, seq.handed = None, payload["ref"], time.perf_counter()
        self.disagg_metrics.handoffs.inc()
        self.disagg_metrics.handoff_bytes.inc(payload["nbytes"])
        self.disagg_metrics.export_seconds.observe(payload["export_s"])
        if seq.cancelled:
            self._finish(seq, cancelled=True)
        else:
            self._route(seq, DECODE)

    def _on_done(self, seq: _Seq, result: Any) -> None:
        if seq.slot is not None and seq.slot.role == DECODE and result.finish_reason != "cancelled":
            ids = (*seq.request.prompt_ids, *result.token_ids[:-1])  # what its row held, offered to its pool
            seq.slot.finished[ids] = None
            seq.slot.finished.move_to_end(ids)
            while len(seq.slot.finished) > REMEMBERED:
                seq.slot.finished.popitem(last=False)
        tokens = len(result.token_ids)
        self.metrics.generation_tokens.inc(tokens)
        self.metrics.cached_tokens.inc(result.cached_tokens)
        self.metrics.observe_speculative(result)
        self.metrics.finished.labels(reason=result.finish_reason).inc()
        if seq.first_token is not None and tokens > 1:
            self.metrics.tpot.observe((time.perf_counter() - seq.first_token) / (tokens - 1))
        self._finish(seq, Event("done", seq.index, result))

    # ---------------------------------------------------------------------------------- workers

    def _on_worker(self, slot: _Slot, event: WorkerEvent) -> None:
        worker = slot.worker
        if event.kind == "ready":
            worker.state, worker.rows = "ready", event.payload["rows"]
            slot.failures = 0
            log.warning("%s worker %s (pid %s) is ready", slot.role, slot.name, worker.pid)
            self._drain_pending()
        elif event.kind == "beat":
            worker.stats = event.payload
            if worker.state == "unresponsive":
                worker.state = "ready"
                log.warning("%s worker %s (pid %s) answers again: back in routing", slot.role, slot.name, worker.pid)
                self._drain_pending()
        elif event.kind == "failed":
            worker.state, worker.exit_reason = "failed", event.payload
        elif event.kind == "exit":
            if self._closed:
                worker.state = "stopped"
                return
            if worker.state != "failed":
                worker.exit_reason = event.payload
            self._on_death(slot)

    def _on_death(self, slot: _Slot) -> None:
        """``slot``'s process is gone: re-run or fail what it held, clean its segments, restart it."""
        worker = slot.worker
        was_ready = worker.state in ("ready", "unresponsive")
        worker.state = "dead"
        self.disagg_metrics.worker_deaths.labels(role=slot.role).inc()
        log.error("%s worker %s (pid %s) %s", slot.role, slot.name, worker.pid, worker.exit_reason)
        for seq in sorted(slot.held, key=lambda s: s.id):
            slot.held.discard(seq)
            seq.slot = None
            self._recover(seq, f"{slot.role} worker {slot.name} (pid {worker.pid}) {worker.exit_reason}")
        slot.finished.clear()  # a new process: an empty prefix cache
        self._orphans.append(worker)  # its shared memory goes once no block in flight is in it
        self._unlink_orphans()
        slot.failures = 0 if was_ready else slot.failures + 1
        if slot.failures > MAX_RESTARTS:
            log.error("%s died %d times before it was ready; not restarting it", slot.name, slot.failures)
            return
        slot.restart_at = time.monotonic() + (0.0 if was_ready else min(2.0**slot.failures, 10.0))

    def _unlink_orphans(self) -> None:
        """Unlink the shared memory of dead workers, once no block in flight is in it (a decode
        worker may still take one from a dead prefill worker's arena or lent cache row)."""
        in_flight = {_ref_name(s.ref) for s in self._live if s.ref is not None}
        for worker in list(self._orphans):
            removed = worker.unlink_segments(keep=in_flight)
            if removed:
                log.warning("unlinked the shared memory %s (pid %s) left: %s", worker.name, worker.pid, removed)
            left = shm.segments(worker.pid) if isinstance(worker, PipeWorker) and worker.pid is not None else []
            if not left:
                self._orphans.remove(worker)

    def _recover(self, seq: _Seq, why: str) -> None:
        """A sequence whose worker is gone or stuck: resume, re-run or fail it."""
        if seq.cancelled:
            self._finish(seq, cancelled=True)
        elif seq.phase == DECODE and seq.ref is not None and _pending(seq.ref):
            self.disagg_metrics.reruns.labels(role=DECODE).inc()
            self._route(seq, DECODE)  # not taken there: its block is still in shared memory
        elif not seq.streamed and seq.tries < MAX_TRIES:
            self.disagg_metrics.reruns.labels(role=PREFILL).inc()
            if seq.ref is not None:
                _discard(seq.ref)
                seq.ref = None
            self._route(seq, PREFILL)
        else:
            detail = "after it streamed output" if seq.streamed else f"after {seq.tries} tries"
            error = WorkerError(f"{why} while it held this sequence ({detail}); the sequence cannot go on: retry it")
            self._finish(seq, Event("error", seq.index, error))

    def _supervise(self) -> None:
        """The supervisor thread: mark silent workers unresponsive, restart dead ones."""
        while not self._stop.wait(min(0.1, self.worker_timeout / 10)):
            now = time.monotonic()
            with self._lock:
                if self._closed:
                    return
                self._unlink_orphans()
                for slot in self.slots:
                    worker = slot.worker
                    if worker.state == "ready" and now - worker.last_seen > self.worker_timeout:
                        self._unresponsive(slot)
                    elif worker.state == "dead" and slot.restart_at is not None and now >= slot.restart_at:
                        slot.restart_at = None
                        slot.restarts += 1
                        slot.worker = self._new_worker(slot.role, slot.index)
                        self.disagg_metrics.restarts.labels(role=slot.role).inc()
                        log.warning("restarting %s worker %s (restart %d)", slot.role, slot.name, slot.restarts)
                        slot.worker.start(self._on_event)
                    elif worker.state == "starting" and worker.pid is not None and not worker.alive():
                        pass  # its reader thread reports the exit

    def _unresponsive(self, slot: _Slot) -> None:
        worker = slot.worker
        worker.state = "unresponsive"
        silent = time.monotonic() - worker.last_seen
        log.error(
            "%s worker %s (pid %s) sent nothing for %.1f s (limit %.1f s): out of routing",
            slot.role,
            slot.name,
            worker.pid,
            silent,
            self.worker_timeout,
        )
        self.disagg_metrics.unresponsive.labels(role=slot.role).inc()
        for seq in sorted(slot.held, key=lambda s: s.id):
            if not seq.streamed and seq.phase == PREFILL:
                worker.cancel(seq.wire)
                slot.held.discard(seq)
                seq.slot = None
                self._recover(seq, f"{slot.role} worker {slot.name} (pid {worker.pid}) stopped answering")
