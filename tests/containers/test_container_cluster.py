"""The image as containers: router + prefill + decode started with testcontainers (host network,
read-only root filesystem, no capabilities, uid 10001). A disaggregated Generate through the client
moves KV over NIXL/UCX between the containers and matches transformers token for token; grpcurl
lists, health-checks and streams from the router."""

from __future__ import annotations

import json
import secrets
import time

import grpc
import pytest
from container_harness import CONTAINER_PREFIX, cpu_image, docker_client, health_status, logs
from test_grpcurl import grpcurl
from testcontainers.core.container import DockerContainer

from tandem.client import LLM, SamplingParams
from tandem.common.auth import CLUSTER_TOKEN_KEY
from tandem.testing.cluster import free_port
from tandem.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(1800)  # the first test may build the image from nothing

MODEL = "/opt/tandem/models/tiny-llama-v2"
# The cluster's shared secret, in every container's environment (as the chart's Secret gives it).
CLUSTER_TOKEN = secrets.token_urlsafe(32)
START_TIMEOUT_S = 180


def _service(image: str, name: str, args: list[str]) -> DockerContainer:
    """One tandem process as the chart runs it: non-root, read-only root, nothing but /tmp writable."""
    return (
        DockerContainer(image)
        .with_name(f"{CONTAINER_PREFIX}-{name}")
        .with_command(args)
        .with_env("HOME", "/tmp")
        .with_env("TANDEM_CLUSTER_TOKEN", CLUSTER_TOKEN)
        .with_tmpfs_mount("/tmp")
        .with_kwargs(
            network_mode="host",
            read_only=True,
            user="10001:10001",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            shm_size="1g",
        )
    )


def _wait_serving(containers: dict[str, tuple[DockerContainer, str]]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = dict(containers)
    while pending:
        for name, (container, address) in list(pending.items()):
            container.get_wrapped_container().reload()
            if container.get_wrapped_container().status == "exited":
                pytest.fail(f"{name} exited:\n{logs(container.get_wrapped_container())}")
            if health_status(address) == "SERVING":
                del pending[name]
        if pending and time.monotonic() > deadline:
            tails = "\n".join(
                f"--- {n}\n{logs(c.get_wrapped_container())}" for n, (c, _) in pending.items()
            )
            pytest.fail(f"not SERVING after {START_TIMEOUT_S} s: {sorted(pending)}\n{tails}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster():
    docker_client()
    image = cpu_image()
    ports = {role: free_port() for role in ("prefill", "decode", "router")}
    # Host network: every process needs its own metrics port too (workers default to 9192).
    metrics = {role: ["--metrics-port", str(free_port())] for role in ports}
    address = {role: f"127.0.0.1:{port}" for role, port in ports.items()}
    engine = ["--model", MODEL, "--num-blocks", "64", "--drain-seconds", "5"]
    specs = {
        "prefill": [
            "serve",
            "prefill",
            "--port",
            str(ports["prefill"]),
            *metrics["prefill"],
            *engine,
        ],
        "decode": ["serve", "decode", "--port", str(ports["decode"]), *metrics["decode"], *engine],
        "router": [
            "serve",
            "router",
            "--port",
            str(ports["router"]),
            *metrics["router"],
            "--health-interval",
            "0.2",
            "--workers",
            f"{address['prefill']},{address['decode']}",
            "--drain-seconds",
            "5",
        ],
    }
    started: dict[str, tuple[DockerContainer, str]] = {}
    try:
        for role, args in specs.items():
            started[role] = (_service(image, role, args).start(), address[role])
        _wait_serving(started)
        yield address
    finally:
        for container, _ in started.values():
            container.stop()


def _worker_state(address: str) -> worker_pb2.WorkerState:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetWorkerState(
            worker_pb2.WorkerStateRequest(),
            timeout=10,
            metadata=((CLUSTER_TOKEN_KEY, CLUSTER_TOKEN),),
        )


def test_disaggregated_generate_matches_transformers(cluster, oracle, model_dirs):
    reference = oracle(model_dirs["llama"])
    prompts = [[1, 17, 23, 42, 8], [1, 99, 5, 61, 200, 7, 3, 150, 12]]
    with LLM(cluster["router"]) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=16), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == reference.greedy(prompt, 16)
    prefill, decode = _worker_state(cluster["prefill"]), _worker_state(cluster["decode"])
    assert prefill.num_prompt_tokens_computed >= sum(map(len, prompts)) - len(prompts)
    assert decode.kv_bytes_received > 0, (
        "the decode container pulled the prompts' KV from the prefill container"
    )


def test_grpcurl_against_the_router(cluster):
    router = cluster["router"]
    assert {"tandem.v1.AsyncLLM", "grpc.health.v1.Health"} <= set(grpcurl(router, "list").split())
    assert json.loads(grpcurl(router, "grpc.health.v1.Health/Check"))["status"] == "SERVING"
    request = {
        "prompt": {"text": "Hello from a container"},
        "streaming": True,
        "sampling_params": {"max_tokens": 8, "ignore_eos": True},
    }
    out = grpcurl(router, "tandem.v1.AsyncLLM/Generate", data=json.dumps(request))
    decoder, messages, rest = json.JSONDecoder(), [], out.strip()
    while rest:
        message, end = decoder.raw_decode(rest)
        messages.append(message)
        rest = rest[end:].strip()
    tokens = [t for m in messages for o in m.get("outputs", []) for t in o.get("token_ids", [])]
    assert len(tokens) == 8
    assert messages[-1]["outputs"][0]["finish_reason"] == "FINISH_REASON_LENGTH"
