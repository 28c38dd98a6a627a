"""The trainer's side of an RL loop that serves its rollouts from tandem (needs torch)."""

from tandem.rl.ipc import ipc_handles

__all__ = ["ipc_handles"]
