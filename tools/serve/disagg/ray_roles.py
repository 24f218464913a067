"""Disaggregated prefill/decode on Ray Serve: prefill, decode and ingress deployments, across machines.

    serve_disagg_ray(ReplicaSettings("out"), prefill_workers=1, decode_workers=1)   # local cluster
    serve_disagg_ray(settings, prefill_workers=2, decode_workers=4, address="auto")   # a running one

The roles are those of the worker processes (:mod:`.worker`), as Ray Serve deployments:

- :class:`PrefillRole`: an engine and a scheduler; ``run(seq, request)`` streams the events of one
  sequence (:class:`~.workers.WorkerEvent`: the first chunk, then "done" or "handoff"). A hand-off's
  KV goes into Ray's object store (``ray.put`` of the block's numpy array and, on a hybrid, its state arrays:
  the header travels as plain data, the arrays are never pickled row by row).
- :class:`DecodeRole`: ``run(seq, ref)`` gets the block (``await`` of its ObjectRef: a zero-copy
  read-only view when the object is on this node, one transfer by Ray's object manager when it is
  not), resumes the sequence and streams "resumed", chunks, "done". Its prefix cache holds the
  sequences it finished, so the router sends it a follow-up whose prompt is mostly one of them
  whole (``run(seq, request)``: no prefill role, no hand-off), as to a decode worker process.
- :class:`IngressRole`: the OpenAI app (:func:`~..app.build_app`) over the router of the worker
  processes (:class:`~.router.DisaggServer`: routing, cancellation, metrics, /health), whose
  workers are :class:`RayWorker` clients: the same interface as a pipe to a process
  (:class:`~.workers.WorkerClient`), over deployment handles.

One deployment per worker (``KvforgePrefill0``, ``KvforgeDecode0``, ...: one replica each), so the
router's least-loaded choice and its cancels reach the replica that holds a sequence. Ray places
the replicas on the cluster's nodes (``ray_actor_options`` CPUs) and restarts one that dies; the
sequences it held then end with an error (a stream that broke), the others go on. The artifact
must be readable at the same path on every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve

from kvforge.graphs import manifest as mf
from kvforge.tools.serve.app import build_app
from kvforge.tools.serve.disagg.router import DisaggServer
from kvforge.tools.serve.disagg.workers import DECODE, PREFILL, WorkerEvent, health_row
from kvforge.tools.serve.ray_app import ReplicaSettings, run_until_signal, start_ray, with_threads

APP_NAME = "kvforge-disagg"
HANDOFF = "handoff"
ROLE_CALLS = 1000  # a role's max_ongoing_requests: its sequences' streams plus heartbeats and cancels


@dataclass(frozen=True)
class RayRef:
    """A hand-off in Ray's object store: its header (plain data) and its block's ObjectRef. The
    router handles it as it handles a shared-memory ref: ``name`` and ``slot`` (None) make its
    discard and clean-up find no segment; Ray frees the object with its last reference."""

    name: str
    header: dict[str, Any]
    block: Any  # ray.ObjectRef of (the block's [L, 2, H_kv, n, D] array, its state dict or None, its scales or None)
    nbytes: int
    slot: None = None


class _Role:
    """What both roles share: the engine, the scheduler, the sequences held, the small verbs."""

    role = ""

    def __init__(self, settings: dict) -> None:
        from kvforge.runtime import Engine

        s = ReplicaSettings(**settings)
        # A decode role's prefix cache holds the sequences it finished (a chat's previous turn): the
        # router sends a follow-up whose prompt is mostly one of them straight to it (a prefix hit).
        self.engine = Engine.load(s.artifact, threads=s.threads, prefix_cache=s.prefix_cache)
        self.scheduler = self.engine.scheduler()
        self.handles: dict[int, Any] = {}  # seq -> RequestHandle

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rows": self.scheduler.rows, "node": ray.get_runtime_context().get_node_id()}

    def stats(self) -> dict[str, Any]:
        """The heartbeat's payload (as a worker process sends it)."""
        states = [h.generation.state for h in list(self.handles.values())]
        queued = states.count("waiting")
        pool = self.engine.prefix_pool
        return {
            "queued": queued,
            "running": len(states) - queued - states.count("done"),
            "prefix_cache": None if pool is None else pool.stats(),
        }

    def cancel(self, seq: int) -> None:
        handle = self.handles.get(seq)
        if handle is not None:
            handle.cancel()

    async def _run_request(self, seq: int, request, hand_off: bool):
        """Run ``request`` (a SeqRequest) from its prompt: the first token then a "handoff" event
        (``hand_off``: a prefill role), or the whole request (a decode role's prefix hit)."""
        try:
            handle = self.scheduler.submit(
                request.prompt_ids, request.max_tokens, request.sampling, request.stop, hand_off=hand_off
            )
        except ValueError as error:  # the request's fault: the router answers 400
            yield _error(seq, error, refused=True)
            return
        try:
            async for event in self._chunks(seq, handle):
                yield event
            result = handle.result()
            if result.finish_reason != HANDOFF:
                yield WorkerEvent("done", seq, result)
                return
            started = time.perf_counter()
            handoff = result.handoff
            # the numpy arrays into the object store: the KV, and a hybrid's state (None: KV only)
            block = ray.put((handoff.block.data, handoff.block.state, handoff.block.scales))
            ref = RayRef(f"ray-{secrets.token_hex(6)}", handoff.header(), block, handoff.nbytes)
            payload = {"ref": ref, "nbytes": ref.nbytes, "export_s": time.perf_counter() - started}
            yield WorkerEvent(HANDOFF, seq, payload)
        except Exception as error:  # this sequence fails alone
            yield _error(seq, error)

    async def _chunks(self, seq: int, handle):
        """The chunks of ``handle`` as "chunk" events, as they come; ``handle.result()`` is ready after."""
        self.handles[seq] = handle
        try:
            chunks = iter(handle)
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield WorkerEvent("chunk", seq, chunk)
        finally:
            self.handles.pop(seq, None)


