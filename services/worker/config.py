"""A worker process's configuration."""
from __future__ import annotations

import dataclasses

from tandem.common.auth import MIN_CLUSTER_TOKEN_CHARS, check_token
from tandem.common.limits import RequestLimits
from tandem.common.roles import Role
from tandem.common.drain import DEFAULT_DRAIN_SECONDS
from tandem.common.tls import TlsConfig
from tandem.engine.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    role: Role
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    # NIXL's UCX progress thread: READs progress without polling, at the price of a busy core.
    nixl_progress_thread: bool = False
    # Admin RPCs need this bearer token when set.
    admin_token: str | None = None
    # SIGTERM: seconds to finish in-flight requests and KV handoffs after health turns NOT_SERVING.
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    # Prometheus metrics over HTTP at /metrics on host:metrics_port; 0: none.
    metrics_port: int = 0
    # Every tandem RPC needs this token when set (the internal plane); it also keys the HMAC of
    # KV handoffs, so a prefill or decode worker cannot run without one.
    cluster_token: str | None = None
    tls: TlsConfig | None = None
    # Plaintext grpc.health.v1 alone on this port (probes that speak no TLS).
    health_port: int | None = None
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)

    def __post_init__(self):
        if not isinstance(self.role, Role) or self.role is Role.UNKNOWN:
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535] (0: no metrics server), got {self.metrics_port}")
        check_token(self.admin_token, "--admin-token")
        check_token(self.cluster_token, "--cluster-token", MIN_CLUSTER_TOKEN_CHARS)
        if self.role.has_transceiver and not self.cluster_token:
            raise ValueError(
                f"a {self.role.label} worker needs the cluster token (--cluster-token or TANDEM_CLUSTER_TOKEN): it signs "
                "and verifies KV handoffs and authenticates the calls between tandem processes. Give the router and "
                "every worker the same one (`tandem up` and the Helm chart generate it), e.g. "
                "`export TANDEM_CLUSTER_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')`")
