"""LLM and AsyncLLM: the seed's API over tandem's gRPC service."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import json_format, struct_pb2

from tandem.client.credentials import Pem, channel_credentials
from tandem.client.params import (
    ConversationParams,
    DisaggregatedParams,
    KvCacheRetentionConfig,
    LoRARequest,
    PreprocessedInputs,
    PromptAdapterRequest,
    SamplingParams,
    SchedulingParams,
    prompt_to_proto,
)
from tandem.client.results import RequestOutput
from tandem.client.tokenizer import RemoteTokenizer
from tandem.client.transport import Transport, iterate_stream
from tandem.v1 import llm_pb2


def _broadcast(value, n: int, name: str) -> list:
    """One value per prompt: a list is indexed by the prompt's position, as TensorRT-LLM does (a
    longer one keeps its first n entries; a shorter one cannot serve every prompt)."""
    if isinstance(value, (list, tuple)):
        if len(value) < n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value[:n])
    return [value] * n


def _to_dicts(msg: llm_pb2.JsonList) -> list[dict]:
    return [json.loads(item) for item in msg.items]


class LLM:
    """A tandem cluster (its router) seen as tensorrt_llm's LLM. `target` is host:port.

    auth_token: the admin token, for admin calls. TLS: `credentials` (grpc.ChannelCredentials), or
    root_certificates (the cluster's CA) and, where the router demands a client certificate,
    certificate_chain and private_key: PEM bytes or file paths. tls_server_name: the name to check
    in the server's certificate instead of the host in target. cluster_token: only for operators
    calling a worker directly (clients call the router)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        auth_token: str | None = None,
        credentials=None,
        root_certificates: Pem | None = None,
        certificate_chain: Pem | None = None,
        private_key: Pem | None = None,
        tls_server_name: str | None = None,
        cluster_token: str | None = None,
        default_timeout: float | None = None,
        **kwargs: Any,
    ):
        model = kwargs.pop("model", None)
        if model is not None:  # TensorRT-LLM's scripts write LLM(model=...): here, the router
            model = str(model)
            host, sep, port = model.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise TypeError(
                    f"model={model!r}: tandem's LLM takes the router's host:port; serve the "
                    f"checkpoint with `tandem up --model {model}` (or `tandem serve ... --model`) "
                    f"and pass its address"
                )
            target = model
        if kwargs:
            raise TypeError(
                f"unexpected arguments {sorted(kwargs)}: model and engine options are server-side "
                "(tandem serve ... flags or the Helm chart values)"
            )
        self.target = target
        self._transport = Transport(
            target,
            auth_token=auth_token,
            cluster_token=cluster_token,
            server_name=tls_server_name,
            credentials=channel_credentials(
                credentials, root_certificates, certificate_chain, private_key
            ),
        )
        self._timeout = default_timeout
        self._info: llm_pb2.ServerInfo | None = None
        self._tokenizer: RemoteTokenizer | None = None

    # -- helpers --
    def _call(self, method: str, request, timeout: float | None = None):
        return self._transport.run_sync(
            self._transport.unary(method, request, timeout or self._timeout)
        )

    async def _acall(self, method: str, request, timeout: float | None = None):
        return await self._transport.run_async(
            self._transport.unary(method, request, timeout or self._timeout)
        )

    def _server_info(self) -> llm_pb2.ServerInfo:
        if self._info is None:
            self._info = self._call("GetServerInfo", llm_pb2.GetServerInfoRequest())
        return self._info

    # -- generation --
    def generate_async(
        self,
        inputs,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        prompt_adapter_request: PromptAdapterRequest | None = None,
        streaming: bool = False,
        kv_cache_retention_config: KvCacheRetentionConfig | None = None,
        disaggregated_params: DisaggregatedParams | None = None,
        trace_headers: dict[str, str] | None = None,
        scheduling_params: SchedulingParams | None = None,
        conversation_params: ConversationParams | None = None,
        cache_salt: str | None = None,
        priority: float = 0.5,
        request_id: str | None = None,
    ) -> RequestOutput:
        """Submits one prompt; returns a RequestOutput to await, iterate (streaming) or abort()."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"The sampling_params must be type SamplingParams or None, but got {type(sampling_params)}"
            )
        request = llm_pb2.GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt_to_proto(inputs),
            streaming=streaming,
            priority=priority,
        )
        if sampling_params is not None:
            request.sampling_params.CopyFrom(sampling_params.to_proto())
        for field, value in (
            ("lora_request", lora_request),
            ("prompt_adapter_request", prompt_adapter_request),
            ("kv_cache_retention_config", kv_cache_retention_config),
            ("disaggregated_params", disaggregated_params),
            ("scheduling_params", scheduling_params),
            ("conversation_params", conversation_params),
        ):
            if value is not None:
                getattr(request, field).CopyFrom(value.to_proto())
        if trace_headers:
            request.trace_headers.update(trace_headers)
        if cache_salt is not None:
            request.cache_salt = cache_salt
        return RequestOutput(self._transport, request, streaming)

    def generate(
        self,
        inputs,
        sampling_params=None,
        use_tqdm: bool = True,
        lora_request=None,
        prompt_adapter_request=None,
        kv_cache_retention_config=None,
        disaggregated_params=None,
        scheduling_params=None,
        conversation_params=None,
        cache_salt=None,
        priority=0.5,
    ):
        """Runs one prompt or a batch concurrently and blocks until all are done."""
        single = isinstance(inputs, (str, dict, PreprocessedInputs)) or (
            isinstance(inputs, list) and inputs and all(isinstance(t, int) for t in inputs)
        )
        batch = [inputs] if single else list(inputs)
        n = len(batch)
        per = {
            name: _broadcast(value, n, name)
            for name, value in (
                ("sampling_params", sampling_params),
                ("lora_request", lora_request),
                ("prompt_adapter_request", prompt_adapter_request),
                ("kv_cache_retention_config", kv_cache_retention_config),
                ("disaggregated_params", disaggregated_params),
                ("scheduling_params", scheduling_params),
                ("conversation_params", conversation_params),
                ("cache_salt", cache_salt),
                ("priority", priority),
            )
        }
        futures = [
            self.generate_async(p, **{k: v[i] for k, v in per.items()}) for i, p in enumerate(batch)
        ]
        bar = None
        if use_tqdm:
            try:
                from tqdm import tqdm

                bar = tqdm(total=n, desc="Processed requests", dynamic_ncols=True)
            except ImportError:
                bar = None
        results = []
        try:
            for f in futures:
                results.append(f.result())
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return results[0] if single else results

    # -- model I/O helpers --
    def preprocess(
        self,
        inputs,
        sampling_params: SamplingParams | None = None,
        disaggregated_params: DisaggregatedParams | None = None,
    ) -> PreprocessedInputs:
        request = llm_pb2.PreprocessRequest(prompt=prompt_to_proto(inputs))
        if sampling_params is not None:
            request.sampling_params.CopyFrom(sampling_params.to_proto())
        if disaggregated_params is not None:
            request.disaggregated_params.CopyFrom(disaggregated_params.to_proto())
        out = self._call("Preprocess", request)
        return PreprocessedInputs(
            prompt_token_ids=list(out.prompt_token_ids),
            prompt=out.prompt if out.HasField("prompt") else None,
            sampling_params=out.sampling_params if out.HasField("sampling_params") else None,
            disaggregated_params=DisaggregatedParams.from_proto(out.disaggregated_params)
            if out.HasField("disaggregated_params")
            else None,
        )

    def encode(
        self,
        inputs,
        add_special_tokens: bool = True,
        batch_indexed_model_output: bool = True,
        copy_logits_to_host: bool = True,
        return_raw_logits: bool = False,
        **model_kwargs: Any,
    ):
        """Token embeddings and pooled (sentence) embeddings from an encoder-only model, as nested lists
        (the client has no torch). One EncoderOutput for one input, a list for a batch; the raw
        [batch, max_len, dim] output (padding rows zero) with return_raw_logits. model_kwargs:
        token_type_ids, one list per input. Outputs are always copied to the host and indexed
        by input, so batch_indexed_model_output and copy_logits_to_host change nothing here."""
        request, single = _encode_request(
            inputs, add_special_tokens, return_raw_logits, model_kwargs
        )
        from tandem.client.encode import decode_encode_response

        return decode_encode_response(self._call("Encode", request), single, return_raw_logits)

    # -- runtime introspection --
    def get_data_transceiver_state(self, worker_id: str = "") -> bytes:
        return self._call(
            "GetDataTransceiverState", llm_pb2.GetDataTransceiverStateRequest(worker_id=worker_id)
        ).state

    def get_kv_cache_capacity(self, worker_id: str = "") -> dict:
        cap = self._call(
            "GetKvCacheCapacity", llm_pb2.GetKvCacheCapacityRequest(worker_id=worker_id)
        )
        return {
            "maxNumBlocks": cap.max_num_blocks,
            "tokensPerBlock": cap.tokens_per_block,
            "maxNumTokens": cap.max_num_tokens,
            "numFreeBlocks": cap.num_free_blocks,
        }

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict]:
        request = llm_pb2.EventsRequest(timeout=timeout if timeout is not None else 2)
        return _to_dicts(self._call("GetKvCacheEvents", request, timeout=(timeout or 2) + 30))

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> AsyncIterator[dict]:
        """KV events as they happen; the iteration ends once none arrives for timeout seconds
        (None: never), as tensorrt_llm's IterationResult does."""
        return self._json_stream("StreamKvCacheEvents", timeout)

    def get_stats(self, timeout: float | None = 2) -> list[dict]:
        request = llm_pb2.EventsRequest(timeout=timeout if timeout is not None else 2)
        return _to_dicts(self._call("GetStats", request, timeout=(timeout or 2) + 30))

    def get_stats_async(self, timeout: float | None = 2) -> AsyncIterator[dict]:
        """Iteration stats as they happen; ends like get_kv_cache_events_async."""
        return self._json_stream("StreamStats", timeout)

    async def _json_stream(self, method: str, timeout: float | None):
        request = llm_pb2.EventsRequest(timeout=timeout if timeout is not None else 2)
        items = iterate_stream(self._transport, method, request)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(items.__anext__(), timeout)
                except (asyncio.TimeoutError, StopAsyncIteration):
                    return
                yield json.loads(item.item)
        finally:
            await items.aclose()

    # -- properties --
    @property
    def llm_id(self) -> str:
        return self._server_info().llm_id

    @property
    def disaggregated_params(self) -> dict:
        return json_format.MessageToDict(self._server_info().disaggregated_params)

    @property
    def startup_metrics(self) -> dict:
        try:
            return json_format.MessageToDict(self._server_info().startup_metrics)
        except Exception:  # noqa: BLE001 - the seed returns {} when metrics cannot be had
            return {}

    @property
    def tokenizer(self) -> RemoteTokenizer | None:
        if self._tokenizer is None:
            files = self._call("GetTokenizer", llm_pb2.GetTokenizerRequest())
            self._tokenizer = RemoteTokenizer(self, files)
        return self._tokenizer

    def shutdown(self) -> None:
        """Closes this client (tensorrt_llm's shutdown() ends what the LLM object owns; a tandem
        client owns its connection, not the cluster). Later calls raise RuntimeError."""
        self._transport.close()

    def close(self) -> None:
        """The same as shutdown()."""
        self.shutdown()

    def shutdown_cluster(self) -> list[str]:
        """Stops the cluster behind this endpoint: the router and every worker (admin: needs the
        admin token when one is configured). Returns what each process answered."""
        return list(self._call("Shutdown", llm_pb2.AdminRequest()).detail)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.shutdown()
        return False


