"""The router's configuration."""

from __future__ import annotations

import dataclasses

from tandem.common.roles import Role
from tandem.common.server_config import ServerConfig
from tandem.router.discovery import parse_dns_targets
from tandem.router.policies import Policy, parse_routing

# Past this the "stream" is a few messages per request: use a non-streaming Generate instead.
MAX_STREAM_INTERVAL = 256


@dataclasses.dataclass(frozen=True)
class RouterConfig(ServerConfig):
    # Worker addresses (host:port); each worker reports its own role.
    workers: tuple[str, ...] = ()
    # DNS names (host:port, optionally ROLE=host:port) whose addresses are the workers: a
    # Kubernetes headless service per role, re-resolved every dns_interval_s.
    workers_dns: tuple[str, ...] = ()
    dns_interval_s: float = 5.0
    # Resolve the DNS names from this file ("NAME HOST:PORT" lines) instead of DNS.
    hosts_file: str | None = None
    # Pick policy per role (policies.py): "kv", or "prefill=kv,decode=least-load,both=round-robin".
    routing: str = "kv"
    # Dynamo's overlap_score_weight: blocks to compute count this much against blocks running.
    kv_overlap_weight: float = 1.0
    # Conditional disaggregation (TensorRT-LLM's max_local_prefill_length): a request whose
    # uncached prompt part is shorter than this runs whole on a decode worker; 0: always split.
    disagg_min_uncached_tokens: int = 0
    # ... as does every request while each prefill worker has at least this many prompt tokens
    # queued (the prefill pool is saturated); 0: never.
    disagg_prefill_queue_tokens: int = 0
    # Generate calls served at once; past it a call is refused RESOURCE_EXHAUSTED with a retry hint.
    max_in_flight: int = 4096
    # Seconds between health polls of the workers.
    health_interval_s: float = 1.0
    # Seconds a worker has to answer a health check (or a stalled stream's probe) before it is down.
    health_timeout_s: float = 1.0
    # Seconds a stream may go without a message before its worker is probed.
    stream_progress_timeout_s: float = 10.0
    # A streamed request's messages to its client carry at least this many new tokens each
    # (the first and the last go at once): fewer gRPC writes per token. 1: every step's tokens.
    stream_interval: int = 1

    def __post_init__(self):
        super().__post_init__()
        if not self.workers and not self.workers_dns:
            raise ValueError(
                "the router needs worker addresses (--workers host:port,...) or DNS names "
                "(--workers-dns prefill=host:port,...)"
            )
        for address in self.workers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address {address!r} is not host:port")
        parse_dns_targets(self.workers_dns)
        parse_routing(self.routing)
        for name in ("dns_interval_s", "kv_overlap_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("disagg_min_uncached_tokens", "disagg_prefill_queue_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(
                f"stream_interval must be between 1 and {MAX_STREAM_INTERVAL}, got {self.stream_interval}"
            )
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError(f"worker addresses repeat: {list(self.workers)}")
        for name in ("health_interval_s", "health_timeout_s", "stream_progress_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def policies(self) -> dict[Role, Policy]:
        return parse_routing(self.routing)
