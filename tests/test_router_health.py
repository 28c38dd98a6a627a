"""How the router follows a worker's health when the Watch stream is cut on the way while the
worker lives (a proxy's idle timeout, a GOAWAY at the server's max connection age): the worker
stays pickable but for a round trip, even while its engine is too busy to answer a state poll;
and when the process behind the address is replaced (a restart, maybe in another role, or a
hot swap that serves at once), the new one is not picked on the old one's word, and what the
router knew of the old one's prefix cache and adapters goes."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.health import InstanceHealthServicer
from tandem.common.roles import Role
from tandem.router.worker_watch import WATCH_REOPEN_MIN_S
from tandem.router.workers import WorkerPool
from tandem.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)

# The fake worker's server ends every connection this long after it opened (plus a short grace):
# each Watch stream on it is cut, as grpc does at max connection age.
CONNECTION_AGE_MS = 1300
SAMPLE_S = 5.0


class CountingHealth(InstanceHealthServicer):
    def __init__(self, instance_id: str):
        super().__init__(instance_id)
        self.watches = 0

    async def Watch(self, request, context):
        self.watches += 1
        await super().Watch(request, context)


class BusyEngineWorker(worker_pb2_grpc.WorkerServicer):
    """Answers the first `num_quick` state polls at once and later ones only after a long step
    (an engine busy with a long prefill answers between steps). kv_blocks: the prefix cache its
    KV block feed reports (None: it has no feed)."""

    def __init__(
        self,
        role=worker_pb2.ROLE_DECODE,
        num_quick: int = 1,
        instance_id: str | None = None,
        kv_blocks: list[int] | None = None,
    ):
        self.role = role
        self.num_quick = num_quick
        self.instance_id = instance_id or uuid.uuid4().hex
        self.kv_blocks = kv_blocks
        self.polls = 0

    async def GetWorkerState(self, request, context):
        self.polls += 1
        if self.polls > self.num_quick:
            await asyncio.sleep(SAMPLE_S + 5)
        return worker_pb2.WorkerState(role=self.role, instance_id=self.instance_id)

    async def SubscribeKvBlocks(self, request, context):
        if self.kv_blocks is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "this fake worker has no KV block feed"
            )
        yield worker_pb2.KvBlocksUpdate(snapshot=True, stored=self.kv_blocks, tokens_per_block=4)
        await asyncio.Event().wait()  # nothing changes after


async def _follow_a_cut_watch() -> tuple[int, float, float]:
    server = grpc.aio.server(
        options=[
            ("grpc.max_connection_age_ms", CONNECTION_AGE_MS),
            ("grpc.max_connection_age_grace_ms", 100),
        ]
    )
    worker = BusyEngineWorker()
    health = CountingHealth(worker.instance_id)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
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
        pool.workers[0].cancel_tasks()
        await pool.workers[0].channel.close()
        await server.stop(None)


def test_a_live_worker_whose_watch_stream_is_cut_stays_pickable():
    watches, longest_down_s, ready_share = asyncio.run(_follow_a_cut_watch())
    assert watches >= 4, (
        f"the fake server cut {watches - 1} Watch streams in {SAMPLE_S} s; expected >= 3"
    )
    # Each cut costs one round trip on loopback, not the busy engine's state poll (> SAMPLE_S).
    assert longest_down_s < 0.25, f"not ready for {longest_down_s:.3f} s after a cut Watch stream"
    assert ready_share > 0.95, ready_share


async def _worker_server(port: int, worker: BusyEngineWorker, serving: bool):
    server = grpc.aio.server()
    health = InstanceHealthServicer(worker.instance_id)
    await health.set(
        "",
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, health, bound


async def _replace_the_process(old_stream_age_s: float) -> list[tuple[Role, bool]]:
    old, _, port = await _worker_server(
        0, BusyEngineWorker(worker_pb2.ROLE_DECODE, num_quick=10), serving=True
    )
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
        new, health, _ = await _worker_server(
            port, BusyEngineWorker(worker_pb2.ROLE_PREFILL, num_quick=0), serving=False
        )
        await stopping
        await asyncio.sleep(0.5)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)  # loaded
        seen = []
        for _ in range(100):
            await asyncio.sleep(0.01)
            seen.append((w.role, w.ready))
        return seen
    finally:
        pool.workers[0].cancel_tasks()
        await pool.workers[0].channel.close()
        if new is not None:
            await new.stop(None)


# 0: the old stream is cut young, so the reopen waits and finds the new process serving already;
# 1.5: it is reopened at once and finds the new process loading.
@pytest.mark.parametrize("old_stream_age_s", [0.0, 1.5])
def test_a_new_process_on_the_address_is_not_picked_on_the_old_ones_role(old_stream_age_s):
    seen = asyncio.run(_replace_the_process(old_stream_age_s))
    assert not any(ready for _, ready in seen), (
        "the new process was picked before a state poll looked at it"
    )


class ReadinessLog(WorkerPool):
    """A pool of one worker that notes (loop time, ready, role) at each change it announces: a
    drop and a return to ready one round trip apart are seen, however briefly it was down."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.changes: list[tuple[float, bool, Role]] = []

    def notify(self) -> None:
        w = self.workers[0]
        self.changes.append((asyncio.get_running_loop().time(), w.ready, w.role))
        super().notify()