class AsyncLLM(LLM):
    """tensorrt_llm.llmapi.AsyncLLM over gRPC: `llm = await AsyncLLM("host:port")`."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        placement_groups=None,
        placement_bundle_indices=None,
        per_worker_gpu_share=None,
        **kwargs: Any,
    ):
        if placement_groups or placement_bundle_indices or per_worker_gpu_share:
            raise ValueError(
                "placement_groups / placement_bundle_indices / per_worker_gpu_share are Ray placement "
                "options; tandem places workers with its Helm chart (deploy/helm)"
            )
        super().__init__(target, **kwargs)

    def __await__(self):
        return self.setup_async().__await__()

    def __enter__(self):
        raise RuntimeError("Please use 'async with AsyncLLM' instead")  # as tensorrt_llm's AsyncLLM

    async def __aenter__(self) -> AsyncLLM:
        return await self.setup_async()

    async def __aexit__(self, *exc) -> bool:
        self.shutdown()
        return False

    async def setup_async(self, timeout: float = 60.0) -> AsyncLLM:
        """Waits until the cluster is ready; returns self."""
        self._info = await self._acall(
            "Setup", llm_pb2.SetupRequest(timeout=timeout), timeout=timeout + 5
        )
        return self

    async def encode_async(
        self,
        inputs,
        add_special_tokens: bool = True,
        return_raw_logits: bool = False,
        **model_kwargs: Any,
    ):
        """encode without blocking the event loop; cancelling it cancels the Encode RPC."""
        request, single = _encode_request(
            inputs, add_special_tokens, return_raw_logits, model_kwargs
        )
        from tandem.client.encode import decode_encode_response

        out = await self._acall("Encode", request)
        return decode_encode_response(out, single, return_raw_logits)

    async def abort(self, request_id: str) -> bool:
        return (await self._acall("Abort", llm_pb2.AbortRequest(request_id=request_id))).aborted

    async def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        unique_reply_rank: int | None = None,
        target_ranks: int | list[int] | None = None,
    ) -> list[Any]:
        request = llm_pb2.CollectiveRpcRequest(method=method)
        request.args.extend(json.loads(json.dumps(list(args))))
        if kwargs:
            request.kwargs.update(json.loads(json.dumps(kwargs)))
        if unique_reply_rank is not None:
            request.unique_reply_rank = unique_reply_rank
        if target_ranks is not None:
            request.target_ranks.extend(
                [target_ranks] if isinstance(target_ranks, int) else target_ranks
            )
        reply = await self._acall("CollectiveRpc", request)
        return [
            json_format.MessageToDict(struct_pb2.Struct(fields={"v": v}))["v"]
            for v in reply.results
        ]

    async def pause_generation(self, mode: str = "abort") -> None:
        """Refuses new requests until resume_generation. mode (vLLM's): "abort" ends the requests
        in flight (finish_reason "cancelled", each with its tokens so far); "keep" freezes them
        with their KV, and they continue where they stopped after resume_generation, on the
        weights update_weights wrote meanwhile if it did (release needs mode "abort")."""
        await self._acall("PauseGeneration", llm_pb2.PauseGenerationRequest(mode=mode))

    async def resume_generation(self) -> None:
        await self._acall("ResumeGeneration", llm_pb2.AdminRequest())

    async def release(self, tags: list[str]) -> None:
        await self._acall("Release", llm_pb2.MemoryTagsRequest(tags=tags))

    async def resume(self, tags: list[str]) -> None:
        await self._acall("Resume", llm_pb2.MemoryTagsRequest(tags=tags))

    async def update_weights(
        self, weights: dict[str, str] | str | llm_pb2.NixlWeights | None
    ) -> None:
        """weights: device UUID -> IPC handles (TensorRT-LLM's format: base64 of a pickled list of
        (name, reduce_tensor(t)); tandem.rl.ipc_handles makes it), or tensors registered with
        NIXL (tandem.rl.NixlWeightSource(...).weights, for a trainer on another host), a bucket
        of the weights per call; None once they are all sent (finalize); or a checkpoint
        directory."""
        if weights is None:
            request = llm_pb2.UpdateWeightsRequest(finalize=True)
        elif isinstance(weights, str):
            request = llm_pb2.UpdateWeightsRequest(checkpoint_path=weights)
        elif isinstance(weights, llm_pb2.NixlWeights):
            request = llm_pb2.UpdateWeightsRequest(nixl_weights=weights)
        else:
            request = llm_pb2.UpdateWeightsRequest(ipc_handles=llm_pb2.IpcHandles(handles=weights))
        await self._acall("UpdateWeights", request)


def _encode_request(
    inputs, add_special_tokens: bool, return_raw_logits: bool, model_kwargs: dict
) -> tuple[llm_pb2.EncodeRequest, bool]:
    """(encode's EncodeRequest, whether inputs was one input rather than a batch)."""
    single = isinstance(inputs, (str, dict, PreprocessedInputs)) or (
        isinstance(inputs, (list, tuple)) and inputs and all(isinstance(t, int) for t in inputs)
    )
    batch = [inputs] if single else list(inputs)
    request = llm_pb2.EncodeRequest(
        inputs=[prompt_to_proto(p) for p in batch],
        add_special_tokens=add_special_tokens,
        return_raw_logits=return_raw_logits,
    )
    if model_kwargs:
        # Arrays and tensors (numpy, torch) travel as their nested lists.
        plain = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in model_kwargs.items()}
        request.model_kwargs.update(json.loads(json.dumps(plain)))
    return request, single
