"""Runs one worker process (prefill, decode or both)."""

from __future__ import annotations

import asyncio
import logging

from tandem.common.auth import AccessPolicy
from tandem.common.gc_pauses import freeze_startup_heap, unfreeze_heap, watch_pauses
from tandem.common.interceptors import Readiness
from tandem.common.server import GrpcServer
from tandem.engine.bert import is_encoder_only
from tandem.v1 import llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc
from tandem.worker.config import WorkerConfig
from tandem.worker.encode_servicer import EncodeOnlyLLMServicer
from tandem.worker.metrics import WorkerMetrics
from tandem.worker.runtime import WorkerRuntime
from tandem.worker.servicer import WorkerInternalServicer, WorkerLLMServicer

log = logging.getLogger("tandem.worker")

SERVICE_NAMES = [
    llm_pb2.DESCRIPTOR.services_by_name["AsyncLLM"].full_name,
    worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
]


async def serve_worker(config: WorkerConfig) -> None:
    watch_pauses()
    ready = asyncio.Event()
    metrics = WorkerMetrics(config.role, config.engine.model_dir)
    policy = AccessPolicy(
        admin_token=config.admin_token, cluster_token=config.cluster_token, internal=True
    )
    server = GrpcServer(
        config.host,
        config.port,
        SERVICE_NAMES,
        drain_seconds=config.drain_seconds,
        policy=policy,
        keepalive_seconds=config.keepalive_seconds,
        tls=config.tls,
        health_port=config.health_port,
        readiness=Readiness(ready.is_set, exempt=frozenset({"Setup", "Shutdown"})),
        metrics=metrics,
        max_request_bytes=config.limits.max_request_bytes,
    )
    runtime = WorkerRuntime(config, server, ready, metrics)
    server.add_drain_check(runtime.is_drained)
    # An encoder-only checkpoint gets a servicer whose generative RPCs refuse (the runtime loads it likewise).
    servicer_type = (
        EncodeOnlyLLMServicer if is_encoder_only(config.engine.model_dir) else WorkerLLMServicer
    )
    llm_servicer = servicer_type(runtime)
    llm_pb2_grpc.add_AsyncLLMServicer_to_server(llm_servicer, server.server)
    worker_pb2_grpc.add_WorkerServicer_to_server(
        WorkerInternalServicer(runtime, llm_servicer), server.server
    )
    metrics_url = metrics.serve_http(config.host, config.metrics_port)
    await server.start()
    server.install_signal_handlers()
    if metrics_url:
        log.info("metrics on %s", metrics_url)
    try:
        await runtime.load()
        freeze_startup_heap(f"{config.role.label} worker")
        await server.set_serving(True)
        log.info(
            "%s worker ready on %s (model %s)",
            config.role.label,
            server.address,
            config.engine.model_dir,
        )
        await server.wait_for_stop()
    finally:
        await llm_servicer.abort_all()
        await runtime.close()
        await server.close()  # stopped already after a drain; still serving if the load failed
        metrics.close()
        unfreeze_heap()
    if runtime.failure:
        raise SystemExit(f"tandem worker: {runtime.failure}")
