"""SamplingParams.return_perf_metrics: CompletionOutput.request_perf_metrics as TensorRT-LLM fills
it (tensorrt_llm.bindings.executor.RequestPerfMetrics), through the router's split, a whole
request through the router, and a worker called directly.

TensorRT-LLM's own test (test_llm_perf_metrics): arrival < first scheduled < first token < last
token, one missed block and no reuse on a fresh one-block prompt, iter - first_iter ==
max_tokens - 1 and last_iter == iter. Here the times are wall-clock timedeltas since the Unix
epoch, compared with the test's own clock around each request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
import time
from datetime import timedelta

import pytest
from test_disagg import worker_state

from tandem.client import AsyncLLM, SamplingParams
from tandem.client.perf_metrics import RequestPerfMetrics
from tandem.testing.cluster import LocalCluster, client_kwargs_for

BLOCK_SIZE = 8
MAX_TOKENS = 6
ENGINE_ARGS = ["--num-blocks", "256", "--block-size", str(BLOCK_SIZE)]
# A router that never splits: every request runs whole (on the decode worker).
WHOLE_ROUTER_ARGS = ["--disagg-min-uncached-tokens", "1000000"]
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, return_perf_metrics=True)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=["--model", str(model_dirs["llama"]), *ENGINE_ARGS],
    ) as c:
        c.add_router("router-whole", WHOLE_ROUTER_ARGS)
        yield c


def _targets(cluster) -> dict[str, str]:
    return {
        "split": cluster.address,
        "whole": cluster.service("router-whole").address,
        "worker": cluster.workers[2].address,
    }


_PROMPT_RNG = random.Random(43)


def _fresh_prompt() -> str:
    """A prompt no worker has cached yet (about 30 tokens: several full blocks)."""
    words = [
        "amber",
        "basalt",
        "cedar",
        "delta",
        "ember",
        "fjord",
        "granite",
        "harbor",
        "iris",
        "juniper",
    ]
    return " ".join(_PROMPT_RNG.choice(words) for _ in range(24))


async def _collect(
    llm: AsyncLLM,
    prompt: str,
    params: SamplingParams,
    streaming: bool,
    first_token: asyncio.Event | None = None,
):
    """The request's final output; streamed, each message is checked: a sequence's perf metrics
    come with its last message (the one that sets its finish reason) when asked for, not before.
    first_token: set once a streamed message has brought a token."""
    if not streaming:
        return await llm.generate_async(prompt, params)
    async for out in llm.generate_async(prompt, params, streaming=True):
        if first_token is not None and any(seq.token_ids for seq in out.outputs):
            first_token.set()
        for seq in out.outputs:
            is_last = seq.finish_reason is not None
            assert (seq.request_perf_metrics is not None) == (
                is_last and params.return_perf_metrics
            ), seq
    return out


async def _generate(target: str, prompt: str, params: SamplingParams, streaming: bool):
    async with AsyncLLM(target, **client_kwargs_for(target)) as llm:
        return await _collect(llm, prompt, params, streaming)


def _run(target: str, prompt: str, params: SamplingParams = PARAMS, streaming: bool = False):
    """(output, the test's clock before and after it) as timedeltas since the Unix epoch."""
    before = timedelta(seconds=time.time())
    out = asyncio.run(_generate(target, prompt, params, streaming))
    return out, before, timedelta(seconds=time.time())


def _check_times(perf: RequestPerfMetrics, before: timedelta, after: timedelta) -> None:
    t = perf.timing_metrics
    assert (
        before
        <= t.arrival_time
        <= t.first_scheduled_time
        <= t.first_token_time
        <= t.last_token_time
        <= after
    ), t


def _num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


@pytest.mark.parametrize("streaming", [False, True], ids=["whole-output", "streamed"])
@pytest.mark.parametrize("path", ["split", "whole", "worker"])
def test_absent_unless_asked(cluster, path, streaming):
    params = dataclasses.replace(PARAMS, return_perf_metrics=False)
    out, _, _ = _run(_targets(cluster)[path], "no metrics asked", params, streaming)
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    assert out.outputs[0].request_perf_metrics is None


@pytest.mark.parametrize("streaming", [False, True], ids=["whole-output", "streamed"])
@pytest.mark.parametrize("path", ["whole", "worker"])
def test_a_whole_request(cluster, path, streaming):
    prompt = _fresh_prompt()
    out, before, after = _run(_targets(cluster)[path], prompt, streaming=streaming)
    seq = out.outputs[0]
    perf = seq.request_perf_metrics
    _check_times(perf, before, after)
    t = perf.timing_metrics
    assert (
        t.kv_cache_size == 0
        and t.kv_cache_transfer_start == t.kv_cache_transfer_end == timedelta(0)
    )
    # One step computed the prompt and drew the first token, then one step per token.
    assert (
        perf.iter == perf.last_iter and perf.last_iter - perf.first_iter == len(seq.token_ids) - 1
    )
    # A fresh prompt: every block allocated new, none found in the prefix cache.
    kv = perf.kv_cache_metrics
    blocks = _num_blocks(len(out.prompt_token_ids))
    assert (kv.num_total_allocated_blocks, kv.num_new_allocated_blocks, kv.num_missed_blocks) == (
        blocks,
    ) * 3
    assert kv.num_reused_blocks == 0 and kv.kv_cache_hit_rate == 0.0
    spec = perf.speculative_decoding
    assert (spec.acceptance_rate, spec.total_accepted_draft_tokens, spec.total_draft_tokens) == (
        0.0,
        0,
        0,
    )


@pytest.mark.parametrize("streaming", [False, True], ids=["whole-output", "streamed"])
def test_a_split_request_combines_both_halves(cluster, streaming):
    prompt = _fresh_prompt()
    out, before, after = _run(cluster.address, prompt, streaming=streaming)
    seq = out.outputs[0]
    perf = seq.request_perf_metrics
    # The router's arrival, the prefill's schedule and first token, the decode's last token:
    # in order only when combined (the decode got the request after the prefill's first token).
    _check_times(perf, before, after)
    t = perf.timing_metrics
    # The decode pulled the prompt's KV after the prefill drew the first token, before drawing its
    # own. The pull's end is the lease confirm's answer, which the first step does not wait for
    # (its outputs do): on a loaded machine the answer can come after the token was drawn.
    assert (
        t.first_token_time
        <= t.kv_cache_transfer_start
        <= min(t.kv_cache_transfer_end, t.last_token_time)
    )
    assert t.kv_cache_size > 0 and t.kv_cache_size == out.metrics.kv_transfer_bytes
    # The decode's steps: the first one drew the second token.
    assert (
        perf.iter == perf.last_iter and perf.last_iter - perf.first_iter == len(seq.token_ids) - 2
    )
    # Both workers allocated the prompt's blocks; the prefill found none of them cached.
    kv = perf.kv_cache_metrics
    blocks = _num_blocks(len(out.prompt_token_ids))
    assert kv.num_total_allocated_blocks == kv.num_new_allocated_blocks == 2 * blocks
    assert (kv.num_reused_blocks, kv.num_missed_blocks, kv.kv_cache_hit_rate) == (0, blocks, 0.0)


@pytest.mark.parametrize("path", ["split", "whole", "worker"])
def test_the_same_prompt_again_reuses_the_prefix_cache(cluster, path):
    target, prompt = _targets(cluster)[path], _fresh_prompt()
    first, _, _ = _run(target, prompt)
    again, before, after = _run(target, prompt)
    blocks = _num_blocks(len(again.prompt_token_ids))
    kv_first = first.outputs[0].request_perf_metrics.kv_cache_metrics
    perf = again.outputs[0].request_perf_metrics
    _check_times(perf, before, after)
    kv = perf.kv_cache_metrics
    assert kv_first.num_reused_blocks == 0
    assert 0 < kv.num_reused_blocks < blocks  # the prompt's last token is computed again
    assert kv.num_reused_blocks + kv.num_missed_blocks == blocks
    assert (
        kv.kv_cache_hit_rate == pytest.approx(kv.num_reused_blocks / blocks)
        and kv.kv_cache_hit_rate > 0
    )
    if (
        path == "split"
    ):  # the decode's own allocation counts too; the pull says what it still needed
        assert kv.num_total_allocated_blocks == 2 * blocks
        assert perf.timing_metrics.kv_cache_size == again.metrics.kv_transfer_bytes


@pytest.mark.parametrize("streaming", [False, True], ids=["whole-output", "streamed"])
@pytest.mark.parametrize("path", ["split", "worker"])
def test_each_of_n_sequences_gets_its_own(cluster, path, streaming):
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        return_perf_metrics=True,
        n=3,
        temperature=0.8,
        seed=5,
    )
    out, before, after = _run(_targets(cluster)[path], _fresh_prompt(), params, streaming)
    assert sorted(o.index for o in out.outputs) == [0, 1, 2]
    perfs = [o.request_perf_metrics for o in out.outputs]
    for perf in perfs:
        _check_times(perf, before, after)
    if path == "split":
        # n single-sequence splits: each its own pull (its own window), all with the one arrival
        # at the router; the decode's steps drew all but the first token.
        assert all(p.timing_metrics.kv_cache_size > 0 for p in perfs)
        assert len({p.timing_metrics.arrival_time for p in perfs}) == 1
        assert (
            len(
                {
                    (
                        p.timing_metrics.kv_cache_transfer_start,
                        p.timing_metrics.kv_cache_transfer_end,
                    )
                    for p in perfs
                }
            )
            == 3
        )
        assert all(
            p.last_iter - p.first_iter == len(o.token_ids) - 2 for p, o in zip(perfs, out.outputs)
        )
    else:  # one engine request per sequence, each drawing a token per step
        assert all(
            p.last_iter - p.first_iter == len(o.token_ids) - 1 for p, o in zip(perfs, out.outputs)
        )


