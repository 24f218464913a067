"""The router's view of a worker: the :class:`WorkerClient` interface, its events, and
:class:`PipeWorker`, the implementation over a spawned process and a ``multiprocessing`` pipe.

A worker runs one engine and one scheduler in one role, ``prefill`` or ``decode``. The router
drives it with four verbs and learns everything else from the events it sends back:

- ``submit(seq, request)`` (prefill): prefill ``request`` (a :class:`~..serving.SeqRequest`) and
  sample its first token; the worker streams that chunk, then either finishes the sequence
  ("done") or hands it off ("handoff": a small reference to its KV in shared memory).
- ``resume(seq, ref)`` (decode): import the block ``ref`` names and continue the sequence in the
  in-flight batch ("resumed" once imported, chunks, "done"); a foreign or corrupted block is
  refused ("error" naming the KVBlockError).
- ``cancel(seq)``: free the sequence's row at the scheduler's next step (it ends "done" with
  ``finish_reason="cancelled"``).
- ``health()``: what ``/health`` lists: name, role, pid, state.

Events (:class:`WorkerEvent`, ``kind`` / ``seq`` / ``payload``): "ready" (``{"pid", "rows"}``),
"beat" (``{"queued", "running", "prefix_cache"}``, every heartbeat), "chunk" (a StreamChunk),
"handoff" (``{"ref", "nbytes", "export_s"}``), "resumed" (``{"import_s"}``), "done" (the
GenerationResult), "error" (``{"type", "message", "refused"}``: that sequence failed, the worker goes on;
``refused``: its scheduler refused the request at submit, a ValueError: the client's 400),
"failed" (a message: the worker could not start), "exit" (the process is gone; ``payload`` says how).

Another transport (Ray actor handles, :mod:`.ray_roles`) implements the same interface and calls
the same ``on_event``; the router does not know which it drives.

Threads of a :class:`PipeWorker`: a reader (``conn.recv`` -> ``on_event``; end of file means the
process is gone) and a writer (the router's sends never block, even when the process is stopped
and its pipe is full). Shared memory: a worker's segments are named after its pid
(:mod:`kvforge.runtime.kv.shm`); :meth:`PipeWorker.unlink_segments` removes what a dead one left.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvforge.tools.serve.disagg.messages import (
    CANCEL,
    CLOSE,
    DECODE,
    PREFILL,
    RESUME,
    ROLES,
    SUBMIT,
    WorkerEvent,
    WorkerSpec,
)

__all__ = ["CANCEL", "CLOSE", "DECODE", "PREFILL", "RESUME", "ROLES", "SUBMIT", "PipeWorker", "WorkerClient"]
__all__ += ["WorkerEvent", "WorkerSpec", "health_row"]

log = logging.getLogger("kvforge.serve")


class WorkerClient(Protocol):
    """What the router needs of a worker, whatever carries the messages."""

    role: str
    name: str

    def start(self, on_event: Callable[[WorkerClient, WorkerEvent], None]) -> None:
        """Start the worker; its events go to ``on_event`` (from any thread), "ready" first."""

    def submit(self, seq: int, request: Any) -> None: ...

    def resume(self, seq: int, ref: Any) -> None: ...

    def cancel(self, seq: int) -> None: ...

    def health(self) -> dict[str, Any]: ...

    def alive(self) -> bool:
        """Whether the worker's process (or actor) still exists."""

    def kill(self) -> None:
        """End it now (SIGKILL); an "exit" event follows."""

    def unlink_segments(self, keep: set[str] = frozenset()) -> list[str]:
        """Remove the shared-memory segments it created and left behind (after it is gone), but
        those in ``keep`` (blocks still on their way to a decode worker)."""

    def close(self, timeout: float = 10.0) -> None:
        """Stop it and wait for it (idempotent)."""


