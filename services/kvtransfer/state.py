"""DataTransceiverState: what a peer needs to READ from our KV pool.

Wire format (no pickle: the bytes cross process and trust boundaries):

    magic b"TKVS" | version u16 | header_len u32 | JSON header | metadata_len u32 | metadata

The JSON header holds the scalar fields; the NIXL agent metadata is opaque
binary, so it travels length-prefixed beside the header rather than
base64-inflated inside it. All integers are big-endian.
"""

from __future__ import annotations

import functools
import json
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"TKVS"
# 2: rank_pools, every tensor-parallel rank's pool (one agent registers them all).
# 3: host_id, so that a reader knows a pull that stays within one host. A version-2 state (a
# peer not upgraded yet) still reads, with no host id: a rolling upgrade keeps its pulls.
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
# A host id is a boot id (36 characters) or a host name (at most 253).
MAX_HOST_ID_CHARS = 253
# The most KV blocks a pool may have (an 8B model's 80 GB of KV is ~40,000 blocks of 16 tokens;
# a small model's pool of short blocks a few million): a peer's are listed once when it is added.
MAX_NUM_BLOCKS = 1 << 24
MEMORY_TYPES = ("DRAM", "VRAM")

_PREFIX = struct.Struct("!4sHI")
_LENGTH = struct.Struct("!I")
# Header keys and their JSON types; the dataclass fields minus agent_metadata.
_HEADER_FIELDS = {
    "agent_name": str,
    "base_address": int,
    "block_nbytes": int,
    "num_blocks": int,
    "memory_type": str,
    "device_id": int,
    "layout_hash": str,
    "rank_pools": list,
    "host_id": str,
}


_V2_HEADER_FIELDS = {name: kind for name, kind in _HEADER_FIELDS.items() if name != "host_id"}


@dataclass(frozen=True)
class TransceiverState:
    """One worker's KV pool as seen by a remote reader."""

    agent_name: str
    agent_metadata: bytes
    base_address: int
    block_nbytes: int
    num_blocks: int
    memory_type: str
    device_id: int
    layout_hash: str
    # (base address, device id) of each tensor-parallel rank's pool, rank 0's first.
    rank_pools: tuple[tuple[int, int], ...] = ()
    # The kernel the pool lives under (local_host_id()): equal ids, one host.
    host_id: str = ""

    def __post_init__(self) -> None:
        if not self.rank_pools:
            object.__setattr__(self, "rank_pools", ((self.base_address, self.device_id),))
        pools = tuple(tuple(pool) for pool in self.rank_pools)
        if any(
            len(pool) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pool)
            or pool[0] == 0
            for pool in pools
        ):
            raise ValueError(
                f"rank_pools must be (base_address > 0, device_id >= 0) pairs, got {self.rank_pools!r}"
            )
        object.__setattr__(self, "rank_pools", pools)
        if not self.agent_name:
            raise ValueError("agent_name must be non-empty")
        if not self.agent_metadata:
            raise ValueError("agent_metadata must be non-empty")
        if self.memory_type not in MEMORY_TYPES:
            raise ValueError(f"memory_type must be one of {MEMORY_TYPES}, got {self.memory_type!r}")
        if self.base_address <= 0 or self.block_nbytes <= 0 or self.num_blocks <= 0:
            raise ValueError(
                f"base_address, block_nbytes and num_blocks must be positive, got "
                f"{self.base_address}, {self.block_nbytes}, {self.num_blocks}"
            )
        if self.num_blocks > MAX_NUM_BLOCKS or self.num_blocks * self.block_nbytes >= 1 << 56:
            # A peer's blocks are listed with NIXL when it is added (one descriptor each).
            raise ValueError(
                f"num_blocks must be at most {MAX_NUM_BLOCKS} and the pool under 2**56 bytes, got "
                f"{self.num_blocks} blocks of {self.block_nbytes} bytes"
            )
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, got {self.device_id}")
        if len(self.host_id) > MAX_HOST_ID_CHARS or not (
            self.host_id.isascii() and self.host_id.isprintable()
        ):
            raise ValueError(
                f"host_id must be at most {MAX_HOST_ID_CHARS} printable ASCII characters, got "
                f"{self.host_id[:40]!r}"
            )

    @property
    def tp_size(self) -> int:
        return len(self.rank_pools)

    def same_host(self, other: TransceiverState) -> bool:
        return bool(self.host_id) and self.host_id == other.host_id

    def to_bytes(self) -> bytes:
        header = json.dumps(
            {name: getattr(self, name) for name in _HEADER_FIELDS}, separators=(",", ":")
        ).encode()
        return b"".join(
            (
                _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)),
                header,
                _LENGTH.pack(len(self.agent_metadata)),
                self.agent_metadata,
            )
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> TransceiverState:
        """Parse bytes from to_bytes(); anything malformed raises ValueError."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"transceiver state must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _PREFIX.size:
            raise ValueError(f"transceiver state truncated: {len(data)} bytes")
        magic, version, header_len = _PREFIX.unpack_from(data, 0)
        if magic != MAGIC:
            raise ValueError(f"not a transceiver state: bad magic {magic!r}")
        if version not in READABLE_VERSIONS:
            raise ValueError(
                f"transceiver state format version {version} is not supported (expected one of "
                f"{READABLE_VERSIONS})"
            )
        offset = _PREFIX.size
        header_bytes = data[offset : offset + header_len]
        offset += header_len
        if len(header_bytes) != header_len or len(data) < offset + _LENGTH.size:
            raise ValueError("transceiver state truncated inside the header")
        (metadata_len,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if len(data) != offset + metadata_len:
            raise ValueError(
                f"transceiver state length mismatch: metadata declares {metadata_len} bytes, "
                f"{len(data) - offset} present"
            )
        try:
            header = json.loads(header_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"transceiver state header is not valid JSON: {exc}") from None
        fields = _HEADER_FIELDS if version == FORMAT_VERSION else _V2_HEADER_FIELDS
        if not isinstance(header, dict) or set(header) != set(fields):
            raise ValueError(
                f"transceiver state version {version} header must have exactly the keys {sorted(fields)}"
            )
        for name, kind in fields.items():
            # bool is an int subclass in Python; a JSON true is never a valid count.
            if not isinstance(header[name], kind) or isinstance(header[name], bool):
                raise ValueError(f"transceiver state field {name!r} must be {kind.__name__}")
        return cls(agent_metadata=data[offset:], **header)


@functools.cache
def local_host_id() -> str:
    """The running kernel's boot id: the same for every process and container (every pod) on one
    host, another on each host and after each reboot. The host name where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()
