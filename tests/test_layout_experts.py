"""MoE experts one by one and stacked: the :class:`Stacked` and :class:`Unstacked` layout rules.

Hugging Face (Mixtral) keeps each expert's matrices as tensors of their own,
``model.layers.0.block_sparse_moe.experts.{e}.w1.weight`` of shape
``[FFN, HID]``; torchtitan-style models stack them, ``layers.0.moe.experts.w1``
of shape ``[E, FFN, HID]``, sharded over the expert-parallel ranks
(``Shard(0)``). A spec with ``Stacked`` loads the first into the second, one
with ``Unstacked`` the second into the first, both by offset reads of the
saved bytes, with renames of the prefixes and tensor-parallel cuts inside
each expert. One-process tests check the pieces; one spawn of 4 gloo ranks
loads a ``model.safetensors`` into stacked EP and EP x TP models (DTensor
and plain), saves a stacked EP model, and loads that into per-expert models
(EP 2 and one process), bit for bit, each rank reading exactly its experts'
bytes (``UCPStorageReader.bytes_requested``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks
from torch.distributed.checkpoint.api import CheckpointException

from ucp_dcp import (
    ReadOptions,
    CheckpointKeyError,
    LayoutRuleError,
    LayoutSpec,
    Reindex,
    Rename,
    Replicated,
    Shard,
    Stacked,
    TensorPieces,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    Unstacked,
)
from ucp_dcp.adapters.rules import Rule
from ucp_dcp.errors import unwrap

safetensors_torch = pytest.importorskip("safetensors.torch")

E, FFN, HID = 6, 32, 64  # one expert matrix: 32 x 64 float32 = 8 KiB, two 4 KiB checksum blocks
HF = "model.layers.0.block_sparse_moe."
TT = "layers.0.moe."
SHAPES = {"w1": (FFN, HID), "w2": (HID, FFN), "w3": (FFN, HID)}
TP_DIM = {"w1": 0, "w2": 1, "w3": 0}  # column-parallel w1/w3, row-parallel w2 (per expert)


def hf_reference(seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixtral-style per-expert tensors and the router, every value distinct."""
    g = torch.Generator().manual_seed(seed)
    ref = {HF + "gate.weight": torch.randn(E, HID, generator=g)}
    for e in range(E):
        for w, shape in SHAPES.items():
            ref[f"{HF}experts.{e}.{w}.weight"] = torch.randn(*shape, generator=g)
    return ref


