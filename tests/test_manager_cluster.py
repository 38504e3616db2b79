"""CheckpointManager on a simulated cluster of 4 and more nodes (real gloo ranks).

Each simulated *machine* has a node-local directory ``local/m<id>``; a job's node ``k`` runs on
the machine ``machines[k]`` says, so a restart can lose a machine, swap in an empty one or add
one, and node ``k`` after a restart need not be the machine that was node ``k`` before. Four
nodes (``ranks_per_node=1``) and four nodes of two ranks (8 ranks) save steps 1-3 with the
persistent tier every 2 steps; then (a) one machine's disk is lost and the job restarts on the
3 survivors, (b) an empty machine replaces it at the same world size, (c) a fifth machine joins,
(d) two neighbouring machines are lost. Two nodes would hide the ring's direction: with four,
node ``k`` holds its own files and node ``k - 1``'s, nobody else's. Case (d) runs again with
the persistent tier in S3 (moto on loopback). Every restore is checked bit-exactly against the
state saved at the step it loads.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist
import s3_server
from dist_utils import run_ranks
from layouts import build, check_against, full_reference, scramble, train_state, train_step

from ucp_dcp import CheckpointManager, ReshardEvent, UCPStorageReader
from ucp_dcp.manager.tiers import LocalTier

pytestmark = pytest.mark.multiproc
s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module


def _local(base: str, machines: list[int], rank: int, rpn: int) -> str:
    return os.path.join(base, "local", f"m{machines[rank // rpn]}")


def _kw(base: str, machines: list[int], rank: int, rpn: int) -> dict[str, Any]:
    return dict(
        local=_local(base, machines, rank, rpn), ranks_per_node=rpn, persistent_interval=2
    )


def _save(
    rank: int, world: int, base: str, rpn: int, root: str | None = None, options: Any = None
) -> None:
    """Steps 1-3, persistent every 2, into ``root`` (default: the shared directory; an S3 URL
    with ``options``)."""
    machines = list(range(world // rpn))
    model, optim = build(f"dp{world}")
    root = root or os.path.join(base, "shared")
    refs = {}
    with CheckpointManager(root, storage_options=options, **_kw(base, machines, rank, rpn)) as mgr:
        for step in (1, 2, 3):
            train_step(model, optim, step)
            state = train_state(model, optim)
            mgr.save(step, state)
            refs[step] = full_reference(state)
        mgr.wait()
        assert mgr.verify(3) == [], mgr.verify(3)  # each node: its files and its partner's
        # What a restore fetches is planned from the index: the model's shards, at the saved
        # layout, are in this rank's own file only.
        step3 = os.path.join(_local(base, machines, rank, rpn), "step-000000000003")
        reads = UCPStorageReader(step3).files_to_read({"model": state["model"]})
        assert [int(n[4:9]) for n in reads] == [rank], reads
    if rank == 0:
        for step in (2, 3):
            torch.save(refs[step], os.path.join(base, f"ref{step}.pt"))
    dist.barrier()


def _held(base: str, machine: int, step: int) -> set[int]:
    """The saving ranks whose data files machine ``machine``'s local tier holds of ``step``."""
    names = LocalTier(os.path.join(base, "local", f"m{machine}"), name="l").files(step)
    return {int(n[4:9]) for n in names if n.endswith(".safetensors")}


def _restore(
    rank: int,
    world: int,
    base: str,
    rpn: int,
    machines: list[int],
    expect: tuple[int, str],
    saved_world: int,
    root: str | None = None,
    options: Any = None,
) -> None:
    model, optim = build(f"dp{world}", seed=5)
    train_step(model, optim, 0)
    state = train_state(model, optim)
    scramble(state)
    events: list[ReshardEvent] = []
    kw = _kw(base, machines, rank, rpn)
    root = root or os.path.join(base, "shared")
    with CheckpointManager(root, storage_options=options, on_reshard=[events.append], **kw) as mgr:
        step = mgr.load(state)
        rec = mgr.last_restore
        assert rec is not None and (step, rec.tier) == expect, rec
        if world != saved_world:
            assert events == [ReshardEvent(step, saved_world, world, rec.tier)], events
        if expect == (2, "persistent"):
            # Why not step 3: its local copy lost files, which the attempts name.
            assert "step 3 from the local tier failed" in rec.failed_attempts[0], rec
        mgr.wait()
    ref = torch.load(os.path.join(base, f"ref{step}.pt"), weights_only=False)
    check_against(state, ref, f"rank {rank}, step {step}")


