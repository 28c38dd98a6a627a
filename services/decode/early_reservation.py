"""An announced request's KV blocks, reserved on the decode while its prefill computes the prompt.

The router announces a split's generation phase to its decode worker when the context phase
starts; the decode takes the request in then and, when its pool has room to spare, reserves the
prompt's blocks at once (SGLang's decode pre-allocates so too), so that the handoff starts its
READ without a round trip to the engine thread. The reserved sequence has no first tokens yet:
the RemoteKvArrived that schedules it brings them.

A reservation belongs to its request id until the request's pull takes it (take) or it is given
back (drop: the request ended first, ran no pull, or the decode paused). Another request of that
id that starts on the worker meanwhile (the router resending the request whole after dropping
its announcement, or a caller reusing an id) is not refused: the reservation gives way to it
(dropped first, so that the new request's AddRequest follows the abort in the engine's queue,
and no abort of the id can free blocks a pull is about to write into), and the announced
request, when its handoff comes, meets that request as a duplicate id or reserves anew, as it
would have without reserving early.
"""

from __future__ import annotations

import asyncio

from tandem.engine.messages import ImportPlan


class EarlyReservation:
    """The engine's answer to an early AddRequest (an ImportPlan, or None when the pool had no
    room to spare), perhaps still on the way, and the weights it was reserved under."""

    __slots__ = ("core", "request_id", "weights_id", "_plan", "_pending")

    def __init__(
        self,
        core,
        request_id: str,
        weights_id: str,
        plan: asyncio.Future,
        pending: dict[str, EarlyReservation],
    ):
        """pending: the reservations no pull took yet, by request id (this one joins them)."""
        self.core = core
        self.request_id = request_id
        self.weights_id = weights_id
        self._plan: asyncio.Future | None = plan
        self._pending = pending
        pending[request_id] = self

    async def take(self, weights_id: str) -> ImportPlan | None:
        """The reserved blocks, the request's to end from now on; None when the pool had no room,
        the engine refused the request (its handoff then meets the same error), the reservation
        was dropped, or the weights changed since (its prefix-cache blocks may hold KV of the old
        ones: given back, the handoff reserves anew)."""
        if self._plan is not None and weights_id != self.weights_id:
            self.drop()
        plan = self._release()
        if plan is None:
            return None
        try:
            return await asyncio.shield(plan)
        except Exception:  # noqa: BLE001 - reserved after the handoff instead, which says why
            return None

    def drop(self) -> None:
        """Gives the blocks back. The abort follows the reservation in the engine's queue, so it
        frees what that reserved (nothing, if the engine refused it: no other request holds the
        id meanwhile). A no-op once taken or dropped."""
        plan = self._release()
        if plan is not None:
            self.core.abort(self.request_id)
            plan.add_done_callback(_retrieve)

    def _release(self) -> asyncio.Future | None:
        plan, self._plan = self._plan, None
        if plan is not None and self._pending.get(self.request_id) is self:
            del self._pending[self.request_id]
        return plan


def _retrieve(plan: asyncio.Future) -> None:
    """A refused reservation's error is nobody's to report (its handoff reserves anew)."""
    if not plan.cancelled():
        plan.exception()