async def _hot_swap(same_instance: bool, sample_s: float) -> list[tuple[float, bool, Role]]:
    """(seconds after the old process stopped, ready, role) at each change of the worker's readiness."""
    old_worker = BusyEngineWorker(worker_pb2.ROLE_DECODE, num_quick=10)
    old, _, port = await _worker_server(0, old_worker, serving=True)
    pool = ReadinessLog((f"127.0.0.1:{port}",), health_interval_s=30.0, health_timeout_s=0.5)
    new = None
    try:
        pool.start()
        assert await pool.wait_ready(10)
        w = pool.workers[0]
        assert w.role is Role.DECODE and w.ready and w.instance_id == old_worker.instance_id
        # The Watch stream lives long enough to be reopened at once when it ends.
        await asyncio.sleep(WATCH_REOPEN_MIN_S + 0.2)
        # The new process listens beside the old one (SO_REUSEPORT), serving already and its engine
        # busy (only the Watch could make it pickable soon); then the old one goes, and the
        # router's next connection reaches the new one. The same instance id stands for the same
        # process reached again.
        if same_instance:
            new_worker = BusyEngineWorker(
                worker_pb2.ROLE_DECODE, num_quick=0, instance_id=old_worker.instance_id
            )
        else:
            new_worker = BusyEngineWorker(worker_pb2.ROLE_PREFILL, num_quick=0)
        new, _, _ = await _worker_server(port, new_worker, serving=True)
        stopped_at = asyncio.get_running_loop().time()
        await old.stop(None)
        await asyncio.sleep(sample_s)
        assert new_worker.polls, "no state poll reached the new process"
        return [(t - stopped_at, ready, role) for t, ready, role in pool.changes if t >= stopped_at]
    finally:
        pool.workers[0].cancel_tasks()
        await pool.workers[0].channel.close()
        await old.stop(None)
        if new is not None:
            await new.stop(None)


def _after_the_first_drop(
    changes: list[tuple[float, bool, Role]],
) -> list[tuple[float, bool, Role]]:
    drops = [i for i, (_, ready, _) in enumerate(changes) if not ready]
    assert drops, f"the router did not see the old process go: {changes}"
    return changes[drops[0] + 1 :]


def test_a_hot_swapped_process_is_picked_on_the_reopened_watch_when_it_is_the_same_instance():
    changes = asyncio.run(_hot_swap(same_instance=True, sample_s=1.0))
    back = [(t, role) for t, ready, role in _after_the_first_drop(changes) if ready]
    # Its state polls wait on the busy engine (> the sample): only the Watch can make it ready.
    assert back and back[0][0] < 0.5, (
        f"the same instance, reached again, waited for a state poll: {changes}"
    )
    assert back[0][1] is Role.DECODE


