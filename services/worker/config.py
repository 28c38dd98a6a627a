"""A worker process's configuration."""

from __future__ import annotations

import dataclasses

from tandem.common.roles import Role
from tandem.common.server_config import ServerConfig
from tandem.decode.outcomes import LOAD_FAILURE_POLICIES
from tandem.decode.pull_links import PullFloor
from tandem.engine.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class WorkerConfig(ServerConfig):
    role: Role
    engine: EngineConfig
    # The host other workers reach this one at (advertised_host): a prefill's handoffs name it.
    advertise_host: str | None = None
    # NIXL's UCX progress thread: READs progress without polling, at the price of a busy core.
    nixl_progress_thread: bool = False
    # The KV pull rate under which a decode warns of a slow lane to a prefill on its host.
    kv_pull_floor: PullFloor = PullFloor()
    # What a decode does with a handoff whose KV it cannot load: compute the prompt itself
    # (recompute) or end the request UNAVAILABLE for the router to retry elsewhere (fail).
    kv_load_failure_policy: str = "recompute"
    # How long a decode whose pool has no room for a handoff's prompt waits for room (blocks
    # freed by finishing requests) before it gives up on the pull, within the lease.
    kv_room_wait_s: float = 10.0
    # An announced request's blocks reserved when the router announces it (before its handoff).
    kv_early_reserve: bool = True
    # The engine core in a process of its own (worker/core_process.py).
    engine_process: bool = False
    # Cross-worker prefix pulls (a prefill or both worker): serve LeasePrefix to peers, and pull a
    # prompt's prefix from the peer the router names instead of computing it.
    kv_prefix_pulls: bool = False

    @property
    def pulls_prefixes(self) -> bool:
        return self.kv_prefix_pulls and self.role.can_prefill

    @property
    def has_transceiver(self) -> bool:
        return self.role.has_transceiver or self.pulls_prefixes

    def __post_init__(self):
        if not isinstance(self.role, Role) or self.role is Role.UNKNOWN:
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        super().__post_init__()
        if not 0 <= self.kv_room_wait_s <= 3600:
            raise ValueError(
                f"kv_room_wait_s must be in [0, 3600] seconds, got {self.kv_room_wait_s}"
            )
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}, got "
                f"{self.kv_load_failure_policy!r}"
            )
        # The cluster token keys the HMAC of KV handoffs: a prefill or decode worker needs one.
        if self.has_transceiver and not self.cluster_token:
            raise ValueError(
                f"a {self.role.label} worker needs the cluster token (--cluster-token or TANDEM_CLUSTER_TOKEN): it signs "
                "and verifies KV handoffs and authenticates the calls between tandem processes. Give the router and "
                "every worker the same one (`tandem up` and the Helm chart generate it), e.g. "
                "`export TANDEM_CLUSTER_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')`"
            )
