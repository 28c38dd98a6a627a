"""The router's Prometheus metrics: the client's view of each request (tandem.common.metrics,
role="router"), failover (migrations, prefill retries), and its view of the workers."""

from __future__ import annotations

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.common.metrics import BASE_LABELS, ProcessMetrics, one_sample


class RouterMetrics(ProcessMetrics):
    def __init__(self):
        super().__init__("router")
        reg, base = self.registry, list(BASE_LABELS)
        self.migrations = Counter(
            "tandem:router_migrations",
            "Requests moved to another worker after theirs died mid-stream.",
            base,
            registry=reg,
        )
        self.prefill_retries = Counter(
            "tandem:router_prefill_retries",
            "Context phases retried on another prefill worker after theirs died.",
            base,
            registry=reg,
        )
        self.busy_refusals = Counter(
            "tandem:router_busy_refusals",
            "Generate calls refused RESOURCE_EXHAUSTED "
            "(with a retry hint) because --max-in-flight were running.",
            base,
            registry=reg,
        )
        self.disagg_decisions = Counter(
            "tandem:router_disagg_decisions",
            "Requests that could be split: split "
            "(prefill worker, then decode worker) or run whole on a decode worker "
            "(local), and why.",
            base + ["decision", "reason"],
            registry=reg,
        )
        self.kv_handoffs = Counter(
            "tandem:router_kv_handoffs",
            "Split requests by how their KV handoff ended, per prefill->decode pair: pulled, "
            "recomputed (and why), released, cancelled, failed, as the decode reported it; "
            "recomputed:migrated where the decode went away under the request.",
            base + ["prefill", "decode", "outcome", "reason"],
            registry=reg,
        )

        self.announcements = Counter(
            "tandem:router_decode_announcements",
            "Split requests announced to their decode worker at the context phase's start "
            "(--no-announce-decode off), by how the announcement ended: handed_off (the handoff "
            "went to it, or its decode failed the pull of the prefill's own handoff first: a "
            "failed pull, retried on another pair), dropped (no generation phase: the context "
            "phase failed, ended the request or was aborted), resent (the decode failed before "
            "its handoff: the request went whole to a decode picked then).",
            base + ["outcome"],
            registry=reg,
        )

    def announcement_ended(self, outcome: str) -> None:
        self.announcements.labels(*self.labels, outcome).inc()

    def kv_handoff_ended(self, prefill: str, decode: str, outcome: str, reason: str) -> None:
        self.kv_handoffs.labels(*self.labels, prefill, decode, outcome, reason).inc()

    def disagg_decided(self, split: bool, reason: str) -> None:
        self.disagg_decisions.labels(*self.labels, "split" if split else "local", reason).inc()

    def refused_busy(self) -> None:
        self.busy_refusals.labels(*self.labels).inc()

    def migrated(self) -> None:
        self.migrations.labels(*self.labels).inc()

    def prefill_retried(self) -> None:
        self.prefill_retries.labels(*self.labels).inc()

    def watch(self, servicer) -> None:
        """Reads servicer (a router.servicer.RouterServicer) at each scrape."""
        self.registry.register(_RouterCollector(self, servicer))


class _RouterCollector(Collector):
    def __init__(self, metrics: RouterMetrics, servicer):
        self.metrics = metrics
        self.servicer = servicer

    def collect(self):
        labels = list(self.metrics.labels)
        yield one_sample(
            GaugeMetricFamily,
            "tandem:router_requests_in_flight",
            "Generate calls the router is serving now.",
            labels,
            len(self.servicer.routes),
        )
        workers = GaugeMetricFamily(
            "tandem:router_worker_ready",
            "1 while the router sees the worker ready.",
            labels=BASE_LABELS + ("worker", "worker_role"),
        )
        for w in list(self.servicer.pool.workers):
            workers.add_metric(labels + [w.address, w.role.label], 1 if w.ready else 0)
        yield workers
