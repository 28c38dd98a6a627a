"""The engine's messages on the wire between a worker's IO process and its engine core process
(worker/core_process.py): MessagePack by msgspec, never pickle. A frame is [kind, payload]:
kind names a dataclass of engine/messages.py (or of the process protocol, PROTOCOL), the
payload is its fields. Tensors (logits), exceptions (an EngineFailure's, a failed call's), a
LoRA adapter (by name, id and path: the core reads it itself) and a compiled guide (xgrammar's
JSON) travel as MessagePack extensions.

Both ends are processes of one worker, connected over IPC sockets in a directory only their
user can open; an exception crosses as its class's name and message, and is rebuilt only as a
tandem or built-in exception class."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import msgspec
import torch

from tandem.engine import messages
from tandem.engine.beam_search import BeamResult

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


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().contiguous().cpu()
        header = msgspec.msgpack.encode([str(tensor.dtype).removeprefix("torch."), tensor.shape])
        data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return msgspec.msgpack.Ext(_TENSOR, len(header).to_bytes(4, "little") + header + data)
    if isinstance(obj, BaseException):
        cls = type(obj)
        return msgspec.msgpack.Ext(
            _ERROR, msgspec.msgpack.encode([cls.__module__, cls.__qualname__, str(obj)])
        )
    if hasattr(obj, "fingerprint") and hasattr(obj, "int_id") and hasattr(obj, "weights"):
        return msgspec.msgpack.Ext(
            _ADAPTER, msgspec.msgpack.encode([obj.name, obj.int_id, obj.path])
        )
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


def rebuild_error(module: str, qualname: str, message: str) -> BaseException:
    """The exception a peer raised: its own class when that is a tandem or built-in exception,
    else a RuntimeError that names it."""
    if module == "builtins" or module.startswith("tandem."):
        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            if isinstance(cls, type) and issubclass(cls, Exception):
                return cls(message)
        except (ImportError, AttributeError, TypeError):
            pass
    return RuntimeError(f"{module}.{qualname}: {message}")


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
    messages.FreeBlocks,
    messages.CheckIdle,
    messages.HoldSteps,
    messages.ReleaseMemory,
    messages.ResumeMemory,
    messages.ReadCounters,
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
    if obj is None or not dataclasses.is_dataclass(obj):
        return ["", obj]
    kind = type(obj).__name__
    if _TYPES.get(kind) is not type(obj):
        raise TypeError(f"{kind} is not a message the engine core takes")
    if isinstance(obj, messages.EngineFailure):
        return [kind, {"error": obj.error}]
    return [kind, obj]


def unpack(kind: str, payload: Any) -> Any:
    if not kind:
        return payload
    cls = _TYPES[kind]
    if cls is messages.EngineFailure:
        return messages.EngineFailure(payload["error"])
    value = msgspec.convert(payload, cls, strict=False)
    if cls is messages.StepOutput and value.beams:
        value.beams = [msgspec.convert(b, BeamResult, strict=False) for b in value.beams]
    return value


def encode(obj: Any, tag: int = 0) -> bytes:
    """One frame: obj packed, and a tag (a call's id; 0 for none)."""
    return _encoder.encode([*pack(obj), tag])


def decode(frame: bytes) -> tuple[Any, int]:
    """(obj, tag) of a frame."""
    kind, payload, tag = _decoder.decode(frame)
    return unpack(kind, payload), tag
