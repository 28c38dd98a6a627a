"""What every tandem server process (router or worker) is configured with: where it listens, its
tokens and TLS, its drain, metrics and health ports, and the bounds on what it accepts."""

from __future__ import annotations

import dataclasses

from tandem.common.auth import MIN_CLUSTER_TOKEN_CHARS, check_token
from tandem.common.drain import DEFAULT_DRAIN_SECONDS
from tandem.common.keepalive import DEFAULT_KEEPALIVE_SECONDS, check_keepalive
from tandem.common.limits import RequestLimits
from tandem.common.tls import TlsConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    # Admin RPCs need this bearer token when set; a router sends it on to the workers.
    admin_token: str | None = None
    # SIGTERM: seconds to finish in-flight requests (and KV handoffs) after health turns NOT_SERVING.
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    # Seconds between HTTP/2 pings to each peer with calls open; one unanswered that long closes
    # the connection (a peer that vanished without closing it: its calls end, their work stops); 0: none.
    keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS
    # Prometheus metrics over HTTP at /metrics on host:metrics_port; 0: none.
    metrics_port: int = 0
    # The internal plane's credential: a worker given one refuses every tandem RPC without it (and
    # keys the HMAC of KV handoffs with it); a router sends it on every call to a worker.
    cluster_token: str | None = None
    # Its server's certificate (a router's is the public face) and its identity towards the workers.
    tls: TlsConfig | None = None
    # Plaintext grpc.health.v1 alone on this port (probes that speak no TLS).
    health_port: int | None = None
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)

    def __post_init__(self):
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        check_keepalive(self.keepalive_seconds)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(
                f"metrics_port must be in [0, 65535] (0: no metrics server), got {self.metrics_port}"
            )
        check_token(self.admin_token, "--admin-token")
        check_token(self.cluster_token, "--cluster-token", MIN_CLUSTER_TOKEN_CHARS)
