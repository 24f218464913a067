"""Prometheus series of a disaggregated server, in the same registry as :class:`ServeMetrics`
(``GET /metrics``). The HTTP series (requests, TTFT, TPOT, tokens, finish reasons) and the
totals ``kvforge_queue_depth`` / ``kvforge_running_rows`` are the one-process server's; these add:

Per worker, labels ``role`` (prefill, decode) and ``worker`` (e.g. ``decode-1``), from the workers'
heartbeats (sum by role in a query for the per-role figure):

- ``kvforge_worker_queue_depth``: sequences waiting for a cache row in that worker's scheduler
- ``kvforge_worker_running_rows``: cache rows generating now
- ``kvforge_worker_sequences``: sequences the router has given it and not seen finish
- ``kvforge_worker_up``: 1 while it is routed to (state "ready"), else 0
- ``kvforge_workers{role, state}``: workers by state (starting, ready, unresponsive, dead, failed)

The hand-off (prefill -> decode):

- ``kvforge_handoffs_total``, ``kvforge_handoff_bytes_total``: blocks handed off and their KV bytes
- ``kvforge_handoff_export_seconds``: the prefill worker's export into shared memory (histogram)
- ``kvforge_handoff_seconds``: from the prefill worker's hand-off to the decode worker's resume of
  it (pipe, routing, the decode worker taking the block; histogram)

``kvforge_prefix_routed_total``: sequences sent straight to a decode worker whose prefix cache holds
most of their prompt (no prefill worker, no hand-off).

Faults, by ``role``: ``kvforge_worker_deaths_total``, ``kvforge_worker_restarts_total``,
``kvforge_worker_unresponsive_total`` (left routing after the timeout),
``kvforge_sequence_reruns_total`` (sequences re-run or re-resumed after their worker failed, by
the role they went back to), ``kvforge_sequence_errors_total`` (sequences a worker failed or
refused, e.g. a KV block that failed its check).
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily


class DisaggServer(Protocol):
    """What the collectors read of the router at scrape time (:class:`~.router.DisaggServer` has
    it; a protocol here keeps this module below the router)."""

    def workers(self) -> list[dict[str, Any]]:
        """One row per worker: role, name, state, its latest heartbeat's stats."""


HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STATES = ("starting", "ready", "unresponsive", "dead", "failed")


class _WorkerCollector:
    """The workers' gauges at scrape time, from their latest heartbeats."""

    def __init__(self, server: DisaggServer) -> None:
        self.server = server

    def collect(self):
        rows = self.server.workers()
        families = {
            "queued": GaugeMetricFamily(
                "kvforge_worker_queue_depth", "sequences waiting for a cache row", labels=["role", "worker"]
            ),
            "running": GaugeMetricFamily(
                "kvforge_worker_running_rows", "cache rows generating now", labels=["role", "worker"]
            ),
            "held": GaugeMetricFamily(
                "kvforge_worker_sequences", "sequences routed to the worker, not finished", labels=["role", "worker"]
            ),
        }
        up = GaugeMetricFamily("kvforge_worker_up", "1 while the worker is routed to", labels=["role", "worker"])
        states = GaugeMetricFamily("kvforge_workers", "workers by state", labels=["role", "state"])
        for row in rows:
            for key, family in families.items():
                family.add_metric([row["role"], row["name"]], row[key])
            up.add_metric([row["role"], row["name"]], 1 if row["state"] == "ready" else 0)
        for role in ("prefill", "decode"):
            for state in STATES:
                states.add_metric([role, state], sum(1 for r in rows if r["role"] == role and r["state"] == state))
        yield from families.values()
        yield up
        yield states


class DisaggMetrics:
    """The series above, registered in ``registry`` (the server's :class:`ServeMetrics` registry)."""

    def __init__(self, registry: CollectorRegistry, server: DisaggServer) -> None:
        r = registry
        self.handoffs = Counter("kvforge_handoffs", "KV blocks handed off from prefill to decode", registry=r)
        self.handoff_bytes = Counter("kvforge_handoff_bytes", "KV bytes handed off", registry=r)
        self.export_seconds = Histogram(
            "kvforge_handoff_export_seconds", "prefill worker: KV export", buckets=HANDOFF_BUCKETS, registry=r
        )
        self.handoff_seconds = Histogram(
            "kvforge_handoff_seconds", "hand-off to the decode worker's resume", buckets=HANDOFF_BUCKETS, registry=r
        )
        self.prefix_routed = Counter(
            "kvforge_prefix_routed", "sequences sent straight to a decode worker holding their prefix", registry=r
        )
        self.worker_deaths = Counter("kvforge_worker_deaths", "worker processes that died", ["role"], registry=r)
        self.restarts = Counter("kvforge_worker_restarts", "worker processes restarted", ["role"], registry=r)
        self.unresponsive = Counter(
            "kvforge_worker_unresponsive", "workers taken out of routing after the timeout", ["role"], registry=r
        )
        self.reruns = Counter(
            "kvforge_sequence_reruns", "sequences re-run after their worker failed", ["role"], registry=r
        )
        self.sequence_errors = Counter(
            "kvforge_sequence_errors", "sequences a worker failed or refused", ["role"], registry=r
        )
        r.register(_WorkerCollector(server))
