"""The announced requests on a decode worker that await their handoff, by the split's
disagg_request_id. Two senders race to bring it: the router, on its session
(SessionRequest.handoffs), and the prefill, which the router told where the request was announced
(SessionSubmit.hand_off_to) and which sends it here itself as its context phase ends
(Worker/HandOff): that saves the pull the hop through the router. The first to come is taken;
the router's, when it comes second, is the same handoff (the router hands off only what that
prefill replied; a context phase it retried elsewhere drops the announcement first) and is
ignored, and one that differs cancels the request (session_server.py)."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from tandem.v1 import internal_pb2


class ArrivedHandoff(NamedTuple):
    """What an announced request's handoff future is set to."""

    kv_params: internal_pb2.KvParams
    from_prefill: bool  # sent by the prefill itself (Worker/HandOff), ahead of the router's


class AwaitedHandoffs:
    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def register(self, disagg_request_id: int, handoff: asyncio.Future) -> bool:
        """handoff (an announced request's future) may be set by hand_off(disagg_request_id) too;
        False when another request awaits that id (only the router's session brings this one's)."""
        if not disagg_request_id or disagg_request_id in self._waiting:
            return False
        self._waiting[disagg_request_id] = handoff
        return True

    def forget(self, disagg_request_id: int, handoff: asyncio.Future) -> None:
        if self._waiting.get(disagg_request_id) is handoff:
            del self._waiting[disagg_request_id]

    def hand_off(self, disagg_request_id: int, kv_params: internal_pb2.KvParams) -> bool:
        """A prefill's handoff (Worker/HandOff): whether a request awaited it (and took it)."""
        handoff = self._waiting.pop(disagg_request_id, None)
        if handoff is None or handoff.done():
            return False
        handoff.set_result(ArrivedHandoff(kv_params, True))
        return True
