"""The worker process: one engine, one scheduler, one role, driven over a pipe by the router.

    main(conn, spec)    # the target of a spawned process (see workers.PipeWorker)

Loads ``Engine.load(spec.artifact_dir, threads=spec.threads)`` (with its prefix cache: a decode
worker's holds the rows it finished), sends "ready", then serves the messages of
:mod:`.workers` until "close" or the end of its pipe (the router is gone), when it cancels what it
holds and exits.

- prefill (``submit``): ``scheduler.submit(..., hand_off=True)``; the first chunk goes back as it
  comes; a sequence that goes on is handed off and the reference goes back ("handoff"). By default
  (``spec.lend_rows``) the engine's KV cache is in shared memory (``kv_shared=True``, a segment
  named after this process's pid, :mod:`kvforge.runtime.kv.shm`) and the hand-off lends the
  sequence's row: nothing is copied here (the checksum is computed over the row in place), the
  decode worker's import copies straight from the row and frees it. Otherwise the scheduler
  exports the KV into a slot of this process's shared-memory arena.
- decode (``submit``): the whole request in its scheduler, no hand-off (the router sends it one
  whose prompt's most is in this worker's prefix cache).
- decode (``resume``): take the block from shared memory (``shm.take`` checks its fingerprint:
  KVBlockError for a foreign one; it unlinks the segment), ``resume`` it in the scheduler, whose
  import checks its checksum as it copies (KVBlockError for a corrupted one, nothing imported),
  stream the chunks, send the result.

Each sequence has its own pump thread (the scheduler's handles block); a heartbeat thread sends
the scheduler's queue and running rows every ``spec.heartbeat_s``. SIGINT is ignored: a Ctrl-C in
the terminal reaches the whole process group, and the front end decides when workers stop.
SIGUSR1 prints every thread's stack to the worker's stderr (to see where a hung worker is).
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
import time
from typing import Any

from kvforge.tools.serve.disagg.messages import CANCEL, CLOSE, PREFILL, RESUME, SUBMIT, WorkerEvent, WorkerSpec

HANDOFF = "handoff"  # the finish_reason of a sequence a prefill worker handed off


def main(conn, spec: WorkerSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # where a hung worker is stuck
    from kvforge.graphs.manifest import read as read_manifest
    from kvforge.runtime import Engine
    from kvforge.runtime.kv import shm

    try:
        # A decode worker's prefix cache holds the rows it finished (a chat's previous turn), which the
        # router may send the next turn to directly (the prefill of its short rest runs there).
        # The cache in shared memory: hand-offs lend their rows; not for a hybrid artifact nor an 8-bit KV
        # cache (a lent row carries KV only: the state, or the scales, are exported with it into the arena).
        layout = read_manifest(spec.artifact_dir).layout
        lend = spec.role == PREFILL and spec.lend_rows and not layout.has_state and not layout.quantized_kv
        engine = Engine.load(spec.artifact_dir, threads=spec.threads, prefix_cache=spec.prefix_cache, kv_shared=lend)
    except Exception as e:
        conn.send(WorkerEvent("failed", None, f"{type(e).__name__}: {e}"))
        return
    try:
        Worker(conn, spec, engine, shm).run()
    finally:
        engine.close()


class Worker:
    """The message loop of one worker process (see the module docstring)."""

    def __init__(self, conn, spec: WorkerSpec, engine, shm) -> None:
        self.conn, self.spec, self.engine, self.shm = conn, spec, engine, shm
        # A prefill worker lends each hand-off's cache row (its engine's cache in shared memory: refs
        # from the cache's segment), or exports the KV into a shared-memory arena: two full-length
        # blocks per row (at most 256 MiB); a larger block gets its own segment.
        self.lender = getattr(engine.cache, "segment", None) if spec.role == PREFILL else None
        self.segments = None
        if spec.role == PREFILL and self.lender is None:
            arena = min(256 * 2**20, 2 * engine.max_batch * (engine.kv_nbytes(engine.max_seq) + shm.SLOT_HEADER))
            self.segments = shm.SegmentAllocator(arena)
        self.scheduler = engine.scheduler(block_alloc=self.segments, lend_rows=self.lender is not None)
        self.handles: dict[int, Any] = {}  # seq -> RequestHandle, while its pump runs
        self.cancelled: set[int] = set()  # cancels that came before a resume had its handle
        self._lock = threading.Lock()  # guards handles, cancelled and the pipe's send side

    def send(self, event: WorkerEvent) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):  # the router is gone: the loop ends soon
            self.conn.send(event)

    def run(self) -> None:
        self.send(WorkerEvent("ready", None, {"rows": self.scheduler.rows}))
        stop = threading.Event()
        threading.Thread(target=self._beat, args=(stop,), name="kvforge-heartbeat", daemon=True).start()
        try:
            while True:
                try:
                    verb, seq, arg = self.conn.recv()
                except (EOFError, OSError):
                    break
                if verb == CLOSE:
                    break
                if verb == SUBMIT:
                    self._submit(seq, arg)
                elif verb == RESUME:
                    threading.Thread(target=self._decode, args=(seq, arg), daemon=True).start()
                elif verb == CANCEL:
                    self._cancel(seq)
        finally:
            stop.set()
            self.scheduler.close(cancel=True)
            if self.segments is not None:
                self.segments.close()  # hand-offs exported and never sent

    # ------------------------------------------------------------------------------------ verbs

    def _submit(self, seq: int, request) -> None:
        try:
            handle = self.scheduler.submit(
                request.prompt_ids,
                max_new_tokens=request.max_tokens,
                sampling=request.sampling,
                stop=request.stop,
                hand_off=self.spec.role == PREFILL,  # a decode worker runs the whole request (a prefix hit)
            )
        except (ValueError, RuntimeError) as e:
            # refused: a ValueError is the request's fault (the router answers 400), not the worker's
            refused = isinstance(e, ValueError)
            self.send(WorkerEvent("error", seq, {"type": type(e).__name__, "message": str(e), "refused": refused}))
            return
        with self._lock:
            self.handles[seq] = handle
        threading.Thread(target=self._prefill, args=(seq, handle), daemon=True).start()

    def _cancel(self, seq: int) -> None:
        with self._lock:
            handle = self.handles.get(seq)
            if handle is None:
                self.cancelled.add(seq)
        if handle is not None:
            handle.cancel()

    # ------------------------------------------------------------------------------------ pumps

    def _prefill(self, seq: int, handle) -> None:
        try:
            for chunk in handle:
                self.send(WorkerEvent("chunk", seq, chunk))
            result = handle.result()
            if result.finish_reason != HANDOFF:
                self.send(WorkerEvent("done", seq, result))
                return
            started = time.perf_counter()
            # the KV and its checksum are in shared memory already: a lent row, or an arena slot
            ref = (self.lender or self.segments).put(result.handoff)
            export_s = result.handoff.export_s + time.perf_counter() - started  # the copy out of the cache, and this
            self.send(WorkerEvent(HANDOFF, seq, {"ref": ref, "nbytes": ref.nbytes, "export_s": export_s}))
        except Exception as e:  # this sequence fails; the worker goes on
            self.send(WorkerEvent("error", seq, {"type": type(e).__name__, "message": str(e)}))
        finally:
            with self._lock:
                self.handles.pop(seq, None)

    def _decode(self, seq: int, ref) -> None:
        try:
            started = time.perf_counter()
            # take: checks the fingerprint (KVBlockError), unlinks a segment of its own; the checksum
            # is checked by the import as it copies (a mismatch: the handle raises KVBlockError)
            handle = self.scheduler.resume(self.shm.take(ref, self.engine.kv_fingerprint, verify=False))
            self.send(WorkerEvent("resumed", seq, {"import_s": time.perf_counter() - started}))
            with self._lock:
                self.handles[seq] = handle
                cancel = seq in self.cancelled
                self.cancelled.discard(seq)
            if cancel:
                handle.cancel()
            for chunk in handle:
                self.send(WorkerEvent("chunk", seq, chunk))
            self.send(WorkerEvent("done", seq, handle.result()))
        except Exception as e:  # KVBlockError for a foreign or corrupted block; this sequence fails alone
            self.send(WorkerEvent("error", seq, {"type": type(e).__name__, "message": str(e)}))
        finally:
            with self._lock:
                self.handles.pop(seq, None)
                self.cancelled.discard(seq)

    # --------------------------------------------------------------------------------- heartbeat

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self.spec.heartbeat_s):
            with self._lock:
                states = [handle.generation.state for handle in self.handles.values()]
            queued = states.count("waiting")
            running = len(states) - queued - states.count("done")
            self.send(WorkerEvent("beat", None, {"queued": queued, "running": running, "prefix_cache": self._pool()}))

    def _pool(self):
        pool = self.engine.prefix_pool
        return None if pool is None else pool.stats()  # a PrefixPoolStats: plain data
