"""The router's view of its workers: channels, roles, readiness, load, the LoRA adapters they
hold, and the pick (by each role's policy, policies.py). Workers come and go while the router
runs (discovery.py); each has its own watch tasks (worker_watch.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.auth import bearer_metadata
from tandem.common.background import spawn
from tandem.common.channels import ClusterCredentials
from tandem.common.errors import unavailable
from tandem.common.roles import Role
from tandem.router import worker_watch
from tandem.router.kv_index import KvIndex
from tandem.router.policies import (
    ADAPTER_MISS_COST,
    NO_PLACEMENT,
    ConditionalDisagg,
    Picker,
    Placement,
    Policy,
)
from tandem.router.prefix_source import PrefixPullCost
from tandem.router.session_client import WorkerSession
from tandem.v1 import internal_pb2, llm_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["ADAPTER_MISS_COST", "LOCAL_ROLES", "WorkerHandle", "WorkerPool"]

log = logging.getLogger("tandem.router.workers")

# Seconds a worker counts as holding an adapter after a request with it was sent there, whatever
# the polls said meanwhile (a poll answered before the worker loaded it would say it does not).
PICKED_ADAPTER_MEMORY_S = 5.0
# Seconds a worker dropped from discovery keeps its channel for the streams still running on it.
REMOVED_WORKER_GRACE_S = 600.0
# How far ahead of the router's reads a worker's outputs may travel: 16 KiB of HTTP/2 window,
# not the megabytes gRPC's bandwidth probe grows it to. A router that falls behind (its core
# saturated) then holds the worker's writes back, and the worker merges the steps it could not
# write into one batch (worker/output_streams.py): each request's backlog reaches its client as
# one message. With the probe, the backlog waited unread in the router's receive buffer and went
# out one token a message, later. bench/router_capacity.py on the H200 host, the router pinned
# to one core, 256 streams: 27-28k tokens/s at 8 ms TPOT before, 39-44k at 5-5.6 ms with 16 KiB
# (33-38k at 64 KiB). A message larger than the window still gets the window it needs.
WORKER_CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 << 10)]


@dataclass
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    llm: llm_pb2_grpc.AsyncLLMStub
    internal: worker_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    role: Role = Role.UNKNOWN
    # The instance id of the process the last state poll saw there ('' before any; worker_watch.py).
    instance_id: str = ""
    ready: bool = False
    in_flight: int = 0
    # Load the router itself puts there (fresher than any poll): prompt tokens sent to be
    # computed whose first message has not come back, and KV blocks of the requests running.
    queued_prefill_tokens: int = 0
    active_blocks: int = 0
    # Prompt tokens other routers had queued there at the last state poll: the worker's report
    # less what this router had sent there then (its own count is fresher and stays exact).
    others_prefill_tokens: int = 0
    # This router's prompts there as the worker's report counts them (whole prompts, their
    # prefix-cached part too, until their first message), and the most of them since the current
    # state poll was sent: the report was taken at some moment in between, so this (not the
    # count when the reply comes, when a request it counted may have finished) is what to take
    # off it.
    reported_prompt_tokens: int = 0
    reported_prompt_peak: int = 0
    # Free KV blocks at the last state poll (None: not known yet).
    num_free_blocks: int | None = None
    # Its KV layout hash and the bytes of one KV block, at the last state poll ('' and 0 before
    # any): a prefix pulls only between workers of one layout (prefix_source.py).
    kv_layout_hash: str = ""
    kv_block_bytes: int = 0
    # It leases its cached prefixes to peers (--kv-prefix-pulls), at the last state poll.
    leases_prefixes: bool = False
    # The LoRA adapters in the worker's device pool at the last poll, and when a request with an
    # adapter was last sent here (it loads the adapter): lora_int_id -> loop time.
    lora_adapters: list[types_pb2.LoRARequest] = field(default_factory=list)
    lora_picked: dict[int, float] = field(default_factory=dict)
    # Its last poll was refused for want of a credential (logged once).
    refused: bool = False
    # Set to poll the worker's state now rather than at the next interval (its health changed).
    poll_now: asyncio.Event = field(default_factory=asyncio.Event)
    # Its health tasks, and the KV block feed's (restarted when another process takes the address).
    tasks: list[asyncio.Task] = field(default_factory=list)
    kv_feed: asyncio.Task | None = None
    # The session its requests go on (session_client.py); set by the pool.
    session: WorkerSession | None = None

    def cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.kv_feed is not None:
            self.kv_feed.cancel()

    def holds(self, adapter_id: int, now: float) -> bool:
        return (
            any(a.lora_int_id == adapter_id for a in self.lora_adapters)
            or now - self.lora_picked.get(adapter_id, float("-inf")) < PICKED_ADAPTER_MEMORY_S
        )

    @property
    def can_prefill(self) -> bool:
        return self.role.can_prefill

    @property
    def can_decode(self) -> bool:
        return self.role.can_decode

    def queue_prefill(self, tokens: int, prompt_tokens: int) -> None:
        """This router sends a prompt of `prompt_tokens` here, `tokens` of them to be computed
        (negative: they were)."""
        self.queued_prefill_tokens += tokens
        self.reported_prompt_tokens += prompt_tokens
        self.reported_prompt_peak = max(self.reported_prompt_peak, self.reported_prompt_tokens)

    def open_state_poll(self) -> None:
        self.reported_prompt_peak = self.reported_prompt_tokens

    def read_state_report(self, num_queued_prompt_tokens: int) -> None:
        """The other routers' share of the prompt tokens a state poll found queued here."""
        self.others_prefill_tokens = max(0, num_queued_prompt_tokens - self.reported_prompt_peak)

    @property
    def prefill_load(self) -> int:
        """Prompt tokens queued there: this router's own (fresh) and the other routers' (as of
        the last state poll)."""
        return self.queued_prefill_tokens + self.others_prefill_tokens


