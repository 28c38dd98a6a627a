"""TLS for every tandem server and channel: one certificate and key per process, and the CA
that signs the cluster's certificates.

A process given a CA verifies its peers against it both ways: its server demands a client
certificate signed by the CA (mTLS inside the cluster) and its channels present their own
certificate. The router's public face may drop the client-certificate demand
(require_client_cert=False) so that clients need only trust the CA.
"""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    # PEM certificate chain this process serves with and presents to its peers.
    cert_file: str
    # PEM private key of cert_file.
    key_file: str
    # PEM CA bundle peers' certificates must chain to; None: the system roots verify servers, and
    # servers ask for no client certificate.
    ca_file: str | None = None
    # With a CA: a server refuses clients without a CA-signed certificate (mTLS). The router's
    # public face may turn this off (--tls-client-auth none).
    require_client_cert: bool = True
    # The name checked in servers' certificates instead of the host dialled (one certificate for
    # a fleet whose addresses vary, e.g. pod DNS names).
    server_name: str | None = None

    def __post_init__(self):
        if not self.cert_file or not self.key_file:
            raise ValueError("TLS needs both --tls-cert and --tls-key (PEM files)")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        _read(self.cert_file, "--tls-cert")
        _read(self.key_file, "--tls-key")
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ValueError(
                f"--tls-cert {self.cert_file!r} and --tls-key {self.key_file!r} are not a PEM "
                f"certificate and its private key: {exc.reason or exc}"
            ) from None
        if self.ca_file is not None:
            _read(self.ca_file, "--tls-ca")
            try:
                context.load_verify_locations(self.ca_file)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"--tls-ca {self.ca_file!r} is not a PEM CA bundle: {exc.reason or exc}"
                ) from None

    @property
    def is_mutual(self) -> bool:
        """Whether this process's server demands client certificates."""
        return self.ca_file is not None and self.require_client_cert

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key_file, "--tls-key"), _read(self.cert_file, "--tls-cert"))],
            root_certificates=_read(self.ca_file, "--tls-ca") if self.ca_file else None,
            require_client_auth=self.is_mutual,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verifies the server against the CA and presents this process's certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "--tls-ca") if self.ca_file else None,
            private_key=_read(self.key_file, "--tls-key"),
            certificate_chain=_read(self.cert_file, "--tls-cert"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def argv(self) -> list[str]:
        """The `tandem serve` flags that give a child process this configuration (tandem up)."""
        argv = ["--tls-cert", self.cert_file, "--tls-key", self.key_file]
        if self.ca_file:
            argv += ["--tls-ca", self.ca_file]
        if self.server_name:
            argv += ["--tls-server-name", self.server_name]
        return argv
