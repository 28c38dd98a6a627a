"""Issue 8, item 7: tokenless context_only requests whose handoffs nobody pulls may pin only part
of a prefill's pool (per client and all clients together); past that they are refused with
RESOURCE_EXHAUSTED and a retry hint, and ordinary requests keep flowing at their usual pace."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
from reliability import lost, record, run_load, scaled
from test_disagg import worker_state

from tandem.client import AsyncLLM, DisaggregatedParams, RequestError, SamplingParams
from tandem.testing.cluster import LocalCluster

NUM_BLOCKS, BLOCK_SIZE, LEASE_SECONDS = 256, 8, 10


def test_hoarded_handoffs_cannot_starve_ordinary_requests(model_dirs):
    num_hoarders, per_hoarder = 6, scaled(20, 60)
    num_ordinary, max_tokens = scaled(40, 300), 16
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            str(NUM_BLOCKS),
            "--block-size",
            str(BLOCK_SIZE),
            "--kv-lease-seconds",
            str(LEASE_SECONDS),
        ],
    ) as c:
        prefill = c.workers[0]
        rng = random.Random(7)

        async def hoard(llm) -> tuple[int, list[RequestError]]:
            handed, refusals = 0, []
            for _ in range(per_hoarder):
                prompt = [1] + [rng.randrange(4, 300) for _ in range(30)]  # 4 blocks each
                try:
                    await llm.generate_async(
                        prompt,
                        SamplingParams(max_tokens=4),
                        disaggregated_params=DisaggregatedParams(request_type="context_only"),
                    )
                    handed += 1
                except RequestError as exc:
                    refusals.append(exc)
            return handed, refusals

        async def go():
            # Half come through the router, half call the prefill worker directly; one connection each.
            hoarders = [
                AsyncLLM(c.address)
                if i % 2
                else AsyncLLM(prefill.address, **c.worker_client_kwargs())
                for i in range(num_hoarders)
            ]
            llm = AsyncLLM(c.address)
            try:
                hoarded = await asyncio.gather(*(hoard(h) for h in hoarders))
                pinned = (await asyncio.to_thread(worker_state, prefill.address)).num_leased_blocks
                started = time.monotonic()
                prompts = [
                    [1] + [rng.randrange(4, 300) for _ in range(60)] for _ in range(num_ordinary)
                ]
                outcomes = await asyncio.wait_for(
                    run_load(
                        llm, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 16
                    ),
                    120,
                )
                return hoarded, pinned, outcomes, time.monotonic() - started
            finally:
                for h in hoarders + [llm]:
                    h.close()

        hoarded, pinned, outcomes, ordinary_s = asyncio.run(go())
        handed = sum(h for h, _ in hoarded)
        refusals = [r for _, rs in hoarded for r in rs]
        failed = lost(outcomes, max_tokens)
        slowest = max(o.seconds for o in outcomes)
        record(
            "lease hoarding: 6 clients' unpulled context_only handoffs, then ordinary load",
            len(outcomes),
            len(outcomes) - len(failed),
            len(failed),
            "pytest tests/test_reliability_leases.py",
            f"{handed} handoffs pinned {pinned}/{NUM_BLOCKS} blocks, {len(refusals)} refused; slowest ordinary "
            f"request {slowest:.2f} s",
        )
        # Each client may pin a quarter of the pool, all of them half of it.
        assert pinned <= NUM_BLOCKS // 2 and handed * 4 <= NUM_BLOCKS // 2 and handed >= 16
        assert refusals and all(
            r.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            and 0 < r.retry_after_s <= LEASE_SECONDS + 2
            and "retry in" in r.details
            for r in refusals
        )
        assert not failed, failed[:3]
        assert slowest < LEASE_SECONDS / 2, (
            slowest
        )  # nobody waited for the hoarded leases to expire
        deadline = time.monotonic() + LEASE_SECONDS + 10
        while (state := worker_state(prefill.address)).num_leases and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state.num_leases == 0 and state.num_free_blocks == state.num_total_blocks, state
        assert state.lease_endings["expired"] == handed
