"""A worker's Prometheus metrics: the engine's state and steps, the prefill's KV leases, the
decode's KV pulls, on top of what every process keeps (tandem.common.metrics).

Nothing here runs on the engine thread. Its per-step record (the iteration stats it hands to
the loop anyway) is observed on the loop; gauges and lease counts are read when Prometheus
scrapes, the engine's through a ReadCounters command answered between two steps.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.common.metrics import BASE_LABELS, ProcessMetrics, one_sample
from tandem.common.roles import Role
from tandem.engine.messages import ReadCounters
from tandem.prefill.lease_keeper import LeaseEnd

log = logging.getLogger("tandem.worker.metrics")

STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# vLLM's vllm:iteration_tokens_total buckets.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A KV pull waits for its reservation and may run up to its 30 s timeout.
KV_TRANSFER_BUCKETS = (*STEP_BUCKETS, 30.0)
# Queue, prefill and decode times (vLLM's request_*_time_seconds buckets, up to an hour).
PHASE_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
    160.0, 320.0, 640.0, 1280.0, 2560.0, 3600.0,
)  # fmt: skip
# How long a scrape waits for the engine thread to answer between two steps.
SNAPSHOT_TIMEOUT_S = 2.0


class WorkerMetrics(ProcessMetrics):
    def __init__(self, role: Role, model_dir: str):
        super().__init__(role.label, Path(model_dir).name)
        reg, base = self.registry, list(BASE_LABELS)
        self.step_seconds = Histogram(
            "tandem:engine_step_duration_seconds",
            "Engine steps: seconds from launch to the sampled tokens on the host.",
            base,
            buckets=STEP_BUCKETS,
            registry=reg,
        )
        self.step_batch_size = Histogram(
            "tandem:engine_step_batch_size",
            "Engine steps: sequences in the batch.",
            base,
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self.iteration_tokens = Histogram(
            "tandem:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            base,
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=reg,
        )
        self.kv_transfer_bytes = Counter(
            "tandem:kv_transfer_bytes",
            "Bytes of KV pulled from prefill workers.",
            base,
            registry=reg,
        )
        self.kv_transfer_seconds = Histogram(
            "tandem:kv_transfer_seconds",
            "KV pulls from prefill workers: seconds from the request's reservation "
            "to its blocks landing.",
            base,
            buckets=KV_TRANSFER_BUCKETS,
            registry=reg,
        )
        # vLLM's request phases, of each request that ended with its last output here.
        self.request_phase_seconds = {
            phase: Histogram(
                f"tandem:request_{phase}_time_seconds",
                doc,
                base,
                buckets=PHASE_BUCKETS,
                registry=reg,
            )
            for phase, doc in (
                ("queue", "Seconds from a request's arrival here to its first scheduled step."),
                ("prefill", "Seconds from a request's first scheduled step to its first token."),
                ("decode", "Seconds from a request's first token to its last."),
                ("inference", "Seconds from a request's first scheduled step to its last token."),
            )
        }
        # Per prefill peer: the READ alone, so that its rate is the lane's (kv_transfer_seconds above
        # also holds the wait for the peer's state and the lease's confirm).
        peer = base + ["peer"]
        self.kv_pull_seconds = Histogram(
            "tandem:kv_pull_seconds",
            "KV pulls by prefill peer: seconds of the NIXL READ (bytes in tandem:kv_pull_bytes).",
            peer,
            buckets=KV_TRANSFER_BUCKETS,
            registry=reg,
        )
        self.kv_pull_bytes = Counter(
            "tandem:kv_pull_bytes", "KV pulls by prefill peer: bytes read.", peer, registry=reg
        )
        # A decode's handoffs by how they ended (a prefill counts its leases as kv_handoffs
        # without labels: the collector below; one process serves one role).
        self.kv_handoff_outcomes = (
            Counter(
                "tandem:kv_handoffs",
                "KV handoffs that reached this decode, by outcome (pulled, recomputed, released, "
                "cancelled, failed) and, for recomputed, the reason (no_room, lease_expiring, "
                "pull_failed, peer_unreachable, unconfirmed).",
                base + ["outcome", "reason"],
                registry=reg,
            )
            if role is Role.DECODE
            else None
        )
        # Cross-worker prefix pulls by how they ended (decode/prefix_pull.py).
        self.kv_prefix_pulls = Counter(
            "tandem:kv_prefix_pulls",
            "Cross-worker prefix pulls tried here, by outcome (pulled, partly_pulled, cancelled, "
            "computed) and, for computed, the reason (nothing_leased, peer_unreachable, "
            "incompatible, weights_mismatch, no_room, pull_failed, unconfirmed, cached).",
            base + ["outcome", "reason"],
            registry=reg,
        )
        self._last_step = 0

    def watch(self, runtime) -> None:
        """Reads runtime (a worker.runtime.WorkerRuntime) at each scrape."""
        self.registry.register(_WorkerCollector(self, runtime))

    def observe_step(self, stats: dict) -> None:
        """On the loop: one engine iteration's record (engine/iteration_stats.py). A call that ran
        no step (everything waits for blocks) repeats the last one's numbers: skipped."""
        if stats["iter"] == self._last_step:
            return
        self._last_step = stats["iter"]
        batch = stats["inflightBatchingStats"]
        labels = self.labels
        self.step_seconds.labels(*labels).observe(stats["iterLatencyMS"] / 1e3)
        self.step_batch_size.labels(*labels).observe(batch.get("numScheduledRequests", 0))
        self.iteration_tokens.labels(*labels).observe(
            batch.get("numCtxTokens", 0) + batch.get("numGenRequests", 0)
        )

    def observe_request_phases(
        self, arrival: float, scheduled_at: float, first_token_at: float, finished_at: float
    ) -> None:
        """One request's phases (time.monotonic() moments): arrival here, its first scheduled
        step, its first token, its end."""
        labels = self.labels
        for phase, seconds in (
            ("queue", scheduled_at - arrival),
            ("prefill", first_token_at - scheduled_at),
            ("decode", finished_at - first_token_at),
            ("inference", finished_at - scheduled_at),
        ):
            self.request_phase_seconds[phase].labels(*labels).observe(max(0.0, seconds))

    def observe_kv_pull(self, num_bytes: int, seconds: float) -> None:
        labels = self.labels
        self.kv_transfer_bytes.labels(*labels).inc(num_bytes)
        self.kv_transfer_seconds.labels(*labels).observe(seconds)

    def observe_peer_pull(self, peer: str, num_bytes: int, seconds: float) -> None:
        labels = (*self.labels, peer)
        self.kv_pull_seconds.labels(*labels).observe(seconds)
        self.kv_pull_bytes.labels(*labels).inc(num_bytes)

    def observe_handoff_outcome(self, outcome: str, reason: str) -> None:
        if self.kv_handoff_outcomes is not None:
            self.kv_handoff_outcomes.labels(*self.labels, outcome, reason).inc()

    def observe_prefix_pull(self, outcome: str, reason: str) -> None:
        self.kv_prefix_pulls.labels(*self.labels, outcome, reason).inc()

    def forget_peer(self, peer: str) -> None:
        """The decode no longer keeps peer's link: its series go too."""
        labels = (*self.labels, peer)
        for family in (self.kv_pull_seconds, self.kv_pull_bytes):
            try:
                family.remove(*labels)
            except KeyError:
                pass


