"""update_weights by IPC handles, in TensorRT-LLM's format (tensorrt_llm/llmapi/rlhf_utils.py).

The trainer sends {device UUID: base64(pickle of [(HF parameter name, reduce_tensor(t)), ...])}:
torch.multiprocessing's (rebuild function, arguments) pair per tensor, a CUDA IPC handle for a
GPU tensor, a shared-memory segment's name for a CPU tensor under torch's file_system sharing
strategy (pickled with multiprocessing's ForkingPickler, which reduces the storage to its name).
The worker takes the entry of its own device ("GPU-<uuid>" as TensorRT-LLM names it, "CPU" on a
CPU worker), rebuilds each tensor on its device without copying it through the message, and
writes it into the served weights in place.

A pickle runs whatever callables it names, so the handles are read by an unpickler that knows
only what these handles hold: torch's tensor-rebuild functions, the tensor and storage classes,
torch.Size and the dtypes (as TensorRT-LLM's restricted unpickler and torch.load(weights_only)
do). While it reads, it calls only what attaches a CPU tensor's storage and builds sizes, with
their arguments checked; anything else is refused (INVALID_ARGUMENT) before any weight changes,
and nothing it names is executed.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import re
from dataclasses import dataclass

import torch
from torch.multiprocessing import reductions

from tandem.engine.device import CPU_DEVICE_UUID, device_uuid
from tandem.engine.loader import hf_parameter_slices, is_ignored_tensor

# The most tensors one update carries.
MAX_TENSORS = 100_000
# What the handles may name: (module, name).
_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): reductions.rebuild_cuda_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    (
        "torch.multiprocessing.reductions",
        "rebuild_storage_filename",
    ): reductions.rebuild_storage_filename,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("torch", "Size"): torch.Size,
}
_TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
# A shared-memory segment torch made (file_system strategy) and its manager's socket.
_SHM_NAME = re.compile(rb"/torch_\d+_\d+(_\d+)?")
_SHM_MANAGER = re.compile(rb"/[\w./-]*/torch-shm-dir-\w+/manager\.sock")
_MAX_STORAGE_BYTES = 1 << 40


class HandleError(ValueError):
    """The handles are not what update_weights takes (INVALID_ARGUMENT; nothing changed)."""


def _refuse(what: str):
    def refuse(self):
        raise HandleError(f"the handles {what}, which update_weights does not run")

    return refuse


def _is_int(value, limit: int = _MAX_STORAGE_BYTES) -> bool:
    return type(value) is int and 0 <= value <= limit


class _HandleUnpickler(pickle._Unpickler):
    """pickle's own reader with its table of opcodes narrowed to what the handles need."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        found = _GLOBALS.get((module, name))
        if found is None and module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            found = vars(torch)[name]  # not getattr: torch's module __getattr__ imports things
        if found is None:
            raise HandleError(
                f"the handles name {module}.{name}; update_weights loads only torch's "
                f"tensor-rebuild functions, tensor and storage classes, torch.Size and dtypes"
            )
        return found

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if type(args) is not tuple:
            raise HandleError("the handles call something with arguments that are not a tuple")
        if func is torch.Size:
            if len(args) != 1 or type(args[0]) is not tuple or not all(map(_is_int, args[0])):
                raise HandleError("a torch.Size in the handles is not a tuple of sizes")
        elif func is reductions.rebuild_typed_storage:
            if len(args) != 2 or not isinstance(args[0], torch.UntypedStorage):
                raise HandleError("a typed storage in the handles does not wrap a storage")
            if not isinstance(args[1], torch.dtype):
                raise HandleError("a typed storage in the handles has no dtype")
        elif func is reductions.rebuild_storage_filename:
            _check_shared_storage(args)
            func = _attach_shared_storage
        else:
            raise HandleError(
                f"the handles call {getattr(func, '__name__', func)!r} while they are read; "
                f"only shared storages and sizes are built then"
            )
        self.stack[-1] = func(*args)

    dispatch[pickle.REDUCE[0]] = load_reduce

    # The containers' own methods only: a list, a dict, a set, never whatever is on the stack.
    def load_append(self):
        value = self.stack.pop()
        _require(self.stack[-1], list).append(value)

    def load_appends(self):
        items = self.pop_mark()
        _require(self.stack[-1], list).extend(items)

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        _require(self.stack[-1], dict)[key] = value

    def load_setitems(self):
        items = self.pop_mark()
        target = _require(self.stack[-1], dict)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_additems(self):
        items = self.pop_mark()
        _require(self.stack[-1], set).update(items)

    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.NEWOBJ[0]] = _refuse("build an object (NEWOBJ)")
    dispatch[pickle.NEWOBJ_EX[0]] = _refuse("build an object (NEWOBJ_EX)")
    dispatch[pickle.OBJ[0]] = _refuse("build an object (OBJ)")
    dispatch[pickle.INST[0]] = _refuse("build an object (INST)")
    dispatch[pickle.BUILD[0]] = _refuse("set an object's state (BUILD)")
    dispatch[pickle.EXT1[0]] = _refuse("name an extension code")
    dispatch[pickle.EXT2[0]] = _refuse("name an extension code")
    dispatch[pickle.EXT4[0]] = _refuse("name an extension code")
    dispatch[pickle.PERSID[0]] = _refuse("name a persistent id")
    dispatch[pickle.BINPERSID[0]] = _refuse("name a persistent id")


