"""The grpc.aio server every tandem process runs: health, reflection, access control, error
mapping, TLS when configured, and a graceful drain on SIGTERM/SIGINT (see drain.py)."""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.common.auth import AccessPolicy
from tandem.common.drain import DEFAULT_DRAIN_SECONDS, InFlightCalls
from tandem.common.health import LIVENESS_SERVICE, InstanceHealthServicer
from tandem.common.interceptors import Readiness
from tandem.common.keepalive import DEFAULT_KEEPALIVE_SECONDS, keepalive_options
from tandem.common.metrics import ProcessMetrics
from tandem.common.server_calls import ServerCalls
from tandem.common.tls import TlsConfig

log = logging.getLogger("tandem.server")

# Tokens of a long prompt, embeddings, tokenizer files: well above gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Peers in a cluster come and go (start-up order, restarts): reconnect within a second, not
    # after gRPC's default back-off of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


_DRAIN_POLL_S = 0.05
# After NOT_SERVING is set, how long at least before the server stops: the health Watch streams
# need a turn of the loop (or a few, on a busy machine) to write NOT_SERVING before stop cancels them.
_WATCH_FLUSH_S = 0.2

DrainCheck = Callable[[], "bool | Awaitable[bool]"]


class GrpcServer:
    def __init__(
        self,
        host: str,
        port: int,
        service_names: list[str],
        drain_seconds: float = DEFAULT_DRAIN_SECONDS,
        policy: AccessPolicy = AccessPolicy(),
        readiness: Readiness | None = None,
        metrics: ProcessMetrics | None = None,
        tls: TlsConfig | None = None,
        health_port: int | None = None,
        max_request_bytes: int = MAX_MESSAGE_BYTES,
        keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS,
    ):
        """tls: serve TLS (mTLS when it has a CA) instead of plaintext. health_port: also serve
        grpc.health.v1 alone in plaintext there, for probes that speak no TLS (Kubernetes')."""
        if drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {drain_seconds}")
        self.service_names = list(service_names)
        self.drain_seconds = drain_seconds
        self.in_flight = InFlightCalls()
        self._drain_checks: list[DrainCheck] = []
        # One interceptor for all of them (server_calls.py); the RPC counts are outermost: they see
        # the status every other concern answers with.
        interceptors = [
            ServerCalls(policy, self.in_flight, readiness, metrics.rpc_counts if metrics else None)
        ]
        # A request over max_request_bytes is refused (RESOURCE_EXHAUSTED) before it is parsed.
        options = dict(
            CHANNEL_OPTIONS,
            **{"grpc.max_receive_message_length": max_request_bytes},
            **dict(keepalive_options(keepalive_seconds)),
        )
        self.server = grpc.aio.server(interceptors=interceptors, options=list(options.items()))
        # Names this process to health checkers (health.py) and in a worker's state: a process
        # runs one server, so one id per process life, a new one on each restart.
        self.instance_id = uuid.uuid4().hex
        self.health = InstanceHealthServicer(self.instance_id)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            self.service_names
            + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        self.tls = tls
        self.port = _bind(self.server, host, port, tls)
        self.address = f"{host}:{self.port}"
        if metrics is not None:
            metrics.bind(self.address)
        self.health_server: grpc.aio.Server | None = None
        if health_port is not None:
            self.health_server = grpc.aio.server(options=CHANNEL_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = _bind(self.health_server, host, health_port, None)
        self._stop = asyncio.Event()
        self._force_stop = asyncio.Event()
        self._draining = False

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "listening on %s (%s)%s",
            self.address,
            "plaintext" if self.tls is None else "mTLS" if self.tls.is_mutual else "TLS",
            f", health on port {self.health_port}" if self.health_server is not None else "",
        )

    async def set_serving(self, serving: bool) -> None:
        """Readiness (the "" name and the served services); not liveness (LIVENESS_SERVICE).
        Once draining, never SERVING again."""
        if serving and self._draining:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in [""] + self.service_names:
            await self.health.set(name, status)

    async def fail(self, why: str) -> None:
        """The process cannot serve any more (why): readiness and liveness NOT_SERVING at once,
        and a stop without a drain."""
        log.error("%s: NOT_SERVING, stopping", why)
        self._draining = True
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stop.set()
        self._force_stop.set()

    def request_stop(self) -> None:
        """Starts the drain; a second request (a second Ctrl-C) cuts it short."""
        if self._stop.is_set():
            self._force_stop.set()
        self._stop.set()

    def add_drain_check(self, is_drained: DrainCheck) -> None:
        """Work beyond in-flight RPCs that a drain waits for: is_drained() (sync or async) is True once none is left."""
        self._drain_checks.append(is_drained)

    async def is_drained(self) -> bool:
        if self.in_flight.count:
            return False
        for check in self._drain_checks:
            result = check()
            if not (await result if inspect.isawaitable(result) else result):
                return False
        return True

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def wait_for_stop(self) -> None:
        """Returns when the process should exit: after a stop request, NOT_SERVING at once (health
        checkers stop sending work), then serving on until drained or drain_seconds are over;
        what is still in flight then is cancelled."""
        await self._stop.wait()
        # Readiness goes NOT_SERVING for good; liveness stays SERVING while the drain runs (a
        # draining process is alive: a liveness probe must not kill it mid-drain).
        self._draining = True
        await self.set_serving(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_seconds
        log.info(
            "draining %s: NOT_SERVING, up to %.1f s for in-flight work",
            self.address,
            self.drain_seconds,
        )
        flushed = loop.time() + min(_WATCH_FLUSH_S, self.drain_seconds)
        drained = await self.is_drained()
        while (
            (not drained or loop.time() < flushed)
            and loop.time() < deadline
            and not self._force_stop.is_set()
        ):
            await asyncio.sleep(_DRAIN_POLL_S)
            drained = await self.is_drained()
        if drained:
            log.info("stopping %s: drained", self.address)
        else:
            log.warning(
                "stopping %s: drain %s with %d call(s) in flight",
                self.address,
                "cut short" if self._force_stop.is_set() else "window over",
                self.in_flight.count,
            )
        await self.close()

    async def close(self) -> None:
        """Stops serving at once: the end of a drain, or of a start that failed after start()
        (grpc.aio's server must stop on its loop, not in a finalizer once the loop is gone)."""
        await self.server.stop(0)
        if self.health_server is not None:
            await self.health_server.stop(0)


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def advertised_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host peers reach a server at: advertise_host when given, else the bind host unless it
    is a wildcard, else this host's own name when it is a DNS name (a StatefulSet pod's FQDN,
    which kubelet's /etc/hosts gives), else its address (the hostname's, or the one the default
    route leaves from), else the bare host name: anything but 0.0.0.0, which a peer on another
    host would take for itself."""
    if advertise_host:
        return advertise_host
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    fqdn = socket.getfqdn()
    if "." in fqdn and not fqdn.startswith("localhost"):
        return fqdn
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(address).is_loopback:
            return address
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 9))  # no packet leaves: the route picks the source
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _bind(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None) -> int:
    address = f"{host}:{port}"
    bound = (
        server.add_insecure_port(address)
        if tls is None
        else server.add_secure_port(address, tls.server_credentials())
    )
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return bound
