"""examples/rl_grpo.py runs (issue 32 item 6): a trainer process, a tandem cluster for the
rollouts, weights synced over IPC handles each step. Two steps, bounded in time: the rollouts'
logprobs agree with the trainer's at step 0 (same weights, two engines), and still at step 1,
after a sync, far closer than the step moved them (a sync that did not land would leave a
mismatch of that size)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_grpo.py"
LINE = re.compile(
    r"^step (\d+)  reward ([\d.]+)  mismatch mean (\S+) max (\S+)  moved (\S+)  "
    r"rollout ([\d.]+) s  train ([\d.]+) s  sync ([\d.]+) s$"
)


def test_two_grpo_steps_sync_the_weights_and_the_logprobs_agree():
    pytest.importorskip("transformers")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "2", "--group", "2", "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [LINE.match(line) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(steps), done.stdout
    rows = [[float(v) for v in m.groups()] for m in steps]
    for step, reward, mismatch, worst, moved, rollout_s, train_s, sync_s in rows:
        assert 0.0 <= reward <= 1.0
        assert all(math.isfinite(v) for v in (mismatch, worst, moved))
        assert 0 < sync_s < 30 and rollout_s > 0 and train_s > 0
    # Same weights, two engines: float32 on both sides, the sampled tokens' logprobs agree.
    assert rows[0][2] < 1e-3 and rows[0][3] < 1e-2
    # The step moved the policy; the sync carried it over: step 1's rollouts came from the
    # trainer's new weights, not the old ones.
    assert rows[0][4] > 1e-4
    assert rows[1][2] < rows[0][4] / 10
    assert elapsed < 90
