"""CheckpointManager restoring from an object-store persistent tier (moto S3 on loopback).

A step only the S3 tier holds is loaded from it directly: each rank fetches
the byte ranges its shards need (checked here by counting every byte s3fs
returns), no copy of the step is written to local disk, and a configured
local tier is refilled in the background afterwards.

The tier's requests run under the manager's ``requests`` policy, like the reader's and the
writer's (tests/test_object_deadlines.py): a stalled PUT of a step's upload and a stalled GET of
a restore (behind the fault proxy, tests/fault_proxy.py) are each abandoned at the policy's
deadline, far below s3fs's own read timeout, and the restore is bit-exact.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fault_proxy
import s3_server
from dist_utils import bit_equal, run_ranks
from manager_utils import assert_state_equal, empty_like_state, make_state
from ucp_dcp import CheckpointManager, RequestPolicy
from ucp_dcp.format import INDEX_FILE
from ucp_dcp.manager.tiers import MARKER_FILE, LocalTier
from ucp_dcp.sources.native import head_request_bytes

s3_bucket = s3_server.s3_bucket  # the session fixtures, made visible to this module
s3_proxy = fault_proxy.s3_proxy

# Rows shard evenly over 2 and 3 ranks; every tensor is 3 MiB, so that the rows of a saved shard one rank
# does not need (a sixth of a tensor) exceed the reader's 256 KiB gap merging (OBJECT_GAP_BYTES): the bytes
# fetched are then the needed ones, not a merged neighbourhood.
ROWS, COLS = 1536, 512


def count_s3_bytes(monkeypatch: Any) -> dict[str, int]:
    """Count every byte s3fs fetches from now on (each GET's answer: ranged, whole, or part of a
    whole-object download), the GETs, and the downloads."""
    import s3fs

    counted = {"bytes": 0, "gets": 0, "downloads": 0}
    real_call, real_get = s3fs.S3FileSystem._call_s3, s3fs.S3FileSystem._get_file

    async def call_s3(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await real_call(self, method, *args, **kwargs)
        if method == "get_object":  # every read's request (the library's ranged GETs, s3fs's own)
            counted["bytes"] += int(out["ContentLength"])
            counted["gets"] += 1
        return out

    async def get_file(self: Any, rpath: str, lpath: str, *args: Any, **kwargs: Any) -> Any:
        counted["downloads"] += 1
        return await real_get(self, rpath, lpath, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    monkeypatch.setattr(s3fs.S3FileSystem, "_get_file", get_file)
    # A filesystem binds its sync methods (get_file, cat_file) when it is created: drop the cached ones.
    s3fs.S3FileSystem.clear_instance_cache()
    return counted


def full_tensors(step: int) -> dict[str, torch.Tensor]:
    """The global tensors of ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(step)
    return {
        "w0": torch.randn(ROWS, COLS, generator=g),
        "w1": torch.randn(ROWS, 2 * COLS, generator=g).to(torch.bfloat16),
        "w2": torch.randn(ROWS, COLS, generator=g),
        "bias": torch.randn(ROWS, generator=g, dtype=torch.float64),
    }


