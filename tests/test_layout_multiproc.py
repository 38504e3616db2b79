"""Layout rules with real ranks: save under one Megatron-style layout, load under another, bit for bit.

Each rank builds its local (fused, padded, stage-local, expert-local)
tensors from a seeded reference by the explicit arithmetic of
:mod:`megatron_block`, saves them through a :class:`LayoutSpec`, and a
later run with another layout loads into NaN-filled tensors and compares
every one bit for bit with what :mod:`megatron_block` cuts from the same
reference for that rank (padding rows must come back as zeros, whatever
was saved in them).

To keep each test to one spawn (starting ranks is most of the time on a
small machine), a test starts the largest world it needs and runs its
phases on the first ``n`` ranks, each phase through a process group of its
own (``dcp.save/load(..., process_group=...)``), as separate jobs would;
the other ranks wait.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dist_utils import bit_equal, run_ranks
from megatron_block import (
    block_spec, expert_local, expert_reference, expert_spec, local_state, rank_coords, reference, scrambled,
    train_state,
)
from ucp_dcp import RankLocal, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp import Averaged, LayoutSpec, Rename
from ucp_dcp.format import LAYOUT_KEY

pytestmark = pytest.mark.multiproc


Phase = Callable[[int, int, str, Any], None]


def _phases(rank: int, world: int, path: str, phases: list[tuple[int, Phase]]) -> None:
    """Run each ``fn(rank, n, path, group)`` on ranks ``0..n-1`` (``group``: theirs), one after another."""
    for n, fn in phases:
        group = dist.group.WORLD if n == world else dist.new_group(list(range(n)))  # every rank calls new_group
        if rank < n:
            fn(rank, n, path, group)
        dist.barrier()


def _save(sd: dict[str, Any], spec: LayoutSpec, path: str, group: Any) -> None:
    dcp.save(spec.apply(sd, record=True), storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner(),
             process_group=group)


def _load(sd: dict[str, Any], spec: LayoutSpec, path: str, group: Any) -> None:
    applied = spec.apply(sd)
    dcp.load(applied, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(), process_group=group)
    spec.update_values(sd, applied)  # step counters land in `applied`; tensors load in place


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    bad = [k for k in want if not bit_equal(got[k], want[k])]
    assert not bad, f"{what}: differ: {bad}"


# ---------------------------------------------------------------- tensor parallel

SCALE = "layers.0.attn.softmax_scale"  # a parameter each TP rank updates a little differently


def _scale(rank: int, tp: int) -> torch.Tensor:
    # Reference value 1.5 plus a per-rank drift that averages to exactly 0 (exact in float32).
    return torch.tensor([1.5 + 0.25 * (2 * rank - (tp - 1))])


def _tp_spec(rank: int, tp: int, group: Any = None) -> LayoutSpec:
    spec = block_spec(rank, tp)
    # Averaged comes before the Replicated/Shard rules; the Rename strips a torch.compile prefix
    # from a DTensor, which then becomes pieces under its new name.
    rules = [Rename(r"_orig_mod\."), Averaged(r"softmax_scale", axis="tp")] + spec.rules
    return LayoutSpec(rules, axes=spec.axes, groups={"tp": group})


def _dtensors(group: Any, nan: bool = False) -> dict[str, Any]:
    """Two DTensors beside the Megatron tensors: one renamed (7 rows: uneven shards), one left as it is."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group, "cpu")
    table, bias = torch.arange(7 * 3, dtype=torch.float32).view(7, 3), torch.linspace(-1, 1, 5)
    if nan:
        table, bias = torch.full_like(table, float("nan")), torch.full_like(bias, float("nan"))
    return {"_orig_mod.table": distribute_tensor(table, mesh, [Shard(0)]),
            "bias": distribute_tensor(bias, mesh, [Replicate()])}


