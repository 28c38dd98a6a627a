"""--stream-interval N on the router: the same tokens, finish reasons and logprobs as interval 1,
in about N times fewer messages (the first and the last at once), over real processes."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.client import SamplingParams
from tandem.testing.cluster import LocalCluster
from tandem.v1 import llm_pb2, types_pb2

STREAM_INTERVAL = 4


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "256",
            "--block-size",
            "8",
        ],
    ) as c:
        c.add_router("router-interval", ["--stream-interval", str(STREAM_INTERVAL)])
        yield c


def test_a_stream_interval_sends_the_same_tokens_in_fewer_messages(
    cluster, no_leaked_worker_blocks
):
    """--stream-interval 4: the first message at once, then at least 4 new tokens a message, the
    last at once; the tokens, finish reasons and cumulative logprobs are those of interval 1."""
    from tandem.client import AsyncLLM

    async def stream(address, prompt, params):
        llm = await AsyncLLM(address)
        try:
            steps = []  # per message: new tokens (all sequences), finished
            async for out in llm.generate_async(prompt, params, streaming=True):
                steps.append((sum(len(o.token_ids_diff) for o in out.outputs), out.finished))
            final = [
                (list(o.token_ids), o.finish_reason, o.cumulative_logprob) for o in out.outputs
            ]
            return steps, final
        finally:
            llm.close()

    async def run():
        results = []
        for seed, (max_tokens, n) in enumerate(((25, 1), (1, 1), (9, 2))):
            rng = random.Random(seed)
            prompt = [1] + [rng.randrange(4, 200) for _ in range(12)]
            params = SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                detokenize=False,
                n=n,
                **({"temperature": 0.9, "seed": 3} if n > 1 else {}),
            )
            every = await stream(cluster.address, prompt, params)
            grouped = await stream(cluster.service("router-interval").address, prompt, params)
            results.append((max_tokens, n, every, grouped))
        return results

    for max_tokens, n, (every_steps, every_final), (steps, final) in asyncio.run(run()):
        assert final == every_final, (max_tokens, n)
        assert sum(k for k, _ in steps) == sum(k for k, _ in every_steps) == max_tokens * n
        assert steps[0][0] >= 1  # the first token at once
        assert [finished for _, finished in steps] == [False] * (len(steps) - 1) + [True]
        assert all(k >= STREAM_INTERVAL for k, _ in steps[1:-1]), (
            steps
        )  # between: at least the interval
        assert len(steps) <= 2 + (max_tokens * n - 1) // STREAM_INTERVAL, steps
        if max_tokens * n > 2 * STREAM_INTERVAL:
            assert len(steps) < len(every_steps), (steps, every_steps)


def test_a_token_interval_holds_tokens_until_the_interval_and_never_drops_them():
    from tandem.text.front import TextFront, TextRequest
    from tandem.text.processor import TextOptions, TextProcessor

    def msg(tokens, finished=False):
        out = types_pb2.RequestOutput(request_id="r", finished=finished)
        out.outputs.add(index=0, token_ids=tokens)
        return out

    class Tracker:
        def saw(self, msg):
            pass

        def counted(self, msg, num_prompt_tokens):
            pass

    async def source(items):
        for item in items:
            if isinstance(item, Exception):
                raise item
            yield item

    def collect(items, interval):
        """What the text front sends the client for the producer's items (a message, or the
        error that ends the stream), with --stream-interval interval."""
        text_request = TextRequest(
            llm_pb2.GenerateRequest(), TextProcessor(None, TextOptions(detokenize=False)), True
        )

        async def on_stop(index, handoff):
            raise AssertionError("no stop strings here")

        async def run():
            got = []
            try:
                async for m in TextFront.respond(
                    text_request, source(items), on_stop, Tracker(), interval
                ):
                    got.append((list(m.outputs[0].token_ids), m.finished))
            except RuntimeError as exc:
                got.append(str(exc))
            return got

        return asyncio.run(run())

    ones = [msg([t]) for t in range(1, 8)] + [msg([8], finished=True)]
    assert collect(ones, 3) == [
        ([1], False),
        ([2, 3, 4], False),
        ([5, 6, 7], False),
        ([8], True),
    ]
    assert collect(ones[:5] + [msg([6], finished=True)], 3) == [
        ([1], False),
        ([2, 3, 4], False),
        ([5, 6], True),
    ]
    assert collect([msg([1]), msg([2, 3, 4, 5]), msg([6])], 3) == [
        ([1], False),
        ([2, 3, 4, 5], False),
        ([6], False),
    ]
    # A failure after held tokens: they go on first, then the error.
    assert collect([msg([1]), msg([2]), msg([3]), RuntimeError("worker lost")], 3) == [
        ([1], False),
        ([2, 3], False),
        "worker lost",
    ]


@pytest.mark.parametrize("value", ["0", "257", "-3"])
def test_a_stream_interval_out_of_range_is_refused_with_what_to_give(value):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "serve",
            "router",
            "--workers",
            "127.0.0.1:1",
            "--stream-interval",
            value,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-500:]
    assert f"stream_interval must be between 1 and 256, got {value}" in proc.stderr
