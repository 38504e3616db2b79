"""Property tests of the pure arithmetic: boxes, layouts, runs, slabs, file runs,
the coalescing range reader and the JSON value codec.

Every layout test checks the library against an independent model: DTensor's
own ``_split_tensor`` applied to ``torch.arange`` (what each rank really holds)
and an in-memory "save" and "load" that moves elements exactly as the storage
reader moves bytes.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from typing import Any, Sequence

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ucp_dcp.format import RunList, decode_runs, encode_runs
from ucp_dcp.byteio.rangeio import RangeReader
from ucp_dcp.byteio.segments import Segment
from ucp_dcp.core.boxes import Run, row_major_strides, runs, slabs
from ucp_dcp.core.sharding import (
    Box,
    Grid,
    LayoutError,
    _application_order,
    arith_box,
    chunk_box,
    intersect,
    layout_chunks,
    layout_grid,
    placement_from_str,
    placement_to_str,
    tiles,
)
from ucp_dcp.core.values import UnsupportedValueError, decode_value, encode_value

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

Layout = tuple[tuple[int, ...], tuple[Placement, ...]]

# ---------------------------------------------------------------- strategies


@st.composite
def global_shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """1-3 dims, each of size 0..9 (mostly non-empty)."""
    ndim = draw(st.integers(1, 3))
    return tuple(draw(st.integers(0, 9) if draw(st.integers(0, 9)) == 0 else st.integers(1, 9)) for _ in range(ndim))


@st.composite
def placements_for(draw: st.DrawFn, ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    """One placement per mesh dim among Replicate, Shard(d), _StridedShard(d, k)."""
    out: list[Placement] = []
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from(["R", "S", "S", "SS"]))
        if kind == "R":
            out.append(Replicate())
        elif kind == "S":
            out.append(Shard(draw(st.integers(0, ndim - 1))))
        else:
            out.append(_StridedShard(draw(st.integers(0, ndim - 1)), split_factor=draw(st.integers(1, 4))))
    return tuple(out)


@st.composite
def fsdp_tp_layouts(draw: st.DrawFn, ndim: int) -> Layout:
    """FSDP2 + TP: mesh (dp, tp), placements (_StridedShard(d, split_factor=tp), Shard(d))."""
    dp, tp = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    d = draw(st.integers(0, ndim - 1))
    return (dp, tp), (_StridedShard(d, split_factor=tp), Shard(d))


@st.composite
def layouts(draw: st.DrawFn, ndim: int) -> Layout:
    """A random mesh (1-2 dims, sizes 1..4) and placements, or the FSDP2+TP combination."""
    if draw(st.integers(0, 4)) == 0:
        return draw(fsdp_tp_layouts(ndim))
    mesh_ndim = draw(st.integers(1, 2))
    mesh = tuple(draw(st.integers(1, 4)) for _ in range(mesh_ndim))
    return mesh, draw(placements_for(ndim, mesh_ndim))


# ---------------------------------------------------------------- helpers


def coords(mesh: Sequence[int]) -> list[tuple[int, ...]]:
    """Every coordinate of a mesh, row-major."""
    return list(itertools.product(*(range(n) for n in mesh)))


def dtensor_local(g: torch.Tensor, mesh: Sequence[int], coord: Sequence[int], pls: Sequence[Placement]) -> torch.Tensor:
    """What DTensor itself stores at ``coord``: its placements' ``_split_tensor``, left to right.

    (In torch 2.13 ``_StridedShard`` is not a ``Shard`` subclass; both split.)
    """
    local = g
    for m, p in enumerate(pls):
        if isinstance(p, (Shard, _StridedShard)):
            local = p._split_tensor(local, mesh[m], with_padding=False, contiguous=True)[0][coord[m]]
    return local


def box_slices(box: Box, base: Sequence[int] | None = None) -> tuple[slice, ...]:
    """Index of ``box`` (optionally relative to ``base`` offsets)."""
    base = base or (0,) * len(box.offsets)
    return tuple(slice(o - b, o - b + s) for o, s, b in zip(box.offsets, box.sizes, base))


def is_box_of(local: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether ``local`` (values of ``arange``) is ``g[box]`` for some box, in row-major order."""
    if local.numel() == 0:
        return True
    cs = torch.stack(torch.unravel_index(local.reshape(-1), g.shape))
    offs = tuple(int(x) for x in cs.min(dim=1).values)
    sub = g[box_slices(Box(offs, tuple(local.shape)))]
    return sub.shape == local.shape and torch.equal(sub, local)


