"""The security flags of `tandem serve`, `tandem up` and `tandem generate`: TLS files, the
cluster token, the plaintext health port (README, "Security")."""

from __future__ import annotations

import argparse
import os

from tandem.common.tls import TlsConfig

CLIENT_AUTH = ("required", "none")


def add_tls_flags(parser: argparse.ArgumentParser, *, public_face: bool) -> None:
    """public_face: the process serves clients (the router, tandem up), which may go without certificates."""
    parser.add_argument(
        "--tls-cert", help="PEM certificate this process serves with and presents to its peers"
    )
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-ca",
        help="PEM CA bundle: peers' certificates must chain to it; servers then demand "
        "client certificates signed by it (mTLS)",
    )
    parser.add_argument(
        "--tls-server-name",
        help="name to check in peers' certificates instead of their host "
        "(one certificate for a fleet)",
    )
    if public_face:
        parser.add_argument(
            "--tls-client-auth",
            choices=CLIENT_AUTH,
            default="required",
            help="with --tls-ca: whether the router's public face demands client certificates "
            "(none: clients need only trust the CA; the workers still demand them)",
        )


def add_server_security_flags(
    parser: argparse.ArgumentParser, *, public_face: bool = False
) -> None:
    """`tandem serve <role>`: TLS, the cluster token, the health port."""
    parser.add_argument(
        "--cluster-token",
        default=os.environ.get("TANDEM_CLUSTER_TOKEN"),
        help="secret every process of the cluster shares: it authenticates calls between them and "
        "signs KV handoffs; prefill and decode workers need one (default: $TANDEM_CLUSTER_TOKEN)",
    )
    add_tls_flags(parser, public_face=public_face)
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve grpc.health.v1 alone, in plaintext, on this port (probes that speak no TLS)",
    )


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """The TlsConfig the flags describe; None without --tls-cert/--tls-key."""
    if not (args.tls_cert or args.tls_key):
        if args.tls_ca:
            raise ValueError(
                "--tls-ca needs --tls-cert and --tls-key too (this process's own certificate)"
            )
        return None
    return TlsConfig(
        cert_file=args.tls_cert,
        key_file=args.tls_key,
        ca_file=args.tls_ca,
        require_client_cert=getattr(args, "tls_client_auth", "required") == "required",
        server_name=args.tls_server_name,
    )


def add_client_tls_flags(parser: argparse.ArgumentParser) -> None:
    """`tandem generate`: how to reach a TLS router."""
    parser.add_argument(
        "--tls-ca", help="PEM CA that signed the router's certificate (turns TLS on)"
    )
    parser.add_argument("--tls-cert", help="PEM client certificate, for a router that demands one")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name", help="name to check in the router's certificate instead of its host"
    )


def client_tls_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments for the client TLS flags."""
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return {}
    return {
        "root_certificates": args.tls_ca,
        "certificate_chain": args.tls_cert,
        "private_key": args.tls_key,
        "tls_server_name": args.tls_server_name,
    }