class _WorkerCollector(Collector):
    """Gauges and counters the worker already keeps, read at scrape time (the HTTP thread)."""

    def __init__(self, metrics: WorkerMetrics, runtime):
        self.metrics = metrics
        self.runtime = runtime

    def collect(self):
        labels = list(self.metrics.labels)
        yield from self._cache_config(labels)
        yield from self._engine(labels)
        keeper = self.runtime.leases
        if keeper is None:
            return
        yield one_sample(
            CounterMetricFamily,
            "tandem:kv_handoffs",
            "Context phases handed off: KV leases opened.",
            labels,
            keeper.num_opened,
        )
        endings = CounterMetricFamily(
            "tandem:kv_lease_endings",
            "KV leases ended, by way: pulled, fallback (the decode computed the prompt), "
            "released (ReleaseKv), undelivered, stopped, paused, expired.",
            labels=BASE_LABELS + ("way",),
        )
        counts = dict(keeper.endings)
        for way in LeaseEnd:
            endings.add_metric(labels + [way.value], counts.get(way.value, 0))
        yield endings
        yield one_sample(
            GaugeMetricFamily,
            "tandem:kv_leases_active",
            "KV leases open now.",
            labels,
            keeper.num_leases,
        )
        yield one_sample(
            GaugeMetricFamily,
            "tandem:kv_leased_blocks",
            "KV blocks held by open leases.",
            labels,
            keeper.num_leased_blocks,
        )

    def _cache_config(self, labels: list[str]):
        """vLLM's cache_config_info: the KV cache's settings as labels of a gauge of 1."""
        core = self.runtime.core
        if core is None:  # loading, or an encoder-only model
            return
        config, facts = self.runtime.config.engine, core.facts
        settings = {
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(facts.limits.num_blocks),
            "cache_dtype": facts.cache_dtype,
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "kv_cache_memory_gb": str(config.kv_cache_memory_gb),
        }
        family = GaugeMetricFamily(
            "tandem:cache_config_info",
            "Information of the KV cache's configuration (vLLM's cache_config_info).",
            labels=BASE_LABELS + tuple(settings),
        )
        family.add_metric(labels + list(settings.values()), 1)
        yield family

    def _engine(self, labels: list[str]):
        core = self.runtime.core
        if core is None:  # loading, or an encoder-only model
            return
        try:
            snap = asyncio.run_coroutine_threadsafe(core.call(ReadCounters()), core.loop).result(
                SNAPSHOT_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - a scrape must answer: without the engine's numbers then
            log.warning("engine counters unavailable for a scrape: %r", exc)
            return
        usage = 1 - snap.num_free_blocks / snap.num_total_blocks if snap.num_total_blocks else 0.0
        for family_type, name, doc, value in (
            (
                GaugeMetricFamily,
                "tandem:num_requests_running",
                "Number of requests in model execution batches.",
                snap.num_running,
            ),
            (
                GaugeMetricFamily,
                "tandem:num_requests_waiting",
                "Number of requests waiting to be processed (queued, "
                "or waiting for their KV from a prefill worker).",
                snap.num_waiting + snap.num_waiting_for_remote_kv,
            ),
            (
                GaugeMetricFamily,
                "tandem:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                usage,
            ),
            (
                CounterMetricFamily,
                "tandem:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                snap.num_prefix_query_tokens,
            ),
            (
                CounterMetricFamily,
                "tandem:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                snap.num_prefix_hit_tokens,
            ),
            (
                CounterMetricFamily,
                "tandem:num_preemptions",
                "Cumulative number of preemption from the engine.",
                snap.num_preemptions,
            ),
            (CounterMetricFamily, "tandem:engine_steps", "Engine steps run.", snap.num_steps),
            (
                CounterMetricFamily,
                "tandem:spec_decode_num_drafts",
                "Speculative decoding: sequence-steps that verified drafts.",
                snap.num_drafted_steps,
            ),
            (
                CounterMetricFamily,
                "tandem:spec_decode_num_draft_tokens",
                "Speculative decoding: draft tokens verified.",
                snap.num_draft_tokens,
            ),
            (
                CounterMetricFamily,
                "tandem:spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens accepted (each one a token without a step).",
                snap.num_accepted_draft_tokens,
            ),
        ):
            yield one_sample(family_type, name, doc, labels, value)
