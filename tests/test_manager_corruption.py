"""Corruption: random byte flips, truncation, deleted files, a malformed index.

Every flip anywhere in a step's files is reported by ``verify`` (whole-file
digests in the commit marker). ``load`` must never hand back wrong data: a
flip in bytes it uses (the index, a chunk, a value, a header field that
locates them) makes it fall back, to the other tier's copy of the same step
or to the previous step; a flip in bytes it does not use (alignment padding,
header whitespace) leaves the loaded state bit-exact.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest

from manager_utils import assert_state_equal, empty_like_state, flip_byte, make_state, restore_byte
from ucp_dcp import Checkpoint, CheckpointManager, CheckpointRestoreError
from ucp_dcp.format import INDEX_FILE

TRIALS_PER_CASE = int(os.environ.get("UCP_CORRUPTION_TRIALS", "30"))


def _used_ranges(step_dir: str) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of each file that hold chunk or value data."""
    out: dict[str, list[tuple[int, int]]] = {}
    with Checkpoint(step_dir) as ck:
        names = [f.name for f in ck.index.files]
        locs = [loc for t in ck.tensor_names() for _, loc in ck.chunks(t)]
        locs += list(ck.index.values.values())
        for loc in locs:
            out.setdefault(names[loc.file], []).append((loc.start, loc.start + loc.nbytes))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("corrupt")
    local, shared = str(base / "local"), str(base / "shared")
    with CheckpointManager(shared, local=local) as mgr:
        mgr.save(1, make_state(1, scale=4))
        mgr.save(2, make_state(2, scale=4))
        mgr.wait()
    return local, shared


def _restore(local: str, shared: str) -> tuple[int, str, tuple[str, ...], dict]:
    with CheckpointManager(shared, local=local) as mgr:
        target = empty_like_state(make_state(0, scale=4))
        step = mgr.load(target)
        rec = mgr.last_restore
        return step, rec.tier, rec.failed_attempts, target


@pytest.mark.parametrize("case", ["local-copy", "only-copy"])
def test_random_flips_are_detected(saved: tuple[str, str], case: str, tmp_path) -> None:
    local, shared = saved
    if case == "only-copy":  # no local tier at all: the fallback is the previous step
        local = str(tmp_path / "empty-local")
    tier_root = saved[0] if case == "local-copy" else shared
    step_dir = os.path.join(tier_root, "step-000000000002")
    used = _used_ranges(step_dir)
    files = sorted(n for n in os.listdir(step_dir) if n.endswith(".safetensors") or n == INDEX_FILE)
    rng = random.Random(7 if case == "local-copy" else 8)
    detected_by_load = 0
    for trial in range(TRIALS_PER_CASE):
        name = rng.choice(files)
        path = os.path.join(step_dir, name)
        # Half the flips aim at data bytes, half anywhere in the file.
        if name in used and rng.random() < 0.5:
            lo, hi = rng.choice(used[name])
            off, old = flip_byte(path, rng, lo, hi)
        else:
            off, old = flip_byte(path, rng)
        try:
            with CheckpointManager(shared, local=local) as mgr:
                problems = mgr.verify(2)
            assert any(name in p for p in problems), f"trial {trial}: flip at {name}:{off} not reported: {problems}"
            step, tier, attempts, target = _restore(local, shared)
            in_data = name == INDEX_FILE or any(lo <= off < hi for lo, hi in used.get(name, []))
            if attempts:
                detected_by_load += 1
                assert "step 2 from the" in attempts[0], attempts
                want = (2, "persistent") if case == "local-copy" else (1, "persistent")
                assert (step, tier) == want, (trial, name, off, attempts)
            else:
                # Not noticed by load: then it must not have touched anything load uses.
                assert not in_data, f"trial {trial}: flip in used bytes of {name} at {off} went unnoticed"
                assert step == 2
            assert_state_equal(target, make_state(step, scale=4))
        finally:
            restore_byte(path, off, old)
    assert detected_by_load >= TRIALS_PER_CASE // 2


def test_truncated_deleted_and_malformed(saved: tuple[str, str], tmp_path) -> None:
    local, shared = saved
    # Work on a copy of the persistent tier (no local tier), so the cases do not interact.
    root = str(tmp_path / "shared")
    shutil.copytree(shared, root)
    step_dir = os.path.join(root, "step-000000000002")
    data = sorted(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))[0]
    nolocal = str(tmp_path / "nolocal")

    def check(expect: str) -> None:
        with CheckpointManager(root, local=nolocal) as mgr:
            problems = mgr.verify(2)
            assert any(expect in p for p in problems), problems
            target = empty_like_state(make_state(0, scale=4))
            assert mgr.load(target) == 1
            (attempt,) = mgr.last_restore.failed_attempts
            assert "step 2 from the persistent tier failed" in attempt
            assert_state_equal(target, make_state(1, scale=4))
            return attempt

    path = os.path.join(step_dir, data)
    with open(path, "rb") as f:
        blob = f.read()
    with open(path, "r+b") as f:
        f.truncate(len(blob) // 2)
    attempt = check(f"{data} (written by rank 0) is corrupt: {len(blob) // 2} bytes")
    assert data in attempt
    os.remove(path)
    attempt = check(f"{data} (written by rank 0) is missing")
    assert data in attempt
    with open(path, "wb") as f:
        f.write(blob)
    index = os.path.join(step_dir, INDEX_FILE)
    with open(index, "rb") as f:
        good = f.read()
    with open(index, "wb") as f:
        f.write(good[: len(good) // 3])  # malformed JSON
    attempt = check(f"{INDEX_FILE} (the index) is corrupt")
    assert "does not match its commit marker" in attempt
    # Every copy of every step damaged: a clear error listing each attempt.
    os.remove(os.path.join(root, "step-000000000001", INDEX_FILE))
    with CheckpointManager(root, local=nolocal) as mgr:
        with pytest.raises(CheckpointRestoreError, match="no copy of any candidate step") as ei:
            mgr.load(empty_like_state(make_state(0, scale=4)))
        assert len(ei.value.attempts) == 2
