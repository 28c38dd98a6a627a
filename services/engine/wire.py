"""The engine's messages on the wire between a worker's IO process and its engine core process
(worker/core_process.py): MessagePack by msgspec, never pickle. A frame is [kind, payload]:
kind names a dataclass of engine/messages.py (or of the process protocol, PROTOCOL), the
payload is its fields. Tensors (logits), exceptions (an EngineFailure's, a failed call's), a
LoRA adapter (by name, id and path: the core reads it itself) and a compiled guide (xgrammar's
JSON) travel as MessagePack extensions.

Both ends are processes of one worker, connected over IPC sockets in a directory only their
user can open; an exception crosses as its class's name, message and plain attributes, and is
rebuilt only as a class registered here (register_error), never by importing what a frame
names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from tandem.common.exceptions import (
    IncompatibleHandoffError,
    PreconditionError,
    ResourceExhaustedError,
    RetryLaterError,
)
from tandem.engine import messages
from tandem.engine.admission import PromptNeverFitsError, PromptTooLongError
from tandem.engine.beam_search import BeamResult
from tandem.engine.block_manager import NoFreeBlocksError
from tandem.engine.lora_adapter import AdapterNotFoundError, LoRAAdapter

_TENSOR, _ERROR, _ADAPTER, _GUIDE = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter on the wire: what the core loads it by (lora_adapter.AdapterStore.load)."""

    name: str
    int_id: int
    path: str


@dataclasses.dataclass(frozen=True)
class GuideJson:
    """A compiled guide on the wire (xgrammar's CompiledGrammar.serialize_json)."""

    json: str


# Exceptions that cross as their own class, by "module.qualname": how each is made again from
# (message, attributes). Anything else arrives as a RuntimeError that names it.
_ERRORS: dict[str, Callable[[str, dict], BaseException]] = {}


def register_error(cls: type[BaseException], make: Callable | None = None) -> None:
    """An exception class rebuilt as itself; make(message, attributes) where its constructor
    takes more than a message (default: the message, then its plain attributes set back)."""

    def rebuild(message: str, attrs: dict) -> BaseException:
        error = cls.__new__(cls)
        BaseException.__init__(error, message)
        for name, value in attrs.items():
            setattr(error, name, value)
        return error

    _ERRORS[f"{cls.__module__}.{cls.__qualname__}"] = make or rebuild


def _error_attrs(error: BaseException) -> dict:
    """What an exception carries beside its message: plain attributes (retry_after_s), and a
    gRPC status code by its name."""
    attrs = {
        k: v
        for k, v in vars(error).items()
        if isinstance(v, (bool, int, float, str)) and not k.startswith("_")
    }
    code = getattr(error, "code", None)
    if code is not None and hasattr(code, "name"):
        attrs["code"] = code.name
    return attrs


def rebuild_error(name: str, message: str, attrs: dict) -> BaseException:
    """The exception a peer raised: its own class when registered, else a RuntimeError naming it."""
    make = _ERRORS.get(name)
    if make is None:
        return RuntimeError(f"{name}: {message}")
    try:
        return make(message, attrs)
    except Exception:  # noqa: BLE001 - a frame must decode whatever the attributes say
        return RuntimeError(f"{name}: {message}")


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().contiguous().cpu()
        header = msgspec.msgpack.encode([str(tensor.dtype).removeprefix("torch."), tensor.shape])
        flat = tensor.reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return msgspec.msgpack.Ext(_TENSOR, len(header).to_bytes(4, "little") + header + data)
    if isinstance(obj, BaseException):
        cls = type(obj)
        frame = [f"{cls.__module__}.{cls.__qualname__}", str(obj), _error_attrs(obj)]
        return msgspec.msgpack.Ext(_ERROR, msgspec.msgpack.encode(frame))
    if hasattr(obj, "serialize_json"):  # xgrammar.CompiledGrammar
        return msgspec.msgpack.Ext(_GUIDE, obj.serialize_json().encode())
    raise TypeError(f"{type(obj).__name__} does not cross to the engine core")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _TENSOR:
        size = int.from_bytes(data[:4], "little")
        dtype, shape = msgspec.msgpack.decode(data[4 : 4 + size])
        raw = bytearray(data[4 + size :])
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(getattr(torch, dtype)).reshape(shape)
    if code == _ERROR:
        return rebuild_error(*msgspec.msgpack.decode(data))
    if code == _ADAPTER:
        return AdapterRef(*msgspec.msgpack.decode(data))
    if code == _GUIDE:
        return GuideJson(bytes(data).decode())
    raise ValueError(f"unknown MessagePack extension {code}")


