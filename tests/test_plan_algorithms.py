"""The planners' algorithms on their own: plain functions over plans and records, no process group.

What travels between ranks (:mod:`ucp_dcp.dcp._plan_records`), the save
checks (values and replicated pieces agree, pieces tile their tensor, one
key one tensor), the writer choice, mesh-group agreement and ownership, the
derived writes of a mesh coordinate, load overlap finding, the asked-keys
bitmap and rank-local values.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ucp_dcp import RankLocal
from ucp_dcp.core.values import set_in_place
from ucp_dcp.core.pieces import Piece, TensorPieces
from ucp_dcp.core.sharding import Box
from ucp_dcp.dcp.load_planner import (
    RankLocalGather,
    asked_keys,
    check_target,
    key_list,
    keys_no_rank_asked,
    overlap_reads,
    rank_local_reads,
    saved_grid,
)
from ucp_dcp.dcp._mesh_groups import MeshGroup, TensorSpec, group_items, shard_item
from ucp_dcp.dcp._plan_records import (
    LoadRankReport,
    LoadSourceInfo,
    MeshGroupReport,
    SaveRankReport,
    SaveReply,
    SaveSummary,
)
from ucp_dcp.dcp import _save_global as save_global
from ucp_dcp.dcp._save_global import (
    SMALL_TENSOR_BYTES,
    assign_owners,
    assign_writers,
    check_groups,
    check_replicated_pieces,
    check_tiling,
    collect_chunks,
    create_global_save_plan,
    divergent_keys,
    group_replies,
    merged_layouts,
    plan_value_item,
    value_writers,
)
from ucp_dcp.dcp.save_planner import create_local_save_plan
from ucp_dcp.errors import CheckpointKeyError, InconsistentSaveError
from ucp_dcp.format import LAYOUT_KEY, Layout, rank_local_key

ROWS = Layout((2,), ("S(0)",))


def report(rank: int, **kw: Any) -> SaveRankReport:
    """A rank's report with nothing in it but what ``kw`` gives."""
    empty: dict[str, Any] = {"digests": {}, "layouts": {}, "rank_local": (), "groups": (), "pieces": (),
                             "piece_digests": {}}
    return SaveRankReport(rank=rank, **{**empty, **kw})


def chunk_plan(
    rank: int, boxes: list[tuple[str, Box, tuple[int, ...]]], dtype: torch.dtype = torch.float32
) -> SavePlan:
    """A local plan of tensor chunks ``(fqn, box, global shape)``."""
    return SavePlan([shard_item(f, b, dtype, shape) for f, b, shape in boxes], planner_data=report(rank))


def group(ranks: tuple[int, ...], *specs: TensorSpec) -> MeshGroup:
    return MeshGroup((len(ranks),), ranks, tuple(sorted(specs, key=lambda t: t.fqn)))


