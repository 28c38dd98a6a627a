"""A worker process's configuration."""
from __future__ import annotations

import dataclasses

from tandem.engine.config import EngineConfig

ROLES = ("prefill", "decode", "both")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    role: str
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    # Seconds a context_only request's KV stays leased before the prefill frees it.
    kv_lease_seconds: float = 30.0

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.kv_lease_seconds <= 0:
            raise ValueError(f"kv_lease_seconds must be > 0, got {self.kv_lease_seconds}")