for _cls in (
    ValueError,
    TypeError,
    RuntimeError,
    NotImplementedError,
    KeyError,
    LookupError,
    IndexError,
    TimeoutError,
    MemoryError,
    ResourceExhaustedError,
    RetryLaterError,
    PreconditionError,
    IncompatibleHandoffError,
    PromptTooLongError,
    PromptNeverFitsError,
    NoFreeBlocksError,
    AdapterNotFoundError,
):
    register_error(_cls)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
_TYPES: dict[str, type] = {}


def register(*types: type) -> None:
    """Dataclasses that cross the wire, by their names."""
    for cls in types:
        _TYPES[cls.__name__] = cls


register(
    messages.AddRequest,
    messages.AbortRequest,
    messages.RemoteKvArrived,
    messages.KvConfirmed,
    messages.FreeBlocks,
    messages.LeasePrefix,
    messages.CheckIdle,
    messages.HoldSteps,
    messages.ReleaseMemory,
    messages.ResumeMemory,
    messages.ReadCounters,
    messages.CopyWeights,
    messages.WeightsChecksum,
    messages.StepOutput,
    messages.EngineFailure,
    messages.EngineSnapshot,
    messages.EngineFacts,
    messages.WeightsInfo,
    messages.ImportPlan,
)


def pack(obj: Any) -> list:
    """[kind, payload]: a registered dataclass by its name and fields, anything else as it is
    (kind "")."""
    if type(obj) is messages.StepOutput:  # most of what crosses: checked by its exact type only
        return ["StepOutput", obj]
    if obj is None or not dataclasses.is_dataclass(obj):
        return ["", obj]
    kind = type(obj).__name__
    if _TYPES.get(kind) is not type(obj):
        raise TypeError(f"{kind} is not a message the engine core takes")
    if isinstance(obj, messages.EngineFailure):
        return [kind, {"error": obj.error}]
    if isinstance(obj, messages.AddRequest) and isinstance(obj.adapter, LoRAAdapter):
        # By reference: the core reads the adapter itself (a dataclass would cross whole).
        ref = msgspec.msgpack.encode([obj.adapter.name, obj.adapter.int_id, obj.adapter.path])
        obj = dataclasses.replace(obj, adapter=msgspec.msgpack.Ext(_ADAPTER, ref))
    return [kind, obj]


def unpack(kind: str, payload: Any) -> Any:
    """The object of a frame's [kind, payload] (payload as decode() leaves it: a step's outputs
    still raw)."""
    if isinstance(payload, msgspec.Raw):
        if kind == "StepOutput":
            return _with_beams(_step_output_decoder.decode(payload))
        payload = _decoder.decode(payload)
    if not kind:
        return payload
    cls = _TYPES[kind]
    if cls is messages.EngineFailure:
        return messages.EngineFailure(payload["error"])
    value = msgspec.convert(payload, cls, strict=False)
    return _with_beams(value) if cls is messages.StepOutput else value


def _with_beams(out: messages.StepOutput) -> messages.StepOutput:
    """A beam search's beams (typed only as a list on StepOutput) as BeamResults."""
    if out.beams:
        out.beams = [msgspec.convert(b, BeamResult, strict=False) for b in out.beams]
    return out


def encode(obj: Any, tag: int = 0) -> bytes:
    """One frame: obj packed, and a tag (a call's id; 0 for none)."""
    return _encoder.encode([*pack(obj), tag])


# A frame is read in two passes: its kind, then its payload by what the kind is. A step's outputs
# (an Outputs frame: [request id, kind, payload] each, 256 of them a step at 256 sequences) keep
# their payloads raw, and unpack() reads each StepOutput with a decoder typed for it, which builds
# the dataclass as it reads: about half the time of decoding to plain values and converting.
_frame_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw, int])
_items_decoder = msgspec.msgpack.Decoder(dict[str, list[tuple[str, str, msgspec.Raw]]])
_step_output_decoder = msgspec.msgpack.Decoder(messages.StepOutput, ext_hook=_ext_hook)


def decode(frame: bytes) -> tuple[Any, int]:
    """(obj, tag) of a frame; an Outputs frame's items keep their payloads raw (unpack them)."""
    kind, payload, tag = _frame_decoder.decode(frame)
    if kind == "Outputs":
        return _TYPES[kind](_items_decoder.decode(payload)["items"]), tag
    return unpack(kind, payload), tag
