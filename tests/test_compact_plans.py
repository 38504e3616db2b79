"""Compact save and load plans (the scale path), with real ranks (gloo, CPU).

Regular DTensors are planned per device mesh: the plans DCP gathers carry a
checksum per mesh (plus one description from the mesh's first rank), never
a write item per chunk; each rank derives its writes. These tests check
that the result is the same checkpoint, bit for bit, as per-chunk planning,
that what travels is really that small, and that disagreement between the
ranks of a mesh is refused by name.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dist_utils import bit_equal, run_ranks
from layouts import build, full_reference, scramble, train_state, train_step
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter, load_index, load_state_dict
from ucp_dcp.dcp._mesh_groups import LazyChunks
from ucp_dcp.errors import CheckpointKeyError

pytestmark = pytest.mark.multiproc


class RecordingSavePlanner(UCPSavePlanner):
    """Keeps what this rank sent to the coordinator and what it finally wrote."""

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        plan = super().create_local_plan()
        self.sent = plan
        return plan

    def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
        self.received = new_plan
        return super().finish_plan(new_plan)


class RecordingLoadPlanner(UCPLoadPlanner):
    """Keeps the local load plan this rank sent."""

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        plan = super().create_local_plan()
        self.sent = plan
        return plan


def _local_slice(full: torch.Tensor, dt: DTensor) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def _compact_vs_per_chunk(rank: int, world: int, root: str) -> None:
    for layout in ("dp4", "dp2tp2", "hsdp2x2"):
        model, optim = build(layout)
        train_step(model, optim, 0)
        state = train_state(model, optim)
        ref = full_reference(state)
        planners = {}
        for mode in ("compact", "per_chunk"):
            planner = RecordingSavePlanner(compact_plans=mode == "compact")
            path = os.path.join(root, layout, mode)
            dcp.save({**state, "step": 1}, storage_writer=UCPStorageWriter(path), planner=planner)
            planners[mode] = planner
        sent = planners["compact"].sent
        # No write item for a DTensor travels; only the mesh's first rank describes it.
        dtensor_keys = {k for k, v in flatten_state_dict(state)[0].items() if isinstance(v, DTensor)}
        assert not [i for i in sent.items if i.index.fqn in dtensor_keys], layout
        described = [g for g in sent.planner_data.groups if g.description is not None]
        assert all(g.first_rank == rank for g in described)
        assert all(g.description is None for g in sent.planner_data.groups if g.first_rank != rank)
        assert len(pickle.dumps(sent)) < len(pickle.dumps(planners["per_chunk"].sent)), layout
        # The coordinator sends back no per-chunk item either.
        assert not [i for i in planners["compact"].received.items if i.index.fqn in dtensor_keys]
        dist.barrier()
        if rank == 0:
            a = load_index(os.path.join(root, layout, "compact"))
            b = load_index(os.path.join(root, layout, "per_chunk"))
            assert set(a.tensors) == set(b.tensors)
            for fqn, t in a.tensors.items():
                assert t.compact, f"{layout}: {fqn} not stored compactly"
                assert (t.dtype, t.shape, t.layout) == (b.tensors[fqn].dtype, b.tensors[fqn].shape, b.tensors[fqn].layout)
        # Both checkpoints load into another layout bit for bit, each chunk from one file.
        for mode in ("compact", "per_chunk"):
            tmodel, toptim = build("dp2tp2" if layout != "dp2tp2" else "dp4", seed=5)
            train_step(tmodel, toptim, 0)
            target = train_state(tmodel, toptim)
            scramble(target)
            target = {**target, "step": 0}
            lp = RecordingLoadPlanner()
            dcp.load(target, storage_reader=UCPStorageReader(os.path.join(root, layout, mode)), planner=lp)
            assert lp.sent.items == [] and lp.sent.planner_data.items > 0  # items stayed on the rank
            flat, _ = flatten_state_dict(target)
            assert flat["step"] == 1
            for k, want in ref.items():
                got = flat[k]
                if isinstance(got, DTensor):
                    assert bit_equal(got.to_local(), _local_slice(want, got)), f"{layout}/{mode}: {k}"
                elif isinstance(got, torch.Tensor):
                    assert bit_equal(got, want), f"{layout}/{mode}: {k}"


def _restart_files(rank: int, world: int, root: str) -> None:
    model, optim = build("dp4")
    train_step(model, optim, 0)
    state = train_state(model, optim)
    ref = full_reference(state)
    dcp.save(state, storage_writer=UCPStorageWriter(root), planner=UCPSavePlanner())
    tmodel, toptim = build("dp4", seed=5)
    train_step(tmodel, toptim, 0)
    target = train_state(tmodel, toptim)
    scramble(target)
    reader = UCPStorageReader(root)
    dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
    flat, _ = flatten_state_dict(target)
    for k, want in ref.items():
        got = flat[k]
        if isinstance(got, DTensor):
            assert bit_equal(got.to_local(), _local_slice(want, got)), k
        elif isinstance(got, torch.Tensor):
            assert bit_equal(got, want), k
    # AdamW's step counters (a plain scalar per parameter, the same on every rank) were written by
    # rank 0 alone: each rank read its own file and rank 0's, not every rank's.
    files = sorted(os.path.basename(p) for p in reader.last_load.file_access)
    assert [f[:10] for f in files] == sorted({"rank00000-", f"rank{rank:05d}-"}), files


def test_an_fsdp2_restart_reads_its_own_file_and_rank_0s(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Small replicated tensors go to their lowest holder at save, so a same-layout load of an FSDP2
    model and its AdamW state on 4 ranks opens two data files a rank, whatever the world size."""
    run_ranks(4, _restart_files, str(tmp_path / "ckpt"))