def spec(fqn: str, shape: tuple[int, ...] = (4, 4), layout: Layout = ROWS, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(fqn, dtype, shape, layout)


def describe(g: MeshGroup, rank: int) -> MeshGroupReport:
    return MeshGroupReport(g.signature, g.first_rank, g.to_json() if rank == g.first_rank else None)


# ------------------------------------------------------------------ records


def test_records_pickle_and_stay_compact() -> None:
    """Records that travel between ranks survive pickle and cost no more than the dicts they replace."""
    g = group((0, 1), spec("w"))
    rec = report(
        3, digests={"lr": "ab"}, layouts={"b": Layout()}, rank_local=("rng",), groups=(describe(g, 0),),
        pieces=("p",), piece_digests={("p", (0, 2)): "cd"},
    )
    assert pickle.loads(pickle.dumps(rec)) == rec
    as_dict = {
        "rank": 3, "digests": {"lr": "ab"}, "layouts": {"b": Layout().to_json()}, "rank_local": ["rng"],
        "groups": [(g.signature, 0, g.to_json())], "pieces": ["p"], "piece_digests": {("p", (0, 2)): "cd"},
    }
    assert len(pickle.dumps(rec)) <= len(pickle.dumps(as_dict)) + 40  # the class is named once per pickle
    for r in (SaveReply(("a", "b")), LoadRankReport(1, 5, b"\x80")):
        assert pickle.loads(pickle.dumps(r)) == r
    # A slotted record pickles its values only: no field names on the wire.
    assert b"piece_digests" not in pickle.dumps(rec) and b"asked" not in pickle.dumps(LoadRankReport(1, 5, b""))


def test_metadata_records_from_other_planners_and_readers() -> None:
    """Metadata made by DCP's own planner or reader reads as empty records, and vice versa."""
    md = Metadata({}, planner_data={"model.w": ("model", "w")})  # DCP's flattening mappings
    assert LoadSourceInfo.of(md) == LoadSourceInfo() and LoadSourceInfo.of(None).rank_local == {}
    assert SaveSummary.of(md, 4) == SaveSummary(4, {}, {}, {})
    info = LoadSourceInfo(2, {"rng": [0, 1]})
    assert "rng" not in info and info.get("rng") is None  # DCP's planners look for mappings there


# ------------------------------------------------------------------ save checks


def test_divergent_keys() -> None:
    same = [report(0, digests={"lr": "a"}), report(1, digests={"lr": "a"})]
    assert divergent_keys(same, allow_rank_local=False) == set()
    values = [report(0, digests={"pos": "a", "lr": "x"}), report(1, digests={"pos": "b", "lr": "x"})]
    with pytest.raises(InconsistentSaveError, match=r"non-tensor value 'pos' differs across ranks \(ranks 0 hold one value"):
        divergent_keys(values, allow_rank_local=False)
    assert divergent_keys(values, allow_rank_local=True) == {"pos"}
    tensors = [report(r, digests={"t": str(r)}, layouts={"t": Layout()}) for r in range(2)]
    with pytest.raises(InconsistentSaveError, match="plain tensor 't' differs"):
        divergent_keys(tensors, allow_rank_local=True)  # never made rank-local


def test_check_replicated_pieces() -> None:
    ok = [report(r, piece_digests={("n", (0,)): "a"}) for r in range(3)]
    check_replicated_pieces(ok)
    bad = [report(r, piece_digests={("n", (0,)): "a" if r < 2 else "b"}) for r in range(3)]
    with pytest.raises(InconsistentSaveError, match=r"replicated tensor 'n' \(box at offsets \[0\]\) differs.*ranks 0, 1 hold"):
        check_replicated_pieces(bad)


def test_check_tiling() -> None:
    """Pieces must cover their tensor exactly once; chunks of other tensors are not checked."""
    reports = [report(0, pieces=("p",)), report(1, pieces=("p",))]
    whole = [chunk_plan(0, [("p", Box((0,), (4,)), (8,))]), chunk_plan(1, [("p", Box((4,), (4,)), (8,))])]
    check_tiling(reports, collect_chunks(whole))
    gap = [chunk_plan(0, [("p", Box((0,), (3,)), (8,))]), chunk_plan(1, [("p", Box((4,), (4,)), (8,))])]
    with pytest.raises(InconsistentSaveError, match="hold 7 elements in all, leaving elements that no rank holds"):
        check_tiling(reports, collect_chunks(gap))
    overlap = [chunk_plan(0, [("p", Box((0,), (5,)), (8,))]), chunk_plan(1, [("p", Box((4,), (4,)), (8,))])]
    with pytest.raises(InconsistentSaveError, match="so some of them overlap"):
        check_tiling(reports, collect_chunks(overlap))
    check_tiling([report(0)], collect_chunks(gap))  # not pieces: DTensor chunks tile by construction


def test_collect_chunks_refuses_one_key_two_tensors() -> None:
    a = chunk_plan(0, [("t", Box((0,), (4,)), (4,))])
    with pytest.raises(InconsistentSaveError, match=r"tensor 't' is float32\[4\] on rank 0 but bfloat16\[4\] on rank 1"):
        collect_chunks([a, chunk_plan(1, [("t", Box((0,), (4,)), (4,))], torch.bfloat16)])
    with pytest.raises(InconsistentSaveError, match=r"rank 0 saves a box of size \[4\] at offsets \[0\] but rank 1 one of size"):
        collect_chunks([a, chunk_plan(1, [("t", Box((0,), (2,)), (4,))])])


def test_assign_writers_spreads_replicas() -> None:
    """Each distinct chunk gets one writer; replicated tensors go to the least-loaded replica, largest
    first, and tensors of at most 64 KiB to their lowest holder, however many there are (a load of
    them then opens one file for them, not one per rank)."""
    n = SMALL_TENSOR_BYTES // 4  # float32 elements of the largest "small" tensor
    plans = [
        chunk_plan(r, [("big", Box((0,), (8 * n,)), (8 * n,)), ("mid", Box((0,), (n + 1,)), (n + 1,)),
                       ("small", Box((0,), (n,)), (n,))]
                   + [(f"step{i}", Box((), ()), ()) for i in range(6)]
                   + [(f"own{r}", Box((0,), (1,)), (1,))])
        for r in range(4)
    ]
    table = collect_chunks(plans)
    assert table.holders[("big", (0,))] == [0, 1, 2, 3]
    writer = assign_writers(table, 4)
    assert writer[("big", (0,))] == 0 and writer[("mid", (0,))] == 1  # least loaded, largest first
    assert writer[("small", (0,))] == 0 and {writer[(f"step{i}", ())] for i in range(6)} == {0}
    assert [writer[(f"own{r}", (0,))] for r in range(4)] == [0, 1, 2, 3]
    md = table.metadata()
    assert {"big", "mid", "small", "own0", "step5"} <= set(md) and list(md["big"].size) == [8 * n]


def test_small_replicated_tensors_fill_the_lowest_holders_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each holder takes at most SMALL_BYTES_PER_RANK of small tensors, then the next one does: a
    state of many small replicated tensors still spreads its writes, over as few files as that
    allows; one that fits nowhere goes to the least-loaded holder."""
    monkeypatch.setattr(save_global, "SMALL_BYTES_PER_RANK", 8)  # two float32 scalars a rank
    plans = [chunk_plan(r, [(f"step{i}", Box((), ()), ()) for i in range(9)]) for r in range(4)]
    writer = assign_writers(collect_chunks(plans), 4)
    # Two a rank, lowest first; the ninth finds no room and goes to the least loaded (all alike).
    assert [writer[(f"step{i}", ())] for i in range(9)] == [0, 0, 1, 1, 2, 2, 3, 3, 0]


# ------------------------------------------------------------------ mesh groups


def test_check_groups() -> None:
    g = group((0, 1), spec("w"))
    agreed = [report(r, groups=(describe(g, r),)) for r in range(2)]
    assert [x.signature for x in check_groups(agreed)] == [g.signature]
    undescribed = [report(r, groups=(MeshGroupReport(g.signature, 0, None),)) for r in range(2)]
    with pytest.raises(InconsistentSaveError, match="whose first rank is 0, but rank 0 does not hold the same ones"):
        check_groups(undescribed)
    with pytest.raises(InconsistentSaveError, match=r"rank\(s\) 1 of it did not report the same ones"):
        check_groups(agreed[:1])


def test_owners_and_replies() -> None:
    """A tensor several meshes hold alike is written by one; the others are told to skip it."""
    g0, g1 = group((0, 1), spec("a"), spec("b")), group((2, 3), spec("a"), spec("b"))
    owners = assign_owners([g0, g1], taken=set())
    assert {owners["a"][0].first_rank, owners["b"][0].first_rank} == {0, 2}  # one each: balanced
    reports = [report(r, groups=(describe(g0 if r < 2 else g1, r),)) for r in range(4)]
    replies = group_replies([g0, g1], owners, reports)
    skipped = {r: rep.skip for r, rep in enumerate(replies) if rep is not None}
    assert skipped[0] == skipped[1] != skipped[2] == skipped[3] and len(skipped[0]) == 1
    with pytest.raises(InconsistentSaveError, match="as a DTensor on some ranks and a plain or irregular tensor on others"):
        assign_owners([g0], taken={"a"})
    with pytest.raises(InconsistentSaveError, match=r"as float32\[4, 4\] on ranks 0, 1 and as float32\[8, 4\] on ranks 2, 3"):
        assign_owners([g0, group((2, 3), spec("a", (8, 4)))], taken=set())


def test_group_items_by_coordinate() -> None:
    """Each coordinate writes its own rows; a replicated tensor is written by one replica only."""
    g = group((0, 1), spec("w"), spec("norm", (4,), Layout((2,), ("R",))))
    items = {c: group_items(g, c, [c], frozenset()) for c in (0, 1)}
    rows = {c: [(i.index.fqn, tuple(i.tensor_data.chunk.offsets)) for i in items[c] if i.index.fqn == "w"]
            for c in (0, 1)}
    assert rows == {0: [("w", (0, 0))], 1: [("w", (2, 0))]}
    assert sum(i.index.fqn == "norm" for c in (0, 1) for i in items[c]) == 1
    assert not [i for i in group_items(g, 0, [0], frozenset({"w"})) if i.index.fqn == "w"]


# ------------------------------------------------------------------ local and global save plans


def test_local_then_global_save_plan() -> None:
    """Two ranks' local plans (no process group) through the coordinator's step."""
    local = []
    for r in range(2):
        sd = {
            "lr": 0.1, "w": torch.ones(4), "rng": RankLocal(r),
            "flat": TensorPieces([Piece("p", (4,), (2 * r,), torch.full((2,), float(r)))]),
        }
        local.append(create_local_save_plan(sd, r, 2))
    rep0 = local[0].plan.planner_data
    assert isinstance(rep0, SaveRankReport) and rep0.rank_local == ("rng",) and rep0.pieces == ("p",)
    assert set(rep0.digests) == {"lr", "w"} and local[0].layouts["w"] == Layout()
    plans, md = create_global_save_plan([lp.plan for lp in local], allow_rank_local=False)
    summary = md.planner_data
    assert isinstance(summary, SaveSummary) and summary.world_size == 2 and summary.positions == {0: 0, 1: 1}
    keys = [[(i.index.fqn, i.type) for i in p.items] for p in plans]
    assert ("lr", WriteItemType.BYTE_IO) in keys[0] and ("lr", WriteItemType.BYTE_IO) not in keys[1]
    assert [k for k in keys[0] + keys[1] if k[0] == "w"] == [("w", WriteItemType.TENSOR)]  # written once
    assert (rank_local_key(1, "rng"), WriteItemType.BYTE_IO) in keys[1]
    assert set(md.state_dict_metadata) == {"w", "p", "lr", "rng"} and all(p.planner_data is None for p in plans)


def test_local_plan_refuses_one_piece_twice() -> None:
    t = torch.zeros(2)
    sd = {"a": TensorPieces([Piece("p", (4,), (0,), t)]), "b": TensorPieces([Piece("p", (4,), (0,), t)])}
    with pytest.raises(InconsistentSaveError, match=r"gives the piece at offsets \[0\] twice, under state-dict keys 'a' and 'b'"):
        create_local_save_plan(sd, 0, 1)


def test_merged_layouts() -> None:
    other = Layout((2,), ("R",))
    merged = merged_layouts([report(0, layouts={"a": ROWS, "b": ROWS}), report(1, layouts={"a": ROWS, "b": other})])
    assert merged == {"a": ROWS, "b": None}


def test_values_written_once_or_per_rank() -> None:
    reports = [report(0, digests={"x": "1"}), report(1, digests={"x": "1", "y": "2"})]
    writers = value_writers(reports)
    assert writers == {"x": 0, "y": 1}
    item = create_local_save_plan({"x": 1}, 1, 2).plan.items[0]
    assert plan_value_item(item, 1, set(), writers) is None  # rank 0 writes it
    assert plan_value_item(item, 1, {"x"}, writers).index.fqn == rank_local_key(1, "x")


# ------------------------------------------------------------------ load


def _smd(shape: tuple[int, ...], boxes: list[Box]) -> TensorStorageMetadata:
    chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in boxes]
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)


@pytest.mark.parametrize("use_grid", [True, False])
def test_overlap_reads(use_grid: bool) -> None:
    """A target across two saved chunks reads the overlap of each, by grid search or by scanning."""
    smd = _smd((4, 4), ROWS.chunks((4, 4)))
    grid = saved_grid(LoadSourceInfo(), "w", smd) if use_grid else None
    assert not use_grid or grid is not None
    reads = overlap_reads("w", [Box((1, 0), (2, 4))], smd, grid)
    got = [(tuple(r.storage_index.offset), tuple(r.storage_offsets), tuple(r.dest_offsets), tuple(r.lengths))
           for r in reads]
    assert got == [((0, 0), (1, 0), (0, 0), (1, 4)), ((2, 0), (0, 0), (1, 0), (1, 4))]
    piece = overlap_reads("w", [Box((0, 0), (1, 4))], smd, grid, dest=("flat", 3))
    assert [(r.dest_index.fqn, r.dest_index.index) for r in piece] == [("flat", 3)]
    with pytest.raises(CheckpointKeyError, match="the saved chunks cover 4 of the 8 elements"):
        overlap_reads("w", [Box((1, 0), (2, 4))], _smd((4, 4), [Box((0, 0), (2, 4))]), None)


def test_saved_grid_from_the_reader() -> None:
    asked: list[str] = []
    info = LoadSourceInfo(chunk_grid=lambda fqn: asked.append(fqn))  # type: ignore[arg-type,func-returns-value]
    assert saved_grid(info, "w", _smd((4,), [])) is None and asked == ["w"]


def test_check_target() -> None:
    smd = _smd((4,), [Box((0,), (4,))])
    assert check_target("w", torch.zeros(4), smd, (4,), False) is smd
    with pytest.raises(CheckpointKeyError, match=r"Size mismatch for 'w': the checkpoint has shape \[4\]"):
        check_target("w", torch.zeros(5), smd, (5,), False)
    with pytest.raises(CheckpointKeyError, match="dtype mismatch for 'w'"):
        check_target("w", torch.zeros(4, dtype=torch.bfloat16), smd, (4,), False)
    check_target("w", torch.zeros(4, dtype=torch.bfloat16), smd, (4,), True)


def test_asked_keys() -> None:
    keys = sorted(["a", "b", "c", LAYOUT_KEY])
    m0, unexpected = asked_keys(keys, {"a"})
    m1, _ = asked_keys(keys, {"b"})
    assert unexpected == ["b", "c"]  # the layout record is never reported
    assert keys_no_rank_asked(keys, [m0, m1]) == ["c"]
    assert len(m0) == 1 and np.unpackbits(np.frombuffer(m0, np.uint8))[: len(keys)].sum() == 1
    assert key_list([str(i) for i in range(3)], limit=2) == "['0', '1', ...]"


def test_rank_local_reads() -> None:
    own, gather = rank_local_reads("rng", None, [0, 1], 2, 1, 2, None)
    assert gather is None and [r.storage_index.fqn for r in own] == [rank_local_key(1, "rng")]
    with pytest.raises(CheckpointKeyError, match=r"rank-local value 'rng' was saved by 2 rank\(s\) \(world size 2\)"):
        rank_local_reads("rng", None, [0, 1], 2, 0, 1, None)
    hooked = RankLocal(None, reshard=lambda k, by, r, w: (k, by, r, w))
    reads, gather = rank_local_reads("rng", hooked, [0, 1], 2, 0, 1, None)
    assert isinstance(gather, RankLocalGather) and len(reads) == 2
    assert not gather.add(rank_local_key(1, "rng"), "b")
    assert gather.add(rank_local_key(0, "rng"), "a")
    assert gather.result("rng", 0, 1) == ("rng", {0: "a", 1: "b"}, 0, 1)


def test_set_in_place_keeps_the_callers_keys() -> None:
    sd: dict[Any, Any] = {"state": {0: {"step": 1}}}
    set_in_place(sd, ("state", "0", "step"), 5)
    assert sd == {"state": {0: {"step": 5}}}
    set_in_place(sd, ("new", "x"), 1)  # a missing container: created as DCP does
    assert sd["new"] == {"x": 1}
