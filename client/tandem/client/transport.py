"""The client's gRPC side: one background event loop thread owns the grpc.aio channel,
so the sync API (LLM) and the async API (AsyncLLM) share one implementation and an
AsyncLLM can be used from any event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tandem.client.credentials import call_metadata
from tandem.client.errors import from_rpc_error
from tandem.v1 import llm_pb2_grpc

_MAX_MESSAGE_BYTES = 256 << 20
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    # A restarted router is back within a second or so: reconnect after at most a second, not
    # after gRPC's default back-off, which grows to two minutes while the router is away.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # One connection per client object, not shared with other clients in this process: the
    # server ties a request to the connection that started it (only it may abort the request).
    ("grpc.use_local_subchannel_pool", 1),
]


# Every address a target resolves to (a router Service's DNS name, or a list of routers) gets a
# connection, and calls go round-robin over the ready ones: one router going away leaves the others.
# A call refused UNAVAILABLE before any answer (a router that just went away) is tried again on
# another: gRPC retries only calls nothing was committed for, so no token is sent twice.
_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{"service": "tandem.v1.AsyncLLM"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)


def channel_target(target: str) -> str:
    """The gRPC target of a client's `target`: host:port (every address DNS gives for host), a
    gRPC target URI as it is (dns:///..., ipv4:..., unix:...), or several routers' IP:port
    separated by commas (all IPv4 or all IPv6: gRPC's static address lists)."""
    if "," not in target:
        return target
    families = set()
    for address in target.split(","):
        host, sep, port = address.strip().rpartition(":")
        try:
            families.add(ipaddress.ip_address(host.strip("[]")).version)
        except ValueError:
            families.add(None)
        if not sep or not port.isdigit():
            families.add(None)
    if families == {4}:
        return "ipv4:" + ",".join(a.strip() for a in target.split(","))
    if families == {6}:
        return "ipv6:" + ",".join(a.strip() for a in target.split(","))
    raise ValueError(
        f"target {target!r}: a list of routers is IP:port entries of one family, comma-separated "
        "(for names, give one DNS name that resolves to every router, e.g. a headless Service)"
    )


class Transport:
    def __init__(
        self,
        target: str,
        auth_token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        cluster_token: str | None = None,
        server_name: str | None = None,
    ):
        # A bad list of routers fails here, before a thread starts.
        self._grpc_target = channel_target(target)
        self.target = target
        self.metadata = call_metadata(auth_token, cluster_token)
        self._server_name = server_name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tandem-client", daemon=True
        )
        self._thread.start()
        self._credentials = credentials
        self._closed = False
        self.stub: llm_pb2_grpc.AsyncLLMStub = self.run_sync(self._open())

    async def _open(self) -> llm_pb2_grpc.AsyncLLMStub:
        options = [*_CHANNEL_OPTIONS, ("grpc.service_config", _SERVICE_CONFIG)]
        if self._server_name:
            options.append(("grpc.ssl_target_name_override", self._server_name))
        if self._credentials is not None:
            self.channel = grpc.aio.secure_channel(
                self._grpc_target, self._credentials, options=options
            )
        else:
            self.channel = grpc.aio.insecure_channel(self._grpc_target, options=options)
        return llm_pb2_grpc.AsyncLLMStub(self.channel)

    def submit(self, coro: Awaitable) -> concurrent.futures.Future:
        if self._closed:
            coro.close()
            # tensorrt_llm's generate_async says the same after shutdown().
            raise RuntimeError(
                f"LLM is shutting down: this client of {self.target} was closed (shutdown() or close())"
            )
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run_sync(self, coro: Awaitable, timeout: float | None = None) -> Any:
        if _in_loop_thread(self._loop):
            raise RuntimeError("a blocking tandem call was made from the client's own loop thread")
        return self.submit(coro).result(timeout)

    async def run_async(self, coro: Awaitable) -> Any:
        return await asyncio.wrap_future(self.submit(coro))

    async def unary(self, method: str, request, timeout: float | None = None):
        """Calls a unary RPC; a coroutine to run on the transport loop (the call must be made there).
        A refused call raises RequestError (tandem.client.errors) with its status."""
        try:
            return await getattr(self.stub, method)(
                request, metadata=self.metadata, timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    def stream_to(
        self,
        method: str,
        request,
        on_item: Callable[[Any], None],
        on_done: Callable[[BaseException | None], None],
    ):
        """Starts a server-streaming call on the transport loop; returns a cancel function."""
        call_holder: dict = {}

        async def pump():
            call = getattr(self.stub, method)(request, metadata=self.metadata)
            call_holder["call"] = call
            try:
                async for item in call:
                    on_item(item)
            except grpc.aio.AioRpcError as exc:
                on_done(from_rpc_error(exc))
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                on_done(exc)
                return
            on_done(None)

        future = self.submit(pump())

        def cancel():
            def _cancel():
                call = call_holder.get("call")
                if call is not None:
                    call.cancel()

            self._loop.call_soon_threadsafe(_cancel)
            future.cancel()

        return cancel

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self.channel.close(), self._loop).result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


async def iterate_stream(transport: Transport, method: str, request) -> AsyncIterator:
    """Async iterator, usable on any loop, over a server-streaming call run on the transport loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    cancel = transport.stream_to(
        method,
        request,
        on_item=lambda item: loop.call_soon_threadsafe(queue.put_nowait, item),
        on_done=lambda exc: loop.call_soon_threadsafe(queue.put_nowait, (done, exc)),
    )
    try:
        while True:
            item = await queue.get()
            if isinstance(item, tuple) and len(item) == 2 and item[0] is done:
                if item[1] is not None and not isinstance(item[1], asyncio.CancelledError):
                    raise item[1]
                return
            yield item
    finally:
        cancel()
