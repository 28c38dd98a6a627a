"""update_weights over NIXL (issue 32 item 2), over real processes: the test process is the
trainer, its (perturbed) weights registered with a NIXL agent of its own; every worker READs
them (no disk, no shared memory) and then serves transformers' greedy tokens on them, through the
prefill/decode split. One registration serves several syncs (the parameters change in place).
An update that does not fit the served model is refused before anything is read or written."""

from __future__ import annotations

import grpc
import pytest
from test_update_weights_ipc import TOKEN, _admin, _greedy, _reference

from tandem.client import RequestError
from tandem.rl import NixlWeightSource
from tandem.testing.cluster import LocalCluster
from tandem.v1 import llm_pb2

PROMPTS = ["weights read over nixl", "a second prompt, a little longer than the first"]


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


def _sync(cluster, weights) -> None:
    async def sync(llm):
        await llm.pause_generation()
        try:
            await llm.update_weights(weights)
            await llm.update_weights(None)
        finally:
            await llm.resume_generation()

    _admin(cluster, sync)


def _checksums(cluster) -> list:
    return [r["result"] for r in _admin(cluster, lambda a: a.collective_rpc("weights_checksum"))]


def _perturb(trainer, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainer.parameters():  # in place: the registered addresses stay
            param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.5)


def test_workers_read_the_trainers_weights_over_nixl(cluster, model_dirs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    trainer = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    before = _greedy(cluster.address, prompts)
    with NixlWeightSource(trainer.named_parameters()) as source:
        assert source.weights.memory_type == "DRAM"
        for step in range(2):  # two training steps, one registration
            _perturb(trainer, seed=step)
            expected = _reference(trainer, prompts)
            assert expected != before
            _sync(cluster, source.weights)
            assert _greedy(cluster.address, prompts) == expected
            before = expected
    sums = _checksums(cluster)
    assert len(set(sums)) == 1  # prefill and decode read the same bytes


def test_an_update_that_does_not_fit_is_refused_before_any_read(cluster):
    import torch

    checksums = _checksums(cluster)
    keep = torch.ones(7)
    with NixlWeightSource([("model.norm.weight", keep)]) as source:
        fits_not = source.weights
        cases = {
            "a name the model lacks": ("model.no_such.weight", None, "no_such"),
            "a wrong shape": ("model.norm.weight", None, "shape"),
            "bytes that are not its shape": ("model.norm.weight", 4, "bytes"),
        }
        for what, (name, num_bytes, fragment) in cases.items():
            weights = llm_pb2.NixlWeights()
            weights.CopyFrom(fits_not)
            weights.tensors[0].name = name
            if num_bytes is not None:
                weights.tensors[0].num_bytes = num_bytes
            with pytest.raises(RequestError) as error:
                _sync(cluster, weights)
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT, what
            assert fragment in error.value.details, (what, error.value.details)
        weights = llm_pb2.NixlWeights()
        weights.CopyFrom(fits_not)
        weights.memory_type = "NVME"
        with pytest.raises(RequestError) as error:
            _sync(cluster, weights)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "'DRAM'" in error.value.details
    assert _checksums(cluster) == checksums


def test_a_tensor_whose_memory_moved_is_not_sent_from_its_old_address():
    """IPC handles of a CPU tensor (or share_memory_()) replace its storage: the registration
    points at freed memory, and a worker's READ would fail or read garbage."""
    import torch

    tensor = torch.ones(16)
    source = NixlWeightSource([("model.norm.weight", tensor)])
    try:
        assert source.weights.tensors[0].address == tensor.data_ptr()
        tensor.share_memory_()
        with pytest.raises(ValueError, match="moved"):
            _ = source.weights
    finally:
        source.close()
    with pytest.raises(ValueError, match="closed"):
        _ = source.weights