def _save_tp(rank: int, world: int, path: str, group: Any) -> None:
    ref, moments = reference(seed=0), reference(seed=1)
    local = local_state(ref, rank, world, pad_value=123.0)  # padding rows must not be saved
    local[SCALE] = _scale(rank, world)
    sd = train_state(local, local_state(moments, rank, world, pad_value=-5.0))
    sd["extra"] = _dtensors(group)
    _save(sd, _tp_spec(rank, world, group), path, group)
    assert bit_equal(local[SCALE], _scale(rank, world)), "averaging must not modify the training state"


def _load_tp(rank: int, world: int, path: str, group: Any, saved_world: int = 2) -> None:
    ref, moments = reference(seed=0), reference(seed=1)
    want, want_m = local_state(ref, rank, world), local_state(moments, rank, world)
    want[SCALE] = torch.tensor([1.5])
    sd = train_state(scrambled(want), scrambled(want_m), step=0)
    sd["extra"] = _dtensors(group, nan=True)
    specs = RankLocal(None, reshard=lambda key, by_rank, r, w: by_rank)
    _load(sd, _tp_spec(rank, world), path, group)
    dcp.load({LAYOUT_KEY: specs}, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(),
             process_group=group)
    what = f"TP {saved_world} -> TP {world}, rank {rank}"
    _check(sd["model"], want, what + " model")
    _check({k: v["exp_avg"] for k, v in sd["optim"]["state"].items()}, want_m, what + " exp_avg")
    for k, v in _dtensors(group).items():
        assert bit_equal(sd["extra"][k].to_local(), v.to_local()), (what, k)
    assert sd["step"] == 5 and all(v["step"] == 5 for v in sd["optim"]["state"].values()), what
    # The checkpoint records how each saved rank laid its state out.
    assert sorted(specs.value) == list(range(saved_world))
    for r, data in specs.value.items():
        assert LayoutSpec.from_json(data) == _tp_spec(r, saved_world), (what, r)


def test_megatron_tp2_to_tp1_tp3_tp4(tmp_path: os.PathLike) -> None:
    """Fused GQA QKV (+bias), fused SwiGLU, row-parallel o/down, padded vocab (37), replicated norms and
    an averaged parameter, with Adam-like moments: TP 2 -> TP 1, TP 3 and TP 4. Beside them, a renamed
    DTensor (uneven Shard(0)) and an unrenamed one."""
    run_ranks(4, _phases, str(tmp_path / "tp2"), [(2, _save_tp), (1, _load_tp), (3, _load_tp), (4, _load_tp)])


# ---------------------------------------------------------------- pipeline stages


def _save_pp(rank: int, world: int, path: str, group: Any) -> None:
    ref = reference(seed=2)
    local = local_state(ref, 0, 1, stage=rank, pp=world, pad_value=9.0)
    assert sorted(k for k in local if k.startswith("layers.") and k.endswith("input_norm.weight")) == [
        "layers.0.input_norm.weight", "layers.1.input_norm.weight"]  # stage-local names
    _save({"model": local}, block_spec(0, 1, stage=rank, pp=world), path, group)


def _load_pp(rank: int, world: int, path: str, group: Any) -> None:
    want = local_state(reference(seed=2), 0, 1, stage=rank, pp=world)
    sd = {"model": scrambled(want)}
    _load(sd, block_spec(0, 1, stage=rank, pp=world), path, group)
    _check(sd["model"], want, f"PP 2 -> PP {world}, stage {rank}")


def test_pipeline_2_stages_to_1_and_4(tmp_path: os.PathLike) -> None:
    """Stage-local layers.0/layers.1 (stage 0: + embedding; last stage: + final norm and head)."""
    run_ranks(4, _phases, str(tmp_path / "pp2"), [(2, _save_pp), (1, _load_pp), (4, _load_pp)])


# ---------------------------------------------------------------- experts


def _save_ep(rank: int, world: int, path: str, group: Any) -> None:
    _save({"model": expert_local(expert_reference(seed=3), rank, world)}, expert_spec(rank, world), path, group)


def _load_ep(rank: int, world: int, path: str, group: Any) -> None:
    want = expert_local(expert_reference(seed=3), rank, world)
    sd = {"model": scrambled(want)}
    _load(sd, expert_spec(rank, world), path, group)
    _check(sd["model"], want, f"EP 2 -> EP {world}, rank {rank}")


