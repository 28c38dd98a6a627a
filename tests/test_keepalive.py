"""A peer that vanishes without closing its connection (its node died, the network split; here:
the client process is stopped with SIGSTOP, so its kernel keeps the TCP connection up but nothing
answers) has its calls ended by the server's keepalive pings (--keepalive-seconds), and the worker
stops generating for it and frees its KV blocks. Without the pings its streams ran on to their
last token, for nobody, while the router could not write to the client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_disagg import worker_state

from tandem.testing.cluster import LocalCluster

NUM_STREAMS, MAX_TOKENS = 6, 1900  # ~11,400 steps one at a time: far longer than the pings take
KEEPALIVE_S = 1.0

CLIENT = """
import asyncio, sys
from tandem.common.channels import ClusterCredentials
from tandem.v1 import llm_pb2, llm_pb2_grpc

async def main(target, token):
    credentials = ClusterCredentials(cluster_token=token or None)
    stub = credentials.stub(llm_pb2_grpc.AsyncLLMStub, credentials.open(target))

    async def one(i):
        request = llm_pb2.GenerateRequest(streaming=True)
        request.prompt.token_ids.ids[:] = [1, 5 + i, 6, 7]
        request.sampling_params.max_tokens = %d
        request.sampling_params.ignore_eos = True
        request.sampling_params.detokenize = False
        async for _ in stub.Generate(request):
            print("streaming", flush=True)
            await asyncio.sleep(0.05)
    await asyncio.gather(*(one(i) for i in range(%d)))

asyncio.run(main(sys.argv[1], sys.argv[2]))
""" % (MAX_TOKENS, NUM_STREAMS)  # noqa: UP031 (the script has braces of its own)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    # One sequence at a time: the streams' last tokens are ~NUM_STREAMS * MAX_TOKENS steps away.
    keepalive = ["--keepalive-seconds", str(KEEPALIVE_S)]
    with LocalCluster(
        roles=["both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "512",
            "--block-size",
            "8",
            "--max-num-seqs",
            "1",
        ],
        worker_args={"both-1": keepalive},
        router_args=keepalive,
    ) as c:
        yield c


@pytest.mark.parametrize("via", ["router", "worker"])
def test_a_stopped_client_has_its_streams_ended_and_their_blocks_freed(
    cluster, via, tmp_path, no_leaked_worker_blocks
):
    worker = cluster.workers[0].address
    target = cluster.address if via == "router" else worker
    token = cluster.cluster_token if via == "worker" else ""
    generated_before = worker_state(worker).num_generated_tokens
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, target, token],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "client.log", "w"),
        text=True,
    )
    try:
        assert client.stdout.readline().strip() == "streaming", (
            tmp_path / "client.log"
        ).read_text()
        os.kill(client.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        deadline = stopped + 30
        while worker_state(worker).num_active_requests and time.monotonic() < deadline:
            time.sleep(0.2)
        ended_after = time.monotonic() - stopped
        state = worker_state(worker)
    finally:
        client.kill()
        client.wait(timeout=10)
    assert state.num_active_requests == 0, (
        f"{via}: the streams of a stopped client still run after 30 s"
    )
    generated = state.num_generated_tokens - generated_before
    # The pings end them within a few seconds (2.1 s here, 1 s pings), well before their last tokens.
    assert ended_after < 10, f"{via}: the streams ran {ended_after:.1f} s after the client stopped"
    assert generated < 0.8 * NUM_STREAMS * MAX_TOKENS, (
        f"{via}: {generated} tokens in {ended_after:.1f} s"
    )
