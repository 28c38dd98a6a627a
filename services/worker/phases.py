"""Which lifecycle a request runs on this worker, by its request_type and the worker's Role.

| request_type            | prefill      | decode           | both  |
| context_and_generation  | local        | local            | local |
| context_only            | context      | refused          | refused |
| generation_only + KV    | refused      | generation (pull)| refused |
| generation_only, no KV  | local (recompute the prompt and the tokens so far: a migration) |
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from tandem.common.errors import RpcError
from tandem.common.roles import Role
from tandem.decode.early_reservation import EarlyReservation
from tandem.decode.generation import GenerationPhase
from tandem.engine.sequence import Phase
from tandem.prefill.context import ContextPhase
from tandem.v1 import types_pb2

REQUEST_PHASES = {
    types_pb2.REQUEST_TYPE_CONTEXT_AND_GENERATION: Phase.CONTEXT_AND_GENERATION,
    types_pb2.REQUEST_TYPE_CONTEXT_ONLY: Phase.CONTEXT_ONLY,
    types_pb2.REQUEST_TYPE_GENERATION_ONLY: Phase.GENERATION_ONLY,
}


class LocalPhase:
    """The whole lifecycle here: context_and_generation, and a generation_only without a handoff
    (a request migrated from a worker that died: its KV is recomputed from the prompt plus the
    tokens already streamed)."""

    @staticmethod
    def start(request) -> None:
        if request.phase is Phase.GENERATION_ONLY:
            if request.finish_if_first_tokens_end():
                return
            request.submit(Phase.CONTEXT_AND_GENERATION, output_token_ids=request.first_gen_tokens)
        else:
            request.submit(request.phase)


class PhasePicker:
    def __init__(self, role: Role):
        self.role = role
        # Present while this worker's transceiver runs (not after release(["kv_cache"])).
        self.context: ContextPhase | None = None
        self.generation: GenerationPhase | None = None

    def pick(
        self,
        phase: Phase,
        params: types_pb2.DisaggregatedParams,
        prompt_token_ids: list[int],
        cache_salt: str | None,
        adapter=None,
        reservation: EarlyReservation | None = None,
    ) -> Callable:
        """The function that starts a WorkerRequest of this phase here, or the error refusing it.
        reservation: an announced request's blocks (reserve_early), for its pull."""
        if phase is Phase.CONTEXT_ONLY:
            if self.context is None:
                raise RpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this {self.role.label} worker cannot run context_only requests; send them to a "
                    f"prefill worker",
                )
            return self.context.start
        if phase is Phase.GENERATION_ONLY and not params.opaque_state:
            if not params.first_gen_tokens:
                raise ValueError(
                    "generation_only needs disaggregated_params.first_gen_tokens (and the context "
                    "phase's opaque_state, or none to recompute the KV here)"
                )
            return LocalPhase.start
        if phase is Phase.GENERATION_ONLY:
            generation = self.generation
            if generation is None:
                raise RpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this {self.role.label} worker cannot run generation_only requests; send them to a "
                    f"decode worker",
                )
            handoff = generation.verify(params, prompt_token_ids, cache_salt, adapter)
            return lambda request: generation.start(request, handoff, reservation)
        return LocalPhase.start

    def reserve_early(
        self, core, request_id: str, prompt_token_ids, options, priority, cache_salt, adapter
    ) -> EarlyReservation | None:
        """An announced generation_only request's blocks, reserved now (a decode's generation
        phase, when it can: GenerationPhase.reserve_early), or None."""
        if self.generation is None:
            return None
        return self.generation.reserve_early(
            core, request_id, prompt_token_ids, options, priority, cache_salt, adapter
        )

    def reservation_for(self, request_id: str) -> EarlyReservation | None:
        """The pending early reservation of that request id, if any."""
        return self.generation.reservation_for(request_id) if self.generation else None

    def drop_reservations(self) -> None:
        """Drops the reservations no pull took yet (a pause aborts what runs)."""
        if self.generation is not None:
            self.generation.drop_reservations()