def _error(seq: int, error: Exception, refused: bool = False) -> WorkerEvent:
    return WorkerEvent("error", seq, {"type": type(error).__name__, "message": str(error), "refused": refused})


@serve.deployment(name="KvforgePrefill", max_ongoing_requests=ROLE_CALLS)
class PrefillRole(_Role):
    role = PREFILL

    async def run(self, seq: int, request):
        """Prefill ``request`` (a SeqRequest) and sample its first token; hand the rest off."""
        async for event in self._run_request(seq, request, hand_off=True):
            yield event


@serve.deployment(name="KvforgeDecode", max_ongoing_requests=ROLE_CALLS)
class DecodeRole(_Role):
    role = DECODE

    async def run(self, seq: int, ref):
        """Continue the sequence handed off as ``ref`` (a :class:`RayRef`), or run a SeqRequest
        whole: the router's prefix hit, a prompt mostly in this role's prefix cache."""
        from kvforge.runtime.kv.handoff import Handoff

        if not isinstance(ref, RayRef):
            async for event in self._run_request(seq, ref, hand_off=False):
                yield event
            return
        try:
            started = time.perf_counter()
            data, state, scales = await ref.block  # read-only; zero-copy from this node's object store
            handle = self.scheduler.resume(Handoff.from_parts(ref.header, data, state, scales))  # KVBlockError: foreign
            del data, state, scales
            yield WorkerEvent("resumed", seq, {"import_s": time.perf_counter() - started})
            async for event in self._chunks(seq, handle):
                yield event
            yield WorkerEvent("done", seq, handle.result())
        except Exception as error:
            yield _error(seq, error)


class RayWorker:
    """A :class:`~.workers.WorkerClient` over a role deployment's handle (in the ingress): verbs are
    handle calls, each sequence's events come from its streaming call on a thread of its own, a
    heartbeat thread polls ``stats``. ``kill`` and the shared-memory clean-up have nothing to do:
    Ray restarts a dead replica and frees the objects of a dead one."""

    def __init__(self, role: str, name: str, handle, heartbeat_s: float) -> None:
        self.role, self.name = role, name
        self.state = "starting"
        self.pid: int | None = None
        self.rows = 0
        self.stats: dict[str, Any] = {}
        self.exit_reason: str | None = None
        self.started_at = self.last_seen = time.monotonic()
        self._handle, self._heartbeat_s = handle, heartbeat_s
        self._stop = threading.Event()
        self._on_event = None

    def start(self, on_event) -> None:
        self._on_event = on_event
        threading.Thread(target=self._watch, name=f"kvforge-{self.name}-beat", daemon=True).start()

    def _emit(self, event: WorkerEvent) -> None:
        self.last_seen = time.monotonic()
        self._on_event(self, event)

    def _watch(self) -> None:
        try:
            info = self._handle.ready.remote().result()
        except Exception as error:
            self._emit(WorkerEvent("failed", None, f"{type(error).__name__}: {error}"))
            return
        self.pid = info["pid"]
        self._emit(WorkerEvent("ready", None, info))
        while not self._stop.wait(self._heartbeat_s):
            with contextlib.suppress(Exception):  # no beat: the router's timeout takes it out of routing
                self._emit(WorkerEvent("beat", None, self._handle.stats.remote().result(timeout_s=30)))

    def _stream(self, seq: int, arg: Any) -> None:
        def pump() -> None:
            try:
                for event in self._handle.options(stream=True).run.remote(seq, arg):
                    self._emit(event)
            except Exception as error:  # the replica died or the call broke: this sequence fails
                self._emit(_error(seq, error))

        threading.Thread(target=pump, name=f"kvforge-{self.name}-{seq}", daemon=True).start()

    def submit(self, seq: int, request: Any) -> None:
        self._stream(seq, request)

    def resume(self, seq: int, ref: Any) -> None:
        self._stream(seq, ref)

    def cancel(self, seq: int) -> None:
        self._handle.cancel.remote(seq)

    def health(self) -> dict[str, Any]:
        return health_row(self)

    def alive(self) -> bool:
        return self.state not in ("failed", "stopped")

    def kill(self) -> None:
        """Nothing: a replica's life is Ray's."""

    def unlink_segments(self, keep: set[str] = frozenset()) -> list[str]:
        return []  # the block is in Ray's object store, freed with its last reference

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.state = "stopped"


