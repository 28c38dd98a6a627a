"""The context phase (context_only): run the prompt, sample the first token, and hand the KV
off: the blocks stay under a lease (lease_keeper.py) and the caller gets a signed handoff
naming them (kvtransfer/handoff.py), which a decode worker presents to pull them. A worker that
speculates hands over its drafts to follow the first token too (draft_tokens), which the decode
verifies at its first step. The router's own split whose generation phase it announced to a decode
worker gets the handoff sent there too, straight from here (handoff_push.py)."""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.messages import StepOutput
from tandem.engine.sequence import Phase
from tandem.kvtransfer.handoff import HandoffFormat
from tandem.prefill.handoff_push import HandoffPush
from tandem.prefill.lease_keeper import LeaseEnd, LeaseKeeper
from tandem.v1 import types_pb2


class ContextPhase:
    def __init__(
        self,
        keeper: LeaseKeeper,
        handoff_format: HandoffFormat,
        endpoint: str,
        agent_name: str,
        weights_id: Callable[[], str] = lambda: "",
        push: HandoffPush | None = None,
    ):
        """weights_id: the weights the worker serves now (its handoffs carry it); push: sends
        a handoff to the decode its request was announced to as well (handoff_push.py)."""
        self.push = push
        self.keeper = keeper
        self.handoff_format = handoff_format
        self.endpoint = endpoint
        self.agent_name = agent_name
        self.weights_id = weights_id

    def start(self, request) -> None:
        """request: a worker.output_processor.WorkerRequest of one sequence. A client's handoff
        counts against its share of the pool from now on (refused when that is full)."""
        if request.client is not None:
            self.keeper.admit(request.request_id, request.client, len(request.prompt_token_ids))
        elif request.disagg_in.HasField("disagg_request_id"):  # the router's own split
            self.keeper.expect_split(request.request_id, request.disagg_in.disagg_request_id)
        request.on_close.append(lambda: self.keeper.forget(request.request_id))
        request.hand_off = lambda out: self._handoff_params(request, out)
        request.withdraw = self._withdraw
        request.submit(Phase.CONTEXT_ONLY)

    def _handoff_params(self, request, out: StepOutput) -> types_pb2.DisaggregatedParams:
        lease = out.lease
        params = types_pb2.DisaggregatedParams(
            request_type=types_pb2.REQUEST_TYPE_CONTEXT_ONLY,
            first_gen_tokens=out.new_token_ids,
            draft_tokens=out.draft_token_ids,
            ctx_request_id=lease.lease_id,
            ctx_endpoint=self.endpoint,
            opaque_state=self.handoff_format.build(
                self.endpoint,
                self.agent_name,
                lease.lease_id,
                lease.block_ids,
                lease.expires_at,
                request.prompt_token_ids,
                request.cache_salt,
                request.adapter,
                self.weights_id(),
            ),
        )
        if request.disagg_in.HasField("disagg_request_id"):
            params.disagg_request_id = request.disagg_in.disagg_request_id
            if request.hand_off_to and self.push is not None:
                self.push.send(request.hand_off_to, params.disagg_request_id, params)
        return params

    def _withdraw(self, lease_id: int, stopped: bool = False) -> None:
        self.keeper.release(lease_id, LeaseEnd.STOPPED if stopped else LeaseEnd.UNDELIVERED)
