"""KV handoff at device speed within one host (issue 41): the transceiver turns UCX's CUDA IPC get
path on unless the operator chose, and a decode measures each prefill's pull rate (WorkerState,
get_stats, /metrics) and warns once per peer when pulls within its host run under the floor."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
from conftest import assert_all_blocks_free
from test_disagg import worker_state
from test_metrics import scrape, value

from tandem.client import LLM, SamplingParams
from tandem.decode.pull_links import (
    DEFAULT_DEVICE_FLOOR_GBPS,
    JUDGED_AFTER,
    MAX_LINKS,
    PullFloor,
    PullLinks,
)
from tandem.kvtransfer.ucx_env import CUDA_IPC_GET_ZCOPY
from tandem.testing.cluster import LocalCluster

MIB = 2**20


def _fresh_process(code: str, env_value: str | None) -> subprocess.CompletedProcess:
    """Runs code in a new interpreter, with the variable set to env_value or absent."""
    import os

    env = {k: v for k, v in os.environ.items() if k != CUDA_IPC_GET_ZCOPY}
    if env_value is not None:
        env[CUDA_IPC_GET_ZCOPY] = env_value
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "operator_value, expected", [(None, "y"), ("n", "n"), ("auto", "auto"), ("y", "y")]
)
def test_device_pools_get_the_cuda_ipc_get_path_unless_the_operator_chose(operator_value, expected):
    result = _fresh_process(
        f"""
        import os
        from tandem.kvtransfer.ucx_env import apply_defaults
        applied = apply_defaults("VRAM")
        again = apply_defaults("VRAM")  # a second transceiver (the pool released and resumed)
        assert again == {{}}, again
        print(",".join(f"{{k}}={{v}}" for k, v in applied.items()) or "-", os.environ.get({CUDA_IPC_GET_ZCOPY!r}))
    """,
        operator_value,
    )
    assert result.returncode == 0, result.stderr
    applied, value_after = result.stdout.split()
    assert value_after == expected
    assert applied == (f"{CUDA_IPC_GET_ZCOPY}=y" if operator_value is None else "-")


def test_a_host_memory_transceiver_sets_nothing_and_ucx_warns_of_nothing():
    """No cuda_ipc transport is loaded for a DRAM pool: the variable would be an unused one."""
    result = _fresh_process(
        f"""
        import os, torch
        from tandem.kvtransfer import KvTransceiver
        with KvTransceiver("t", torch.zeros(4, 2, 2, 8, 2, 16), "hash", progress_thread=False):
            print(os.environ.get({CUDA_IPC_GET_ZCOPY!r}, "unset"))
    """,
        None,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "unset"
    assert "unused environment variable" not in result.stderr


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="a device pool needs a CUDA GPU"
)
@pytest.mark.parametrize("operator_value, expected", [(None, "y"), ("auto", "auto")])
def test_a_device_transceiver_turns_the_cuda_ipc_get_path_on(operator_value, expected):
    result = _fresh_process(
        f"""
        import os, torch
        from tandem.kvtransfer import KvTransceiver
        with KvTransceiver("t", torch.zeros(4, 2, 2, 8, 2, 16, device="cuda"), "hash", progress_thread=False):
            print(os.environ.get({CUDA_IPC_GET_ZCOPY!r}, "unset"))
    """,
        operator_value,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == expected
    assert "unused environment variable" not in result.stderr


def test_the_setting_is_applied_before_nixl_creates_the_agent(monkeypatch):
    """UCX reads its environment when NIXL creates the agent's context: the order is the point."""
    import torch

    from tandem.kvtransfer import transceiver as transceiver_module

    calls = []
    real_apply, real_agent = transceiver_module.apply_ucx_defaults, transceiver_module.nixl_agent
    monkeypatch.setattr(
        transceiver_module,
        "apply_ucx_defaults",
        lambda memory_type: calls.append(f"apply {memory_type}") or real_apply(memory_type),
    )
    monkeypatch.setattr(
        transceiver_module,
        "nixl_agent",
        lambda *args, **kwargs: calls.append("agent") or real_agent(*args, **kwargs),
    )
    with transceiver_module.KvTransceiver(
        "order", torch.zeros(4, 2, 2, 8, 2, 16), "hash", progress_thread=False
    ):
        pass
    assert calls == ["apply DRAM", "agent"]


def test_a_prefill_under_a_new_agent_starts_a_new_link_and_old_links_go():
    forgotten = []
    links = PullLinks(PullFloor(), on_forget=forgotten.append)
    for _ in range(JUDGED_AFTER):
        links.observe("10.0.0.1:50052", "agent-1", True, True, 128 * MIB, 0.25)
    links.observe("10.0.0.1:50052", "agent-2", True, True, 128 * MIB, 0.0015)  # restarted there
    (link,) = links.links()
    assert (link.agent, link.num_pulls, link.num_judged, link.num_below_floor) == (
        "agent-2",
        1,
        1,
        0,
    )
    for i in range(MAX_LINKS):
        links.observe(f"10.0.1.{i}:50052", "agent", False, True, MIB, 0.01)
    assert len(links.links()) == MAX_LINKS and forgotten == ["10.0.0.1:50052"]
    links.observe("10.0.1.0:50052", "agent", False, True, MIB, 0.01)  # pulled again: kept
    links.observe("10.0.2.0:50052", "agent", False, True, MIB, 0.01)
    assert forgotten == ["10.0.0.1:50052", "10.0.1.1:50052"]


