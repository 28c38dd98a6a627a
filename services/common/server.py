"""The grpc.aio server every tandem process runs: health, reflection, error
mapping, and a graceful stop on SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.common.auth import AdminAuthInterceptor
from tandem.common.interceptors import ErrorMappingInterceptor, ReadinessInterceptor

log = logging.getLogger("tandem.server")

# Tokens of a long prompt, embeddings, tokenizer files: well above gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Peers in a cluster come and go (start-up order, restarts): reconnect within a second, not
    # after gRPC's default back-off of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class GrpcServer:
    def __init__(self, host: str, port: int, service_names: list[str], grace_seconds: float = 5.0,
                 admin_token: str | None = None, readiness: ReadinessInterceptor | None = None,
                 max_request_bytes: int = MAX_MESSAGE_BYTES):
        self.service_names = list(service_names)
        self.grace_seconds = grace_seconds
        interceptors = ([AdminAuthInterceptor(admin_token)] if admin_token else []) + \
            ([readiness] if readiness else []) + [ErrorMappingInterceptor()]
        # A request over max_request_bytes is refused (RESOURCE_EXHAUSTED) before it is parsed.
        options = dict(CHANNEL_OPTIONS, **{"grpc.max_receive_message_length": max_request_bytes})
        self.server = grpc.aio.server(interceptors=interceptors, options=list(options.items()))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"
        self._stop = asyncio.Event()

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(False)
        log.info("listening on %s", self.address)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [""] + self.service_names:
            await self.health.set(name, status)

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def wait_for_stop(self) -> None:
        await self._stop.wait()
        log.info("stopping %s", self.address)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_seconds)
