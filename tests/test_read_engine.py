"""The chunk-read engine (ucp_dcp.byteio.engine.ChunkReads) on its own: bit-exact regions of
saved chunks under the direct and the staged path, unverified, block-verified and checked
against whole-chunk checksums; the bytes it asks its ByteSource for; callbacks after the
checks; a damaged needed byte caught; the byte view of a destination's storage it reads into."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dist_utils import bit_equal
from test_span_reads import _full
from ucp_dcp.byteio.blocksums import BlockHasher, BlockSums
from ucp_dcp.byteio.engine import ChunkReads
from ucp_dcp.byteio.objrange import ObjectRangeReader
from ucp_dcp.byteio.rangeio import ByteSource, RangeReader, ReadStats
from ucp_dcp.byteio.segments import Segment
from ucp_dcp.byteio.transfer import ChunkRegion
from ucp_dcp.core.sharding import Box
from ucp_dcp.errors import ChecksumError, InvalidArgumentError
from ucp_dcp.format import Location

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


def _write_chunks(
    path: str, chunks: list[torch.Tensor], order: tuple[int, ...], block: int
) -> list[tuple[Location, BlockSums]]:
    """Each chunk stored densely (in ``order`` if given) after some unrelated bytes, with its
    xxh3-64 and its block checksums."""
    out, at = [], 0
    with open(path, "wb") as f:
        for k, c in enumerate(chunks):
            data = (c.permute(order) if order else c).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            lead = os.urandom(100 + 37 * k)
            f.write(lead + data)
            start = at + len(lead)
            at = start + len(data)
            h = BlockHasher(len(data), block)
            h.update(data)
            out.append((Location(0, start, len(data), xxhash.xxh3_64_hexdigest(data), order), BlockSums(block, h.digests())))
        f.write(os.urandom(333))
    return out


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(2, 24))
    cols = draw(st.sampled_from([1, 3, 16, 100, 700]))
    cut = draw(st.integers(1, rows - 1))
    regions = []
    for n in (cut, rows - cut):
        r0 = draw(st.integers(0, n - 1))
        c0 = draw(st.integers(0, cols - 1))
        regions.append(Box((r0, c0), (draw(st.integers(1, n - r0)), draw(st.integers(1, cols - c0)))))
    return {
        "dtype": dtype, "shape": (rows, cols), "cut": cut, "regions": regions,
        # direct: CPU, saved dtype; strided: a transposed destination; cast / order: staged.
        "dest": draw(st.sampled_from(["direct", "strided", "cast"])),
        "order": (1, 0) if draw(st.booleans()) else (),
        "verify": draw(st.sampled_from(["none", "blocks", "whole"])),
        "block": draw(st.sampled_from([16, 100, 4096])),
        "gap": draw(st.sampled_from([0, 4095])),
        "budget": draw(st.sampled_from([1 << 10, 1 << 20])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _dest(kind: str, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if kind == "cast":
        return torch.full(sizes, 7, dtype=torch.float64)
    if kind == "strided":
        return torch.full(sizes[::-1], 7, dtype=dtype).t()
    return torch.full(sizes, 7, dtype=dtype)


def _run(case: dict[str, Any], path: str, stored: list[tuple[Location, BlockSums]], full: torch.Tensor,
         source: ByteSource) -> tuple[ChunkReads, list[torch.Tensor], list[int]]:
    cut, dtype = case["cut"], case["dtype"]
    boxes = [Box((0, 0), (cut, full.shape[1])), Box((cut, 0), (full.shape[0] - cut, full.shape[1]))]
    engine = ChunkReads(source, [path], [3], verify=case["verify"] != "none", max_buffer_bytes=case["budget"])
    dests, done = [], []
    for k, (box, (loc, sums), region) in enumerate(zip(boxes, stored, case["regions"])):
        dest = _dest(case["dest"], region.sizes, dtype)
        dests.append(dest)
        engine.add(
            ChunkRegion(loc, box.sizes, region, dtype), dest, name="w", chunk_offsets=box.offsets,
            sums=sums if case["verify"] == "blocks" else None, done=lambda k=k: done.append(k),
        )
    engine.flush()
    return engine, dests, done


def _want(full: torch.Tensor, case: dict[str, Any], k: int) -> torch.Tensor:
    base = (0, case["cut"])[k]
    r = case["regions"][k]
    return full[base + r.offsets[0]: base + r.offsets[0] + r.sizes[0], r.offsets[1]: r.offsets[1] + r.sizes[1]]


@given(case=cases())
@example(case={"dtype": torch.float32, "shape": (4, 3), "cut": 1,
               "regions": [Box((0, 0), (1, 1)), Box((0, 0), (3, 3))], "dest": "strided", "order": (),
               "verify": "none", "block": 16, "gap": 0, "budget": 1024, "seed": 0})
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_engine_regions_are_bit_exact_and_checked(case: dict[str, Any]) -> None:
    """Any region of any chunk, direct or staged, verified or not, is exact; the callbacks run
    once each after the reads; unverified reads with gap_bytes=0 ask for exactly the needed bytes;
    a flipped needed byte fails a verified read."""
    dtype = case["dtype"]
    full = _full(case["shape"], dtype, case["seed"])
    chunks = [full[: case["cut"]], full[case["cut"]:]]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "data.bin")
        stored = _write_chunks(path, chunks, case["order"], case["block"])
        with RangeReader([path], threads=2, gap_bytes=case["gap"]) as reader:
            engine, dests, done = _run(case, path, stored, full, reader)
            engine.close()
        for k, dest in enumerate(dests):
            want = _want(full, case, k)
            assert bit_equal(dest, want.to(dest.dtype)), k
        assert sorted(done) == [0, 1]
        totals = engine.stats
        assert totals.regions == 2
        if case["dest"] == "cast" or case["order"]:
            assert totals.staged == 2
        elif case["gap"] == 0:
            # No span reads a gap: a CPU destination of the saved dtype is read run by run, unless
            # the region's bytes are one stretch of the file (a span with no gap, which the cost
            # model may copy out of the mapped file, as for a transposed destination).
            cols = case["shape"][1]
            gapless = sum(r.sizes[0] == 1 or (r.offsets[1] == 0 and r.sizes[1] == cols) for r in case["regions"])
            assert totals.staged <= gapless
        needed = sum(r.numel for r in case["regions"]) * dtype.itemsize
        if case["verify"] == "none":
            assert totals.verified_bytes == 0
            if case["gap"] == 0:
                assert totals.bytes == needed
        elif case["verify"] == "whole":
            assert totals.verified_bytes == sum(loc.nbytes for loc, _ in stored)
        else:
            assert totals.verified_bytes >= needed
        # A needed byte flipped on disk: every verified mode refuses it.
        loc, _ = stored[0]
        r = case["regions"][0]
        sizes = (case["cut"], case["shape"][1])
        stored_sizes = tuple(sizes[d] for d in case["order"]) if case["order"] else sizes
        first = tuple(r.offsets[d] for d in case["order"]) if case["order"] else r.offsets
        at = loc.start + (first[0] * stored_sizes[1] + first[1]) * dtype.itemsize
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ 0x10]))
        with RangeReader([path], threads=2, gap_bytes=case["gap"]) as reader:
            if case["verify"] == "none":
                _run(case, path, stored, full, reader)[0].close()
            else:
                with pytest.raises(ChecksumError, match=r"\[0, 0\]"):
                    _run(case, path, stored, full, reader)


class _Counted(ByteSource):
    """A ByteSource of its own (the seam): forwards to a RangeReader, counting segments."""

    def __init__(self, inner: RangeReader) -> None:
        self.inner = inner
        self.gap_bytes = inner.gap_bytes
        self.stats = ReadStats()
        self.segments = 0

    def read(self, segments: Any) -> None:
        segs: list[Segment] = list(segments)
        self.segments += len(segs)
        before = (self.inner.stats.calls, self.inner.stats.bytes)
        self.inner.read(segs)
        self.stats.add(self.inner.stats.calls - before[0], self.inner.stats.bytes - before[1])

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_whole_chunk_checksum_hashes_the_destination_or_reads_again(tmp_path: Any) -> None:
    """Without block checksums a whole chunk read into contiguous memory is hashed there (no
    second read); a partial region reads the chunk again; another ByteSource plugs in unchanged."""
    full = _full((8, 64), torch.float32, 1)
    path = str(tmp_path / "data.bin")
    (loc, _), = _write_chunks(path, [full], (), 4096)
    for region, extra in ((Box((0, 0), (8, 64)), 0), (Box((2, 0), (3, 64)), loc.nbytes)):
        with _Counted(RangeReader([path], threads=1, gap_bytes=0)) as source:
            dest = torch.empty(region.sizes, dtype=torch.float32)
            with ChunkReads(source, [path], [0]) as engine:
                engine.add(ChunkRegion(loc, (8, 64), region, torch.float32), dest, name="w", chunk_offsets=(0, 0))
                engine.flush()
            assert bit_equal(dest, full[region.offsets[0]: region.offsets[0] + region.sizes[0]])
            needed = region.numel * 4
            # The direct read goes through the seam; the second read of the chunk through the same source.
            assert engine.stats.verified_bytes == loc.nbytes
            assert source.inner.stats.bytes == needed + extra
            assert source.segments >= 1


def test_object_range_reader_is_a_byte_source() -> None:
    """Both readers declare the seam the engine reads through."""
    assert ByteSource in RangeReader.__mro__ and ByteSource in ObjectRangeReader.__mro__


def test_storage_view_covers_the_storage_and_keeps_it_alive() -> None:
    """``storage_view`` addresses the whole storage of a (possibly offset, strided) view, is
    writable, and keeps the memory alive after every tensor over it is gone."""
    import gc

    import numpy as np

    from ucp_dcp.byteio.rangeio import storage_view

    base = torch.arange(24, dtype=torch.float32)
    view = base[4:].view(4, 5)[:, ::2]  # offset and strided: the view still sees all 24 floats
    mv = storage_view(view)
    assert (mv.nbytes, mv.readonly, mv.format) == (96, False, "B")
    assert bytes(mv) == base.numpy().tobytes()
    mv[0:4] = np.float32(7.5).tobytes()  # writes land in the tensor
    assert base[0].item() == 7.5
    del base, view
    gc.collect()
    torch.randn(1 << 16)  # other allocations do not reuse the memory the view holds
    assert np.frombuffer(mv, dtype=np.float32)[:3].tolist() == [7.5, 1.0, 2.0]
    assert storage_view(torch.empty(0)).nbytes == 0


def test_pending_reads_are_bounded_by_scratch_and_segment_count(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strided regions are read before more are planned once the block verifier's scratch reaches
    its bound, or once the segments pending reach MAX_PENDING_SEGMENTS; the bytes are the same."""
    import ucp_dcp.byteio.engine as engine_mod

    full = _full((16, 100), torch.float32, 3)
    path = str(tmp_path / "data.bin")
    stored = _write_chunks(path, [full[:8], full[8:]], (), 16)
    monkeypatch.setattr(engine_mod, "MAX_PENDING_SEGMENTS", 4)
    regions = [Box((1, 3), (6, 2)), Box((0, 50), (8, 3))]  # 6 and 8 runs
    for verify in (True, False):
        with RangeReader([path], threads=2, gap_bytes=0) as reader:
            engine = ChunkReads(reader, [path], [0], verify=verify, max_buffer_bytes=1 << 10)
            if engine.blocks is not None:
                engine.blocks.scratch_limit = 64  # a run's two edge blocks and a little more
            dests = []
            for k, ((loc, sums), region) in enumerate(zip(stored, regions)):
                dest = torch.full(region.sizes, 7.0)
                dests.append(dest)
                engine.add(ChunkRegion(loc, (8, 100), region, torch.float32), dest, name="w",
                           chunk_offsets=(8 * k, 0), sums=sums)
            engine.flush()
            engine.close()
        for k, (dest, r) in enumerate(zip(dests, regions)):
            base = 8 * k + r.offsets[0]
            assert bit_equal(dest, full[base: base + r.sizes[0], r.offsets[1]: r.offsets[1] + r.sizes[1]]), (verify, k)
        assert engine.stats.staged == 0
        assert (engine.stats.verified_bytes >= sum(r.numel for r in regions) * 4) is verify