# Roles that can run a whole request (context_and_generation, or generation_only without a
# handoff: a recompute) by themselves, in the order the router prefers them for it.
LOCAL_ROLES = (Role.BOTH, Role.DECODE, Role.PREFILL)


class WorkerPool:
    def __init__(
        self,
        addresses: tuple[str, ...],
        health_interval_s: float,
        credentials: ClusterCredentials = ClusterCredentials(),
        health_timeout_s: float = 1.0,
        routing: dict[Role, Policy] | None = None,
        kv_overlap_weight: float = 1.0,
        disagg: ConditionalDisagg = ConditionalDisagg(),
        prefix_cost: PrefixPullCost | None = None,
        announce_decode: bool = True,
        direct_handoff: bool = True,
    ):
        """credentials: the router's TLS identity and tokens; its channels present them on every
        call; prefix_cost: the cost model of cross-worker prefix pulls (None: off);
        announce_decode: a split's decode worker gets its request when the context phase
        starts, and only the handoff when it ends (relay.py); direct_handoff: its prefill sends
        the handoff to the announced decode itself, as well as replying."""
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.credentials = credentials
        # Sent on every admin call to a worker (the channels add it too; explicit where a call is admin).
        self.admin_metadata = bearer_metadata(credentials.admin_token)
        self.kv_index = KvIndex()
        self.picker = Picker(
            routing or {}, self.kv_index, kv_overlap_weight, prefix_cost=prefix_cost
        )
        self.disagg = disagg
        self.announce_decode = announce_decode
        self.direct_handoff = direct_handoff
        self.workers: list[WorkerHandle] = []
        self.changed = asyncio.Event()
        self._started = False
        self._closing: set[asyncio.Task] = set()
        for address in addresses:
            self.workers.append(self._open(address))

    def _open(self, address: str) -> WorkerHandle:
        channel = self.credentials.open(address, WORKER_CHANNEL_OPTIONS)
        internal = self.credentials.stub(worker_pb2_grpc.WorkerStub, channel)
        session = WorkerSession(
            internal,
            address,
            lambda output: self._release_orphaned_handoff(internal, address, output),
        )
        return WorkerHandle(
            address,
            channel,
            self.credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel),
            internal,
            health_pb2_grpc.HealthStub(channel),
            session=session,
        )

    def _release_orphaned_handoff(
        self, internal, address: str, output: internal_pb2.EngineOutput
    ) -> None:
        """An output came on a stream after its relay ended (its call was cancelled or failed just
        as the worker answered): a handoff in it reaches nobody, so its lease goes now, not at expiry."""
        if output.kv_params.opaque_state:
            request = worker_pb2.ReleaseKvRequest(ctx_request_id=output.kv_params.ctx_request_id)
            spawn(self._release(internal, address, request))

    async def _release(self, internal, address: str, request: worker_pb2.ReleaseKvRequest) -> None:
        try:
            await internal.ReleaseKv(request, timeout=5, metadata=self.admin_metadata)
        except grpc.aio.AioRpcError as exc:
            log.info(
                "ReleaseKv(%d) on %s: %s (the lease expires anyway)",
                request.ctx_request_id,
                address,
                exc.code(),
            )

    def start(self) -> None:
        self._started = True
        for w in self.workers:
            self._start_watching(w)

    def _start_watching(self, w: WorkerHandle) -> None:
        # Tasks per worker: a hung worker's slow answers delay nobody else's.
        w.tasks = [
            asyncio.create_task(worker_watch.poll_forever(self, w)),
            asyncio.create_task(worker_watch.watch_health(self, w)),
        ]
        w.kv_feed = asyncio.create_task(worker_watch.follow_kv_blocks(self, w))

    def meet_new_process(self, w: WorkerHandle, instance_id: str) -> None:
        """A state poll found another process at the worker's address than the last one (a
        restart, a hot swap; instance_id is the new one's): what the router knew of the old one
        is dropped. The poll brings the new one's role, adapters and free blocks; the adapters
        sent to the old one are not loaded in the new one; and the old one's prefix cache leaves
        the KV index: the feed starts over (it may still read the old process's stream, on a
        connection that outlives the swap) and the new subscription's snapshot fills it again."""
        if (
            w.instance_id or w.role is not Role.UNKNOWN
        ):  # an earlier poll answered: there is something to drop
            log.info(
                "worker %s is another process now (instance %s, was %s)",
                w.address,
                instance_id or "?",
                w.instance_id or "?",
            )
            w.lora_picked.clear()
            self.kv_index.forget(w.address)
            if w.kv_feed is not None:
                w.kv_feed.cancel()
                w.kv_feed = asyncio.create_task(worker_watch.follow_kv_blocks(self, w))
        w.instance_id = instance_id

    def set_addresses(self, addresses: set[str]) -> None:
        """Discovery's latest answer: workers new to it start being watched, workers missing from
        it stop being picked (their running streams finish, or fail over, as any)."""
        known = {w.address for w in self.workers}
        for address in sorted(addresses - known):
            log.info("worker %s discovered", address)
            w = self._open(address)
            self.workers.append(w)
            if self._started:
                self._start_watching(w)
        for w in [w for w in self.workers if w.address not in addresses]:
            log.info(
                "worker %s (%s) left discovery; %d requests still on it",
                w.address,
                w.role.label or "?",
                w.in_flight,
            )
            self.workers.remove(w)
            w.ready = False
            self.kv_index.forget(w.address)
            task = asyncio.create_task(self._close_when_idle(w))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.notify()

    async def _close_when_idle(self, w: WorkerHandle) -> None:
        w.cancel_tasks()
        deadline = asyncio.get_running_loop().time() + REMOVED_WORKER_GRACE_S
        while w.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
        w.session.close()
        await w.channel.close()

    def notify(self) -> None:
        """Wakes whoever waits for a change of the workers' readiness."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        for w in self.workers:
            w.cancel_tasks()
            w.session.close()
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
        return any(w.role is Role.PREFILL for w in ready) and any(
            w.role is Role.DECODE for w in ready
        )

    def should_split(self, placement: Placement) -> tuple[bool, str]:
        """Conditional disaggregation for a request that can be split: (split, reason)."""
        ready = self.ready_workers
        return self.disagg.decide(
            placement,
            self.kv_index,
            [w for w in ready if w.role is Role.PREFILL],
            [w for w in ready if w.role is Role.DECODE],
        )

    def by_address(self, address: str) -> WorkerHandle:
        for w in self.workers:
            if w.address == address:
                return w
        raise ValueError(
            f"unknown worker {address!r}; workers are {[w.address for w in self.workers]}"
        )

    def mark_down(self, worker: WorkerHandle) -> None:
        """A call failed as if the worker were gone: stop picking it until its health check passes."""
        worker.ready = False

    def pick(
        self,
        need: Role | None,
        exclude: set[str] | frozenset[str] = frozenset(),
        adapter_id: int | None = None,
        placement: Placement | None = None,
    ) -> WorkerHandle:
        """The ready worker of role `need` (None: any role) by that role's policy (policies.py);
        adapter_id: the request's LoRA adapter when no placement carries it."""
        return self.pick_any_of((need,), exclude, adapter_id, placement)

    def pick_any_of(
        self,
        needs: tuple[Role | None, ...],
        exclude: set[str] | frozenset[str] = frozenset(),
        adapter_id: int | None = None,
        placement: Placement | None = None,
    ) -> WorkerHandle:
        """pick() for the first of needs that has a candidate."""
        if placement is None:
            placement = Placement(adapter_id=adapter_id) if adapter_id is not None else NO_PLACEMENT
        now = asyncio.get_running_loop().time()
        ready = [w for w in self.ready_workers if w.address not in exclude]
        for need in needs:
            # A split needs the transceivers only prefill and decode workers have: roles match exactly.
            candidates = [w for w in ready if need is None or w.role is need]
            if candidates:
                chosen = self.picker.choose(need, candidates, placement, now)
                if placement.adapter_id is not None:
                    chosen.lora_picked[placement.adapter_id] = now
                return chosen
        wanted = "/".join(n.label if n is not None else "any" for n in needs)
        raise unavailable(
            f"no ready worker can serve {wanted} requests (workers: "
            + ", ".join(
                f"{w.address}={w.role.label or '?'}{'' if w.ready else ' not ready'}"
                for w in self.workers
            )
            + ")"
        )

    async def is_responsive(self, w: WorkerHandle, engine_timeout_s: float) -> bool:
        """Whether the worker's event loop answers within the health timeout (a SIGSTOPped worker
        does not) and its engine thread within engine_timeout_s (GetWorkerState reads the
        engine's counters between two steps: a wedged engine does not answer, a busy one does)."""
        try:
            await w.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout_s
            )
            await w.internal.GetWorkerState(
                worker_pb2.WorkerStateRequest(), timeout=engine_timeout_s
            )
            return True
        except grpc.aio.AioRpcError as exc:
            # A worker that answers at all (paused, refusing) is not hung.
            return exc.code() not in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
            )

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