def test_compact_plans_write_the_same_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """dp4, dp2tp2 (TP-replicated norms on DP submeshes), hsdp2x2 (replicas): compact planning
    writes every chunk once, stores the index compactly, and loads bit-exactly like per-chunk planning."""
    run_ranks(4, _compact_vs_per_chunk, str(tmp_path))


def _repeated_saves_reuse_plans(rank: int, world: int, root: str) -> None:
    model, optim = build("dp2")
    train_step(model, optim, 0)
    items = []
    for step in range(3):
        planner = RecordingSavePlanner()
        train_step(model, optim, step + 1)
        state = train_state(model, optim)
        dcp.save({**state, "step": step}, storage_writer=UCPStorageWriter(os.path.join(root, str(step))), planner=planner)
        items.append(planner.plan.items)
        ref = full_reference(state)
        target = train_state(*build("dp2", seed=3))
        scramble(target)
        dcp.load(target, storage_reader=UCPStorageReader(os.path.join(root, str(step))), planner=UCPLoadPlanner())
        flat, _ = flatten_state_dict(target)
        for k, v in flat.items():
            if isinstance(v, DTensor):
                assert bit_equal(v.to_local(), _local_slice(ref[k], v)), (step, k)
    # The derived write items of a mesh group are computed once and reused.
    dtensor_items = [[i for i in it if i.type.name == "SHARD"] for it in items]
    assert dtensor_items[0] and all(a is b for a, b in zip(dtensor_items[0], dtensor_items[2]))


