"""How read-once's messages travel (issue 35): never through device memory by default.

The choice is a pure function of the group's backend string
(:func:`~ucp_dcp.dcp.read_once.transport.choose_transport`), asserted here for ``"nccl"``,
``"gloo"``, ``"cpu:gloo,cuda:nccl"`` and others without a GPU. The group a collective then
runs on (:func:`~ucp_dcp.dcp.read_once.transport.wire_for`) is checked with fake groups (a
gloo group made once per process group from its ranks, reused), and with real ranks: a gloo
default group stands in for one that is NCCL alone through the same seam
(:func:`~ucp_dcp.dcp.read_once.transport.group_backend`), so a load, its placement check and the
manager's peer copies run over the gloo group made from its ranks, and the load's report names
the transport.
"""

from __future__ import annotations

import faulthandler
import os
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks

from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.dcp import reader as reader_module
from ucp_dcp.dcp.read_once import ReadOnceCosts, transport
from ucp_dcp.dcp.read_once.transport import (
    Transport,
    Wire,
    choose_transport,
    wire_device,
    wire_for,
)
from ucp_dcp.manager._collective import Group, NodeLayout
from ucp_dcp.manager.peer import exchange_files

BACKENDS = ["gloo", "nccl", "cpu:gloo,cuda:nccl", "cuda:nccl", "mpi", "ucc", "xccl", "custom"]

# ---------------------------------------------------------------- the pure choice


@pytest.mark.parametrize(
    "backend,allow_device,gloo,want",
    [
        ("gloo", False, True, Transport.GROUP),
        ("gloo", True, True, Transport.GROUP),
        ("nccl", False, True, Transport.GLOO),
        ("nccl", True, True, Transport.DEVICE),
        ("cpu:gloo,cuda:nccl", False, True, Transport.GROUP),
        ("cpu:gloo,cuda:nccl", True, True, Transport.GROUP),
        ("cuda:nccl", False, True, Transport.GLOO),
        ("cuda:nccl", True, True, Transport.DEVICE),
        ("mpi", False, True, Transport.GROUP),
        ("ucc", False, True, Transport.GLOO),
        ("xccl", True, True, Transport.GLOO),  # device memory is NCCL's only
        ("NCCL", False, True, Transport.GLOO),
        ("nccl", False, False, Transport.NONE),
        ("nccl", True, False, Transport.DEVICE),
        ("gloo", False, False, Transport.GROUP),
    ],
)
def test_choose_transport(backend: str, allow_device: bool, gloo: bool, want: Transport) -> None:
    assert choose_transport(backend, allow_device, gloo) is want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gloo", [True, False])
def test_no_backend_gets_device_memory_without_the_opt_in(backend: str, gloo: bool) -> None:
    assert choose_transport(backend, False, gloo) is not Transport.DEVICE
    assert choose_transport(backend) is not Transport.DEVICE
    assert ReadOptions().device_transport is False  # the default does not opt in


def test_the_report_names_a_transport_as_a_word() -> None:
    assert [str(t) for t in Transport] == ["group", "gloo", "device", "none"]
    assert Transport.GLOO == "gloo"


def test_wire_device_is_host_memory_unless_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    for t in (Transport.GROUP, Transport.GLOO, Transport.NONE):
        assert wire_device(t) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert wire_device(Transport.DEVICE) == torch.device("cuda", 3)


# ---------------------------------------------------------------- the group, with fakes


class _FakeGroup:
    """A process group as the seam sees it: its global ranks, in group-rank order."""

    def __init__(self, ranks: list[int], backend: str) -> None:
        self.ranks, self.backend = ranks, backend


