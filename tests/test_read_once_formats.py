"""Read-once loads of every source format, with real ranks (gloo), bit-exact.

tests/test_read_once.py loads the native format; here the same exchange
loads what other tools wrote: a directory of DCP's own ``FileSystemWriter``
(``.distcp`` files holding ``torch.save`` archives), a Hugging Face
safetensors model (two shards and their index, tensors at unaligned
offsets) and DeepSpeed ZeRO checkpoints (the committed fixtures), each into
targets every rank holds whole (replicated: the most overlap there is). None
of these formats has block checksums, so nothing is checked on receipt;
every loaded tensor is compared bit for bit with the tensors that were
saved, and the bytes the ranks read from storage, summed, must be the
unique bytes the job needs (each read once) where a direct load reads them
once per rank.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fault_proxy
import pytest
import s3_server
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks
from fault_proxy import FaultProxy
from safetensors.torch import save_file
from test_deepspeed import FIXTURES, expected
from test_manager_object_restore import count_s3_bytes, sharded_state
from test_manager_object_restore import full_tensors as full_tensors_s3
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ucp_dcp import (
    ReadOptions,
    CheckpointManager,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
)
from ucp_dcp.byteio.objstore import ObjectStore
from ucp_dcp.errors import ReadOnceError, unwrap
from ucp_dcp.manager import _restore
from ucp_dcp.sources import open_source

pytestmark = pytest.mark.multiproc

s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module
s3_proxy = fault_proxy.s3_proxy  # a counting proxy in front of it (needs s3_bucket visible)

WORLD = 3
WATCHDOG_S = 300
PAGE = 4096


def _watchdog() -> None:
    """A rank stuck in a collective fails the test with every thread's stack."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)


def full_tensors() -> dict[str, torch.Tensor]:
    """The saved tensors (the same on every rank): odd shapes and dtypes, so that rows and
    shards do not fall on 4 KiB pages."""
    g = torch.Generator().manual_seed(23)
    return {
        "embed": torch.randn(301, 70, generator=g),
        "proj": torch.randn(257, 33, generator=g).to(torch.bfloat16),
        "norm": torch.randn(1000, generator=g, dtype=torch.float64),
        "ids": torch.randint(-(2**40), 2**40, (17, 5), generator=g),
        "half": torch.randn(129, 3, generator=g).half(),
    }


def _record(reader: UCPStorageReader) -> dict[str, Any]:
    """What one rank's load decided and read."""
    d, t = reader.last_load.read_once, reader.last_load.exchange
    return {
        "exchange": d is not None and d.exchange,
        "reason": None if d is None else d.reason,
        "unique": None if d is None else d.unique_bytes,
        "needed": None if d is None else d.needed_bytes,
        "read": None if t is None else t.read,
        "received": None if t is None else t.received,
        "requested": reader.last_load.bytes_requested,
    }


def _gather(rank: int, world: int, record: dict[str, Any], out: str) -> None:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        torch.save(gathered, out)


def _load_replicated(rank: int, world: int, path: str, out: str) -> None:
    """Every rank loads all of ``full_tensors()`` (plain tensors) with read_once=True."""
    _watchdog()
    want = full_tensors()
    records = {}
    for once in (False, True):
        sd = {k: torch.full_like(v, 13) for k, v in want.items()}
        reader = UCPStorageReader(path, options=ReadOptions(read_once=once))
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
        for k, v in want.items():
            assert bit_equal(sd[k], v), f"rank {rank}: {k} differs, read_once={once}"
        records[once] = _record(reader)
    _gather(rank, world, records, out)


def _located_bytes(path: str, targets: Mapping[str, torch.Tensor]) -> int:
    """The saved bytes of the chunks of ``targets`` that a read-once load exchanges, each distinct
    byte range once (tied weights share theirs). Left out: tensors saved in another dtype than
    their target's (a cast, read through staging by each rank itself)."""
    src = open_source(path)
    ranges = set()
    for k, t in targets.items():
        if src.index.tensors[k].dtype != t.dtype:
            continue
        for i in range(len(src.chunks(k))):
            loc = src.locate(k, i)
            ranges.add((loc.file, loc.start, loc.nbytes))
    return sum(n for _, _, n in ranges)


