"""The router's configuration."""

from __future__ import annotations

import dataclasses

from tandem.common.flag_fields import flag_field, split_list
from tandem.common.roles import Role
from tandem.common.server_config import ServerConfig
from tandem.router.discovery import parse_dns_targets
from tandem.router.policies import Policy, parse_routing
from tandem.router.prefix_source import PrefixPullCost

# Past this the "stream" is a few messages per request: use a non-streaming Generate instead.
MAX_STREAM_INTERVAL = 256


# The fields whoever starts the router sets for it (`tandem up` wires its own workers): the
# flags of `tandem serve router` only.
DISCOVERY_FIELDS = ("workers", "workers_dns", "dns_interval_s", "hosts_file")


@dataclasses.dataclass(frozen=True)
class RouterConfig(ServerConfig):
    """The router's own settings (the server's are ServerConfig's): each field is also its flag
    of `tandem serve router` (and, but for DISCOVERY_FIELDS, of `tandem up`), and where the chart
    has it, the router value of the flag's name in camelCase (checked by a test)."""

    workers: tuple[str, ...] = flag_field(
        (), "comma-separated worker addresses host:port", type=split_list
    )
    workers_dns: tuple[str, ...] = flag_field(
        (),
        "comma-separated DNS names [ROLE=]HOST:PORT whose addresses are the workers (a "
        "Kubernetes headless service per role), re-resolved every --dns-interval seconds",
        type=split_list,
    )
    dns_interval_s: float = flag_field(
        5.0, "seconds between DNS resolutions", flag="--dns-interval"
    )
    hosts_file: str | None = flag_field(
        None, "resolve --workers-dns names from this file of 'NAME HOST:PORT' lines instead of DNS"
    )
    routing: str = flag_field(
        "kv",
        "pick policy per role: kv, least-load, round-robin or conversation; one for all roles or "
        "e.g. prefill=kv,decode=least-load",
    )
    kv_overlap_weight: float = flag_field(
        1.0,
        "kv policy: weight of the blocks to compute against the blocks running (Dynamo's "
        "overlap_score_weight)",
    )
    # Conditional disaggregation (TensorRT-LLM's max_local_prefill_length).
    disagg_min_uncached_tokens: int = flag_field(
        0,
        "run a request whole on a decode worker when the uncached part of its prompt is shorter "
        "than this (0: always split when prefill workers exist)",
    )
    disagg_prefill_queue_tokens: int = flag_field(
        0,
        "run requests whole on decode workers while every prefill worker has this many prompt "
        "tokens queued (0: never)",
    )
    announce_decode: bool = flag_field(
        True,
        "off: send a split request's generation phase to its decode worker after its context "
        "phase ends, not when it starts (by default the decode takes it in while the prompt is "
        "computed and pulls the KV as soon as the handoff comes)",
        flag="--no-announce-decode",
    )
    direct_handoff: bool = flag_field(
        True,
        "off: the announced decode worker gets a split's handoff from the router only (by "
        "default its prefill sends it there too as the context phase ends, Worker/HandOff, so "
        "the pull starts without the hop through the router)",
        flag="--no-direct-handoff",
    )
    # Cross-worker prefix pulls (router/prefix_source.py; the workers need --kv-prefix-pulls).
    prefix_pulls: bool = flag_field(
        False,
        "name, with a request sent to a worker holding less of its prompt's prefix than a peer of "
        "its role, that peer to pull the prefix from, where the cost model (--prefix-pull-*) "
        "says a pull beats computing it (every prefill/both worker needs --kv-prefix-pulls)",
    )
    prefix_pull_min_blocks: int = flag_field(
        4, "prefix pulls: the fewest extra KV blocks worth a pull"
    )
    prefix_pull_gbps: float = flag_field(
        10.0, "prefix pulls: the KV pull bandwidth the cost model assumes, GB/s"
    )
    prefix_compute_tokens_per_s: float = flag_field(
        20000.0,
        "prefix pulls: the prompt tokens per second a worker computes, as the cost model assumes",
    )
    max_in_flight: int = flag_field(
        4096,
        "Generate calls served at once; more are refused RESOURCE_EXHAUSTED with a retry hint",
    )
    health_interval_s: float = flag_field(
        1.0, "seconds between health checks of a worker", flag="--health-interval"
    )
    health_timeout_s: float = flag_field(
        1.0,
        "seconds a worker has to answer a health check before it counts as down",
        flag="--health-timeout",
    )
    stream_progress_timeout_s: float = flag_field(
        10.0,
        "seconds a stream may go without a message before its worker is probed; a worker that "
        "does not answer the probe in --health-timeout is hung and its streams move on",
        flag="--stream-progress-timeout",
    )
    stream_interval: int = flag_field(
        1,
        "streamed tokens per message to a client (the first and the last go at once); more: "
        "fewer gRPC writes per token, each token later by up to that many - 1 steps",
    )

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
        PrefixPullCost(
            self.prefix_pull_min_blocks, self.prefix_pull_gbps, self.prefix_compute_tokens_per_s
        )  # its own checks, on or off
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
    def prefix_pull_cost(self) -> PrefixPullCost | None:
        if not self.prefix_pulls:
            return None
        return PrefixPullCost(
            self.prefix_pull_min_blocks, self.prefix_pull_gbps, self.prefix_compute_tokens_per_s
        )

    @property
    def policies(self) -> dict[Role, Policy]:
        return parse_routing(self.routing)
