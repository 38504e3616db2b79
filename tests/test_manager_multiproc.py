"""CheckpointManager with real ranks (gloo, CPU): elastic restore, peer replication, tier fallback."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from layouts import build, check_against, full_reference, scramble, train_state, train_step
from ucp_dcp import CheckpointManager, ReshardEvent
from ucp_dcp.manager.tiers import LocalTier

pytestmark = pytest.mark.multiproc


def _save_fsdp(rank: int, world: int, root: str) -> None:
    model, optim = build(f"dp{world}")
    with CheckpointManager(root, keep_last=2) as mgr:
        for step in range(1, 4):
            train_step(model, optim, step)
            state = {**train_state(model, optim), "step": step}
            mgr.save(step, state)
            if step == 3:
                ref = full_reference(state)  # collective: before mutating
            # Training changes every parameter in place while the save runs.
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        mgr.wait()
        assert mgr.steps() == [2, 3]
        _check_slowest([r.slowest for r in mgr.stats()], world)
    if rank == 0:
        torch.save(ref, os.path.join(root, "ref.pt"))


def _check_slowest(records: list, world: int) -> None:
    """Each save's or restore's slowest rank is named, with its file, the same on every rank."""
    assert records and all(
        r is not None and 0 <= r.rank < world and r.file.endswith(".safetensors") and r.seconds > 0
        for r in records
    ), records
    everyone: list = [None] * world
    dist.all_gather_object(everyone, records)
    assert everyone == [records] * world, everyone


def _restore_elastic(rank: int, world: int, root: str) -> None:
    model, optim = build(f"dp{world}", seed=5)
    train_step(model, optim, 0)  # optimizer state must exist to be loaded into
    state = {**train_state(model, optim), "step": -1}
    scramble(state)
    events: list[ReshardEvent] = []
    with CheckpointManager(root, on_reshard=[events.append]) as mgr:
        step = mgr.load(state)
    assert step == 3
    assert events == [ReshardEvent(3, 4, world, "persistent")], events
    assert mgr.last_restore is not None
    _check_slowest([mgr.last_restore.slowest], world)
    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=False)
    check_against(state, ref, f"rank {rank} of {world}")


def test_saved_on_4_restored_on_3_with_callbacks(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(4, _save_fsdp, root)
    run_ranks(3, _restore_elastic, root)


def _peer_save(rank: int, world: int, base: str) -> None:
    model, optim = build(f"dp{world}")
    kw = dict(local=os.path.join(base, "local", "node{node}"), ranks_per_node=2, persistent_interval=2)
    with CheckpointManager(os.path.join(base, "shared"), **kw) as mgr:
        for step in (1, 2, 3):
            train_step(model, optim, step)
            state = train_state(model, optim)
            mgr.save(step, state)
            ref = full_reference(state)
        mgr.wait()
    if rank == 0:
        torch.save(ref, os.path.join(base, "ref3.pt"))
    dist.barrier()
    # Each node holds its own files and a copy of the other node's.
    for node in (0, 1):
        names = set(LocalTier(os.path.join(base, "local", f"node{node}"), name="l").files(3))
        assert len([n for n in names if n.endswith(".safetensors")]) == 4, names


def _peer_restore(rank: int, world: int, base: str, expect_tier: str, expect_step: int) -> None:
    model, optim = build(f"dp{world}", seed=5)
    train_step(model, optim, 0)
    state = train_state(model, optim)
    scramble(state)
    kw = dict(local=os.path.join(base, "local", "node{node}"), ranks_per_node=2, persistent_interval=2)
    with CheckpointManager(os.path.join(base, "shared"), **kw) as mgr:
        step = mgr.load(state)
        assert (step, mgr.last_restore.tier) == (expect_step, expect_tier), mgr.last_restore
    if expect_step == 3:
        check_against(state, torch.load(os.path.join(base, "ref3.pt"), weights_only=False), f"rank {rank}")


def test_peer_copy_and_persistent_fallback(tmp_path) -> None:
    base = str(tmp_path)
    run_ranks(4, _peer_save, base)
    # Node 1's local disk is lost: its files come back from node 0's peer copy.
    shutil.rmtree(os.path.join(base, "local", "node1"))
    run_ranks(4, _peer_restore, base, "local", 3)
    assert 3 in LocalTier(os.path.join(base, "local", "node1"), name="l").steps(), "node 1 was not repaired"
    # Every node's local tier is gone: restore from the persistent tier (step 2).
    shutil.rmtree(os.path.join(base, "local"))
    run_ranks(4, _peer_restore, base, "persistent", 2)


def _close_after_a_new_default_group(rank: int, world: int, root: str, init: str) -> None:
    """A job that destroyed its default group (and the manager's groups with it) and made a new
    one: close() still returns, and the new group works."""
    mgr = CheckpointManager(root)
    mgr.save(1, {"w": torch.ones(4)})
    mgr.wait()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mgr.close()
    assert mgr._fg.pg is None and mgr._bg.pg is None  # noqa: SLF001  (nothing left to destroy)
    got = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(got, torch.full((1,), float(rank)))
    assert [int(t.item()) for t in got] == list(range(world))


def test_close_after_the_job_replaced_its_default_group(tmp_path) -> None:
    run_ranks(2, _close_after_a_new_default_group, str(tmp_path / "ckpt"), str(tmp_path / "init2"))