@pytest.fixture
def fake_dist(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``transport``'s view of torch.distributed, faked: a world of 4 ranks whose default group has
    the backend ``state["world"].backend``; every ``new_group`` call is recorded."""
    world = _FakeGroup([0, 1, 2, 3], "nccl")
    state: dict[str, Any] = {"world": world, "made": []}

    def new_group(**kw: Any) -> _FakeGroup:
        state["made"].append(kw)
        return _FakeGroup(list(kw["ranks"]), kw["backend"])

    def size(g: Any = None) -> int:
        return len((g or world).ranks)

    fake = types.SimpleNamespace(
        group=types.SimpleNamespace(WORLD=world),
        is_gloo_available=lambda: state.get("gloo", True),
        get_world_size=size,
        get_global_rank=lambda g, r: g.ranks[r],
        get_rank=lambda g=None: 0,
        new_group=new_group,
    )
    monkeypatch.setattr(transport, "dist", fake)
    monkeypatch.setattr(transport, "group_backend", lambda g: (g or world).backend)
    return state


def test_an_nccl_group_gets_a_gloo_group_of_its_ranks_made_once(fake_dist: dict[str, Any]) -> None:
    sub = _FakeGroup([3, 1], "nccl")  # group rank 0 is global rank 3: the order is kept
    first = wire_for(sub)
    assert first.transport is Transport.GLOO and first.group is not sub
    assert first.device == torch.device("cpu")
    assert fake_dist["made"] == [
        {"ranks": [3, 1], "backend": "gloo", "sort_ranks": False, "use_local_synchronization": True}
    ]
    # Reused by every later load (and peer copy) on the same group: no second new_group.
    assert wire_for(sub) == first and wire_for(sub, False) == first
    assert len(fake_dist["made"]) == 1
    # The default group (the whole world): every rank of the job makes it, no local barrier.
    whole = wire_for(None)
    assert whole.transport is Transport.GLOO and whole.group.ranks == [0, 1, 2, 3]
    assert fake_dist["made"][1]["use_local_synchronization"] is False
    assert wire_for(fake_dist["world"]) == whole  # None and WORLD are one group
    assert len(fake_dist["made"]) == 2


def test_auto_never_selects_device_memory_on_an_nccl_group(fake_dist: dict[str, Any]) -> None:
    sub = _FakeGroup([0, 1], "nccl")
    opts = ReadOptions()
    assert opts.read_once == "auto"
    wire = wire_for(sub, opts.device_transport)
    assert wire.transport is not Transport.DEVICE and wire.device.type == "cpu"


def test_the_opt_in_uses_the_nccl_group_itself(fake_dist: dict[str, Any]) -> None:
    sub = _FakeGroup([0, 1], "nccl")
    assert wire_for(sub, ReadOptions(device_transport=True).device_transport) == Wire(
        Transport.DEVICE, sub
    )
    assert fake_dist["made"] == []


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl"])
def test_a_group_that_moves_host_memory_is_used_as_it_is(
    fake_dist: dict[str, Any], backend: str
) -> None:
    sub = _FakeGroup([0, 1], backend)
    for allow in (False, True):
        assert wire_for(sub, allow) == Wire(Transport.GROUP, sub)
    assert fake_dist["made"] == []


def test_without_gloo_an_nccl_group_does_not_exchange(fake_dist: dict[str, Any]) -> None:
    fake_dist["gloo"] = False
    sub = _FakeGroup([0, 1], "nccl")
    assert wire_for(sub) == Wire(Transport.NONE, sub)
    assert fake_dist["made"] == []


# ---------------------------------------------------------------- real ranks, "nccl" by the seam

N = 3000


def _state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(N, 5, generator=g), "b": torch.arange(N, dtype=torch.int64)}


def _load(root: str, opts: ReadOptions) -> tuple[dict[str, torch.Tensor], Any]:
    sd = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    reader = UCPStorageReader(root, options=opts)
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    want = _state(0)
    assert all(bit_equal(sd[k], want[k]) for k in want)
    return sd, reader.last_load


def _ranks(rank: int, world: int, root: str, files: str) -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    writer = UCPStorageWriter(root, placement_digests=True)
    dcp.save(_state(rank), storage_writer=writer, planner=UCPSavePlanner())

    # The default group as it is (gloo): used itself, nothing made.
    _, report = _load(root, ReadOptions(read_once=True))
    assert report.transport is Transport.GROUP and report.read_once.exchange

    # From here on the default group reads "nccl" through the seam; groups made from it are gloo.
    default = dist.group.WORLD
    real_backend = transport.group_backend
    transport.group_backend = lambda g: "nccl" if g is None or g is default else real_backend(g)
    made: list[Any] = []
    new_group = dist.new_group

    def counting(*a: Any, **kw: Any) -> Any:
        g = new_group(*a, **kw)
        made.append((kw.get("backend"), g))
        return g

    dist.new_group = counting
    try:
        _, report = _load(root, ReadOptions(read_once=True, verify_placement=True))
        assert report.transport is Transport.GLOO, report.transport
        assert report.read_once.exchange and report.exchange is not None
        assert report.exchange.rounds >= 1
        assert report.placement is not None and set(report.placement.checked) == {"w", "b"}
        assert [b for b, _ in made] == ["gloo"]
        gloo = made[0][1]
        assert dist.get_backend(gloo) == "gloo" and dist.get_rank(gloo) == rank
        assert dist.get_world_size(gloo) == world

        # "auto" on shared storage, where exchanging pays: the same gloo group, reused.
        reader_module.shared_storage = lambda path: (True, "nfs")
        costs = ReadOnceCosts(storage_bytes_per_s=1e3)
        _, report = _load(root, ReadOptions(read_once_costs=costs))
        assert report.read_once.mode == "auto" and report.read_once.exchange
        assert report.transport is Transport.GLOO
        assert len(made) == 1

        # No group that moves host memory (no gloo): no exchange, each rank reads its own bytes.
        real_wire_for = reader_module.wire_for
        reader_module.wire_for = lambda g, allow=False: Wire(Transport.NONE, g)
        _, report = _load(root, ReadOptions(read_once=True))
        assert report.transport is Transport.NONE
        assert not report.read_once.exchange and report.exchange is None
        assert "no gloo" in report.read_once.reason
        reader_module.wire_for = real_wire_for

        # The manager's peer copies: its own groups are gloo, used as they are; a group that is
        # NCCL alone moves the files over the gloo group made from its ranks (the same one).
        own = Group(NodeLayout(rank, world, 1), True)
        assert made[-1][0] == "gloo"  # the manager makes its group gloo, whatever the default
        assert wire_for(own.pg) == Wire(Transport.GROUP, own.pg)
        src, dest = os.path.join(files, f"src{rank}"), os.path.join(files, f"dest{rank}")
        os.makedirs(src)
        with open(os.path.join(src, f"r{rank}.bin"), "wb") as f:
            f.write(bytes([rank]) * 100_000)
        other = f"r{1 - rank}.bin"
        count = len(made)
        got = exchange_files(None, src, [f"r{rank}.bin"], dest, [other])
        assert got.received == [other] and got.bytes_received == 100_000
        with open(os.path.join(dest, other), "rb") as f:
            assert f.read() == bytes([1 - rank]) * 100_000
        assert len(made) == count  # the gloo group made for the loads, reused
        got = exchange_files(own.pg, src, [f"r{rank}.bin"], dest, [])
        assert got.received == []
    finally:
        dist.new_group = new_group
        transport.group_backend = real_backend


@pytest.mark.multiproc
def test_an_nccl_group_exchanges_over_a_gloo_group_made_once(tmp_path: Any) -> None:
    root, files = str(tmp_path / "ckpt"), str(tmp_path / "files")
    os.makedirs(files)
    run_ranks(2, _ranks, root, files)