def sharded_state(step: int, world: int, *, fill: float | None = None) -> dict[str, Any]:
    """Row-sharded DTensors of ``full_tensors(step)`` (or filled with ``fill``) on a 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = {k: distribute_tensor(t if fill is None else torch.full_like(t, fill), mesh, [Shard(0)])
             for k, t in full_tensors(step).items()}
    return {"model": model, "step": step if fill is None else -1}


def _save(rank: int, world: int, root: str, options: dict[str, Any]) -> None:
    with CheckpointManager(root, storage_options=options) as mgr:
        mgr.save(7, sharded_state(7, world))
        mgr.wait()


def _restore(rank: int, world: int, root: str, options: dict[str, Any]) -> None:
    state = sharded_state(7, world, fill=13.0)
    with pytest.MonkeyPatch.context() as mp:
        counted = count_s3_bytes(mp)
        with CheckpointManager(root, storage_options=options) as mgr:
            tmp_before = set(os.listdir(os.environ["TMPDIR"]))
            assert mgr.load(state) == 7
            rec = mgr.last_restore
            assert rec is not None and rec.tier == "persistent", rec
            marker = mgr.persistent.marker(7)
        # No whole-object download and no local directory of the step.
        assert counted["downloads"] == 0, counted
        assert set(os.listdir(os.environ["TMPDIR"])) == tmp_before
    assert state["step"] == 7
    want = full_tensors(7)
    need = 0
    for k, t in state["model"].items():
        local = t.to_local()
        start = local.shape[0] * rank
        assert bit_equal(local, want[k][start:start + local.shape[0]]), f"rank {rank}: {k} differs"
        need += local.numel() * local.element_size()
    # Allowance for what is not tensor data: the index, the marker, every data file's header, block checksums and
    # values (all the bytes of the files that are not tensor bytes, however few of them this rank reads).
    tensor_bytes = sum(t.numel() * t.element_size() for t in want.values())
    data_files = sum(d.size for d in marker.files if d.name != INDEX_FILE)
    overhead = (data_files - tensor_bytes) + marker.digest(INDEX_FILE).size + len(marker.encode())
    got = counted["bytes"]
    # What came with the data files' first requests (made by one rank each, for all) counts where
    # that rank fetched it; the reader's own requests are the rest of what this rank needs.
    heads = sum(head_request_bytes(d.size) for d in marker.files if d.name != INDEX_FILE)
    assert need - heads <= got <= 1.05 * need + overhead, (rank, got, need, overhead)
    assert need - heads <= rec.read_bytes <= got, (rec, heads)
    dist.barrier()


@pytest.mark.multiproc
def test_saved_on_2_restored_on_3_reads_only_needed_ranges(s3_bucket, tmp_path, monkeypatch) -> None:
    url, options = s3_bucket
    root = f"{url}/elastic-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where a whole-step download would land
    run_ranks(2, _save, root, options)
    run_ranks(3, _restore, root, options)


def test_single_process_direct_restore_then_background_refill(s3_bucket, tmp_path, monkeypatch) -> None:
    url, options = s3_bucket
    root = f"{url}/single-{uuid.uuid4().hex[:8]}"
    local = str(tmp_path / "local")
    with CheckpointManager(root, storage_options=options, keep_last=3) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state(step, scale=64))
        mgr.wait()
    # Only the S3 tier: loaded straight from it.
    counted = count_s3_bytes(monkeypatch)
    with CheckpointManager(root, storage_options=options) as mgr:
        target = empty_like_state(make_state(2, scale=64))
        assert mgr.load(target) == 2 and mgr.last_restore.tier == "persistent"
        assert_state_equal(target, make_state(2, scale=64))
        assert counted["downloads"] == 0, counted
        assert mgr.last_restore.read_bytes > 0
        monkeypatch.undo()
    # With a local tier: the load reads S3 directly, then the local tier is refilled in the background.
    with CheckpointManager(root, storage_options=options, local=local) as mgr:
        target = empty_like_state(make_state(2, scale=64))
        assert mgr.load(target) == 2 and mgr.last_restore.tier == "persistent"
        assert_state_equal(target, make_state(2, scale=64))
        mgr.wait()  # the refill
        tier = LocalTier(local, name="l")
        assert tier.steps() == [2]
        assert mgr.verify(2, tier="local") == []
        assert not [n for n in os.listdir(local) if n.startswith(".tmp-")]
        target = empty_like_state(make_state(2, scale=64))
        assert mgr.load(target) == 2 and mgr.last_restore.tier == "local"
        assert_state_equal(target, make_state(2, scale=64))


def _change_data_object(mgr: CheckpointManager, step: int, change: Callable[[bytes], bytes]) -> str:
    """Rewrite a data object of persistent ``step`` as ``change`` of its bytes, behind the
    manager's back; its name."""
    fs = mgr.persistent.store.fs
    name = next(d.name for d in mgr.persistent.marker(step).files if d.name not in (INDEX_FILE, MARKER_FILE))
    obj = fs._strip_protocol(f"{mgr.persistent.step_path(step)}/{name}")
    fs.pipe_file(obj, change(fs.cat_file(obj)))
    fs.invalidate_cache()
    return name


