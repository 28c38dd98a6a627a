"""Channels from one tandem process to another: TLS when the cluster has certificates, the
cluster token on every call and the admin token on admin calls (added by the stubs, so no
call site can forget them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc

from tandem.common.auth import (
    ADMIN_METHODS,
    ADMIN_TOKEN_KEY,
    PRIVILEGED_READS,
    bearer_metadata,
    cluster_metadata,
)
from tandem.common.server import CHANNEL_OPTIONS
from tandem.common.tls import TlsConfig


@dataclasses.dataclass(frozen=True)
class ClusterCredentials:
    """What a tandem process presents to the others: its TLS identity, the cluster token, and
    the admin token for the admin calls it relays."""

    tls: TlsConfig | None = None
    cluster_token: str | None = None
    admin_token: str | None = None

    def open(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to another tandem process (TLS when configured), with gRPC channel
        options on top of tandem's; stub() adds the tokens."""
        options = CHANNEL_OPTIONS + (self.tls.channel_options() if self.tls else []) + list(options)
        if self.tls is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, self.tls.channel_credentials(), options=options)

    def stub(self, stub_type, channel: grpc.aio.Channel):
        """stub_type(channel) whose every call carries the tokens it needs. Metadata is added per
        call rather than by a grpc.aio client interceptor: an intercepted streaming call drops
        a reply that arrived just before a cancel (a context phase's handoff, whose lease then
        waits for its expiry), where a plain call keeps it."""
        return _TokenStub(stub_type(channel), self)

    def open_sync(self, target: str) -> grpc.Channel:
        """A blocking channel with the tokens on every call (the launcher's readiness checks, tests)."""
        options = CHANNEL_OPTIONS + (self.tls.channel_options() if self.tls else [])
        if self.tls is None:
            channel = grpc.insecure_channel(target, options=options)
        else:
            channel = grpc.secure_channel(target, self.tls.channel_credentials(), options=options)
        if self.cluster_token or self.admin_token:
            channel = grpc.intercept_channel(channel, _SyncTokenInterceptor(self))
        return channel

    def metadata_for(self, method: str, metadata) -> tuple[tuple[str, str], ...]:
        """The call's metadata plus the tokens it needs (method: its name or full path)."""
        metadata = tuple(metadata or ())
        extra = cluster_metadata(self.cluster_token)
        name = method.rsplit("/", 1)[-1]
        if (name in ADMIN_METHODS or name in PRIVILEGED_READS) and all(
            k != ADMIN_TOKEN_KEY for k, _ in metadata
        ):
            extra += bearer_metadata(self.admin_token)
        return metadata + extra


class _TokenStub:
    def __init__(self, stub, credentials: ClusterCredentials):
        self._stub = stub
        self._credentials = credentials

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        credentials = self._credentials

        def call(
            *args, metadata=None, **kwargs
        ):  # a request, or none for a stream of requests (Session)
            return method(*args, metadata=credentials.metadata_for(name, metadata), **kwargs)

        setattr(self, name, call)  # built once per method
        return call


class _SyncTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, credentials: ClusterCredentials):
        self._credentials = credentials

    def _details(self, details):
        return details._replace(
            metadata=self._credentials.metadata_for(details.method, details.metadata)
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
