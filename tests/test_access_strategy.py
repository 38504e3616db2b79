"""How each file is read (a stream with read-ahead, or exact announced reads), chosen from the plan."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dist_utils import bit_equal, run_ranks
from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.byteio.rangeio import RangeReader
from ucp_dcp.byteio.segments import Segment
from ucp_dcp.core.spans import EXACT, READ_AHEAD_BYTES, SEQUENTIAL, file_access
from ucp_dcp.errors import InvalidArgumentError

MiB = 1 << 20


# ------------------------------------------------------------ the pure choice
def test_whole_file_in_pieces_is_sequential() -> None:
    """A file read front to back, tensor after tensor (a same-layout restart), is streamed."""
    lengths = [4096, 1000, 3 * MiB, 17, 8 * MiB]
    starts = np.cumsum([0, *lengths[:-1]])
    assert file_access(starts, lengths, sum(lengths)) == SEQUENTIAL


def test_column_pieces_are_exact() -> None:
    """One rank reading every 4th 4000-byte piece of 16000-byte rows (a column shard) reads
    exactly: read-ahead would pull in the pages of the three other ranks' pieces of every row."""
    rows = 4096
    starts = [r * 16000 + 4000 for r in range(rows)]
    assert file_access(starts, [4000] * rows, rows * 16000) == EXACT


def test_column_pieces_narrower_than_a_page_stream() -> None:
    """Every 4th 1000-byte piece of 4000-byte rows: every page of the file holds a needed byte,
    so an exact read asks storage for the same pages a stream does, and the stream wins (the
    kernel's read-ahead, no announcement per read)."""
    rows = 4096
    starts = [r * 4000 + 1000 for r in range(rows)]
    assert file_access(starts, [1000] * rows, rows * 4000) == SEQUENTIAL
    # Waste is counted in whole pages: one page between 4 KiB pieces is too much.
    starts = [r * 8192 for r in range(rows)]
    assert file_access(starts, [4096] * rows, rows * 8192) == EXACT


def test_long_stretches_are_sequential_short_ones_exact() -> None:
    """A quarter of a large file in one stretch streams (the overshoot is a window at most); a
    quarter of a small file, the rest other ranks', stays exact."""
    big = 4 * 64 * MiB
    assert file_access([64 * MiB], [64 * MiB], big) == SEQUENTIAL
    small = 4 * MiB
    assert file_access([MiB], [MiB], small) == EXACT
    # The last stretch of a file: nothing past it to pull in.
    assert file_access([3 * MiB], [MiB], small) == SEQUENTIAL


