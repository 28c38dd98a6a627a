"""Prometheus metrics every tandem process serves (prometheus-client): one registry per process,
an HTTP port bound on the gRPC host (--metrics-port), the gRPC interceptor that counts RPCs by
status code, and the request metrics the router and the workers both keep.

Names are vLLM's (vllm/v1/metrics/loggers.py) under the `tandem:` prefix where vLLM has one, with
its types and buckets; every series carries the process's role and worker id, the LLM ones the
model name too (vLLM's model_name). The router's request metrics are the client's view
(role="router"); a worker's are what it served (a prefill: the context phases it handed off).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from tandem.common.interceptors import wrap_handler
from tandem.v1 import types_pb2

# vLLM's buckets (loggers.py), so dashboards built for vLLM read tandem's histograms alike.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# vLLM's build_1_2_5_buckets, up to a million tokens (the router does not know max_model_len).
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)

# model_name, role, worker_id: on every LLM-level series.
BASE_LABELS = ("model_name", "role", "worker_id")


def process_id(address: str) -> str:
    """The worker_id label: the gRPC address, with a wildcard host (0.0.0.0, [::]) replaced by
    the host name (a pod's name in Kubernetes), so that pods of one StatefulSet differ."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        return f"{socket.gethostname()}:{port}"
    return address


def finish_reason_label(reason: int) -> str:
    """FINISH_REASON_STOP -> "stop", as the API spells it."""
    return types_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


class ProcessMetrics:
    """The registry of one process, its labels and what every process counts (RPCs by code)."""

    def __init__(self, role: str, model_name: str = ""):
        self.role = role
        self.model_name = model_name  # the router learns it from its first ready worker
        self.worker_id = ""  # set once the gRPC port is bound (bind())
        # No *_created series: one process serves one role, and vLLM's dashboards do not read them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.rpcs_handled = Counter(
            "tandem:grpc_server_handled",
            "RPCs completed on this server, by method and gRPC status code",
            ["role", "worker_id", "grpc_service", "grpc_method", "grpc_code"],
            registry=self.registry,
        )
        self.requests = RequestMetrics(self)
        self.rpc_counts = RpcCounts(self)
        self._http: tuple | None = None

    @property
    def labels(self) -> tuple[str, str, str]:
        return self.model_name, self.role, self.worker_id

    def bind(self, address: str) -> None:
        """The gRPC address this process serves on names it in the worker_id label."""
        self.worker_id = process_id(address)

    def serve_http(self, host: str, port: int) -> str | None:
        """Serves /metrics on host:port in a daemon thread (port 0: no metrics server). Raises
        OSError when the port cannot be bound, as the gRPC port does. Returns the URL."""
        if port == 0:
            return None
        try:
            self._http = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(
                f"cannot bind the metrics port {host}:{port} ({exc.strerror}); pass another "
                f"--metrics-port, or 0 for none"
            ) from exc
        return f"http://{host}:{port}/metrics"

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None


class RpcCounts:
    """Counts every RPC by its final status code (and each Generate that came on a session, as
    one). Outermost of the server's wrappers (server_calls.py), so that the statuses the others
    answer with (auth, readiness, error mapping) count too."""

    def __init__(self, metrics: ProcessMetrics):
        self._metrics = metrics
        # (method, code, worker_id) -> its counter: labels() costs more than the increment.
        self._counters: dict[tuple[str, grpc.StatusCode, str], object] = {}

    def count(
        self, method: str, context: grpc.aio.ServicerContext, exc: BaseException | None
    ) -> None:
        """One RPC of method ended, with exc (None: returned)."""
        self.count_code(method, status_code(context, exc))

    def count_code(self, method: str, code: grpc.StatusCode) -> None:
        """One RPC of method ended with code (also a Generate that came on a session)."""
        m = self._metrics
        key = (method, code, m.worker_id)
        counter = self._counters.get(key)
        if counter is None:
            service, _, name = method.lstrip("/").rpartition("/")
            counter = self._counters[key] = m.rpcs_handled.labels(
                m.role, m.worker_id, service, name, code.name
            )
        counter.inc()

    @contextlib.asynccontextmanager
    async def _counting(self, method: str, context: grpc.aio.ServicerContext):
        try:
            yield
        except BaseException as exc:
            self.count(method, context, exc)
            raise
        self.count(method, context, None)

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler | None
    ) -> grpc.RpcMethodHandler | None:
        return wrap_handler(handler, lambda context: self._counting(method, context))


