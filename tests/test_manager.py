"""CheckpointManager in one process (no process group): async, isolation, commit, retention, tiers."""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

import ucp_dcp.byteio.durable
from manager_utils import assert_state_equal, empty_like_state, flip_byte, make_state
from ucp_dcp import CheckpointManager, NoCheckpointError
from ucp_dcp.manager.manager import CheckpointSaveError
from ucp_dcp.errors import InvalidArgumentError
from ucp_dcp.format import INDEX_FILE
from ucp_dcp.manager.snapshot import NonFiniteError
from ucp_dcp.manager.tiers import LocalTier


def _load(mgr: CheckpointManager, step: int | None = None) -> tuple[int, dict]:
    target = empty_like_state(make_state(0))
    got = mgr.load(target, step=step)
    return got, target


def test_round_trip_and_listing(tmp_path) -> None:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.steps() == []
        with pytest.raises(NoCheckpointError, match="nothing to restore"):
            mgr.load(empty_like_state(make_state(0)))
        for step in (1, 2):
            assert mgr.save(step, make_state(step))
        mgr.wait()
        assert mgr.steps() == [1, 2]
        step, target = _load(mgr)
        assert step == 2
        assert_state_equal(target, make_state(2))
        step, target = _load(mgr, step=1)
        assert_state_equal(target, make_state(1))
        assert [r.step for r in mgr.stats()] == [1, 2]
        assert all(r.nbytes > 0 and r.tiers == ("persistent",) for r in mgr.stats())
        assert mgr.verify(2) == []
    # Only committed step directories, no staging leftovers.
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-000000000001", "step-000000000002"]


def test_snapshot_isolation(tmp_path) -> None:
    state = make_state(3)
    want = make_state(3)
    with CheckpointManager(tmp_path, max_in_flight=2) as mgr:
        mgr.save(3, state)
        # The training loop changes everything in place right away.
        for t in state["model"].values():
            t.add_(1)
        state["optim"]["state"]["count"].add_(5)
        state["history"].append(99)
        state["step"] = 4
        mgr.wait()
        _, target = _load(mgr)
    assert_state_equal(target, want)


def test_backpressure_and_in_flight_saves_all_commit(tmp_path) -> None:
    with CheckpointManager(tmp_path, max_in_flight=2, keep_last=10) as mgr:
        for step in range(1, 6):
            mgr.save(step, make_state(step))
        mgr.wait()
        assert mgr.steps() == [1, 2, 3, 4, 5]
        for step in (1, 5):
            _, target = _load(mgr, step)
            assert_state_equal(target, make_state(step))


def test_background_error_surfaces_and_keeps_earlier_steps(tmp_path, monkeypatch) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, make_state(1))
    mgr.wait()

    def no_space(fd: int, data, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ucp_dcp.byteio.durable, "_pwrite", no_space)
    assert mgr.save(2, make_state(2))  # returns: the write fails in the background
    with pytest.raises(CheckpointSaveError, match="No space left on device") as ei:
        mgr.wait()
    assert ei.value.step == 2
    monkeypatch.undo()
    assert mgr.steps() == [1]
    assert sorted(os.listdir(tmp_path)) == ["step-000000000001"], "the failed save left files behind"
    _, target = _load(mgr)
    assert_state_equal(target, make_state(1))
    # The next save works again.
    mgr.save(3, make_state(3))
    mgr.close()
    assert CheckpointManager(tmp_path).steps() == [1, 3]


def test_error_surfaces_at_next_save(tmp_path, monkeypatch) -> None:
    mgr = CheckpointManager(tmp_path)

    def no_space(fd: int, data, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ucp_dcp.byteio.durable, "_pwrite", no_space)
    mgr.save(1, make_state(1))
    mgr._futures[-1].exception()  # let it fail
    monkeypatch.undo()
    with pytest.raises(CheckpointSaveError, match="step 1"):
        mgr.save(2, make_state(2))
    mgr.save(2, make_state(2))
    mgr.close()
    assert CheckpointManager(tmp_path).steps() == [2]