def test_transceiver_state_reads_version_2_and_bounds_the_host_id():
    from tandem.kvtransfer import TransceiverState
    from tandem.kvtransfer.state import _LENGTH, _PREFIX, MAGIC, MAX_NUM_BLOCKS

    state = TransceiverState("a", b"meta", 4096, 64, 8, "DRAM", 0, "hash", host_id="boot-1")
    assert TransceiverState.from_bytes(state.to_bytes()) == state
    header = json.dumps(
        {
            "agent_name": "a",
            "base_address": 4096,
            "block_nbytes": 64,
            "num_blocks": 8,
            "memory_type": "DRAM",
            "device_id": 0,
            "layout_hash": "hash",
            "rank_pools": [[4096, 0]],
        }
    ).encode()
    v2 = _PREFIX.pack(MAGIC, 2, len(header)) + header + _LENGTH.pack(4) + b"meta"
    old = TransceiverState.from_bytes(v2)
    assert old.host_id == "" and not old.same_host(state) and not state.same_host(old)
    for bad in ("x" * 254, "boot\n1", "boöt"):
        with pytest.raises(ValueError, match="host_id"):
            TransceiverState("a", b"meta", 4096, 64, 8, "DRAM", 0, "hash", host_id=bad)
    # A peer's blocks are listed with NIXL when it is added: their count is bounded first.
    for num_blocks, block_nbytes in ((MAX_NUM_BLOCKS + 1, 64), (1 << 20, 1 << 36)):
        with pytest.raises(ValueError, match="num_blocks must be at most"):
            TransceiverState("a", b"meta", 4096, block_nbytes, num_blocks, "DRAM", 0, "hash")
    TransceiverState("a", b"meta", 4096, 64, MAX_NUM_BLOCKS, "DRAM", 0, "hash")


def test_a_lane_whose_every_pull_is_slow_warns_once(caplog):
    observed = []
    links = PullLinks(PullFloor(), on_pull=lambda peer, b, s: observed.append((peer, b)))
    caplog.set_level(logging.WARNING, "tandem.decode.pull_links")
    # Device pools on one host: 128 MiB in 250 ms is 0.54 GB/s, a TCP lane; judged after JUDGED_AFTER pulls.
    for _ in range(JUDGED_AFTER - 1):
        links.observe("10.0.0.1:50052", "agent-1", True, True, 128 * MIB, 0.25)
    assert not caplog.records
    for _ in range(3):
        links.observe("10.0.0.1:50052", "agent-1", True, True, 128 * MIB, 0.25)
    # Too small to say, another host, host-memory pools (no default floor): never judged.
    for peer, same_host, device_pools, nbytes in (
        ("10.0.0.3:50052", True, True, 1 * MIB),
        ("10.0.0.4:50052", False, True, 128 * MIB),
        ("10.0.0.5:50052", True, False, 128 * MIB),
    ):
        for _ in range(2 * JUDGED_AFTER):
            links.observe(peer, "agent", same_host, device_pools, nbytes, 0.25)
    links.observe(
        "10.0.0.6:50052", "agent", True, True, 0, 0.0
    )  # an empty pull moves nothing: not a link
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert (
        "10.0.0.1:50052" in warnings[0]
        and "0.54 GB/s at best" in warnings[0]
        and CUDA_IPC_GET_ZCOPY in warnings[0]
    )
    by_peer = {link.peer: link for link in links.links()}
    assert set(by_peer) == {"10.0.0.1:50052", "10.0.0.3:50052", "10.0.0.4:50052", "10.0.0.5:50052"}
    slow = by_peer["10.0.0.1:50052"]
    assert (slow.num_pulls, slow.num_bytes, slow.num_below_floor) == (
        JUDGED_AFTER + 2,
        (JUDGED_AFTER + 2) * 128 * MIB,
        JUDGED_AFTER + 2,
    )
    assert slow.mean_gbps == pytest.approx(128 * MIB / 0.25 / 1e9) == slow.best_gbps
    assert all(
        by_peer[p].num_judged == by_peer[p].num_below_floor == 0
        for p in by_peer
        if p != "10.0.0.1:50052"
    )
    assert len(observed) == JUDGED_AFTER + 2 + 6 * JUDGED_AFTER