def stacked_reference(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values under torchtitan-style names, each matrix stacked over the experts."""
    out = {TT + "router.gate.weight": ref[HF + "gate.weight"]}
    for w in SHAPES:
        out[f"{TT}experts.{w}"] = torch.stack(
            [ref[f"{HF}experts.{e}.{w}.weight"] for e in range(E)]
        )
    return out


def stacked_rules(axis: str | None = None, tp: bool = False) -> list[Rule]:
    """torchtitan names -> Hugging Face names; stacked matrices as one logical tensor per expert."""
    rules: list[Rule] = [
        Rename(r"^layers\.", "model.layers."),
        Rename(r"\.moe\.router\.gate\.", ".block_sparse_moe.gate."),
        Rename(r"\.moe\.experts\.", ".block_sparse_moe.experts."),
        Stacked(r"\.experts\.(w[123])$", repl=r".experts.{}.\1.weight", experts=E, axis=axis),
    ]
    if tp:  # a plain tensor: the TP cut inside each expert (dims of the stacked tensor)
        rules += [
            Shard(r"\.experts\.w[13]$", dim=1, axis="tp"),
            Shard(r"\.experts\.w2$", dim=2, axis="tp"),
        ]
    return rules


def unstacked_rules(per_rank: int = 0) -> list[Rule]:
    """Hugging Face names -> torchtitan names; each expert a box of the stacked logical tensor."""
    rules: list[Rule] = (
        [Reindex(r"experts\.(\d+)\.", axis="ep", per_rank=per_rank)] if per_rank else []
    )
    return rules + [
        Rename(r"^model\.layers\.", "layers."),
        Rename(r"\.block_sparse_moe\.gate\.", ".moe.router.gate."),
        Rename(r"\.block_sparse_moe\.", ".moe."),
        Unstacked(r"\.experts\.(\d+)\.(w[123])\.weight$", repl=r".experts.\2", experts=E),
        Replicated(r"router"),
    ]


def local_stacked(
    st: dict[str, torch.Tensor], ep_rank: int, ep: int, tp_rank: int = 0, tp: int = 1
) -> dict[str, torch.Tensor]:
    """A plain EP x TP rank's stacked tensors, cut by explicit arithmetic (even split)."""
    per = E // ep
    out = {TT + "router.gate.weight": st[TT + "router.gate.weight"].clone()}
    for w in SHAPES:
        t = st[f"{TT}experts.{w}"][ep_rank * per : (ep_rank + 1) * per]
        d = TP_DIM[w] + 1
        n = t.shape[d] // tp
        out[f"{TT}experts.{w}"] = t.narrow(d, tp_rank * n, n).clone()
    return out


def _pieces(sd: dict[str, Any]) -> list[tuple[str, TensorPieces]]:
    return [(k, v) for k, v in sd.items() if isinstance(v, TensorPieces)]


def _box(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


def _views(view: torch.Tensor, base: torch.Tensor) -> bool:
    lo = base.data_ptr()
    return lo <= view.data_ptr() < lo + base.numel() * base.element_size()


# ------------------------------------------------------------------ pieces


def test_stacked_pieces_ep_by_tp_tile_the_experts() -> None:
    """Over the 4 ranks of EP 2 x TP 2 (plain tensors), the pieces are views of each rank's
    stacked tensors holding exactly the per-expert reference, and cover every expert once."""
    ref = hf_reference()
    st = stacked_reference(ref)
    covered: Counter[str] = Counter()
    for ep_rank in range(2):
        for tp_rank in range(2):
            local = local_stacked(st, ep_rank, 2, tp_rank, 2)
            spec = LayoutSpec(
                stacked_rules("ep", tp=True) + [Replicated("gate")],
                axes={"ep": (ep_rank, 2), "tp": (tp_rank, 2)},
            )
            sd = spec.apply(local)
            for key, obj in _pieces(sd):
                for p in obj.pieces:
                    assert p.shape == tuple(ref[p.fqn].shape), p.fqn
                    assert bit_equal(p.data, _box(ref[p.fqn], p.offsets, tuple(p.data.shape))), (
                        p.fqn
                    )
                    assert _views(p.data, local[key]), (key, p.fqn)
                    if "experts" in p.fqn:
                        covered[p.fqn] += p.data.numel()
            w1 = sd[TT + "experts.w1"].pieces
            assert [(p.fqn, p.offsets) for p in w1] == [
                (f"{HF}experts.{e}.w1.weight", (tp_rank * FFN // 2, 0))
                for e in range(3 * ep_rank, 3 * ep_rank + 3)
            ]
            w1[1].data.fill_(
                2.5
            )  # a load writes in place: the second local expert of the rank's stack
            assert bool((local[TT + "experts.w1"][1] == 2.5).all())
    assert covered == {f"{HF}experts.{e}.{w}.weight": FFN * HID for e in range(E) for w in SHAPES}


def test_stacked_one_process_and_by_an_ep_shard_rule() -> None:
    """Without an axis the stack dim is whole (one process), or cut by a layout rule on it."""
    st = stacked_reference(hf_reference())
    sd = LayoutSpec([Stacked(r"\.experts\.(w1)$", repl=r".experts.{}.\1")]).apply(
        {"m.experts.w1": st[TT + "experts.w1"]}
    )
    obj = sd["m.experts.w1"]
    assert obj.replicated and [p.fqn for p in obj.pieces] == [f"m.experts.{e}.w1" for e in range(E)]
    local = st[TT + "experts.w1"][4:6]
    spec = LayoutSpec(
        [
            Stacked(r"\.experts\.(w1)$", repl=r".experts.{}.\1", experts=E),
            Shard(r"experts", dim=0, axis="ep"),
        ],
        axes={"ep": (2, 3)},
    )
    (a, b) = spec.apply({"m.experts.w1": local})["m.experts.w1"].pieces
    assert (a.fqn, a.shape, a.offsets, b.fqn) == (
        "m.experts.4.w1",
        (FFN, HID),
        (0, 0),
        "m.experts.5.w1",
    )


def test_unstacked_pieces_with_reindex_and_tp() -> None:
    """Per-expert tensors (EP rank 1 of 2: local experts 0..2 are global 3..5; TP rank 1 of 2
    inside each) are boxes [e:e+1] of the stacked tensors, viewed with the expert dim unsqueezed."""
    ref = hf_reference()
    local = {HF + "gate.weight": ref[HF + "gate.weight"].clone()}
    for i in range(3):
        for w in SHAPES:
            t = ref[f"{HF}experts.{3 + i}.{w}.weight"]
            n = t.shape[TP_DIM[w]] // 2
            local[f"{HF}experts.{i}.{w}.weight"] = t.narrow(TP_DIM[w], n, n).clone()
    spec = LayoutSpec(
        unstacked_rules(per_rank=3)
        + [Shard(r"w[13]\.weight$", dim=0, axis="tp"), Shard(r"w2\.weight$", dim=1, axis="tp")],
        axes={"ep": (1, 2), "tp": (1, 2)},
    )
    sd = spec.apply(local)
    st = stacked_reference(ref)
    for key, obj in _pieces(sd):
        (p,) = obj.pieces
        assert bit_equal(p.data, _box(st[p.fqn], p.offsets, tuple(p.data.shape))), key
        assert _views(p.data, local[key]), key
    p = sd[f"{HF}experts.1.w2.weight"].pieces[0]
    assert (p.fqn, p.shape, p.offsets, tuple(p.data.shape)) == (
        TT + "experts.w2",
        (E, HID, FFN),
        (4, 0, FFN // 2),
        (1, HID, FFN // 2),
    )
    assert not sd[f"{HF}experts.1.w2.weight"].replicated and sd[HF + "gate.weight"].replicated
    # The stack dim anywhere: last.
    sd = LayoutSpec([Unstacked(r"\.(\d+)$", repl="", experts=3, dim=-1)]).apply(
        {"b.2": torch.ones(4)}
    )
    (p,) = sd["b.2"].pieces
    assert (p.fqn, p.shape, p.offsets, tuple(p.data.shape)) == ("b", (4, 3), (0, 2), (4, 1))


def test_stack_rules_round_trip_through_json() -> None:
    spec = LayoutSpec(
        stacked_rules("ep", tp=True) + unstacked_rules(per_rank=2),
        axes={"ep": (1, 3), "tp": (0, 2)},
    )
    data = json.loads(json.dumps(spec.to_json()))
    assert (
        LayoutSpec.from_json(data) == spec
        and LayoutSpec.from_json(data).to_json() == spec.to_json()
    )
    assert data["rules"][3] == {
        "rule": "Stacked",
        "pattern": r"\.experts\.(w[123])$",
        "optional": False,
        "repl": r".experts.{}.\1.weight",
        "dim": 0,
        "experts": E,
        "axis": "ep",
    }


# ------------------------------------------------------------------ errors


def test_stack_rule_errors() -> None:
    local = local_stacked(stacked_reference(hf_reference()), 1, 3)  # 2 experts: 6 over 3 ranks
    with pytest.raises(LayoutRuleError) as e:
        LayoutSpec(stacked_rules("ep") + [Replicated("gate")], axes={"ep": (1, 2)}).apply(local)
    assert str(e.value) == (
        r"Stacked('\\.experts\\.(w[123])$', repl='.experts.{}.\\1.weight', experts=6, axis='ep'): "
        "'layers.0.moe.experts.w1' stacks 4 experts along dim 0 (2 on each of 2 'ep' coordinates), "
        "expected experts=6"
    )
    with pytest.raises(LayoutRuleError) as e:
        LayoutSpec(unstacked_rules()).apply({f"{HF}experts.6.w1.weight": torch.zeros(2)})
    assert str(e.value) == (
        r"Unstacked('\\.experts\\.(\\d+)\\.(w[123])\\.weight$', repl='.experts.\\2', experts=6): "
        "'layers.0.moe.experts.6.w1.weight' "
        "(from 'model.layers.0.block_sparse_moe.experts.6.w1.weight') "
        "is expert 6, outside the 6 experts of the stacked tensor"
    )
    with pytest.raises(
        LayoutRuleError,
        match=re.escape(
            "Stacked('x', repl='x'): repl must hold '{}' once, where the expert index goes"
        ),
    ):
        Stacked("x", repl="x")
    with pytest.raises(LayoutRuleError, match=r"needs a capture group \(the expert index\)"):
        Unstacked(r"experts\.\d+", experts=4)
    with pytest.raises(LayoutRuleError, match=r"give experts, the number of experts"):
        Unstacked(r"experts\.(\d+)")
    with pytest.raises(
        LayoutRuleError,
        match=re.escape(
            "splits dim 0 of 'w' over 'ep', but the layout rule that matches it already cut "
            "that dim (2 of 4)"
        ),
    ):
        LayoutSpec(
            [Stacked("w", repl="{}", axis="ep"), Shard("w", dim=0, axis="tp")],
            axes={"ep": (0, 2), "tp": (0, 2)},
        ).apply({"w": torch.zeros(2, 3)})
    with pytest.raises(
        LayoutRuleError, match=r"has 1 dims, so the stacked tensor has 2, which have no dim 2"
    ):
        LayoutSpec([Unstacked(r"(\d)", experts=2, dim=2)]).apply({"1": torch.zeros(3)})


# ------------------------------------------------------------------ one process, through DCP


def _hf_dir(path: Path, ref: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in ref.items()}, str(path / "model.safetensors")
    )
    return str(path)


def _nbytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def test_one_process_hf_to_stacked_and_refusals(tmp_path: Path) -> None:
    """A model.safetensors into a whole stacked model (offset reads: exactly the file's tensor
    bytes); a missing expert and a stacked checkpoint of another E name the tensor."""
    ref = hf_reference(seed=1)
    hf = _hf_dir(tmp_path / "hf", ref)
    st = stacked_reference(ref)
    sd = {k: torch.full_like(v, float("nan")) for k, v in st.items()}
    spec = LayoutSpec(stacked_rules() + [Replicated("gate")])
    reader = UCPStorageReader(hf)
    dcp.load(spec.apply(sd), storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
    assert [k for k in st if not bit_equal(sd[k], st[k])] == []
    assert reader.last_load.bytes_requested == _nbytes(ref.values())
    # Expert 5 missing from the file.
    hf5 = _hf_dir(tmp_path / "hf5", {k: v for k, v in ref.items() if ".experts.5." not in k})
    err = _load_error(spec.apply(sd), hf5)
    assert isinstance(err, CheckpointKeyError) and (
        "3 key(s) of the state dict are missing from the checkpoint: "
        f"['{HF}experts.5.w1.weight', '{HF}experts.5.w2.weight', '{HF}experts.5.w3.weight']"
    ) in str(err)
    # A stacked checkpoint of 6 experts into per-expert tensors that say 8.
    dcp.save(
        st,
        storage_writer=UCPStorageWriter(str(tmp_path / "st")),
        planner=UCPSavePlanner(),
        no_dist=True,
    )
    rules = [
        r if not isinstance(r, Unstacked) else Unstacked(r.pattern, repl=r.repl, experts=8)
        for r in unstacked_rules()
    ]
    err = _load_error(LayoutSpec(rules).apply(dict(ref)), str(tmp_path / "st"))
    assert isinstance(err, CheckpointKeyError) and str(err) == (
        "Size mismatch for 'layers.0.moe.experts.w1': the checkpoint has shape [6, 32, 64], "
        "the state dict expects [8, 32, 64]"
    )


def _load_error(sd: dict[str, Any], path: str) -> BaseException | None:
    """The library's error a one-process load of ``sd`` from ``path`` fails with."""
    with pytest.raises(CheckpointException) as e:
        dcp.load(sd, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(), no_dist=True)
    return unwrap(e.value)


# ------------------------------------------------------------------ with ranks

Phase = Callable[[int, int, dict[str, str], Any], None]


def _phases(rank: int, world: int, paths: dict[str, str], phases: list[tuple[int, Phase]]) -> None:
    """Each ``fn(rank, n, paths, group)`` on ranks ``0..n-1``, one after another (as in
    test_layout_multiproc)."""
    for n, fn in phases:
        group = dist.group.WORLD if n == world else dist.new_group(list(range(n)))
        if rank < n:
            fn(rank, n, paths, group)
        dist.barrier()


def _placements(w: str, tp: bool) -> list[Any]:
    from torch.distributed.tensor import Shard as DShard

    return [DShard(0), DShard(TP_DIM[w] + 1)] if tp else [DShard(0)]


def _stacked_dtensors(
    st: dict[str, torch.Tensor], mesh: Any, tp: bool, nan: bool
) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, float("nan")) if nan else t

    out = {
        TT + "router.gate.weight": distribute_tensor(
            full(st[TT + "router.gate.weight"]), mesh, [Replicate()] * mesh.ndim
        )
    }
    for w in SHAPES:
        out[f"{TT}experts.{w}"] = distribute_tensor(
            full(st[f"{TT}experts.{w}"]), mesh, _placements(w, tp)
        )
    return out


def _load_checked(
    sd: dict[str, Any], spec: LayoutSpec, path: str, group: Any, gap_bytes: int | None = None
) -> int:
    """Load through ``spec``; the bytes the reader asked of storage."""
    reader = UCPStorageReader(path, options=ReadOptions(gap_bytes=gap_bytes))
    dcp.load(spec.apply(sd), storage_reader=reader, planner=UCPLoadPlanner(), process_group=group)
    return reader.last_load.bytes_requested


def _hf_into_dtensor(rank: int, world: int, paths: dict[str, str], group: Any, tp: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    st = stacked_reference(hf_reference())
    mesh = init_device_mesh(
        "cpu", (2, 2) if tp else (world,), mesh_dim_names=("ep", "tp") if tp else ("ep",)
    )
    sd = _stacked_dtensors(st, mesh, tp, nan=True)
    got = _load_checked(
        sd, LayoutSpec(stacked_rules()), paths["hf"], group, gap_bytes=0 if tp else None
    )
    want = _stacked_dtensors(st, mesh, tp, nan=False)
    assert [k for k in sd if not bit_equal(sd[k].to_local(), want[k].to_local())] == [], (rank, tp)
    # Exactly the experts this rank holds (6 over 4 EP ranks: 2, 2, 2, 0), and the router.
    assert got == _nbytes(v.to_local() for v in want.values()), (rank, tp, got)
    with pytest.raises(
        LayoutRuleError, match=r"a DTensor: its placements say which experts this rank holds"
    ):
        LayoutSpec(stacked_rules("ep"), axes={"ep": (0, 1)}).apply(sd)


def _hf_into_ep(rank: int, world: int, paths: dict[str, str], group: Any) -> None:
    _hf_into_dtensor(rank, world, paths, group, tp=False)


def _hf_into_ep_tp(rank: int, world: int, paths: dict[str, str], group: Any) -> None:
    _hf_into_dtensor(rank, world, paths, group, tp=True)


def _hf_into_plain_ep_tp(rank: int, world: int, paths: dict[str, str], group: Any) -> None:
    ep_rank, tp_rank = divmod(rank, 2)
    st = stacked_reference(hf_reference())
    want = local_stacked(st, ep_rank, 2, tp_rank, 2)
    sd = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    spec = LayoutSpec(
        stacked_rules("ep", tp=True) + [Replicated("gate")],
        axes={"ep": (ep_rank, 2), "tp": (tp_rank, 2)},
    )
    got = _load_checked(sd, spec, paths["hf"], group, gap_bytes=0)
    assert [k for k in want if not bit_equal(sd[k], want[k])] == [], rank
    assert got == _nbytes(want.values()), (rank, got)


def _save_stacked_ep(rank: int, world: int, paths: dict[str, str], group: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    sd = _stacked_dtensors(stacked_reference(hf_reference()), mesh, tp=False, nan=False)
    dcp.save(
        sd,
        storage_writer=UCPStorageWriter(paths["stacked"]),
        planner=UCPSavePlanner(),
        process_group=group,
    )


def _stacked_into_per_expert(rank: int, world: int, paths: dict[str, str], group: Any) -> None:
    want = _per_expert_local(rank, world)
    sd = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    per = E // world
    spec = LayoutSpec(unstacked_rules(per_rank=per if world > 1 else 0), axes={"ep": (rank, world)})
    got = _load_checked(sd, spec, paths["stacked"], group)
    assert [k for k in want if not bit_equal(sd[k], want[k])] == [], (rank, world)
    assert got == _nbytes(want.values()), (rank, world, got)


def _per_expert_local(rank: int, world: int) -> dict[str, torch.Tensor]:
    """EP rank ``rank`` of ``world``'s per-expert tensors under local indices, and the router."""
    ref = hf_reference()
    per = E // world
    out = {HF + "gate.weight": ref[HF + "gate.weight"]}
    for i in range(per):
        for w in SHAPES:
            out[f"{HF}experts.{i}.{w}.weight"] = ref[f"{HF}experts.{rank * per + i}.{w}.weight"]
    return out


def _save_plain_stacked_as_per_expert(
    rank: int, world: int, paths: dict[str, str], group: Any
) -> None:
    ep_rank, tp_rank = divmod(rank, 2)
    local = local_stacked(stacked_reference(hf_reference()), ep_rank, 2, tp_rank, 2)
    spec = LayoutSpec(
        stacked_rules("ep", tp=True) + [Replicated("gate")],
        axes={"ep": (ep_rank, 2), "tp": (tp_rank, 2)},
    )
    dcp.save(
        spec.apply(local, record=True),
        storage_writer=UCPStorageWriter(paths["per_expert"]),
        planner=UCPSavePlanner(),
        process_group=group,
    )


def _per_expert_checkpoint_as_it_is(
    rank: int, world: int, paths: dict[str, str], group: Any
) -> None:
    """What the stacked EP x TP save wrote: Hugging Face's per-expert tensors, no spec needed."""
    want = hf_reference()
    sd = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    reader = UCPStorageReader(paths["per_expert"])
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(), process_group=group)
    assert [k for k in want if not bit_equal(sd[k], want[k])] == []


def _save_per_expert_as_stacked(rank: int, world: int, paths: dict[str, str], group: Any) -> None:
    spec = LayoutSpec(unstacked_rules(per_rank=E // world), axes={"ep": (rank, world)})
    dcp.save(
        spec.apply(_per_expert_local(rank, world), record=True),
        storage_writer=UCPStorageWriter(paths["stacked2"]),
        planner=UCPSavePlanner(),
        process_group=group,
    )


def _stacked_checkpoint_into_dtensors(
    rank: int, world: int, paths: dict[str, str], group: Any
) -> None:
    """The per-expert EP 2 save wrote stacked tensors: a stacked EP 4 model reads them as such."""
    from torch.distributed.device_mesh import init_device_mesh

    st = stacked_reference(hf_reference())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    sd = _stacked_dtensors(st, mesh, tp=False, nan=True)
    dcp.load(
        sd,
        storage_reader=UCPStorageReader(paths["stacked2"]),
        planner=UCPLoadPlanner(),
        process_group=group,
    )
    want = _stacked_dtensors(st, mesh, tp=False, nan=False)
    assert [k for k in sd if not bit_equal(sd[k].to_local(), want[k].to_local())] == [], rank


@pytest.mark.multiproc
def test_hf_experts_into_stacked_ep_and_back(tmp_path: Path) -> None:
    """A Mixtral-style model.safetensors into stacked experts: DTensor EP 4 (6 experts: 2, 2, 2,
    0), DTensor EP 2 x TP 2, plain EP 2 x TP 2; a stacked EP 4 save into per-expert EP 2 and one
    process. Saves through the rules: plain stacked EP 2 x TP 2 as per-expert tensors, per-expert
    EP 2 as stacked ones, each then read by a model of the other form with no rules at all."""
    paths = {"hf": _hf_dir(tmp_path / "hf", hf_reference())}
    paths.update((k, str(tmp_path / k)) for k in ("stacked", "per_expert", "stacked2"))
    run_ranks(
        4,
        _phases,
        paths,
        [
            (4, _hf_into_ep),
            (4, _hf_into_ep_tp),
            (4, _hf_into_plain_ep_tp),
            (4, _save_stacked_ep),
            (2, _stacked_into_per_expert),
            (1, _stacked_into_per_expert),
            (4, _save_plain_stacked_as_per_expert),
            (1, _per_expert_checkpoint_as_it_is),
            (2, _save_per_expert_as_stacked),
            (4, _stacked_checkpoint_into_dtensors),
        ],
    )
