"""Issue 11: KV-aware routing and conditional disaggregation, with 2 prefill + 2 decode worker
processes on the tiny model and three routers over them (kv, least-load, and kv with
conditional disaggregation), all in the same run."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import urllib.request

import grpc
import pytest

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.router.kv_index import KvIndex
from tandem.router.policies import Placement
from tandem.testing.cluster import LocalCluster, channel_to
from tandem.v1 import llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 8
SYSTEM_TOKENS = 64  # 8 blocks shared by every user of a system prompt
MIN_UNCACHED = 32

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    engine_args = [
        "--model",
        str(model_dirs["llama"]),
        "--num-blocks",
        "256",
        "--block-size",
        str(BLOCK_SIZE),
    ]
    with LocalCluster(
        roles=["prefill", "prefill", "decode", "decode"],
        engine_args=engine_args,
        router_args=["--routing", "kv"],
    ) as c:
        c.add_router("router-least-load", ["--routing", "least-load"])
        c.add_router(
            "router-conditional",
            ["--routing", "kv", "--disagg-min-uncached-tokens", str(MIN_UNCACHED)],
        )
        c.add_router("router-busy", ["--max-in-flight", "1"])
        yield c


def _router(c: LocalCluster, name: str) -> str:
    return c.service(name).address


def worker_state(address: str) -> worker_pb2.WorkerState:
    with channel_to(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetWorkerState(
            worker_pb2.WorkerStateRequest(), timeout=10
        )


def _workload(seed: int, num_systems: int, num_users: int) -> list[list[tuple[int, list[int]]]]:
    """rounds[user]: (system, prompt) in a random order (users do not arrive in lockstep); a
    prompt = a system prompt shared by its users + the user's own turn."""
    rng = random.Random(seed)
    systems = [
        [1] + [rng.randrange(4, 250) for _ in range(SYSTEM_TOKENS - 1)] for _ in range(num_systems)
    ]
    rounds = []
    for _ in range(num_users):
        turns = [
            (i, system + [rng.randrange(4, 250) for _ in range(rng.randrange(6, 14))])
            for i, system in enumerate(systems)
        ]
        rng.shuffle(turns)
        rounds.append(turns)
    return rounds


def _run(
    address: str, rounds: list[list[tuple[int, list[int]]]]
) -> tuple[float, list[float], list]:
    """Each round's prompts at once, rounds one after another: (prefix hit rate, TTFTs,
    [(system, output)])."""

    async def main():
        llm = await AsyncLLM(address)
        try:
            outs = []
            for prompts in rounds:
                outs += await asyncio.gather(
                    *(llm.generate_async(p, SamplingParams(max_tokens=4)) for _, p in prompts)
                )
            return outs
        finally:
            llm.close()

    outs = asyncio.run(main())
    turns = [t for r in rounds for t in r]
    cached = sum(o.metrics.num_cached_prompt_tokens for o in outs)
    return (
        cached / sum(len(p) for _, p in turns),
        [o.metrics.time_to_first_token_s for o in outs],
        [(system, o) for (system, _), o in zip(turns, outs)],
    )


def test_shared_prefixes_land_where_their_kv_is(cluster):
    """The same workload shape (6 system prompts x 4 users, distinct tokens per router) through
    the kv router and the least-load router: kv reuses far more of the prompts' KV."""
    least_load_rate, least_load_ttft, _ = _run(
        _router(cluster, "router-least-load"), _workload(1, 6, 4)
    )
    kv_rate, kv_ttft, kv_outs = _run(cluster.address, _workload(2, 6, 4))
    print(
        f"\nprefix hit rate: kv {kv_rate:.1%}, least-load {least_load_rate:.1%}; TTFT p50 kv "
        f"{statistics.median(kv_ttft) * 1e3:.1f} ms, least-load {statistics.median(least_load_ttft) * 1e3:.1f} ms"
    )
    # kv: every user after a system prompt's first finds its 8 blocks cached (3 of 4 users).
    ideal = 3 / 4 * SYSTEM_TOKENS / (SYSTEM_TOKENS + 10)
    assert kv_rate >= 0.8 * ideal
    assert kv_rate > least_load_rate + 0.1
    # Each system prompt's users went to one prefill worker, but for at most two systems: the
    # cost weighs the prefill work queued on a worker against the blocks it holds, so a round's
    # concurrent users may tip one over to the other worker, more often on a slow machine (one
    # CI run saw two); least-load routing splits about 4.5 of the 6 (a system's 3 later users
    # all on one of 2 workers has odds 1 in 4), so two or fewer still tells the policies apart.
    prefills = {w.address for w in cluster.workers if w.role == "prefill"}
    split = []
    for system in range(6):
        served = {o.metrics.served_by[0] for s, o in kv_outs[6:] if s == system}
        assert served <= prefills
        if len(served) > 1:
            split.append(system)
    assert len(split) <= 2, split


