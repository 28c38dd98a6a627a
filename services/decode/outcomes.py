"""How each KV handoff that reached this decode ended: exactly one outcome per handoff, counted
and, where the decode computed the prompt itself, logged with its reason.

A split whose decode recomputes every prompt runs, answers correctly and pays for each prompt
twice; without these counts it looks healthy (issue 39: no silent recompute).

Lives on the worker (not the generation phase), so a released and resumed pool keeps them.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable

log = logging.getLogger("tandem.decode.outcomes")

# What a decode does with a handoff whose KV it cannot load (--kv-load-failure-policy, vLLM's
# name): compute the prompt itself, or end the request for the router to retry elsewhere.
LOAD_FAILURE_POLICIES = ("recompute", "fail")


class Outcome(enum.Enum):
    PULLED = "pulled"  # the prompt's KV came from the prefill (and its lease confirmed it)
    RECOMPUTED = "recomputed"  # the decode computed the prompt itself (a Reason says why)
    RELEASED = "released"  # nothing to pull: the first tokens already ended the request
    CANCELLED = "cancelled"  # the request was cancelled before its KV landed
    FAILED = (
        "failed"  # the request failed (with a Reason: its KV did not load, and the policy is fail)
    )


class Reason(enum.Enum):
    NONE = ""
    NO_ROOM = "no_room"  # the decode's pool had no room for the prompt's blocks then
    LEASE_EXPIRING = "lease_expiring"  # too little of the lease was left to read in time
    PULL_FAILED = "pull_failed"  # the READ failed or timed out
    PEER_UNREACHABLE = "peer_unreachable"  # the prefill did not answer (its state, or the confirm)
    UNCONFIRMED = "unconfirmed"  # the lease had ended before the confirm (a stale handoff)
    WEIGHTS_MISMATCH = "weights_mismatch"  # the prefill computed the KV with other weights


class HandoffOutcomes:
    def __init__(
        self,
        decode: str = "",
        on_outcome: Callable[[str, str], None] = lambda outcome, reason: None,
    ):
        """decode: this worker's address (in the log lines); on_outcome(outcome, reason): each
        handoff's end (the worker's metrics)."""
        self.decode = decode
        self.on_outcome = on_outcome
        self._counts: collections.Counter[tuple[Outcome, Reason]] = collections.Counter()

    def record(
        self, outcome: Outcome, request_id: str, prefill: str, reason: Reason = Reason.NONE
    ) -> None:
        self._counts[outcome, reason] += 1
        self.on_outcome(outcome.value, reason.value)
        if reason is not Reason.NONE:
            log.warning(
                "request %s: the KV handed off by prefill %s was not pulled (%s); decode %s %s",
                request_id,
                prefill,
                reason.value,
                self.decode,
                "computes the prompt itself"
                if outcome is Outcome.RECOMPUTED
                else "fails the request (--kv-load-failure-policy fail)",
            )

    def counts(self) -> dict[str, int]:
        """By "outcome" or "outcome:reason" (WorkerState.kv_handoff_outcomes)."""
        return {
            f"{outcome.value}:{reason.value}" if reason.value else outcome.value: count
            for (outcome, reason), count in self._counts.items()
        }

    def count(self, outcome: Outcome, reason: Reason | None = None) -> int:
        return sum(n for (o, r), n in self._counts.items() if o is outcome and reason in (None, r))
