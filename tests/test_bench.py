"""`tandem bench` against a real tiny-model cluster (1 prefill + 1 decode): the CLI runs a
concurrency sweep and a request-rate sweep, and its JSON, table and plot say what happened."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_disagg import worker_state

from tandem.cli.bench import percentile
from tandem.testing.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "256",
            "--block-size",
            "8",
        ],
    ) as c:
        yield c


def _bench(cluster, tmp_path, *sweep: str, num_prompts: int = 6):
    result, png = tmp_path / "result.json", tmp_path / "plot.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "bench",
            "--target",
            cluster.address,
            *sweep,
            "--num-prompts",
            str(num_prompts),
            "--input-len",
            "24",
            "--output-len",
            "6",
            "--num-warmup",
            "2",
            "--seed",
            "7",
            "--result-json",
            str(result),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(result.read_text()), png, proc


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_concurrency_sweep(cluster, tmp_path):
    def prompt_tokens_computed():
        return sum(worker_state(w.address).num_prompt_tokens_computed for w in cluster.workers)

    before = prompt_tokens_computed()
    result, png, proc = _bench(cluster, tmp_path, "--max-concurrency", "1,3")
    assert result["sweep"] == "max_concurrency" and result["mode"] == "disaggregated"
    assert [p["max_concurrency"] for p in result["points"]] == [1, 3]
    for p in result["points"]:
        assert p["completed"] == 6 and p["failed"] == 0
        assert (
            p["input_tokens"] == 6 * 24 and p["output_tokens"] == 6 * 6
        )  # fixed lengths, as the server saw them
        for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
            assert 0 < p[metric]["p50"] <= p[metric]["p90"] <= p[metric]["p99"]
        assert p["ttft_ms"]["p50"] < p["e2e_ms"]["p99"]
        assert p["output_throughput"] == pytest.approx(p["output_tokens"] / p["duration_s"])
    # Fresh prompts at every point: every prompt token was computed, none came from a cache (warm-up included).
    assert prompt_tokens_computed() - before == (2 + 6 + 6) * 24
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "TTFT ms p50/p90/p99" in proc.stdout and "Processed" not in proc.stdout
    assert "max_concurrency 3" in proc.stderr  # the progress bar


def test_request_rate_sweep_with_random_lengths(cluster, tmp_path):
    result, _, _ = _bench(
        cluster, tmp_path, "--request-rate", "4,inf", "--range-ratio", "0.5", num_prompts=8
    )
    assert [p["request_rate"] for p in result["points"]] == [4.0, "inf"]
    for p in result["points"]:
        assert p["completed"] == 8 and p["failed"] == 0
        assert 8 * 12 <= p["input_tokens"] <= 8 * 36 and p["input_tokens"] != 8 * 24
    # Poisson arrivals at 4/s spread 8 requests over about two seconds; inf sends them at once.
    assert result["points"][0]["duration_s"] > result["points"][1]["duration_s"]