def test_router_hashes_prompts_as_the_engine_does(cluster):
    """The chain hashes the router computes for a prompt (with a cache_salt) are the block
    hashes a worker reports in its KV events after computing it."""
    prefill = next(w for w in cluster.workers if w.role == "prefill")
    prompt = [1] + list(range(300, 340))
    with LLM(prefill.address, **cluster.worker_client_kwargs()) as llm:
        llm.get_kv_cache_events(timeout=0.1)
        llm.generate(prompt, SamplingParams(max_tokens=1), cache_salt="tenant-a")
        events = llm.get_kv_cache_events(timeout=2)
    stored = [
        b["block_hash"]
        for e in events
        if e["data"]["type"] == "stored"
        for b in e["data"]["blocks"]
    ]
    index = KvIndex()
    index.apply("w", worker_pb2.KvBlocksUpdate(tokens_per_block=BLOCK_SIZE))
    request = llm_pb2.GenerateRequest(cache_salt="tenant-a")
    request.prompt.token_ids.ids[:] = prompt
    hashes = Placement.of(request).hashes(index)
    assert len(hashes) == len(prompt) // BLOCK_SIZE and hashes == stored[: len(hashes)]


def _metric(address: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples that carry labels."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(w in line for w in wanted)
    )


def test_conditional_disaggregation(cluster):
    """Short uncached prompts run whole on a decode worker (no lease opened on any prefill),
    long ones are split; greedy tokens equal the always-split router's either way."""
    rng = random.Random(3)
    short = [
        [1] + [rng.randrange(4, 250) for _ in range(rng.randrange(5, MIN_UNCACHED - 2))]
        for _ in range(4)
    ]
    long = [[1] + [rng.randrange(4, 250) for _ in range(MIN_UNCACHED + 20)] for _ in range(4)]
    prefills = [w.address for w in cluster.workers if w.role == "prefill"]
    router = cluster.service("router-conditional")
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)

    def leases_opened() -> int:
        return sum(worker_state(a).num_leases_opened for a in prefills)

    with LLM(router.address) as conditional, LLM(cluster.address) as always_split:
        before = leases_opened()
        short_outs = [conditional.generate(p, greedy) for p in short]
        after_short = leases_opened()
        long_outs = [conditional.generate(p, greedy) for p in long]
        after_long = leases_opened()
        reference = [always_split.generate(p, greedy) for p in short + long]
    assert after_short == before
    assert after_long == before + len(long)
    for out in short_outs:
        assert len(out.metrics.served_by) == 1 and out.metrics.served_by[0] not in prefills
    for out in long_outs:
        assert out.metrics.served_by[0] in prefills
    assert [o.outputs[0].token_ids for o in short_outs + long_outs] == [
        o.outputs[0].token_ids for o in reference
    ]
    decisions = "tandem:router_disagg_decisions_total"
    assert _metric(
        router.metrics_address, decisions, decision="local", reason="short_uncached_prompt"
    ) == len(short)
    assert _metric(
        router.metrics_address, decisions, decision="split", reason="long_uncached_prompt"
    ) == len(long)


def test_full_router_refuses_with_a_retry_hint_and_deadlines_reach_the_workers(cluster):
    """--max-in-flight 1: a second Generate while one runs is RESOURCE_EXHAUSTED with the
    grpc-retry-pushback-ms hint. A client deadline ends the worker's side of the request too."""
    long_request = llm_pb2.GenerateRequest(streaming=True)
    long_request.prompt.token_ids.ids[:] = [1, 5, 6, 7]
    long_request.sampling_params.max_tokens = 400
    long_request.sampling_params.ignore_eos = True
    with cluster.channel(cluster.service("router-busy").address) as channel:
        stub = llm_pb2_grpc.AsyncLLMStub(channel)
        running = stub.Generate(long_request)
        next(running)  # it runs now
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Generate(long_request))
        running.cancel()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("grpc-retry-pushback-ms", "500") in (refused.value.trailing_metadata() or ())
    with cluster.channel(cluster.address) as channel:
        stub = llm_pb2_grpc.AsyncLLMStub(channel)
        with pytest.raises(grpc.RpcError) as late:
            for _ in stub.Generate(long_request, timeout=0.5):
                pass
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while any(worker_state(w.address).num_active_requests for w in cluster.workers):
        assert time.monotonic() < deadline, "a worker still runs a request whose deadline passed"
        time.sleep(0.1)