@pytest.mark.parametrize("streaming", [False, True], ids=["whole-output", "streamed"])
def test_beam_search_best_of_returns_it_on_each_beam(cluster, streaming):
    """The beams come from one searched request (aggregated even through the splitting router):
    each returned one carries its record."""
    params = dataclasses.replace(PARAMS, use_beam_search=True, n=2, best_of=3)
    out, before, after = _run(cluster.address, _fresh_prompt(), params, streaming)
    assert len(out.outputs) == 2
    for seq in out.outputs:
        _check_times(seq.request_perf_metrics, before, after)
    assert out.outputs[0].request_perf_metrics == out.outputs[1].request_perf_metrics


@pytest.fixture
def two_decodes(model_dirs):
    """A prefill, two decode workers and an aggregated one; the router-whole router runs whole
    requests on a decode worker."""
    with LocalCluster(
        roles=["prefill", "decode", "decode", "both"],
        engine_args=["--model", str(model_dirs["llama"]), *ENGINE_ARGS],
    ) as c:
        c.add_router("router-whole", WHOLE_ROUTER_ARGS)
        yield c


async def _stream_killing_its_decode(cluster, llm: AsyncLLM, params: SamplingParams):
    """Streams a long request and kills the decode worker that runs it once it has drawn 10 tokens
    for it and the client has its first one (the router's record of the start is what it saw:
    on a loaded machine the worker can be 10 tokens ahead of it): (output, the test's clock
    before, when the kill was sent, after)."""
    decodes = [s for s in cluster.workers if s.role == "decode" and s.process.poll() is None]
    generated = {s.address: worker_state(s.address).num_generated_tokens for s in decodes}
    killed_at = []
    first_token = asyncio.Event()

    async def kill_the_busy_decode():
        await first_token.wait()
        while True:
            for s in decodes:
                if (
                    await asyncio.to_thread(worker_state, s.address)
                ).num_generated_tokens >= generated[s.address] + 10:
                    killed_at.append(timedelta(seconds=time.time()))
                    s.process.send_signal(signal.SIGKILL)
                    await asyncio.to_thread(s.process.wait, 5)
                    return
            await asyncio.sleep(0.005)

    before = timedelta(seconds=time.time())
    killer = asyncio.create_task(kill_the_busy_decode())
    try:
        out = await _collect(
            llm, "a long story that outlives its decode worker", params, True, first_token
        )
        await asyncio.wait_for(killer, 5)
    finally:
        killer.cancel()
    return out, before, killed_at[0], timedelta(seconds=time.time())


