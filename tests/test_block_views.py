"""The strided views of block checking stay inside their buffers.

:mod:`ucp_dcp.byteio.blocksums` hashes many blocks, and copies many equal
pieces out of scratch memory, through ``as_strided`` views, which numpy does
not bounds-check: a view reaching past its buffer would read, or write,
memory that is not the buffer's (heap corruption, far from its cause).

* ``_rows`` builds a view only where every row lies inside the buffer, and
  names the view in an :class:`InvalidArgumentError` otherwise.
* ``_digests`` and ``_copy`` over random offsets and lengths, on buffers that
  sit inside larger ones: the digests are those of the bytes asked for, the
  copies land where asked, and no byte around them changes.
* Verified reads of random regions of random chunks into strided
  destinations that sit inside larger tensors (small blocks: many blocks, and
  both strided paths): the region is exact and no other byte of the
  destination's storage changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucp_dcp.byteio import blocksums
from ucp_dcp.byteio.blocksums import BlockHasher, BlockSums
from ucp_dcp.byteio.blocksums import (
    Batch,
    BlockVerifier,
    ChunkCheck,
    _digests,
    _rows,
    read_verified,
)
from ucp_dcp.byteio.rangeio import ReadStats
from ucp_dcp.byteio.segments import Segment
from ucp_dcp.core.sharding import Box
from ucp_dcp.errors import InvalidArgumentError
from ucp_dcp.format import Location

GUARD = 37  # bytes of known garbage on each side of a buffer under test


def _guarded(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random buffer of ``n + 2 * GUARD`` bytes and its middle ``n`` bytes (a view)."""
    outer = np.random.default_rng(seed).integers(0, 256, n + 2 * GUARD, dtype=np.uint8)
    return outer, outer[GUARD : GUARD + n]


# ---------------------------------------------------------------- _rows


@given(
    n=st.integers(0, 200),
    start=st.integers(-50, 250),
    count=st.integers(-2, 30),
    width=st.integers(-2, 40),
    step=st.integers(-5, 40),
)
def test_rows_are_inside_the_buffer_or_refused(
    n: int, start: int, count: int, width: int, step: int
) -> None:
    """Row ``i`` of ``_rows`` is exactly ``arr[start + i * step :][:width]``, every one inside
    ``arr``; a view that would reach outside it (or back before it) is refused by name."""
    arr = np.arange(n, dtype=np.uint8)
    fits = (
        count >= 1
        and width >= 0
        and start >= 0
        and step >= 0
        and start + (count - 1) * step + width <= n
    )
    if not fits:
        with pytest.raises(InvalidArgumentError, match="not inside a buffer of"):
            _rows(arr, start, count, width, step, "rows under test")
        return
    rows = _rows(arr, start, count, width, step, "rows under test")
    assert rows.shape == (count, width)
    for i in range(count):
        assert rows[i].tolist() == arr[start + i * step : start + i * step + width].tolist()


# ---------------------------------------------------------------- _digests


@st.composite
def digest_cases(draw: Any) -> tuple[int, int, list[int], list[int]]:
    """A buffer size, a block size and blocks inside the buffer: at a constant stride (the
    strided path) or anywhere, some of them short."""
    block = draw(st.integers(1, 16))
    count = draw(st.integers(1, 20))
    if draw(st.booleans()):  # a constant stride, every block full
        step = draw(st.integers(1, 3 * block))
        first = draw(st.integers(0, 20))
        offs, lens = [first + i * step for i in range(count)], [block] * count
    else:
        offs = draw(st.lists(st.integers(0, 300), min_size=count, max_size=count))
        lens = [draw(st.sampled_from([block, block, draw(st.integers(0, block))])) for _ in offs]
    n = max(o + w for o, w in zip(offs, lens)) + draw(st.integers(0, 3))
    return n, block, offs, lens


@given(case=digest_cases(), seed=st.integers(0, 2**32 - 1), as_memoryview=st.booleans())
def test_digests_hash_exactly_the_blocks_asked_for(
    case: tuple[int, int, list[int], list[int]], seed: int, as_memoryview: bool
) -> None:
    """``_digests`` gives the xxh3-64 of ``mem[o : o + n]`` for every block, strided or not; a
    view past the buffer's end would have hashed the guard bytes behind it."""
    n, block, offs, lens = case
    outer, mem = _guarded(n, seed)
    before = outer.copy()
    got = _digests(
        mem.data if as_memoryview else mem,
        np.array(offs, dtype=np.int64),
        np.array(lens, dtype=np.int64),
        block,
    )
    want = [xxhash.xxh3_64_intdigest(mem[o : o + w].tobytes()) for o, w in zip(offs, lens)]
    assert got.tolist() == want
    assert np.array_equal(outer, before)


# ---------------------------------------------------------------- _copy


