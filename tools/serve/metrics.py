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
- ``kvforge_prompt_tokens_cached_total``: prompt tokens of finished sequences taken from the prefix
  cache instead of prefilled
- ``kvforge_unexpected_errors_total{route}``: exceptions a route let out (bugs), answered with a 500
  error object (or a stream's last error event); each is in the log with its traceback

The prefix cache's own series (read from the engine's pool at scrape time; absent when it is off),
with vLLM's meaning of queries and hits (tokens, not requests):

- ``kvforge_prefix_cache_queries_total``: prompt tokens looked up (vLLM ``prefix_cache_queries``)
- ``kvforge_prefix_cache_hits_total``: of those, found in the cache (vLLM ``prefix_cache_hits``);
  the hit rate is hits / queries
- ``kvforge_prefix_cache_requests_total``, ``kvforge_prefix_cache_hit_requests_total``: lookups,
  and lookups that found at least one block
- ``kvforge_prefix_cache_evictions_total``: blocks evicted to stay within the budget
- ``kvforge_prefix_cache_bytes``, ``kvforge_prefix_cache_budget_bytes``,
  ``kvforge_prefix_cache_blocks``: host memory in use, its budget, blocks held
- speculative decoding (vLLM's names): ``kvforge_spec_decode_num_drafts_total`` (verify calls with
  drafts), ``kvforge_spec_decode_num_draft_tokens_total`` (tokens drafted),
  ``kvforge_spec_decode_num_accepted_tokens_total`` (of them accepted). Acceptance rate = accepted /
  draft tokens; tokens per target call of a drafting step = 1 + accepted / drafts
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class ModelServer(Protocol):
    """What the collectors read of a server at scrape time (:class:`~.serving.ModelServer` has it;
    a protocol here keeps this module below the serving layer)."""

    engine: Any  # its prefix_pool
    in_flight: int

    def scheduler_stats(self) -> tuple[int, int]:
        """(queued, running) sequences."""


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


class _PrefixCacheCollector:
    """The prefix pool's statistics at scrape time (nothing when the engine has no pool)."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server

    def collect(self):
        pool = self.server.engine.prefix_pool
        if pool is None:
            return
        s = pool.stats()
        for name, doc, value in (
            ("kvforge_prefix_cache_queries", "prompt tokens looked up in the prefix cache", s.queries),
            ("kvforge_prefix_cache_hits", "prompt tokens found in the prefix cache", s.hits),
            ("kvforge_prefix_cache_requests", "prefix cache lookups", s.requests),
            ("kvforge_prefix_cache_hit_requests", "prefix cache lookups that found a block", s.hit_requests),
            ("kvforge_prefix_cache_evictions", "prefix cache blocks evicted", s.evictions),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("kvforge_prefix_cache_bytes", "host memory held by the prefix cache", s.bytes),
            ("kvforge_prefix_cache_budget_bytes", "the prefix cache's byte budget", s.budget),
            ("kvforge_prefix_cache_blocks", "blocks held by the prefix cache", s.blocks),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


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
        self.cached_tokens = Counter(
            "kvforge_prompt_tokens_cached", "prompt tokens taken from the prefix cache", registry=r
        )
        self.spec_drafts = Counter("kvforge_spec_decode_num_drafts", "verify calls with drafted tokens", registry=r)
        self.spec_draft_tokens = Counter(
            "kvforge_spec_decode_num_draft_tokens", "tokens drafted and verified", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "kvforge_spec_decode_num_accepted_tokens", "drafted tokens accepted", registry=r
        )
        self.unexpected_errors = Counter(
            "kvforge_unexpected_errors", "exceptions a route let out (bugs), answered with a 500", ["route"], registry=r
        )
        r.register(_SchedulerCollector(server))
        r.register(_PrefixCacheCollector(server))

    def observe_speculative(self, result) -> None:
        """Count a finished request's drafting (a no-op without speculative decoding)."""
        if result.drafted_tokens:
            self.spec_drafts.inc(result.verify_steps)
            self.spec_draft_tokens.inc(result.drafted_tokens)
            self.spec_accepted_tokens.inc(result.accepted_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
