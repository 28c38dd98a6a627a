"""The trainer's side of an RL loop that serves its rollouts from tandem (needs torch)."""

from tandem.rl.ipc import ipc_handles
from tandem.rl.nixl import NixlWeightSource

__all__ = ["NixlWeightSource", "ipc_handles"]
