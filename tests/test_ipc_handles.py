"""The reader of update_weights' IPC handles (worker/ipc_weights.py), in one process: what it
accepts (torch's reduce_tensor of shared CPU tensors, pickled by ForkingPickler) and what it
refuses before anything is rebuilt or written (test_update_weights_ipc.py runs it across
processes)."""

from __future__ import annotations

import base64
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.loader import hf_parameter_slices, load_model
from tandem.worker.ipc_weights import HandleError, read_handles, weight_update

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_model_dir(), dtype=torch.float32)[0]


def _handles(items) -> dict[str, str]:
    mp.set_sharing_strategy("file_system")
    return {"CPU": base64.b64encode(bytes(ForkingPickler.dumps(items))).decode()}


def _raw(data: bytes) -> dict[str, str]:
    return {"CPU": base64.b64encode(data).decode()}


def test_fused_parameters_take_each_part_in_its_rows(model):
    slices = hf_parameter_slices(model)
    config = model.config
    q = slices["model.layers.0.self_attn.q_proj.weight"]
    k = slices["model.layers.0.self_attn.k_proj.weight"]
    v = slices["model.layers.0.self_attn.v_proj.weight"]
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    assert q == ("layers.0.self_attn.qkv_proj.weight", 0, q_rows)
    assert k == ("layers.0.self_attn.qkv_proj.weight", q_rows, q_rows + kv_rows)
    assert v[1:] == (q_rows + kv_rows, q_rows + 2 * kv_rows)
    up = slices["model.layers.1.mlp.up_proj.weight"]
    assert up == (
        "layers.1.mlp.gate_up_proj.weight",
        config.intermediate_size,
        2 * config.intermediate_size,
    )


def test_shared_tensors_rebuild_without_a_copy_and_land_in_their_rows(model):
    rows = model.config.num_kv_heads * model.config.head_dim
    k = torch.randn(rows, model.config.hidden_size)
    update = weight_update(
        _handles([("model.layers.0.self_attn.k_proj.weight", reduce_tensor(k))]), model, CPU
    )
    ((param, start, end, tensor),) = update.updates
    assert param == "layers.0.self_attn.qkv_proj.weight" and end - start == rows
    assert torch.equal(tensor, k)
    k.add_(1)  # the same memory: the worker reads the trainer's tensor, not a copy of it
    assert torch.equal(tensor, k)


def test_a_handle_whose_view_passes_its_storage_is_refused(model):
    small = torch.randn(4)
    func, (cls, storage, (offset, _, _, grad)) = reduce_tensor(small)
    forged = (func, (cls, storage, (offset, torch.Size([64, 64]), (64, 1), grad)))
    with pytest.raises(HandleError, match="do not fit its storage"):
        weight_update(_handles([("model.norm.weight", forged)]), model, CPU)


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (b"cposix\nsystem\n(S'true'\ntR.", "posix.system"),
        (b"cbuiltins\neval\n(S'1'\ntR.", "builtins.eval"),
        (b"ctorch\nhas_cuda\n.", "torch.has_cuda"),
        (b"ctorch\nTensor\n(K\x01e.", "add items to a"),  # APPENDS onto a class
        (b"ctorch\nSize\n(K\x01K\x02tR.", "torch.Size"),  # a Size of two arguments
        (b"ctorch\nTensor\n(K\x05tR.", "while they are read"),  # a tensor built by the pickle
        (pickle.dumps({"not": "a list"}), "must be a list"),
        (pickle.dumps([("name", (print, ()))]), "builtins.print"),
    ],
)
def test_anything_but_tensor_handles_is_refused(payload, fragment):
    with pytest.raises(HandleError, match=fragment.replace(".", r"\.")):
        read_handles(_raw(payload), CPU)


def test_handles_for_another_device_or_not_base64_are_refused():
    with pytest.raises(HandleError, match="device UUID CPU not found"):
        read_handles({"GPU-0": "AA=="}, CPU)
    with pytest.raises(HandleError, match="not base64"):
        read_handles({"CPU": "%%%"}, CPU)


# rebuild_cuda_tensor's arguments as torch 2.11's reduce_tensor gave them for a [4, 8] bf16 CUDA
# tensor on an H100 (the storage class is TypedStorage there).
CUDA_ARGS = (
    torch.Tensor,
    torch.Size([4, 8]),
    (8, 1),
    0,
    torch.storage.TypedStorage,
    torch.bfloat16,
    0,
    b"\x02" * 66,
    64,
    0,
    False,
    b"/torch_3861_841150158_0",
    0,
    b"\x15" * 64,
    True,
)


def test_a_cuda_handle_as_torch_makes_it_passes_its_checks():
    from tandem.worker.ipc_weights import _check_cuda_handle

    _check_cuda_handle("w", CUDA_ARGS)


@pytest.mark.parametrize(
    "index, value",
    [
        (12, 10_000),  # a reference-counter offset past torch's counter file
        (11, b"/etc/passwd"),  # a reference-counter file that is not torch's
        (8, 32),  # a view past its storage
        (5, torch.int64),  # not weights
        (4, torch.Tensor),  # not a storage class
        (7, 7),  # a handle that is not bytes
    ],
)
def test_a_cuda_handle_with_an_argument_out_of_bounds_is_refused(index, value):
    from tandem.worker.ipc_weights import _check_cuda_handle

    args = list(CUDA_ARGS)
    args[index] = value
    with pytest.raises(HandleError, match="not a CUDA tensor's handle"):
        _check_cuda_handle("w", tuple(args))
