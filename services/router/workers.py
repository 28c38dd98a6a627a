"""The router's view of its workers: channels, roles, readiness, and the pick policy."""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.auth import bearer_metadata
from tandem.common.channels import ClusterCredentials
from tandem.common.errors import unavailable
from tandem.common.roles import Role
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
    # Its last poll was refused for want of a credential (logged once).
    refused: bool = False

    @property
    def can_prefill(self) -> bool:
        return self.role.can_prefill

    @property
    def can_decode(self) -> bool:
        return self.role.can_decode


class WorkerPool:
    def __init__(self, addresses: tuple[str, ...], health_interval_s: float,
                 credentials: ClusterCredentials = ClusterCredentials()):
        """credentials: the router's TLS identity and tokens; its channels present them on every call."""
        self.health_interval_s = health_interval_s
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
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
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

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(w) for w in self.workers))
            self.changed.set()
            self.changed = asyncio.Event()
            await asyncio.sleep(self.health_interval_s)

    async def _poll(self, w: WorkerHandle) -> None:
        try:
            resp = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            ready = resp.status == health_pb2.HealthCheckResponse.SERVING
            if ready and w.role is Role.UNKNOWN:
                state = await w.internal.GetWorkerState(worker_pb2.WorkerStateRequest(), timeout=5.0)
                w.role = Role(state.role)
        except grpc.aio.AioRpcError as exc:
            ready = False
            refused = exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
            if refused and not w.refused:
                log.error("worker %s refuses the router (%s: %s): give the router the cluster's --cluster-token",
                          w.address, exc.code().name, exc.details())
            w.refused = refused
        if ready != w.ready:
            log.info("worker %s (%s) is %s", w.address, w.role.label or "?", "ready" if ready else "not ready")
        w.ready = ready

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
