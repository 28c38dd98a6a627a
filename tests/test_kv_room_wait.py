"""A handoff whose decode has no room in its KV pool waits for room (--kv-room-wait-seconds)
and pulls once a running request frees its blocks, instead of computing the prompt at once;
with 0 it computes the prompt (recomputed: no_room). Real processes: the decodes' pools are
filled by a long request of their own."""

from __future__ import annotations

import asyncio
import random

import pytest
from test_disagg import worker_state

from tandem.client import LLM, AsyncLLM, DisaggregatedParams, SamplingParams
from tandem.testing.cluster import LocalCluster

BLOCK = 16
DECODE_BLOCKS = 64  # 1024 tokens
HOG_PROMPT, HOG_TOKENS = 700, 300  # 44 blocks at once, 63 at its end
PROMPT = 400  # 25 blocks: no room while the hog runs
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(model_dirs):
    """prefill (a large pool); decode-1 waits for room (the default), decode-2 does not."""
    small = ["--num-blocks", str(DECODE_BLOCKS)]
    with LocalCluster(
        roles=["prefill", "decode", "decode"],
        engine_args=["--model", str(model_dirs["llama"]), "--block-size", str(BLOCK)],
        worker_args={
            "prefill-1": ["--num-blocks", "512"],
            "decode-1": small,
            "decode-2": [*small, "--kv-room-wait-seconds", "0"],
        },
    ) as c:
        yield c


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 380) for _ in range(n)]


async def _hog(dec, seed: int):
    """A long request of the decode's own, streaming: once this returns (its first message) it
    holds its prompt's blocks, and the pool has no room for a handoff's. Its iterator."""
    hog = dec.generate_async(
        _ids(seed, HOG_PROMPT),
        SamplingParams(max_tokens=HOG_TOKENS, ignore_eos=True),
        streaming=True,
    )
    hog_iter = hog.__aiter__()
    await hog_iter.__anext__()
    return hog_iter


def _generation_only(ctx) -> DisaggregatedParams:
    """The generation_only params of a context phase's output ctx (a client's own split)."""
    h = ctx.outputs[0].disaggregated_params
    assert h.opaque_state
    return DisaggregatedParams(
        request_type="generation_only",
        first_gen_tokens=h.first_gen_tokens,
        ctx_request_id=h.ctx_request_id,
        opaque_state=h.opaque_state,
    )


def _split_while_full(cluster, decode, seed: int):
    """The hog runs on the decode; once it streams, a context phase's handoff is presented to
    the same decode. Returns (the handoff request's output, the hog's output)."""
    prompt = _ids(seed, PROMPT)

    async def run():
        kwargs = cluster.worker_client_kwargs()
        async with AsyncLLM(decode.address, **kwargs) as dec, AsyncLLM(cluster.address) as router:
            hog_iter = await _hog(dec, seed + 1000)
            params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            ctx = await router.generate_async(
                prompt,
                params,
                disaggregated_params=DisaggregatedParams(request_type="context_only"),
            )
            gen = await dec.generate_async(
                prompt, params, disaggregated_params=_generation_only(ctx)
            )
            async for _ in hog_iter:
                pass
            return gen

    return prompt, asyncio.run(run())


@pytest.mark.parametrize("which", ["waits", "recomputes"])
def test_a_handoff_without_room_waits_and_pulls_or_recomputes_at_once(cluster, which):
    decode = cluster.workers[1] if which == "waits" else cluster.workers[2]
    before = dict(worker_state(decode.address).kv_handoff_outcomes)
    prompt, gen = _split_while_full(cluster, decode, seed=7 if which == "waits" else 8)
    after = dict(worker_state(decode.address).kv_handoff_outcomes)
    with LLM(cluster.address) as llm:  # the same request, split by the router with room
        expected = llm.generate(
            prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
        )
    assert gen.outputs[0].token_ids == expected.outputs[0].token_ids
    handoff = gen.metrics.kv_handoff
    if which == "waits":
        assert (handoff.outcome, handoff.reason) == ("pulled", "")
        assert handoff.room_wait_s > 0
        assert after.get("pulled", 0) == before.get("pulled", 0) + 1
        assert after.get("recomputed:no_room", 0) == before.get("recomputed:no_room", 0)
    else:
        assert (handoff.outcome, handoff.reason) == ("recomputed", "no_room")
        assert handoff.room_wait_s == 0
        assert after["recomputed:no_room"] == before.get("recomputed:no_room", 0) + 1


def test_a_bad_room_wait_is_refused_at_start():
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "serve",
            "decode",
            "--kv-room-wait-seconds",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "kv_room_wait_s must be in [0, 3600]" in proc.stderr


