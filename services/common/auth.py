"""Who may call what: the admin token, the cluster token, and protected mode.

Two planes (DESIGN.md, "Trust zones"). The public face is the router's AsyncLLM service. The
internal plane is everything between tandem processes; a worker serves only it. Two credentials:

- the cluster token (`--cluster-token`, TANDEM_CLUSTER_TOKEN), which every tandem process of one
  cluster holds and sends on every call to another (metadata `tandem-cluster-token`). A worker
  given one refuses every tandem RPC without it: Worker RPCs, KV events, stats, transceiver
  state (NIXL memory keys) and its AsyncLLM surface. It also keys the HMAC of KV handoffs.
- the admin token (`--admin-token`, TANDEM_ADMIN_TOKEN), which operators send as
  `authorization: Bearer <token>` on admin calls (ADMIN_METHODS) and, on the router, on the
  reads that expose other tenants' data or memory keys (PRIVILEGED_READS).

With no admin token the cluster is in protected mode (as Redis is): admin calls and privileged
reads are accepted only from loopback peers, or from cluster peers (holding the cluster token)
that relay a call they accepted. Health and reflection are always open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress

import grpc

from tandem.common.interceptors import wrap_handler

ADMIN_METHODS = frozenset(
    {
        "PauseGeneration",
        "ResumeGeneration",
        "Release",
        "Resume",
        "UpdateWeights",
        "CollectiveRpc",
        "Shutdown",
    }
)
# Reads that expose what a client must not see: KV events carry token ids (other tenants'
# prompts), transceiver state carries NIXL agent metadata (the keys to the KV pool's memory).
PRIVILEGED_READS = frozenset({"GetKvCacheEvents", "StreamKvCacheEvents", "GetDataTransceiverState"})

CLUSTER_TOKEN_KEY = "tandem-cluster-token"
ADMIN_TOKEN_KEY = "authorization"
MIN_CLUSTER_TOKEN_CHARS = 16


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((ADMIN_TOKEN_KEY, f"Bearer {token}"),) if token else ()


def cluster_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((CLUSTER_TOKEN_KEY, token),) if token else ()


def check_token(token: str | None, flag: str, min_chars: int = 1) -> None:
    """Tokens travel as gRPC metadata: printable ASCII without spaces."""
    if token is None:
        return
    if len(token) < min_chars:
        raise ValueError(
            f"{flag} must be at least {min_chars} characters; generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    if not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"{flag} must be printable ASCII without spaces (it is sent as gRPC metadata)"
        )


def derive_key(secret: str, purpose: str) -> bytes:
    """A key for one purpose from a shared secret, so the secret itself never keys two things."""
    return hmac.new(secret.encode(), f"tandem.v1 {purpose}".encode(), hashlib.sha256).digest()


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string (ipv4:127.0.0.1:5000, ipv6:[::1]:5000, unix:/path) is this host."""
    kind, _, rest = peer.partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]").split("%")[0]
    else:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """ALLOW, a denial (code and message), or allowed only from a loopback peer."""

    code: grpc.StatusCode | None = None
    message: str = ""
    loopback_only: bool = False


ALLOW = Verdict()


@dataclasses.dataclass(frozen=True)
class AccessPolicy:
    admin_token: str | None = None
    cluster_token: str | None = None
    # A worker: every tandem RPC it serves belongs to the internal plane.
    internal: bool = False

    def decide(self, full_method: str, metadata: dict) -> Verdict:
        if not full_method.startswith("/tandem."):
            return ALLOW  # grpc.health.v1 (probes), reflection
        name = full_method.rsplit("/", 1)[-1]
        cluster_peer = False
        if self.cluster_token:
            given = metadata.get(CLUSTER_TOKEN_KEY)
            if given is not None:
                if not hmac.compare_digest(given.encode(), self.cluster_token.encode()):
                    return Verdict(
                        grpc.StatusCode.PERMISSION_DENIED, f"{name}: the cluster token is wrong"
                    )
                cluster_peer = True
            elif self.internal:
                return Verdict(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{name} on a worker is a cluster-internal call: only tandem processes holding the "
                    f"cluster token may make it ('{CLUSTER_TOKEN_KEY}' metadata); clients call the router",
                )
        if name not in ADMIN_METHODS and (name not in PRIVILEGED_READS or cluster_peer):
            return ALLOW
        if self.admin_token:
            given = metadata.get(ADMIN_TOKEN_KEY)
            if given is None:
                return Verdict(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{name} is an admin call: send 'authorization: Bearer <token>' metadata",
                )
            if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
                return Verdict(
                    grpc.StatusCode.PERMISSION_DENIED, f"{name}: the admin token is wrong"
                )
            return ALLOW
        if cluster_peer:  # a tandem process relays an admin call it accepted itself
            return ALLOW
        return Verdict(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{name} is an admin call and this cluster has no admin token, so it is accepted only from "
            f"this host (protected mode): start every process with --admin-token (or "
            f"TANDEM_ADMIN_TOKEN) and send 'authorization: Bearer <token>'",
            loopback_only=True,
        )


def guarded(handler: grpc.RpcMethodHandler, verdict: Verdict) -> grpc.RpcMethodHandler:
    """The handler behind a check of the caller's address (loopback_only) or refused outright:
    what a call the policy did not ALLOW gets before any servicer code runs (server_calls.py)."""

    @contextlib.asynccontextmanager
    async def check(context):
        if not (verdict.loopback_only and is_loopback_peer(context.peer())):
            await context.abort(verdict.code, verdict.message)
        yield

    return wrap_handler(handler, check)
