"""What the container tests share: Docker (required), the image (built once per content), gRPC health waits.

Docker is required: when no daemon answers, these tests fail and say how to get one. A developer
without Docker may skip them for a targeted run with TANDEM_SKIP_CONTAINER_TESTS=1; `make test`
clears that variable, so CI always runs them. Nothing here talks to a registry: Ryuk (the reaper
image testcontainers would pull) is off, and every container is removed by the test that made it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"

import docker  # noqa: E402 - after the Ryuk switch, which testcontainers reads on first use
import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SKIP_VARIABLE = "TANDEM_SKIP_CONTAINER_TESTS"
BUILD_TIMEOUT_S = 1500
# What the Dockerfile copies (Dockerfile.dockerignore): a change to any of these is a new test image.
IMAGE_INPUTS = (
    "client",
    "services",
    "kernels",
    "pyproject.toml",
    "deploy/image",
    "deploy/helm/Dockerfile",
    "deploy/helm/Dockerfile.dockerignore",
)
CONTAINER_PREFIX = f"tandem-test-{os.getpid()}"


def docker_client() -> docker.DockerClient:
    """The Docker daemon, or a failed (not skipped) test unless the developer opted out explicitly."""
    if os.environ.get(SKIP_VARIABLE) == "1":
        pytest.skip(
            f"{SKIP_VARIABLE}=1: container tests skipped on request (make test and CI always run them)"
        )
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except docker.errors.DockerException as exc:
        pytest.fail(
            f"the container tests need a Docker daemon ({exc}). Install and start one: "
            f"deploy/image/host_deps.sh (as root: installs docker.io, mmdebstrap and iptables, starts dockerd) -- or, for a targeted run "
            f"on a machine without Docker, set {SKIP_VARIABLE}=1",
            pytrace=False,
        )
    return client


def _version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["version"]


def image_content_hash() -> str:
    digest = hashlib.sha256()
    for top in IMAGE_INPUTS:
        path = ROOT / top
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts or any(
                part.endswith(".egg-info") for part in file.parts
            ):
                continue
            digest.update(str(file.relative_to(ROOT)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


_built: dict[str, str] = {}


def cpu_image() -> str:
    """The CPU image of this tree, built once per test session and tagged by its content (worktrees
    sharing a daemon never test each other's image); make image's caches make a rebuild of unchanged
    content take seconds."""
    if "cpu" not in _built:
        _built["cpu"] = _build_cpu_image()
    return _built["cpu"]


def _build_cpu_image() -> str:
    tag = f"tandem:{_version()}-cpu-test-{image_content_hash()}"
    log = ROOT / ".tandem" / "image" / "test-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "deploy" / "image" / "build.py"),
                "--variant",
                "cpu",
                "--tag",
                tag,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=BUILD_TIMEOUT_S,
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"building the image failed (full log: {log}):\n{tail}", pytrace=False)
    print(f"[containers] image {tag} ready in {time.monotonic() - started:.0f} s (log: {log})")
    return tag


def health_status(address: str, timeout: float = 1.0) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
            return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except grpc.RpcError as exc:
            return exc.code().name


def logs(container) -> str:
    try:
        return container.logs(tail=40).decode(errors="replace")
    except docker.errors.DockerException as exc:
        return f"(no logs: {exc})"


def remove(container) -> None:
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass
