"""What a worker process does in the cluster: the Role of worker.proto, with its names and abilities."""

from __future__ import annotations

import enum

from tandem.v1 import worker_pb2


class Role(enum.IntEnum):
    UNKNOWN = worker_pb2.ROLE_UNSPECIFIED
    PREFILL = worker_pb2.ROLE_PREFILL
    DECODE = worker_pb2.ROLE_DECODE
    BOTH = worker_pb2.ROLE_BOTH

    @classmethod
    def parse(cls, name: str) -> Role:
        """prefill | decode | both, as the CLI and the chart spell them."""
        try:
            role = cls[name.upper()]
        except KeyError:
            role = cls.UNKNOWN
        if role is cls.UNKNOWN:
            raise ValueError(f"role must be one of prefill, decode, both; got {name!r}")
        return role

    @property
    def label(self) -> str:
        return "" if self is Role.UNKNOWN else self.name.lower()

    @property
    def can_prefill(self) -> bool:
        return self in (Role.PREFILL, Role.BOTH)

    @property
    def can_decode(self) -> bool:
        return self in (Role.DECODE, Role.BOTH)

    @property
    def hands_off(self) -> bool:
        """Runs context_only requests: keeps their KV under lease for a decode worker."""
        return self is Role.PREFILL

    @property
    def pulls(self) -> bool:
        """Runs generation_only requests with a handoff: pulls their KV from a prefill worker."""
        return self is Role.DECODE

    @property
    def has_transceiver(self) -> bool:
        return self in (Role.PREFILL, Role.DECODE)
