"""pause_generation's modes (issue 32 item 4), over real processes through the router and the
prefill/decode split: "keep" freezes the requests in flight and they continue after
resume_generation with every token (the same greedy tokens as a run never paused), on new weights
if an update came meanwhile (vLLM's in-flight update; what they computed across it never enters
the prefix cache); "abort" ends them with finish_reason "cancelled" and the tokens they made so
far; any other mode is refused before any worker pauses."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tandem.client import LLM, AsyncLLM, RequestError, SamplingParams
from tandem.testing.cluster import LocalCluster

TOKEN = "pause-modes-token"
PROMPT = "a rollout paused halfway"
# Long enough that the pause lands mid-stream on the tiny model (hundreds of tokens a second).
PARAMS = SamplingParams(max_tokens=600, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "256"],
        env={"TANDEM_ADMIN_TOKEN": TOKEN},
    ) as c:
        yield c


@pytest.fixture(scope="module")
def unpaused(cluster) -> list[int]:
    with LLM(cluster.address) as llm:
        return llm.generate(PROMPT, PARAMS, use_tqdm=False).outputs[0].token_ids


async def _stream_until_paused(llm: AsyncLLM, mode: str):
    """Starts the rollout, pauses it in `mode` once a few tokens came; returns (the output, the
    task reading it, the list of token counts as they came)."""
    running = llm.generate_async(PROMPT, PARAMS, streaming=True)
    counts: list[int] = []
    first = asyncio.Event()

    async def read():
        async for out in running:
            counts.append(len(out.outputs[0].token_ids))
            if counts[-1] >= 3:
                first.set()

    reader = asyncio.create_task(read())
    await asyncio.wait_for(first.wait(), 30)
    await llm.pause_generation(mode=mode)
    return running, reader, counts


def test_keep_freezes_the_rollout_and_resume_continues_it_with_no_token_lost(cluster, unpaused):
    async def go():
        llm = AsyncLLM(cluster.address, auth_token=TOKEN)
        try:
            running, reader, counts = await _stream_until_paused(llm, "keep")
            await asyncio.sleep(0.3)  # what was on the wire when the engines stopped arrives
            held_at = counts[-1]
            assert held_at < PARAMS.max_tokens, "the rollout ended before the pause: not mid-stream"
            await asyncio.sleep(1.0)
            assert counts[-1] == held_at and not reader.done()  # frozen, not ended
            # Paused: a new request is refused; the KV pool of frozen requests cannot go.
            with pytest.raises(RequestError) as refused:
                await llm.generate_async("new", SamplingParams(max_tokens=2))
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert "paused" in refused.value.details
            with pytest.raises(RequestError) as busy:
                await llm.release(["kv_cache"])
            assert busy.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "'keep'" in busy.value.details and "'abort'" in busy.value.details
            await llm.resume_generation()
            await asyncio.wait_for(reader, 60)
            return running.outputs[0], held_at
        finally:
            llm.close()

    out, held_at = asyncio.run(go())
    assert 3 <= held_at < len(unpaused)
    assert out.token_ids == unpaused  # every token, the same as never paused
    assert out.finish_reason == "length"


def test_abort_ends_the_rollout_with_its_tokens_so_far(cluster, unpaused):
    async def go():
        llm = AsyncLLM(cluster.address, auth_token=TOKEN)
        try:
            running, reader, counts = await _stream_until_paused(llm, "abort")
            await asyncio.wait_for(reader, 30)  # the stream ends: nothing is held
            await llm.resume_generation()
            return running.outputs[0]
        finally:
            llm.close()

    out = asyncio.run(go())
    assert out.finish_reason == "cancelled"
    assert 3 <= len(out.token_ids) < len(unpaused)
    # A trainer resumes from here: the tokens are the rollout's own, in order.
    assert out.token_ids == unpaused[: len(out.token_ids)]


def test_an_unknown_mode_is_refused_and_pauses_nothing(cluster):
    async def go():
        llm = AsyncLLM(cluster.address, auth_token=TOKEN)
        try:
            with pytest.raises(RequestError) as error:
                await llm.pause_generation(mode="drain")
            return error.value
        finally:
            llm.close()

    error = asyncio.run(go())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'abort'" in error.details and "'keep'" in error.details and "drain" in error.details
    started = time.monotonic()
    with LLM(cluster.address) as llm:  # still generating
        out = llm.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and time.monotonic() - started < 30


def test_keep_lets_a_handoff_in_flight_reach_its_decode_frozen(cluster):
    """A request between its prefill and its decode when the pause came is in flight too: its
    generation phase is taken (not refused as a new request), frozen, and ends after resume."""
    from tandem.client import DisaggregatedParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(cluster.address) as llm:
        whole = llm.generate(PROMPT, params, use_tqdm=False).outputs[0].token_ids
        ctx = llm.generate(
            PROMPT,
            params,
            use_tqdm=False,
            disaggregated_params=DisaggregatedParams(request_type="context_only"),
        )
    handoff = ctx.outputs[0].disaggregated_params

    async def go():
        llm = AsyncLLM(cluster.address, auth_token=TOKEN)
        try:
            await llm.pause_generation(mode="keep")
            generation = asyncio.ensure_future(
                llm.generate_async(
                    ctx.prompt_token_ids,
                    params,
                    disaggregated_params=DisaggregatedParams(
                        request_type="generation_only",
                        first_gen_tokens=handoff.first_gen_tokens,
                        ctx_request_id=handoff.ctx_request_id,
                        opaque_state=handoff.opaque_state,
                    ),
                )
            )
            await asyncio.sleep(1.0)
            assert not generation.done()  # taken and frozen: a refusal would have ended it
            await llm.resume_generation()
            return (await asyncio.wait_for(generation, 30)).outputs[0]
        finally:
            llm.close()

    out = asyncio.run(go())
    assert out.token_ids == whole and out.finish_reason == "length"


def test_weights_updated_under_kept_requests_carry_on_and_cache_nothing_mixed(
    cluster, unpaused, model_dirs
):
    """Paused in keep mode mid-stream, the trainer's weights go in (IPC handles): the rollout
    continues on them (every token; the tokens before the pause its own, those after new), and
    the blocks it computed across the change, KV of both weights, are not served to a request
    that starts on the new weights. Last in the module: it restores the checkpoint at the end."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.rl import ipc_handles

    trainer = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.5)

    async def go():
        llm = AsyncLLM(cluster.address, auth_token=TOKEN)
        try:
            running, reader, counts = await _stream_until_paused(llm, "keep")
            await asyncio.sleep(0.3)
            held_at = counts[-1]
            await llm.update_weights(ipc_handles(trainer.named_parameters()))
            await llm.update_weights(None)
            await asyncio.to_thread(llm.get_kv_cache_events, 0.5)  # up to the update
            await llm.resume_generation()
            await asyncio.wait_for(reader, 60)
            after = await asyncio.to_thread(llm.get_kv_cache_events, 0.5)
            return running, held_at, after
        finally:
            llm.close()

    try:
        running, held_at, events_after = asyncio.run(go())
        out = running.outputs[0]
        assert 3 <= held_at < len(unpaused) and len(out.token_ids) == len(unpaused)
        assert out.token_ids[:held_at] == unpaused[:held_at]
        assert out.token_ids != unpaused  # the rest came from the new weights
        # The blocks it filled after the update (KV of both weights) were not cached anywhere ...
        stored = [e for e in events_after if e["data"]["type"] == "stored"]
        assert not stored, stored[:2]
        # ... and the whole rollout as a prompt is computed on the new weights.
        prompt = list(running.prompt_token_ids) + out.token_ids
        with LLM(cluster.address) as llm:
            again = llm.generate(
                prompt, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
            )
        with torch.no_grad():
            expected = trainer.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=4,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert again.outputs[0].token_ids == expected
    finally:

        async def restore():
            llm = AsyncLLM(cluster.address, auth_token=TOKEN)
            try:
                await llm.pause_generation()
                await llm.update_weights(str(model_dirs["llama"]))
                await llm.resume_generation()
            finally:
                llm.close()

        asyncio.run(restore())
