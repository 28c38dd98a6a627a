"""The router's view of its workers: channels, roles, readiness, the LoRA adapters they hold,
and the pick policy."""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.auth import bearer_metadata
from tandem.common.channels import ClusterCredentials
from tandem.common.errors import unavailable
from tandem.common.roles import Role
from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger("tandem.router.workers")

# What a worker that does not hold a request's LoRA adapter costs in pick(), in requests in
# flight: it loads the adapter first (a disk read, a copy to the device, maybe an eviction), so a
# holder is preferred unless it is this much busier.
ADAPTER_MISS_COST = 4
# Seconds a worker counts as holding an adapter after a request with it was sent there, whatever
# the polls said meanwhile (a poll answered before the worker loaded it would say it does not).
PICKED_ADAPTER_MEMORY_S = 5.0


def adapter_of(request: llm_pb2.GenerateRequest) -> int | None:
    """The lora_int_id of the request's LoRA adapter, None for the base model."""
    return request.lora_request.lora_int_id if request.lora_request.lora_name else None


@dataclass
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    llm: llm_pb2_grpc.AsyncLLMStub
    internal: worker_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    role: Role = Role.UNKNOWN
    ready: bool = False
    in_flight: int = 0
    # The LoRA adapters in the worker's device pool at the last poll, and when a request with an
    # adapter was last sent here (it loads the adapter): lora_int_id -> loop time.
    lora_adapters: list[types_pb2.LoRARequest] = field(default_factory=list)
    lora_picked: dict[int, float] = field(default_factory=dict)

    def holds(self, adapter_id: int, now: float) -> bool:
        return (any(a.lora_int_id == adapter_id for a in self.lora_adapters)
                or now - self.lora_picked.get(adapter_id, float("-inf")) < PICKED_ADAPTER_MEMORY_S)
    # Its last poll was refused for want of a credential (logged once).
    refused: bool = False

    @property
    def can_prefill(self) -> bool:
        return self.role.can_prefill

    @property
    def can_decode(self) -> bool:
        return self.role.can_decode


# Roles that can run a whole request (context_and_generation, or generation_only without a
# handoff: a recompute) by themselves, in the order the router prefers them for it.
LOCAL_ROLES = (Role.BOTH, Role.DECODE, Role.PREFILL)


class WorkerPool:
    def __init__(self, addresses: tuple[str, ...], health_interval_s: float,
                 credentials: ClusterCredentials = ClusterCredentials(), health_timeout_s: float = 1.0):
        """credentials: the router's TLS identity and tokens; its channels present them on every call."""
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        # Sent on every admin call to a worker (the channels add it too; explicit where a call is admin).
        self.admin_metadata = bearer_metadata(credentials.admin_token)
        self.workers: list[WorkerHandle] = []
        for address in addresses:
            channel = credentials.open(address)
            self.workers.append(WorkerHandle(address, channel, credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel),
                                             credentials.stub(worker_pb2_grpc.WorkerStub, channel),
                                             health_pb2_grpc.HealthStub(channel)))
        self._rr = itertools.count()
        self.changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        # One poll loop per worker: a hung worker's slow answers delay nobody else's.
        self._tasks = [asyncio.create_task(self._poll_forever(w)) for w in self.workers]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for w in self.workers:
            await w.channel.close()

    @property
    def ready_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.ready]

    @property
    def all_ready(self) -> bool:
        return all(w.ready for w in self.workers)

    @property
    def can_disaggregate(self) -> bool:
        """Whether a ready prefill-only and a ready decode-only worker exist."""
        ready = self.ready_workers
        return any(w.role is Role.PREFILL for w in ready) and any(w.role is Role.DECODE for w in ready)

    def by_address(self, address: str) -> WorkerHandle:
        for w in self.workers:
            if w.address == address:
                return w
        raise ValueError(f"unknown worker {address!r}; workers are {[w.address for w in self.workers]}")

    def mark_down(self, worker: WorkerHandle) -> None:
        """A call failed as if the worker were gone: stop picking it until its health check passes."""
        worker.ready = False

    def pick(self, need: Role | None, exclude: set[str] | frozenset[str] = frozenset(),
             adapter_id: int | None = None) -> WorkerHandle:
        """The ready worker of role `need` (None: any role) with the fewest requests in flight,
        counting ADAPTER_MISS_COST more for one that does not hold the request's LoRA adapter
        (adapter_id); round-robin among equals."""
        return self.pick_any_of((need,), exclude, adapter_id)

    def pick_any_of(self, needs: tuple[Role | None, ...], exclude: set[str] | frozenset[str] = frozenset(),
                    adapter_id: int | None = None) -> WorkerHandle:
        """pick() for the first of needs that has a candidate."""
        now = asyncio.get_running_loop().time()

        def load(w: WorkerHandle) -> int:
            return w.in_flight + (ADAPTER_MISS_COST if adapter_id is not None and not w.holds(adapter_id, now) else 0)

        ready = [w for w in self.ready_workers if w.address not in exclude]
        for need in needs:
            # A split needs the transceivers only prefill and decode workers have: roles match exactly.
            candidates = [w for w in ready if need is None or w.role is need]
            if candidates:
                start = next(self._rr) % len(candidates)
                rotated = candidates[start:] + candidates[:start]
                chosen = min(rotated, key=load)
                if adapter_id is not None:
                    chosen.lora_picked[adapter_id] = now
                return chosen
        wanted = "/".join(n.label if n is not None else "any" for n in needs)
        raise unavailable(f"no ready worker can serve {wanted} requests (workers: "
                          + ", ".join(f"{w.address}={w.role.label or '?'}{'' if w.ready else ' not ready'}"
                                      for w in self.workers) + ")")

    async def _poll_forever(self, w: WorkerHandle) -> None:
        while True:
            await self._poll(w)
            self.changed.set()
            self.changed = asyncio.Event()
            await asyncio.sleep(self.health_interval_s)

    async def _poll(self, w: WorkerHandle) -> None:
        try:
            resp = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout_s)
            ready = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as exc:
            ready = False
            refused = exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
            if refused and not w.refused:
                log.error("worker %s refuses the router (%s: %s): give the router the cluster's --cluster-token",
                          w.address, exc.code().name, exc.details())
            w.refused = refused
        if ready:
            try:
                state = await w.internal.GetWorkerState(worker_pb2.WorkerStateRequest(), timeout=5.0)
                w.role = Role(state.role)
                w.lora_adapters = list(state.lora_adapters)
            except grpc.aio.AioRpcError:
                # The state waits for the engine thread between steps; a slow step leaves the last
                # adapters in place. A worker whose role is still unknown cannot be picked yet.
                ready = w.role is not Role.UNKNOWN
        if ready != w.ready:
            log.info("worker %s (%s) is %s", w.address, w.role.label or "?", "ready" if ready else "not ready")
        w.ready = ready

    async def is_responsive(self, w: WorkerHandle, engine_timeout_s: float) -> bool:
        """Whether the worker's event loop answers within the health timeout (a SIGSTOPped worker
        does not) and its engine thread within engine_timeout_s (GetWorkerState reads the
        engine's counters between two steps: a wedged engine does not answer, a busy one does)."""
        try:
            await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout_s)
            await w.internal.GetWorkerState(worker_pb2.WorkerStateRequest(), timeout=engine_timeout_s)
            return True
        except grpc.aio.AioRpcError as exc:
            # A worker that answers at all (paused, refusing) is not hung.
            return exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)

    async def wait_ready(self, timeout: float) -> bool:
        """Waits until every worker is ready; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.all_ready:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True
