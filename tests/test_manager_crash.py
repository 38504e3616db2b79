"""Crash consistency: a process saving in a loop is SIGKILLed at random moments.

After every kill, a new manager (which cleans up leftovers at start) must list
only committed steps, every listed step must verify, and the newest must load
bit-exactly. ``UCP_CRASH_TRIALS=200`` runs a longer trial set.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from manager_utils import assert_state_equal, empty_like_state, make_state
from ucp_dcp import CheckpointManager
from ucp_dcp.manager.tiers import LocalTier

TRIALS = int(os.environ.get("UCP_CRASH_TRIALS", "20"))
WORKER = os.path.join(os.path.dirname(__file__), "crash_worker.py")


def _start(root: str, local: str, first: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, WORKER, root, local, str(first), "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _check(root: str, local: str) -> int:
    """What a restarted job sees; returns the newest step."""
    kw = {"local": local, "persistent_interval": 2} if local != "-" else {}
    with CheckpointManager(root, **kw) as mgr:
        steps = mgr.steps()
        for tier in ([LocalTier(local, name="l")] if local != "-" else []) + [LocalTier(root, name="p")]:
            leftovers = [n for n in os.listdir(tier.url) if n.startswith(".")]
            assert leftovers == [], f"start-up cleanup left {leftovers} in {tier.url}"
        if not steps:
            return -1
        for s in steps:
            assert mgr.verify(s) == [], f"step {s} listed but does not verify: {mgr.verify(s)}"
        target = empty_like_state(make_state(0, scale=8))
        got = mgr.load(target)
        assert got == steps[-1] and mgr.last_restore.failed_attempts == ()
        assert_state_equal(target, make_state(got, scale=8))
        return got


@pytest.mark.parametrize("tiers", ["persistent", "local+persistent"])
def test_sigkill_at_random_moments(tmp_path, tiers: str) -> None:
    rng = random.Random(int(os.environ.get("UCP_CRASH_SEED", "1234")) + len(tiers))
    root = str(tmp_path / "ckpt")
    local = str(tmp_path / "local") if tiers != "persistent" else "-"
    trials = max(TRIALS // 2, 1)
    newest = -1
    killed_mid_write = 0
    for trial in range(trials):
        proc = _start(root, local, newest + 1)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "ready", f"worker did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
            time.sleep(rng.uniform(0.0, 1.5))
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        staged = [int(x.split()[1]) for x in out.splitlines() if x.startswith("staged")]
        committed = [int(x.split()[1]) for x in out.splitlines() if x.startswith("committed")]
        got = _check(root, local)
        # A step reported committed is never lost; steps only move forward.
        assert got >= max(committed + [newest]), (trial, got, committed, newest)
        if staged and got < max(staged):
            killed_mid_write += 1
        newest = max(newest, got)
    assert newest >= 0, "no step was ever committed: the kills came too early to test anything"
    # Not a timing assertion: with these delays some kills must land while a save is in flight,
    # or the test would not be testing crashes during writes.
    assert killed_mid_write > 0
