"""Placement proofs through CheckpointManager (issue 25): ``placement_digests`` saves them on every
tier, ``read=ReadOptions(verify_placement=True)`` checks every restore, from the local tier, a local persistent tier and
an object-store one (loaded from it directly). A wrong placement (a load planner that puts two
rows of a tensor in each other's place, as tests/test_placement.py does to UCPStorageReader) fails
each copy naming the tensor, and the restore says so for every attempt; a step saved without
digests says that instead. One process, no process group.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner import ReadItem

import s3_server
import ucp_dcp.manager._restore
from manager_utils import assert_state_equal, empty_like_state, make_state
from ucp_dcp import CheckpointManager, ReadOptions, UCPLoadPlanner
from ucp_dcp.core.placement_digest import box_share, digest_hex
from ucp_dcp.errors import CheckpointRestoreError
from ucp_dcp.format import INDEX_FILE
from ucp_dcp.manager.tiers import LocalTier

s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module

BAD = "model.embed.weight"  # 37 x 24 float32
TENSORS = ("model.embed.weight", "model.layer.bias", "model.layer.weight", "optim.state.count")


class _SwapRowsAfterRead(UCPLoadPlanner):
    """Puts rows 0 and 1 of :data:`BAD` in each other's place once their read is done."""

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if read_item.dest_index.fqn == BAD:
            tensor[[0, 1]] = tensor[[1, 0]]
        super().commit_tensor(read_item, tensor)


def _digests(index: bytes) -> dict[str, str]:
    return {k: t["placement_digest"] for k, t in json.loads(index)["tensors"].items()}


def _digest(t: torch.Tensor) -> str:
    """The placement digest of a whole tensor (one box, the tensor itself)."""
    return digest_hex(box_share(t, (0,) * t.dim(), t.shape))


def _wrong(where: str) -> str:
    """The exact error of a load of step 1 whose planner swapped :data:`BAD`'s first two rows."""
    saved = make_state(1)["model"]["embed.weight"]
    swapped = saved.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    got, recorded = _digest(swapped), _digest(saved)
    return (
        f"rank 0: PlacementError: {where}: the load did not put every element where the save "
        f"found it, 1 tensor(s): '{BAD}': its 1 loaded copy hash to {got}, the save recorded "
        f"{recorded} (elements in the wrong places, or wrong values)"
    )


def _restore(mgr: CheckpointManager) -> dict[str, Any]:
    target = empty_like_state(make_state(0))
    assert mgr.load(target) == 1
    return target


def test_local_tiers_save_digests_and_restores_prove_placement(tmp_path: Path, monkeypatch: Any) -> None:
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    opts = {"local": local, "placement_digests": True, "read": ReadOptions(verify_placement=True)}
    with CheckpointManager(shared, **opts) as mgr:
        mgr.save(1, make_state(1))
        mgr.wait()
        local_dir, shared_dir = LocalTier(local, name="l").step_path(1), LocalTier(shared, name="p").step_path(1)
        recorded = _digests(Path(local_dir, INDEX_FILE).read_bytes())
        assert sorted(recorded) == sorted(TENSORS) and recorded[BAD] == _digest(make_state(1)["model"]["embed.weight"])
        assert _digests(Path(shared_dir, INDEX_FILE).read_bytes()) == recorded
        assert_state_equal(_restore(mgr), make_state(1))
        report = mgr.last_restore
        assert report.tier == "local" and report.placement is not None
        assert report.placement.checked == TENSORS and report.placement.copies == dict.fromkeys(TENSORS, 1)

        # A wrong placement fails the local copy, then the persistent one, each naming the tensor.
        monkeypatch.setattr(ucp_dcp.manager._restore, "UCPLoadPlanner", _SwapRowsAfterRead)
        with pytest.raises(CheckpointRestoreError) as e:
            mgr.load(empty_like_state(make_state(0)))
        assert e.value.attempts == (
            f"step 1 from the local tier failed: {_wrong(local_dir)}",
            f"step 1 from the persistent tier failed: {_wrong(shared_dir)}",
        )
        monkeypatch.undo()

    # The persistent copy alone proves its placement too.
    with CheckpointManager(shared, placement_digests=True, read=ReadOptions(verify_placement=True)) as mgr:
        assert_state_equal(_restore(mgr), make_state(1))
        assert mgr.last_restore.tier == "persistent" and mgr.last_restore.placement.checked == TENSORS
    # Without verify_placement nothing is checked; a step saved without digests cannot be proven.
    with CheckpointManager(shared) as mgr:
        assert_state_equal(_restore(mgr), make_state(1))
        assert mgr.last_restore.placement is None
    bare = str(tmp_path / "bare")
    with CheckpointManager(bare) as mgr:
        mgr.save(1, make_state(1))
        mgr.wait()
    with CheckpointManager(bare, read=ReadOptions(verify_placement=True)) as mgr:
        with pytest.raises(CheckpointRestoreError) as e:
            mgr.load(empty_like_state(make_state(0)))
        step_dir = LocalTier(bare, name="p").step_path(1)
        assert e.value.attempts == (
            f"step 1 from the persistent tier failed: rank 0: PlacementError: {step_dir} records no "
            "placement digests (saved without UCPStorageWriter(placement_digests=True), by an older "
            "ucp_dcp, or in another format): nothing to prove the load's placement against. Save with "
            "placement_digests=True, or load without verify_placement",
        )


def test_object_tier_restores_prove_placement(tmp_path: Path, s3_bucket: Any, monkeypatch: Any) -> None:
    url, options = s3_bucket
    root = f"{url}/mgr-placement-{uuid.uuid4().hex[:8]}"
    with CheckpointManager(root, storage_options=options, placement_digests=True, read=ReadOptions(verify_placement=True)) as mgr:
        mgr.save(1, make_state(1))
        mgr.wait()
        # Loaded straight from the object store (ranged reads), placement proven.
        assert_state_equal(_restore(mgr), make_state(1))
        report = mgr.last_restore
        assert report.tier == "persistent" and report.placement is not None
        assert report.placement.checked == TENSORS
        monkeypatch.setattr(ucp_dcp.manager._restore, "UCPLoadPlanner", _SwapRowsAfterRead)
        with pytest.raises(CheckpointRestoreError) as e:
            mgr.load(empty_like_state(make_state(0)))
        assert e.value.attempts == (f"step 1 from the persistent tier failed: {_wrong(mgr.persistent.step_path(1))}",)