def test_a_healthy_lane_slowed_by_load_does_not_warn(caplog):
    """Under load most pulls of a healthy lane run slow (queued READs, the GIL): one fast pull
    shows the lane is not a TCP one."""
    links = PullLinks(PullFloor())
    caplog.set_level(logging.WARNING, "tandem.decode.pull_links")
    links.observe("10.0.0.2:50052", "agent", True, True, 128 * MIB, 0.0015)  # 89 GB/s
    for _ in range(4 * JUDGED_AFTER):
        links.observe("10.0.0.2:50052", "agent", True, True, 16 * MIB, 0.02)  # 0.84 GB/s
    link = links.links()[0]
    assert not caplog.records
    assert link.num_below_floor == 4 * JUDGED_AFTER and link.best_gbps > DEFAULT_DEVICE_FLOOR_GBPS


def test_floor_settings_are_checked():
    assert PullFloor().gbps_for(device_pools=True) == DEFAULT_DEVICE_FLOOR_GBPS
    assert PullFloor().gbps_for(device_pools=False) == 0
    assert PullFloor(2.0).gbps_for(device_pools=False) == 2.0
    for bad in (
        dict(gbps=-1.0),
        dict(gbps=float("nan")),
        dict(min_mib=0.0),
        dict(min_mib=float("inf")),
    ):
        with pytest.raises(ValueError, match="kv_pull_floor"):
            PullFloor(**bad)


@pytest.fixture(scope="module")
def slow_floor_cluster(model_dirs):
    """A split whose decode holds its (CPU) pulls to a floor no loopback path reaches."""
    engine_args = ["--model", str(model_dirs["llama"]), "--num-blocks", "128", "--block-size", "8"]
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=engine_args,
        worker_args={"decode-1": ["--kv-pull-floor-gbps", "1000", "--kv-pull-floor-mib", "0.001"]},
    ) as c:
        yield c


def test_pull_rates_reach_worker_state_stats_and_metrics_and_a_slow_lane_warns(slow_floor_cluster):
    cluster = slow_floor_cluster
    prefill, decode = cluster.workers
    prompts = [[1] + [(7 * i + 13 * j) % 200 + 3 for j in range(40)] for i in range(JUDGED_AFTER)]
    with LLM(cluster.address) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert all(o.metrics.kv_transfer_bytes > 0 for o in outs)
        pulled = sum(o.metrics.kv_transfer_bytes for o in outs)
        assert_all_blocks_free(llm)

    links = worker_state(decode.address).kv_pull_links
    assert len(links) == 1
    link = links[0]
    assert link.peer == prefill.address and link.same_host and not link.device_pools
    n = JUDGED_AFTER
    assert (link.num_pulls, link.num_bytes, link.num_judged, link.num_below_floor) == (
        n,
        pulled,
        n,
        n,
    )
    assert link.seconds > 0 and link.mean_gbps == pytest.approx(pulled / link.seconds / 1e9)
    assert 0 < link.last_gbps <= link.best_gbps < 1000

    samples = scrape(decode)
    assert value(samples, "tandem:kv_pull_bytes_total", peer=prefill.address) == pulled
    assert value(samples, "tandem:kv_pull_seconds_count", peer=prefill.address) == n
    assert value(samples, "tandem:kv_pull_seconds_sum", peer=prefill.address) == pytest.approx(
        link.seconds
    )

    with LLM(decode.address, **cluster.worker_client_kwargs()) as direct:
        stats = direct.get_stats(timeout=2)
    assert stats and stats[-1]["kvPullStats"][prefill.address]["numPulls"] == n

    log = decode.log_path.read_text(errors="replace")
    warnings = [line for line in log.splitlines() if "KV pulls from" in line]
    assert len(warnings) == 1, warnings
    assert (
        prefill.address in warnings[0]
        and "under the 1000.0 GB/s" in warnings[0]
        and "UCX_TLS" in warnings[0]
    )
    # The prefill pulls nothing: no links, and no series.
    assert not worker_state(prefill.address).kv_pull_links
    assert value(scrape(prefill), "tandem:kv_pull_seconds_count") == 0


def test_handoff_outcomes_count_each_way_and_log_each_recompute(caplog):
    from tandem.decode.outcomes import HandoffOutcomes, Outcome, Reason

    seen = []
    outcomes = HandoffOutcomes(
        "10.0.0.9:50053", lambda outcome, reason: seen.append((outcome, reason))
    )
    caplog.set_level(logging.WARNING, "tandem.decode.outcomes")
    outcomes.record(Outcome.PULLED, "r1", "10.0.0.1:50052")
    outcomes.record(Outcome.RECOMPUTED, "r2", "10.0.0.1:50052", Reason.NO_ROOM)
    outcomes.record(Outcome.RECOMPUTED, "r3", "10.0.0.2:50052", Reason.NO_ROOM)
    outcomes.record(Outcome.RELEASED, "r4", "10.0.0.1:50052")
    assert outcomes.counts() == {"pulled": 1, "recomputed:no_room": 2, "released": 1}
    assert outcomes.count(Outcome.RECOMPUTED) == 2 and outcomes.count(Outcome.PULLED) == 1
    assert seen[1] == ("recomputed", "no_room") and seen[0] == ("pulled", "")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "request r3" in lines[1] and "10.0.0.2:50052" in lines[1]
    assert "(no_room); decode 10.0.0.9:50053 computes" in lines[1]
