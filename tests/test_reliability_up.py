"""Issue 8, items 6 and 12: `tandem up` supervises its processes. A worker that dies is started
again (same role, same port, bounded restarts with back-off) while the rest keep serving: its
streams move on, and the router uses the worker again once it is back. `--admin-token` guards
the admin calls of the whole cluster."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability import lost, record, run_load, scaled

from tandem.client import AsyncLLM, RequestError, SamplingParams
from tandem.testing.cluster import free_port

TOKEN = "up-admin-token"


class Up:
    """`tandem up` as a user runs it, in its own process group."""

    def __init__(self, model_dir, log_path):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "up",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--num-blocks",
            "512",
            "--block-size",
            "8",
            "--admin-token",
            TOKEN,
            "--max-restarts",
            "1",
            "--health-interval",
            "0.2",
            "--health-timeout",
            "0.5",
            "--stream-progress-timeout",
            "1",
        ]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert self.process.poll() is None, (
                f"tandem up exited ({self.process.returncode}):\n{self.log()}"
            )
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{self.log()}"
            time.sleep(0.1)

    def worker(self, role: str) -> tuple[int, str]:
        """(pid, address) of the running worker of that role (one of each here)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.process.pid and b"serve" in argv and role.encode() in argv:
                return int(pid), f"127.0.0.1:{argv[argv.index(b'--port') + 1].decode()}"
        raise LookupError(f"no running {role} worker under tandem up")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(), timeout=1)
                .status
                == health_pb2.HealthCheckResponse.SERVING
            )
        except grpc.RpcError:
            return False


def test_tandem_up_restarts_a_dead_worker_and_keeps_serving(model_dirs, tmp_path):
    # Streams long enough that most are still running when the last one has started (on a fast
    # run 64 tokens took 0.3 s and most had ended before the kill).
    num_streams, max_tokens = scaled(24, 160), scaled(192, 256)
    up = Up(model_dirs["llama"], tmp_path / "up.log")
    try:
        up.wait_for("tandem: serving on", 180)
        decode_pid, decode_address = up.worker("decode")
        prefill_pid, prefill_address = up.worker("prefill")
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        started: set[int] = set()

        async def kill_decode_under_load():
            while len(started) < num_streams:
                assert up.process.poll() is None, up.log()
                await asyncio.sleep(0.01)
            os.kill(decode_pid, signal.SIGKILL)
            return time.monotonic()

        async def load():
            llm = AsyncLLM(up.address)
            try:
                killer = asyncio.create_task(kill_decode_under_load())
                outcomes = await asyncio.wait_for(
                    run_load(
                        llm,
                        [f"stream {i}" for i in range(num_streams)],
                        params,
                        num_streams,
                        on_started=started.add,
                    ),
                    120,
                )
                return outcomes, await asyncio.wait_for(killer, 1)
            finally:
                llm.close()

        outcomes, killed_at = asyncio.run(load())
        failed = lost(outcomes, max_tokens)
        moved = [
            o for o in outcomes if o.served_by == [prefill_address, decode_address, prefill_address]
        ]
        record(
            "decode SIGKILL under `tandem up` (1P+1D), streams in flight",
            len(outcomes),
            len(outcomes) - len(failed),
            len(failed),
            "pytest tests/test_reliability_up.py",
            f"{len(moved)} streams moved to the prefill worker; the decode restarted on its port",
        )
        assert not failed, failed[:3]
        assert len(moved) >= num_streams // 2, [o.served_by for o in outcomes]
        assert all(o in moved or o.served_by == [prefill_address, decode_address] for o in outcomes)

        # The decode comes back on its port, and the router splits requests over it again.
        up.wait_for("tandem: restarted decode-1", 30)
        new_pid, address = up.worker("decode")
        assert new_pid != decode_pid and address == decode_address
        while not serving(decode_address):
            assert time.monotonic() - killed_at < 90
            time.sleep(0.05)
        serving_at = time.monotonic()

        async def until_split_again():
            llm = AsyncLLM(up.address)
            try:
                while True:
                    out = await llm.generate_async(
                        "after the restart", SamplingParams(max_tokens=4)
                    )
                    if out.metrics.served_by == [prefill_address, decode_address]:
                        return time.monotonic()
                    assert time.monotonic() - killed_at < 90
                    await asyncio.sleep(0.1)
            finally:
                llm.close()

        back_at = asyncio.run(until_split_again())
        assert back_at - serving_at < 3  # the router takes a worker back within a few health checks

        async def admin():
            for token, code in (
                (None, grpc.StatusCode.UNAUTHENTICATED),
                ("wrong", grpc.StatusCode.PERMISSION_DENIED),
            ):
                llm = AsyncLLM(up.address, auth_token=token)
                try:
                    with pytest.raises(RequestError) as err:
                        await llm.pause_generation()
                    assert err.value.code == code
                finally:
                    llm.close()
            llm = AsyncLLM(up.address, auth_token=TOKEN)
            try:
                await llm.pause_generation()
                await llm.resume_generation()
            finally:
                llm.close()

        asyncio.run(admin())

        # Past --max-restarts the worker is left down; the rest keep serving.
        os.kill(new_pid, signal.SIGKILL)
        up.wait_for("leaving it down", 10)
        with AsyncLLMSync(up.address) as generate:
            out = generate("with the decode left down", SamplingParams(max_tokens=4))
        # Until a health check sees the kill, the router may still hand off to the dead decode,
        # and the request then fails over to the prefill worker.
        assert out.metrics.served_by in (
            [prefill_address],
            [prefill_address, decode_address, prefill_address],
        )
        assert len(out.outputs[0].token_ids) == 4
        assert not serving(decode_address)
        assert up.process.poll() is None
    finally:
        code = up.stop()
    assert code == 0, up.log()
    with pytest.raises(LookupError):
        up.worker("prefill")
    print(
        f"decode SERVING again {serving_at - killed_at:.1f} s after the kill, used {back_at - serving_at:.2f} s later"
    )


class AsyncLLMSync:
    """One blocking generate on a fresh client."""

    def __init__(self, address: str):
        from tandem.client import LLM

        self.llm = LLM(address)

    def __enter__(self):
        return lambda prompt, params: self.llm.generate(prompt, params, use_tqdm=False)

    def __exit__(self, *exc):
        self.llm.close()