def _require(value, kind: type):
    if type(value) is not kind:
        raise HandleError(
            f"the handles add items to a {type(value).__name__}, not a {kind.__name__}"
        )
    return value


def _ints(values, limit: int = _MAX_STORAGE_BYTES) -> bool:
    return type(values) in (tuple, torch.Size) and all(_is_int(v, limit) for v in values)


def _extent_bytes(size, stride, offset: int, dtype: torch.dtype) -> int:
    """Bytes of storage a tensor of size/stride/offset (elements) reaches."""
    if any(s == 0 for s in size):
        return 0
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    return (last + 1) * torch._utils._element_size(dtype)


def _check_shared_storage(args: tuple) -> None:
    """rebuild_storage_filename(cls, manager, handle, size[, dtype]): a segment torch shared."""
    if not 4 <= len(args) <= 5 or args[0] not in (torch.UntypedStorage, torch.TypedStorage):
        raise HandleError("a shared storage in the handles is not torch's")
    _, manager, handle, size = args[:4]
    if type(manager) is not bytes or not _SHM_MANAGER.fullmatch(manager):
        raise HandleError("a shared storage in the handles names no torch shared-memory manager")
    if type(handle) is not bytes or not _SHM_NAME.fullmatch(handle):
        raise HandleError("a shared storage in the handles is not a torch shared-memory segment")
    if not _is_int(size) or (len(args) == 5 and not isinstance(args[4], torch.dtype)):
        raise HandleError("a shared storage in the handles has no size within bounds")


def _attach_shared_storage(cls, manager: bytes, handle: bytes, size: int, dtype=None):
    """rebuild_storage_filename without its decref: torch counts one reader per pickle (the
    sender's reduce adds a reference that the first reader drops, and the segment goes once that
    reader lets go), while every worker of a cluster reads the same handles. Attaching holds a
    reference of this worker's own, dropped when its tensors go; the segment lives as long as
    the trainer's tensor (torch's manager removes it when the trainer exits)."""
    num_bytes = size if dtype is None else size * torch._utils._element_size(dtype)
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, num_bytes)
    if dtype is None:
        return storage
    return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def read_handles(handles: dict[str, str], device: torch.device) -> list[tuple[str, tuple]]:
    """This device's [(name, (rebuild function, arguments))] from TensorRT-LLM's handle map."""
    key = device_uuid(device)
    if key not in handles:
        raise HandleError(
            f"device UUID {key} not found in the handles (it has {sorted(handles)[:8]}); "
            f"collective_rpc('get_worker_state') gives each worker's device_uuid"
        )
    try:
        data = base64.b64decode(handles[key], validate=True)
    except (binascii.Error, ValueError):
        raise HandleError(f"the handles of {key} are not base64") from None
    try:
        entries = _HandleUnpickler(io.BytesIO(data)).load()
    except HandleError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken pickle, or a segment that is not there
        raise HandleError(
            f"the handles of {key} do not read: {type(exc).__name__}: {exc}"
        ) from None
    if type(entries) is not list:
        raise HandleError(f"the handles must be a list, got {type(entries).__name__}")
    if len(entries) > MAX_TENSORS:
        raise HandleError(f"{len(entries)} tensors in one update (at most {MAX_TENSORS})")
    for entry in entries:
        if (
            type(entry) is not tuple
            or len(entry) != 2
            or type(entry[0]) is not str
            or type(entry[1]) is not tuple
            or len(entry[1]) != 2
            or entry[1][0] not in (reductions.rebuild_tensor, reductions.rebuild_cuda_tensor)
            or type(entry[1][1]) is not tuple
        ):
            raise HandleError(
                "each handle must be (name, reduce_tensor(tensor)): torch.multiprocessing's "
                "(rebuild_tensor or rebuild_cuda_tensor, arguments)"
            )
    return entries


def _rebuild(name: str, func, args: tuple, device: torch.device) -> torch.Tensor:
    if func is reductions.rebuild_cuda_tensor:
        if device.type != "cuda":
            raise HandleError(
                f"{name} is a CUDA tensor's handle; this worker runs on {device.type}: send the "
                f"handles of CPU tensors (file_system sharing) under the key {CPU_DEVICE_UUID!r}"
            )
        _check_cuda_handle(name, args)
        args = list(args)
        args[6] = device.index or 0  # this worker's device, as TensorRT-LLM does
        return func(*args)
    if (
        len(args) != 3
        or args[0] not in _TENSOR_CLASSES
        or not isinstance(args[1], torch.TypedStorage)
        or type(args[2]) is not tuple
        or len(args[2]) != 4
    ):
        raise HandleError(f"{name}: not a CPU tensor's handle as reduce_tensor makes it")
    storage, (offset, size, stride, requires_grad) = args[1], args[2]
    if (
        not _is_int(offset)
        or not _ints(size)
        or not _ints(stride)
        or len(size) != len(stride)
        or type(requires_grad) is not bool
        or _extent_bytes(size, stride, offset, storage.dtype) > storage._untyped_storage.nbytes()
    ):
        raise HandleError(f"{name}: its size, stride and offset do not fit its storage")
    return func(*args)