def test_block_verifier_refuses_reads_outside_the_chunk_and_spans_that_miss_their_blocks(tmp_path: Any) -> None:
    """Its callers' regions lie inside the chunk and spans cover their blocks; one that did not is
    an InvalidArgumentError naming the bytes, not a read of other bytes. An empty region plans nothing."""
    from ucp_dcp.byteio.blocksums import BlockVerifier, ChunkCheck

    full = _full((4, 8), torch.float32, 5)
    path = str(tmp_path / "data.bin")
    ((loc, sums),) = _write_chunks(path, [full], (), 16)
    verifier = BlockVerifier([path], [0])
    check = ChunkCheck(verifier, sums, "w", (0, 0))
    view = memoryview(bytearray(256))
    with pytest.raises(InvalidArgumentError, match=r"^read \[120, 136\) outside a chunk of 128 bytes$"):
        verifier._batch_one(loc, check, 120, 0, 16, view)
    with pytest.raises(InvalidArgumentError, match=r"^read \[-4, 76\) outside a chunk of 128 bytes$"):
        verifier._batch(loc, check, np.array([-4, 60]), np.array([0, 16]), 16, view)
    mem = np.zeros(64, np.uint8)
    with pytest.raises(InvalidArgumentError, match=r"^blocks 1\.\.5 are not inside the span read at 16$"):
        verifier.check_span(check, loc, mem, 16, np.array([1, 5]))  # blocks 1..5 need 80 bytes from 16
    with pytest.raises(InvalidArgumentError, match=r"^blocks 0\.\.1 are not inside the span read at 16$"):
        verifier.check_span(check, loc, mem, 16, np.array([0, 1]))
    assert list(verifier.plan(loc, check, (4, 8), Box((2, 0), (0, 8)), torch.empty(0, 8))) == []


