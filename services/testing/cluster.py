"""A local tandem cluster as child processes: what `tandem up` and the tests start.

Every cluster has a cluster token (given, from TANDEM_CLUSTER_TOKEN, or a fresh random one),
which its children get through their environment; with a TlsConfig every process serves TLS
(mTLS when it has a CA) and presents the certificate to the others.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.channels import ClusterCredentials
from tandem.common.tls import TlsConfig

# Address -> the running cluster that serves it (channel_to).
_RUNNING: dict[str, LocalCluster] = {}


# Ports are picked below the kernel's ephemeral range (net.ipv4.ip_local_port_range), from
# which it hands out the local ports of outgoing connections: a port picked from that range can
# be taken by some connection before the service binds it (a server then fails with EADDRINUSE).
_LOWEST_PICKED_PORT = 10000
_port_rng = random.Random()  # seeded from the OS: concurrent test runs pick apart
# Ports this process handed out. A cluster picks all its ports before any service binds one, and
# a port free now is free for the next pick too: without this, two services of one cluster got
# the same port now and then (one exited with EADDRINUSE; seen in CI, 2026-12-04).
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range where there is room for one."""
    high = _ephemeral_low()
    for _ in range(100 if high - _LOWEST_PICKED_PORT >= 1000 else 0):
        port = _port_rng.randrange(_LOWEST_PICKED_PORT, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


@dataclass
class Service:
    name: str
    role: str
    address: str
    argv: list[str]
    log_path: Path
    # host:port of its Prometheus /metrics (None: started without one).
    metrics_address: str | None = None
    process: subprocess.Popen | None = None

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


@dataclass
class LocalCluster:
    """Router + workers on loopback. roles: worker roles in start order, e.g. ["both"] or ["prefill", "decode"]."""

    roles: list[str]
    engine_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    router_port: int = 0
    log_dir: Path | None = None
    env: dict[str, str] | None = None
    worker_args: dict[str, list[str]] = field(default_factory=dict)
    # Every process serves Prometheus metrics on a port of its own: the router's is this one
    # (0: a free one), each worker's a free one. False: none.
    metrics: bool = True
    router_metrics_port: int = 0
    # The cluster's shared secret; None: TANDEM_CLUSTER_TOKEN (from env or os.environ) or a fresh
    # random one; "": none at all (an open cluster: aggregated workers only).
    cluster_token: str | None = None
    # TLS for every process; the router's public face demands client certificates when the
    # config has a CA and require_client_cert (the router alone honours require_client_cert=False).
    tls: TlsConfig | None = None
    # Flags for the router (after the cluster's own, so they win).
    router_args: list[str] = field(default_factory=list)
    # Discovery by (simulated) DNS: the router resolves one name per role from this file
    # (--workers-dns with --hosts-file, write_hosts_file) instead of a --workers list.
    hosts_file: Path | None = None
    services: list[Service] = field(default_factory=list)

    def __post_init__(self):
        if self.cluster_token is None:
            self.cluster_token = (
                (self.env or {}).get("TANDEM_CLUSTER_TOKEN")
                or os.environ.get("TANDEM_CLUSTER_TOKEN")
                or secrets.token_urlsafe(32)
            )

    @property
    def credentials(self) -> ClusterCredentials:
        """What a tandem process of this cluster presents (the tests' privileged channels use it)."""
        admin = (self.env or {}).get("TANDEM_ADMIN_TOKEN") or os.environ.get("TANDEM_ADMIN_TOKEN")
        return ClusterCredentials(self.tls, self.cluster_token or None, admin)

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel to one of the services, presenting the cluster's credentials."""
        return self.credentials.open_sync(address)

    def client_tls_kwargs(self) -> dict:
        """LLM(...) keyword arguments that reach this cluster's router over its TLS."""
        tls = self.tls
        if tls is None:
            return {}
        kwargs = {"root_certificates": tls.ca_file, "tls_server_name": tls.server_name}
        if tls.is_mutual:
            kwargs.update(certificate_chain=tls.cert_file, private_key=tls.key_file)
        return kwargs

    def client_tls_flags(self) -> dict:
        """The `tandem generate` flags of client_tls_kwargs."""
        names = {
            "root_certificates": "tls-ca",
            "certificate_chain": "tls-cert",
            "private_key": "tls-key",
            "tls_server_name": "tls-server-name",
        }
        return {names[k]: v for k, v in self.client_tls_kwargs().items() if v}

    def worker_client_kwargs(self) -> dict:
        """LLM(...) keyword arguments for calling a worker directly, as an operator holding the
        cluster's credentials (workers serve only the internal plane)."""
        tls = self.tls
        kwargs = {"cluster_token": self.cluster_token or None}
        if tls is not None:
            kwargs.update(
                root_certificates=tls.ca_file,
                certificate_chain=tls.cert_file,
                private_key=tls.key_file,
                tls_server_name=tls.server_name,
            )
        return kwargs

    @property
    def router(self) -> Service:
        return next(s for s in self.services if s.role == "router")

    @property
    def workers(self) -> list[Service]:
        return [s for s in self.services if s.role != "router"]

    @property
    def address(self) -> str:
        return self.router.address

    def start(self, timeout: float = 120.0) -> LocalCluster:
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="tandem-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for role in self.roles:
            self.services.append(self._worker_service(role))
        if self.hosts_file is not None:
            self.write_hosts_file()
        self.services.append(self._router_service("router", self.router_port, self.router_args))
        for s in self.services:
            self._spawn(s, "w")
        for s in self.services:
            _RUNNING[s.address] = self
        try:
            self.wait_serving([s.address for s in self.services], timeout)
            self.wait_router_setup(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _worker_service(self, role: str) -> Service:
        name = f"{role}-{sum(s.role == role for s in self.services) + 1}"
        port = free_port(self.host)
        metrics_port = free_port(self.host) if self.metrics else 0
        argv = [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "serve",
            role,
            "--host",
            self.host,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            *(self.tls.argv() if self.tls else []),
            *self.engine_args,
            *self.worker_args.get(name, []),
        ]
        return Service(
            name,
            role,
            f"{self.host}:{port}",
            argv,
            self.log_dir / f"{name}.log",
            self._metrics_address(metrics_port),
        )

    def _router_service(
        self, name: str, port: int, args: list[str], host: str | None = None
    ) -> Service:
        host = host or self.host
        port = port or free_port(host)
        fixed_metrics_port = self.router_metrics_port if name == "router" else 0
        metrics_port = (fixed_metrics_port or free_port(host)) if self.metrics else 0
        tls_argv = self.tls.argv() if self.tls else []
        if self.tls is not None and not self.tls.require_client_cert:
            tls_argv = tls_argv + ["--tls-client-auth", "none"]
        if self.hosts_file is not None:
            roles = sorted({s.role for s in self.workers})
            discovery = [
                "--workers-dns",
                ",".join(f"{r}={self.dns_name(r)}:1" for r in roles),
                "--hosts-file",
                str(self.hosts_file),
                "--dns-interval",
                "0.3",
            ]
        else:
            discovery = ["--workers", ",".join(s.address for s in self.workers)]
        return Service(
            name,
            "router",
            f"{host}:{port}",
            [
                sys.executable,
                "-m",
                "tandem.cli.main",
                "serve",
                "router",
                "--host",
                host,
                "--port",
                str(port),
                *discovery,
                "--health-interval",
                "0.2",
                "--metrics-port",
                str(metrics_port),
                *tls_argv,
                *args,
            ],
            self.log_dir / f"{name}.log",
            f"{host}:{metrics_port}" if metrics_port else None,
        )

    @staticmethod
    def dns_name(role: str) -> str:
        """The name a role's workers are found under with hosts_file (a headless service's)."""
        return f"tandem-{role}.test"

    def write_hosts_file(self, exclude: tuple[str, ...] = ()) -> None:
        """Lists every worker but those at the addresses in exclude under its role's name; the
        router sees the change at its next resolution. Written whole, then renamed into place."""
        lines = [
            f"{self.dns_name(s.role)} {s.address}" for s in self.workers if s.address not in exclude
        ]
        partial = self.hosts_file.with_suffix(".partial")
        partial.write_text("\n".join(lines) + "\n")
        partial.replace(self.hosts_file)

    def add_worker(self, role: str, timeout: float = 120.0) -> Service:
        """Starts one more worker of role and waits until it serves (the router learns of it only
        through discovery: write_hosts_file)."""
        service = self._worker_service(role)
        self.services.append(service)
        _RUNNING[service.address] = self
        self._spawn(service, "w")
        self.wait_serving([service.address], timeout)
        return service

    def add_router(
        self,
        name: str,
        args: list[str],
        timeout: float = 120.0,
        host: str | None = None,
        port: int = 0,
    ) -> Service:
        """Another router over the same workers (e.g. another routing policy, to compare; or a
        second replica, on another loopback address and the same port)."""
        service = self._router_service(name, port, args, host)
        self.services.append(service)
        _RUNNING[service.address] = self
        self._spawn(service, "w")
        self.wait_serving([service.address], timeout)
        with self.channel(service.address) as channel:
            from tandem.v1 import llm_pb2, llm_pb2_grpc

            llm_pb2_grpc.AsyncLLMStub(channel).Setup(
                llm_pb2.SetupRequest(timeout=timeout), timeout=timeout + 5
            )
        return service

    def _metrics_address(self, port: int) -> str | None:
        return f"{self.host}:{port}" if port else None

    def _spawn(self, service: Service, log_mode: str) -> None:
        env = dict(os.environ, **(self.env or {}))
        env.pop("TANDEM_CLUSTER_TOKEN", None)
        if self.cluster_token:
            env["TANDEM_CLUSTER_TOKEN"] = self.cluster_token
        with open(service.log_path, log_mode) as log:
            service.process = subprocess.Popen(
                service.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def service(self, name: str) -> Service:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(f"no service {name!r}; services are {[s.name for s in self.services]}")

    def restart(self, service: Service) -> None:
        """Starts a service that exited again: same role, same port, its log continued."""
        if service.process is not None and service.process.poll() is None:
            raise RuntimeError(f"{service.name} is still running (pid {service.process.pid})")
        with open(service.log_path, "a") as log:
            log.write(f"\n--- tandem: restarting {service.name} ---\n")
        self._spawn(service, "a")

    def wait_serving(self, addresses: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for address in addresses:
            with self.channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    self.check_alive()
                    try:
                        if (
                            stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                            == health_pb2.HealthCheckResponse.SERVING
                        ):
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{address} not SERVING after {timeout} s\n{self._tails()}"
                        )
                    time.sleep(0.1)

    def wait_router_setup(self, timeout: float) -> None:
        """Setup returns once the router itself has seen every worker ready (its health polls lag)."""
        from tandem.v1 import llm_pb2, llm_pb2_grpc

        with self.channel(self.router.address) as channel:
            llm_pb2_grpc.AsyncLLMStub(channel).Setup(
                llm_pb2.SetupRequest(timeout=timeout), timeout=timeout + 5
            )

    def check_alive(self) -> None:
        for s in self.services:
            if s.process is not None and s.process.poll() is not None:
                raise RuntimeError(
                    f"{s.name} exited with code {s.process.returncode}\n{s.log_tail()}"
                )

    def _tails(self) -> str:
        return "\n".join(f"--- {s.name} ({s.log_path})\n{s.log_tail()}" for s in self.services)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every service (graceful), then SIGKILL what is left."""
        for s in self.services:
            if _RUNNING.get(s.address) is self:
                del _RUNNING[s.address]
        for s in reversed(self.services):
            if s.process is not None and s.process.poll() is None:
                s.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for s in self.services:
            if s.process is None:
                continue
            try:
                s.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(s.process.pid, signal.SIGKILL)
                s.process.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def client_kwargs_for(address: str) -> dict:
    """LLM(address, **...) keyword arguments for a service of a running LocalCluster: a worker's
    need the cluster's credentials (they serve only the internal plane), the router's its TLS."""
    cluster = _RUNNING.get(address)
    if cluster is None:
        return {}
    if any(s.address == address for s in cluster.workers):
        return cluster.worker_client_kwargs()
    return cluster.client_tls_kwargs()


def channel_to(address: str) -> grpc.Channel:
    """A blocking channel to a service of a running LocalCluster, with that cluster's credentials
    (the tests read worker state this way); plaintext and tokenless for any other address."""
    cluster = _RUNNING.get(address)
    return cluster.channel(address) if cluster is not None else grpc.insecure_channel(address)
