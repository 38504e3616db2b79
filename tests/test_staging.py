"""The staging path (ucp_dcp.byteio.transfer): dtype casts and device destinations, bit for bit.

CPU tests run everywhere: casts through a tiny staging buffer (many slabs,
one allocation per ``read_data``), and the double-buffered device code
forced onto CPU destinations (``StagingBuffers(overlap=True)``), also with
a fake stream whose copies only run when waited for, which checks the
event protocol. The CUDA tests (pinned buffers, non-blocking copies,
events) run only with a GPU.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ucp_dcp.byteio.engine as ucp_engine
from dist_utils import bit_equal
from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.tools.checkpoint import Checkpoint
from ucp_dcp.core.sharding import Box
from ucp_dcp.byteio.transfer import ChunkRegion, StagingBuffers

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.cuda  # skipped without CUDA (tests/conftest.py)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)  # every bit pattern, NaNs included


def _state() -> dict[str, torch.Tensor]:
    return {
        "w": _rand((97, 131), torch.float32, 1),  # 50 KB: dozens of slabs in a 1 KiB buffer
        "cube": _rand((5, 7, 33), torch.float32, 2),
        "h": _rand((300,), torch.bfloat16, 3),
        "scalar": _rand((), torch.float32, 4),
        "empty": _rand((0, 9), torch.float32, 5),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("staging") / "ckpt"
    sd = _state()
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    return path, sd


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, **kw: Any) -> list[StagingBuffers]:
    """Every StagingBuffers ``module`` makes from now on (made with ``kw`` added)."""
    made: list[StagingBuffers] = []

    def factory(*args: Any, **kwargs: Any) -> StagingBuffers:
        b = StagingBuffers(*args, **{**kwargs, **kw})
        made.append(b)
        return b

    monkeypatch.setattr(module, "StagingBuffers", factory)
    return made


def cast_equal(got: torch.Tensor, src: torch.Tensor, dtype: torch.dtype, ref: torch.Tensor | None = None) -> bool:
    """``got`` is ``ref`` (default ``src.to(dtype)``) bit for bit, except that a NaN of ``src`` may come out as any NaN.

    torch itself is not consistent there: a contiguous float32 -> bfloat16
    cast keeps a NaN's sign and payload bits, a copy into a strided target
    gives the canonical NaN.
    """
    if got.dtype != dtype or got.shape != src.shape:
        return False
    ref = src.to(dtype) if ref is None else ref
    got, src, ref = got.cpu(), src.cpu(), ref.cpu()
    nan = src.isnan() if src.is_floating_point() else torch.zeros(src.shape, dtype=torch.bool)
    if not bool(got[nan].isnan().all()):
        return False
    return bit_equal(got[~nan], ref[~nan])


def _load(path: Path, out: dict[str, torch.Tensor], max_buffer_bytes: int) -> UCPStorageReader:
    reader = UCPStorageReader(path)
    reader._buffer_bytes = max_buffer_bytes  # below ReadOptions.buffer_bytes's 1 MiB floor: many slabs
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner(allow_dtype_cast=True))
    return reader


def _targets(sd: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    out = {k: torch.full_like(v, 7, dtype=dtype, device=device) for k, v in sd.items()}
    # One non-contiguous target: a transposed view of a scratch matrix.
    out["w"] = torch.full((131, 97), 7, dtype=dtype, device=device).t()
    return out


# ---------------------------------------------------------------- CPU: casts


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("overlap", [None, True], ids=["blocking", "double-buffered"])
def test_cast_load_bit_exact_one_buffer(
    saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, overlap: bool | None
) -> None:
    """A cast load through a 1 KiB buffer equals ``.to(dtype)`` bit for bit; one buffer, allocated once, serves every item."""
    path, sd = saved
    made = _spy(monkeypatch, ucp_engine, overlap=overlap)
    out = _targets(sd, dtype)
    _load(path, out, 1024)
    for k in sd:
        assert cast_equal(out[k], sd[k], dtype), k
    assert len(made) == 1, "one StagingBuffers per read_data"
    (b,) = made
    assert b.allocations == 1
    n_bytes = sum(t.numel() * t.element_size() for t in sd.values() if t.dtype != dtype)  # the rest: in place
    assert b.bytes_staged == n_bytes
    # 1 KiB per slab (512 B per half when double-buffered): many slabs, one buffer.
    assert b.slabs >= n_bytes // (512 if overlap else 1024) > 50
    assert b.capacity == 0, "closed at the end of read_data"


def test_default_floor_still_bounds_memory(saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the reader's own settings the buffer is no larger than the largest staged item."""
    path, sd = saved
    made = _spy(monkeypatch, ucp_engine)
    caps: list[int] = []
    real_read = StagingBuffers.read

    def read(self: StagingBuffers, *args: Any) -> None:
        real_read(self, *args)
        if self.capacity:  # an empty item allocates nothing
            caps.append(self.capacity)

    monkeypatch.setattr(StagingBuffers, "read", read)
    out = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in sd.items()}
    dcp.load(out, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(allow_dtype_cast=True))
    for k in sd:
        assert cast_equal(out[k], sd[k], torch.float64), k
    largest = max(t.numel() * t.element_size() for t in sd.values())
    assert made[0].allocations == 1
    assert set(caps) == {-(-largest // 16) * 16}  # sized from the hint (rounded up to 16 bytes), not 64 MiB


def test_checkpoint_read_tensor_one_buffer_per_read(saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoint.read_tensor with a cast: one staging buffer per read, exact; none when no staging is needed."""
    path, sd = saved
    made = _spy(monkeypatch, ucp_engine, overlap=True)
    with Checkpoint(path, options=ReadOptions(max_buffer_bytes=1)) as ck:
        for k in sd:
            got = ck.read_tensor(k, dtype=torch.float64)
            assert cast_equal(got, sd[k], torch.float64), k
        same = ck.read_tensor("w")
    assert bit_equal(same, sd["w"])
    assert len(made) == len(sd) + 1
    assert [b.allocations for b in made] == [0 if sd[k].numel() == 0 else 1 for k in sd] + [0]


# ---------------------------------------------------------------- CPU: the device code path


@pytest.mark.parametrize("max_bytes", [32, 100, 4096, 1 << 20])
def test_double_buffered_path_on_cpu_same_dtype(saved: tuple[Path, dict[str, torch.Tensor]], max_bytes: int) -> None:
    """The double-buffered (device) code, forced onto same-dtype CPU views, is exact for any buffer size."""
    path, sd = saved
    with Checkpoint(path) as ck, StagingBuffers(max_bytes, overlap=True) as buffers:
        outs = {}
        for k, v in sd.items():
            out = torch.full(v.shape[::-1], 3, dtype=v.dtype).permute(tuple(reversed(range(v.dim()))))
            for box, loc in ck.chunks(k):
                whole = Box((0,) * len(box.sizes), box.sizes)
                buffers.read(ck._reader, ChunkRegion(loc, box.sizes, whole, v.dtype), out)
            outs[k] = out
        assert buffers.allocations == 1 and buffers.capacity <= max(max_bytes, 32)
        assert buffers.double_buffered(torch.empty(0))
        assert not buffers.pinned  # CPU destinations never ask for page-locked memory
    for k in sd:
        assert bit_equal(outs[k], sd[k]), k


class FakeStream:
    """Copies that run only when waited for, in order, like a device stream.

    ``copy`` is a ``StagingBuffers(device_copy=...)``: it queues ``target <-
    buf`` and returns an event; a copy runs (reading ``buf`` as it is *then*)
    when its event, or a later one, is waited for. A half refilled before
    its copy was waited for would be caught as wrong data.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor, FakeEvent]] = []
        self.max_in_flight = 0
        self.copies = 0

    def copy(self, target: torch.Tensor, buf: torch.Tensor) -> "FakeEvent":
        ev = FakeEvent(self)
        self.pending.append((target, buf, ev))
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return ev

    def run_until(self, ev: "FakeEvent | None") -> None:
        while self.pending:
            target, buf, e = self.pending.pop(0)
            target.copy_(buf)
            e.done = True
            self.copies += 1
            if e is ev:
                return


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.done = stream, False

    def synchronize(self) -> None:
        if not self.done:
            self.stream.run_until(self)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_double_buffered_waits_before_refilling(
    saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """With copies that complete only when waited for, a load is still exact: no half is
    refilled before its copy ran, at most two copies are ever in flight (and two are:
    reads overlap copies, across items too), and everything has landed when read_data returns."""
    path, sd = saved
    stream = FakeStream()
    made = _spy(monkeypatch, ucp_engine, overlap=True, device_copy=stream.copy)
    out = _targets(sd, dtype)
    _load(path, out, 256)
    assert stream.pending == []
    for k in sd:
        assert cast_equal(out[k], sd[k], dtype), k
    assert stream.max_in_flight == 2 and stream.copies == made[0].slabs > 100
    assert made[0].allocations == 1


def test_fake_stream_catches_a_missing_wait(saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Control for the test above: without the wait before a refill, the data comes out wrong."""
    path, sd = saved
    stream = FakeStream()
    monkeypatch.setattr(StagingBuffers, "_wait", lambda self, half: None)
    with Checkpoint(path) as ck:
        ((box, loc),) = ck.chunks("w")
        out = torch.zeros(sd["w"].shape)
        with StagingBuffers(1024, overlap=True, device_copy=stream.copy) as buffers:
            buffers.read(ck._reader, ChunkRegion(loc, box.sizes, Box((0, 0), box.sizes), torch.float32), out)
        stream.run_until(None)
    assert stream.max_in_flight > 2
    assert not bit_equal(out, sd["w"])


def test_partial_regions_through_shared_and_own_buffers(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Sub-boxes of a chunk, through shared buffers and through a buffer of their own, match slicing."""
    path, sd = saved
    w = sd["cube"]
    regions = [Box((0, 0, 0), (5, 7, 33)), Box((1, 2, 3), (3, 4, 29)), Box((4, 6, 32), (1, 1, 1)), Box((2, 0, 5), (2, 7, 0))]
    with Checkpoint(path) as ck:
        ((box, loc),) = ck.chunks("cube")
        for overlap in (False, True):
            with StagingBuffers(200, overlap=overlap) as buffers:
                for r in regions:
                    want = w[tuple(slice(o, o + s) for o, s in zip(r.offsets, r.sizes))]
                    got = torch.empty(r.sizes, dtype=torch.float64)
                    part = ChunkRegion(loc, box.sizes, r, torch.float32)
                    buffers.read(ck._reader, part, got)
                    assert cast_equal(got, want, torch.float64), (overlap, r)
                    got2 = torch.empty(r.sizes, dtype=torch.float64)
                    with StagingBuffers(64, largest_bytes=part.nbytes) as own:  # 64 bytes: many slabs
                        own.read(ck._reader, part, got2)
                    assert bit_equal(got2, got)
            assert buffers.allocations == 1


def test_buffer_grows_within_bound_without_hint() -> None:
    """Without a size hint the buffer starts small and doubles, never past the bound; close() drops it."""
    b = StagingBuffers(10_000)
    b._ensure(100, False, False)
    assert (b.capacity, b.allocations) == (112, 1)  # rounded up to 16 bytes
    b._ensure(50, False, False)
    assert b.allocations == 1
    b._ensure(150, False, False)
    assert (b.capacity, b.allocations) == (224, 2)
    b._ensure(1_000_000, True, False)
    assert (b.capacity, b.allocations) == (10_000, 3)
    b._ensure(1_000_000, True, False)
    assert b.allocations == 3
    b.close()
    assert b.capacity == 0
    hinted = StagingBuffers(10_000, largest_bytes=3200)
    hinted._ensure(10, True, False)
    assert hinted.capacity == 6400  # two halves of the largest item at once
    assert StagingBuffers(1).max_buffer_bytes == 32


# ---------------------------------------------------------------- CUDA


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_cuda_load_pinned_double_buffered(saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """A load into CUDA tensors goes through one pinned, double-buffered buffer and is exact.

    Casts run on the device, so the reference is the device cast."""
    path, sd = saved
    made = _spy(monkeypatch, ucp_engine)
    out = _targets(sd, dtype, "cuda")
    _load(path, out, 1024)
    for k in sd:
        assert out[k].is_cuda and cast_equal(out[k], sd[k], dtype, sd[k].cuda().to(dtype)), k
    (b,) = made
    assert b.allocations == 1 and b.slabs > 50
    assert b.double_buffered(out["w"])
    assert b._events == [None, None], "close() waited for every copy"


@cuda
def test_cuda_buffer_is_pinned_and_copies_on_current_stream(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """The buffer is pinned; copies run on the destination's current stream (a side stream here)."""
    path, sd = saved
    side = torch.cuda.Stream()
    with Checkpoint(path) as ck, torch.cuda.stream(side):
        buffers = StagingBuffers(4096)
        out = torch.zeros(sd["w"].shape, device="cuda")
        ((box, loc),) = ck.chunks("w")
        buffers.read(ck._reader, ChunkRegion(loc, box.sizes, Box((0, 0), box.sizes), torch.float32), out)
        assert buffers.pinned and buffers.allocations == 1
        got = out.clone()  # ordered after the copies on the same stream, before close()
        buffers.close()
    side.synchronize()
    assert bit_equal(got, sd["w"]) and bit_equal(out, sd["w"])


@cuda
def test_cuda_read_tensor_and_upgrade_to_pinned(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Checkpoint.read_tensor to CUDA is exact; a buffer first used for a CPU cast is replaced by a pinned one."""
    path, sd = saved
    with Checkpoint(path) as ck:
        for k, v in sd.items():
            assert bit_equal(ck.read_tensor(k, device="cuda"), v), k
        ((box, loc),) = ck.chunks("cube")
        whole = Box((0, 0, 0), box.sizes)
        with StagingBuffers(1 << 20) as b:
            cpu = torch.empty(box.sizes, dtype=torch.float64)
            b.read(ck._reader, ChunkRegion(loc, box.sizes, whole, torch.float32), cpu)
            assert not b.pinned
            dev = torch.empty(box.sizes, dtype=torch.float32, device="cuda")
            b.read(ck._reader, ChunkRegion(loc, box.sizes, whole, torch.float32), dev)
            assert b.pinned and b.allocations == 2
        assert bit_equal(cpu, sd["cube"].double()) and bit_equal(dev, sd["cube"])


# ---------------------------------------------------------------- the benchmark


def test_bench_gpu_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench_gpu.main(--device cpu --quick) runs in this process, prints its table and writes its JSON."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        bench_gpu = importlib.import_module("bench_gpu")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "gpu.json"
    rc = bench_gpu.main(["--device", "cpu", "--quick", "--gb", "0.02", "--dir", str(tmp_path), "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    assert "measurement" in printed.out and "GB/s" in printed.out
    for what in ("device->host", "DefaultStager.stage", "UCPStorageWriter", "FileSystemWriter",
                 "sequential read", "UCPStorageReader, cold", "FileSystemReader, cold"):
        assert what in printed.out, what
    result = json.loads(out.read_text())
    assert result["failures"] == [] and len(result["rows"]) >= 15
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"], "checkpoints removed"