@st.composite
def copy_cases(draw: Any) -> tuple[int, int, list[int], list[int], list[int]]:
    """Scratch and destination sizes and pieces inside both that do not overlap in the
    destination: equal pieces at equal strides (the strided path) or any."""
    count = draw(st.integers(1, 20))
    if draw(st.booleans()):
        w = draw(st.integers(1, 12))
        sstep, dstep = draw(st.integers(1, 20)), draw(st.integers(w, 30))
        s0, d0 = draw(st.integers(0, 10)), draw(st.integers(0, 10))
        so = [s0 + i * sstep for i in range(count)]
        do = [d0 + i * dstep for i in range(count)]
        ln = [w] * count
    else:
        ln = draw(st.lists(st.integers(0, 12), min_size=count, max_size=count))
        so = [draw(st.integers(0, 100)) for _ in ln]
        gaps = draw(st.lists(st.integers(0, 10), min_size=count, max_size=count))
        do = list(np.cumsum(gaps) + np.cumsum([0, *ln[:-1]]))
        order = draw(st.permutations(range(count)))
        so, do, ln = [so[i] for i in order], [int(do[i]) for i in order], [ln[i] for i in order]
    ns = max(s + w for s, w in zip(so, ln)) + draw(st.integers(0, 3))
    nd = max(d + w for d, w in zip(do, ln)) + draw(st.integers(0, 3))
    return ns, nd, so, do, ln


@given(case=copy_cases(), seed=st.integers(0, 2**32 - 1))
def test_copy_writes_exactly_the_pieces_asked_for(
    case: tuple[int, int, list[int], list[int], list[int]], seed: int
) -> None:
    """``_copy`` puts ``scratch[s : s + n]`` at ``dest[d : d + n]`` for every piece, strided or
    not, and changes no other byte of the destination's buffer or around it."""
    ns, nd, so, do, ln = case
    _, scratch = _guarded(ns, seed)
    outer, dest = _guarded(nd, seed + 1)
    want = outer.copy()
    for s, d, w in zip(so, do, ln):
        want[GUARD + d : GUARD + d + w] = scratch[s : s + w]
    empty = np.zeros(0, np.int64)
    loc = Location(0, 0, 0, "")
    check = ChunkCheck(BlockVerifier(["f"], [0]), BlockSums(1, np.zeros(0, np.uint64)), "t", (0,))
    batch = Batch(
        loc,
        check,
        dest.data,
        empty,
        empty,
        scratch,
        empty,
        tuple(np.array(x, dtype=np.int64) for x in (so, do, ln)),
    )  # type: ignore[arg-type]
    BlockVerifier._copy(batch)
    assert np.array_equal(outer, want)


def test_copy_refuses_pieces_past_the_destination() -> None:
    """Equal pieces at equal strides whose last one ends past the destination: refused before
    anything is written, not written past its end."""
    outer, dest = _guarded(100, 0)
    before = outer.copy()
    _, scratch = _guarded(400, 1)
    n = 12  # more than blocksums._FEW: the strided path
    so, do, ln = (
        np.arange(n, dtype=np.int64) * 30,
        np.arange(n, dtype=np.int64) * 9,
        np.full(n, 5, np.int64),
    )
    empty = np.zeros(0, np.int64)
    check = ChunkCheck(BlockVerifier(["f"], [0]), BlockSums(1, np.zeros(0, np.uint64)), "t", (0,))
    batch = Batch(
        Location(0, 0, 0, ""), check, dest.data, empty, empty, scratch, empty, (so, do, ln)
    )
    with pytest.raises(
        InvalidArgumentError,
        match=r"pieces of tensor 't' chunk at \[0\] copied into the destination",
    ):
        BlockVerifier._copy(batch)
    assert np.array_equal(outer, before)


# ---------------------------------------------------------------- verified reads


class _MemorySource:
    """A byte source over one file held in memory: each segment is filled, then its callback
    runs, in order (the callbacks check and copy, as on an I/O thread)."""

    gap_bytes = 0

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.stats = ReadStats()

    def read(self, segments: Sequence[Segment]) -> None:
        for s in segments:
            assert 0 <= s.offset and s.offset + len(s.dest) <= len(self.data), (
                "a read outside the file"
            )
            s.dest[:] = self.data[s.offset : s.offset + len(s.dest)]
            self.stats.add(1, len(s.dest))
            if s.done is not None:
                s.done(1)

    def close(self) -> None:
        pass


_DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64]


