"""Save under one parallel layout, load into another, with real ranks (gloo, CPU).

Every loaded local shard is compared bit for bit with the matching slice of
the full tensor gathered at save time; optimizer ``step``/``param_groups``
and rank-local values must round-trip too.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dist_utils import bit_equal, run_ranks
from layouts import build, check_against, full_reference, scramble, train_state, train_step
from ucp_dcp import RankLocal, ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter

pytestmark = pytest.mark.multiproc

SOURCES = {4: ["dp4", "dp2tp2", "hsdp2x2"], 1: ["plain"]}


def _extra(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + rank)
    return {"rank": rank, "rng": torch.randint(0, 255, (8,), generator=g, dtype=torch.uint8), "pos": 17 * rank}


def _save_sources(rank: int, world: int, root: str, layouts: list[str], use_async: bool) -> None:
    for layout in layouts:
        model, optim = build(layout)
        for step in range(2):
            train_step(model, optim, step)
        state = train_state(model, optim)
        ref = full_reference(state)
        sd = {**state, "step": 2, "extra": RankLocal(_extra(rank))}
        path = os.path.join(root, layout)
        writer, planner = UCPStorageWriter(path), UCPSavePlanner()
        if use_async and layout == "dp4":
            dcp.async_save(sd, storage_writer=writer, planner=planner).result()
        elif use_async and layout == "dp2tp2":
            _save_in_a_process(sd, writer, planner)
        else:
            dcp.save(sd, storage_writer=writer, planner=planner)
        if rank == 0:
            torch.save({"ref": ref, "world": world}, os.path.join(root, f"{layout}.ref.pt"))


def _save_in_a_process(sd: dict[str, Any], writer: UCPStorageWriter, planner: UCPSavePlanner) -> None:
    """torchtitan's ``async_with_pinned_mem`` save: staged by a ``DefaultStager``, written by a
    checkpoint process of DCP's own (which joins a gloo group of its own; the writer and the
    planner are pickled into it), the staging awaited before the upload (pinned memory needs
    CUDA: off here). The process is stopped afterwards: the ranks end with ``os._exit``, which
    would leave it behind."""
    from torch.distributed.checkpoint import _async_process_executor as executor
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False
        )
    )
    try:
        res = dcp.async_save(
            sd,
            storage_writer=writer,
            planner=planner,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        assert isinstance(res, AsyncSaveResponse), type(res)
        res.staging_completion.result()
        res.upload_completion.result()
    finally:
        stager.close()
        proc, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
        if proc is not None:
            proc.__del__()  # DCP's own shutdown: a terminate request, then a join


def _load_targets(rank: int, world: int, root: str, pairs: list[tuple[str, str]], access: str = "auto",
                  expect: str | None = None) -> None:
    for source, target in pairs:
        what = f"{source} -> {target}"
        saved = torch.load(os.path.join(root, f"{source}.ref.pt"))
        model, optim = build(target, seed=1)  # other seed: nothing may survive from init
        state = train_state(model, optim)
        scramble(state)
        same_world = saved["world"] == world

        def reshard(key: str, by_rank: dict[int, Any], r: int, w: int) -> Any:
            return {"saved_ranks": sorted(by_rank), "pos_sum": sum(v["pos"] for v in by_rank.values())}

        extra = RankLocal(None) if same_world else RankLocal(None, reshard=reshard)
        sd = {**state, "step": 0, "extra": extra}
        reader = UCPStorageReader(os.path.join(root, source), options=ReadOptions(access=access))
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
        if expect is not None:  # the file this rank wrote is read ``expect``'s way; forced: every file
            own = [how for p, how in reader.last_load.file_access.items() if os.path.basename(p).startswith(f"rank{rank:05d}-")]
            assert own == [expect], (what, reader.last_load.file_access)
            if access != "auto":
                assert set(reader.last_load.file_access.values()) == {access}, (what, reader.last_load.file_access)
        check_against({"model": sd["model"], "optim": sd["optim"]}, saved["ref"], f"rank {rank}: {what}")
        assert sd["step"] == 2, what
        if same_world:
            want = _extra(rank)
            assert extra.value["rank"] == rank and extra.value["pos"] == want["pos"], what
            assert bit_equal(extra.value["rng"], want["rng"]), what
        else:
            n = saved["world"]
            assert extra.value == {"saved_ranks": list(range(n)), "pos_sum": 17 * sum(range(n))}, what
        # The loaded state must drive the model: set it and take a step.
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        dist.barrier()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("sources"))
    for world, layouts in SOURCES.items():
        run_ranks(world, _save_sources, root, layouts, True)
    return root


@pytest.mark.parametrize(
    "world,pairs",
    [
        (3, [("dp4", "dp3"), ("dp2tp2", "dp3"), ("hsdp2x2", "dp3"), ("plain", "dp3")]),
        (4, [("plain", "dp4"), ("dp2tp2", "tp4"), ("dp2tp2", "dp4tp1"), ("dp4", "dp2tp2"),
             ("dp4", "hsdp2x2"), ("dp2tp2", "dp2tp2"), ("hsdp2x2", "dp4")]),
        (2, [("dp4", "tp2"), ("dp2tp2", "dp2")]),
        (1, [("dp2tp2", "plain"), ("hsdp2x2", "plain")]),
    ],
    ids=["world3", "world4", "world2", "world1"],
)
def test_reshard_load(sources: str, world: int, pairs: list[tuple[str, str]]) -> None:
    """Every pair loads bit-exactly into the target layout (dp4 was saved with async_save, dp2tp2 by
    DCP's checkpoint process)."""
    run_ranks(world, _load_targets, sources, pairs)


@pytest.mark.parametrize(
    "access,pairs,expect",
    [
        # A restart on the same layout: each rank reads its own file whole, as a stream (and the
        # few bytes it needs from other ranks' files exactly).
        ("auto", [("dp4", "dp4")], "sequential"),
        ("sequential", [("dp4", "dp4"), ("dp2tp2", "tp4")], "sequential"),
        ("exact", [("dp4", "dp4"), ("dp2tp2", "tp4")], "exact"),
    ],
)
def test_reshard_load_each_access(sources: str, access: str, pairs: list[tuple[str, str]], expect: str) -> None:
    """Bit-exact loads whichever way the files are read, and the way chosen is reported."""
    run_ranks(4, _load_targets, sources, pairs, access, expect)


def test_regular_layouts_are_stored_compactly(sources: str) -> None:
    """FSDP, FSDP+TP (with _StridedShard) and HSDP tensors are indexed by layout, not chunk lists."""
    from ucp_dcp import load_index

    for layouts in SOURCES.values():
        for layout in layouts:
            index = load_index(os.path.join(sources, layout))
            explicit = sorted(k for k, t in index.tensors.items() if not t.compact)
            assert not explicit, f"{layout}: stored with explicit chunk lists: {explicit}"
            # Every file-run list is a handful of arithmetic progressions.
            assert all(len(t.files) <= 4 for t in index.tensors.values())
            placements = {p for t in index.tensors.values() for p in t.layout.placements}
            if layout == "dp2tp2":
                assert {"SS(0,2)", "S(0)", "S(1)"} <= placements, placements
            if layout == "hsdp2x2":
                assert {"R", "S(0)"} <= placements, placements