def test_repeated_saves_reuse_plans(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A training loop saving again derives nothing twice, and every save is still exact."""
    run_ranks(2, _repeated_saves_reuse_plans, str(tmp_path))


def _mesh_disagreement(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd: dict[str, Any] = {"w": distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])}
    if rank == 1:  # rank 1 holds one more DTensor on the same mesh than rank 0
        sd["extra"] = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)], run_check=False)  # no collective
    with pytest.raises(CheckpointException, match=r"every rank of a mesh must save the same DTensors"):
        dcp.save(sd, storage_writer=UCPStorageWriter(root), planner=UCPSavePlanner())
    assert not os.path.exists(os.path.join(root, "ucp_index.json"))
    # Per-chunk planning saves it (the extra tensor then exists only as rank 1's shard).
    dist.barrier()


def test_ranks_of_a_mesh_must_agree(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A rank holding other DTensors than its mesh's first rank fails the save, naming the mesh."""
    run_ranks(2, _mesh_disagreement, str(tmp_path / "ckpt"))


def _default_planner_reads_lazy_chunks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": distribute_tensor(full.T.contiguous(), mesh, [Shard(1)])}
    saved_md = dcp.save(sd, storage_writer=UCPStorageWriter(root), planner=UCPSavePlanner())
    # DCP broadcasts the save's metadata to every rank: its chunk lists travel unexpanded.
    lazy = saved_md.state_dict_metadata["w"].chunks
    assert isinstance(lazy, LazyChunks) and lazy._source is not None
    assert [list(c.offsets) for c in pickle.loads(pickle.dumps(lazy))] == [[0, 0], [5, 0]]
    # DCP's own planner reads TensorStorageMetadata.chunks: the lazy list fills in.
    target = {"w": torch.zeros(10, 6), "b": torch.zeros(6, 10)}
    dcp.load(target, storage_reader=UCPStorageReader(root), planner=DefaultLoadPlanner())
    assert bit_equal(target["w"], full) and bit_equal(target["b"], full.T.contiguous())
    md = UCPStorageReader(root).read_metadata()
    chunks = md.state_dict_metadata["w"].chunks
    assert [list(c.offsets) for c in chunks] == [[0, 0], [5, 0]]
    assert pickle.loads(pickle.dumps(chunks)) == list(chunks)
    if rank == 0:
        with open(os.path.join(root, "ucp_index.json")) as f:
            doc = json.load(f)
        assert doc["tensors"]["w"]["files"] == [[0, 2, 1]]  # chunk i in file i: one run


def test_default_load_planner_sees_chunk_lists(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Chunk lists in DCP's metadata are built lazily, and only for planners that read them."""
    run_ranks(2, _default_planner_reads_lazy_chunks, str(tmp_path / "ckpt"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lazy_chunks_compare_and_print_as_their_list(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tool comparing or printing a tensor's chunk list first (no len, no iteration) sees the
    real list."""
    dcp.save({"w": torch.ones(4, 3)}, storage_writer=UCPStorageWriter(str(tmp_path)), planner=UCPSavePlanner())
    whole = [ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((4, 3)))]
    md = UCPStorageReader(str(tmp_path)).read_metadata()
    assert md.state_dict_metadata["w"].chunks == whole
    md = UCPStorageReader(str(tmp_path)).read_metadata()
    assert repr(md.state_dict_metadata["w"].chunks) == repr(whole)
    # planner_data answers as DCP's map from flattened keys to their paths
    assert "w" in md.planner_data and md.planner_data["w"] == ("w",)
    with pytest.raises(CheckpointKeyError) as ei:
        md.planner_data["nope"]
    assert ei.value.args == ("'nope' is not a key of the checkpoint",)


def _many_mesh_groups(rank: int, world: int, root: str) -> None:
    from ucp_dcp.dcp import _mesh_groups

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    for i in range(66):  # 66 mesh groups (a different tensor name each), planned
        planner = UCPSavePlanner()
        planner.set_up_planner({f"w{i}": distribute_tensor(full + i, mesh, [Shard(0)])}, None, rank == 0)
        planner.create_local_plan()
        assert len(_mesh_groups._GROUPS) == min(i + 1, 64)  # bounded: the oldest went first
    sd = {"w0": distribute_tensor(full, mesh, [Shard(0)])}  # the first group again: planned anew
    dcp.save(sd, storage_writer=UCPStorageWriter(root), planner=UCPSavePlanner())
    assert bit_equal(load_state_dict(root)["w0"], full)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_more_mesh_groups_than_the_cache_holds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Past 64 distinct mesh groups in a process the oldest cached one is dropped; a save that
    needs it again plans it anew, and every checkpoint loads back exactly."""
    run_ranks(1, _many_mesh_groups, str(tmp_path))