@st.composite
def read_cases(draw: Any) -> dict[str, Any]:
    """A chunk, a region of it, a block size and a destination view inside a larger tensor."""
    ndim = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(_DTYPES))
    sizes = [draw(st.integers(1, 24)) for _ in range(ndim)]
    offs = [draw(st.integers(0, s - 1)) for s in sizes]
    lens = [draw(st.integers(1, s - o)) for s, o in zip(sizes, offs)]
    pads = [(draw(st.integers(0, 3)), draw(st.integers(0, 3))) for _ in range(ndim)]
    return {
        "dtype": dtype,
        "sizes": sizes,
        "region": Box(tuple(offs), tuple(lens)),
        # Blocks about a row long put one block, or none, in each row of a column slice: the strided
        # paths (equal blocks, equal pieces at a constant stride).
        "block": draw(
            st.one_of(
                st.sampled_from([1, 3, 8, 64, 4096]), st.integers(1, 2 * sizes[-1] * dtype.itemsize)
            )
        ),
        "pads": pads,
        "reversed": draw(st.booleans()),  # the larger tensor's dimensions in reverse memory order
        "scratch_limit": draw(st.sampled_from([1, 64, 16 << 20])),
        "prefix": draw(st.integers(0, 9)),  # the chunk's offset in the file
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@st.composite
def column_cases(draw: Any) -> dict[str, Any]:
    """:func:`read_cases` narrowed to column slices of many rows with blocks about a row long:
    equal in-place blocks and equal scratch pieces at constant strides, many of them (the
    strided paths)."""
    case = draw(read_cases())
    rows, cols = draw(st.integers(9, 40)), draw(st.integers(1, 24))
    c0 = draw(st.integers(0, cols - 1))
    case["sizes"] = [rows, cols]
    case["region"] = Box((0, c0), (rows, draw(st.integers(1, cols - c0))))
    case["pads"] = case["pads"][:1] * 2
    case["block"] = draw(st.integers(1, 2 * cols * case["dtype"].itemsize))
    return case


def _verified_read(case: dict[str, Any]) -> None:
    """Read the case's region with block verification into its destination and check the result
    and every other byte of the destination's storage."""
    dtype, sizes, region, block = case["dtype"], case["sizes"], case["region"], case["block"]
    g = torch.Generator().manual_seed(case["seed"] % (2**31))
    es = dtype.itemsize
    chunk_bytes = torch.randint(0, 256, (int(np.prod(sizes)) * es,), dtype=torch.uint8, generator=g)
    chunk = chunk_bytes.view(dtype).reshape(sizes)
    hasher = BlockHasher(chunk_bytes.numel(), block)
    hasher.update(chunk_bytes.numpy().tobytes())
    sums = BlockSums(block, hasher.digests())
    outer_shape = [n + a + b for n, (a, b) in zip(region.sizes, case["pads"])]

    def dest_in(storage: torch.Tensor) -> torch.Tensor:
        if case["reversed"]:
            big = (
                storage.view(dtype)[: int(np.prod(outer_shape))]
                .reshape(outer_shape[::-1])
                .permute(*reversed(range(len(sizes))))
            )
        else:
            big = storage.view(dtype)[: int(np.prod(outer_shape))].reshape(outer_shape)
        for d, ((a, _), n) in enumerate(zip(case["pads"], region.sizes)):
            big = big.narrow(d, a, n)
        return big

    nbytes = (
        int(np.prod(outer_shape)) + 3
    ) * es  # a few spare elements past the larger tensor, too
    storage = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    want = storage.clone()
    dest_in(want).copy_(chunk[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes))])
    prefix = bytes(range(case["prefix"]))
    source = _MemorySource(prefix + chunk_bytes.numpy().tobytes() + b"\xee" * 5)
    verifier = BlockVerifier(["f"], [0], scratch_limit=case["scratch_limit"])
    check = ChunkCheck(verifier, sums, "t", (0,) * len(sizes))
    location = Location(0, len(prefix), chunk_bytes.numel(), "")
    read_verified(source, location, tuple(sizes), region, dest_in(storage), check)  # type: ignore[arg-type]
    verifier.close()
    assert torch.equal(storage, want)


@given(case=read_cases())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_verified_reads_write_only_their_region(case: dict[str, Any]) -> None:
    """A verified read of any region of any chunk, into a strided view of a larger tensor, fills
    the view exactly (every block it touched checked) and changes no other byte of the storage."""
    _verified_read(case)


@given(case=column_cases())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_verified_column_reads_write_only_their_region(case: dict[str, Any]) -> None:
    """The same for column slices of many rows, whose blocks and scratch pieces are hashed and
    copied through strided views."""
    _verified_read(case)


def test_verified_reads_take_both_strided_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Narrow columns of many rows take the strided copy out of scratch, one whole block of each
    row the strided hash in place; both stay exact and inside their buffers."""
    built: list[str] = []
    real = blocksums._rows

    def spy(
        arr: np.ndarray, start: int, count: int, width: int, step: int, what: str
    ) -> np.ndarray:
        built.append(what)
        return real(arr, start, count, width, step, what)

    monkeypatch.setattr(blocksums, "_rows", spy)
    base = {
        "dtype": torch.uint8,
        "pads": [(2, 1), (1, 3)],
        "reversed": False,
        "scratch_limit": 16 << 20,
        "prefix": 5,
        "seed": 7,
    }
    # Columns [3, 10) of 64-byte rows, 16-byte blocks: no whole block in a row, all through scratch.
    _verified_read({**base, "sizes": [40, 64], "region": Box((0, 3), (40, 7)), "block": 16})
    assert {
        "pieces of tensor 't' chunk at [0, 0] copied into the destination",
        "pieces of tensor 't' chunk at [0, 0] copied out of scratch",
    } <= set(built)
    # Columns [3, 35): one whole block [16, 32) of each row, hashed in place, evenly spaced.
    built.clear()
    _verified_read({**base, "sizes": [40, 64], "region": Box((0, 3), (40, 32)), "block": 16})
    assert "blocks of tensor 't' chunk at [0, 0]" in built
