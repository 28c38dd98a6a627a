"""The messages between a worker's IO process and its engine core process, beside
engine/messages.py's commands and outputs (worker/core_process.py, worker/core_client.py):
plain dataclasses registered with engine/wire.py.

The IO process sends Start first and the core answers Ready (or Failed); then commands in
order, calls tagged (answered by Reply under the same tag), Stop last. The core sends each
step's Outputs as one frame, with Stats and KvEvents beside them (a step's Stats may come before
its Outputs), and the transceiver's READ results and notifications.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc

from tandem.common.errors import KvLoadFailedError, RpcError
from tandem.engine import wire
from tandem.engine.config import EngineConfig
from tandem.engine.messages import EngineFacts, WeightsInfo
from tandem.kvtransfer import errors as kv_errors
from tandem.kvtransfer.state import TransceiverState
from tandem.worker.ipc_weights import HandleError


@dataclasses.dataclass(frozen=True)
class Start:
    config: EngineConfig
    hands_off: bool
    # LoRA adapters the core keeps on the host (lora_adapter.AdapterStore), 0: none.
    adapter_capacity: int = 0


@dataclasses.dataclass(frozen=True)
class Ready:
    facts: EngineFacts
    weights: WeightsInfo
    released_tags: list[str]
    pid: int
    warmup_s: float


@dataclasses.dataclass(frozen=True)
class Failed:
    error: str


@dataclasses.dataclass(frozen=True)
class Register:
    request_id: str


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class LoadWeights:
    path: str
    fingerprint: str


@dataclasses.dataclass(frozen=True)
class WriteWeights:
    kind: str
    payload: Any


@dataclasses.dataclass(frozen=True)
class GuideInfo:
    """The tokenizer's xgrammar TokenizerInfo (serialized), sent before the first guide."""

    tokenizer_info: str


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


@dataclasses.dataclass(frozen=True)
class TrimMemory:
    """Hand freed memory back to the OS (after a release, a weight load); ipc: also let go of
    the IPC handles a weight update opened."""

    ipc: bool = False


# -- the KV transceiver, which lives beside the pool (here) --
@dataclasses.dataclass(frozen=True)
class StartTransceiver:
    """A NIXL agent over the KV pool and the thread that polls it. Reply: TransceiverInfo."""

    agent_name: str
    progress_thread: bool


@dataclasses.dataclass(frozen=True)
class TransceiverInfo:
    state: bytes  # GetDataTransceiverState's bytes
    block_nbytes: int


@dataclasses.dataclass(frozen=True)
class StopTransceiver:
    pass


@dataclasses.dataclass(frozen=True)
class AddPeer:
    """Reply: the peer's TransceiverState."""

    state: bytes


@dataclasses.dataclass(frozen=True)
class PostRead:
    read_id: int
    peer_name: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    notify: bytes
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class AbandonRead:
    read_id: int


@dataclasses.dataclass(frozen=True)
class ReadFinished:
    """A READ's end: done (nbytes, seconds) or its error."""

    read_id: int
    nbytes: int = 0
    seconds: float = 0.0
    error: Any = None


@dataclasses.dataclass(frozen=True)
class ReadSettled:
    read_id: int


@dataclasses.dataclass(frozen=True)
class Notification:
    peer: str
    message: bytes


@dataclasses.dataclass(frozen=True)
class Reply:
    ok: bool
    value: Any


@dataclasses.dataclass(frozen=True)
class Outputs:
    """One step's outputs: [request_id, kind, payload] each (StepOutput or EngineFailure)."""

    items: list


@dataclasses.dataclass(frozen=True)
class Stats:
    record: dict


@dataclasses.dataclass(frozen=True)
class KvEvents:
    events: list


@dataclasses.dataclass(frozen=True)
class Undelivered:
    request_id: str
    block_ids: list[int]


wire.register(
    Start,
    Ready,
    Failed,
    Register,
    Abort,
    LoadWeights,
    WriteWeights,
    GuideInfo,
    Stop,
    TrimMemory,
    Reply,
    Outputs,
    Stats,
    KvEvents,
    Undelivered,
    StartTransceiver,
    TransceiverInfo,
    StopTransceiver,
    AddPeer,
    TransceiverState,
    PostRead,
    AbandonRead,
    ReadFinished,
    ReadSettled,
    Notification,
)


def _with_status(cls: type[RpcError]):
    """An RpcError's class made again with its gRPC status code (crossed by name)."""

    def make(message: str, attrs: dict) -> RpcError:
        error = cls.__new__(cls)
        Exception.__init__(error, message)
        for name, value in attrs.items():
            setattr(error, name, value)
        error.code = grpc.StatusCode[attrs["code"]]
        return error

    return make


for _cls in (
    kv_errors.KvTransferError,
    kv_errors.LayoutMismatchError,
    kv_errors.UnknownPeerError,
    kv_errors.TransferError,
    kv_errors.TransferTimeoutError,
    kv_errors.TransceiverClosedError,
    HandleError,
):
    wire.register_error(_cls)
for _cls in (RpcError, KvLoadFailedError):
    wire.register_error(_cls, _with_status(_cls))
