"""Runs the router process."""

from __future__ import annotations

import asyncio
import logging

from tandem.common.auth import AccessPolicy
from tandem.common.channels import ClusterCredentials
from tandem.common.gc_pauses import freeze_startup_heap, unfreeze_heap, watch_pauses
from tandem.common.server import GrpcServer
from tandem.router.config import RouterConfig
from tandem.router.discovery import (
    DnsDiscovery,
    hosts_file_resolver,
    parse_dns_targets,
    resolve_dns,
)
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import ConditionalDisagg
from tandem.router.servicer import RouterServicer
from tandem.router.workers import WorkerPool
from tandem.v1 import llm_pb2, llm_pb2_grpc

log = logging.getLogger("tandem.router")


async def _track_readiness(server: GrpcServer, pool: WorkerPool, servicer: RouterServicer) -> None:
    """The router is SERVING while it can route: it has the model's tokenizer, and at least one
    worker that can prefill and one that can decode are ready."""
    serving = None
    frozen = False
    while True:
        ready = pool.ready_workers
        if ready and servicer.front is None:
            try:
                await servicer.load_tokenizer(ready[0])
            except Exception as exc:  # noqa: BLE001 - tried again next round
                log.warning("loading the tokenizer from %s failed: %s", ready[0].address, exc)
        now = (
            servicer.front is not None
            and any(w.can_prefill for w in ready)
            and any(w.can_decode for w in ready)
        )
        if now and not frozen:
            freeze_startup_heap("router")
            frozen = True
        if now != serving:
            await server.set_serving(now)
            serving = now
        await asyncio.sleep(pool.health_interval_s / 2)


async def serve_router(config: RouterConfig) -> None:
    watch_pauses()
    metrics = RouterMetrics()
    server = GrpcServer(
        config.host,
        config.port,
        [llm_pb2.DESCRIPTOR.services_by_name["AsyncLLM"].full_name],
        drain_seconds=config.drain_seconds,
        metrics=metrics,
        keepalive_seconds=config.keepalive_seconds,
        policy=AccessPolicy(admin_token=config.admin_token, cluster_token=config.cluster_token),
        tls=config.tls,
        health_port=config.health_port,
        max_request_bytes=config.limits.max_request_bytes,
    )
    credentials = ClusterCredentials(config.tls, config.cluster_token, config.admin_token)
    pool = WorkerPool(
        config.workers,
        config.health_interval_s,
        credentials,
        health_timeout_s=config.health_timeout_s,
        routing=config.policies,
        kv_overlap_weight=config.kv_overlap_weight,
        disagg=ConditionalDisagg(
            config.disagg_min_uncached_tokens, config.disagg_prefill_queue_tokens
        ),
        prefix_cost=config.prefix_pull_cost,
        announce_decode=config.announce_decode,
        direct_handoff=config.direct_handoff,
    )
    servicer = RouterServicer(pool, server.address, server.request_stop, config, metrics)
    llm_pb2_grpc.add_AsyncLLMServicer_to_server(servicer, server.server)
    metrics_url = metrics.serve_http(config.host, config.metrics_port)
    await server.start()
    server.install_signal_handlers()
    if metrics_url:
        log.info("metrics on %s", metrics_url)
    pool.start()
    tasks = [asyncio.create_task(_track_readiness(server, pool, servicer))]
    if config.workers_dns:
        resolver = hosts_file_resolver(config.hosts_file) if config.hosts_file else resolve_dns
        discovery = DnsDiscovery(
            parse_dns_targets(config.workers_dns),
            pool.set_addresses,
            config.dns_interval_s,
            resolver,
        )
        tasks.append(asyncio.create_task(discovery.run()))
    log.info(
        "router on %s, workers %s", server.address, ", ".join(config.workers + config.workers_dns)
    )
    try:
        await server.wait_for_stop()
    finally:
        for task in tasks:
            task.cancel()
        await pool.close()
        metrics.close()
        unfreeze_heap()