def test_route_gives_worker_calls_what_is_left_of_the_deadline():
    """The request goes on the worker's session with the client's deadline, whose remaining time
    the session writes in the submit (test_sessions: timeout_s); a recording session in place of
    a worker's: the deadline is what is under test, not the worker."""
    from tandem.router.inbox import ENDED, Inbox
    from tandem.router.metrics import RouterMetrics
    from tandem.router.relay import Relay
    from tandem.router.workers import WorkerPool

    deadlines = []

    class Session:
        def submit(
            self,
            tag,
            request,
            client,
            split,
            deadline,
            return_first_gen_tokens=False,
            prefix_source=None,
            awaits_handoff=False,
            hand_off_to="",
        ):
            deadlines.append(deadline)

        def detach(self, tag):
            pass

        def cut(self, tag, inbox):
            pass

    class WorkerSession:
        async def attach(self, timeout):
            inbox = Inbox()
            inbox.put(ENDED)
            return Session(), 1, inbox

        def close(self):
            pass

    async def main():
        pool = WorkerPool(("127.0.0.1:1",), health_interval_s=1.0)
        worker = pool.workers[0]
        worker.session = WorkerSession()
        for deadline in (time.monotonic() + 30, None):
            relay = Relay(pool, "r", RouterMetrics(), deadline=deadline)
            async for _ in relay.direct(worker, llm_pb2.GenerateRequest()):
                pass
        await pool.close()

    asyncio.run(main())
    assert 29 < deadlines[0] - time.monotonic() <= 30 and deadlines[1] is None


def test_the_kv_policy_weighs_the_prefill_work_every_router_queued():
    """Two routers share the prefills: a prefill another router loaded (the worker's report,
    WorkerState.num_queued_prompt_tokens, less this router's own share) is not picked as if idle,
    and this router's own fresher count adds to it."""
    from tandem.common.roles import Role
    from tandem.router.policies import Picker, Policy
    from tandem.router.workers import WorkerHandle

    def worker(address: str) -> WorkerHandle:
        return WorkerHandle(address, None, None, None, None, role=Role.PREFILL, ready=True)

    index = KvIndex()
    index.block_size = 16
    picker = Picker({Role.PREFILL: Policy.KV}, index)
    a, b = worker("a:1"), worker("b:1")
    placement = Placement(token_ids=list(range(64)))
    a.others_prefill_tokens = 4096  # another router's long prompts, queued at a (its last poll)
    assert {picker.choose(Role.PREFILL, [a, b], placement, 0.0).address for _ in range(4)} == {
        "b:1"
    }
    b.queued_prefill_tokens = 8192  # ours, sent to b
    assert picker.choose(Role.PREFILL, [a, b], placement, 0.0).address == "a:1"
    assert (a.prefill_load, b.prefill_load) == (4096, 8192)


def test_our_work_that_finished_during_a_poll_is_not_counted_as_another_routers():
    """A state poll's report counts our prompts whole (their prefix-cached part too) and may count
    a request of ours that finished before the reply came: what is taken off the report is the
    most of our whole prompts there since the poll went out, so no phantom load is left on the
    worker (it sent a shared prefix's next users elsewhere)."""
    from tandem.common.roles import Role
    from tandem.router.workers import WorkerHandle

    w = WorkerHandle("a:1", None, None, None, None, role=Role.PREFILL, ready=True)
    w.queue_prefill(16, 80)  # ours before the poll: an 80-token prompt, 64 of them cached there
    w.open_state_poll()
    w.queue_prefill(200, 200)  # ours, sent while the poll is on its way
    assert w.queued_prefill_tokens == 216  # the pick weighs what will be computed
    w.queue_prefill(-16, -80)
    w.queue_prefill(-200, -200)  # both computed before the reply
    w.read_state_report(280 + 64)  # the worker counted both whole, and 64 of another router's
    assert (w.others_prefill_tokens, w.prefill_load) == (64, 64)


def test_a_worker_reports_the_prompt_tokens_queued_in_its_engine(model_dirs):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions

    engine = LLMEngine(
        EngineConfig(str(model_dirs["llama"]), num_blocks=64, max_num_batched_tokens=32)
    )
    options = SamplingOptions(max_tokens=2, ignore_eos=True)
    engine.add_request("a", [1] + list(range(4, 103)), options)  # 100 tokens, 32 a step
    engine.add_request("b", [1] + list(range(4, 43)), options)  # 40
    assert engine.snapshot().num_queued_prompt_tokens == 140
    engine.step()
    assert engine.snapshot().num_queued_prompt_tokens == 108
    while engine.num_unfinished:
        engine.step()
    assert engine.snapshot().num_queued_prompt_tokens == 0
