"""The same app on Ray Serve: N replicas, each with its own engine, behind Ray's HTTP proxy.

    kvforge serve OUT --ray --replicas 2                      # a local Ray cluster on this machine
    kvforge serve OUT --ray --replicas 4 --address auto       # join a running cluster (ray start --head)

:class:`KvforgeDeployment` is a Ray Serve deployment whose ``__init__`` loads the engine once per
replica (``ModelServer.load``) and whose ASGI app is :func:`kvforge.tools.serve.app.build_app` over
it: the routes, errors and metrics are those of one process. The app is built per replica
(``@serve.ingress()`` with ``__serve_build_asgi_app__``) rather than passed as ``@serve.ingress(app)``:
the latter freezes a copy of a module-level app at decoration time, which could not hold the
engine the replica's ``__init__`` has just loaded.

Each replica answers with its Ray replica id in ``x-kvforge-replica`` and ``/health``. A replica
takes at most ``max_batch + max_queue`` requests at once (``max_ongoing_requests``), so its own 429
and Ray's routing agree on what "full" means. The artifact path must be readable on every node that
runs a replica (shared storage, or the same path copied to each node).
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
from ray import serve

from kvforge.graphs import manifest as mf
from kvforge.tools.serve.app import build_app
from kvforge.tools.serve.serving import ModelServer

APP_NAME = "kvforge"


@dataclass(frozen=True)
class ReplicaSettings:
    """What each replica needs to build its server (plain data: shipped to the replicas)."""

    artifact: str  # absolute path, valid on every node
    threads: int | None = None
    model_name: str | None = None
    max_queue: int = 64
    api_key: str | None = None
    strict_fields: bool = False  # refuse fields outside OpenAI's schema (build_app's strict_fields)
    prefix_cache: int | str | None = None  # each replica's own prefix cache (Engine.load's)


@serve.deployment(name="KvforgeServer")
@serve.ingress()
class KvforgeDeployment:
    def __init__(self, settings: dict) -> None:
        s = ReplicaSettings(**settings)
        replica = serve.get_replica_context().replica_id.unique_id
        self.api_key, self.strict_fields = s.api_key, s.strict_fields
        self.server = ModelServer.load(
            s.artifact,
            threads=s.threads,
            model_name=s.model_name,
            max_queue=s.max_queue,
            replica_id=replica,
            prefix_cache=s.prefix_cache,
        )

    def __serve_build_asgi_app__(self):
        return build_app(self.server, api_key=self.api_key, owns_server=True, strict_fields=self.strict_fields)


def deploy(
    settings: ReplicaSettings,
    *,
    replicas: int,
    replica_cpus: float,
    host: str,
    port: int,
) -> None:
    """Start Serve's HTTP proxy on ``host:port`` and deploy ``replicas`` replicas (Ray must be
    initialised); returns once every replica is up."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    manifest = mf.read(Path(settings.artifact), verify=False)
    capacity = manifest.limits.max_batch + settings.max_queue
    serve.start(http_options={"host": host, "port": port})
    app = KvforgeDeployment.options(
        num_replicas=replicas,
        max_ongoing_requests=capacity,
        ray_actor_options={"num_cpus": replica_cpus},
    ).bind(asdict(settings))
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def serve_ray(
    settings: ReplicaSettings,
    *,
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    num_cpus: int | None = None,
    replica_cpus: float | None = None,
) -> None:
    """Run the deployment until SIGTERM/SIGINT, then shut Serve down (each replica's lifespan
    closes its scheduler after what it runs) and leave or stop the cluster.

    ``address``: join this cluster (``auto`` or ``ray://host:10001``); None starts a local one with
    ``num_cpus`` CPUs (default: this machine's). ``replica_cpus``: CPUs Ray reserves per replica
    (default: an equal share of the local cluster, or 1 on a joined one)."""
    settings, num_cpus = start_ray(settings, address, num_cpus)
    if replica_cpus is None:
        replica_cpus = 1.0 if address else max(0.1, (num_cpus or 1) / replicas)
    settings = with_threads(settings, replica_cpus)
    run_until_signal(
        lambda: deploy(settings, replicas=replicas, replica_cpus=replica_cpus, host=host, port=port),
        f"kvforge: serving {replicas} replica(s) on http://{host}:{port}/v1 (Ray Serve)",
    )


def start_ray(settings: ReplicaSettings, address: str | None, num_cpus: int | None) -> tuple[ReplicaSettings, int]:
    """``settings`` with its artifact as an absolute path (ValueError when it is not a directory),
    and Ray initialised: joined at ``address``, else a local cluster of ``num_cpus`` CPUs (default:
    this machine's). Returns the settings and the local cluster's CPUs (0 on a joined one)."""
    settings = ReplicaSettings(**{**asdict(settings), "artifact": str(Path(settings.artifact).resolve())})
    if not Path(settings.artifact).is_dir():
        raise ValueError(f"artifact directory {settings.artifact!r} does not exist")
    if address:
        ray.init(address=address)
        return settings, 0
    num_cpus = num_cpus or os.cpu_count() or 1
    ray.init(num_cpus=num_cpus, include_dashboard=False)
    return settings, num_cpus


def with_threads(settings: ReplicaSettings, cpus: float) -> ReplicaSettings:
    """``settings`` whose engines use ``cpus`` threads when no thread count was given (ORT's default,
    every core, would oversubscribe a replica's share)."""
    if settings.threads is not None:
        return settings
    return ReplicaSettings(**{**asdict(settings), "threads": max(1, round(cpus))})


def run_until_signal(deploy_app, banner: str) -> None:
    """Run ``deploy_app()``, print ``banner``, serve until SIGTERM/SIGINT, then shut Serve down (each
    replica's lifespan closes its scheduler after what it runs) and leave or stop the cluster."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy_app()
        print(banner, flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
