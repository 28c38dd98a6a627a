"""Operating the router with the real grpcurl binary (reflection, health, a Generate call)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_all_blocks_free

from tandem.client import LLM
from tandem.testing.cluster import LocalCluster

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["both"], engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "32"]
    ) as c:
        yield c


@pytest.fixture(autouse=True)
def no_leaked_blocks(cluster):
    yield
    with LLM(cluster.address) as llm:
        assert_all_blocks_free(llm)


def grpcurl(*args: str, data: str | None = None) -> str:
    argv = [GRPCURL, "-plaintext", *(["-d", data] if data is not None else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{' '.join(argv)} failed: {proc.stderr}"
    return proc.stdout


def test_list_shows_the_public_service_and_health(cluster):
    services = grpcurl(cluster.address, "list").split()
    assert "tandem.v1.AsyncLLM" in services
    assert "grpc.health.v1.Health" in services


def test_describe_documents_the_rpcs(cluster):
    out = grpcurl(cluster.address, "describe", "tandem.v1.AsyncLLM")
    for rpc in (
        "Generate",
        "Abort",
        "GetKvCacheCapacity",
        "PauseGeneration",
        "GetDataTransceiverState",
    ):
        assert f"rpc {rpc}" in out
    assert "SamplingParams" in grpcurl(cluster.address, "describe", "tandem.v1.SamplingParams")


def test_health_check(cluster):
    assert (
        json.loads(grpcurl(cluster.address, "grpc.health.v1.Health/Check"))["status"] == "SERVING"
    )
    worker = cluster.workers[0].address
    assert json.loads(grpcurl(worker, "grpc.health.v1.Health/Check"))["status"] == "SERVING"
    assert "tandem.v1.Worker" in grpcurl(worker, "list").split()


def test_generate_streams_json(cluster):
    request = json.dumps(
        {
            "prompt": {"text": "Hello from grpcurl"},
            "streaming": True,
            "sampling_params": {"max_tokens": 5, "ignore_eos": True},
        }
    )
    out = grpcurl(cluster.address, "tandem.v1.AsyncLLM/Generate", data=request)
    messages = [
        json.loads(chunk) for chunk in out.replace("}\n{", "}\x00{").split("\x00") if chunk.strip()
    ]
    tokens = [t for m in messages for o in m.get("outputs", []) for t in o.get("token_ids", [])]
    assert len(tokens) == 5
    assert messages[-1]["finished"] is True
    assert messages[-1]["outputs"][0]["finish_reason"] == "FINISH_REASON_LENGTH"
