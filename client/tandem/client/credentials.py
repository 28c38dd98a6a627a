"""How the client authenticates a tandem endpoint and itself: TLS (the server's CA, and a client
certificate where the server demands one) and the tokens it sends as metadata."""

from __future__ import annotations

import os
from typing import Union

import grpc

Pem = Union[bytes, str, "os.PathLike[str]"]


def _pem(value: Pem | None, name: str) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(
            f"{name}: cannot read {os.fspath(value)!r}: {exc.strerror or exc}"
        ) from None


def channel_credentials(
    credentials: grpc.ChannelCredentials | None,
    root_certificates: Pem | None,
    certificate_chain: Pem | None,
    private_key: Pem | None,
) -> grpc.ChannelCredentials | None:
    """credentials as given, or TLS built from PEM bytes/paths; None: plaintext."""
    pems = (root_certificates, certificate_chain, private_key)
    if credentials is not None:
        if any(p is not None for p in pems):
            raise ValueError(
                "pass credentials or root_certificates/certificate_chain/private_key, not both"
            )
        return credentials
    if all(p is None for p in pems):
        return None
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("a client certificate needs both certificate_chain and private_key")
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(root_certificates, "root_certificates"),
        private_key=_pem(private_key, "private_key"),
        certificate_chain=_pem(certificate_chain, "certificate_chain"),
    )


def call_metadata(auth_token: str | None, cluster_token: str | None) -> tuple[tuple[str, str], ...]:
    """auth_token: the admin token (`authorization: Bearer`). cluster_token: only for operators
    calling a worker directly (workers serve the cluster's internal plane)."""
    metadata: tuple[tuple[str, str], ...] = ()
    if auth_token:
        metadata += (("authorization", f"Bearer {auth_token}"),)
    if cluster_token:
        metadata += (("tandem-cluster-token", cluster_token),)
    return metadata
