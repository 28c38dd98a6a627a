"""Process lifecycle: health is NOT_SERVING until the model is loaded, SIGTERM stops
gracefully, shutdown_cluster() stops the whole cluster, and the CLI streams a completion."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client import LLM
from tandem.testing.cluster import LocalCluster, free_port


def _health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(), timeout=1)
                .status
            )
            return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as exc:
            return exc.code().name


def _generate_code(address: str) -> str:
    from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2

    with grpc.insecure_channel(address) as channel:
        request = llm_pb2.GenerateRequest(
            prompt=types_pb2.Prompt(text="early"),
            sampling_params=types_pb2.SamplingParams(max_tokens=1),
        )
        try:
            list(llm_pb2_grpc.AsyncLLMStub(channel).Generate(request, timeout=5))
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name


def test_worker_is_not_serving_until_loaded_and_stops_on_sigterm(model_dirs, tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "serve",
            "both",
            "--port",
            str(port),
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "16",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        seen, early = [], set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not seen or seen[-1] != "SERVING"):
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            seen.append(_health(address))
            if seen[-1] == "NOT_SERVING":
                early.add(_generate_code(address))
            time.sleep(0.02)
        assert seen[-1] == "SERVING"
        assert "NOT_SERVING" in seen, seen  # the port answered before the model was ready
        assert early <= {"UNAVAILABLE", "OK"}, early  # never INTERNAL while loading
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_worker_whose_model_cannot_load_exits_with_what_to_fix(model_dirs):
    """The error comes after the server started (the model loads behind NOT_SERVING): the worker
    says what to fix, exits 2, and stops its server on its loop (no finalizer noise after)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "serve",
            "both",
            "--port",
            str(free_port()),
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "16",
            "--max-model-len",
            "4096",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "give --max-model-len 2048 or less" in proc.stderr, proc.stderr[-2000:]
    assert "listening on" in proc.stderr  # it did start serving first
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[
        -2000:
    ]


def test_shutdown_stops_the_cluster_and_the_cli_streams(model_dirs):
    cluster = LocalCluster(
        roles=["prefill", "decode"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "32"],
    )
    with cluster:
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem.cli.main",
                "generate",
                "--target",
                cluster.address,
                "--max-tokens",
                "6",
                "Hello from the command line",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert "[length: 6 tokens]" in cli.stdout
        with LLM(cluster.address) as llm:
            llm.shutdown_cluster()
        for service in cluster.services:
            assert service.process.wait(timeout=20) == 0, service.log_tail()
