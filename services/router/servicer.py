"""tandem.v1.AsyncLLM on the router: routes generation, fans admin calls out to workers."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import grpc
from google.protobuf import struct_pb2

from tandem.common import tracing
from tandem.common.auth import ADMIN_METHODS
from tandem.common.callers import (
    CLIENT_METADATA,
    TLS_IDENTITY_PREFIX,
    caller_of,
    holds_admin_token,
    may_abort,
)
from tandem.common.errors import PreconditionError, RetryLaterError, RpcError, unavailable
from tandem.common.logs import bind
from tandem.common.pause import PauseMode
from tandem.common.roles import Role
from tandem.common.streams import closing, merge
from tandem.router.config import RouterConfig
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import Placement
from tandem.router.relay import Relay
from tandem.router.workers import WorkerHandle, WorkerPool
from tandem.text.front import ClientStream, TextFront
from tandem.text.tokenizer import Tokenizer
from tandem.v1 import llm_pb2, llm_pb2_grpc, worker_pb2

log = logging.getLogger("tandem.router")

# Seconds a client refused for --max-in-flight is told to wait before it retries.
RETRY_AFTER_BUSY_S = 0.5


def _deadline(context) -> float | None:
    """The client's deadline on the monotonic clock (None: it set none): the worker calls made for
    the request carry what is left of it."""
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


class RouterServicer(llm_pb2_grpc.AsyncLLMServicer):
    def __init__(
        self,
        pool: WorkerPool,
        address: str,
        request_stop,
        config: RouterConfig,
        metrics: RouterMetrics,
    ):
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.address = address
        self.request_stop = request_stop
        self.llm_id = uuid.uuid4().hex
        self.started_at = time.time()
        # request id -> its relay (for Abort).
        self.routes: dict[str, Relay] = {}
        # The pause in force (pause_generation through this router), None while generating.
        self.pause_mode: PauseMode | None = None
        # The served model's tokenizer, fetched from a worker once one is ready (load_tokenizer).
        self.tokenizer_files: llm_pb2.TokenizerFiles | None = None
        self.front: TextFront | None = None
        metrics.watch(self)

    async def load_tokenizer(self, worker: WorkerHandle) -> None:
        """Text is the router's job: it tokenizes prompts and detokenizes what the workers stream."""
        files = await worker.llm.GetTokenizer(llm_pb2.GetTokenizerRequest(), timeout=30)
        info = await worker.llm.GetServerInfo(llm_pb2.GetServerInfoRequest(), timeout=30)
        tokenizer = await asyncio.to_thread(Tokenizer, dict(files.files), worker.address)
        # The model_name label of the request metrics: the served checkpoint's directory name.
        self.metrics.model_name = Path(info.model).name
        self.tokenizer_files = files
        self.front = TextFront(tokenizer, self.config.limits, info.max_model_len)

    def _text(self) -> TextFront:
        if self.front is None:
            raise unavailable(
                "the router has no tokenizer yet (no worker has been ready); retry shortly"
            )
        return self.front

    async def Generate(self, request: llm_pb2.GenerateRequest, context):
        arrival_time = time.time()
        if len(self.routes) >= self.config.max_in_flight:
            # Refused before any work (tokenizing included): the caller retries after a moment,
            # and the router's memory stays bounded by max_in_flight requests.
            self.metrics.refused_busy()
            raise RetryLaterError(
                f"the router serves {len(self.routes)} requests (--max-in-flight "
                f"{self.config.max_in_flight})",
                RETRY_AFTER_BUSY_S,
            )
        tracker = self.metrics.requests.track()
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        elif request.request_id in self.routes:
            raise ValueError(
                f"request id {request.request_id!r} is already running; ids must be unique"
            )
        bind(request_id=request.request_id)
        text_request = await self._text().prepare(request)
        engine_request = text_request.engine_request
        relay = self.routes[request.request_id] = Relay(
            self.pool,
            request.request_id,
            self.metrics,
            caller_of(context),
            self.config.stream_progress_timeout_s,
            Placement.of(engine_request),
            _deadline(context),
            arrival_time,
        )
        ended = "closed by the client"  # the stream was let go before its end
        # The workers' spans are this one's children: its traceparent goes in the request they get.
        traced = tracing.span(
            "tandem.router.generate",
            engine_request.trace_headers,
            **{"tandem.request_id": request.request_id},
        )
        try:
            with traced:
                # TextFront.respond's loop, run in the call's handler: between the relay's
                # generator and the client's stream a token passes no other layer.
                client = ClientStream(text_request, tracker, self.config.stream_interval)
                try:
                    async with closing(relay.stream(engine_request)) as messages:
                        async for msg in messages:
                            out, stops = client.feed(msg)
                            for index, handoff in stops:  # a stop string ended a sequence
                                await relay.stop(index, handoff)
                            out = client.send(out)
                            if out is not None:
                                yield out
                            if client.done:
                                break
                    last = client.finish()
                    if last is not None:
                        yield last
                except Exception:
                    held = client.held()
                    if held is not None:  # what arrived before the failure is the client's
                        yield held
                    raise
            ended = "finished"
        except asyncio.CancelledError:
            ended = "cancelled"
            raise
        except Exception as exc:
            ended = f"failed ({type(exc).__name__}: {exc})"
            raise
        finally:
            self.routes.pop(request.request_id, None)
            # One line a request (its fields bound: request id, the workers that served it).
            log.info(
                "request %s %s after %.1f ms",
                request.request_id,
                ended,
                (time.time() - arrival_time) * 1e3,
            )

    async def Abort(self, request, context):
        relay = self.routes.get(request.request_id)
        if relay is None:
            return llm_pb2.AbortResponse(aborted=await self._abort_elsewhere(request, context))
        # Another client's request is none of this caller's business: it is answered as unknown.
        if not may_abort(context, relay.client, self.config.admin_token):
            return llm_pb2.AbortResponse(aborted=False)
        await relay.abort()
        return llm_pb2.AbortResponse(aborted=True)

    async def _abort_elsewhere(self, request, context) -> bool:
        """An id this router does not carry may run through another router of the cluster (a
        client spread over several): the workers hold its legs and the client each was made
        for, so the Abort goes to every ready worker naming this caller (or with the admin
        token, when the caller holds it); the router carrying the request then ends its stream
        as aborted."""
        caller = caller_of(context)
        admin = holds_admin_token(context, self.config.admin_token)
        if not (admin or caller.startswith(TLS_IDENTITY_PREFIX)):
            # Without a certificate a client is its connection here, and a peer address as this
            # router sees it may be another client's as another router sees it (NAT, proxies).
            return False
        metadata = [(CLIENT_METADATA, caller)]
        if admin:
            metadata += self.pool.admin_metadata
        replies = await asyncio.gather(
            *(w.llm.Abort(request, metadata=metadata, timeout=5) for w in self.pool.ready_workers),
            return_exceptions=True,
        )
        for worker, reply in zip(self.pool.ready_workers, replies):
            if isinstance(reply, BaseException):
                log.info("Abort(%s) passed on to %s: %s", request.request_id, worker.address, reply)
        return any(isinstance(r, llm_pb2.AbortResponse) and r.aborted for r in replies)

    async def _any(self, method: str, request):
        return await getattr(self.pool.pick(None).llm, method)(request)

    async def Preprocess(self, request, context):
        """Tokenized here; a worker checks the ids against its model and fills in end_id."""
        params = request.sampling_params
        add_special = params.add_special_tokens if params.HasField("add_special_tokens") else True
        ids, text = await self._text().encode_prompt(request.prompt, add_special)
        checked = llm_pb2.PreprocessRequest()
        checked.CopyFrom(request)
        checked.prompt.preprocessed.prompt_token_ids[:] = ids
        if text is not None:
            checked.prompt.preprocessed.prompt = text
        return await self._any("Preprocess", checked)

    async def Detokenize(self, request, context):
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return llm_pb2.DetokenizeResponse(
            text=self._text().detokenize(list(request.token_ids), skip)
        )

    async def GetTokenizer(self, request, context):
        self._text()
        return self.tokenizer_files

    async def Encode(self, request, context):
        return await self._any("Encode", request)

    async def GetDataTransceiverState(self, request, context):
        if request.worker_id:
            worker = self.pool.by_address(request.worker_id)
        else:  # a cluster without prefill workers has no transceiver: its workers answer empty bytes
            has_prefill = any(w.role is Role.PREFILL for w in self.pool.ready_workers)
            worker = self.pool.pick(Role.PREFILL if has_prefill else None)
        return await worker.llm.GetDataTransceiverState(request)

    async def GetKvCacheCapacity(self, request, context):
        if request.worker_id:
            return await self.pool.by_address(request.worker_id).llm.GetKvCacheCapacity(request)
        workers = [w for w in self.pool.ready_workers if w.can_decode]
        if not workers:
            raise unavailable("no ready decode-capable worker")
        caps = await asyncio.gather(*(w.llm.GetKvCacheCapacity(request) for w in workers))
        return llm_pb2.KvCacheCapacity(
            max_num_blocks=sum(c.max_num_blocks for c in caps),
            tokens_per_block=caps[0].tokens_per_block,
            max_num_tokens=sum(c.max_num_tokens for c in caps),
            num_free_blocks=sum(c.num_free_blocks for c in caps),
        )

    async def _fan_out(
        self, method: str, request, workers: list[WorkerHandle] | None = None
    ) -> list:
        workers = self.pool.ready_workers if workers is None else workers
        if not workers:
            raise unavailable("no ready worker")
        metadata = self.pool.admin_metadata if method in ADMIN_METHODS else ()
        return await asyncio.gather(
            *(getattr(w.llm, method)(request, metadata=metadata) for w in workers)
        )

    async def _admin(self, method: str, request) -> llm_pb2.AdminResponse:
        replies = await self._fan_out(method, request)
        return llm_pb2.AdminResponse(detail=[d for r in replies for d in r.detail])

    async def PauseGeneration(self, request, context):
        mode = PauseMode.parse(request.mode)  # refused here, before any worker pauses
        # A worker that refuses leaves the others generating again (what abort mode aborted on
        # them stays aborted: the request is refused as a whole, so send it again).
        resume = llm_pb2.AdminRequest()
        reply = await self._all_or_nothing(
            "PauseGeneration", request, lambda w: ("ResumeGeneration", resume)
        )
        self.pause_mode = mode
        return reply

    async def ResumeGeneration(self, request, context):
        reply = await self._admin("ResumeGeneration", request)
        self.pause_mode = None
        return reply

    async def Release(self, request, context):
        if self.routes:  # a request between its prefill and decode workers would lose its KV
            kept = " (paused in mode 'keep', they hold their KV: pause in mode 'abort')"
            raise PreconditionError(
                f"{len(self.routes)} requests are in flight; call pause_generation before release"
                + (kept if self.pause_mode is PauseMode.KEEP else "")
            )
        undo = llm_pb2.MemoryTagsRequest(tags=request.tags)
        return await self._all_or_nothing("Release", request, lambda w: ("Resume", undo))

    async def Resume(self, request, context):
        return await self._admin("Resume", request)

    async def UpdateWeights(self, request, context):
        # Paused in keep mode the requests in flight continue on the new weights (vLLM's in-flight
        # update); a handoff between its prefill and its decode meanwhile is computed again at
        # the decode (it carries the old weights_id).
        if self.routes and self.pause_mode is not PauseMode.KEEP:
            raise PreconditionError(
                f"{len(self.routes)} requests are in flight; call pause_generation before update_weights"
            )
        if request.WhichOneof("source") != "checkpoint_path":
            # A bucket by IPC handles (or the finalize) is written in place and cannot be taken
            # back; each worker checks all of it before it writes any, and sending it again
            # writes the same values: a worker that refused is named in the error.
            return await self._all_or_nothing("UpdateWeights", request, lambda w: None)
        states = {
            w.address: await w.internal.GetWorkerState(worker_pb2.WorkerStateRequest(), timeout=10)
            for w in self.pool.ready_workers
        }
        return await self._all_or_nothing(
            "UpdateWeights",
            request,
            lambda w: (
                "UpdateWeights",
                llm_pb2.UpdateWeightsRequest(checkpoint_path=states[w.address].weights_source),
            ),
        )

    async def _all_or_nothing(self, method: str, request, undo) -> llm_pb2.AdminResponse:
        """Runs an admin call on every worker; if any refuses, undoes it on those that applied it,
        so the cluster never ends up half-changed."""
        workers = self.pool.ready_workers
        if not workers:
            raise unavailable("no ready worker")
        metadata = self.pool.admin_metadata
        replies = await asyncio.gather(
            *(getattr(w.llm, method)(request, metadata=metadata) for w in workers),
            return_exceptions=True,
        )
        failures = [r for r in replies if isinstance(r, BaseException)]
        if failures:
            kept = []
            for w, reply in zip(workers, replies):
                if isinstance(reply, BaseException):
                    continue
                undone = undo(w)
                if undone is None:
                    kept.append(w.address)
                else:
                    await getattr(w.llm, undone[0])(undone[1], metadata=metadata)
            first = failures[0]
            if kept and isinstance(first, grpc.aio.AioRpcError):
                refused = [w.address for w, r in zip(workers, replies) if r in failures]
                raise RpcError(
                    first.code(),
                    f"{first.details()} (refused by {refused}; applied on {kept}: send it again)",
                )
            raise first
        return llm_pb2.AdminResponse(detail=[d for r in replies for d in r.detail])

    async def CollectiveRpc(self, request, context):
        """Ranks are worker indices in the router's --workers order."""
        workers = self.pool.workers
        ranks = list(request.target_ranks) or list(range(len(workers)))
        bad = [r for r in ranks if not 0 <= r < len(workers)]
        if bad:
            raise ValueError(
                f"target_ranks {bad} out of range: there are {len(workers)} workers (ranks 0..{len(workers) - 1})"
            )
        if request.HasField("unique_reply_rank") and request.unique_reply_rank not in ranks:
            raise ValueError(
                f"unique_reply_rank {request.unique_reply_rank} is not among the target ranks {ranks}"
            )
        targets = [workers[r] for r in ranks]
        not_ready = [w.address for w in targets if not w.ready]
        if not_ready:
            raise unavailable(f"workers not ready: {not_ready}")
        replies = await self._fan_out("CollectiveRpc", request, targets)
        results = [r.results[0] for r in replies]
        if request.HasField("unique_reply_rank"):
            results = [results[ranks.index(request.unique_reply_rank)]]
        return llm_pb2.CollectiveRpcResponse(results=results)

    async def GetStats(self, request, context):
        replies = await self._fan_out("GetStats", request)
        return llm_pb2.JsonList(items=[i for r in replies for i in r.items])

    async def GetKvCacheEvents(self, request, context):
        replies = await self._fan_out("GetKvCacheEvents", request)
        return llm_pb2.JsonList(items=[i for r in replies for i in r.items])

    async def StreamStats(self, request, context):
        async for item in self._merge_streams("StreamStats", request):
            yield item

    async def StreamKvCacheEvents(self, request, context):
        async for item in self._merge_streams("StreamKvCacheEvents", request):
            yield item

    async def _merge_streams(self, method: str, request):
        calls = [getattr(w.llm, method)(request) for w in self.pool.ready_workers]
        try:
            async for _, item in merge(calls):
                yield item
        finally:
            for call in calls:
                call.cancel()

    async def Setup(self, request, context):
        timeout = request.timeout if request.HasField("timeout") else 60.0
        if not await self.pool.wait_ready(timeout):
            raise unavailable(
                f"workers not ready after {timeout} s: "
                + ", ".join(w.address for w in self.pool.workers if not w.ready)
            )
        if self.front is None:
            await self.load_tokenizer(self.pool.ready_workers[0])
        return await self.GetServerInfo(llm_pb2.GetServerInfoRequest(), context)

    async def Shutdown(self, request, context):
        try:
            reply = await self._admin("Shutdown", request)
        except RpcError:
            reply = llm_pb2.AdminResponse()
        self.request_stop()
        return llm_pb2.AdminResponse(
            detail=list(reply.detail) + [f"router {self.address}: stopping"]
        )

    async def GetServerInfo(self, request, context):
        info = llm_pb2.ServerInfo(llm_id=self.llm_id, role="router")
        for w in self.pool.workers:
            info.workers.add(
                worker_id=w.address, role=w.role.label, ready=w.ready, lora_adapters=w.lora_adapters
            )
        ready = self.pool.ready_workers
        if ready:
            worker_info = await ready[0].llm.GetServerInfo(request)
            info.model = worker_info.model
            info.max_model_len = worker_info.max_model_len
            info.encode_only = worker_info.encode_only
            info.embedding_size = worker_info.embedding_size
            info.collective_rpc_methods.extend(worker_info.collective_rpc_methods)
            info.startup_metrics.update(
                {f"{ready[0].address}.{k}": v for k, v in worker_info.startup_metrics.items()}
            )
        roles = {w.role for w in self.pool.workers}
        if ready and "deterministic" in worker_info.disaggregated_params:
            # Every worker of a split runs the same mode (the KV layout hash refuses a mix).
            info.disaggregated_params["deterministic"] = worker_info.disaggregated_params[
                "deterministic"
            ]
        info.disaggregated_params.update(
            {
                "mode": "disaggregated"
                if Role.PREFILL in roles and Role.DECODE in roles
                else "aggregated",
                "prefill_workers": struct_pb2.ListValue(
                    values=[
                        struct_pb2.Value(string_value=w.address)
                        for w in self.pool.workers
                        if w.can_prefill
                    ]
                ),
                "decode_workers": struct_pb2.ListValue(
                    values=[
                        struct_pb2.Value(string_value=w.address)
                        for w in self.pool.workers
                        if w.can_decode
                    ]
                ),
            }
        )
        info.startup_metrics.update({"router_uptime_s": time.time() - self.started_at})
        return info
