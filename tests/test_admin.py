"""Admin and RL calls through the router: auth, release/resume memory by tag,
update_weights from a checkpoint, collective_rpc. Nothing half-applied."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import assert_all_blocks_free
from test_disagg import worker_state

from tandem.client import LLM, AsyncLLM, RequestError, SamplingParams
from tandem.testing.cluster import LocalCluster

TOKEN = "s3cret-admin-token"
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "64",
            "--block-size",
            "8",
        ],
        env={"TANDEM_ADMIN_TOKEN": TOKEN},
    ) as c:
        yield c


def run(coro):
    return asyncio.run(coro)


async def _admin(address: str, token: str | None, call):
    llm = AsyncLLM(address, auth_token=token)
    try:
        return await call(llm)
    finally:
        llm.close()


def test_admin_calls_need_the_token(cluster):
    for token, code in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("wrong", grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(RequestError) as err:
            run(_admin(cluster.address, token, lambda llm: llm.pause_generation()))
        assert err.value.code == code
    # Workers check it too: nobody can skip the router.
    with pytest.raises(RequestError) as err:
        run(_admin(cluster.workers[0].address, None, lambda llm: llm.release(["kv_cache"])))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with LLM(cluster.address) as llm:  # generation needs no token
        assert llm.generate("open to all", PARAMS, use_tqdm=False).outputs[0].token_ids
        assert_all_blocks_free(llm)


def test_release_and_resume_really_free_and_restore_memory(cluster):
    addresses = [w.address for w in cluster.workers]
    with LLM(cluster.address, auth_token=TOKEN) as llm:
        before = llm.generate("same after resume", PARAMS, use_tqdm=False).outputs[0].token_ids
        full = [worker_state(a) for a in addresses]
        assert all(s.weight_bytes > 0 and s.kv_cache_bytes > 0 for s in full)
        with pytest.raises(RequestError) as err:
            run(_admin(cluster.address, TOKEN, lambda a: a.release(["gpu"])))
        assert (
            err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "kv_cache" in err.value.details
        )
        run(_admin(cluster.address, TOKEN, lambda a: a.release(["model", "kv_cache"])))
        assert all(
            s.weight_bytes == 0 and s.kv_cache_bytes == 0
            for s in (worker_state(a) for a in addresses)
        )
        with pytest.raises(RequestError) as err:
            llm.generate("refused while released", PARAMS, use_tqdm=False)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "Resume" in err.value.details
        run(_admin(cluster.address, TOKEN, lambda a: a.resume(["model", "kv_cache"])))
        restored = [worker_state(a) for a in addresses]
        assert [(s.weight_bytes, s.kv_cache_bytes) for s in restored] == [
            (s.weight_bytes, s.kv_cache_bytes) for s in full
        ]
        # The split still works: the decode worker fetches the prefill's new transceiver state.
        assert (
            llm.generate("same after resume", PARAMS, use_tqdm=False).outputs[0].token_ids == before
        )
        assert_all_blocks_free(llm)


def test_tensorrt_llms_memory_tags_are_taken(cluster):
    """TensorRT-LLM's tags (ExecutorMemoryType): model_weights is the weights, memory tandem does
    not hold apart (sampler, drafter, ...) is a no-op, an unknown tag is refused naming them."""
    addresses = [w.address for w in cluster.workers]
    run(_admin(cluster.address, TOKEN, lambda a: a.release(["sampler", "guided_decoder"])))
    assert all(worker_state(a).weight_bytes > 0 for a in addresses)
    run(_admin(cluster.address, TOKEN, lambda a: a.release(["model_weights", "sampler"])))
    assert all(
        s.weight_bytes == 0 and s.kv_cache_bytes > 0 for s in (worker_state(a) for a in addresses)
    )
    run(_admin(cluster.address, TOKEN, lambda a: a.resume(["model_weights", "sampler"])))
    assert all(worker_state(a).weight_bytes > 0 for a in addresses)
    with pytest.raises(RequestError) as err:
        run(_admin(cluster.address, TOKEN, lambda a: a.release(["gpu_memory"])))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "model_weights" in err.value.details and "gpu_memory" in err.value.details
    with LLM(cluster.address) as llm:
        assert llm.generate("after the tags", PARAMS, use_tqdm=False).outputs[0].token_ids


def test_release_is_refused_while_requests_run(cluster):
    async def go():
        llm = AsyncLLM(cluster.address, auth_token=TOKEN)
        try:
            running = llm.generate_async(
                "keep going", SamplingParams(max_tokens=200, ignore_eos=True), streaming=True
            )
            stream = running.__aiter__()
            await (
                stream.__anext__()
            )  # running on the decode worker now (leaving the loop would abort it)
            with pytest.raises(RequestError) as err:
                await llm.release(["kv_cache"])
            assert (
                err.value.code == grpc.StatusCode.FAILED_PRECONDITION
                and "pause_generation" in err.value.details
            )
            running.abort()
            async for _ in stream:
                pass
            assert running.outputs[0].finish_reason == "cancelled"
        finally:
            llm.close()

    run(go())
    assert all(
        worker_state(w.address).kv_cache_bytes > 0 for w in cluster.workers
    )  # nothing half-applied


def test_update_weights_from_a_checkpoint(cluster, model_dirs, tmp_path):
    from tandem.engine.checkpoints import write_tiny_checkpoint

    other = write_tiny_checkpoint(tmp_path / "other-llama", "llama", seed=5)
    with LLM(cluster.address, auth_token=TOKEN) as llm:
        old = llm.generate("new weights", PARAMS, use_tqdm=False).outputs[0].token_ids
        old_sums = run(
            _admin(cluster.address, TOKEN, lambda a: a.collective_rpc("weights_checksum"))
        )
        run(
            _admin(cluster.address, TOKEN, lambda a: a.pause_generation())
        )  # weights change only while idle
        with pytest.raises(RequestError) as err:
            run(
                _admin(cluster.address, TOKEN, lambda a: a.update_weights(str(model_dirs["qwen3"])))
            )
        assert (
            err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            and "does not fit" in err.value.details
        )
        with pytest.raises(RequestError) as err:
            run(
                _admin(
                    cluster.address, TOKEN, lambda a: a.update_weights(str(tmp_path / "missing"))
                )
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            run(_admin(cluster.address, TOKEN, lambda a: a.collective_rpc("weights_checksum")))
            == old_sums
        )
        run(_admin(cluster.address, TOKEN, lambda a: a.update_weights(str(other))))
        run(_admin(cluster.address, TOKEN, lambda a: a.resume_generation()))
        new_sums = run(
            _admin(cluster.address, TOKEN, lambda a: a.collective_rpc("weights_checksum"))
        )
        assert all(n["result"] != o["result"] for n, o in zip(new_sums, old_sums))
        assert new_sums[0]["result"] == new_sums[1]["result"]  # prefill and decode agree
        new = llm.generate("new weights", PARAMS, use_tqdm=False).outputs[0].token_ids
        assert new != old
        with (
            LocalCluster(
                roles=["both"], engine_args=["--model", str(other), "--num-blocks", "32"]
            ) as ref,
            LLM(ref.address) as r,
        ):
            assert r.generate("new weights", PARAMS, use_tqdm=False).outputs[0].token_ids == new
        run(_admin(cluster.address, TOKEN, lambda a: a.pause_generation()))
        run(_admin(cluster.address, TOKEN, lambda a: a.update_weights(str(model_dirs["llama"]))))
        run(_admin(cluster.address, TOKEN, lambda a: a.resume_generation()))
        assert llm.generate("new weights", PARAMS, use_tqdm=False).outputs[0].token_ids == old


def test_handoffs_are_signed_and_bound_to_their_prompt(cluster):
    """With an admin token, a client cannot reuse one prompt's KV for another (it would poison the
    decode worker's prefix cache) nor edit a handoff."""
    from tandem.client import DisaggregatedParams
    from tandem.v1 import worker_pb2

    with LLM(cluster.address) as llm:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        ctx = llm.generate(
            "the real prompt",
            params,
            use_tqdm=False,
            disaggregated_params=DisaggregatedParams(request_type="context_only"),
        )
        h = ctx.outputs[0].disaggregated_params
        forged = worker_pb2.KvHandoff.FromString(h.opaque_state)
        forged.num_prompt_tokens += 1
        for prompt, opaque, fragment in (
            (ctx.prompt_token_ids[:-1] + [7], h.opaque_state, "another prompt"),
            (ctx.prompt_token_ids, forged.SerializeToString(), "signature"),
        ):
            with pytest.raises(RequestError) as err:
                llm.generate(
                    prompt,
                    params,
                    use_tqdm=False,
                    disaggregated_params=DisaggregatedParams(
                        request_type="generation_only",
                        first_gen_tokens=h.first_gen_tokens,
                        ctx_request_id=h.ctx_request_id,
                        opaque_state=opaque,
                    ),
                )
            assert (
                err.value.code == grpc.StatusCode.FAILED_PRECONDITION
                and fragment in err.value.details
            )
        with pytest.raises(RequestError) as err:  # out-of-vocabulary first tokens are bad input
            llm.generate(
                ctx.prompt_token_ids,
                params,
                use_tqdm=False,
                disaggregated_params=DisaggregatedParams(
                    request_type="generation_only",
                    first_gen_tokens=[10**9],
                    opaque_state=h.opaque_state,
                ),
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        gen = llm.generate(
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
        assert len(gen.outputs[0].token_ids) == 4  # the first token included, as TensorRT-LLM
        assert_all_blocks_free(llm)


def test_collective_rpc_allowlist_and_ranks(cluster):
    states = run(_admin(cluster.address, TOKEN, lambda a: a.collective_rpc("get_worker_state")))
    assert [s["result"]["role"] for s in states] == ["prefill", "decode"]
    only = run(
        _admin(
            cluster.address,
            TOKEN,
            lambda a: a.collective_rpc("kv_cache_capacity", target_ranks=[1]),
        )
    )
    assert len(only) == 1 and only[0]["worker_id"] == cluster.workers[1].address
    one = run(
        _admin(
            cluster.address,
            TOKEN,
            lambda a: a.collective_rpc("get_worker_state", unique_reply_rank=0),
        )
    )
    assert len(one) == 1 and one[0]["result"]["role"] == "prefill"
    for method, ranks, fragment in (
        ("os.system", None, "not allowed"),
        ("get_worker_state", [7], "out of range"),
    ):
        with pytest.raises(RequestError) as err:
            run(
                _admin(
                    cluster.address, TOKEN, lambda a: a.collective_rpc(method, target_ranks=ranks)
                )
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details
