"""--log-format json (issue 35): every line a JSON object, and the lines logged on a request's
behalf carry its id, route and worker: the router's one line a request, and a decode's line
about the request's KV pull. Real processes (a split cluster, TANDEM_LOG_FORMAT=json, a READ
fault so that the decode has a line of its own); the formatters and the binding in-process."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import pytest

from tandem.client import LLM, SamplingParams
from tandem.common import logs
from tandem.testing.cluster import LocalCluster


def _record(message: str) -> logging.LogRecord:
    record = logging.LogRecord("tandem.test", logging.INFO, __file__, 1, message, (), None)
    logs._Fields().filter(record)
    return record


def test_fields_bound_in_a_task_reach_its_lines_and_those_of_the_tasks_it_starts():
    async def request(rid: str):
        logs.bind(request_id=rid, worker="w:1", empty="")

        async def child():
            logs.bind(route="a -> b")
            return _record("child")

        child_record = await asyncio.create_task(child())
        return _record("parent"), child_record

    async def run():
        return await asyncio.gather(request("r1"), request("r2")), _record("outside")

    (first, second), outside = asyncio.run(run())
    assert first[0].tandem_fields == {"request_id": "r1", "worker": "w:1"}
    assert first[1].tandem_fields == {"request_id": "r1", "worker": "w:1", "route": "a -> b"}
    assert second[0].tandem_fields["request_id"] == "r2"  # requests do not see each other's
    assert outside.tandem_fields == {}
    line = json.loads(logs.JsonFormatter().format(first[1]))
    assert line["message"] == "child" and line["request_id"] == "r1" and line["level"] == "INFO"
    assert logs.TextFormatter().format(first[0]).endswith(" [request_id=r1 worker=w:1]")
    assert "[" not in logs.TextFormatter().format(outside)


def test_a_bad_log_format_is_refused_at_start():
    import subprocess
    import sys

    argv = [sys.executable, "-m", "tandem.cli.main"]
    proc = subprocess.run(
        [*argv, "--log-format", "xml", "default-model"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "--log-format: invalid choice: 'xml'" in proc.stderr
    env = dict(os.environ, TANDEM_LOG_FORMAT="yaml")
    proc = subprocess.run(
        [*argv, "default-model"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 2
    assert (
        "log format must be one of text, json (--log-format, TANDEM_LOG_FORMAT), got 'yaml'"
        in proc.stderr
    )


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=["--model", str(model_dirs["llama"]), "--block-size", "8"],
        env={"TANDEM_LOG_FORMAT": "json", "TANDEM_TEST_KV_PULL_FAULT": "2:1"},
    ) as c:
        yield c


def _lines(service) -> list[dict]:
    text = service.log_path.read_text()
    out = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            out.append(json.loads(raw))
        else:  # what is not a log record (a native library's own print) is no JSON line
            assert "tandem" not in raw.split(" ")[0:3], raw
    return out


def test_json_lines_carry_the_request_id_route_and_worker(cluster):
    prefill, decode = cluster.workers
    with LLM(cluster.address) as llm:
        llm.generate_async(
            [1] + list(range(4, 60)),
            SamplingParams(max_tokens=4, ignore_eos=True),
            request_id="joined-id-1",
        ).result()
    deadline_lines = []
    for _ in range(50):
        deadline_lines = [x for x in _lines(cluster.router) if x.get("request_id") == "joined-id-1"]
        if deadline_lines:
            break
        time.sleep(0.1)
    (finished,) = deadline_lines
    assert finished["message"].startswith("request joined-id-1 finished after ")
    assert finished["route"] == f"{prefill.address} -> {decode.address}"
    # The decode's line about this request's pull (the READ fault) names it and the worker.
    pulls = [x for x in _lines(decode) if "KV pull for" in x["message"]]
    assert pulls and all(x["worker"] == decode.address for x in pulls)
    assert any(x["request_id"].startswith("joined-id-1") for x in pulls), pulls
    assert {"ts", "level", "logger", "pid"} <= set(pulls[0])
