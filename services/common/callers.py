"""Who is calling: what ties a request to the client that started it (Abort), and what a
prefill counts a client's unclaimed KV handoffs against.

A caller is its authenticated TLS identity when the connection has one, else its connection
(the peer address and port: one client channel is one connection). The router calls workers
on behalf of its clients and names the client in CLIENT_METADATA; a worker trusts that name
only as far as it trusts its callers (the cluster credential of the internal plane).
"""

from __future__ import annotations

import hmac

import grpc

# The client a router forwards a request for (set by the router on its calls to workers).
CLIENT_METADATA = "tandem-client"
# Set by the router on the context_only half of a request it splits itself: its handoff goes
# straight to a decode worker, so it is not a client's unclaimed lease.
SPLIT_METADATA = "tandem-split"


# How caller_of names a caller with an authenticated TLS identity (its certificate's names).
TLS_IDENTITY_PREFIX = "tls:"


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """The identity of the connection a call came on."""
    identities = context.peer_identities()
    if identities:
        # Printable ASCII: the router passes it on as a metadata value.
        return TLS_IDENTITY_PREFIX + ",".join(
            i.decode("ascii", errors="replace").replace("\ufffd", "?") for i in identities
        )
    return context.peer()


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return None


def client_of(context: grpc.aio.ServicerContext) -> str:
    """The client a call is made for: the one the router names, or the caller itself."""
    return metadata_value(context, CLIENT_METADATA) or caller_of(context)


def holds_admin_token(context: grpc.aio.ServicerContext, admin_token: str | None) -> bool:
    if not admin_token:
        return False
    given = metadata_value(context, "authorization") or ""
    return hmac.compare_digest(given.encode(), f"Bearer {admin_token}".encode())


def may_abort(context: grpc.aio.ServicerContext, owner: str, admin_token: str | None) -> bool:
    """A request is aborted by the caller that started it, or by an admin token holder."""
    return caller_of(context) == owner or holds_admin_token(context, admin_token)
