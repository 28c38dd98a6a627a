"""How the router follows a worker's health when the Watch stream is cut on the way while the
worker lives (a proxy's idle timeout, a GOAWAY at the server's max connection age): the worker
stays pickable but for a round trip, even while its engine is too busy to answer a state poll;
and when the process behind the address is replaced (a restart, maybe in another role), the new
one is not picked on the old one's word."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.roles import Role
from tandem.router.workers import WorkerPool
from tandem.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)

# The fake worker's server ends every connection this long after it opened (plus a short grace):
# each Watch stream on it is cut, as grpc does at max connection age.
CONNECTION_AGE_MS = 1300
SAMPLE_S = 5.0


class CountingHealth(health_async.HealthServicer):
    def __init__(self):
        super().__init__()
        self.watches = 0

    async def Watch(self, request, context):
        self.watches += 1
        await super().Watch(request, context)


class BusyEngineWorker(worker_pb2_grpc.WorkerServicer):
    """Answers the first `num_quick` state polls at once and later ones only after a long step
    (an engine busy with a long prefill answers between steps)."""

    def __init__(self, role=worker_pb2.ROLE_DECODE, num_quick: int = 1):
        self.role = role
        self.num_quick = num_quick
        self.polls = 0

    async def GetWorkerState(self, request, context):
        self.polls += 1
        if self.polls > self.num_quick:
            await asyncio.sleep(SAMPLE_S + 5)
        return worker_pb2.WorkerState(role=self.role)

    async def SubscribeKvBlocks(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this fake worker has no KV block feed")


async def _follow_a_cut_watch() -> tuple[int, float, float]:
    server = grpc.aio.server(options=[("grpc.max_connection_age_ms", CONNECTION_AGE_MS),
                                      ("grpc.max_connection_age_grace_ms", 100)])
    health = CountingHealth()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    worker_pb2_grpc.add_WorkerServicer_to_server(BusyEngineWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = WorkerPool((f"127.0.0.1:{port}",), health_interval_s=30.0, health_timeout_s=0.5)
    try:
        pool.start()
        assert await pool.wait_ready(10)
        w = pool.workers[0]
        assert w.role is Role.DECODE
        loop = asyncio.get_running_loop()
        end = loop.time() + SAMPLE_S
        longest, down_since, ready_s, last = 0.0, None, 0.0, loop.time()
        while (now := loop.time()) < end:
            if w.ready:
                ready_s += now - last
                if down_since is not None:
                    longest, down_since = max(longest, now - down_since), None
            elif down_since is None:
                down_since = now
            last = now
            await asyncio.sleep(0.002)
        if down_since is not None:
            longest = max(longest, loop.time() - down_since)
        return health.watches, longest, ready_s / SAMPLE_S
    finally:
        for t in pool.workers[0].tasks:
            t.cancel()
        await pool.workers[0].channel.close()
        await server.stop(None)


def test_a_live_worker_whose_watch_stream_is_cut_stays_pickable():
    watches, longest_down_s, ready_share = asyncio.run(_follow_a_cut_watch())
    assert watches >= 4, f"the fake server cut {watches - 1} Watch streams in {SAMPLE_S} s; expected >= 3"
    # Each cut costs one round trip on loopback, not the busy engine's state poll (> SAMPLE_S).
    assert longest_down_s < 0.25, f"not ready for {longest_down_s:.3f} s after a cut Watch stream"
    assert ready_share > 0.95, ready_share


async def _worker_server(port: int, worker: BusyEngineWorker, serving: bool):
    server = grpc.aio.server()
    health = health_async.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING if serving else
                     health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, health, bound


async def _replace_the_process(old_stream_age_s: float) -> list[tuple[Role, bool]]:
    old, _, port = await _worker_server(0, BusyEngineWorker(worker_pb2.ROLE_DECODE, num_quick=10), serving=True)
    pool = WorkerPool((f"127.0.0.1:{port}",), health_interval_s=30.0, health_timeout_s=0.5)
    new = None
    try:
        pool.start()
        assert await pool.wait_ready(10)
        w = pool.workers[0]
        assert w.role is Role.DECODE and w.ready
        await asyncio.sleep(old_stream_age_s)
        # The old process goes; a new one, another role and still loading, listens at once (its
        # state polls are slow, so only the Watch could make it pickable soon).
        stopping = asyncio.create_task(old.stop(None))
        new, health, _ = await _worker_server(port, BusyEngineWorker(worker_pb2.ROLE_PREFILL, num_quick=0),
                                              serving=False)
        await stopping
        await asyncio.sleep(0.5)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)  # loaded
        seen = []
        for _ in range(100):
            await asyncio.sleep(0.01)
            seen.append((w.role, w.ready))
        return seen
    finally:
        for t in pool.workers[0].tasks:
            t.cancel()
        await pool.workers[0].channel.close()
        if new is not None:
            await new.stop(None)


# 0: the old stream is cut young, so the reopen waits and finds the new process serving already;
# 1.5: it is reopened at once and finds the new process loading.
@pytest.mark.parametrize("old_stream_age_s", [0.0, 1.5])
def test_a_new_process_on_the_address_is_not_picked_on_the_old_ones_role(old_stream_age_s):
    seen = asyncio.run(_replace_the_process(old_stream_age_s))
    assert not any(ready for _, ready in seen), "the new process was picked before a state poll looked at it"