def coverage(boxes: Sequence[Box], shape: Sequence[int]) -> torch.Tensor:
    """How many boxes hold each element."""
    cov = torch.zeros(tuple(shape), dtype=torch.int64)
    for b in boxes:
        cov[box_slices(b)] += 1
    return cov


def make_dest(sizes: tuple[int, ...], perm: Sequence[int], pads: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A destination view of shape ``sizes`` into a larger, permuted base tensor.

    The base has dims ``sizes[perm[i]]`` padded by ``pads[i]``; the view is
    the unpadded window, permuted back. Returns ``(base, view)``, both filled with -1.
    """
    base_shape = tuple(sizes[p] + lo + hi for p, (lo, hi) in zip(perm, pads))
    base = torch.full(base_shape, -1, dtype=torch.int64)
    win = base[tuple(slice(lo, lo + sizes[p]) for p, (lo, _) in zip(perm, pads))]
    inv = [perm.index(i) for i in range(len(perm))]
    view = win.permute(inv)
    assert tuple(view.shape) == sizes
    return base, view


def simulate_load(
    g: torch.Tensor,
    saved: Sequence[Box],
    target: Box,
    perm: Sequence[int],
    pads: Sequence[tuple[int, int]],
) -> None:
    """Load ``target`` from flat row-major buffers of the ``saved`` chunks, run by run, and check it."""
    bufs = [g[box_slices(s)].contiguous().reshape(-1) for s in saved]
    base, dest = make_dest(target.sizes, perm, pads)
    flat = base.view(-1)  # base is contiguous with storage offset 0: flat == its storage
    written = torch.zeros(flat.numel(), dtype=torch.int64)
    covered = 0
    for s, buf in zip(saved, bufs):
        inter = intersect(target, s)
        if inter is None:
            continue
        covered += inter.numel
        region = Box(tuple(o - so for o, so in zip(inter.offsets, s.offsets)), inter.sizes)
        dview = dest[box_slices(inter, target.offsets)]
        grid = runs(s.sizes, region, dview.stride(), dview.storage_offset())
        n, it = len(grid), iter(grid)
        rl: list[Run] = list(it)
        assert len(rl) == n
        assert len({r.count for r in rl}) <= 1, "every run has the same length"
        assert sum(r.count for r in rl) == inter.numel
        for r in rl:
            assert r.count > 0
            assert 0 <= r.src and r.src + r.count <= s.numel, f"run {r} leaves saved chunk {s}"
            assert 0 <= r.dst and r.dst + r.count <= flat.numel(), f"run {r} leaves the destination storage"
            flat[r.dst : r.dst + r.count] = buf[r.src : r.src + r.count]
            written[r.dst : r.dst + r.count] += 1
        if n > 1:
            # Maximality: the first two runs step along the innermost cut dim;
            # they are never adjacent in both the chunk and the destination.
            c = rl[0].count
            assert not (rl[1].src - rl[0].src == c and rl[1].dst - rl[0].dst == c), rl[:2]
    assert covered == target.numel
    assert torch.equal(dest, g[box_slices(target)])
    # Exactly the destination view's elements were written, each once.
    expected = torch.zeros(flat.numel(), dtype=torch.int64)
    pos = torch.arange(flat.numel()).view(base.shape)
    _, posview = make_dest(target.sizes, perm, pads)  # same geometry, to find positions
    pos_view = pos.as_strided(posview.shape, posview.stride(), posview.storage_offset())
    expected[pos_view.reshape(-1)] = 1
    assert torch.equal(written, expected)


def try_chunks(shape: tuple[int, ...], layout: Layout) -> list[Box] | None:
    """``layout_chunks`` or None for a layout that is not box-shaped."""
    try:
        return layout_chunks(shape, *layout)
    except LayoutError:
        return None


# ---------------------------------------------------------------- layouts


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_layout_chunks_match_dtensor_and_tile(data: st.DataObject) -> None:
    """A layout's boxes are exactly what DTensor stores on each rank, are disjoint and
    cover the tensor; LayoutError is raised iff some rank's shard is not a box."""
    shape = data.draw(global_shapes())
    mesh, pls = data.draw(layouts(len(shape)))
    g = torch.arange(math.prod(shape)).reshape(shape)
    locals_ = {c: dtensor_local(g, mesh, c, pls) for c in coords(mesh)}
    boxes = try_chunks(shape, (mesh, pls))
    if boxes is None:
        assert not all(is_box_of(t, g) for t in locals_.values()), "LayoutError for a box-shaped layout"
        return
    for c, t in locals_.items():
        box = chunk_box(shape, mesh, c, pls)
        assert box.sizes == tuple(t.shape)
        if t.numel():
            assert torch.equal(g[box_slices(box)], t), f"coord {c}: box {box} is not DTensor's shard"
            assert box in boxes
    assert len(set(boxes)) == len(boxes)
    assert all(b.numel > 0 for b in boxes)
    if math.prod(shape):
        assert bool((coverage(boxes, shape) == 1).all()), "saved chunks overlap or leave holes"
    else:
        assert boxes == []
    # Placement names round-trip (the index stores them as strings).
    assert tuple(placement_from_str(placement_to_str(p)) for p in pls) == tuple(pls)


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_fsdp_tp_strided_layout_is_box_shaped(data: st.DataObject) -> None:
    """FSDP2+TP (_StridedShard(d, split_factor=tp), Shard(d)) on mesh (dp, tp) always gives
    boxes, ordered tp-major along d, matching DTensor's shards."""
    shape = data.draw(global_shapes())
    mesh, pls = data.draw(fsdp_tp_layouts(len(shape)))
    boxes = layout_chunks(shape, mesh, pls)  # must not raise
    g = torch.arange(math.prod(shape)).reshape(shape)
    for c in coords(mesh):
        t = dtensor_local(g, mesh, c, pls)
        if t.numel():
            assert torch.equal(g[box_slices(chunk_box(shape, mesh, c, pls))], t)
    if math.prod(shape):
        assert bool((coverage(boxes, shape) == 1).all())


def test_fsdp_tp_docstring_example() -> None:
    """The torch docstring example: 8 rows, mesh (2, 2), (SS(0, 2), S(0)) -> rows 0-1, 4-5, 2-3, 6-7."""
    pls = (_StridedShard(0, split_factor=2), Shard(0))
    got = [chunk_box((8, 8), (2, 2), c, pls) for c in coords((2, 2))]
    assert [b.offsets for b in got] == [(0, 0), (4, 0), (2, 0), (6, 0)]
    assert all(b.sizes == (2, 8) for b in got)


def test_non_box_layout_raises() -> None:
    """A strided layout whose shards interleave (S(0) then SS(0, 2)) raises LayoutError naming it."""
    with pytest.raises(LayoutError, match=r"does not split it into disjoint boxes"):
        layout_chunks((8,), (2, 2), (Shard(0), _StridedShard(0, split_factor=2)))


@settings(max_examples=200, **SETTINGS)
@given(data=st.data())
def test_layout_grid_matches_layout_chunks(data: st.DataObject) -> None:
    """The vectorised grid gives DTensor's boxes in layout_chunks' order; overlap queries
    and offset lookups agree with testing every chunk; mesh_lin names a holder of each chunk."""
    shape = data.draw(global_shapes())
    mesh, pls = data.draw(layouts(len(shape)))
    boxes = try_chunks(shape, (mesh, pls))
    if boxes is None:
        with pytest.raises(LayoutError):
            layout_grid(shape, mesh, pls)
        return
    grid = layout_grid(shape, mesh, pls)
    assert grid.boxes() == boxes
    assert grid.n_chunks == len(boxes)
    for k, b in enumerate(boxes):
        assert grid.find(b.offsets) == k
    if grid.mesh_lin is not None:  # the arithmetic path: chunk k is held at these shard coordinates
        shard_dims = [m for m, p in enumerate(pls) if not isinstance(p, Replicate)]
        for k, b in enumerate(boxes):
            rest, coord = int(grid.mesh_lin[k]), [0] * len(mesh)
            for m in reversed(shard_dims):
                coord[m], rest = rest % mesh[m], rest // mesh[m]
            assert chunk_box(shape, mesh, coord, pls) == b
    for _ in range(3):
        offs = tuple(data.draw(st.integers(0, max(0, n - 1))) for n in shape)
        sizes = tuple(data.draw(st.integers(0, n - o)) for o, n in zip(offs, shape))
        target = Box(offs, sizes)
        want = sorted(k for k, b in enumerate(boxes) if target.numel and intersect(target, b) is not None)
        assert sorted(grid.overlapping(target).tolist()) == want


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_fsdp_tp_layouts_take_the_arithmetic_path(data: st.DataObject) -> None:
    """FSDP2+TP layouts of evenly split TP dims never fall back to DTensor's per-rank arithmetic."""
    shape = data.draw(global_shapes())
    mesh, pls = data.draw(fsdp_tp_layouts(len(shape)))
    d = pls[0].dim
    assume(shape[d] % mesh[1] == 0)
    assert _application_order(shape, mesh, pls) is not None
    assert layout_grid(shape, mesh, pls).boxes() == layout_chunks(shape, mesh, pls)


def test_layout_grid_at_16384_ranks_is_fast_and_exact() -> None:
    """A 70B-class FSDP+TP weight at 16384 ranks: no per-rank enumeration, spot-checked against DTensor."""
    mesh, pls = (2048, 8), (_StridedShard(0, split_factor=8), Shard(0))
    grid = layout_grid((28672, 8192), mesh, pls)
    assert grid.n_chunks == 8 * 1792  # 3584 rows per TP rank, 2 rows for each of 1792 DP ranks
    for coord in [(0, 0), (5, 3), (1791, 7), (1792, 2), (2047, 7)]:
        box = chunk_box((28672, 8192), mesh, coord, pls)
        if box.numel:
            assert grid.box(grid.find(box.offsets)) == box
        else:
            assert not grid.overlapping(Box(box.offsets, (1, 1))).size or box.offsets[0] >= 28672


def test_grid_from_boxes_rejects_non_grids() -> None:
    """Explicit chunk lists that do not form a grid get None (the planner then tests every chunk)."""
    assert Grid.from_boxes([Box((0, 0), (2, 4)), Box((2, 0), (2, 2)), Box((2, 2), (2, 2))], (4, 4)) is None
    g = Grid.from_boxes([Box((2, 0), (2, 4)), Box((0, 0), (2, 4))], (4, 4))
    assert g is not None and g.boxes() == [Box((2, 0), (2, 4)), Box((0, 0), (2, 4))]


# ---------------------------------------------------------------- runs


@st.composite
def dest_geometry(draw: st.DrawFn, ndim: int, mode: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Permutation and per-dim padding of the destination base tensor for ``mode``."""
    perm = list(range(ndim))
    if mode in ("permuted", "permuted+narrowed"):
        perm = draw(st.permutations(perm))
    pads = [(0, 0)] * ndim
    if mode in ("narrowed", "permuted+narrowed"):
        pads = [(draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(ndim)]
    return perm, pads


@settings(max_examples=200, **SETTINGS)
@given(data=st.data(), mode=st.sampled_from(["contiguous", "narrowed", "permuted", "permuted+narrowed"]))
def test_save_then_load_any_layout_via_runs(data: st.DataObject, mode: str) -> None:
    """Saving under one layout and loading every target box of another, run by run,
    reproduces ``global[box]`` exactly, for contiguous, narrowed and permuted destinations."""
    shape = data.draw(global_shapes())
    saved = try_chunks(shape, data.draw(layouts(len(shape)), label="saved"))
    assume(saved is not None)
    target_layout = data.draw(st.one_of(st.just(None), layouts(len(shape))), label="target")
    if target_layout is None:  # a plain tensor: one box, the whole tensor
        targets = [Box((0,) * len(shape), shape)] if math.prod(shape) else []
    else:
        targets = try_chunks(shape, target_layout)
        assume(targets is not None)
    assert saved is not None and targets is not None
    if math.prod(shape):
        assert bool((coverage(saved, shape) == 1).all())
    g = torch.arange(math.prod(shape)).reshape(shape)
    for t in targets:
        perm, pads = data.draw(dest_geometry(len(shape), mode))
        simulate_load(g, saved, t, perm, pads)


def test_transposed_destination_gives_single_element_runs() -> None:
    """A ``.t()`` destination is contiguous in no dim: runs are single elements, and correct."""
    g = torch.arange(12).reshape(3, 4)
    base = torch.full((4, 3), -1, dtype=torch.int64)
    dest = base.t()
    grid = runs((3, 4), Box((0, 0), (3, 4)), dest.stride(), dest.storage_offset())
    n, it = len(grid), iter(grid)
    rl = list(it)
    assert n == 12 and all(r.count == 1 for r in rl)
    buf = g.reshape(-1)
    for r in rl:
        base.view(-1)[r.dst] = buf[r.src]
    assert torch.equal(dest, g)


def test_whole_chunk_into_contiguous_dest_is_one_run() -> None:
    """Reading a whole saved chunk into a contiguous tensor is one run of all its elements."""
    grid = runs((2, 3, 5), Box((0, 0, 0), (2, 3, 5)), row_major_strides((2, 3, 5)), 7)
    n, it = len(grid), iter(grid)
    assert n == 1 and list(it) == [Run(0, 7, 30)]


def test_empty_region_and_scalar() -> None:
    """An empty region yields no run; a 0-d region is one single-element run."""
    grid = runs((4, 4), Box((1, 1), (0, 3)), (4, 1), 0)
    n, it = len(grid), iter(grid)
    assert n == 0 and list(it) == []
    grid = runs((), Box((), ()), (), 5)
    n, it = len(grid), iter(grid)
    assert n == 1 and list(it) == [Run(0, 5, 1)]


# ---------------------------------------------------------------- slabs


@settings(max_examples=300, **SETTINGS)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 300),
)
def test_slabs_partition_box_within_budget(lengths: tuple[int, ...], itemsize: int, budget: int) -> None:
    """Slabs lie inside the box, are disjoint, cover it exactly, and each holds at most
    ``budget`` bytes, except that a single element larger than the budget is one slab."""
    out = list(slabs(lengths, itemsize, budget))
    assert out, "slabs yields at least one (possibly empty) slab"
    cov = torch.zeros(lengths, dtype=torch.int64)
    for offs, sizes in out:
        assert len(offs) == len(sizes) == len(lengths)
        assert all(0 <= o and o + s <= n for o, s, n in zip(offs, sizes, lengths)), (offs, sizes)
        numel = math.prod(sizes)
        if itemsize <= budget:
            assert numel * itemsize <= budget, (offs, sizes)
        else:
            assert numel <= 1, (offs, sizes)
        cov[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] += 1
    assert bool((cov == 1).all()), "slabs overlap or leave holes"
    if math.prod(lengths) * itemsize <= budget:
        assert out == [((0,) * len(lengths), lengths)]


# ---------------------------------------------------------------- file runs


@settings(max_examples=300, **SETTINGS)
@given(xs=st.lists(st.integers(-50, 50), max_size=40))
def test_encode_decode_runs_roundtrip(xs: list[int]) -> None:
    """``decode_runs(encode_runs(xs)) == xs``; runs are [start, count >= 1, step]."""
    enc = encode_runs(xs)
    assert decode_runs(enc, "test") == xs
    assert all(len(r) == 3 and r[1] >= 1 for r in enc)
    assert len(enc) <= max(1, len(xs))


@settings(max_examples=200, **SETTINGS)
@given(start=st.integers(-100, 100), step=st.integers(-5, 5), count=st.integers(1, 200))
def test_arithmetic_progression_is_one_run(start: int, step: int, count: int) -> None:
    """An arithmetic progression (FSDP: chunk i in file i) encodes to a single run."""
    xs = [start + i * step for i in range(count)]
    assert encode_runs(xs) == [[start, count, step if count > 1 else 0]]
    assert decode_runs(encode_runs(xs), "t") == xs


@settings(max_examples=200, **SETTINGS)
@given(xs=st.lists(st.integers(-50, 50), max_size=60))
def test_run_list_indexes_like_a_list(xs: list[int]) -> None:
    """RunList (the lazy form of a compact file list) indexes, iterates and bounds like the list."""
    rl = RunList(encode_runs(xs))
    assert len(rl) == len(xs) and list(rl) == xs
    assert [rl[i] for i in range(-len(xs), len(xs))] == xs[-len(xs):] + xs if xs else True
    if xs:
        assert (rl.min(), rl.max()) == (min(xs), max(xs))
    with pytest.raises(IndexError):
        rl[len(xs)]


# ---------------------------------------------------------------- range reader


def pattern(file: int, n: int) -> bytes:
    """Known content of test file ``file``: byte i is a function of (file, i)."""
    return bytes(((i * 7 + file * 13 + (i >> 8)) % 251) for i in range(n))


@pytest.fixture(scope="module")
def pattern_files(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, bytes]]:
    """Two files of known bytes."""
    d = tmp_path_factory.mktemp("rangeio")
    out = []
    for i, n in enumerate((3000, 1200)):
        p = os.path.join(d, f"f{i}.bin")
        data = pattern(i, n)
        with open(p, "wb") as f:
            f.write(data)
        out.append((p, data))
    return out


@settings(max_examples=150, **SETTINGS)
@given(
    data=st.data(),
    gap=st.integers(0, 64),
    max_req=st.integers(1, 400),
    threads=st.integers(1, 3),
)
def test_range_reader_plan_and_read(
    pattern_files: list[tuple[str, bytes]], data: st.DataObject, gap: int, max_req: int, threads: int
) -> None:
    """Every segment's buffer receives exactly its bytes; requests never exceed
    ``max_request_bytes``; gaps read into scratch never exceed ``gap_bytes``; a request's
    buffers account for all of its bytes."""
    paths = [p for p, _ in pattern_files]
    segs: list[Segment] = []
    for _ in range(data.draw(st.integers(0, 25))):
        f = data.draw(st.integers(0, len(paths) - 1))
        size = len(pattern_files[f][1])
        off = data.draw(st.integers(0, size))
        n = data.draw(st.integers(0, min(size - off, 600)))
        segs.append(Segment(f, off, memoryview(bytearray(n))))
    with RangeReader(paths, threads=threads, gap_bytes=gap, max_request_bytes=max_req) as reader:
        plan = reader.plan(segs)
        dest_objs = {id(s.dest.obj) for s in segs}
        for r in plan:
            assert 0 < r.nbytes <= max_req
            assert sum(len(b) for b in r.bufs) == r.nbytes
            assert r.offset + r.nbytes <= len(pattern_files[r.file][1])
            for b in r.bufs:
                if id(b.obj) not in dest_objs:  # a gap, landing in scratch
                    assert 0 < len(b) <= gap
        assert sum(r.nbytes for r in plan) >= sum(len(s.dest) for s in segs)
        reader.read(segs)
        assert reader.stats.bytes == sum(r.nbytes for r in plan)
    for s in segs:
        want = pattern_files[s.file][1][s.offset : s.offset + len(s.dest)]
        assert bytes(s.dest) == want, (s.file, s.offset, len(s.dest))


def test_range_reader_coalesces_neighbours(pattern_files: list[tuple[str, bytes]]) -> None:
    """Neighbouring segments within ``gap_bytes`` become one call; farther ones do not."""
    path, data = pattern_files[0]
    bufs = [bytearray(10) for _ in range(3)]
    segs = [Segment(0, 0, memoryview(bufs[0])), Segment(0, 15, memoryview(bufs[1])), Segment(0, 100, memoryview(bufs[2]))]
    with RangeReader([path], gap_bytes=5) as reader:
        plan = reader.plan(segs)
        assert [(r.offset, r.nbytes) for r in plan] == [(0, 25), (100, 10)]
        reader.read(segs)
    assert bytes(bufs[0]) == data[0:10] and bytes(bufs[1]) == data[15:25] and bytes(bufs[2]) == data[100:110]


def test_range_reader_short_file_names_it(tmp_path: Any) -> None:
    """Reading past the end of a file raises EOFError naming the file."""
    p = tmp_path / "short.bin"
    p.write_bytes(b"x" * 10)
    with RangeReader([str(p)]) as reader:
        with pytest.raises(EOFError, match=re.escape(str(p)) + ".*truncated"):
            reader.read([Segment(0, 5, memoryview(bytearray(10)))])


# ---------------------------------------------------------------- values

_TENSOR_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@st.composite
def small_tensors(draw: st.DrawFn) -> torch.Tensor:
    """A small CPU tensor (0-3 dims, possibly empty) of a random dtype, random bits."""
    dtype = draw(st.sampled_from(_TENSOR_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    nbytes = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 0.0, float("nan"), float("inf"), float("-inf")]),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.binary(max_size=8).map(bytearray),
    small_tensors(),
)
keys = st.one_of(
    st.text(max_size=5),
    st.integers(-5, 5),
    st.booleans(),
    st.just("__ucp__"),
    st.tuples(st.integers(0, 3), st.text(max_size=2)),
)
values_tree = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=5), inner, max_size=4),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=15,
)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact structural equality: same types at every level, floats bit-for-bit
    (nan, -0.0), tensors by dtype, shape and bytes, dict keys with their types."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        if a.numel():
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert len(a) == len(b), path
        bk = {(type(k), k): k for k in b}
        for k, v in a.items():
            assert (type(k), k) in bk, f"{path}: key {k!r} ({type(k).__name__}) lost"
            assert_same(v, b[bk[(type(k), k)]], f"{path}[{k!r}]")
    else:
        assert a == b, path


@settings(max_examples=300, **SETTINGS)
@given(v=values_tree)
def test_value_roundtrip_preserves_types(v: Any) -> None:
    """``decode_value(encode_value(v))`` equals ``v`` with every type preserved
    (tuple stays tuple, int keys stay int, bool stays bool, nan/-0.0/inf exact)."""
    data = encode_value(v, "k")
    assert isinstance(data, bytes)
    data.decode("utf-8")  # valid UTF-8 JSON
    assert_same(v, decode_value(data, "k"))


def test_value_roundtrip_examples() -> None:
    """Hand-picked values: optimizer-like param_groups, mixed keys, tagged-looking dicts."""
    v = {
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2], "amsgrad": False}],
        "state": {0: {"step": torch.tensor(3.0)}, 1: {"step": torch.tensor(4.0, dtype=torch.bfloat16)}},
        "__ucp__": "not a tag",
        "nested": {"__ucp__": "tuple", "v": [1, 2]},
        "special": [float("nan"), -0.0, float("-inf"), True, 1, None, b"\x00\xff", ""],
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        (1, "a"): {True: 1, 1.5: "x"},
    }
    out = decode_value(encode_value(v, "root"), "root")
    assert_same(v, out)


# Regression: torch.Size is a tuple subclass and used to come back as a tuple.
def test_torch_size_roundtrips_as_size() -> None:
    """A torch.Size value comes back as a torch.Size (values.py has a "size" tag for it)."""
    out = decode_value(encode_value({"s": torch.Size([2, 3])}, "k"), "k")
    assert type(out["s"]) is torch.Size, f"torch.Size decoded as {type(out['s']).__name__}"


# Regression: numpy.float64 is a float subclass and used to come back as a float.
def test_numpy_float64_scalar_keeps_type() -> None:
    """numpy scalars keep their type like other numpy scalars do (float32, int64 already do)."""
    np = pytest.importorskip("numpy")
    assert type(decode_value(encode_value(np.float32(1.5), "k"), "k")) is np.float32
    assert type(decode_value(encode_value(np.int64(3), "k"), "k")) is np.int64
    out = decode_value(encode_value(np.float64(1.5), "k"), "k")
    assert type(out) is np.float64, f"numpy.float64 decoded as {type(out).__name__}"


def test_builtin_subclasses_are_refused_not_changed() -> None:
    """A namedtuple or an enum would load as a plain tuple or int: refused, naming the key and
    the type; bytearray keeps its type (it came back as bytes)."""
    import collections
    import enum

    point = collections.namedtuple("point", "x y")

    class Mode(enum.IntEnum):
        TRAIN = 1

    class Name(str):
        pass

    for obj, base in ((point(1, 2), "tuple"), (Mode.TRAIN, "int"), (Name("a"), "str")):
        with pytest.raises(UnsupportedValueError, match=rf"^opt\.a\[0\]: a .*{type(obj).__qualname__} "
                           rf"\(a subclass of {base}\) would load as a plain {base}"):
            encode_value({"a": [obj]}, "opt")
    out = decode_value(encode_value({"b": bytearray(b"\x00\xff"), "c": b"\x01"}, "k"), "k")
    assert type(out["b"]) is bytearray and out["b"] == b"\x00\xff" and type(out["c"]) is bytes
    ordered = decode_value(encode_value(collections.OrderedDict([("z", 1), ("a", 2)]), "k"), "k")
    assert list(ordered.items()) == [("z", 1), ("a", 2)]  # a dict subclass loads as a dict, in order


@pytest.mark.parametrize(
    ("obj", "typename"),
    [(object(), "builtins.object"), (lambda: 0, "function"), ({1, 2}, "builtins.set"), (1 + 2j, "builtins.complex")],
)
def test_unsupported_value_names_key_path(obj: Any, typename: str) -> None:
    """An unsupported object anywhere in a value raises UnsupportedValueError naming the key path."""
    nested = {"a": [1, {"b": (2, obj)}]}
    with pytest.raises(UnsupportedValueError, match=re.escape("opt.a[1].b[1]: values of type") + f".*{typename}"):
        encode_value(nested, "opt")
    with pytest.raises(UnsupportedValueError, match=re.escape("opt[3]:")):
        encode_value({3: obj}, "opt")
    with pytest.raises(UnsupportedValueError, match=r"^opt: "):
        encode_value(obj, "opt")


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_arith_box_matches_dtensor(data: st.DataObject) -> None:
    """The per-coordinate arithmetic the planners use agrees with DTensor's on every rank
    (sizes always; offsets wherever the shard is non-empty)."""
    shape = data.draw(global_shapes())
    mesh, pls = data.draw(layouts(len(shape)))
    for c in coords(mesh):
        box = arith_box(shape, mesh, pls, c)
        if box is None:
            assert _application_order(shape, mesh, pls) is None
            continue
        want = chunk_box(shape, mesh, c, pls)
        assert box.sizes == want.sizes
        if box.numel:
            assert box.offsets == want.offsets


# ------------------------------------------------------------ chunks that tile a tensor
@st.composite
def _boxes_in(draw: Any) -> tuple[tuple[int, ...], list[Box]]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        offs = tuple(draw(st.integers(0, n - 1)) for n in shape)
        sizes = tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, offs))
        boxes.append(Box(offs, sizes))
    return shape, boxes


def _split(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Box]:
    """The grid of boxes that cutting each dimension at ``cuts`` makes."""
    per_dim = [list(zip([0, *c], [*c, n])) for n, c in zip(shape, cuts)]
    return [Box(tuple(a for a, _ in cell), tuple(b - a for a, b in cell)) for cell in itertools.product(*per_dim)]


@settings(max_examples=400, deadline=None)
@given(_boxes_in())
def test_tiles_agrees_with_counting_each_element(case: tuple[tuple[int, ...], list[Box]]) -> None:
    """``tiles`` says yes exactly when every element lies in exactly one non-empty box."""
    shape, boxes = case
    counts = {e: 0 for e in itertools.product(*[range(n) for n in shape])}
    for b in boxes:
        for e in itertools.product(*[range(o, o + n) for o, n in zip(b.offsets, b.sizes)]):
            counts[e] += 1
    assert tiles(boxes, shape) == all(c == 1 for c in counts.values()), (shape, boxes)


def test_a_grid_with_a_box_listed_twice_and_one_missing_does_not_tile() -> None:
    """Per dimension the intervals still tile and the count is right: only distinct boxes tell."""
    grid = _split((4, 6), [[2], [3]])
    assert tiles(grid, (4, 6)) and Grid.from_boxes(grid, (4, 6)) is not None
    twice = [grid[0], grid[0], grid[1], grid[2]]
    assert not tiles(twice, (4, 6)) and Grid.from_boxes(twice, (4, 6)) is None


@pytest.mark.parametrize(
    "shape, mesh, pls",
    [
        ((8, 4), (2, 2), (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2))),  # two pending on dim 0
        ((6, 4), (2, 4), (_StridedShard(0, split_factor=4), Shard(0))),  # 6 rows do not split in 4
        ((8, 4), (2, 3), (_StridedShard(0, split_factor=2), Shard(0))),  # split factor 2 not a multiple of 3
        ((8, 4), (2, 2), (Replicate(), Shard(0))),
    ],
)
def test_layouts_outside_the_arithmetic_path_match_dtensor(shape: tuple[int, ...], mesh: tuple[int, ...],
                                                             pls: tuple[Any, ...]) -> None:
    """Strided layouts the vectorised path does not handle go through DTensor's own arithmetic:
    the same boxes, or the same LayoutError."""
    if not isinstance(pls[0], Replicate):
        assert _application_order(shape, mesh, pls) is None
    boxes = try_chunks(shape, (mesh, pls))
    if boxes is None:
        with pytest.raises(LayoutError):
            layout_grid(shape, mesh, pls)
    else:
        assert layout_grid(shape, mesh, pls).boxes() == boxes


def test_application_order_of_a_dim_the_tensor_lacks_or_another_placement_is_none() -> None:
    assert _application_order((4,), (2,), (Shard(1),)) is None
    assert _application_order((4,), (2,), (Placement(),)) is None


def test_grid_find_offsets_that_start_no_chunk() -> None:
    grid = layout_grid((8, 4), (2,), (Shard(0),))
    assert grid.find((4, 0)) == 1 and grid.find((3, 0)) is None and grid.find((9, 0)) is None


def test_placement_to_str_of_an_unknown_placement() -> None:
    with pytest.raises(LayoutError, match=r"^unsupported DTensor placement"):
        placement_to_str(Placement())


def test_object_arrays_and_nested_tensor_subclasses_are_refused() -> None:
    import numpy as np

    with pytest.raises(UnsupportedValueError, match=r"^opt\.a: numpy arrays of Python objects cannot be saved$"):
        encode_value({"a": np.array([1, "x"], dtype=object)}, "opt")

    class Tagged(torch.Tensor):
        pass

    t = torch.Tensor._make_subclass(Tagged, torch.zeros(2))
    with pytest.raises(UnsupportedValueError, match=r"^opt\.a\[0\]: a Tagged nested inside a non-tensor value cannot "
                       r"be saved; put it directly in the state dict so it is saved as a tensor$"):
        encode_value({"a": [t]}, "opt")
