"""Disaggregation under faults: incompatible workers, abandoned handoffs, a storm
of aborts and cancellations. Nothing may leak a KV block."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from test_disagg import worker_state

from tandem.client import LLM, AsyncLLM, DisaggregatedParams, RequestError, SamplingParams
from tandem.testing.cluster import LocalCluster

LEASE_SECONDS = 2.0


def wait_leak_free(cluster, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while True:
        states = [worker_state(w.address) for w in cluster.workers]
        if (
            all(
                s.num_free_blocks == s.num_total_blocks
                and s.num_leased_blocks == 0
                and s.num_active_requests == 0
                for s in states
            )
            or time.monotonic() > deadline
        ):
            return states
        time.sleep(0.1)


def test_incompatible_handoff_is_failed_precondition(model_dirs):
    model = str(model_dirs["llama"])
    with (
        LocalCluster(
            roles=["prefill", "decode"],
            engine_args=["--model", model, "--num-blocks", "64", "--kv-lease-seconds", "60"],
            worker_args={"prefill-1": ["--block-size", "8"], "decode-1": ["--block-size", "16"]},
        ) as c,
        LLM(c.address) as llm,
    ):
        started = time.monotonic()
        with pytest.raises(RequestError) as err:
            llm.generate(
                "mismatched blocks", SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False
            )
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size: prefill 8 vs decode 16" in err.value.details
        assert time.monotonic() - started < 10  # an error, not a hang
        # The router released the lease at once (not after the 60 s expiry).
        states = wait_leak_free(c, timeout=5)
        assert all(s.num_free_blocks == s.num_total_blocks for s in states), states


def test_user_orchestrated_split_and_abandoned_handoffs(model_dirs):
    model = str(model_dirs["llama"])
    with (
        LocalCluster(
            roles=["prefill", "decode", "both"],
            engine_args=[
                "--model",
                model,
                "--num-blocks",
                "64",
                "--block-size",
                "8",
                "--kv-lease-seconds",
                str(LEASE_SECONDS),
            ],
        ) as c,
        LLM(c.address) as llm,
        LLM(c.workers[2].address, **c.worker_client_kwargs()) as aggregated,
    ):
        params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3)
        ctx = llm.generate(
            "split by hand",
            params,
            use_tqdm=False,
            disaggregated_params=DisaggregatedParams(request_type="context_only"),
        )
        handoff = ctx.outputs[0].disaggregated_params
        assert (
            handoff.request_type == "context_only"
            and handoff.opaque_state
            and len(handoff.first_gen_tokens) == 1
        )
        gen = llm.generate(
            ctx.prompt_token_ids,
            params,
            use_tqdm=False,
            disaggregated_params=DisaggregatedParams(
                request_type="generation_only",
                first_gen_tokens=handoff.first_gen_tokens,
                ctx_request_id=handoff.ctx_request_id,
                opaque_state=handoff.opaque_state,
            ),
        )
        expected = aggregated.generate("split by hand", params, use_tqdm=False).outputs[0].token_ids
        assert gen.outputs[0].token_ids == expected  # the first token included, as TensorRT-LLM
        # Handoffs nobody pulls are freed when their lease expires.
        for i in range(3):
            llm.generate(
                f"abandoned {i}",
                params,
                use_tqdm=False,
                disaggregated_params=DisaggregatedParams(request_type="context_only"),
            )
        assert worker_state(c.workers[0].address).num_leased_blocks > 0
        states = wait_leak_free(c, timeout=LEASE_SECONDS + 5)
        assert all(
            s.num_free_blocks == s.num_total_blocks and s.num_leased_blocks == 0 for s in states
        ), states


def test_200_mixed_requests_leave_no_block_behind(model_dirs):
    """Normal, aborted before/during/after the handoff, cancelled by the client, ended in the
    context phase, and handed off but never pulled: afterwards every block is free again."""
    model = str(model_dirs["llama"])
    rng = random.Random(2026)
    kinds = rng.choices(
        ["normal", "abort_early", "abort_streaming", "cancel", "never_pulled", "one_token"],
        weights=[40, 15, 15, 10, 10, 10],
        k=200,
    )

    async def one(aio, i: int, kind: str) -> str:
        prompt = [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(2, 40))]
        params = SamplingParams(
            max_tokens=1 if kind == "one_token" else rng.randrange(2, 24), ignore_eos=True
        )
        if kind == "never_pulled":
            try:
                out = await aio.generate_async(
                    prompt,
                    params,
                    disaggregated_params=DisaggregatedParams(request_type="context_only"),
                )
            except (
                RequestError
            ) as exc:  # this client's unpulled handoffs fill its share of the pool
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.retry_after_s > 0, exc
                return "refused"
            return "handoff" if out.outputs[0].disaggregated_params else "done"
        result = aio.generate_async(prompt, params, streaming=kind in ("abort_streaming", "cancel"))
        if kind == "abort_early":
            result.abort()
            return (await result).outputs[0].finish_reason or "?"
        if kind == "abort_streaming":
            async for out in result:
                result.abort()
            return out.outputs[0].finish_reason
        if kind == "cancel":
            agen = result.__aiter__()
            await agen.__anext__()
            await agen.aclose()
            return "cancelled-by-client"
        return (await result).outputs[0].finish_reason

    async def storm(address: str) -> list[str]:
        aio = await AsyncLLM(address)
        limit = asyncio.Semaphore(16)

        async def bounded(i, kind):
            async with limit:
                return await asyncio.wait_for(one(aio, i, kind), 60)

        try:
            return await asyncio.gather(*(bounded(i, k) for i, k in enumerate(kinds)))
        finally:
            aio.close()

    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            model,
            "--num-blocks",
            "96",
            "--block-size",
            "8",
            "--kv-lease-seconds",
            str(LEASE_SECONDS),
        ],
    ) as c:
        results = asyncio.run(storm(c.address))
        # A client's unpulled handoffs may pin a quarter of the prefill's pool: past that, refused.
        assert len(results) == 200 and results.count("handoff") >= 5
        assert results.count("handoff") + results.count("refused") >= 10
        assert {"length", "cancelled"} <= set(results)
        states = wait_leak_free(c, timeout=LEASE_SECONDS + 10)
        for s in states:
            assert s.num_free_blocks == s.num_total_blocks, s
            assert s.num_leased_blocks == 0 and s.num_active_requests == 0, s
        c.check_alive()  # no worker died on the way


def test_a_handoff_whose_prefill_died_is_recomputed_on_the_decode(model_dirs):
    """Issue 8 item 5: the prefill dies after its handoff, before the decode pulled. The decode
    has the prompt and the first token: it computes the prompt itself, and the request goes on
    as if the pull had worked (same tokens). Both ways the pull can fail: a decode that knew the
    prefill's NIXL agent (the READ fails) and one that did not (fetching its state fails)."""
    model = str(model_dirs["llama"])
    with (
        LocalCluster(
            roles=["prefill", "decode", "decode"],
            engine_args=["--model", model, "--num-blocks", "32", "--block-size", "8"],
        ) as c,
        LLM(c.address) as llm,
    ):
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        prefill, knows, new = c.workers

        def handoff(prompt: str):
            return llm.generate(
                prompt,
                params,
                use_tqdm=False,
                disaggregated_params=DisaggregatedParams(request_type="context_only"),
            )

        def resume(address: str, ctx) -> list[int]:
            h = ctx.outputs[0].disaggregated_params
            with LLM(address, **c.worker_client_kwargs()) as decode:
                out = decode.generate(
                    ctx.prompt_token_ids,
                    params,
                    use_tqdm=False,
                    disaggregated_params=DisaggregatedParams(
                        request_type="generation_only",
                        first_gen_tokens=h.first_gen_tokens,
                        ctx_request_id=h.ctx_request_id,
                        opaque_state=h.opaque_state,
                    ),
                )
            assert out.outputs[0].finish_reason == "length"
            handoffs[address] = out.metrics.kv_handoff
            return out.outputs[0].token_ids  # it starts with the context phase's first token

        handoffs = {}

        prompts = ("orphaned handoff", "another orphan")
        expected = {
            p: resume(knows.address, handoff(p)) for p in prompts
        }  # pulled: `knows` knows the agent now
        orphans = {p: handoff(p) for p in prompts}
        assert (
            worker_state(knows.address).kv_bytes_received > 0
            and worker_state(new.address).kv_bytes_received == 0
        )
        prefill.process.kill()
        prefill.process.wait()
        started = time.monotonic()
        assert resume(knows.address, orphans["orphaned handoff"]) == expected["orphaned handoff"]
        assert resume(new.address, orphans["another orphan"]) == expected["another orphan"]
        assert time.monotonic() - started < 20
        # Each recompute is counted and visible to the client with its reason: the READ from a
        # known agent failed; the new decode could not even reach the prefill for its state.
        for worker, reason in ((knows, "pull_failed"), (new, "peer_unreachable")):
            handoff = handoffs[worker.address]
            assert (handoff.outcome, handoff.reason) == ("recomputed", reason), handoff
            assert (handoff.prefill, handoff.decode) == (prefill.address, worker.address)
            assert worker_state(worker.address).kv_handoff_outcomes[f"recomputed:{reason}"] == 1
            assert f"({reason}); decode {worker.address} computes" in worker.log_path.read_text(
                errors="replace"
            )
        for worker in (knows, new):
            state = worker_state(worker.address)
            assert (
                state.num_free_blocks == state.num_total_blocks and state.num_active_requests == 0
            ), state
