"""A worker process's configuration."""
from __future__ import annotations

import dataclasses

from tandem.common.limits import RequestLimits
from tandem.common.roles import Role
from tandem.engine.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    role: Role
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    # NIXL's UCX progress thread: READs progress without polling, at the price of a busy core.
    nixl_progress_thread: bool = False
    # Admin RPCs need this bearer token when set.
    admin_token: str | None = None
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)

    def __post_init__(self):
        if not isinstance(self.role, Role) or self.role is Role.UNKNOWN:
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
