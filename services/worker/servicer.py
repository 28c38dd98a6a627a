"""The AsyncLLM and Worker services of one worker process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid

from google.protobuf import json_format

from tandem.common import tracing
from tandem.common.auth import is_loopback_peer
from tandem.common.callers import (
    CLIENT_METADATA,
    SPLIT_METADATA,
    caller_of,
    client_of,
    holds_admin_token,
    may_abort,
    metadata_value,
)
from tandem.common.engine_messages import disaggregated_params, generate_request
from tandem.common.errors import (
    PreconditionError,
    failing_before_handoff,
    invalid,
    unavailable,
)
from tandem.common.interceptors import MalformedRequest
from tandem.common.logs import bind
from tandem.common.pause import PauseMode
from tandem.decode.awaited_handoffs import AwaitedHandoffs
from tandem.engine.messages import HoldSteps
from tandem.engine.sampling_options import for_generation_phase
from tandem.engine.sequence import Phase
from tandem.prefill.lease_keeper import LeaseEnd
from tandem.text.front import TextFront
from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from tandem.worker import admin
from tandem.worker.convert import check_unsupported, sampling_options
from tandem.worker.guides import Guides
from tandem.worker.output_processor import WorkerRequest
from tandem.worker.output_sink import OutputSink
from tandem.worker.output_streams import OutputStream
from tandem.worker.phases import REQUEST_PHASES
from tandem.worker.runtime import WorkerRuntime
from tandem.worker.session_server import Sessions

# A worker's span of a request, by the phase it runs.
_SPAN_NAMES = {
    Phase.CONTEXT_ONLY: "tandem.prefill",
    Phase.GENERATION_ONLY: "tandem.decode",
    Phase.CONTEXT_AND_GENERATION: "tandem.generate",
}


def _json(d: dict) -> str:
    """JSON text keeps ints exact (63-bit block hashes), which google.protobuf.Struct would not."""
    return json.dumps(d, separators=(",", ":"))


class WorkerLLMServicer(llm_pb2_grpc.AsyncLLMServicer):
    """RPC glue: each handler hands its request to the runtime, the text front or a phase."""

    def __init__(self, runtime: WorkerRuntime):
        self.rt = runtime
        self.requests: dict[str, WorkerRequest] = {}
        self.guides = Guides(runtime)
        self.awaited_handoffs = AwaitedHandoffs()
        self.sessions = Sessions(
            self.run_submitted,
            runtime.server.in_flight,
            runtime.metrics.rpc_counts.count_code,
            runtime.config.limits.max_request_bytes,
        )

    async def Generate(self, request: llm_pb2.GenerateRequest, context):
        bind(request_id=request.request_id, worker=self.rt.worker_id)
        tracker, text_request, adapter, guide = await self._prepare(request)
        requester = client_of(context)
        client = None if metadata_value(context, SPLIT_METADATA) else requester
        with self._running(
            text_request.engine_request, caller_of(context), client, adapter, guide
        ) as worker_request:
            worker_request.requester = requester
            async for msg in self._messages(text_request, tracker, worker_request):
                yield msg
                worker_request.delivered()

    async def run_submitted(
        self,
        submit: worker_pb2.SessionSubmit,
        stream: OutputStream,
        owner: str,
        handoff: asyncio.Future | None = None,
    ) -> None:
        """A request that came on a session (session_server.py): token ids in, its outputs onto the
        session's stream under its tag as the engine hands them over (output_sink.py), then its
        end; what it raises is its status. No text runs here: that is the caller's front's.
        handoff: an announced generation_only request's (awaits_handoff) handoff to come
        (decode/awaited_handoffs.ArrivedHandoff), from the router or, ahead of it, from its
        prefill: the request is taken in and checked first, so that the handoff starts its pull
        at once; what fails it before then fails with the reason before_handoff."""
        bind(request_id=submit.request.request_id, worker=self.rt.worker_id)
        request = generate_request(submit.request)
        if handoff is None:
            await self._run_submitted(submit, stream, owner, request, None)
            return
        split_id = request.disaggregated_params.disagg_request_id
        self.awaited_handoffs.register(split_id, handoff)
        try:
            await self._run_submitted(submit, stream, owner, request, handoff)
        finally:
            self.awaited_handoffs.forget(split_id, handoff)

    async def _run_submitted(
        self,
        submit: worker_pb2.SessionSubmit,
        stream: OutputStream,
        owner: str,
        request: llm_pb2.GenerateRequest,
        handoff: asyncio.Future | None,
    ) -> None:
        announced, checked, reservation = handoff is not None, None, None
        with failing_before_handoff(announced):
            if announced and (
                request.disaggregated_params.request_type != types_pb2.REQUEST_TYPE_GENERATION_ONLY
            ):
                raise invalid("awaits_handoff is for a generation_only request")
            tracker, text_request, adapter, guide = await self._prepare(request)
            if not text_request.processor.is_passthrough:
                raise invalid(
                    "a session carries token ids only: set sampling_params.detokenize=false and "
                    "leave stop strings and exclude_input_from_output to the caller's text front"
                )
            if announced:
                checked = self._checked(text_request.engine_request, guide)
                reservation = self._reserve_early(text_request.engine_request, checked, adapter)
        try:
            from_prefill = False
            if announced:
                kv, from_prefill = await handoff
                with failing_before_handoff(True):  # paused or released meanwhile: refused as now
                    self.rt.check_accepting(types_pb2.REQUEST_TYPE_GENERATION_ONLY)
                params = text_request.engine_request.disaggregated_params
                params.CopyFrom(disaggregated_params(kv))
                params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
                tracker.started = time.monotonic()  # its latency here runs from the handoff
            requester = submit.client or owner
            client = None if submit.split else requester
            sink = OutputSink(text_request, tracker, stream, submit.tag)
            echo = submit.request.return_first_gen_tokens
            source = submit.prefix_source if submit.HasField("prefix_source") else None
            with self._running(
                text_request.engine_request,
                owner,
                client,
                adapter,
                guide,
                sink,
                echo,
                source,
                checked,
                reservation,
                submit.hand_off_to,
                from_prefill,
            ) as worker_request:
                worker_request.requester = requester
                await sink.wait()  # each output went out as the engine handed it over
        finally:
            if reservation is not None:  # (a no-op once its pull took it)
                reservation.drop()

    def _reserve_early(self, request: llm_pb2.GenerateRequest, checked: tuple, adapter):
        """An announced request's blocks, reserved while its prefill runs (a decode worker's
        generation phase, not paused), or None."""
        rid = request.request_id
        if not rid or rid in self.requests or self.rt.paused:  # (_start refuses a running id)
            return None
        options, prompt_ids = checked
        priority, salt = _priority_and_salt(request)
        return self.rt.phases.reserve_early(
            self.rt.core, rid, prompt_ids, for_generation_phase(options), priority, salt, adapter
        )

    @staticmethod
    def _messages(text_request, tracker, worker_request: WorkerRequest):
        """A running request's messages as its caller gets them (the usual path: text front and metrics)."""
        return TextFront.respond(
            text_request, worker_request.outputs(), worker_request.stop, tracker
        )

    async def _prepare(self, request: llm_pb2.GenerateRequest):
        """What every Generate does before it starts: refused while paused, checked, its text
        front, adapter and guide ready. Returns (tracker, text request, adapter, guide)."""
        rt = self.rt
        tracker = rt.metrics.requests.track()
        rt.check_accepting(request.disaggregated_params.request_type)
        check_unsupported(request)
        text_request = await rt.front.prepare(request)
        adapter = await rt.load_adapter(text_request.engine_request)
        guide = await self.guides.compile(request.sampling_params)
        return tracker, text_request, adapter, guide

    @contextlib.contextmanager
    def _running(
        self,
        request: llm_pb2.GenerateRequest,
        owner: str,
        client: str | None,
        adapter=None,
        guide=None,
        sink: OutputSink | None = None,
        return_first_gen_tokens: bool = True,
        prefix_source: worker_pb2.PrefixSource | None = None,
        checked: tuple | None = None,
        reservation=None,
        hand_off_to: str = "",
        handoff_from_prefill: bool = False,
    ):
        """The started request (_start), known by its id (Abort, StopSequences) until the block
        is left, then closed (aborted in the engine if it still runs)."""
        worker_request = self._start(
            request,
            owner,
            client,
            adapter,
            guide,
            sink,
            return_first_gen_tokens,
            prefix_source,
            checked,
            reservation,
            hand_off_to,
            handoff_from_prefill,
        )
        self.requests[worker_request.request_id] = worker_request
        # The phase's span: a child of the router's (the traceparent it put in trace_headers),
        # and the parent of the decode's KV pull (worker_request.trace_headers).
        worker_request.trace_headers = dict(request.trace_headers)
        traced = tracing.span(
            _SPAN_NAMES[worker_request.phase],
            worker_request.trace_headers,
            **{"tandem.request_id": worker_request.request_id, "tandem.worker": self.rt.worker_id},
        )
        try:
            with traced:
                yield worker_request
        finally:
            self.requests.pop(worker_request.request_id, None)
            worker_request.close()
            m = worker_request.metrics
            if None not in (m.scheduled_at, m.first_token_at, m.finished_at):
                self.rt.metrics.observe_request_phases(
                    m.arrival, m.scheduled_at, m.first_token_at, m.finished_at
                )

    def _start(
        self,
        request: llm_pb2.GenerateRequest,
        owner: str,
        client: str | None,
        adapter=None,
        guide=None,
        sink: OutputSink | None = None,
        return_first_gen_tokens: bool = True,
        prefix_source: worker_pb2.PrefixSource | None = None,
        checked: tuple | None = None,
        reservation=None,
        hand_off_to: str = "",
        handoff_from_prefill: bool = False,
    ) -> WorkerRequest:
        """Validates a token-id request and starts it in the phase its request_type asks for.
        owner: the caller that may abort it; client: whom its unclaimed KV handoff counts against
        (None: the router's own split); sink: what takes its outputs instead of its queue
        (output_sink.py); return_first_gen_tokens: a generation_only output starts with the
        tokens the request carries (a public Generate's does); prefix_source: where the router
        says the prompt's prefix may be pulled from (a session's submit only; ignored by a worker
        without --kv-prefix-pulls); checked: what _checked returned for it already; reservation:
        its blocks reserved at its announcement (decode/early_reservation.py), for its pull;
        hand_off_to: a context phase of the router's split announced to the decode at that
        address, which gets the handoff from here too (prefill/context.py);
        handoff_from_prefill: a generation phase whose handoff came from its prefill itself."""
        options, prompt_ids = checked or self._checked(request, guide)
        limits = self.rt.core.facts.limits
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running; ids must be unique")
        held = self.rt.phases.reservation_for(request_id)
        if held is not None and held is not reservation:
            # An announced request's reservation gives way to a request of its id that starts
            # (the router's resend of it, say): see early_reservation.py.
            held.drop()
        if request.disaggregated_params.request_type not in REQUEST_PHASES:
            raise ValueError(
                f"disaggregated_params.request_type {request.disaggregated_params.request_type} is not "
                f"a RequestType"
            )
        phase = REQUEST_PHASES[request.disaggregated_params.request_type]
        if phase is Phase.GENERATION_ONLY:
            limits.check_draft_tokens(list(request.disaggregated_params.draft_tokens))
        priority, salt = _priority_and_salt(request)
        if reservation is not None and not (
            phase is Phase.GENERATION_ONLY and request.disaggregated_params.opaque_state
        ):
            reservation.drop()  # no pull to take it (a request the context phase ended, say)
            reservation = None
        start = self.rt.phases.pick(
            phase, request.disaggregated_params, prompt_ids, salt, adapter, reservation
        )
        worker_request = WorkerRequest(
            self.rt.core,
            request_id,
            prompt_ids,
            options,
            phase,
            priority,
            salt,
            request.disaggregated_params,
            adapter,
            return_first_gen_tokens,
        )
        worker_request.owner = owner
        worker_request.client = client
        worker_request.hand_off_to = hand_off_to
        worker_request.metrics.handoff_from_prefill = handoff_from_prefill
        if sink is not None:
            sink.bind(worker_request)
        if prefix_source is not None and self.rt.prefix_pulls is not None:
            self.rt.prefix_pulls.attach(worker_request, prefix_source)
        start(worker_request)
        return worker_request

    def _checked(self, request: llm_pb2.GenerateRequest, guide=None) -> tuple:
        """(sampling options, prompt ids) of a token-id request, or the error refusing them."""
        options = sampling_options(
            request.sampling_params, self.rt.eos_token_ids, self._encode_plain
        )
        if guide is not None:
            options = dataclasses.replace(options, guide=guide)
        prompt_ids = list(request.prompt.token_ids.ids)
        limits = self.rt.core.facts.limits
        limits.check_prompt(len(prompt_ids), prompt_ids)
        limits.check_options(options)
        return options, prompt_ids

    def _encode_plain(self, text: str) -> list[int]:
        return self.rt.front.tokenizer.encode(text, False)

    async def Abort(self, request, context):
        """The caller that started the request (its router) aborts it; so does another router
        that passes on a client's Abort it could not place, naming the client: then every leg
        of the request here made for that client stops (its n > 1 sequences `id/i`, a retried
        context phase `id#...`), or every one for an admin token holder."""
        admin_token = self.rt.config.admin_token
        if metadata_value(context, CLIENT_METADATA) is None:  # the router carrying it, or an admin
            worker_request = self.requests.get(request.request_id)
            if worker_request is None or not may_abort(context, worker_request.owner, admin_token):
                return llm_pb2.AbortResponse(aborted=False)
            worker_request.cancel()
            return llm_pb2.AbortResponse(aborted=True)
        # Passed on by another router, which shares the carrying router's identity on this plane:
        # the client it names decides, not the caller.
        named = self._named_client(context)
        admin = holds_admin_token(context, admin_token)
        if named is None and not admin:
            return llm_pb2.AbortResponse(aborted=False)
        rid = request.request_id
        legs = [
            r
            for key, r in self.requests.items()
            if (key == rid or key.startswith((f"{rid}/", f"{rid}#")))
            and (admin or r.requester == named)
        ]
        for leg in legs:
            leg.cancel()
        return llm_pb2.AbortResponse(aborted=bool(legs))

    def _named_client(self, context) -> str | None:
        """The client a router names on a call (CLIENT_METADATA), trusted as far as the caller is:
        from cluster peers (with a cluster token this worker refuses every call without it) or,
        in a cluster without one, from this host only."""
        named = metadata_value(context, CLIENT_METADATA)
        if named and (self.rt.config.cluster_token or is_loopback_peer(context.peer())):
            return named
        return None

    async def abort_all(self) -> int:
        self.rt.phases.drop_reservations()  # (the announced requests' handoffs meet the pause)
        requests = list(self.requests.values())
        for worker_request in requests:
            worker_request.cancel()
        return len(requests)

    async def Preprocess(self, request, context):
        params = request.sampling_params
        add_special = params.add_special_tokens if params.HasField("add_special_tokens") else True
        ids, text = await self.rt.front.encode_prompt(request.prompt, add_special)
        self.rt.core.facts.limits.check_prompt(len(ids), ids)
        out = types_pb2.PreprocessedInputs(
            prompt_token_ids=ids, disaggregated_params=request.disaggregated_params
        )
        if text is not None:
            out.prompt = text
        if request.HasField("sampling_params"):
            options = sampling_options(params, self.rt.eos_token_ids, self._encode_plain)
            out.sampling_params.CopyFrom(params)
            if not params.HasField("end_id") and options.eos_token_ids:
                out.sampling_params.end_id = options.eos_token_ids[0]
        return out

    async def Detokenize(self, request, context):
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return llm_pb2.DetokenizeResponse(
            text=self.rt.front.detokenize(list(request.token_ids), skip)
        )

    async def GetKvCacheCapacity(self, request, context):
        return await self.rt.kv_capacity()

    async def GetServerInfo(self, request, context):
        return await self.rt.server_info()

    async def GetTokenizer(self, request, context):
        return llm_pb2.TokenizerFiles(
            files=self.rt.tokenizer.files(),
            eos_token_ids=self.rt.eos_token_ids,
            **({"bos_token_id": self.rt.bos_token_id} if self.rt.bos_token_id is not None else {}),
        )

    async def Setup(self, request, context):
        timeout = request.timeout if request.HasField("timeout") else 60.0
        try:
            await asyncio.wait_for(self.rt.ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise unavailable(f"worker not ready after {timeout} s") from None
        return await self.rt.server_info()

    async def Shutdown(self, request, context):
        self.rt.request_stop()
        return llm_pb2.AdminResponse(detail=[f"{self.rt.worker_id}: stopping"])

    async def GetStats(self, request, context):
        timeout = request.timeout if request.HasField("timeout") else 2.0
        items = await self.rt.drain_stats(timeout)
        return llm_pb2.JsonList(items=[_json(s) for s in items])

    async def StreamStats(self, request, context):
        while True:
            for s in await self.rt.drain_stats(None):
                yield llm_pb2.JsonItem(item=_json(s))

    async def PauseGeneration(self, request, context):
        rt = self.rt
        mode = PauseMode.parse(request.mode)
        rt.pause_mode = mode
        if mode is PauseMode.KEEP:
            # Between two steps: once this returns no request moves until ResumeGeneration.
            num_held = await rt.core.call(HoldSteps(True))
            return llm_pb2.AdminResponse(
                detail=[f"{rt.worker_id}: paused (keep), holding {num_held} requests"]
            )
        num_aborted = await self.abort_all()
        await rt.drain()
        if rt.leases is not None:
            rt.leases.release_all(LeaseEnd.PAUSED)
        return llm_pb2.AdminResponse(
            detail=[f"{rt.worker_id}: paused, aborted {num_aborted} requests"]
        )

    async def ResumeGeneration(self, request, context):
        num_held = await self.rt.core.call(HoldSteps(False))
        self.rt.pause_mode = None
        return llm_pb2.AdminResponse(
            detail=[f"{self.rt.worker_id}: resumed, {num_held} requests continue"]
        )

    async def GetDataTransceiverState(self, request, context):
        return llm_pb2.GetDataTransceiverStateResponse(
            state=self.rt.transceiver_state(), worker_id=self.rt.worker_id
        )

    async def GetKvCacheEvents(self, request, context):
        timeout = request.timeout if request.HasField("timeout") else 2.0
        return llm_pb2.JsonList(items=[_json(e) for e in await self.rt.drain_kv_events(timeout)])

    async def StreamKvCacheEvents(self, request, context):
        while True:
            for e in await self.rt.drain_kv_events(None):
                yield llm_pb2.JsonItem(item=_json(e))

    async def Encode(self, request, context):
        # The seed's encode raises RuntimeError unless encode_only; the encode-only servicer overrides this.
        raise PreconditionError(
            f"Encode needs an encoder-only model (e.g. BertModel); this worker serves the "
            f"generative model {self.rt.config.engine.model_dir}"
        )

    async def CollectiveRpc(self, request, context):
        value = await admin.collective_rpc(
            self.rt,
            request.method,
            json_format.MessageToDict(request.args) or [],
            json_format.MessageToDict(request.kwargs) or {},
        )
        return llm_pb2.CollectiveRpcResponse(results=[value])

    async def Release(self, request, context):
        return llm_pb2.AdminResponse(detail=[await admin.release(self.rt, request.tags)])

    async def Resume(self, request, context):
        return llm_pb2.AdminResponse(detail=[await admin.resume(self.rt, request.tags)])

    async def UpdateWeights(self, request, context):
        return llm_pb2.AdminResponse(detail=[await admin.update_weights(self.rt, request)])


class WorkerInternalServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runtime: WorkerRuntime, llm: WorkerLLMServicer):
        self.rt = runtime
        self.llm = llm

    async def GetWorkerState(self, request, context):
        state = await self.rt.worker_state()
        state.num_sessions = self.llm.sessions.num_open
        return state

    async def ReleaseKv(self, request, context):
        keeper = self.rt.leases
        if keeper is None:
            return worker_pb2.ReleaseKvResponse(released=False)
        if request.ctx_request_id or not request.disagg_request_id:
            return worker_pb2.ReleaseKvResponse(
                released=keeper.release(request.ctx_request_id, LeaseEnd.RELEASED)
            )
        for worker_request in list(
            self.llm.requests.values()
        ):  # still running: it ends without a handoff
            if (
                worker_request.client is None
                and worker_request.disagg_in.disagg_request_id == request.disagg_request_id
            ):
                worker_request.cancel()
        return worker_pb2.ReleaseKvResponse(
            released=keeper.release_split(request.disagg_request_id, LeaseEnd.RELEASED)
        )

    async def HandOff(self, request_iterator, context):
        taken = 0
        try:
            async for request in request_iterator:
                if isinstance(request, MalformedRequest):
                    raise invalid(
                        f"HandOff: a message is not a valid HandOffRequest ({request.error})"
                    )
                taken += self.llm.awaited_handoffs.hand_off(
                    request.disagg_request_id, request.kv_params
                )
        except asyncio.CancelledError:
            # The server stops (a drain's end) or the prefill went away: the stream just ends
            # (the prefill's next handoff opens another, or goes by the router).
            pass
        return worker_pb2.HandOffResponse(num_taken=taken)

    async def ConfirmLease(self, request, context):
        keeper = self.rt.leases
        confirmed = keeper is not None and keeper.confirm(request.ctx_request_id, request.pulled)
        return worker_pb2.ConfirmLeaseResponse(confirmed=confirmed)

    async def LeasePrefix(self, request, context):
        leases = self.rt.prefix_leases
        if leases is None:
            raise PreconditionError(
                f"worker {self.rt.worker_id} does not lease its prefixes to peers: serve it with "
                f"--kv-prefix-pulls (a prefill or both worker)"
            )
        if self.rt.paused:  # (PauseGeneration ends every lease; none opens until it is over)
            return worker_pb2.LeasePrefixResponse()
        return await leases.lease(request, context.time_remaining, lambda: self.rt.paused)

    async def SubscribeKvBlocks(self, request, context):
        if self.rt.encode_only:
            raise PreconditionError("an encoder-only worker has no KV cache")
        if self.rt.kv_feed is None:
            raise unavailable("the worker is still loading its model")
        async for update in self.rt.kv_feed.subscribe():
            yield update

    async def Session(self, request_iterator, context):
        async for batch in self.llm.sessions.serve(caller_of(context), request_iterator, context):
            yield batch

    async def StopSequences(self, request, context):
        worker_request = self.llm.requests.get(request.request_id)
        if worker_request is None:
            return worker_pb2.StopSequencesResponse(found=False)
        for index in request.indices:
            await worker_request.stop(index)
        return worker_pb2.StopSequencesResponse(found=True)


def _priority_and_salt(request: llm_pb2.GenerateRequest) -> tuple[float, str | None]:
    """A request's scheduling priority (0.5 unset) and cache salt (None unset)."""
    priority = request.priority if request.HasField("priority") else 0.5
    return priority, request.cache_salt if request.HasField("cache_salt") else None