class PipeWorker:
    """A worker in a spawned process on this machine, over a duplex pipe (see the module docstring).

    ``state`` is kept by the router ("starting", "ready", "unresponsive", "dead", "stopped");
    ``last_seen`` is the monotonic time of the latest message from the process.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.role, self.name = spec.role, spec.name
        self.state = "starting"
        self.pid: int | None = None
        self.rows = 0
        self.started_at = time.monotonic()
        self.last_seen = self.started_at
        self.stats: dict[str, Any] = {}  # the latest heartbeat's payload
        self.exit_reason: str | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._closing = False

    def start(self, on_event: Callable[[PipeWorker, WorkerEvent], None]) -> None:
        from kvforge.tools.serve.disagg.worker import main

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=main, args=(child, self.spec), name=f"kvforge-{self.name}", daemon=True)
        self._process.start()
        child.close()  # the child holds its end; ours closing makes the child's reads see the end of file
        self._conn, self.pid = parent, self._process.pid
        self.started_at = self.last_seen = time.monotonic()
        threading.Thread(target=self._read, args=(on_event,), name=f"kvforge-{self.name}-rx", daemon=True).start()
        threading.Thread(target=self._write, name=f"kvforge-{self.name}-tx", daemon=True).start()

    # -------------------------------------------------------------------------------- the verbs

    def submit(self, seq: int, request: Any) -> None:
        self._outbox.put((SUBMIT, seq, request))

    def resume(self, seq: int, ref: Any) -> None:
        self._outbox.put((RESUME, seq, ref))

    def cancel(self, seq: int) -> None:
        self._outbox.put((CANCEL, seq, None))

    def health(self) -> dict[str, Any]:
        return health_row(self)

    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def kill(self) -> None:
        if self.pid is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def unlink_segments(self, keep: set[str] = frozenset()) -> list[str]:
        """Unlink the shared-memory segments this worker's process created (blocks it exported and
        no decode worker took) but those in ``keep``; returns their names."""
        from kvforge.runtime.kv import shm

        if self.pid is None:
            return []
        return [name for name in shm.segments(self.pid) if name not in keep and unlink_segment(name)]

    def close(self, timeout: float = 10.0) -> None:
        """Ask the process to finish (a "close" message ends its loop), then wait; SIGKILL after ``timeout``."""
        if self._closing:
            return
        self._closing = True
        self._outbox.put(None)
        if self._process is not None and self.pid is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                self.kill()
                self._process.join(5)

    # ------------------------------------------------------------------------------- the threads

    def _read(self, on_event: Callable[[PipeWorker, WorkerEvent], None]) -> None:
        conn = self._conn
        while True:
            try:
                event = conn.recv()
            except (EOFError, OSError):
                break
            self.last_seen = time.monotonic()
            try:
                on_event(self, event)
            except Exception:  # a bug in handling one event must not deafen the router to this worker
                log.exception("%s: handling its %r event failed", self.name, event.kind)
        self._outbox.put(None)  # ends the writer
        with contextlib.suppress(OSError):
            conn.close()
        self._process.join(5)
        code = self._process.exitcode
        if code is not None and code < 0:
            self.exit_reason = f"killed by signal {signal.Signals(-code).name}"
        else:
            self.exit_reason = f"exited with status {code}"
        on_event(self, WorkerEvent("exit", None, self.exit_reason))

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._conn.send((CLOSE, None, None) if message is None else message)
            except (OSError, ValueError):  # the process is gone: the reader reports it
                return
            if message is None:  # the process ends its loop; the reader sees the end of its pipe
                return


def health_row(worker: Any) -> dict[str, Any]:
    """A worker client's ``/health`` entry from what every client keeps: its name, role, pid,
    state and rows, and its last heartbeat (``stats``, ``last_seen``)."""
    beat = worker.stats
    return {
        "name": worker.name,
        "role": worker.role,
        "pid": worker.pid,
        "state": worker.state,
        "rows": worker.rows,
        "queued": beat.get("queued", 0),
        "running": beat.get("running", 0),
        "last_seen_s": round(time.monotonic() - worker.last_seen, 3),
    }


def unlink_segment(name: str) -> bool:
    """Unlink the shared-memory segment ``name`` (False when it is already gone)."""
    from kvforge.runtime.kv.shm import SHM_DIR

    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        return False
    return True