def _check_read_once(
    both: list[dict[bool, Any]], path: str, targets: Mapping[str, torch.Tensor]
) -> None:
    """Every rank exchanged, agreed on the unique bytes (the saved bytes of ``targets``: none of
    these formats has block checksums to round them out to), and the job read each of them
    once."""
    ranks = [b[True] for b in both]
    direct = [b[False] for b in both]
    assert not any(r["exchange"] for r in direct), direct
    assert all(r["exchange"] for r in ranks), ranks
    unique = ranks[0]["unique"]
    assert all(r["unique"] == unique for r in ranks), ranks
    assert all(r["needed"] == WORLD * unique for r in ranks), ranks  # replicated: every rank all
    assert unique == _located_bytes(path, targets), unique
    read = sum(r["read"] for r in ranks)
    assert read == unique, (read, unique)
    # Each rank got from the others what it did not read itself.
    assert all(r["read"] + r["received"] == unique for r in ranks), ranks
    # What the ranks asked storage for, summed (reads merge in the bytes between needed ranges,
    # such as archive headers; casts are read by each rank itself), is at most what one rank asks
    # for alone in a direct load, where every rank asks for all of it.
    alone = [r["requested"] for r in direct]
    assert min(alone) >= unique, (alone, unique)
    assert sum(r["requested"] for r in ranks) <= max(alone), (ranks, alone)


def _tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---------------------------------------------------------------- DCP's own FileSystemWriter


def _save_dcp(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_tensors().items()}
    dcp.save(sd, checkpoint_id=path)  # DCP's FileSystemWriter and DefaultSavePlanner


def test_dcp_filesystem_writer_directory(tmp_path: Path) -> None:
    path = str(tmp_path / "dcp")
    run_ranks(WORLD, _save_dcp, path)
    assert any(n.endswith(".distcp") for n in os.listdir(path))
    out = str(tmp_path / "counts.pt")
    run_ranks(WORLD, _load_replicated, path, out)
    _check_read_once(torch.load(out), path, full_tensors())


# ---------------------------------------------------------------- Hugging Face safetensors


def _save_hf(path: Path) -> None:
    """Two safetensors shards and their index, as transformers writes a sharded model."""
    path.mkdir()
    tensors = full_tensors()
    shards = {
        "model-00001-of-00002.safetensors": ["embed", "half", "proj"],
        "model-00002-of-00002.safetensors": ["norm", "ids"],
    }
    weight_map = {}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / name))
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": _tensor_bytes(tensors)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_hf_safetensors_directory(tmp_path: Path) -> None:
    path = tmp_path / "hf"
    _save_hf(path)
    assert type(open_source(str(path))).__name__ == "HFSource"
    out = str(tmp_path / "counts.pt")
    run_ranks(WORLD, _load_replicated, str(path), out)
    _check_read_once(torch.load(out), str(path), full_tensors())


# ---------------------------------------------------------------- DeepSpeed ZeRO fixtures

DS_VARIANTS = ["zero1_bf16_w2", "zero3_fp32_w4"]


def _load_deepspeed(rank: int, world: int, variant: str, out: str) -> None:
    """Every rank loads DeepSpeed's full weights and Adam moments (plain tensors)."""
    _watchdog()
    want = expected(variant)
    records = {}
    for once in (False, True):
        sd = {k: torch.full_like(v, 13) for k, v in want.items() if not k.endswith(".step")}
        reader = UCPStorageReader(FIXTURES / variant, options=ReadOptions(read_once=once))
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
        for k, v in sd.items():
            assert bit_equal(v, want[k].to(v.dtype)), f"rank {rank}: {variant} {k}, {once}"
        records[once] = _record(reader)
    _gather(rank, world, records, out)


@pytest.mark.parametrize("variant", DS_VARIANTS)
def test_deepspeed_fixture(tmp_path: Path, variant: str) -> None:
    out = str(tmp_path / "counts.pt")
    run_ranks(WORLD, _load_deepspeed, variant, out)
    targets = {k: v for k, v in expected(variant).items() if not k.endswith(".step")}
    _check_read_once(torch.load(out), str(FIXTURES / variant), targets)


# ---------------------------------------------------------------- an object store (moto S3)
#
# The default read_once ("auto") exchanges where the storage is shared by the job: an object
# store is, so replicated targets (every rank needs every byte) are read once over the job.