def test_a_hot_swapped_process_with_another_instance_id_is_not_picked_on_the_old_ones_role():
    # Past the new process's first state poll, which times out (5 s) on its busy engine.
    changes = asyncio.run(_hot_swap(same_instance=False, sample_s=6.0))
    picked = [
        f"{t:.3f} s as {role.label}" for t, ready, role in _after_the_first_drop(changes) if ready
    ]
    assert not picked, f"the new process was picked before a state poll looked at it: {picked}"


async def _swap_under_a_live_feed() -> tuple[int, int, Role, bool]:
    old_worker = BusyEngineWorker(worker_pb2.ROLE_DECODE, num_quick=1000, kv_blocks=[11, 12, 13])
    old, _, port = await _worker_server(0, old_worker, serving=True)
    address = f"127.0.0.1:{port}"
    pool = WorkerPool((address,), health_interval_s=0.2, health_timeout_s=0.5)
    new = None
    try:
        pool.start()
        assert await pool.wait_ready(10)
        w = pool.workers[0]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while pool.kv_index.num_blocks(address) != 3 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        before = pool.kv_index.num_blocks(address)
        w.lora_picked[7] = loop.time()  # a request with adapter 7 was just sent there
        new_worker = BusyEngineWorker(worker_pb2.ROLE_PREFILL, num_quick=1000, kv_blocks=[21])
        new, _, _ = await _worker_server(port, new_worker, serving=True)
        # The old process stops with a grace: its open streams (Watch, KV feed) go on over the old
        # connection while new calls (the polls) reach the new process.
        stopping = asyncio.create_task(old.stop(4.0))
        deadline = loop.time() + 2.0
        while w.instance_id != new_worker.instance_id and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # the new process's feed answers
        result = before, pool.kv_index.num_blocks(address), w.role, w.holds(7, loop.time())
        await stopping
        return result
    finally:
        pool.workers[0].cancel_tasks()
        await pool.workers[0].channel.close()
        await old.stop(None)
        if new is not None:
            await new.stop(None)


def test_another_process_at_the_address_drops_the_old_ones_prefix_cache_and_adapters():
    before, after, role, holds_adapter = asyncio.run(_swap_under_a_live_feed())
    assert before == 3
    assert role is Role.PREFILL
    assert after == 1, f"the KV index holds {after} blocks for the address; the new process has 1"
    assert not holds_adapter, "an adapter sent to the old process counts as loaded in the new one"


def test_a_watcher_still_open_hears_a_change_after_another_watcher_left():
    """Two routers (or a reopened stream beside the old one's ending handler) watch one worker;
    one leaves; the other still hears the drain's NOT_SERVING (grpcio-health-checking's own
    Watch dropped the shared condition with the first watcher to leave, and the other heard
    nothing more)."""

    async def run():
        server = grpc.aio.server()
        health = InstanceHealthServicer(uuid.uuid4().hex)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                staying, leaving = (
                    stub.Watch(health_pb2.HealthCheckRequest()),
                    stub.Watch(health_pb2.HealthCheckRequest()),
                )
                first = [(await staying.read()).status, (await leaving.read()).status]
                leaving.cancel()
                await asyncio.sleep(0.2)  # its handler ends
                await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                later = (await asyncio.wait_for(staying.read(), 5)).status
                staying.cancel()
                await asyncio.sleep(0.2)
                return first, later, dict(health._num_watchers), dict(health._server_watchers)
        finally:
            await server.stop(None)

    first, later, watchers, conditions = asyncio.run(run())
    assert first == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert later == health_pb2.HealthCheckResponse.NOT_SERVING
    assert watchers == {} and conditions == {}  # nothing kept once nobody watches
