"""The AsyncLLM and Worker services of one worker process."""
from __future__ import annotations

import asyncio
import json
import uuid

from google.protobuf import json_format

import grpc

from tandem.common.errors import PreconditionError, RpcError, unavailable
from tandem.decode.importer import parse_handoff
from tandem.engine.sequence import Phase
from tandem.worker import admin
from tandem.worker.convert import PHASES, check_unsupported, sampling_options
from tandem.worker.generate import GenerateCall
from tandem.worker.runtime import WorkerRuntime
from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc


def _json(d: dict) -> str:
    """JSON text keeps ints exact (63-bit block hashes), which google.protobuf.Struct would not."""
    return json.dumps(d, separators=(",", ":"))


class WorkerLLMServicer(llm_pb2_grpc.AsyncLLMServicer):
    def __init__(self, runtime: WorkerRuntime):
        self.rt = runtime
        self.calls: dict[str, GenerateCall] = {}

    def _prompt(self, prompt: types_pb2.Prompt, add_special_tokens: bool) -> tuple[list[int], str | None]:
        kind = prompt.WhichOneof("kind")
        if kind == "text":
            if not prompt.text:
                raise ValueError("the prompt is empty: give text or token ids")
            return self.rt.tokenizer.encode(prompt.text, add_special_tokens), prompt.text
        if kind == "token_ids":
            return list(prompt.token_ids.ids), None
        if kind == "preprocessed":
            p = prompt.preprocessed
            return list(p.prompt_token_ids), (p.prompt if p.HasField("prompt") else None)
        raise ValueError("the prompt is empty: set prompt.text, prompt.token_ids or prompt.preprocessed")

    async def Generate(self, request: llm_pb2.GenerateRequest, context):
        if self.rt.paused:
            raise unavailable("generation is paused (PauseGeneration); call ResumeGeneration first")
        released = self.rt.engine.released_tags
        if released:
            raise unavailable(f"memory {released} is released (Release); call Resume({released}) first")
        check_unsupported(request)
        params = request.sampling_params
        options = sampling_options(params, self.rt.eos_token_ids)
        add_special = params.add_special_tokens if params.HasField("add_special_tokens") else True
        prompt_ids, prompt_text = self._prompt(request.prompt, add_special)
        if params.HasField("truncate_prompt_tokens"):
            if params.truncate_prompt_tokens <= 0:
                raise ValueError(f"truncate_prompt_tokens must be > 0, got {params.truncate_prompt_tokens}")
            prompt_ids = prompt_ids[-params.truncate_prompt_tokens:]
        self.rt.engine.check_prompt(len(prompt_ids), prompt_ids)
        self.rt.engine.check_options(options)
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.calls:
            raise ValueError(f"request id {request_id!r} is already running; ids must be unique")
        phase = PHASES[request.disaggregated_params.request_type]
        salt = request.cache_salt if request.HasField("cache_salt") else None
        handoff = self._check_phase(phase, request.disaggregated_params, prompt_ids, salt)
        call = GenerateCall(self.rt.engine_loop, self.rt.tokenizer, request_id, prompt_ids, prompt_text, options, phase,
                            request.priority if request.HasField("priority") else 0.5,
                            request.cache_salt if request.HasField("cache_salt") else None,
                            request.streaming, request.disaggregated_params, self.rt.handoff_keeper)
        if handoff is not None:
            call.start_import(self.rt.importer, handoff)
        elif phase is Phase.GENERATION_ONLY:
            call.resume()
        else:
            call.submit()
        self.calls[request_id] = call
        try:
            async for msg in call.outputs():
                yield msg
        finally:
            self.calls.pop(request_id, None)

    def _check_phase(self, phase: Phase, params: types_pb2.DisaggregatedParams, prompt_ids: list[int],
                     cache_salt: str | None):
        """Refuses a phase this worker cannot run; for GENERATION_ONLY returns the parsed handoff."""
        if phase is Phase.CONTEXT_ONLY and self.rt.handoff_keeper is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"this {self.rt.config.role} worker cannot run context_only requests; send them to a prefill worker")
        if phase is Phase.GENERATION_ONLY and not params.opaque_state:
            if not params.first_gen_tokens:
                raise ValueError("generation_only needs disaggregated_params.first_gen_tokens (and the context "
                                 "phase's opaque_state, or none to recompute the KV here)")
            return None  # a resumed request (migration): any worker recomputes its KV
        if phase is Phase.GENERATION_ONLY:
            if self.rt.importer is None:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this {self.rt.config.role} worker cannot run generation_only requests; send them to a decode worker")
            if not params.first_gen_tokens:
                raise ValueError("generation_only needs disaggregated_params.first_gen_tokens from the context phase")
            return parse_handoff(params.opaque_state, self.rt.kv_layout, self.rt.kv_layout_hash, prompt_ids,
                                 cache_salt, self.rt.signing_key)
        return None

    async def Abort(self, request, context):
        call = self.calls.get(request.request_id)
        if call is None:
            return llm_pb2.AbortResponse(aborted=False)
        call.cancel()
        return llm_pb2.AbortResponse(aborted=True)

    async def abort_all(self) -> int:
        calls = list(self.calls.values())
        for call in calls:
            call.cancel()
        return len(calls)

    async def Preprocess(self, request, context):
        params = request.sampling_params
        add_special = params.add_special_tokens if params.HasField("add_special_tokens") else True
        ids, text = self._prompt(request.prompt, add_special)
        self.rt.engine.check_prompt(len(ids), ids)
        out = types_pb2.PreprocessedInputs(prompt_token_ids=ids, disaggregated_params=request.disaggregated_params)
        if text is not None:
            out.prompt = text
        if request.HasField("sampling_params"):
            options = sampling_options(params, self.rt.eos_token_ids)
            out.sampling_params.CopyFrom(params)
            if not params.HasField("end_id") and options.eos_token_ids:
                out.sampling_params.end_id = options.eos_token_ids[0]
        return out

    async def Detokenize(self, request, context):
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        vocab = self.rt.tokenizer.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of vocabulary [0, {vocab}): {bad[:8]}")
        return llm_pb2.DetokenizeResponse(text=self.rt.tokenizer.decode(list(request.token_ids), skip))

    async def GetKvCacheCapacity(self, request, context):
        return self.rt.kv_capacity()

    async def GetServerInfo(self, request, context):
        return self.rt.server_info()

    async def GetTokenizer(self, request, context):
        return llm_pb2.TokenizerFiles(files=self.rt.tokenizer.files(), eos_token_ids=self.rt.eos_token_ids,
                                      **({"bos_token_id": self.rt.bos_token_id} if self.rt.bos_token_id is not None else {}))

    async def Setup(self, request, context):
        timeout = request.timeout if request.HasField("timeout") else 60.0
        try:
            await asyncio.wait_for(self.rt.ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise unavailable(f"worker not ready after {timeout} s") from None
        return self.rt.server_info()

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
        self.rt.paused = True
        num_aborted = await self.abort_all()
        await self.rt.drain()
        await self.rt.engine_loop.call(lambda e: e.release_all_leases())
        return llm_pb2.AdminResponse(detail=[f"{self.rt.worker_id}: paused, aborted {num_aborted} requests"])

    async def ResumeGeneration(self, request, context):
        self.rt.paused = False
        return llm_pb2.AdminResponse(detail=[f"{self.rt.worker_id}: resumed"])

    async def GetDataTransceiverState(self, request, context):
        return llm_pb2.GetDataTransceiverStateResponse(state=self.rt.transceiver_state(), worker_id=self.rt.worker_id)

    async def GetKvCacheEvents(self, request, context):
        timeout = request.timeout if request.HasField("timeout") else 2.0
        return llm_pb2.JsonList(items=[_json(e) for e in await self.rt.drain_kv_events(timeout)])

    async def StreamKvCacheEvents(self, request, context):
        while True:
            for e in await self.rt.drain_kv_events(None):
                yield llm_pb2.JsonItem(item=_json(e))

    async def Encode(self, request, context):
        # The seed's encode raises RuntimeError unless encode_only; the encode-only servicer overrides this.
        raise PreconditionError(f"Encode needs an encoder-only model (e.g. BertModel); this worker serves the "
                                f"generative model {self.rt.config.engine.model_dir}")

    async def CollectiveRpc(self, request, context):
        value = await admin.collective_rpc(self.rt, request.method, json_format.MessageToDict(request.args) or [],
                                           json_format.MessageToDict(request.kwargs) or {})
        return llm_pb2.CollectiveRpcResponse(results=[value])

    async def Release(self, request, context):
        return llm_pb2.AdminResponse(detail=[await admin.release(self.rt, request.tags)])

    async def Resume(self, request, context):
        return llm_pb2.AdminResponse(detail=[await admin.resume(self.rt, request.tags)])

    async def UpdateWeights(self, request, context):
        return llm_pb2.AdminResponse(detail=[await admin.update_weights(self.rt, request)])


class WorkerInternalServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runtime: WorkerRuntime):
        self.rt = runtime

    async def GetWorkerState(self, request, context):
        return await self.rt.worker_state()

    async def ReleaseKv(self, request, context):
        keeper = self.rt.handoff_keeper
        released = keeper is not None and await keeper.release(request.ctx_request_id)
        return worker_pb2.ReleaseKvResponse(released=released)
