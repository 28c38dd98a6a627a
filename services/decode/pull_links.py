"""How fast a decode worker's KV pulls run, per prefill worker it pulls from.

The rate is measured, not trusted: UCX picks a lane per pair of agents, and a lane that falls
back to TCP still moves correct bytes, at a hundredth of the speed (loopback TCP between two
processes on one GPU: 0.47 GB/s against 380 GB/s over CUDA IPC, bench/RESULTS.md). Each real
pull's bytes over the seconds of its READ go into the peer's link.

One slow pull says little: under load a READ waits behind others and its poll behind the engine
thread's GIL (a burst of 512 requests on one H100 ran its pulls at 4.3 GB/s on average over a
healthy CUDA IPC lane). A TCP lane is slow on every pull. So the lane is judged by its best pull:
once JUDGED_AFTER pulls of at least `floor.min_mib` between two pools of one host have all run
under the floor, the decode logs one warning for the peer naming it, the rate and the likely cause.

Lives on the worker (not the generation phase), so a released and resumed pool keeps the links.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable

from tandem.kvtransfer.ucx_env import CUDA_IPC_GET_ZCOPY

log = logging.getLogger("tandem.decode.pull_links")

# No healthy device path within one host misses this (CUDA IPC moves ~100 GB/s on one H200).
DEFAULT_DEVICE_FLOOR_GBPS = 5.0
# Below this a pull's time is mostly fixed cost: its rate says nothing about the lane.
DEFAULT_FLOOR_MIN_MIB = 8.0
# Pulls of at least min_mib a lane is judged on: all of them under the floor, it warns.
JUDGED_AFTER = 8
# Prefills a decode keeps links (and metric series) for; the one pulled from longest ago goes
# first (pods come back at new addresses).
MAX_LINKS = 64
# What a link reports (WorkerState.kv_pull_links, get_stats' kvPullStats): KvPullLink's fields.
REPORTED = (
    "peer",
    "same_host",
    "device_pools",
    "num_pulls",
    "num_bytes",
    "seconds",
    "last_gbps",
    "mean_gbps",
    "num_judged",
    "best_gbps",
    "num_below_floor",
)


@dataclasses.dataclass(frozen=True)
class PullFloor:
    """gbps: the rate under which a pull within one host warns. None: DEFAULT_DEVICE_FLOOR_GBPS
    between device pools and no floor between host-memory pools (CPU workers: tests, dev); a
    number: that floor for every pull within one host; 0: no warning."""

    gbps: float | None = None
    min_mib: float = DEFAULT_FLOOR_MIN_MIB

    def __post_init__(self):
        if self.gbps is not None and not (math.isfinite(self.gbps) and self.gbps >= 0):
            raise ValueError(
                f"kv_pull_floor_gbps must be a finite number >= 0 (0: no warning), got {self.gbps}"
            )
        if not (math.isfinite(self.min_mib) and self.min_mib > 0):
            raise ValueError(f"kv_pull_floor_mib must be a finite number > 0, got {self.min_mib}")

    def gbps_for(self, device_pools: bool) -> float:
        """The floor between two pools of one host of this kind (0: none)."""
        if self.gbps is not None:
            return self.gbps
        return DEFAULT_DEVICE_FLOOR_GBPS if device_pools else 0.0


@dataclasses.dataclass
class PeerLink:
    """The pulls from one prefill worker (by its gRPC endpoint) since it came under its agent."""

    peer: str
    agent: str
    same_host: bool
    device_pools: bool
    num_pulls: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    last_gbps: float = 0.0
    # Over the pulls that count against the floor (within one host, at least min_mib).
    num_judged: int = 0
    best_gbps: float = 0.0
    num_below_floor: int = 0
    warned: bool = False

    @property
    def mean_gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def report(self) -> dict:
        return {name: getattr(self, name) for name in REPORTED}


class PullLinks:
    def __init__(
        self,
        floor: PullFloor,
        on_pull: Callable[[str, int, float], None] = lambda peer, b, s: None,
        on_forget: Callable[[str], None] = lambda peer: None,
    ):
        """on_pull(peer, bytes, seconds): each pull that moved bytes; on_forget(peer): a link
        dropped (MAX_LINKS): the worker's metrics."""
        self.floor = floor
        self.on_pull = on_pull
        self.on_forget = on_forget
        self._links: dict[str, PeerLink] = {}  # least recently pulled from first

    def observe(
        self,
        peer: str,
        agent: str,
        same_host: bool,
        device_pools: bool,
        num_bytes: int,
        seconds: float,
    ) -> None:
        """One pull that landed from peer's agent: num_bytes in seconds of READ."""
        if num_bytes <= 0 or seconds <= 0:
            return
        link = self._links.pop(peer, None)
        if link is None or link.agent != agent:  # a new process (or pool) at the address
            link = PeerLink(peer, agent, same_host, device_pools)
        self._links[peer] = link
        if len(self._links) > MAX_LINKS:
            forgotten = next(iter(self._links))
            del self._links[forgotten]
            self.on_forget(forgotten)
        gbps = num_bytes / seconds / 1e9
        link.num_pulls += 1
        link.num_bytes += num_bytes
        link.seconds += seconds
        link.last_gbps = gbps
        self.on_pull(peer, num_bytes, seconds)
        floor = self.floor.gbps_for(device_pools)
        if not (same_host and floor and num_bytes >= self.floor.min_mib * 2**20):
            return
        link.num_judged += 1
        link.best_gbps = max(link.best_gbps, gbps)
        link.num_below_floor += gbps < floor
        if link.num_judged >= JUDGED_AFTER and link.best_gbps < floor and not link.warned:
            link.warned = True
            log.warning(
                "KV pulls from %s run at %.2f GB/s at best over %d pulls (the last: %.1f MiB in %.1f ms), "
                "under the %.1f GB/s that a healthy path between two %s pools of one host keeps: %s",
                peer,
                link.best_gbps,
                link.num_judged,
                num_bytes / 2**20,
                seconds * 1e3,
                floor,
                "GPU" if device_pools else "host-memory",
                _likely_cause(device_pools),
            )

    def expected_seconds(self, peer: str, num_bytes: int) -> float:
        """How long a pull of num_bytes from peer should take at the mean rate its pulls ran
        (0.0 before its first pull: nothing measured to go by)."""
        link = self._links.get(peer)
        if link is None or link.seconds <= 0 or link.num_bytes <= 0:
            return 0.0
        return num_bytes * link.seconds / link.num_bytes

    def links(self) -> list[PeerLink]:
        return [dataclasses.replace(link) for link in self._links.values()]


def _likely_cause(device_pools: bool) -> str:
    if device_pools:
        setting = os.environ.get(CUDA_IPC_GET_ZCOPY, "unset")
        return (
            f"the bytes likely go over a TCP lane instead of CUDA IPC; UCX's cuda_ipc get path is off without "
            f"NVLink unless {CUDA_IPC_GET_ZCOPY}=y (here: {setting}; tandem sets y unless the operator set it). "
            f"Check both workers' environment and UCX_TLS, or run UCX_LOG_LEVEL=info to see the lanes"
        )
    return (
        "the bytes likely go over a TCP lane instead of shared memory: check UCX_TLS (it needs sm or posix/cma) "
        "in both workers' environment, or run UCX_LOG_LEVEL=info to see the lanes"
    )