# torch's CUDA IPC reference-counter file: offsets into it (C++ CUDA_IPC_REF_COUNTER_FILE_SIZE).
_REF_COUNTER_FILE_SIZE = 10000


def _check_cuda_handle(name: str, args: tuple) -> None:
    """rebuild_cuda_tensor's 15 arguments, each of the type and within the bounds reduce_tensor
    gives them: torch's C++ uses them unchecked (a reference-counter offset is written through)."""
    if len(args) != 15:
        raise HandleError(f"{name}: not a CUDA tensor's handle as reduce_tensor makes it")
    (
        tensor_cls,
        size,
        stride,
        offset,
        storage_cls,
        dtype,
        _device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    ok = (
        tensor_cls in _TENSOR_CLASSES
        and storage_cls in (torch.TypedStorage, torch.UntypedStorage)
        and isinstance(dtype, torch.dtype)
        and dtype.is_floating_point
        and _ints(size)
        and _ints(stride)
        and len(size) == len(stride)
        and _is_int(offset)
        and type(storage_handle) is bytes
        and 0 < len(storage_handle) <= 256
        and _is_int(storage_size_bytes)
        and _is_int(storage_offset_bytes)
        and type(requires_grad) is bool
        and type(ref_counter_handle) is bytes
        and _SHM_NAME.fullmatch(ref_counter_handle) is not None
        and _is_int(ref_counter_offset, _REF_COUNTER_FILE_SIZE - 1)
        and (event_handle is None or (type(event_handle) is bytes and len(event_handle) <= 256))
        and type(event_sync_required) is bool
    )
    if not ok or _extent_bytes(size, stride, offset, dtype) > storage_size_bytes:
        raise HandleError(f"{name}: not a CUDA tensor's handle as reduce_tensor makes it")


@dataclass
class WeightUpdate:
    """What one update_weights call writes: (parameter, first row, end row, tensor) each."""

    updates: list[tuple[str, int, int, torch.Tensor]]
    num_bytes: int


class UpdateTargets:
    """Where the HF-named tensors of one update go in the served model, each checked (name, shape,
    floating dtype) before any is written; HandleError names what does not fit."""

    def __init__(self, model):
        self.slices = hf_parameter_slices(model)
        self.params = dict(model.named_parameters())
        self.tied = model.lm_head is None
        self.seen: set[str] = set()
        self.unknown: list[str] = []

    def locate(self, name: str) -> tuple[str, int, int] | None:
        """(engine parameter, first row, end row) of name; None for a tensor the engine does not
        hold (collected: require_known refuses them)."""
        if name in self.seen:
            raise HandleError(f"{name} comes twice in one update")
        self.seen.add(name)
        if name not in self.slices:
            # Some checkpoints carry what the engine recomputes, or a tied head beside its embedding.
            if not (is_ignored_tensor(name) or (self.tied and name == "lm_head.weight")):
                self.unknown.append(name)
            return None
        param, start, end = self.slices[name]
        if self.params[param].dtype == torch.float8_e4m3fn or param.endswith(".weight_scale"):
            raise HandleError(
                f"{name}: the served projections are FP8 (their scales are the checkpoint's or "
                f"were computed at load); IPC handles would overwrite them unscaled: "
                f"update_weights from a checkpoint directory instead"
            )
        return param, start, end

    def check(self, name: str, target: tuple[str, int, int], shape, dtype: torch.dtype) -> None:
        param, start, end = target
        expected = (end - start, *self.params[param].shape[1:])
        if tuple(shape) != expected:
            raise HandleError(f"{name} has shape {tuple(shape)}; the served model's is {expected}")
        if not dtype.is_floating_point:
            raise HandleError(f"{name} is {dtype}; weights are floating point")

    def require_known(self) -> None:
        if self.unknown:
            raise HandleError(
                f"{len(self.unknown)} names are not parameters of the served model: "
                f"{self.unknown[:8]}"
                + (" ..." if len(self.unknown) > 8 else "")
                + " (HF checkpoint names, e.g. model.layers.0.self_attn.q_proj.weight)"
            )


def weight_update(handles: dict[str, str], model, device: torch.device) -> WeightUpdate:
    """The handles of this device rebuilt and checked against the served model (names, shapes,
    floating dtypes), or HandleError before anything is written."""
    targets = UpdateTargets(model)
    updates = []
    num_bytes = 0
    for name, (func, args) in read_handles(handles, device):
        target = targets.locate(name)
        if target is None:
            continue
        tensor = _rebuild(name, func, args, device)
        targets.check(name, target, tensor.shape, tensor.dtype)
        updates.append((*target, tensor))
        num_bytes += tensor.numel() * tensor.element_size()
    targets.require_known()
    return WeightUpdate(updates, num_bytes)