def test_pages_other_ranks_here_read_are_no_waste() -> None:
    """Read-ahead into pages another rank on this machine reads (a column shard's other half,
    another rank's tensors) is no waste: the page cache they share reads each page once, so the
    file streams; pages no rank here reads still count."""
    rows = 4096
    starts = [r * 8192 for r in range(rows)]
    size = rows * 8192
    assert file_access(starts, [4096] * rows, size) == EXACT
    others = ([r * 8192 + 4096 for r in range(rows)], [4096] * rows)
    assert file_access(starts, [4096] * rows, size, shared=others) == SEQUENTIAL
    half = ([r * 8192 + 4096 for r in range(rows // 2)], [4096] * (rows // 2))
    assert file_access(starts, [4096] * rows, size, shared=half) == EXACT
    # A part of a large file whose rest other ranks here read: streamed where the part is at
    # least a read-ahead window, read exactly where it is less (a few small reads gain nothing
    # from a stream, and its read-ahead would pull the others' pages in early).
    part = READ_AHEAD_BYTES
    assert file_access([0], [part], 64 * part) == EXACT
    assert file_access([0], [part], 64 * part, shared=([0], [64 * part])) == SEQUENTIAL
    assert file_access([0], [part], 64 * part, shared=([], [])) == EXACT
    assert file_access([0], [4096], 64 * part, shared=([0], [64 * part])) == EXACT


def test_nothing_to_read_is_exact() -> None:
    assert file_access([], [], 1000) == EXACT
    assert file_access([10], [0], 1000) == EXACT


extents = st.lists(st.tuples(st.integers(0, 1 << 26), st.integers(0, 1 << 22)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(extents, st.integers(0, 1 << 27), st.randoms(use_true_random=False))
def test_order_and_splitting_do_not_matter(ranges: list[tuple[int, int]], size: int, rnd: random.Random) -> None:
    """The choice depends on the bytes read, not on how the plan lists or cuts them."""
    size = max(size, max((s + n for s, n in ranges), default=0))
    want = file_access([s for s, _ in ranges], [n for _, n in ranges], size)
    shuffled = ranges[:]
    rnd.shuffle(shuffled)
    cut = [p for s, n in shuffled for p in ([(s, n // 2), (s + n // 2, n - n // 2)] if n > 1 else [(s, n)])]
    assert file_access([s for s, _ in cut], [n for _, n in cut], size) == want


@settings(max_examples=200, deadline=None)
@given(extents, extents, st.integers(0, 1 << 27))
def test_shared_ranges_only_ever_make_a_file_stream(
    ranges: list[tuple[int, int]], shared: list[tuple[int, int]], size: int
) -> None:
    """Ranges others on the machine read can turn an exact file into a streamed one, never the
    reverse; the whole file shared streams any file this rank reads a read-ahead window of."""
    size = max(size, max((s + n for s, n in ranges), default=0))
    starts, lengths = [s for s, _ in ranges], [n for _, n in ranges]
    alone = file_access(starts, lengths, size)
    with_others = file_access(starts, lengths, size, shared=([s for s, _ in shared], [n for _, n in shared]))
    assert alone == EXACT or with_others == SEQUENTIAL
    everything = file_access(starts, lengths, size, shared=([0], [size]))
    needed, end = 0, 0  # the bytes the ranges cover, overlaps counted once
    for s, n in sorted(ranges):
        needed += max(0, s + n - max(s, end))
        end = max(end, s + n)
    if needed >= READ_AHEAD_BYTES:
        assert everything == SEQUENTIAL
    else:
        assert everything == alone


@settings(max_examples=200, deadline=None)
@given(extents, st.integers(1, 1 << 27))
def test_covering_the_file_is_sequential(ranges: list[tuple[int, int]], size: int) -> None:
    """Whatever else is read, a plan that reads every byte of the file streams it."""
    size = max(size, max((s + n for s, n in ranges), default=0))
    ranges = [*ranges, (0, size)]
    assert file_access([s for s, _ in ranges], [n for _, n in ranges], size) == SEQUENTIAL


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 1 << 16), st.integers(2, 64), st.integers(1, 4096))
def test_scattered_short_runs_are_exact(length: int, every: int, rows: int) -> None:
    """Runs of ``length`` bytes, one per row of ``every`` runs, with whole pages (a quarter of
    their length or a whole read-ahead window) between them, are read exactly."""
    row = length * every
    # The whole pages between two runs: their gap less at most a partial page at each end.
    assume(min(row - length - 2 * 4096, READ_AHEAD_BYTES) > 0.25 * length)
    starts = [r * row for r in range(rows)]
    assert file_access(starts, [length] * rows, rows * row) == EXACT


def test_extents_of_chunk_regions() -> None:
    """The ranges a plan needs come from its regions: a column shard of a chunk of 4000-byte rows
    is a 1000-byte run per row (every page holds one: sequential, as the whole chunk, one run),
    per file."""
    from ucp_dcp.byteio.transfer import ChunkRegion, extents
    from ucp_dcp.core.sharding import Box
    from ucp_dcp.format import Location

    rows = 256
    col = ChunkRegion(Location(0, 64, rows * 4000, ""), (rows, 1000), Box((0, 250), (rows, 250)), torch.float32)
    whole = ChunkRegion(Location(1, 0, rows * 4000, ""), (rows, 1000), Box((0, 0), (rows, 1000)), torch.float32)
    ext = extents([col, whole])
    assert ext[0][0].tolist() == [64 + r * 4000 + 1000 for r in range(rows)]
    assert set(ext[0][1].tolist()) == {1000}
    assert ext[1][0].tolist() == [0] and ext[1][1].tolist() == [rows * 4000]
    assert file_access(*ext[0], 64 + rows * 4000) == SEQUENTIAL
    assert file_access(*ext[1], rows * 4000) == SEQUENTIAL


# ------------------------------------------------------------ the range reader
def _files(tmp_path: Path, sizes: list[int]) -> tuple[list[str], list[bytes]]:
    paths, data = [], []
    rng = np.random.default_rng(0)
    for i, n in enumerate(sizes):
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(b)
        paths.append(str(p))
        data.append(b)
    return paths, data


def test_plan_access_per_file_and_override(tmp_path: Path) -> None:
    """One file read whole streams, one read in column pieces stays exact; a mode overrides both;
    an unknown mode is refused naming it and the accepted ones."""
    paths, _ = _files(tmp_path, [64 * 1024, 16000 * 64])
    whole = (np.array([0, 1000]), np.array([1000, 63 * 1024]))
    pieces = (np.arange(64) * 16000 + 4000, np.full(64, 4000))
    with RangeReader(paths) as r:
        assert r.plan_access({0: whole, 1: pieces}) == {0: SEQUENTIAL, 1: EXACT}
        assert r.plan_access({0: whole, 1: pieces}, "exact") == {0: EXACT, 1: EXACT}
        assert r.plan_access({0: whole, 1: pieces}, "sequential") == {0: SEQUENTIAL, 1: SEQUENTIAL}
        with pytest.raises(InvalidArgumentError) as e:
            r.plan_access({}, "streaming")
    assert str(e.value) == "access must be one of ('auto', 'sequential', 'exact'), got 'streaming'"


@pytest.mark.parametrize("mode", ["sequential", "exact", "auto"])
def test_reads_bit_exact_under_each_mode(tmp_path: Path, mode: str) -> None:
    """Random segments (split requests, merged neighbours, callbacks) read the same bytes whichever
    way each file is read, and every callback reports every segment once."""
    sizes = [3 * MiB + 5, 200_000, 4000 * 100]
    paths, data = _files(tmp_path, sizes)
    rng = random.Random(1)
    segs, want, seen = [], [], {"n": 0}

    def done(n: int) -> None:
        seen["n"] += n

    hooked = 0
    for f, n in enumerate(sizes):
        for _ in range(60):
            a = rng.randrange(n)
            b = min(n, a + rng.choice([1, 100, 5000, 300_000, 2 * MiB]))
            buf = memoryview(bytearray(b - a))
            cb = done if rng.random() < 0.5 else None
            hooked += cb is not None
            segs.append(Segment(f, a, buf, cb))
            want.append(data[f][a:b])
    with RangeReader(paths, threads=3, gap_bytes=4095, max_request_bytes=MiB) as r:
        extents = {f: (np.array([s.offset for s in segs if s.file == f]),
                       np.array([len(s.dest) for s in segs if s.file == f])) for f in range(len(sizes))}
        r.plan_access(extents, mode)
        r.read(segs)
    assert all(bytes(s.dest) == w for s, w in zip(segs, want))
    assert seen["n"] == hooked


def test_sequential_read_of_a_truncated_file_names_it(tmp_path: Path) -> None:
    from ucp_dcp.errors import TruncatedFileError

    paths, _ = _files(tmp_path, [1000])
    with RangeReader(paths) as r:
        r.plan_access({0: (np.array([0]), np.array([1000]))}, "sequential")
        with pytest.raises(TruncatedFileError, match="f0.bin: needed bytes \\[1000, 2000\\)"):
            r.read([Segment(0, 0, memoryview(bytearray(2000)))])


# ------------------------------------------------------------ the storage reader
def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(512, 1024, generator=g),
        "b": torch.randn(1024, generator=g, dtype=torch.float64),
        "m": {"exp_avg": torch.randn(300, 700, generator=g).to(torch.bfloat16), "step": torch.tensor(3.0)},
        "epoch": 7,
    }


def _zeros(sd: dict[str, Any], cast: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _zeros(v, cast)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v, dtype=torch.float64 if cast and v.dtype == torch.float32 else v.dtype)
        else:
            out[k] = 0
    return out


def test_access_is_validated() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        UCPStorageReader("/nonexistent", options=ReadOptions(access="random"))
    assert str(e.value) == "access must be one of ('auto', 'sequential', 'exact'), got 'random'"


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("cast", [False, True], ids=["in_place", "cast"])
@pytest.mark.parametrize("access", ["auto", "sequential", "exact"])
def test_load_bit_exact_and_reported(tmp_path: Path, access: str, cast: bool, verify: bool) -> None:
    """A whole-state load is bit-exact under every mode (in place and through staging), and the
    reader reports the way each file was read: a whole-file load streams under ``auto``."""
    sd = _state()
    dcp.save(sd, storage_writer=UCPStorageWriter(tmp_path), planner=UCPSavePlanner())
    out = _zeros(sd, cast)
    reader = UCPStorageReader(tmp_path, options=ReadOptions(access=access, verify=verify))
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner())
    for k in ("w", "b"):
        assert bit_equal(out[k], sd[k].to(out[k].dtype)), k
    assert bit_equal(out["m"]["exp_avg"], sd["m"]["exp_avg"]) and out["m"]["step"].item() == 3.0
    assert out["epoch"] == 7
    data = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    assert [os.path.basename(p) for p in reader.last_load.file_access] == data
    assert set(reader.last_load.file_access.values()) == {SEQUENTIAL if access == "auto" else access}


def test_a_small_part_of_a_large_file_is_read_exactly(tmp_path: Path) -> None:
    """Loading one small tensor out of a large file reads it exactly under ``auto``."""
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(4 * MiB, generator=g), "small": torch.randn(64, generator=g),
          "z": torch.randn(4 * MiB, generator=g)}
    dcp.save(sd, storage_writer=UCPStorageWriter(tmp_path), planner=UCPSavePlanner())
    out = {"small": torch.zeros(64)}
    reader = UCPStorageReader(tmp_path)
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner())
    assert bit_equal(out["small"], sd["small"])
    assert set(reader.last_load.file_access.values()) == {EXACT}


@pytest.mark.parametrize("mode", ["sequential", "exact"])
def test_hints_follow_the_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A streamed file gets no hints (the kernel's read-ahead does the work); an exact one has
    read-ahead off and every request announced."""
    paths, data = _files(tmp_path, [12 * MiB])
    calls: list[int] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append(advice)
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    buf = memoryview(bytearray(12 * MiB))
    with RangeReader(paths, max_request_bytes=MiB) as r:
        r.plan_access({0: (np.array([0]), np.array([12 * MiB]))}, mode)
        calls.clear()  # plan_access opens the file for its size
        r.read([Segment(0, 0, buf)])
    assert bytes(buf) == data[0]
    if mode == "sequential":
        assert calls == []
    else:
        assert calls.count(os.POSIX_FADV_WILLNEED) == 12


# ------------------------------------------------------------ ranks sharing a machine
def _column_reshard(rank: int, world: int, root: str, separate: bool) -> None:
    """A (dp2,tp2) weight, ``Shard(0), Shard(1)``, loaded as ``Shard(1)`` over 4 ranks: each rank
    needs every other 4 KiB page of two files, 8 MiB of each (a read-ahead window), the pages
    between them its partner's."""
    import socket

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if separate:  # every rank on a machine of its own, as far as the load can tell
        socket.gethostname = lambda: f"machine-{rank}"  # type: ignore[assignment]
    full = torch.arange(4096 * 4096, dtype=torch.float32).view(4096, 4096)
    saved = distribute_tensor(full, init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)])
    path = os.path.join(root, "saved")
    if not separate:
        dcp.save({"w": saved}, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    dist.barrier()
    out = {"w": distribute_tensor(torch.zeros(4096, 4096), init_device_mesh("cpu", (4,)), [Shard(1)])}
    reader = UCPStorageReader(path)
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner())
    assert bit_equal(out["w"].to_local(), full[:, rank * 1024 : (rank + 1) * 1024])
    ways = reader.last_load.file_access
    assert len(ways) == 2, ways
    # Alone, a rank reads such files exactly; on one machine its partner reads the pages between
    # its pieces, the page cache they share reads each once, and both files stream.
    assert set(ways.values()) == {EXACT if separate else SEQUENTIAL}, ways
    # The load's slowest rank (gathered as numbers at its end) is the same record on every rank:
    # the rank record with the most seconds, its file one of the load's.
    records: list[Any] = [None] * world
    dist.all_gather_object(records, reader.last_load.rank_record)
    job = reader.last_load.slowest
    assert job == max(records, key=lambda r: (r.seconds, -r.rank)), (job, records)
    assert job.file in reader.source.paths and job.bytes > 0


@pytest.mark.multiproc
def test_ranks_on_one_machine_stream_what_they_read_between_them(tmp_path: Path) -> None:
    """Which ranks share a machine reaches every rank with the load's plan (no collective of its
    own), and turns a column reshard's exact reads into streams only where they do."""
    run_ranks(4, _column_reshard, str(tmp_path), False)
    run_ranks(4, _column_reshard, str(tmp_path), True)
