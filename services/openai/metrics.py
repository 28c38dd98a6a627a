"""The front's own Prometheus metrics: requests by endpoint and HTTP status, latencies, tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class FrontMetrics:
    """One registry per app, so several fronts in one process (tests) keep separate counts."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tandem_openai_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tandem_openai_request_duration_seconds",
            "Time to the last byte of a response",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tandem_openai_time_to_first_token_seconds",
            "Time to the first streamed token",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tandem_openai_prompt_tokens",
            "Prompt tokens of finished requests",
            ["endpoint"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "tandem_openai_generation_tokens",
            "Generated tokens of finished requests",
            ["endpoint"],
            registry=self.registry,
        )
