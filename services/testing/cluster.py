"""A local tandem cluster as child processes: what `tandem up` and the tests start."""
from __future__ import annotations

import os
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    role: str
    address: str
    argv: list[str]
    log_path: Path
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
    # Flags for the router (after the cluster's own, so they win).
    router_args: list[str] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)

    @property
    def router(self) -> Service:
        return self.services[-1]

    @property
    def workers(self) -> list[Service]:
        return self.services[:-1]

    @property
    def address(self) -> str:
        return self.router.address

    def start(self, timeout: float = 120.0) -> "LocalCluster":
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="tandem-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        counts: dict[str, int] = {}
        for role in self.roles:
            counts[role] = counts.get(role, 0) + 1
            port = free_port(self.host)
            name = f"{role}-{counts[role]}"
            argv = [sys.executable, "-m", "tandem.cli.main", "serve", role, "--host", self.host, "--port", str(port),
                    *self.engine_args, *self.worker_args.get(name, [])]
            self.services.append(Service(name, role, f"{self.host}:{port}", argv, self.log_dir / f"{name}.log"))
        port = self.router_port or free_port(self.host)
        workers = ",".join(s.address for s in self.services)
        self.services.append(Service("router", "router", f"{self.host}:{port}",
                                     [sys.executable, "-m", "tandem.cli.main", "serve", "router", "--host", self.host,
                                      "--port", str(port), "--workers", workers, "--health-interval", "0.2",
                                      *self.router_args],
                                     self.log_dir / "router.log"))
        for s in self.services:
            self._spawn(s, "w")
        try:
            self.wait_serving([s.address for s in self.services], timeout)
            self.wait_router_setup(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, service: Service, log_mode: str) -> None:
        env = dict(os.environ, **(self.env or {}))
        with open(service.log_path, log_mode) as log:
            service.process = subprocess.Popen(service.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True)

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
            with grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    self.check_alive()
                    try:
                        if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{address} not SERVING after {timeout} s\n{self._tails()}")
                    time.sleep(0.1)

    def wait_router_setup(self, timeout: float) -> None:
        """Setup returns once the router itself has seen every worker ready (its health polls lag)."""
        from tandem.v1 import llm_pb2, llm_pb2_grpc
        with grpc.insecure_channel(self.router.address) as channel:
            llm_pb2_grpc.AsyncLLMStub(channel).Setup(llm_pb2.SetupRequest(timeout=timeout), timeout=timeout + 5)

    def check_alive(self) -> None:
        for s in self.services:
            if s.process is not None and s.process.poll() is not None:
                raise RuntimeError(f"{s.name} exited with code {s.process.returncode}\n{s.log_tail()}")

    def _tails(self) -> str:
        return "\n".join(f"--- {s.name} ({s.log_path})\n{s.log_tail()}" for s in self.services)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every service (graceful), then SIGKILL what is left."""
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