class _NoCallbacks(ByteSource):
    """A ByteSource that fills the buffers but never calls the segments' callbacks."""

    def __init__(self, inner: RangeReader) -> None:
        self.inner = inner
        self.gap_bytes = inner.gap_bytes
        self.stats = inner.stats

    def read(self, segments: Any) -> None:
        self.inner.read([Segment(s.file, s.offset, s.dest) for s in segments])

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> _NoCallbacks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_blocks_a_source_read_without_their_callbacks_are_checked_at_the_end(tmp_path: Any) -> None:
    """No callback ran, so no batch was checked during the read: the engine's flush checks them all,
    and a flipped byte is still caught."""
    full = _full((16, 100), torch.float32, 4)
    path = str(tmp_path / "data.bin")
    ((loc, sums),) = _write_chunks(path, [full], (), 64)
    region = Box((2, 10), (5, 30))
    for flipped in (False, True):
        if flipped:
            at = loc.start + (2 * 100 + 10) * 4
            with open(path, "r+b") as f:
                f.seek(at)
                b = f.read(1)[0]
                f.seek(at)
                f.write(bytes([b ^ 1]))
        dest = torch.zeros(region.sizes)
        with _NoCallbacks(RangeReader([path], gap_bytes=0)) as source, ChunkReads(source, [path], [2]) as engine:
            engine.add(ChunkRegion(loc, (16, 100), region, torch.float32), dest, name="w", chunk_offsets=(0, 0), sums=sums)
            if not flipped:
                engine.flush()
                assert bit_equal(dest, full[2:7, 10:40]) and engine.stats.verified_bytes > 0
            else:
                # Byte (2 * 100 + 10) * 4 = 840 of the chunk is in block 13 of 64 bytes.
                match = r"tensor 'w' chunk at \[0, 0\], block 13 \(bytes \[832, 896\) of the chunk\): the file is corrupt "
                with pytest.raises(ChecksumError, match=match):
                    engine.flush()