def test_sync_mode(tmp_path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(7, make_state(7))
        assert mgr.steps() == [7]  # committed when save returns


def test_nonfinite_error_names_tensors(tmp_path) -> None:
    state = make_state(1)
    state["model"]["layer.bias"][3] = float("nan")
    state["model"]["embed.weight"][0, 0] = float("-inf")
    with CheckpointManager(tmp_path, nonfinite="error") as mgr:
        with pytest.raises(NonFiniteError, match=r"refusing to save step 1: NaN/Inf in 2 tensor\(s\): "
                           r"model\.embed\.weight \(rank 0\), model\.layer\.bias \(rank 0\)"):
            mgr.save(1, state)
        assert mgr.steps() == []


def test_nonfinite_flag_is_recorded_and_skipped_by_default(tmp_path) -> None:
    with CheckpointManager(tmp_path, nonfinite="flag") as mgr:
        mgr.save(1, make_state(1))
        bad = make_state(2)
        bad["model"]["layer.bias"][0] = float("inf")
        mgr.save(2, bad)
        mgr.wait()
        assert mgr.steps() == [1, 2]
        assert mgr.persistent.marker(2).nonfinite == {"model.layer.bias": [0]}
        step, target = _load(mgr)
        assert step == 1  # the poisoned step is not picked by default
        assert_state_equal(target, make_state(1))
        step, target = _load(mgr, step=2)  # but can be asked for
        assert_state_equal(target, bad)


def test_retention_keeps_the_newest_step_a_default_load_restores(tmp_path) -> None:
    """With nonfinite="flag", steps holding NaN or Inf after the last finite one count towards
    keep_last but are not what load() picks: the last finite step is kept anyway."""
    with CheckpointManager(tmp_path, nonfinite="flag", keep_last=2) as mgr:
        mgr.save(1, make_state(1))
        for step in (2, 3, 4):
            bad = make_state(step)
            bad["model"]["layer.bias"][0] = float("nan")
            mgr.save(step, bad)
        mgr.wait()
        assert mgr.steps() == [1, 3, 4]
        step, target = _load(mgr)
        assert step == 1
        assert_state_equal(target, make_state(1))


def test_a_malformed_marker_is_skipped_not_raised(tmp_path) -> None:
    """A COMMIT.json nested deeper than the JSON parser recurses, or holding an integer of more
    digits than Python converts, is a damaged step like any other: listed as not committed, and
    the load falls back."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
        mgr.wait()
        marker = Path(mgr.persistent.step_path(2)) / "COMMIT.json"
    assert marker.is_file()
    for junk in (b"[" * 100_000 + b"]" * 100_000, b'{"step": ' + b"9" * 5000 + b"}"):
        marker.write_bytes(junk)
        with CheckpointManager(tmp_path) as mgr:
            assert mgr.steps() == [1]
            step, target = _load(mgr)
            assert step == 1
            assert_state_equal(target, make_state(1))


def test_bad_arguments_are_named_and_leave_the_manager_usable(tmp_path) -> None:
    """Arguments of the wrong kind are refused with the library's errors, before a save takes its
    slot: a bad ``extra`` once left the slot taken, and the next save waited forever."""
    import threading

    from ucp_dcp import CheckpointConfig
    from ucp_dcp.errors import InvalidArgumentTypeError, UnsupportedValueError

    for kw, err, says in [
        ({"root": None}, InvalidArgumentTypeError, "root must be a path"),
        ({"config": {"keep_last": 2}}, InvalidArgumentTypeError, "config must be a CheckpointConfig"),
        ({"keep_lats": 2}, InvalidArgumentTypeError, "unknown option(s) ['keep_lats']"),
        ({"on_reshard": None}, InvalidArgumentTypeError, "on_reshard must be a sequence of callables"),
        ({"ranks_per_node": "2"}, InvalidArgumentError, "ranks_per_node must be None or an int >= 1"),
        ({"local": "/x/{nod}"}, InvalidArgumentError, "the only placeholder is '{node}'"),
        ({"async_save": "no"}, InvalidArgumentTypeError, "CheckpointConfig.async_save must be True or False"),
        ({"local": 3}, InvalidArgumentTypeError,
         "CheckpointConfig.local must be None or a directory (str or os.PathLike, '{node}' standing for the node), got int"),
    ]:
        root = kw.pop("root", tmp_path)
        with pytest.raises(err, match=re.escape(says)):
            CheckpointManager(root, **kw)
    assert isinstance(CheckpointConfig(local=tmp_path / "loc"), CheckpointConfig)
    with CheckpointManager(tmp_path, local=tmp_path / "loc-{node}", max_in_flight=1) as mgr:
        for call, err, says in [
            (lambda: mgr.save(1, None), InvalidArgumentTypeError, "state must be a mapping"),
            # Each once went through the restore: a list failed inside it as an AttributeError
            # wrapped in CheckpointRestoreError, step="1" as "nothing to restore".
            (lambda: mgr.load([1]), InvalidArgumentTypeError, "CheckpointManager.load: state must be a mapping"),
            (lambda: mgr.load(make_state(1), step="1"), InvalidArgumentError,
             "CheckpointManager.load: step must be a non-negative integer, got '1'"),
            (lambda: mgr.load(make_state(1), step=-1), InvalidArgumentError, "step must be a non-negative integer"),
            (lambda: mgr.save(1, make_state(1), extra=[("a", 1), "b"]), InvalidArgumentTypeError, "extra must be"),
            (lambda: mgr.save(1, make_state(1), extra={"a": object()}), InvalidArgumentError, "extra is not JSON"),
            # The marker is strict JSON: a NaN loss used to pass save() and fail the save in the background.
            (lambda: mgr.save(1, make_state(1), extra={"loss": float("nan")}), InvalidArgumentError,
             "extra is not JSON (Out of range float values are not JSON compliant"),
            (lambda: mgr.save(1, {**make_state(1), "g": (x for x in ())}), UnsupportedValueError, "g: a generator"),
            (lambda: mgr.save(1, {**make_state(1), "t": torch.empty(2, device="meta")}), UnsupportedValueError,
             "t: a meta tensor"),
        ]:
            with pytest.raises(err, match=re.escape(says)):
                call()
        done = threading.Event()
        t = threading.Thread(target=lambda: (mgr.save(2, make_state(2)), mgr.wait(), done.set()), daemon=True)
        t.start()
        t.join(60)
        assert done.is_set(), "a save after refused ones did not finish: its slot was never given back"
        assert mgr.steps() == [2]


def test_retention_keep_last_and_every(tmp_path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, keep_every=4) as mgr:
        for step in range(1, 10):
            mgr.save(step, make_state(step))
        mgr.wait()
        assert mgr.steps() == [4, 8, 9]


@pytest.mark.parametrize("field", ["keep_last", "local_keep_last", "max_in_flight", "persistent_interval"])
def test_bad_config_is_named(tmp_path, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"CheckpointConfig.{field} must be an int >= 1, got 0"):
        CheckpointManager(tmp_path, **{field: 0})
    # A bool is an int to Python, never a count here (keep_last=True kept one step).
    with pytest.raises(InvalidArgumentError, match=f"CheckpointConfig.{field} must be an int >= 1, got True"):
        CheckpointManager(tmp_path, **{field: True})


def test_keep_every_refuses_a_bool(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match="CheckpointConfig.keep_every must be None or an int >= 1, got True"):
        CheckpointManager(tmp_path, keep_every=True)


@pytest.mark.parametrize("step", [-1, True, 1.0])
def test_save_refuses_a_step_that_is_not_a_non_negative_int(tmp_path, step: object) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(InvalidArgumentError, match="CheckpointManager.save: step must be a non-negative integer"):
            mgr.save(step, make_state(0))  # type: ignore[arg-type]
        assert mgr.steps() == []


def test_two_tiers_intervals_and_fallback_to_persistent(tmp_path) -> None:
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with CheckpointManager(shared, local=local, persistent_interval=2, local_keep_last=2, keep_last=5) as mgr:
        for step in range(1, 6):
            mgr.save(step, make_state(step))
        mgr.wait()
        assert LocalTier(local, name="l").steps() == [4, 5]
        assert LocalTier(shared, name="p").steps() == [2, 4]
        assert [r.tiers for r in mgr.stats()][:2] == [("local",), ("local", "persistent")]
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier) == (5, "local")
        assert_state_equal(target, make_state(5))
    shutil.rmtree(local)  # the node's disk is gone
    with CheckpointManager(shared, local=local, persistent_interval=2) as mgr:
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier) == (4, "persistent")
        assert_state_equal(target, make_state(4))


def test_corrupt_local_copy_falls_back_to_persistent_copy_of_same_step(tmp_path) -> None:
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with CheckpointManager(shared, local=local) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
        mgr.wait()
    step_dir = LocalTier(local, name="l").step_path(2)
    data = [n for n in os.listdir(step_dir) if n.endswith(".safetensors")][0]
    from ucp_dcp import Checkpoint
    with Checkpoint(step_dir) as ck:
        (box, loc), = ck.chunks("model.embed.weight")
    flip_byte(os.path.join(step_dir, data), random.Random(0), loc.start, loc.start + loc.nbytes)
    with CheckpointManager(shared, local=local) as mgr:
        problems = mgr.verify(2, tier="local")
        assert any(data in p and "corrupt" in p for p in problems), problems
        assert any("model.embed.weight" in p for p in problems), problems
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier) == (2, "persistent")
        (attempt,) = mgr.last_restore.failed_attempts
        assert "step 2 from the local tier failed" in attempt and "model.embed.weight" in attempt
        assert_state_equal(target, make_state(2))


def count_file_reads(monkeypatch, paths: list[str]) -> dict[str, int]:
    """Bytes read from each of ``paths`` from now on, by any ``os.pread``/``os.preadv`` call (how
    the reader reads files) or Python file object (how whole-file digests and small files read;
    ``pathlib`` opens through ``io.open``)."""
    import builtins
    import io

    by_inode = {(os.stat(p).st_dev, os.stat(p).st_ino): os.path.basename(p) for p in paths}
    counted = dict.fromkeys(by_inode.values(), 0)

    def add(fd: int, n: int) -> None:
        st = os.fstat(fd)
        name = by_inode.get((st.st_dev, st.st_ino))
        if name is not None:
            counted[name] += n

    real_pread, real_preadv, real_open = os.pread, os.preadv, builtins.open

    def pread(fd: int, n: int, offset: int) -> bytes:
        data = real_pread(fd, n, offset)
        add(fd, len(data))
        return data

    def preadv(fd: int, bufs, offset: int, *flags) -> int:
        n = real_preadv(fd, bufs, offset, *flags)
        add(fd, n)
        return n

    def opened(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "r" in mode and isinstance(file, (str, os.PathLike)) and os.path.basename(file) in counted:
            counted[os.path.basename(file)] += os.fstat(f.fileno()).st_size  # assume read whole
        return f

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(builtins, "open", opened)
    monkeypatch.setattr(io, "open", opened)
    return counted


def test_local_restore_reads_each_data_byte_once(tmp_path, monkeypatch) -> None:
    """Checks ride on the read: the restore hashes no whole file, and reads no data file byte
    twice (the index is checked against the marker; data against its block checksums as it
    arrives)."""
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with CheckpointManager(shared, local=local, persistent_interval=10**9) as mgr:
        mgr.save(1, make_state(1, scale=64))
        mgr.wait()
        step_dir = mgr.local.step_path(1)
    data = [os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".safetensors")]
    size = sum(os.path.getsize(p) for p in data)
    counted = count_file_reads(monkeypatch, data)
    with CheckpointManager(shared, local=local, persistent_interval=10**9) as mgr:
        target = empty_like_state(make_state(1, scale=64))
        assert mgr.load(target) == 1 and mgr.last_restore.tier == "local"
        assert_state_equal(target, make_state(1, scale=64))
        rec = mgr.last_restore
    monkeypatch.undo()
    tensors = sum(t.numel() * t.element_size() for t in make_state(1, scale=64)["model"].values())
    assert tensors <= rec.verified_bytes <= rec.read_bytes <= size, (rec, size)
    assert tensors <= sum(counted.values()) <= size, (counted, size)


def test_local_restore_reads_the_index_once_and_loads_what_was_checked(tmp_path, monkeypatch):
    """The index is read once, for the digest check against the commit marker, and the load parses
    those bytes: an index replaced on disk after the check does not reach the load."""
    from ucp_dcp.manager._restore import Restorer

    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with CheckpointManager(shared, local=local, persistent_interval=10**9) as mgr:
        mgr.save(1, make_state(1))
        mgr.wait()
        index = os.path.join(mgr.local.step_path(1), INDEX_FILE)
    counted = count_file_reads(monkeypatch, [index])
    with CheckpointManager(shared, local=local, persistent_interval=10**9) as mgr:
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier, mgr.last_restore.failed_attempts) == (1, "local", ())
    assert counted[INDEX_FILE] == os.path.getsize(index)
    assert_state_equal(target, make_state(1))
    monkeypatch.undo()

    checked = Restorer._check_index

    def check_then_damage(self, path: str, cand) -> bytes:
        data = checked(self, path, cand)
        with open(os.path.join(path, INDEX_FILE), "wb") as f:
            f.write(b"{")  # after the check: a reader that read the file again would fail
        return data

    monkeypatch.setattr(Restorer, "_check_index", check_then_damage)
    with CheckpointManager(shared, local=local, persistent_interval=10**9) as mgr:
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier, mgr.last_restore.failed_attempts) == (1, "local", ())
    assert_state_equal(target, make_state(1))


def test_restore_pauses_the_cyclic_collector_for_the_whole_load(tmp_path, monkeypatch) -> None:
    """Index parsing and planning run with Python's cyclic collector paused (a full collection
    walks the whole heap), and it runs again after the restore, a failed attempt included."""
    import gc

    from ucp_dcp import UCPLoadPlanner, UCPStorageReader

    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with CheckpointManager(shared, local=local) as mgr:
        mgr.save(1, make_state(1))
        mgr.wait()
    seen: dict[str, bool] = {}
    read_metadata, plan = UCPStorageReader.read_metadata, UCPLoadPlanner.create_local_plan

    def read_metadata_seen(self, *a, **k):
        seen["read_metadata"] = gc.isenabled()
        return read_metadata(self, *a, **k)

    def plan_seen(self):
        seen["create_local_plan"] = gc.isenabled()
        if seen.pop("fail", False):
            raise RuntimeError("planning failed")
        return plan(self)

    monkeypatch.setattr(UCPStorageReader, "read_metadata", read_metadata_seen)
    monkeypatch.setattr(UCPLoadPlanner, "create_local_plan", plan_seen)
    assert gc.isenabled()
    with CheckpointManager(shared, local=local) as mgr:
        assert _load(mgr)[0] == 1
        assert seen == {"read_metadata": False, "create_local_plan": False}
        assert gc.isenabled()
        seen["fail"] = True  # the local copy's load fails inside dcp.load; the persistent one loads
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier) == (1, "persistent")
        assert "planning failed" in mgr.last_restore.failed_attempts[0]
        assert gc.isenabled() and seen["create_local_plan"] is False
    assert_state_equal(target, make_state(1))


def test_goodput_from_measured_saves(tmp_path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, make_state(step))
        mgr.wait()
        est = mgr.goodput(mtbf_s=3600.0, restart_s=60.0)
        assert est.saves == 3 and est.blocking_s > 0 and est.write_s > 0 and 0 < est.effective_ratio < 1
        assert est.optimal_interval_s > 0


def test_stats_count_each_rank_s_bytes(tmp_path) -> None:
    state = {"w": torch.randn(256, 1024)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        mgr.wait()
        (rec,) = mgr.stats()
        assert rec.nbytes >= 256 * 1024 * 4


# ---------------------------------------------------------------- object store (moto S3 on loopback)
import uuid  # noqa: E402

import s3_server  # noqa: E402

s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module


def test_s3_tier_round_trip_and_restore_into_local(tmp_path, s3_bucket) -> None:
    url, options = s3_bucket
    root = f"{url}/mgr-{uuid.uuid4().hex[:8]}"
    local = str(tmp_path / "local")
    # Straight to S3 (no local tier): staged in a scratch directory, uploaded, marker last.
    with CheckpointManager(root, storage_options=options, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state(step))
        mgr.wait()
        assert mgr.steps() == [2, 3]
        assert mgr.verify(3) == []
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier) == (3, "persistent")
        assert_state_equal(target, make_state(3))
    # A job with a local tier restores from S3 and keeps the copy locally (copied in the background).
    with CheckpointManager(root, storage_options=options, local=local) as mgr:
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier) == (3, "persistent")
        assert_state_equal(target, make_state(3))
        mgr.wait()
        assert LocalTier(local, name="l").steps() == [3]
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier) == (3, "local")
        # Saves drain from the local tier to S3.
        mgr.save(4, make_state(4))
        mgr.wait()
        assert mgr.persistent.steps() == [2, 3, 4]  # keep_last=3 by default
    with CheckpointManager(root, storage_options=options) as mgr:
        step, target = _load(mgr)
        assert_state_equal(target, make_state(4))


def test_a_manager_that_cannot_start_leaves_no_thread_and_a_closed_one_refuses(tmp_path) -> None:
    """A local tier that cannot be created fails the constructor with the tier's StorageError and
    no worker thread left running; close() twice is harmless; a closed manager refuses work;
    verify names a step that no tier holds."""
    import threading

    from ucp_dcp.errors import InvalidArgumentError, InvalidStateError, StorageError

    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    before = {t for t in threading.enumerate() if t.name.startswith("ucp-ckpt")}
    with pytest.raises(StorageError, match=rf"^tier 'local' \({blocker}/loc\): cannot create the tier directory"):
        CheckpointManager(tmp_path / "ckpt", local=blocker / "loc")
    assert {t for t in threading.enumerate() if t.name.startswith("ucp-ckpt")} == before

    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, make_state(1))
    mgr.wait()
    assert mgr.verify(2) == ["step 2: not committed in persistent"]
    assert mgr.verify(1, tier="local") == ["step 1: this manager has no local tier (made without local=)"]
    with pytest.raises(InvalidArgumentError, match=r"^tier must be 'local', 'persistent' or None, got 'remote'$"):
        mgr.verify(1, tier="remote")
    # torch cannot allocate the staging copy (4 PiB for an expanded view): the step's save error,
    # the backpressure slot given back, so the next save runs
    with pytest.raises(CheckpointSaveError, match=r"^checkpoint save of step 3 failed: staging the state's copy failed: .*can't allocate memory"):
        mgr.save(3, {"huge": torch.zeros(1).expand(2**50)})
    mgr.save(4, make_state(4))
    mgr.wait()
    assert mgr.verify(4) == []
    mgr.close()
    mgr.close()
    with pytest.raises(InvalidStateError, match=r"^this CheckpointManager is closed \(close\(\) was called\); create a new one$"):
        mgr.save(2, make_state(2))


def test_a_failed_refill_or_retention_is_logged_not_raised(tmp_path, caplog, monkeypatch) -> None:
    """Restored straight from an object store, a local tier that cannot be listed nor take the
    copy (its root replaced by a file) only logs; a retention whose delete fails (EIO) logs, and
    the save it follows stays committed; a persistent tier that cannot be listed fails the
    restore with the library's error (a raw NotADirectoryError escaped before, raised by the one
    rank that lists the tier while the others waited for its answer)."""
    import logging

    import ucp_dcp.manager.tiers.local as local_tier

    root = f"memory://ucp-mgr-{uuid.uuid4().hex[:8]}/ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    local = tmp_path / "local"
    caplog.set_level(logging.INFO, logger="ucp_dcp.manager.manager")
    with CheckpointManager(root, local=local) as mgr:
        os.rmdir(local)
        local.write_bytes(b"not a directory")
        step, target = _load(mgr)
        assert (step, mgr.last_restore.tier) == (1, "persistent")
        assert_state_equal(target, make_state(1))
        mgr.wait()  # the refill failed in the background: not raised
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned[0] == (
        f"node 0: listing the local tier: StorageError: tier 'local' ({local}): cannot list "
        f"{local}: Not a directory; restoring from the other copies"
    ), warned
    assert len(warned) == 2 and warned[1].startswith(
        f"node 0: refilling the local tier {local} with step 1 failed: "
    ), warned

    caplog.clear()
    with CheckpointManager(tmp_path / "ckpt", keep_last=1) as mgr:
        mgr.save(1, make_state(1))
        mgr.wait()

        def broken_rmtree(path, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

        monkeypatch.setattr(local_tier.shutil, "rmtree", broken_rmtree)
        mgr.save(2, make_state(2))
        mgr.wait()
        monkeypatch.undo()
        assert mgr.steps() == [2]  # step 1's marker went first: it is no longer committed
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and re.fullmatch(  # step 1 was renamed out of view, then removed
        re.escape(f"retention in the persistent tier ({tmp_path / 'ckpt'}) failed: [Errno 5] "
                  f"Input/output error: '{tmp_path / 'ckpt'}/.del-step-000000000001-") + "[0-9a-z]+'",
        warned[0],
    ), warned

    from ucp_dcp.errors import CheckpointRestoreError

    gone = tmp_path / "gone"
    with CheckpointManager(gone) as mgr:
        os.rmdir(gone)
        gone.write_bytes(b"not a directory")
        with pytest.raises(CheckpointRestoreError) as ei:
            _load(mgr)
    assert str(ei.value) == (
        f"rank 0: listing the persistent tier: StorageError: tier 'persistent' ({gone}): cannot list "
        f"{gone}: Not a directory"
    )
