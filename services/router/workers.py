"""The router's view of its workers: channels, roles, readiness, and the pick policy."""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.auth import bearer_metadata
from tandem.common.errors import unavailable
from tandem.common.roles import Role
from tandem.common.server import CHANNEL_OPTIONS
from tandem.v1 import llm_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("tandem.router.workers")


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
    def __init__(self, addresses: tuple[str, ...], health_interval_s: float, admin_token: str | None = None,
                 health_timeout_s: float = 1.0):
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        # Sent on every admin call to a worker.
        self.admin_metadata = bearer_metadata(admin_token)
        self.workers: list[WorkerHandle] = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self.workers.append(WorkerHandle(address, channel, llm_pb2_grpc.AsyncLLMStub(channel),
                                             worker_pb2_grpc.WorkerStub(channel), health_pb2_grpc.HealthStub(channel)))
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

    def pick(self, need: Role | None, exclude: set[str] | frozenset[str] = frozenset()) -> WorkerHandle:
        """The ready worker of role `need` (None: any role) with the fewest requests in flight;
        round-robin among equals."""
        return self.pick_any_of((need,), exclude)

    def pick_any_of(self, needs: tuple[Role | None, ...], exclude: set[str] | frozenset[str] = frozenset()) -> WorkerHandle:
        """pick() for the first of needs that has a candidate."""
        ready = [w for w in self.ready_workers if w.address not in exclude]
        for need in needs:
            # A split needs the transceivers only prefill and decode workers have: roles match exactly.
            candidates = [w for w in ready if need is None or w.role is need]
            if candidates:
                start = next(self._rr) % len(candidates)
                rotated = candidates[start:] + candidates[:start]
                return min(rotated, key=lambda w: w.in_flight)
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
            if ready and w.role is Role.UNKNOWN:
                state = await w.internal.GetWorkerState(worker_pb2.WorkerStateRequest(), timeout=5.0)
                w.role = Role(state.role)
        except grpc.aio.AioRpcError:
            ready = False
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
