"""The engine core in a process of its own (--engine-process, worker/core_process.py): the same
tokens, text, logprobs and stop strings as transformers through the router; aborts, guided
decoding, stats and admin calls cross the process boundary; killing the core under streams takes
its worker NOT_SERVING within a second and out (non-zero), and the router moves the streams to
another worker with no token lost. The frames themselves: engine/wire.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_disagg import worker_state

from tandem.client import LLM, AsyncLLM, RequestError, SamplingParams
from tandem.testing.cluster import LocalCluster, channel_to
from tandem.v1 import worker_pb2, worker_pb2_grpc

TOKEN = "engine-process-admin"


@pytest.fixture(scope="module")
def cluster(model_dirs):
    """Router + an aggregated worker whose engine core runs in its own process + a plain one."""
    with LocalCluster(
        roles=["both", "both"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "128"],
        worker_args={"both-1": ["--engine-process"]},
        env={"TANDEM_ADMIN_TOKEN": TOKEN},
    ) as c:
        yield c


def _process_worker(cluster):
    return cluster.workers[0]


def test_the_core_is_another_process_and_serves_transformers_tokens(cluster, model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    worker = _process_worker(cluster)
    state = worker_state(worker.address)
    assert state.engine_core_pid not in (0, worker.process.pid)
    os.kill(state.engine_core_pid, 0)  # alive
    plain = worker_state(cluster.workers[1].address)
    assert plain.engine_core_pid == cluster.workers[1].process.pid
    prompts = [ref.tokenizer.encode(f"engine process {i} " * (2 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    with LLM(worker.address, **cluster.worker_client_kwargs()) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        with LLM(cluster.workers[1].address, **cluster.worker_client_kwargs()) as other:
            theirs = other.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats(timeout=2)
    for prompt, out, their in zip(prompts, outs, theirs):
        seq = out.outputs[0]
        assert seq.token_ids == ref.greedy(prompt, 20)
        assert seq.text == ref.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        for mine, other in zip(seq.logprobs, their.outputs[0].logprobs, strict=True):
            assert mine.keys() == other.keys()
            for token in mine:
                assert mine[token].logprob == pytest.approx(other[token].logprob, abs=1e-4)
    assert stats and all("iterLatencyMS" in s for s in stats)


def test_streams_stop_strings_and_aborts_cross_the_boundary(cluster, model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    worker = _process_worker(cluster)
    prompt = ref.tokenizer.encode("stop strings and aborts")
    full = ref.tokenizer.decode(ref.greedy(prompt, 30), skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]

    async def go():
        llm = await AsyncLLM(worker.address, **cluster.worker_client_kwargs())
        try:
            stopped = await llm.generate_async(
                prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])
            )
            long = llm.generate_async(
                prompt, SamplingParams(max_tokens=2000, ignore_eos=True), streaming=True
            )
            seen = 0
            async for out in long:
                seen += len(out.outputs[0].token_ids_diff)
                if seen >= 5:
                    long.abort()
            return stopped, out
        finally:
            llm.close()

    stopped, aborted = asyncio.run(go())
    assert stopped.outputs[0].text == full[: full.index(stop)]
    assert stopped.outputs[0].finish_reason == "stop"
    assert aborted.outputs[0].finish_reason == "cancelled"
    assert len(aborted.outputs[0].token_ids) < 2000
    deadline = time.monotonic() + 5
    while worker_state(worker.address).num_active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    state = worker_state(worker.address)
    assert state.num_active_requests == 0 and state.num_free_blocks == state.num_total_blocks


def test_guided_decoding_crosses_as_a_serialized_grammar(cluster):
    from tandem.client import GuidedDecodingParams

    params = SamplingParams(
        max_tokens=12, guided_decoding=GuidedDecodingParams(regex="(yes|no) [0-9]{3}")
    )
    worker = _process_worker(cluster)
    with LLM(worker.address, **cluster.worker_client_kwargs()) as llm:
        text = llm.generate("answer", params, use_tqdm=False).outputs[0].text
    assert text.split(" ")[0] in ("yes", "no") and len(text.split(" ")[1]) == 3


def test_lora_adapters_are_read_by_the_core(cluster, model_dirs, tmp_path):
    """The IO side names the adapter; the core reads it itself and gives peft's tokens. An
    adapter the workers cannot read fails its request with a message, nothing hangs."""
    from lora_adapters import PeftOracle, write_adapter

    from tandem.client import LoRARequest

    model_dir = model_dirs["llama"]
    adapter = LoRARequest(
        "core-adapter", 7, str(write_adapter(model_dir, tmp_path / "a7", seed=7, rank=4, std=0.2))
    )
    prompt = [1, 57, 12, 230, 9, 41, 77, 3, 150, 18, 66]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(_process_worker(cluster).address, **cluster.worker_client_kwargs()) as llm:
        out = llm.generate(prompt, params, lora_request=adapter, use_tqdm=False)
        assert out.outputs[0].token_ids == PeftOracle(model_dir).greedy(
            prompt, 12, adapter.lora_path
        )
        with pytest.raises(RequestError) as err:
            llm.generate(
                prompt,
                params,
                lora_request=LoRARequest("nowhere", 8, str(tmp_path / "missing")),
                use_tqdm=False,
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_weights_and_memory_are_managed_through_the_core(cluster, model_dirs, tmp_path):
    from tandem.engine.checkpoints import write_tiny_checkpoint

    other = write_tiny_checkpoint(tmp_path / "other-llama", "llama", seed=5)
    worker = _process_worker(cluster)
    kwargs = dict(cluster.worker_client_kwargs(), auth_token=TOKEN)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def admin(call):
        llm = AsyncLLM(worker.address, **kwargs)
        try:
            return await call(llm)
        finally:
            llm.close()

    with LLM(worker.address, **kwargs) as llm:
        old = llm.generate("weights", params, use_tqdm=False).outputs[0].token_ids
        asyncio.run(admin(lambda a: a.pause_generation()))
        asyncio.run(admin(lambda a: a.update_weights(str(other))))
        asyncio.run(admin(lambda a: a.update_weights(None)))  # finalize: crosses as CopyWeights
        asyncio.run(admin(lambda a: a.resume_generation()))
        new = llm.generate("weights", params, use_tqdm=False).outputs[0].token_ids
        assert new != old
        asyncio.run(admin(lambda a: a.release(["model", "kv_cache"])))
        with pytest.raises(RequestError) as err:
            llm.generate("refused while released", params, use_tqdm=False)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        asyncio.run(admin(lambda a: a.resume(["model", "kv_cache"])))
        asyncio.run(admin(lambda a: a.pause_generation()))
        asyncio.run(admin(lambda a: a.update_weights(str(model_dirs["llama"]))))
        asyncio.run(admin(lambda a: a.resume_generation()))
        assert llm.generate("weights", params, use_tqdm=False).outputs[0].token_ids == old


def test_a_split_cluster_of_engine_processes_hands_off_over_nixl(model_dirs, oracle):
    """Prefill and decode each with their core (and its NIXL agent) in a process of their own:
    the decode pulls the prefill's KV (no recompute), the leases end confirmed, a released and
    resumed pool comes back under a new agent and pulls again."""
    ref = oracle(model_dirs["llama"])
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "128",
            "--engine-process",
        ],
        env={"TANDEM_ADMIN_TOKEN": TOKEN},
    ) as cluster:
        prefill, decode = cluster.workers
        prompts = [ref.tokenizer.encode(f"split over processes {i} " * (3 + i)) for i in range(3)]
        params = SamplingParams(max_tokens=16, ignore_eos=True, return_perf_metrics=True)

        def generate():
            with LLM(cluster.address, auth_token=TOKEN) as llm:
                outs = llm.generate(prompts, params, use_tqdm=False)
            for prompt, out in zip(prompts, outs):
                seq = out.outputs[0]
                assert seq.token_ids == ref.greedy(prompt, 16)
                assert seq.request_perf_metrics.kv_handoff.outcome == "pulled"

        generate()
        state = worker_state(decode.address)
        assert state.kv_bytes_received > 0 and state.engine_core_pid != decode.process.pid
        before = worker_state(prefill.address)
        assert before.engine_core_pid != prefill.process.pid

        async def admin(call):
            llm = AsyncLLM(decode.address, **cluster.worker_client_kwargs(), auth_token=TOKEN)
            try:
                return await call(llm)
            finally:
                llm.close()

        asyncio.run(admin(lambda a: a.release(["kv_cache"])))
        asyncio.run(admin(lambda a: a.resume(["kv_cache"])))
        generate()
        deadline = time.monotonic() + 10
        while worker_state(prefill.address).num_leases and time.monotonic() < deadline:
            time.sleep(0.05)
        after = worker_state(prefill.address)
        assert after.num_leases == 0 and after.num_free_blocks == after.num_total_blocks
        assert after.lease_endings["pulled"] >= 6


def test_a_dead_core_takes_its_worker_out_and_its_streams_move(model_dirs, oracle):
    """SIGKILL the engine core under streams: its worker is NOT_SERVING within a second and
    exits non-zero; the router moves the streams to the other worker, no token lost."""
    ref = oracle(model_dirs["llama"])
    with LocalCluster(
        roles=["both", "both"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "256"],
        worker_args={"both-1": ["--engine-process"]},
        router_args=["--health-interval", "0.2", "--health-timeout", "0.5"],
    ) as cluster:
        victim = cluster.workers[0]
        core_pid = worker_state(victim.address).engine_core_pid
        prompts = [ref.tokenizer.encode(f"outlive the core {i}") for i in range(4)]
        params = SamplingParams(max_tokens=300, ignore_eos=True)

        async def go():
            llm = await AsyncLLM(cluster.address)
            try:

                async def one(prompt):
                    ids = []
                    async for out in llm.generate_async(prompt, params, streaming=True):
                        ids += out.outputs[0].token_ids_diff
                    return ids, out

                tasks = [asyncio.create_task(one(p)) for p in prompts]
                await asyncio.to_thread(_wait_for_tokens, victim.address, 40)
                os.kill(core_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                not_serving_after = await asyncio.to_thread(_not_serving_after, victim.address)
                return await asyncio.gather(*tasks), not_serving_after - killed_at
            finally:
                llm.close()

        results, took = asyncio.run(go())
        assert took < 1.0
        assert victim.process.wait(15) not in (0, None)
        for prompt, (ids, out) in zip(prompts, results):
            assert ids == out.outputs[0].token_ids == ref.greedy(prompt, 300)


def _wait_for_tokens(address: str, num_tokens: int) -> None:
    """Returns once the worker has generated num_tokens, polled on one channel opened once (a
    fresh channel per poll costs a handshake each time); run off the event loop."""
    deadline = time.monotonic() + 60
    with channel_to(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        while time.monotonic() < deadline:
            state = stub.GetWorkerState(worker_pb2.WorkerStateRequest(), timeout=10)
            if state.num_generated_tokens >= num_tokens:
                return
            time.sleep(0.01)
    raise AssertionError(f"the worker did not generate {num_tokens} tokens in 60 s")


def _not_serving_after(address: str) -> float:
    """When the worker's readiness first answered NOT_SERVING (or stopped answering)."""
    deadline = time.monotonic() + 5
    with channel_to(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
            except grpc.RpcError:
                return time.monotonic()
            if status != health_pb2.HealthCheckResponse.SERVING:
                return time.monotonic()
            time.sleep(0.01)
    raise AssertionError("the worker kept answering SERVING")


def test_frames_carry_outputs_errors_and_tensors_unchanged():
    from tandem.common.errors import unavailable
    from tandem.common.exceptions import PreconditionError, RetryLaterError
    from tandem.engine import wire
    from tandem.engine.beam_search import BeamResult
    from tandem.engine.messages import AddRequest, EngineFailure, Lease, StepOutput
    from tandem.engine.sampling_options import SamplingOptions
    from tandem.engine.sequence import FinishReason, Phase
    from tandem.engine.sequence_perf import SequencePerf
    from tandem.worker.core_protocol import Outputs, Reply

    command = AddRequest(
        "r1",
        [1, 2, 3],
        SamplingOptions(max_tokens=5, stop_token_ids=(3, 4), bad_words=((5, 6),), seed=9),
        Phase.CONTEXT_ONLY,
        0.25,
        "salt",
        [9],
        True,
    )
    assert wire.decode(wire.encode(command, 7)) == (command, 7)
    logits = torch.randn(2, 3, dtype=torch.bfloat16)
    out = StepOutput(
        "r1",
        [5],
        [{5: -0.1, 6: -2.0}],
        -0.1,
        True,
        FinishReason.LENGTH,
        None,
        3,
        1,
        [1, 2],
        [{5: 1}],
        prompt_logprobs=[({1: -0.5}, {1: 1})],
        context_logits=logits,
        perf=SequencePerf(first_iter=3, num_draft_tokens=2),
    )
    frame = wire.encode(
        Outputs([["r1", *wire.pack(out)], ["r2", *wire.pack(EngineFailure(ValueError("bad")))]])
    )
    outputs, _ = wire.decode(frame)
    got = wire.unpack(*outputs.items[0][1:])
    assert torch.equal(got.context_logits, logits) and got.context_logits.dtype == torch.bfloat16
    got.context_logits = out.context_logits
    assert got == out
    failure = wire.unpack(*outputs.items[1][1:])
    assert type(failure.error) is ValueError and str(failure.error) == "bad"
    reply, _ = wire.decode(wire.encode(Reply(False, PreconditionError("paused"))))
    assert type(reply.value) is PreconditionError
    # Errors keep their class, message and attributes: the retry hint, the gRPC status.
    retry, _ = wire.decode(wire.encode(Reply(False, RetryLaterError("pool full", 2.5))))
    assert type(retry.value) is RetryLaterError and retry.value.retry_after_s == 2.5
    assert str(retry.value) == str(RetryLaterError("pool full", 2.5))
    status, _ = wire.decode(wire.encode(Reply(False, unavailable("core gone"))))
    assert status.value.code == grpc.StatusCode.UNAVAILABLE and status.value.message == "core gone"
    # Every field of an output crosses as it was (a StepOutput is decoded typed): the lease, the
    # drafts, each token's logits row, a beam search's beams, the scheduling time.
    full = StepOutput(
        "r3",
        [7, 8],
        [None, {8: -0.25}],
        -3,  # an int where a float is declared: still a float's value
        True,
        FinishReason.STOP,
        8,
        4,
        0,
        [3],
        [None, {8: 2}],
        beams=[BeamResult([7, 8], -1.5, FinishReason.STOP, [-0.5, -1.0])],
        generation_logits=[logits[0], logits[1]],
        first_scheduled_at=12.5,
        lease=Lease(2**61, [3], 99.0),
        draft_token_ids=[9, 10],
    )
    crossed, _ = wire.decode(wire.encode(Outputs([["r3", *wire.pack(full)]])))
    got = wire.unpack(*crossed.items[0][1:])
    assert all(torch.equal(a, b) for a, b in zip(got.generation_logits, full.generation_logits))
    got.generation_logits = full.generation_logits
    assert got == full and type(got.beams[0]) is BeamResult and got.cumulative_logprob == -3.0
    # A scalar tensor crosses too.
    scalar = wire.unpack(
        *wire.pack(StepOutput("r", [], [], 0.0, False, context_logits=logits[0, 0]))
    )
    assert torch.equal(scalar.context_logits, logits[0, 0])
    # Only registered classes are rebuilt (nothing a frame names is imported); others are named.
    assert type(wire.rebuild_error("os.system", "x", {})) is RuntimeError
    assert "os.system: x" in str(wire.rebuild_error("os.system", "x", {}))
    with pytest.raises(TypeError, match="does not cross"):
        wire.encode(StepOutput("r", [], [], 0.0, False, context_logits=object()))
