"""Channels from one tandem process to another: TLS when the cluster has certificates, the
cluster token on every call and the admin token on admin calls (an interceptor, so no call
site can forget them)."""
from __future__ import annotations

import dataclasses

import grpc

from tandem.common.auth import ADMIN_METHODS, ADMIN_TOKEN_KEY, PRIVILEGED_READS, bearer_metadata, cluster_metadata
from tandem.common.server import CHANNEL_OPTIONS
from tandem.common.tls import TlsConfig


@dataclasses.dataclass(frozen=True)
class ClusterCredentials:
    """What a tandem process presents to the others: its TLS identity, the cluster token, and
    the admin token for the admin calls it relays."""
    tls: TlsConfig | None = None
    cluster_token: str | None = None
    admin_token: str | None = None

    def open(self, target: str) -> grpc.aio.Channel:
        """An asyncio channel to another tandem process."""
        options = CHANNEL_OPTIONS + (self.tls.channel_options() if self.tls else [])
        # grpc.aio files each interceptor under one call type only: one object per type.
        interceptors = ([_UnaryTokenInterceptor(self), _StreamTokenInterceptor(self)]
                        if self.cluster_token or self.admin_token else None)
        if self.tls is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(target, self.tls.channel_credentials(), options=options,
                                       interceptors=interceptors)

    def open_sync(self, target: str) -> grpc.Channel:
        """A blocking channel (the launcher's readiness checks, tests)."""
        options = CHANNEL_OPTIONS + (self.tls.channel_options() if self.tls else [])
        if self.tls is None:
            channel = grpc.insecure_channel(target, options=options)
        else:
            channel = grpc.secure_channel(target, self.tls.channel_credentials(), options=options)
        if self.cluster_token or self.admin_token:
            channel = grpc.intercept_channel(channel, _SyncTokenInterceptor(self))
        return channel

    def metadata_for(self, method: str, metadata) -> tuple[tuple[str, str], ...]:
        """The call's metadata plus the tokens it needs."""
        metadata = tuple(metadata or ())
        extra = cluster_metadata(self.cluster_token)
        name = method.rsplit("/", 1)[-1]
        if (name in ADMIN_METHODS or name in PRIVILEGED_READS) and all(k != ADMIN_TOKEN_KEY for k, _ in metadata):
            extra += bearer_metadata(self.admin_token)
        return metadata + extra


class _TokenDetails:
    def __init__(self, credentials: ClusterCredentials):
        self._credentials = credentials

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = grpc.aio.Metadata(*self._credentials.metadata_for(method, details.metadata))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryTokenInterceptor(_TokenDetails, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamTokenInterceptor(_TokenDetails, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, credentials: ClusterCredentials):
        self._credentials = credentials

    def _details(self, details):
        return details._replace(metadata=self._credentials.metadata_for(details.method, details.metadata))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)
