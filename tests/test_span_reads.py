"""Span reads (ucp_dcp.core.spans, StagingBuffers' span path): the cost model, and bytes exactly.

A region of many short runs (column slices of rows) may be read as its
covering span into bounded staging memory and scattered with one strided
copy. The cost model's functions are checked against brute force; the span
path against plain slicing, bit for bit, with hypothesis choosing shapes,
dtypes, row/column slices, gaps between runs, staging budgets, casts,
stored dimension orders and verification on or off; a flipped byte of a
needed block inside a staged span is caught, one elsewhere in the span is
not used.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ucp_dcp.byteio.transfer as transfer
from dist_utils import bit_equal
from ucp_dcp.byteio.blocksums import BlockHasher, BlockSums
from ucp_dcp.byteio.blocksums import BlockVerifier, ChunkCheck
from ucp_dcp.byteio.rangeio import RangeReader
from ucp_dcp.byteio.transfer import ChunkRegion, StagingBuffers
from ucp_dcp.core.sharding import Box
from ucp_dcp.core.spans import ReadCost, ReadCosts, prefer_span, read_cost, region_starts, span_of, span_slabs
from ucp_dcp.errors import ChecksumError
from ucp_dcp.format import Location
from ucp_dcp import ReadOptions

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.int64]


# ---------------------------------------------------------------- the cost model


@given(
    n=st.integers(1, 200), length=st.integers(1, 9000), gap=st.integers(0, 20000), base=st.integers(0, 10000),
    page=st.sampled_from([512, 4096]),
)
def test_read_cost_counts_pages_and_calls_like_brute_force(n: int, length: int, gap: int, base: int, page: int) -> None:
    starts = np.arange(n, dtype=np.int64) * (length + gap)
    exact, span = read_cost(starts, length, base=base, gap_bytes=page - 1, page=page, iov_max=1 << 30)
    pages = {p for s in starts.tolist() for p in range((base + s) // page, (base + s + length - 1) // page + 1)}
    assert exact.pages == len(pages)
    assert exact.calls == (1 if gap <= page - 1 else n)
    end = base + int(starts[-1]) + length
    assert span.pages == (end - 1) // page - base // page + 1
    assert span.pages >= exact.pages
    if gap < page:  # a sub-page gap costs no extra page... beyond the pages the runs touch themselves
        assert span.pages == exact.pages


def test_prefer_span_picks_spans_for_narrow_columns_and_exact_reads_for_rows() -> None:
    # Whole rows, or a few runs: exact.
    assert not prefer_span((1024, 2048), Box((100, 0), (500, 2048)), 4)
    assert not prefer_span((4, 2048), Box((0, 0), (4, 512)), 4)
    # 2 KiB of every 4 KiB row (sub-page gaps): the same pages, and the exact reads already share calls.
    assert not prefer_span((4096, 1024), Box((0, 512), (4096, 512)), 4)
    # 8 bytes of every 16 bytes: the bookkeeping of a run costs more than copying out of a span.
    assert prefer_span((4096, 4), Box((0, 2), (4096, 2)), 4)
    # 2 KiB of every 8 KiB row: twice the pages, but one call per row costs more than a page.
    assert prefer_span((4096, 2048), Box((0, 512), (4096, 512)), 4)
    # 4 bytes of every 64 KiB row: 16 pages per needed page; exact.
    assert not prefer_span((4096, 16384), Box((0, 3), (4096, 1)), 4)
    # Free calls and runs: never worth a wider read.
    free = ReadCosts(call=0.0, run=0.0)
    assert not prefer_span((4096, 2048), Box((0, 512), (4096, 512)), 4, costs=free)
    # gap_bytes=0 asks for exactly the needed bytes: no span with a gap in it, however cheap.
    assert not prefer_span((4096, 2048), Box((0, 512), (4096, 512)), 4, gap_bytes=0)
    assert not prefer_span((4096, 4), Box((0, 2), (4096, 2)), 4, gap_bytes=0)


@st.composite
def regions(draw: Any) -> tuple[tuple[int, ...], Box, int]:
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=nd, max_size=nd)))
    offs, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n - 1))
        offs.append(o)
        sizes.append(draw(st.integers(1, n - o)))
    return shape, Box(tuple(offs), tuple(sizes)), draw(st.sampled_from([1, 2, 4, 8]))


@given(r=regions(), budget=st.integers(1, 600))
def test_span_slabs_tile_the_region_and_keep_each_span_within_budget(r: tuple[Any, Box, int], budget: int) -> None:
    shape, region, es = r
    seen = np.zeros(region.sizes, dtype=np.int64)
    for offs, sizes in span_slabs(shape, region, es, budget):
        a, b = span_of(shape, tuple(o + p for o, p in zip(region.offsets, offs)), sizes, es)
        assert b - a <= budget or math.prod(sizes) == 1
        seen[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] += 1
    assert (seen == 1).all()


@given(r=regions())
def test_span_of_covers_exactly_the_first_to_the_last_run(r: tuple[Any, Box, int]) -> None:
    shape, region, es = r
    starts, length = region_starts(shape, region, es)
    assert span_of(shape, region.offsets, region.sizes, es) == (int(starts[0]), int(starts[-1]) + length)


# ---------------------------------------------------------------- bytes, exactly


def _full(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape)
    if dtype.is_floating_point:  # no NaN: casts must compare bit for bit
        t = torch.where(t.isnan(), torch.zeros((), dtype=dtype), t)
    return t


@st.composite
def span_cases(draw: Any) -> dict[str, Any]:
    nd = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(DTYPES))
    # The last dim sets the row length, hence the gap between column slices: sub-page to several pages.
    last = draw(st.sampled_from([3, 17, 64, 512, 1024, 2048, 3000]))
    lead = draw(st.lists(st.integers(1, 9), min_size=nd - 1, max_size=nd - 1))
    shape = (*lead, max(1, last // dtype.itemsize))
    kind = draw(st.sampled_from(["columns", "rows", "any"]))
    offs, sizes = [], []
    for d, n in enumerate(shape):
        whole = kind == "rows" and d > 0 or kind == "columns" and d < nd - 1
        o = 0 if whole else draw(st.integers(0, n - 1))
        offs.append(o)
        sizes.append(n - o if whole else draw(st.integers(1, n - o)))
    order = tuple(draw(st.permutations(range(nd)))) if draw(st.booleans()) else ()
    return {
        "shape": shape, "dtype": dtype, "region": Box(tuple(offs), tuple(sizes)), "order": order,
        "cast": draw(st.booleans()), "verify": draw(st.booleans()), "block": draw(st.sampled_from([16, 24, 64, 100, 4096])),
        "budget": draw(st.sampled_from([64, 200, 4096, 1 << 20])), "lead": draw(st.integers(0, 5000)),
        "seed": draw(st.integers(0, 2**16)), "mapped": draw(st.booleans()),
    }


def _write(d: str, full: torch.Tensor, order: tuple[int, ...], lead: int, block: int) -> tuple[str, Location, BlockSums]:
    stored = (full.permute(order) if order else full).contiguous()
    data = stored.reshape(-1).view(torch.uint8).numpy().tobytes()
    path = os.path.join(d, "data.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(lead) + data + os.urandom(777))
    h = BlockHasher(len(data), block)
    h.update(data)
    return path, Location(0, lead, len(data), "", order), BlockSums(block, h.digests())


def _read(
    path: str, loc: Location, sums: BlockSums, case: dict[str, Any], dest: torch.Tensor
) -> tuple[BlockVerifier | None, StagingBuffers]:
    verifier = BlockVerifier([path], [0]) if case["verify"] else None
    check = ChunkCheck(verifier, sums, "w", (0,) * len(case["shape"])) if verifier is not None else None
    with RangeReader([path], threads=2, gap_bytes=4095) as reader:
        if not case.get("mapped", True):  # the staged path: what a source that cannot map takes
            reader.read_mapped = lambda file, spans: False  # type: ignore[method-assign]
        with StagingBuffers(case["budget"]) as staging:
            staging.read(reader, ChunkRegion(loc, case["shape"], case["region"], case["dtype"]), dest, check)
    return verifier, staging


@given(case=span_cases())
@example(case={  # blocks of 100 bytes, 8-byte elements: the first needed byte is not at a block's element boundary
    "shape": (64,), "dtype": torch.float64, "region": Box((13,), (1,)), "order": (), "cast": False, "verify": True,
    "block": 100, "budget": 64, "lead": 0, "seed": 0, "mapped": True,
})
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_span_reads_are_bit_exact_and_catch_a_flipped_needed_byte(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The span path (forced) fills the region exactly: any shape, dtype, slice, gap, budget, cast, stored
    order, verified or not, copied out of the file mapped into memory or read into staging memory.
    Verified, a flipped byte the region needs fails the read naming its block; a flipped byte of the span
    outside every touched block changes nothing."""
    used: list[bool] = []

    def forced(*args: Any) -> bool:
        used.append(True)
        return True

    monkeypatch.setattr(transfer, "spanned", forced)
    shape, dtype, region, order = case["shape"], case["dtype"], case["region"], case["order"]
    full = _full(shape, dtype, case["seed"])
    want = full[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))]
    out_dtype = torch.float64 if case["cast"] and dtype != torch.float64 else dtype
    with tempfile.TemporaryDirectory() as d:
        path, loc, sums = _write(d, full, order, case["lead"], case["block"])
        dest = torch.full(region.sizes, 7, dtype=out_dtype)
        verifier, staging = _read(path, loc, sums, case, dest)
        assert used, "the span path was asked"
        # Taken wherever the buffer holds an element plus a block at each end and an element to align.
        fits = case["budget"] - (2 * case["block"] if case["verify"] else 0) - dtype.itemsize >= dtype.itemsize
        mapped = case["mapped"] and case["lead"] % dtype.itemsize == 0  # a chunk at an element boundary
        if mapped:  # straight from the mapping: no staging memory, whatever its bound
            assert staging.spans > 0 and staging.allocations == 0
        else:
            assert (staging.spans > 0) == fits
        assert bit_equal(dest, want.to(out_dtype))

        # Which bytes of the stored chunk the region needs (positions in stored order).
        pos = torch.arange(full.numel()).view(shape)
        pos_stored = (pos.permute(order) if order else pos).contiguous().reshape(-1)
        rank_of = torch.empty_like(pos_stored)
        rank_of[pos_stored] = torch.arange(full.numel())  # element -> its index in the stored order
        needed = rank_of[pos[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))].reshape(-1)]
        es, bs = dtype.itemsize, case["block"]
        touched = {b for i in needed.tolist() for b in range(i * es // bs, ((i + 1) * es - 1) // bs + 1)}
        if verifier is not None and (fits or mapped):  # each touched block hashed once, no other
            assert verifier.bytes == sum(min(bs, loc.nbytes - k * bs) for k in touched)

        def flipped(byte: int) -> torch.Tensor:
            with open(path, "r+b") as f:
                f.seek(loc.start + byte)
                b = f.read(1)[0]
                f.seek(loc.start + byte)
                f.write(bytes([b ^ 0x10]))
            out = torch.full(region.sizes, 7, dtype=out_dtype)
            try:
                _read(path, loc, sums, case, out)
            finally:
                with open(path, "r+b") as f:
                    f.seek(loc.start + byte)
                    f.write(bytes([b]))
            return out

        byte = int(needed[len(needed) // 2]) * es + es - 1
        if case["verify"]:
            with pytest.raises(ChecksumError, match=f"block {byte // bs} "):
                flipped(byte)
        else:
            assert not bit_equal(flipped(byte), want.to(out_dtype)) or out_dtype != dtype
        # A byte inside the span but in no touched block: read, never used, never hashed.
        lo, hi = int(needed.min()) * es, (int(needed.max()) + 1) * es
        spare = [x for x in range(lo, hi, max(1, (hi - lo) // 64)) if x // bs not in touched]
        if spare:
            assert bit_equal(flipped(spare[0]), want.to(out_dtype))


def test_span_staging_stays_within_its_bound_for_a_large_column_slice(tmp_path: Any) -> None:
    """A column slice whose span is 64x the staging bound: many spans, one buffer of at most the bound."""
    full = _full((1024, 2048), torch.float32, 1)  # 8 MiB, 8 KiB rows
    region = Box((0, 512), (1024, 512))  # 2 KiB of each row
    path, loc, sums = _write(str(tmp_path), full, (), 100, 4096)
    assert prefer_span(full.shape, region, 4, base=loc.start)
    dest = torch.zeros(region.sizes)
    with RangeReader([path], threads=2, gap_bytes=4095) as reader, StagingBuffers(128 << 10) as staging:
        reader.read_mapped = lambda file, spans: False  # type: ignore[method-assign]  # staged, as from a store
        verifier = BlockVerifier([path], [0])
        staging.read(reader, ChunkRegion(loc, full.shape, region, torch.float32), dest,
                     ChunkCheck(verifier, sums, "w", (0, 0)))
        assert staging.capacity <= 128 << 10 and staging.allocations == 1 and staging.spans >= 64
        assert reader.stats.calls < 1024 // 8  # not one call per row
    assert bit_equal(dest, full[:, 512:1024])


def test_mapped_spans_read_a_column_slice_without_staging_and_check_each_touched_block_once(tmp_path: Any) -> None:
    """A local file's column slice is copied straight out of the file mapped into memory: bit-exact, no
    staging memory, a call per 16 MiB of span, every block holding a needed byte hashed exactly once, a
    flipped needed byte named by its block. A file cut short is not mapped: the staged read names the
    truncation."""
    from ucp_dcp.errors import TruncatedFileError

    full = _full((4096, 2048), torch.float32, 2)  # 32 MiB, 8 KiB rows: spans of two requests
    region = Box((0, 512), (4096, 512))  # 2 KiB of each row: in one 4 KiB block of it
    path, loc, sums = _write(str(tmp_path), full, (), 64, 4096)
    part = ChunkRegion(loc, full.shape, region, torch.float32)

    def read(dest: torch.Tensor, *, verify: bool = True) -> tuple[RangeReader, StagingBuffers, BlockVerifier]:
        verifier = BlockVerifier([path], [0])
        check = ChunkCheck(verifier, sums, "w", (0, 0)) if verify else None
        with RangeReader([path], threads=2, gap_bytes=4095) as reader, StagingBuffers(1 << 20) as staging:
            assert reader.maps_files and transfer.spanned(reader, part, dest)
            staging.read(reader, part, dest, check)
        return reader, staging, verifier

    dest = torch.zeros(region.sizes)
    reader, staging, verifier = read(dest)
    assert bit_equal(dest, full[:, 512:1024])
    assert staging.allocations == 0 and staging.spans == reader.stats.calls == 2
    assert verifier.bytes == 4096 * 4096  # row r's needed bytes lie in its block 2r: 4096 blocks, once each
    byte = (1000 * 2048 + 700) * 4 + 1  # row 1000, column 700: needed
    with open(path, "r+b") as f:
        f.seek(loc.start + byte)
        b = f.read(1)[0]
        f.seek(loc.start + byte)
        f.write(bytes([b ^ 4]))
    with pytest.raises(ChecksumError, match=f"block {byte // 4096} "):
        read(torch.zeros(region.sizes))
    unchecked = torch.zeros(region.sizes)
    read(unchecked, verify=False)
    assert int((unchecked != full[:, 512:1024]).sum()) == 1  # unverified, the flipped element as it is
    os.truncate(path, loc.start + loc.nbytes // 2)
    with pytest.raises(TruncatedFileError, match="truncated"):
        read(torch.zeros(region.sizes), verify=False)


def test_dcp_load_reads_a_narrow_column_slice_as_spans_and_checks_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``dcp.load``: 2 KiB of each 8 KiB row of two saved chunks, read as spans (few calls), exact;
    with a byte the load needs flipped, verified loads fail naming the block, unverified ones load it."""
    import torch.distributed.checkpoint as dcp

    from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
    from ucp_dcp.core.pieces import Piece, TensorPieces
    from ucp_dcp.sources import NativeSource, SourceOptions

    made: list[StagingBuffers] = []

    def spy(*args: Any, **kwargs: Any) -> StagingBuffers:
        made.append(StagingBuffers(*args, **kwargs))
        return made[-1]

    import ucp_dcp.byteio.engine as engine_module

    monkeypatch.setattr(engine_module, "StagingBuffers", spy)
    shape = (512, 2048)
    full = _full(shape, torch.float32, 3)
    halves = [Piece("w", shape, (r, 0), full[r : r + 256].clone()) for r in (0, 256)]
    dcp.save({"p": TensorPieces(halves)}, storage_writer=UCPStorageWriter(tmp_path), planner=UCPSavePlanner(), no_dist=True)

    def load(verify: bool) -> tuple[torch.Tensor, UCPStorageReader]:
        dest = torch.zeros(500, 512)
        reader = UCPStorageReader(tmp_path, options=ReadOptions(verify=verify))
        dcp.load({"p": TensorPieces([Piece("w", shape, (6, 1024), dest)])}, storage_reader=reader,
                 planner=UCPLoadPlanner(), no_dist=True)
        return dest, reader

    for verify in (True, False):
        dest, reader = load(verify)
        assert bit_equal(dest, full[6:506, 1024:1536])
        assert made[-1].spans >= 2 and reader.last_load.read_calls < 50  # not one read per row
    src = NativeSource.open(str(tmp_path), SourceOptions())
    loc = src.locate("w", src.chunk_index("w", (256, 0), None))
    byte = (100 * 2048 + 1100) * 4 + 2  # row 356, column 1100: needed
    with open(src.paths[loc.file], "r+b") as f:
        f.seek(loc.start + byte)
        b = f.read(1)[0]
        f.seek(loc.start + byte)
        f.write(bytes([b ^ 1]))
    with pytest.raises(BaseException) as ei:
        load(True)
    assert f"block {byte // 4096} " in str(ei.value)
    dest, _ = load(False)
    assert not bit_equal(dest, full[6:506, 1024:1536])


def test_a_destination_in_another_order_counts_its_runs() -> None:
    """Whole rows into a transposed destination are one run per element when read in place: spans."""
    chunk, region = (256, 256), Box((0, 0), (256, 256))
    assert not prefer_span(chunk, region, 4)
    assert prefer_span(chunk, region, 4, dst_strides=(1, 256))


def test_no_runs_or_empty_runs_cost_nothing_and_an_empty_region_has_no_slab() -> None:
    zero = ReadCost(0, 0, 0.0)
    assert read_cost(np.array([], dtype=np.int64), 8) == (zero, zero)
    assert read_cost(np.array([0, 64], dtype=np.int64), 0) == (zero, zero)
    assert list(span_slabs((4, 4), Box((1, 0), (0, 4)), 4, 1 << 20)) == []