def status_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    """The status an RPC ended with: the one set on its context (context.abort, set_code),
    CANCELLED when the client went away, UNKNOWN for an exception nothing turned into a status."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    if code is not None:
        return code
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


def one_sample(family_type, name: str, doc: str, labels: list[str], value: float):
    """A metric family of one series (a collector's gauge or counter read at scrape time)."""
    family = family_type(name, doc, labels=BASE_LABELS)
    family.add_metric(labels, value)
    return family


class RequestMetrics:
    """vLLM's request-level metrics, recorded once per Generate that delivers its last message
    (a failed one counts under its status code in tandem:grpc_server_handled instead)."""

    def __init__(self, process: ProcessMetrics):
        self.process = process
        reg, base = process.registry, list(BASE_LABELS)
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            base,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "tandem:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (after the first; one per request).",
            base,
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Histogram of the time between a request's messages of new tokens after the first "
            "(one per message: a message of several tokens is one interval).",
            base,
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            base,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens",
            "Number of prompt tokens of the requests served.",
            base,
            registry=reg,
        )
        self.generation_tokens = Counter(
            "tandem:generation_tokens", "Number of generation tokens produced.", base, registry=reg
        )
        self.request_prompt_tokens = Histogram(
            "tandem:request_prompt_tokens",
            "Number of prompt tokens per request.",
            base,
            buckets=TOKEN_BUCKETS,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            "tandem:request_generation_tokens",
            "Number of generation tokens per request.",
            base,
            buckets=TOKEN_BUCKETS,
            registry=reg,
        )
        self.request_success = Counter(
            "tandem:request_success",
            "Count of finished sequences by finish reason (handoff: a context phase "
            "whose KV went to a decode worker).",
            base + ["finished_reason"],
            registry=reg,
        )

    def track(self) -> RequestTracker:
        """Starts the clock of one request (call it when the request arrives)."""
        return RequestTracker(self)

    def record(
        self,
        tracker: RequestTracker,
        num_prompt_tokens: int,
        num_tokens: dict[int, int],
        reasons: dict[int, str],
    ) -> None:
        labels = self.process.labels
        end = time.monotonic()
        total = sum(num_tokens.values())
        self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(total)
        self.request_prompt_tokens.labels(*labels).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(total)
        self.e2e.labels(*labels).observe(end - tracker.started)
        for reason in reasons.values():
            self.request_success.labels(*labels, reason).inc()
        first = tracker.first_token_at
        if first is None:
            return
        self.ttft.labels(*labels).observe(first - tracker.started)
        longest = max(num_tokens.values(), default=0)
        if longest >= 2:
            self.tpot.labels(*labels).observe((end - first) / (longest - 1))


class RequestTracker:
    """One request's clock, kept by the text front (TextFront.respond): saw() each message of the
    token-id stream a process gets from whatever produces it (the engine, the workers): the first
    token's time; counted() each message the client gets (stop strings applied, merged when not
    streaming): the tokens and finish reasons, recorded with the last message."""

    def __init__(self, metrics: RequestMetrics):
        self.metrics = metrics
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        # When the client's last message with new tokens went out (inter-token latency).
        self._last_tokens_at: float | None = None
        # The histogram's series for this process, bound once.
        self._itl = metrics.itl.labels(*metrics.process.labels)
        # What the client got so far, per sequence index: tokens and finish reasons.
        self._num_tokens: dict[int, int] = {}
        self._reasons: dict[int, str] = {}

    def saw(self, msg: types_pb2.RequestOutput) -> None:
        """One message of the token-id stream."""
        if self.first_token_at is None and any(out.token_ids for out in msg.outputs):
            self.first_token_at = time.monotonic()

    def counted(self, msg: types_pb2.RequestOutput, num_prompt_tokens: int) -> None:
        """One message the client gets; the last one records."""
        if any(out.token_ids for out in msg.outputs):
            self._tokens_out()
        for out in msg.outputs:
            self._num_tokens[out.index] = self._num_tokens.get(out.index, 0) + len(out.token_ids)
            if out.disaggregated_params.opaque_state:  # a context phase's 'not_finished'
                self._reasons[out.index] = "handoff"
            elif out.finish_reason:
                self._reasons[out.index] = finish_reason_label(out.finish_reason)
        if msg.finished:
            self.metrics.record(self, num_prompt_tokens, self._num_tokens, self._reasons)

    def count_tokens(self, index: int, num_tokens: int) -> None:
        """What counted() does for a message of num_tokens tokens of sequence index and nothing else."""
        self._num_tokens[index] = self._num_tokens.get(index, 0) + num_tokens
        if num_tokens:
            self._tokens_out()

    def _tokens_out(self) -> None:
        """A message with new tokens went out: the interval since the last one is observed."""
        now = time.monotonic()
        if self._last_tokens_at is not None:
            self._itl.observe(now - self._last_tokens_at)
        self._last_tokens_at = now