@pytest.mark.parametrize(("world", "rpn"), [(4, 1), (8, 2)])
def test_four_nodes_save_and_lose_restart_swap_and_grow(tmp_path, world: int, rpn: int) -> None:
    base = str(tmp_path)
    nodes = world // rpn
    run_ranks(world, _save, base, rpn)
    # The ring: machine k holds the files of its own ranks and of machine k - 1's, no others.
    for m in range(nodes):
        want = {r for r in range(world) if r // rpn in (m, (m - 1) % nodes)}
        assert _held(base, m, 3) == want, (m, _held(base, m, 3))
    # (d), on a copy of the tiers as saved: two neighbouring machines lost (1 and 2). Node 1's
    # files were on machines 1 and 2 only, so no local copy of step 3 or 2 is whole: step 2
    # comes from the persistent tier, and the restore says why.
    lost = os.path.join(base, "d")
    for tier in ("shared", "local"):
        shutil.copytree(os.path.join(base, tier), os.path.join(lost, tier))
    for step in (2, 3):
        shutil.copy(os.path.join(base, f"ref{step}.pt"), lost)
    for m in (1, 2):
        shutil.rmtree(os.path.join(lost, "local", f"m{m}"))
    run_ranks(2 * rpn, _restore, lost, rpn, [0, 3], (2, "persistent"), world)
    ref_step3 = (3, "local")
    # The same nodes again: from the local tier, and nothing moves between machines. Every
    # rank reads the AdamW step counters, saved once each in every rank's file: a rank whose
    # node lacks that file gets them through the group from a node that has it.
    run_ranks(world, _restore, base, rpn, list(range(nodes)), ref_step3, world)
    for m in range(nodes):
        want = {r for r in range(world) if r // rpn in (m, (m - 1) % nodes)}
        assert _held(base, m, 3) == want, (m, _held(base, m, 3))
    # (a) Machine 2's disk is lost; the job restarts on the three survivors (machines 0, 1, 3:
    # node 2 is now machine 3): step 3 from the local tier, machine 2's files from machine 3.
    shutil.rmtree(os.path.join(base, "local", "m2"))
    survivors = [0, 1, 3]
    run_ranks(len(survivors) * rpn, _restore, base, rpn, survivors, ref_step3, world)
    # (b) Hot swap: an empty machine 4 replaces machine 2 at the same world size; afterwards it
    # holds the step: its own node's files and its partner's (here: all, fetched to load).
    run_ranks(world, _restore, base, rpn, [0, 1, 4, 3], ref_step3, world)
    node2 = {r for r in range(world) if r // rpn in (2, 1)}
    assert node2 <= _held(base, 4, 3)
    # (c) Scale up: a fifth, empty machine joins.
    run_ranks(world + rpn, _restore, base, rpn, [0, 1, 4, 3, 5], ref_step3, world)


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rpn", [1, 2, 4])
@pytest.mark.parametrize("uneven", [False, True])
def test_the_ring_keeps_every_file_on_two_nodes(nodes: int, rpn: int, uneven: bool) -> None:
    """NodeLayout.held_files, the one statement of the ring: with several nodes, every data file
    is on its own node and the next one (node k keeps node k - 1's), the index on all; a last node
    with fewer ranks (``uneven``) takes part like any other."""
    from ucp_dcp.manager._collective import NodeLayout
    from ucp_dcp.manager.tiers import CommitMarker, FileDigest

    world = nodes * rpn - (1 if uneven and rpn > 1 else 0)
    files = tuple(FileDigest(f"rank{r:05d}-x.safetensors", 1, "0" * 32, r) for r in range(world))
    marker = CommitMarker(3, world, 1.0, (*files, FileDigest("ucp_index.json", 1, "0" * 32, -1)))
    layouts = [NodeLayout(r, world, rpn) for r in range(0, world, rpn)]  # each node's leader
    assert [lay.node for lay in layouts] == list(range(nodes))
    holders: dict[str, list[int]] = {}
    for lay in layouts:
        for name in lay.held_files(marker, peer=True):
            holders.setdefault(name, []).append(lay.node)
        assert set(lay.held_files(marker, peer=False)) == {
            f.name for f in marker.files if f.rank < 0 or f.rank // rpn == lay.node
        }
    assert holders.pop("ucp_index.json") == list(range(nodes))
    for f in files:
        own = f.rank // rpn
        assert sorted(holders[f.name]) == sorted({own, (own + 1) % nodes}), (f.name, holders)


def test_four_nodes_with_an_s3_persistent_tier_lose_two_neighbours(tmp_path, s3_bucket) -> None:
    """The same cluster with its persistent tier in S3 (moto on loopback): four nodes save steps
    1-3 (step 2 uploaded), two neighbouring machines are lost, and the two survivors restore
    step 2 from the bucket, resharded 4 -> 2, bit-exactly; the restore names why not step 3."""
    url, options = s3_bucket
    root = f"{url}/cluster-{uuid.uuid4().hex[:8]}"
    base = str(tmp_path)
    run_ranks(4, _save, base, 1, root, options)
    for m in (1, 2):
        shutil.rmtree(os.path.join(base, "local", f"m{m}"))
    run_ranks(2, _restore, base, 1, [0, 3], (2, "persistent"), 4, root, options)
