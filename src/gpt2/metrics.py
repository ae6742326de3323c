"""The server's Prometheus metrics (GET /metrics), through prometheus_client.

    curl -s http://127.0.0.1:8000/metrics | grep gpt2_

Counters and histograms are updated by server.py as requests and tokens pass the HTTP edge; the
scheduler's own state (queue depth, running batch, KV memory) is read from `Scheduler.stats()` at
scrape time, so it is never stale. Each app has its own registry (tests run several servers in one
process; nothing goes into prometheus_client's global one).

    gpt2_requests_total{endpoint, status}       HTTP requests answered, by route and status code
    gpt2_prompt_tokens_total                    prompt tokens submitted (once per prompt, not per choice)
    gpt2_generation_tokens_total                tokens generated, all choices
    gpt2_time_to_first_token_seconds            submit -> a choice's first token reaches the edge
    gpt2_inter_token_latency_seconds            gaps between one choice's successive tokens
    gpt2_queue_depth, gpt2_running_sequences    sequences waiting for a batch row; rows decoding
    gpt2_kv_cache_bytes, gpt2_kv_cache_limit_bytes, gpt2_prefix_cache_bytes
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds: a tiny model on a GPU answers in a millisecond, a 1.5B one on two CPU cores in seconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

SCHEDULER_GAUGES = {  # Scheduler.stats() key: (metric name, help)
    "queue_depth": ("gpt2_queue_depth", "Sequences waiting for a row in the decode batch"),
    "running": ("gpt2_running_sequences", "Sequences in the decode batch (its running size)"),
    "kv_bytes": ("gpt2_kv_cache_bytes", "Bytes of KV cache allocated now"),
    "kv_limit_bytes": ("gpt2_kv_cache_limit_bytes", "The KV cache limit in bytes (--max-kv-mb; 0: none)"),
    "prefix_cache_bytes": ("gpt2_prefix_cache_bytes", "Bytes of KV held by the prefix cache"),
}


SPECULATION_COUNTERS = {  # SpeculationStats field (gpt2 serve --draft): (metric name, help)
    "rounds": ("gpt2_speculative_rounds", "Speculative rounds run for lone requests"),
    "proposed": ("gpt2_draft_tokens_proposed", "Tokens the draft proposed"),
    "accepted": ("gpt2_draft_tokens_accepted", "Proposed tokens the target kept"),
}


class _SchedulerCollector:
    """The scheduler's gauges, read from one stats() call per scrape, and its speculation counters."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        stats = self.scheduler.stats()
        for key, (name, help) in SCHEDULER_GAUGES.items():
            yield GaugeMetricFamily(name, help, value=float(stats[key] or 0))
        speculation = self.scheduler.speculation
        for key, (name, help) in SPECULATION_COUNTERS.items():
            yield CounterMetricFamily(name, help, value=float(getattr(speculation, key)))


class ServerMetrics:
    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.requests = Counter("gpt2_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("gpt2_prompt_tokens", "Prompt tokens submitted", registry=self.registry)
        self.generation_tokens = Counter("gpt2_generation_tokens", "Tokens generated", registry=self.registry)
        self.time_to_first_token = Histogram("gpt2_time_to_first_token_seconds",
                                             "Seconds from submission to a choice's first token",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram("gpt2_inter_token_latency_seconds",
                                             "Seconds between a choice's successive tokens",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_SchedulerCollector(scheduler))

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
