"""Workers dying under requests: the client sees one continuous stream (decode dies
mid-stream: migrated) or a clean success (prefill dies: retried elsewhere)."""
from __future__ import annotations

import asyncio
import signal

import pytest

from tandem.cli.cluster import LocalCluster
from tandem.client import AsyncLLM, LLM, SamplingParams
from test_disagg import worker_state


@pytest.fixture
def cluster(model_dirs):
    roles = ["prefill", "prefill", "decode", "decode", "both"]
    with LocalCluster(roles=roles, engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "256",
                                                "--block-size", "8"]) as c:
        yield c


# logprobs=0: cumulative_logprob is filled only when logprobs are asked for (as in TensorRT-LLM).
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=400, ignore_eos=True, logprobs=0),
                                    SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7,
                                                   logprobs=0)],
                         ids=["greedy", "seeded"])
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
    with LLM(cluster.workers[-1].address) as reference:  # the aggregated worker, never touched
        expected = reference.generate(prompt, params, use_tqdm=False).outputs[0]
    assert ids == out.outputs[0].token_ids == expected.token_ids  # nothing lost, nothing repeated
    assert text == out.outputs[0].text == expected.text
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].cumulative_logprob == pytest.approx(expected.cumulative_logprob, rel=1e-4, abs=1e-3)
    assert killed.address in out.metrics.served_by and len(out.metrics.served_by) >= 3


def test_requests_survive_a_dead_prefill(cluster):
    cluster.workers[0].process.send_signal(signal.SIGKILL)  # the router has not noticed yet
    cluster.workers[0].process.wait(5)
    with LLM(cluster.address) as llm:
        outs = llm.generate([f"prefill retry {i}" for i in range(6)], SamplingParams(max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert all(cluster.workers[0].address not in o.metrics.served_by[-2:] for o in outs)