def test_handoffs_waiting_for_room_get_it_in_the_order_they_came():
    """Three handoffs find no room; room for one frees at a time: they get it first come, first
    served (the head of the line asks for all), and one past its wait gives up."""
    import time
    from types import SimpleNamespace

    from tandem.decode.generation import GenerationPhase
    from tandem.decode.outcomes import Reason
    from tandem.decode.pull_links import PullFloor, PullLinks
    from tandem.engine.messages import AddRequest
    from tandem.engine.sampling_options import SamplingOptions

    class Core:
        def __init__(self):
            self.room = 0
            self.asked: list[str] = []

        async def call(self, command):
            self.asked.append(command.request_id)
            if self.room:
                self.room -= 1
                return SimpleNamespace(request_id=command.request_id)
            return None

    async def run():
        core = Core()
        phase = GenerationPhase.__new__(GenerationPhase)
        phase.room_wait_s = 1.0
        from collections import deque

        phase._room_line = deque()
        phase.poller = SimpleNamespace(transceiver=SimpleNamespace(block_nbytes=4096))
        phase.links = PullLinks(PullFloor())
        handoff = SimpleNamespace(
            lease_expires_at=time.time() + 60, block_ids=[1, 2, 3], ctx_endpoint="p:1"
        )

        async def reserve(rid, delay):
            await asyncio.sleep(delay)
            add = AddRequest(rid, [1, 2, 3], SamplingOptions(), remote_kv=True)
            return await phase._reserve(core, add, handoff)

        tasks = [asyncio.create_task(reserve(f"r{i}", 0.01 * i)) for i in range(3)]
        got = []
        await asyncio.sleep(0.1)
        for _ in range(2):  # room for one, twice
            core.room = 1
            done, _ = await asyncio.wait(
                [t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED
            )
            got += [t.result()[0].request_id for t in done]
        last = await tasks[2]
        # Only the head of the line asks while others wait: no "r2" before "r1" got its room.
        first_r2 = core.asked.index("r2", 1)
        return got, last, core.asked, first_r2

    got, last, asked, first_r2 = asyncio.run(run())
    assert got == ["r0", "r1"]
    plan, reason, waited = last
    assert plan is None and reason is Reason.NO_ROOM and 0.9 <= waited <= 3.0
    assert "r1" in asked[:first_r2]


def test_a_pull_starts_only_with_the_time_it_should_take_left_on_the_lease():
    """After a wait for room, a lease with less left than twice what the peer's pulls of that
    many bytes took (plus the 1 s margin) is not pulled: lease_expiring, the prompt computed."""
    import time
    from types import SimpleNamespace

    from tandem.decode.generation import GenerationPhase
    from tandem.decode.outcomes import Reason
    from tandem.decode.pull_links import PullFloor, PullLinks
    from tandem.engine.messages import AddRequest
    from tandem.engine.sampling_options import SamplingOptions

    class Core:
        def __init__(self, room_after_s: float = 0.0):
            self.room_at = time.monotonic() + room_after_s

        async def call(self, command):
            if time.monotonic() < self.room_at:
                return None  # no room yet
            return SimpleNamespace(request_id=command.request_id)

    def reserve(seconds_left: float, pull_seconds: float | None, room_after_s: float = 0.0):
        phase = GenerationPhase.__new__(GenerationPhase)
        phase.room_wait_s = 1.0
        phase._room_line = deque()
        phase.poller = SimpleNamespace(transceiver=SimpleNamespace(block_nbytes=1 << 20))
        phase.links = PullLinks(PullFloor())
        if pull_seconds is not None:  # an earlier pull of 10 MiB from that prefill took this long
            phase.links.observe("p:1", "agent", True, False, 10 << 20, pull_seconds)
        handoff = SimpleNamespace(
            lease_expires_at=time.time() + seconds_left,
            block_ids=list(range(10)),
            ctx_endpoint="p:1",
        )
        add = AddRequest("r", [1, 2, 3], SamplingOptions(), remote_kv=True)
        return asyncio.run(phase._reserve(Core(room_after_s), add, handoff))

    from collections import deque

    assert reserve(3.0, None)[0] is not None  # nothing measured: the margin alone
    assert reserve(3.0, 0.5)[0] is not None  # 1 + 2 x 0.5 s < 3 s
    plan, reason, _ = reserve(3.0, 1.5)  # 1 + 2 x 1.5 s > 3 s
    assert plan is None and reason is Reason.LEASE_EXPIRING
    # Enough left when it came (1 + 2 x 0.25 < 1.8 s), but the wait for room ate into it: once
    # what is left no longer covers the pull, it gives up (room would only come later).
    plan, reason, waited = reserve(1.8, 0.25, room_after_s=0.9)
    assert plan is None and reason is Reason.LEASE_EXPIRING and 0.2 <= waited <= 0.6


def test_a_client_own_handoff_cancelled_while_waiting_for_room_ends_its_lease(cluster):
    """A client that runs the split itself (no router to release the lease) cancels its
    generation_only while the decode waits for room: the prefill's lease ends at once, not when
    it expires."""
    decode, prefill = cluster.workers[1], cluster.workers[0]
    prompt = _ids(21, PROMPT)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run():
        kwargs = cluster.worker_client_kwargs()
        async with (
            AsyncLLM(decode.address, **kwargs) as dec,
            AsyncLLM(prefill.address, **kwargs) as pre,
        ):
            hog_iter = await _hog(dec, 1021)
            before = worker_state(prefill.address).num_leases
            ctx = await pre.generate_async(
                prompt,
                params,
                disaggregated_params=DisaggregatedParams(request_type="context_only"),
            )
            assert worker_state(prefill.address).num_leases == before + 1
            gen = dec.generate_async(
                prompt,
                params,
                disaggregated_params=_generation_only(ctx),
                streaming=True,
            )
            task = asyncio.ensure_future(gen.__aiter__().__anext__())
            await asyncio.sleep(0.3)  # waiting for room: the hog holds the pool
            assert not task.done()
            task.cancel()
            gen.abort()
            left, deadline = None, time.monotonic() + 5
            while time.monotonic() < deadline:
                left = worker_state(prefill.address).num_leases
                if left == before:
                    break
                await asyncio.sleep(0.1)
            async for _ in hog_iter:
                pass
            return before, left

    import time

    before, left = asyncio.run(run())
    assert left == before, "the cancelled handoff's lease is still out at the prefill"
    assert worker_state(decode.address).kv_handoff_outcomes["cancelled"] >= 1
