"""update_weights by IPC handles in TensorRT-LLM's format (issue 32), over real processes: the test
process is the trainer (transformers' model of the served checkpoint, its weights perturbed),
the cluster's workers read the handles of its shared-memory tensors (CPU: torch's file_system
strategy) and write them into their weights; greedy outputs then equal transformers' on the
perturbed weights, through the split and on the aggregated worker. A pickle that names anything
but tensor handles is refused before anything changes, and runs nothing."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle

import grpc
import pytest

from tandem.client import LLM, AsyncLLM, RequestError, SamplingParams
from tandem.rl import ipc_handles
from tandem.testing.cluster import LocalCluster

TOKEN = "weights-admin-token"
MAX_TOKENS = 10
PROMPTS = ["the weights changed", "a prefix cached before the update, then asked again"]


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode", "both"],
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


def _admin(cluster, call):
    async def run():
        llm = AsyncLLM(cluster.address, auth_token=TOKEN)
        try:
            return await call(llm)
        finally:
            llm.close()

    return asyncio.run(run())


def _greedy(address: str, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(address, **kwargs) as llm:
        return [llm.generate(p, params, use_tqdm=False).outputs[0].token_ids for p in prompts]


def _reference(model, prompts: list[list[int]]) -> list[list[int]]:
    import torch

    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def _checksums(cluster) -> list:
    return [r["result"] for r in _admin(cluster, lambda a: a.collective_rpc("weights_checksum"))]


def test_each_worker_reports_its_device_uuid(cluster):
    states = _admin(cluster, lambda a: a.collective_rpc("get_worker_state"))
    assert [s["result"]["device_uuid"] for s in states] == ["CPU"] * 3


def test_update_by_ipc_handles_serves_the_trainers_weights(cluster, model_dirs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    trainer = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    before = _greedy(cluster.address, prompts)
    assert before == _reference(trainer.eval(), prompts)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in trainer.parameters():  # a training step's worth of change
            param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.5)
    expected = _reference(trainer, prompts)
    assert expected != before
    named = [(n, p.data) for n, p in trainer.named_parameters()]
    checksums = _checksums(cluster)

    _admin(cluster, lambda a: a.pause_generation())
    # Two buckets, as a trainer syncs a large model, then the finalize.
    half = len(named) // 2
    for bucket in (named[:half], named[half:]):
        handles = ipc_handles(bucket)
        assert list(handles) == ["CPU"]
        _admin(cluster, lambda a, h=handles: a.update_weights(h))
    _admin(cluster, lambda a: a.update_weights(None))
    _admin(cluster, lambda a: a.resume_generation())

    after = _checksums(cluster)
    assert all(a != b for a, b in zip(after, checksums)) and len(set(after)) == 1
    # Through the split (the prefix the first prompts left in the caches is not reused) ...
    assert _greedy(cluster.address, prompts) == expected
    # ... and on the aggregated worker.
    both = cluster.workers[2].address
    assert _greedy(both, prompts, **cluster.worker_client_kwargs()) == expected
    states = _admin(cluster, lambda a: a.collective_rpc("get_worker_state"))
    assert {s["result"]["weights_source"] for s in states} == {"ipc"}


def _refused(cluster, handles) -> RequestError:
    _admin(cluster, lambda a: a.pause_generation())
    try:
        with pytest.raises(RequestError) as error:
            _admin(cluster, lambda a: a.update_weights(handles))
    finally:
        _admin(cluster, lambda a: a.resume_generation())
    return error.value


class _Exploit:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_that_names_anything_else_is_refused_and_runs_nothing(cluster, tmp_path):
    import torch

    checksums = _checksums(cluster)
    marker = tmp_path / "pwned"
    payloads = {
        "os.system": pickle.dumps([("model.norm.weight", _Exploit(str(marker)))]),
        "a callable as the rebuild": pickle.dumps(
            [("model.norm.weight", (os.system, (f"touch {marker}",)))]
        ),
        "a tensor built while read": pickle.dumps([("model.norm.weight", torch.zeros(4))]),
    }
    for what, payload in payloads.items():
        error = _refused(cluster, {"CPU": base64.b64encode(payload).decode()})
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT, what
        assert "update_weights" in error.details or "handle" in error.details, what
    assert not marker.exists()
    assert _checksums(cluster) == checksums


def test_handles_that_do_not_fit_change_nothing(cluster):
    import torch

    checksums = _checksums(cluster)
    keep = torch.ones(7)
    cases = {
        "no entry for this device": (ipc_handles([("model.norm.weight", keep)], "GPU-0000"), "CPU"),
        "a name the model lacks": (ipc_handles([("model.no_such.weight", keep)]), "no_such"),
        "a wrong shape": (
            ipc_handles([("model.layers.0.input_layernorm.weight", keep)]),
            "shape",
        ),
        "not base64": ({"CPU": "%%%"}, "base64"),
    }
    for what, (handles, fragment) in cases.items():
        error = _refused(cluster, handles)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT, what
        assert fragment in error.details, (what, error.details)
    assert _checksums(cluster) == checksums


def test_kv_of_other_weights_is_not_used(cluster, model_dirs):
    """An update that reached the decode only (a bucket sent to one worker): the prefill's
    handoffs carry weights the decode no longer serves, and the decode computes the prompt with
    its own instead of continuing KV of the old ones (counted as weights_mismatch)."""
    import torch
    from test_disagg import worker_state

    prefill, decode = cluster.workers[0].address, cluster.workers[1].address
    norm = torch.ones(_hidden_size(model_dirs))

    async def update_decode_only(handles):
        llm = AsyncLLM(decode, auth_token=TOKEN, **cluster.worker_client_kwargs())
        try:
            await llm.update_weights(handles)
            await llm.update_weights(None)
        finally:
            llm.close()

    before = worker_state(decode).kv_handoff_outcomes.get("recomputed:weights_mismatch", 0)
    _admin(cluster, lambda a: a.pause_generation())
    asyncio.run(update_decode_only(ipc_handles([("model.norm.weight", norm)])))
    _admin(cluster, lambda a: a.resume_generation())
    with LLM(cluster.address) as llm:
        out = llm.generate(
            "weights that differ", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
        )
    assert out.metrics.kv_handoff.reason == "weights_mismatch"
    assert (out.metrics.kv_handoff.prefill, out.metrics.kv_handoff.decode) == (prefill, decode)
    after = worker_state(decode).kv_handoff_outcomes["recomputed:weights_mismatch"]
    assert after == before + 1


def _hidden_size(model_dirs) -> int:
    import json

    return json.loads((model_dirs["llama"] / "config.json").read_text())["hidden_size"]


def test_a_checkpoint_rewritten_in_place_is_other_weights(cluster, model_dirs, tmp_path):
    """A trainer that saves each step into the same directory: a decode that loaded the rewrite
    and a prefill that did not serve the same path, yet other weights; the decode does not
    continue the prefill's KV (weights_id names what the files were, not only where)."""
    import shutil

    from test_disagg import worker_state

    from tandem.engine.checkpoints import write_tiny_checkpoint

    prefill, decode = cluster.workers[0].address, cluster.workers[1].address
    steps = tmp_path / "trainer-step"
    shutil.copytree(model_dirs["llama"], steps)

    async def update(address: str, **kwargs):
        llm = AsyncLLM(address, auth_token=TOKEN, **kwargs)
        try:
            await llm.pause_generation()
            await llm.update_weights(str(steps))
            await llm.resume_generation()
        finally:
            llm.close()

    try:
        asyncio.run(update(cluster.address))  # every worker on step 0
        shutil.rmtree(steps)
        write_tiny_checkpoint(steps, "llama", seed=5)  # step 1, same path
        asyncio.run(update(decode, **cluster.worker_client_kwargs()))
        before = worker_state(decode).kv_handoff_outcomes.get("recomputed:weights_mismatch", 0)
        with LLM(cluster.address) as llm:
            out = llm.generate(
                "saved in place", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
            )
        assert out.metrics.kv_handoff.reason == "weights_mismatch"
        assert (out.metrics.kv_handoff.prefill, out.metrics.kv_handoff.decode) == (prefill, decode)
        after = worker_state(decode).kv_handoff_outcomes["recomputed:weights_mismatch"]
        assert after == before + 1
    finally:  # the module's other tests expect the served checkpoint
        _admin(cluster, lambda a: a.pause_generation())
        _admin(cluster, lambda a: a.update_weights(str(model_dirs["llama"])))
        _admin(cluster, lambda a: a.resume_generation())