def _save_s3(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    state = sharded_state(7, world)
    dcp.save(
        state["model"],
        storage_writer=UCPStorageWriter(url, storage_options=options),
        planner=UCPSavePlanner(),
    )


def _load_s3(
    rank: int, world: int, url: str, options: dict[str, Any], once: bool | str, out: str
) -> None:
    """Replicated targets from S3 (``once == "auto"``: read_once left at its default); what s3fs
    fetched."""
    _watchdog()
    want = full_tensors_s3(7)
    sd = {k: torch.full_like(v, 13) for k, v in want.items()}
    with pytest.MonkeyPatch.context() as mp:
        counted = count_s3_bytes(mp)
        kw: dict[str, Any] = {} if once == "auto" else {"read_once": once}
        reader = UCPStorageReader(url, storage_options=options, options=ReadOptions(**kw))
        assert reader.options.read_once == once
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    for k, v in want.items():
        assert bit_equal(sd[k], v), f"rank {rank}: {k} differs, read_once={once}"
    fetched = {"s3": counted["bytes"], "downloads": counted["downloads"]}
    _gather(rank, world, {**_record(reader), **fetched}, out)


@pytest.fixture(scope="module")
def saved_s3(s3_bucket: tuple[str, dict[str, Any]]) -> str:
    """The URL of a checkpoint saved on WORLD ranks in the test server (once for the module)."""
    base, options = s3_bucket
    url = f"{base}/read-once-{uuid.uuid4().hex[:8]}"
    run_ranks(WORLD, _save_s3, url, options)
    return url


def test_object_store_auto_reads_each_byte_once(
    saved_s3: str, s3_proxy: tuple[str, dict[str, Any], FaultProxy], tmp_path: Path
) -> None:
    # The options lead s3fs through the proxy, which counts what the server sends.
    _, options, proxy = s3_proxy
    url = saved_s3
    runs: dict[bool | str, tuple[list[dict[str, Any]], int]] = {}
    for once in ("auto", False):
        proxy.reset_records()
        out = str(tmp_path / f"counts-{once}.pt")
        run_ranks(WORLD, _load_s3, url, options, once, out)
        runs[once] = torch.load(out), proxy.bytes_sent("GET")
    (auto, server_auto), (direct, server_direct) = runs["auto"], runs[False]
    assert all(r["exchange"] for r in auto), auto
    assert all("shared storage (object store)" in r["reason"] for r in auto), auto
    assert not any(r["exchange"] for r in direct), direct
    assert not any(r["downloads"] for r in auto + direct)
    unique = auto[0]["unique"]
    tensors = _tensor_bytes(full_tensors_s3(7))
    assert all(r["unique"] == unique for r in auto)
    # Whole checksum blocks of the saved chunks: the tensors' bytes, rounded up to 4 KiB per chunk.
    assert tensors <= unique <= tensors + WORLD * len(full_tensors_s3(7)) * PAGE, unique
    assert sum(r["read"] for r in auto) == unique
    assert sum(r["requested"] for r in auto) == unique
    # Counted at s3fs: the data each rank fetches, summed, is the unique bytes once, plus what is
    # not tensor data (index, headers, block checksums: every rank reads them for itself, as
    # in a direct load); directly, every rank fetches all of it.
    once_s3 = sum(r["s3"] for r in auto)
    direct_s3 = sum(r["s3"] for r in direct)
    assert once_s3 <= unique + sum(r["s3"] - r["requested"] for r in direct), (once_s3, unique)
    assert direct_s3 >= WORLD * tensors
    # Counted at the server (GET bodies, listings included): the same picture.
    assert once_s3 <= server_auto < unique + WORLD * (1 << 20), (server_auto, once_s3, unique)
    assert server_direct >= direct_s3 >= WORLD * tensors, (server_direct, direct_s3)
    assert server_auto < server_direct / (WORLD - 0.5), (server_auto, server_direct)


def _load_without_an_object(
    rank: int, world: int, url: str, options: dict[str, Any], out: str
) -> None:
    """A read-once load of a checkpoint one of whose data objects is gone: every rank raises."""
    _watchdog()
    sd = {k: torch.full_like(v, 13) for k, v in full_tensors_s3(7).items()}
    reader = UCPStorageReader(url, storage_options=options, options=ReadOptions(read_once=True))
    with pytest.raises(CheckpointException) as ei:
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    err = unwrap(ei.value)
    _gather(rank, world, {"type": type(err).__name__, "message": str(err)}, out)


def test_a_header_one_rank_cannot_fetch_for_the_others_fails_every_rank(
    saved_s3: str, s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Each data file's first request is made by one rank for all: where that rank's request
    fails, every rank raises its storage error, naming the object; none waits."""
    _, options = s3_bucket
    url = f"{saved_s3}-gone"
    store = ObjectStore(url, options)
    for name in ObjectStore(saved_s3, options).list_sizes():
        store.fs.copy(f"{saved_s3}/{name}", store.path(name))
    gone = sorted(n for n in store.list_sizes() if n.startswith("rank"))[1]
    store.remove([gone])
    out = str(tmp_path / "errors.pt")
    run_ranks(WORLD, _load_without_an_object, url, options, out)
    errors = torch.load(out)
    assert len({e["message"] for e in errors}) == 1, errors
    assert all(e["type"] == "StorageError" for e in errors), errors
    assert errors[0]["message"].startswith(f"{url}/{gone}: "), errors


# ---------------------------------------------------------------- CheckpointManager restore


def _manager_save(rank: int, world: int, root: str, options: dict[str, Any]) -> None:
    with CheckpointManager(root, storage_options=options) as mgr:
        mgr.save(7, sharded_state(7, world))
        mgr.wait()


def _manager_restore(rank: int, world: int, root: str, options: dict[str, Any], out: str) -> None:
    """A restore from the object-store tier into replicated targets: the manager's group
    exchanges."""
    _watchdog()
    want = full_tensors_s3(7)
    state = {"model": {k: torch.full_like(v, 13) for k, v in want.items()}, "step": -1}
    groups: list[Any] = []

    class Reader(UCPStorageReader):
        def __init__(self, *a: Any, **kw: Any) -> None:
            groups.append(kw.get("process_group"))
            super().__init__(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        counted = count_s3_bytes(mp)
        mp.setattr(_restore, "UCPStorageReader", Reader)
        with CheckpointManager(root, storage_options=options) as mgr:
            assert mgr.load(state) == 7
            rec = mgr.last_restore
            # The exchange runs on the group dcp.load runs on: the manager's own (gloo), not the
            # default group (NCCL in a GPU job, where CPU tensors cannot travel).
            pg = mgr._restorer.group.pg
            assert pg is not None and groups == [pg], (groups, pg)
    assert rec is not None and rec.tier == "persistent", rec
    assert state["step"] == 7
    for k, v in want.items():
        assert bit_equal(state["model"][k], v), f"rank {rank}: {k} differs"
    d = rec.read_once
    assert d is not None
    record = {"decision": dataclasses.asdict(d), "read": rec.read_bytes, "s3": counted["bytes"]}
    _gather(rank, world, record, out)


def test_manager_restore_from_object_store_exchanges(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    base, options = s3_bucket
    root = f"{base}/mgr-read-once-{uuid.uuid4().hex[:8]}"
    run_ranks(WORLD, _manager_save, root, options)
    out = str(tmp_path / "restore.pt")
    run_ranks(WORLD, _manager_restore, root, options, out)
    ranks = torch.load(out)
    decisions = [r["decision"] for r in ranks]
    assert all(d["exchange"] and d["storage"] == "object store" for d in decisions), decisions
    unique = decisions[0]["unique_bytes"]
    assert all(d["unique_bytes"] == unique for d in decisions), decisions
    assert all(d["needed_bytes"] == WORLD * unique for d in decisions), decisions
    tensors = _tensor_bytes(full_tensors_s3(7))
    assert tensors <= unique
    # RestoreRecord.read_bytes: the data this rank fetched, now its share of the job's, and the
    # values every rank reads itself (the step: a few bytes).
    read = sum(r["read"] for r in ranks)
    assert unique <= read <= unique + WORLD * 64, (read, unique)
    # Counted at s3fs: besides the data, each rank reads the index, marker, headers and block
    # checksums (about 0.2 MiB here); a restore without read-once fetches every byte WORLD times.
    fetched = sum(r["s3"] for r in ranks)
    assert fetched < unique + WORLD * (1 << 20), (fetched, unique)


def _load_two_checkpoints(rank: int, world: int, a: str, b: str, options: dict[str, Any]) -> None:
    """Rank 0 loads checkpoint ``a``, rank 1 ``b``, from the object store, read-once: every rank
    raises the ReadOnceError naming both."""
    _watchdog()
    reader = UCPStorageReader(a if rank == 0 else b, storage_options=options,
                              options=ReadOptions(read_once=True, verify=False))
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"w": torch.zeros(16, 8)}, storage_reader=reader, planner=UCPLoadPlanner())
    assert sorted(ei.value.failures) == [0, 1]
    err = ei.value.failures[rank][0]
    assert type(err) is ReadOnceError and str(err).startswith(
        f"rank 1 loads another checkpoint than rank 0: {b} holds other files than {a}; "
    ), repr(err)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ranks_loading_two_checkpoints_from_an_object_store_are_refused(
    s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """The object-store path of a read-once load (first requests shared, then the plan): ranks
    that load different checkpoints are refused, not handed each other's bytes."""
    base, options = s3_bucket
    a, b = (f"{base}/two-{uuid.uuid4().hex[:8]}" for _ in range(2))
    for i, url in enumerate((a, b)):
        full = torch.arange(128, dtype=torch.float32).reshape(16, 8) + i
        dcp.save({"w": full}, storage_writer=UCPStorageWriter(url, storage_options=options),
                 planner=UCPSavePlanner())
    run_ranks(2, _load_two_checkpoints, a, b, options)
