"""Workers dying under requests: the client sees one continuous stream (decode dies
mid-stream: migrated) or a clean success (prefill dies: retried elsewhere)."""

from __future__ import annotations

import asyncio
import signal

import pytest
from test_disagg import worker_state
from test_metrics import scrape, value

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.testing.cluster import LocalCluster


@pytest.fixture
def cluster(model_dirs):
    roles = ["prefill", "prefill", "decode", "decode", "both"]
    # prefill-1 computes prompts 16 tokens a step: long prompts stay on it long enough to be
    # caught there by a SIGKILL.
    with LocalCluster(
        roles=roles,
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "512",
            "--block-size",
            "8",
        ],
        worker_args={"prefill-1": ["--max-num-batched-tokens", "16"]},
    ) as c:
        yield c


# logprobs=0: cumulative_logprob is filled only when logprobs are asked for (as in TensorRT-LLM).
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=400, ignore_eos=True, logprobs=0),
        SamplingParams(
            max_tokens=400, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7, logprobs=0
        ),
    ],
    ids=["greedy", "seeded"],
)
def test_decode_dying_mid_stream_is_invisible_to_the_client(cluster, params):
    prompt = "a long story that outlives its decode worker"
    decodes = [s for s in cluster.workers if s.role == "decode"]

    async def kill_the_busy_decode():
        """Kills the decode worker as soon as it runs the request (watched independently of how
        fast this client reads the stream)."""
        while True:
            for s in decodes:
                if (await asyncio.to_thread(worker_state, s.address)).num_generated_tokens >= 10:
                    s.process.send_signal(signal.SIGKILL)
                    return s
            await asyncio.sleep(0.005)

    async def go():
        llm = await AsyncLLM(cluster.address)
        killer = asyncio.create_task(kill_the_busy_decode())
        try:
            ids, text = [], ""
            async for out in llm.generate_async(prompt, params, streaming=True):
                ids += out.outputs[0].token_ids_diff
                text += out.outputs[0].text_diff
            return out, ids, text, await asyncio.wait_for(killer, 5)
        finally:
            killer.cancel()
            llm.close()

    out, ids, text, killed = asyncio.run(go())
    assert killed is not None and killed.process.wait(5) == -signal.SIGKILL
    with LLM(
        cluster.workers[-1].address, **cluster.worker_client_kwargs()
    ) as reference:  # the aggregated worker, never touched
        expected = reference.generate(prompt, params, use_tqdm=False).outputs[0]
    assert ids == out.outputs[0].token_ids == expected.token_ids  # nothing lost, nothing repeated
    assert text == out.outputs[0].text == expected.text
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        expected.cumulative_logprob, rel=1e-4, abs=1e-3
    )
    assert killed.address in out.metrics.served_by and len(out.metrics.served_by) >= 3
    # served_by: the prefill, the killed decode, then one worker per migration.
    assert (
        value(scrape(cluster.router), "tandem:router_migrations_total")
        == len(out.metrics.served_by) - 2
    )


def test_requests_survive_a_dead_prefill(cluster):
    """The prefill dies with requests in its engine: the router retries them on the other one."""
    victim = cluster.workers[0]
    rng = __import__("random").Random(3)
    prompts = [[1] + [rng.randrange(4, 300) for _ in range(600)] for _ in range(6)]

    async def go():
        llm = await AsyncLLM(cluster.address)
        try:
            params = SamplingParams(max_tokens=5, ignore_eos=True)
            tasks = [asyncio.ensure_future(llm.generate_async(p, params)) for p in prompts]
            in_flight = 0
            while not in_flight:
                if all(t.done() for t in tasks):
                    raise AssertionError(
                        "every request finished before the prefill could be killed"
                    )
                in_flight = (
                    await asyncio.to_thread(worker_state, victim.address)
                ).num_active_requests
            victim.process.send_signal(signal.SIGKILL)
            return in_flight, await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            llm.close()

    in_flight, outs = asyncio.run(go())
    assert victim.process.wait(5) == -signal.SIGKILL and in_flight >= 1
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    served = [list(o.metrics.served_by) for o in outs]
    # Retried: the victim, then another prefill, then a decode. A request whose context phase the
    # victim finished just before it died (the kill waits for one in its engine; an earlier one
    # may be done) went on to a decode, which pulled or computed the prompt: [victim, decode].
    retried = [s for s in served if victim.address in s[:-2]]
    handed_off = [s for s in served if s[0] == victim.address and len(s) == 2]
    assert len(retried) >= 1, served  # the killed prefill really had some of these requests
    assert all(s in retried or s in handed_off or victim.address not in s for s in served), served
    assert all(s[-1] != victim.address for s in served), served
    assert value(scrape(cluster.router), "tandem:router_prefill_retries_total") == len(retried)