def test_a_migrated_stream_keeps_a_sane_record(two_decodes):
    """A decode worker dies mid-stream and the request carries on elsewhere, recomputed: its last
    message still has the whole request's record, the start as it happened before the kill."""
    params = dataclasses.replace(PARAMS, max_tokens=300)

    async def go():
        # Both clients set up while every worker is alive (setup waits for them all).
        async with (
            AsyncLLM(two_decodes.address) as split,
            AsyncLLM(two_decodes.service("router-whole").address) as whole,
        ):
            return [
                await _stream_killing_its_decode(two_decodes, llm, params) for llm in (split, whole)
            ]

    for out, before, killed_at, after in asyncio.run(go()):
        seq = out.outputs[0]
        assert len(seq.token_ids) == 300 and len(out.metrics.served_by) >= 2
        perf = seq.request_perf_metrics
        _check_times(perf, before, after)
        t = perf.timing_metrics
        assert t.first_token_time < killed_at < t.last_token_time
        # The worker that finished it recomputed the KV: no pull.
        assert t.kv_cache_size == 0 and t.kv_cache_transfer_start == timedelta(0)
        assert perf.first_iter <= perf.last_iter == perf.iter


@pytest.mark.parametrize("streaming", [False, True], ids=["whole-output", "streamed"])
@pytest.mark.parametrize("path", ["split", "whole", "worker"])
@pytest.mark.parametrize("stop_after", [1, 3], ids=["first-token", "later-token"])
def test_a_stop_string_still_returns_them(cluster, path, streaming, stop_after):
    """A stop string ends the sequence in the text front, after the engine: the producer's record
    (up to the abort) still reaches the message that ends it, on a split the prefill's alone when
    the stop string is in the first token."""
    target = _targets(cluster)[path]
    prompt = _fresh_prompt()
    greedy = dataclasses.replace(PARAMS, max_tokens=12, top_k=1, return_perf_metrics=False)
    longer = _run(target, prompt, greedy)[0].outputs[0].text
    # The text of the first k >= stop_after tokens where it is whole (not cut inside a character:
    # the random model draws byte tokens), and the shortest end of it found nowhere before, so
    # that the stop string matches in token k, not earlier.
    for k in range(stop_after, 12):
        text = _run(target, prompt, dataclasses.replace(greedy, max_tokens=k))[0].outputs[0].text
        if text and longer.startswith(text) and not text.endswith("\ufffd"):
            break
    stop = next(
        (text[-n:] for n in range(1, len(text) + 1) if text.find(text[-n:]) == len(text) - n), ""
    )
    assert stop, (text, longer)
    # Room to run on past the stop string: a sequence the worker finished before the front's stop
    # reached it is aborted in the router, and its record is not waited for.
    out, before, after = _run(
        target,
        prompt,
        dataclasses.replace(greedy, max_tokens=64, stop=[stop], return_perf_metrics=True),
        streaming,
    )
    seq = out.outputs[0]
    assert seq.finish_reason == "stop" and seq.stop_reason == stop, seq
    assert seq.text + stop == text, (seq.text, stop, text)
    perf = seq.request_perf_metrics
    assert perf is not None, seq
    _check_times(perf, before, after)
    assert perf.kv_cache_metrics.num_total_allocated_blocks >= _num_blocks(
        len(out.prompt_token_ids)
    )
    assert perf.first_iter <= perf.last_iter == perf.iter
    if (
        path == "split"
    ):  # a stop in the first token ends the request at the prefill, before any pull
        assert (perf.timing_metrics.kv_cache_size > 0) == (k > 1), (k, perf.timing_metrics)


async def _abort_after_tokens(target: str, prompt: str, params: SamplingParams, num_tokens: int):
    async with AsyncLLM(target, **client_kwargs_for(target)) as llm:
        result = llm.generate_async(prompt, params, streaming=True)
        async for out in result:
            if len(out.outputs[0].token_ids) >= num_tokens and not result.aborted():
                result.abort()
        return out


@pytest.mark.parametrize("path", ["split", "whole", "worker"])
def test_an_aborted_request_gets_the_record_up_to_the_abort(cluster, path):
    params = SamplingParams(max_tokens=200, ignore_eos=True, return_perf_metrics=True)
    before = timedelta(seconds=time.time())
    out = asyncio.run(_abort_after_tokens(_targets(cluster)[path], _fresh_prompt(), params, 3))
    after = timedelta(seconds=time.time())
    seq = out.outputs[0]
    assert seq.finish_reason == "cancelled" and 3 <= len(seq.token_ids) < 200, seq
    perf = seq.request_perf_metrics
    assert perf is not None, seq
    _check_times(perf, before, after)
    # The engine's record may hold tokens drawn after the last one the client got, none before it.
    assert perf.last_iter - perf.first_iter >= len(seq.token_ids) - (2 if path == "split" else 1)