def _flip_middle_byte(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0xFF
    return bytes(out)


def test_object_that_disagrees_with_its_marker_falls_back(s3_bucket, caplog) -> None:
    url, options = s3_bucket
    root = f"{url}/short-{uuid.uuid4().hex[:8]}"
    with CheckpointManager(root, storage_options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state(step, scale=8))
        mgr.wait()
        # Truncate a data object of step 2 behind the manager's back.
        name = _change_data_object(mgr, 2, lambda data: data[:-100])
        target = empty_like_state(make_state(1, scale=8))
        assert mgr.load(target) == 1
        assert_state_equal(target, make_state(1, scale=8))
        (attempt,) = mgr.last_restore.failed_attempts
        assert name in attempt and "incomplete" in attempt, attempt


def test_download_restore_commits_a_checked_copy_locally_first(s3_bucket, tmp_path) -> None:
    """``direct_restore=False`` with a local tier: the step is downloaded into the local tier,
    checked against its marker's digests and committed there before the load (the copy a refill
    makes after a direct restore); a copy that fails the check is not committed, and the restore
    falls back."""
    url, options = s3_bucket
    root = f"{url}/download-{uuid.uuid4().hex[:8]}"
    local = str(tmp_path / "local")
    with CheckpointManager(root, storage_options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state(step, scale=8))
        mgr.wait()
        # Flip one byte of a data object of step 2 (its size unchanged) behind the manager's back.
        name = _change_data_object(mgr, 2, _flip_middle_byte)
    with CheckpointManager(root, storage_options=options, local=local, direct_restore=False) as mgr:
        target = empty_like_state(make_state(1, scale=8))
        assert mgr.load(target) == 1 and mgr.last_restore.tier == "persistent"
        assert_state_equal(target, make_state(1, scale=8))
        (attempt,) = mgr.last_restore.failed_attempts
        assert name in attempt and "is corrupt" in attempt, attempt
        assert LocalTier(local, name="l").steps() == [1]  # committed before the load; no refill
        assert mgr.verify(1, tier="local") == []
        assert not [n for n in os.listdir(local) if n.startswith(".tmp-")]
        target = empty_like_state(make_state(1, scale=8))
        assert mgr.load(target, 1) == 1 and mgr.last_restore.tier == "local"
        assert_state_equal(target, make_state(1, scale=8))


def test_download_restore_without_local_tier_removes_a_failed_copy(s3_bucket, tmp_path, monkeypatch) -> None:
    """``direct_restore=False`` and no local tier: each step is downloaded to a temporary
    directory. A step that fails falls back to the previous one, and its directory goes at once,
    whether the download fails (an object gone) or the load of what it fetched does (an object
    shorter than its marker says): a process that restores many times leaks none."""
    url, options = s3_bucket
    root = f"{url}/nolocal-{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with CheckpointManager(root, storage_options=options, direct_restore=False) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state(step, scale=8))
        mgr.wait()
        name = _change_data_object(mgr, 2, lambda data: data[:-100])
        fs = mgr.persistent.store.fs
        for case in ("truncated", "gone"):
            if case == "gone":
                fs.rm_file(fs._strip_protocol(f"{mgr.persistent.step_path(2)}/{name}"))
                fs.invalidate_cache()
            for _ in range(3):
                target = empty_like_state(make_state(1, scale=8))
                assert mgr.load(target) == 1
                assert_state_equal(target, make_state(1, scale=8))
                (attempt,) = mgr.last_restore.failed_attempts
                assert name in attempt and case in attempt.replace("missing", "gone"), attempt
            assert not [n for n in os.listdir(tmp_path) if n.startswith("ucp-restore-")], (case, os.listdir(tmp_path))


def log_s3_requests(monkeypatch: Any) -> dict[str, list[Any]]:
    """Record every GET s3fs makes from now on as ``(object name, bytes)``, and every listing."""
    import s3fs

    log: dict[str, list[Any]] = {"gets": [], "lists": []}
    real_call, real_ls = s3fs.S3FileSystem._call_s3, s3fs.S3FileSystem._ls

    async def call_s3(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await real_call(self, method, *args, **kwargs)
        if method == "get_object":
            log["gets"].append((kwargs["Key"].rsplit("/", 1)[-1], int(out["ContentLength"])))
        return out

    async def ls(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        log["lists"].append(path)
        return await real_ls(self, path, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    monkeypatch.setattr(s3fs.S3FileSystem, "_ls", ls)
    s3fs.S3FileSystem.clear_instance_cache()
    return log


def test_direct_restore_reads_in_large_requests_and_each_marker_once(s3_bucket, monkeypatch) -> None:
    """One process needs the whole step: its tensor bytes come in requests of at most the manager's
    request size (not the reader's default; the store's parts are smaller still), and the manager reads each step's marker
    once, the index once (checked, then handed to the reader), and lists twice plus the step
    directory once."""
    import math

    import ucp_dcp.manager._restore as restore

    url, options = s3_bucket
    root = f"{url}/requests-{uuid.uuid4().hex[:8]}"
    with CheckpointManager(root, storage_options=options, keep_last=3) as mgr:
        for step in (5, 6, 7):
            mgr.save(step, {"model": full_tensors(step), "step": step})
        mgr.wait()
    request = 4 << 20  # smaller than the reader's 16 MiB default, so the count shows whose size it is
    monkeypatch.setattr(restore, "OBJECT_REQUEST_BYTES", request)
    target = {"model": {k: torch.zeros_like(t) for k, t in full_tensors(7).items()}, "step": -1}
    log = log_s3_requests(monkeypatch)  # before the manager opens the store (s3fs binds its methods)
    with CheckpointManager(root, storage_options=options) as mgr:
        for requests in log.values():
            requests.clear()  # start-up cleanup's
        assert mgr.load(target) == 7 and mgr.last_restore.tier == "persistent"
        monkeypatch.undo()
    assert target["step"] == 7
    for k, t in full_tensors(7).items():
        assert bit_equal(target["model"][k], t), k
    tensor_bytes = sum(t.numel() * t.element_size() for t in full_tensors(7).values())
    names = [n for n, _ in log["gets"]]
    data = [n for n, _ in log["gets"] if n.endswith(".safetensors")]
    # The store sends each request as parts that fit the hedge budget (2 MiB here, the least:
    # RequestScheduler.part_bytes), so the GETs are at most the manager's size, never the reader's.
    large = [size for n, size in log["gets"] if size > (64 << 10)]
    assert all(size <= min(request, 2 << 20) for size in large), log["gets"]
    assert len(large) >= math.ceil(tensor_bytes / request), log["gets"]
    assert sum(large) >= tensor_bytes - request, log["gets"]
    assert len(set(data)) == 1
    assert names.count(MARKER_FILE) == 3 + 1, names  # every step's once, the restored one's again
    assert names.count(INDEX_FILE) == 1, names  # checked by the manager, its bytes handed on
    assert len(log["lists"]) <= 3, log["lists"]


# Short deadlines: a stalled request is abandoned after at most two seconds (s3fs's own read
# timeout would hold it 15 s, then retry). The floor is a second, not less: a deadline is wall
# clock, and on a loaded 2-core CI machine a healthy loopback GET beside a restore's other threads
# once took more than 0.3 s, was abandoned and sent again like the stalled ones. Such a request is
# handled right (retried, the restore stays bit-exact), so the counts below are "at least the
# stalls"; the scheduler's exact counts are asserted on a quiet store in test_object_deadlines.
STALL_POLICY = RequestPolicy(deadline_floor_s=1.0, deadline_cap_s=2.0, hedge=False)
SLACK_S = 5.0  # what the rest of a save or a restore may take on loopback moto


def _is_marker(path: str) -> bool:
    return path.split("?")[0].endswith("/" + MARKER_FILE)


def test_a_stalled_upload_of_a_step_is_abandoned_at_the_deadline(s3_proxy: Any) -> None:
    """The first PUT of a step's files (a data file or the index) never answers: the tier's store
    abandons it at the policy's deadline and sends it again; the step commits and restores
    bit-exact."""
    base, options, proxy = s3_proxy
    root = f"{base}/mgr-stall-put-{uuid.uuid4().hex[:8]}"
    proxy.inject("stall", count=1, match=lambda m, p, h: m == "PUT" and not _is_marker(p))
    with CheckpointManager(root, storage_options=options, requests=STALL_POLICY, async_save=False) as mgr:
        t0 = time.monotonic()
        mgr.save(1, make_state(1, scale=16))
        mgr.wait()
        took = time.monotonic() - t0
        stats = mgr.persistent.store.stats
    assert proxy.count(fault="stall") == 1 and proxy.pending() == 0
    assert stats.timeouts >= 1 and stats.retries >= stats.timeouts, stats
    assert took < STALL_POLICY.deadline_cap_s + SLACK_S, took
    with CheckpointManager(root, storage_options=options) as mgr:
        target = empty_like_state(make_state(1, scale=16))
        assert mgr.load(target) == 1
    assert_state_equal(target, make_state(1, scale=16))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "download"])
def test_a_stalled_get_of_a_restore_is_abandoned_at_the_deadline_and_bit_exact(s3_proxy: Any, direct: bool) -> None:
    """The tier's GET of the step's marker and the first ranged GET of its data (the reader's, for
    a direct restore; the tier's download otherwise) never answer: each is abandoned at the
    policy's deadline and sent again, and the restore is bit-exact."""
    base, options, proxy = s3_proxy
    root = f"{base}/mgr-stall-get-{uuid.uuid4().hex[:8]}"
    with CheckpointManager(root, storage_options=options) as mgr:
        mgr.save(2, make_state(2, scale=16))
        mgr.wait()
    proxy.reset_records()
    proxy.inject("stall", count=1, match=lambda m, p, h: m == "GET" and _is_marker(p))
    proxy.inject("stall", count=1, match=lambda m, p, h: m == "GET" and h.get("Range") is not None)
    with CheckpointManager(
        root, storage_options=options, requests=STALL_POLICY, direct_restore=direct
    ) as mgr:
        target = empty_like_state(make_state(2, scale=16))
        t0 = time.monotonic()
        assert mgr.load(target) == 2 and mgr.last_restore.tier == "persistent"
        took = time.monotonic() - t0
        tier_stats = mgr.persistent.store.stats
    assert_state_equal(target, make_state(2, scale=16))
    assert proxy.count(fault="stall") == 2 and proxy.pending() == 0
    # The tier's own stalls: the marker's, and the data's when the tier downloads (a direct
    # restore's ranged GET is the reader's, counted by its own scheduler).
    assert tier_stats.timeouts >= (1 if direct else 2) and tier_stats.retries >= tier_stats.timeouts, tier_stats
    # Two stalls in a row at most, each abandoned at its deadline (the cap at the most).
    assert took < 2 * STALL_POLICY.deadline_cap_s + SLACK_S, took
