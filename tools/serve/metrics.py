"""Prometheus metrics of one server (``GET /metrics``), with prometheus-client.

Each :class:`ServeMetrics` has its own registry, so several servers in one process (tests, Ray
replicas sharing a worker) never mix their series. Names follow Prometheus conventions (base units:
seconds, ``_total`` counters):

- ``kvforge_requests_total{route, status}``: HTTP requests answered, by route and status code
- ``kvforge_queue_depth``: requests waiting for a cache row (the scheduler's queue)
- ``kvforge_running_rows``: cache rows generating now
- ``kvforge_in_flight_sequences``: sequences admitted by the server and not finished (the 429 gauge)
- ``kvforge_time_to_first_token_seconds``: submission to the first generated token (histogram)
- ``kvforge_time_per_output_token_seconds``: decode time per token after the first (histogram)
- ``kvforge_sequences_finished_total{reason}``: sequences ended, by finish reason (stop, length,
  cancelled: a client that left)
- ``kvforge_prompt_tokens_total``, ``kvforge_generation_tokens_total``: tokens in and out
- ``kvforge_ignored_fields_total{field}``: valid requests that set an OpenAI field the server
  ignores (:data:`kvforge.tools.serve.fields.IGNORED`), by field
- ``kvforge_unknown_fields_total``: fields outside OpenAI's schema in valid requests (ignored and
  named in ``x-kvforge-ignored-fields``; no label: their names are the clients' choice)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from kvforge.tools.serve.serving import ModelServer

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _SchedulerCollector:
    """Gauges read from the scheduler at scrape time (no polling thread)."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server

    def collect(self):
        queued, running = self.server.scheduler_stats()
        for name, doc, value in (
            ("kvforge_queue_depth", "requests waiting for a cache row", queued),
            ("kvforge_running_rows", "cache rows generating now", running),
            ("kvforge_in_flight_sequences", "sequences admitted and not finished", self.server.in_flight),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], value)
            yield gauge


class ServeMetrics:
    def __init__(self, server: ModelServer) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvforge_requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "kvforge_time_to_first_token_seconds", "submission to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "kvforge_time_per_output_token_seconds", "time per token after the first", buckets=TPOT_BUCKETS, registry=r
        )
        self.finished = Counter(
            "kvforge_sequences_finished", "sequences ended, by finish reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("kvforge_prompt_tokens", "prompt tokens submitted", registry=r)
        self.generation_tokens = Counter("kvforge_generation_tokens", "tokens generated", registry=r)
        self.ignored_fields = Counter(
            "kvforge_ignored_fields", "requests that set an OpenAI field the server ignores", ["field"], registry=r
        )
        self.unknown_fields = Counter(
            "kvforge_unknown_fields", "fields outside OpenAI's schema, ignored (named in a header)", registry=r
        )
        r.register(_SchedulerCollector(server))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