def test_experts_ep2_to_ep4_and_ep1(tmp_path: os.PathLike) -> None:
    """4 experts, local indices experts.0/experts.1 on each of 2 EP ranks -> 1 per rank, and all on one."""
    run_ranks(4, _phases, str(tmp_path / "ep2"), [(2, _save_ep), (4, _load_ep), (1, _load_ep)])


# ---------------------------------------------------------------- TP x PP


def _save_tp_pp(rank: int, world: int, path: str, group: Any) -> None:
    tp = 2
    tp_rank, stage = rank_coords(rank, tp)
    pp = world // tp
    local = local_state(reference(seed=4), tp_rank, tp, stage, pp, pad_value=1.0)
    _save({"model": local}, block_spec(tp_rank, tp, stage, pp), path, group)


def _load_tp3(rank: int, world: int, path: str, group: Any) -> None:
    tp = 3
    tp_rank, stage = rank_coords(rank, tp)
    pp = world // tp
    want = local_state(reference(seed=4), tp_rank, tp, stage, pp)
    sd = {"model": scrambled(want)}
    _load(sd, block_spec(tp_rank, tp, stage, pp), path, group)
    _check(sd["model"], want, f"TP2xPP2 -> TP{tp}xPP{pp}, rank {rank}")


def test_tp2_pp2_to_tp3(tmp_path: os.PathLike) -> None:
    """4 ranks as TP 2 x PP 2 -> 3 ranks as TP 3 x PP 1 (renaming and fusing at once)."""
    run_ranks(4, _phases, str(tmp_path / "tp2pp2"), [(4, _save_tp_pp), (3, _load_tp3)])


def _dtensor_refusals(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    from ucp_dcp import LayoutRuleError
    from ucp_dcp import Shard as ShardRule

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    w = distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)])
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    # Global 5 rows over 2 ranks: rank 0 should hold 3 of them, here it holds 2.
    short = DTensor.from_local(torch.zeros(2, 2), mesh, [Shard(0)], run_check=False, shape=(5, 2), stride=(2, 1))
    refusals = [
        (lambda: LayoutSpec([ShardRule("w", axis="tp")], axes={"tp": (rank, 2)}).apply({"w": w}),
         r"^Shard\('w', axis='tp'\) matches 'w', a DTensor: a DTensor describes its own layout"),
        (lambda: LayoutSpec([Rename("^p$", "q")]).apply({"p": partial}),
         r"^p -> q: a renamed DTensor with placements \(Partial\(sum\),\) \(only Shard and Replicate can be renamed\)$"),
        (lambda: LayoutSpec([Rename(r"^b\.", "a.")]).apply({"a.w": w, "b.w": w}),
         r"^keys \['a\.w', 'b\.w'\] all map to the logical tensor 'a\.w'$"),
        (lambda: LayoutSpec([Averaged("s", axis="tp")], axes={"tp": (rank, 4)}, groups={"tp": dist.group.WORLD})
         .apply({"s": torch.ones(2)}, record=True),
         r"^Averaged\('s', axis='tp'\): the process group of axis 'tp' has 2 ranks, but axes says its size is 4$"),
    ]
    if rank == 0:
        refusals.append((lambda: LayoutSpec([Rename("^s$", "t")]).apply({"s": short}),
                         r"^s -> t: DTensor local shape \[2, 2\] is not the expected \[3, 2\]$"))
    for call, says in refusals:
        with pytest.raises(LayoutRuleError, match=says):
            call()


def test_dtensors_the_layout_cannot_take_are_refused() -> None:
    """A layout rule matching a DTensor, a renamed Partial DTensor or one whose local shard is not
    the shape its spec gives, two DTensors on one logical tensor, one of them as it is, an Averaged axis
    whose process group is not the axis size: each a LayoutRuleError naming the key and rule."""
    run_ranks(2, _dtensor_refusals)