class RayDisaggServer(DisaggServer):
    """The router of the worker processes, its workers :class:`RayWorker` clients of the role
    deployments' handles (``prefill``/``decode``: one handle per worker)."""

    def __init__(self, artifact_dir, *, prefill: list, decode: list, **options) -> None:
        self._handles = {PREFILL: list(prefill), DECODE: list(decode)}
        super().__init__(artifact_dir, prefill_workers=len(prefill), decode_workers=len(decode), **options)

    def _new_worker(self, role: str, index: int) -> RayWorker:
        return RayWorker(role, f"{role}-{index}", self._handles[role][index], self._heartbeat_s)


@serve.deployment(name="KvforgeIngress")
@serve.ingress()
class IngressRole:
    def __init__(self, settings: dict, prefill: list, decode: list) -> None:
        s = ReplicaSettings(**settings)
        self.api_key, self.strict_fields = s.api_key, s.strict_fields
        self.server = RayDisaggServer.load(
            s.artifact,
            prefill=prefill,
            decode=decode,
            model_name=s.model_name,
            max_queue=s.max_queue,
            replica_id=serve.get_replica_context().replica_id.unique_id,
            prefix_cache=s.prefix_cache,
        )

    def __serve_build_asgi_app__(self):
        return build_app(self.server, api_key=self.api_key, owns_server=True, strict_fields=self.strict_fields)


def deploy(
    settings: ReplicaSettings,
    *,
    prefill_workers: int,
    decode_workers: int,
    worker_cpus: float,
    host: str = "127.0.0.1",
    port: int = 8000,
) -> None:
    """Start Serve's HTTP proxy on ``host:port`` and deploy the roles (Ray must be initialised);
    returns once every replica is up and the ingress has seen each worker ready."""
    for flag, count in (("--prefill-workers", prefill_workers), ("--decode-workers", decode_workers)):
        if count < 1:
            raise ValueError(f"{flag} must be at least 1 for a disaggregated deployment, got {count}")
    limits = mf.read(Path(settings.artifact), verify=False).limits
    config = asdict(settings)
    options = dict(ray_actor_options={"num_cpus": worker_cpus})
    prefill = [PrefillRole.options(name=f"KvforgePrefill{i}", **options).bind(config) for i in range(prefill_workers)]
    decode = [DecodeRole.options(name=f"KvforgeDecode{i}", **options).bind(config) for i in range(decode_workers)]
    capacity = decode_workers * limits.max_batch + settings.max_queue
    ingress = IngressRole.options(max_ongoing_requests=capacity, ray_actor_options={"num_cpus": 0.1})
    serve.start(http_options={"host": host, "port": port})
    serve.run(ingress.bind(config, prefill, decode), name=APP_NAME, route_prefix="/", blocking=False)


def serve_disagg_ray(
    settings: ReplicaSettings,
    *,
    prefill_workers: int,
    decode_workers: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    num_cpus: int | None = None,
    worker_cpus: float | None = None,
) -> None:
    """``kvforge serve OUT --ray --prefill-workers P --decode-workers D``: deploy, run until
    SIGTERM/SIGINT, then shut Serve down and leave (or stop) the cluster. ``address``: join this
    cluster; None starts a local one of ``num_cpus`` CPUs. ``worker_cpus``: CPUs reserved per
    role replica (default: an equal share of the local cluster, 1 on a joined one); the engines'
    threads default to it."""
    settings, num_cpus = start_ray(settings, address, num_cpus)
    if worker_cpus is None:
        worker_cpus = 1.0 if address else max(0.1, (num_cpus - 0.1) / (prefill_workers + decode_workers))
    settings = with_threads(settings, worker_cpus)
    run_until_signal(
        lambda: deploy(
            settings,
            prefill_workers=prefill_workers,
            decode_workers=decode_workers,
            worker_cpus=worker_cpus,
            host=host,
            port=port,
        ),
        f"kvforge: serving {prefill_workers} prefill + {decode_workers} decode worker(s) on "
        f"http://{host}:{port}/v1 (Ray Serve)",
    )
