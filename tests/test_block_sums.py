"""Block checksums: written with every tensor chunk, checked by every load that reads it.

* ``BlockHasher`` gives the xxh3-64 of every block however the stream is cut.
* Property: a load of any box of a saved tensor (row slices, column slices,
  any box; into contiguous, strided or cast targets) detects any single
  flipped byte it reads, naming file, tensor, chunk, block and rank; and it
  needs no byte outside the blocks it touches: every other byte of the
  tensor's chunks may be garbage and the load is still exact. Shapes,
  dtypes, chunkings and block sizes (some not multiples of the element
  size) are random; small blocks put many block boundaries in small tensors.
* A chunk read whole is checked against its entry's xxh3-64 in one hash; a flipped byte is
  still named by its block, a wrong entry checksum by the chunk.
* Checkpoints without block checksums (written before them) still load, and
  a verified load checks them chunk by chunk; a damaged block-checksum entry
  is named by loads and by ``verify``.
* ``Checkpoint``, ``load_state_dict``, ``load_into_module`` and the command
  line verify by default; ``verify=False`` / ``--no-verify`` opt out.
* ``RangeReader`` runs a segment's ``done`` callback once its last byte is
  read, also when the segment is split across requests.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp.byteio.blocksums
import ucp_dcp.byteio.datafile
from dist_utils import bit_equal
from test_integrity import flip
from ucp_dcp import (
    ReadOptions,
    Checkpoint,
    ChecksumError,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    load_into_module,
    load_state_dict,
)
from ucp_dcp.byteio.blocksums import BlockHasher
from ucp_dcp.errors import InvalidArgumentError
from ucp_dcp.byteio.rangeio import HOOKED_REQUEST_BYTES, RangeReader
from ucp_dcp.byteio.segments import Segment
from ucp_dcp.core.pieces import Piece, TensorPieces
from ucp_dcp.byteio.rangeio import read_header
from ucp_dcp.format import BLOCK_SUMS_ENTRY
from ucp_dcp.sources import NativeSource, SourceOptions
from ucp_dcp.tools.cli import main as cli_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8]


# ---------------------------------------------------------------- helpers


@contextmanager
def block_size(n: int) -> Iterator[None]:
    """Data files written inside get blocks of ``n`` bytes (the reader takes the size from the header)."""
    old = ucp_dcp.byteio.datafile.BLOCK_BYTES
    ucp_dcp.byteio.datafile.BLOCK_BYTES = n
    try:
        yield
    finally:
        ucp_dcp.byteio.datafile.BLOCK_BYTES = old


def full_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g, dtype=torch.int64).to(dtype)


def chunk_boxes(shape: tuple[int, ...], dim: int, cuts: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes that cut ``shape`` along ``dim`` at ``cuts`` (sorted, inside the dim)."""
    bounds = [0, *cuts, shape[dim]]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            offs = tuple(a if d == dim else 0 for d in range(len(shape)))
            sizes = tuple(b - a if d == dim else n for d, n in enumerate(shape))
            out.append((offs, sizes))
    return out


def view_of(t: torch.Tensor, offs: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offs, sizes)):
        t = t.narrow(d, o, s)
    return t


def save_pieces(path: str, full: torch.Tensor, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    pieces = [Piece("w", tuple(full.shape), o, view_of(full, o, s).clone()) for o, s in boxes]
    dcp.save({"p": TensorPieces(pieces)}, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner(), no_dist=True)


def target(sizes: tuple[int, ...], dtype: torch.dtype, mode: str) -> torch.Tensor:
    if mode == "cast":
        return torch.zeros(sizes, dtype=torch.float64)
    if mode == "strided":  # storage in reversed dimension order: every element a separate run
        return torch.zeros(sizes[::-1], dtype=dtype).permute(*reversed(range(len(sizes))))
    return torch.zeros(sizes, dtype=dtype)


def load_box(path: str, shape: tuple[int, ...], offs: tuple[int, ...], dest: torch.Tensor, **reader_kw: Any) -> UCPStorageReader:
    reader = UCPStorageReader(path, options=ReadOptions(**reader_kw))
    planner = UCPLoadPlanner(allow_dtype_cast=True)
    dcp.load({"p": TensorPieces([Piece("w", shape, offs, dest)])}, storage_reader=reader, planner=planner, no_dist=True)
    return reader


def unwrap(e: BaseException) -> BaseException:
    """The rank's own error out of DCP's CheckpointException."""
    if isinstance(e, CheckpointException):
        ((err, _),) = e.failures.values()
        return err
    return e


def overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def read_elements(chunk: tuple[tuple[int, ...], tuple[int, ...]], box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    """Row-major positions inside ``chunk`` of the elements of ``box`` that it holds."""
    ov = overlap(chunk, box)
    if ov is None:
        return torch.zeros(0, dtype=torch.int64)
    pos = torch.arange(math.prod(chunk[1]), dtype=torch.int64).view(chunk[1])
    local = tuple(o - c for o, c in zip(ov[0], chunk[0]))
    return view_of(pos, local, ov[1]).reshape(-1)


# ---------------------------------------------------------------- the hasher


@given(data=st.binary(max_size=3000), block=st.sampled_from([1, 7, 64, 4096]), cuts=st.lists(st.integers(0, 3000), max_size=6))
def test_block_hasher_is_blockwise_xxh3_however_the_stream_is_cut(data: bytes, block: int, cuts: list[int]) -> None:
    h = BlockHasher(len(data), block)
    bounds = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    for a, b in zip(bounds, bounds[1:]):
        h.update(data[a:b])
    want = [xxhash.xxh3_64_intdigest(data[i : i + block]) for i in range(0, len(data), block)]
    assert h.digests().tolist() == want


def test_block_hasher_fed_too_few_bytes_refuses_its_digests() -> None:
    h = BlockHasher(10, 4)
    h.update(b"abcde")  # one block whole, one begun: blocks 0 and 1 of 3
    with pytest.raises(InvalidArgumentError, match=r"^block hasher fed 2 of 3 blocks$"):
        h.digests()


# ---------------------------------------------------------------- the property


BOX_KINDS = ["rows", "columns", "any", "all"]


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    split_dim = draw(st.integers(0, ndim - 1))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, shape[split_dim] - 1)), max_size=3))))
    cuts = [c for c in cuts if 0 < c < shape[split_dim]]
    kind = draw(st.sampled_from(BOX_KINDS))
    offs, sizes = [], []
    for d, n in enumerate(shape):
        whole = kind == "all" or (kind == "rows" and d > 0) or (kind == "columns" and d < ndim - 1)
        if whole:
            offs.append(0)
            sizes.append(n)
        else:
            o = draw(st.integers(0, n - 1))
            offs.append(o)
            sizes.append(draw(st.integers(1, n - o)))
    return {
        "shape": shape, "dtype": dtype, "chunks": chunk_boxes(shape, split_dim, cuts),
        "box": (tuple(offs), tuple(sizes)), "mode": draw(st.sampled_from(["plain", "strided", "cast"])),
        "block": draw(st.sampled_from([8, 24, 64, 100, 4096])), "seed": draw(st.integers(0, 2**16)),
        # Runs read in place are hashed piece by piece as their reads land: pieces of this many blocks.
        "piece": draw(st.sampled_from([1, 2, 5, None])),
    }


@contextmanager
def piece_blocks(n: int | None, block: int) -> Iterator[None]:
    """Loads inside cut runs read in place into pieces of ``n`` blocks (None: the default size)."""
    old = ucp_dcp.byteio.blocksums._PIECE
    ucp_dcp.byteio.blocksums._PIECE = old if n is None else n * block
    try:
        yield
    finally:
        ucp_dcp.byteio.blocksums._PIECE = old


@given(case=cases(), pick=st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_load_detects_any_flipped_byte_it_reads_and_needs_no_other_byte(case: dict[str, Any], pick: random.Random) -> None:
    """Any single flipped byte inside the tensor data a load reads fails that load with a
    ChecksumError naming file, tensor, chunk, block and rank; garbage in every byte of the
    tensor's chunks outside the blocks the load touches does not change the load at all.
    However runs are cut into pieces hashed as they land, every touched block is hashed once."""
    with piece_blocks(case["piece"], case["block"]):
        _check_flips_and_garbage(case, pick)


def _check_flips_and_garbage(case: dict[str, Any], pick: random.Random) -> None:
    shape, dtype, chunks, box, mode, block = (case[k] for k in ("shape", "dtype", "chunks", "box", "mode", "block"))
    full = full_tensor(shape, dtype, case["seed"])
    want = view_of(full, *box)
    want = want.double() if mode == "cast" else want
    es = dtype.itemsize
    with tempfile.TemporaryDirectory() as d:
        with block_size(block):
            save_pieces(d, full, chunks)
        src = NativeSource.open(d, SourceOptions())
        locs = {c[0]: src.locate("w", src.chunk_index("w", c[0], None)) for c in chunks}
        path = src.paths[0]
        assert read_header(path).block_sums.block == block

        # Intact: exact, and every byte hashed lies in a block the load touches.
        dest = target(box[1], dtype, mode)
        reader = load_box(d, shape, box[0], dest)
        assert bit_equal(dest, want)
        touched = {c: read_elements(c, box) for c in chunks}
        blocks = {c: {b for i in t.tolist() for b in range(i * es // block, ((i + 1) * es - 1) // block + 1)}
                  for c, t in touched.items()}
        nbytes = {c: locs[c[0]].nbytes for c in chunks}
        # Every block the load touches is hashed once, and no other.
        assert reader.last_load.verified_bytes == sum(
            sum(min(block, nbytes[c] - k * block) for k in ks) for c, ks in blocks.items()
        )

        # Any byte the load reads, flipped: the load fails naming it.
        c = pick.choice([c for c in chunks if len(touched[c])])
        elem = pick.choice(touched[c].tolist())
        byte = elem * es + pick.randrange(es)
        loc = locs[c[0]]
        mask = 1 << pick.randrange(8)
        flip(path, loc.start + byte, mask)
        with pytest.raises(BaseException) as ei:
            load_box(d, shape, box[0], target(box[1], dtype, mode))
        err = unwrap(ei.value)
        assert isinstance(err, ChecksumError), err
        k = byte // block
        assert err.path == path and err.rank == 0
        assert err.what == (f"tensor 'w' chunk at {list(c[0])}, block {k} (bytes [{k * block}, "
                            f"{min(k * block + block, loc.nbytes)}) of the chunk)")
        assert err.expected != err.actual
        dest = target(box[1], dtype, mode)
        load_box(d, shape, box[0], dest, verify=False)  # opted out: loads without looking
        flip(path, loc.start + byte, mask)  # undone

        # Every byte of the tensor's chunks outside the touched blocks, garbage: still exact.
        raw = bytearray(Path(path).read_bytes())
        for c in chunks:
            lc = locs[c[0]]
            keep = np.zeros(lc.nbytes, dtype=bool)
            for kb in blocks[c]:
                keep[kb * block : kb * block + block] = True
            region = np.frombuffer(raw, dtype=np.uint8, count=lc.nbytes, offset=lc.start).copy()
            region[~keep] ^= 0xA5
            raw[lc.start : lc.start + lc.nbytes] = region.tobytes()
        Path(path).write_bytes(bytes(raw))
        dest = target(box[1], dtype, mode)
        load_box(d, shape, box[0], dest)
        assert bit_equal(dest, want)


# ---------------------------------------------------------------- compatibility and damage


def save_plain(path: Path, sd: dict[str, Any]) -> None:
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner(), no_dist=True)


@pytest.fixture()
def sd() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(64, 300, generator=g), "b": torch.randn(7, generator=g),
                      "e": torch.zeros(0, 5)}, "step": 4}


def blank(sd: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}


def test_checkpoints_without_block_sums_load_and_are_checked_whole(
    tmp_path: Path, sd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint written before block checksums (no entry, no metadata) loads bit-exactly;
    a verified load checks its chunks whole and names a flipped byte's chunk; verify=False does not."""
    monkeypatch.setattr(ucp_dcp.byteio.datafile, "has_block_sums", lambda meta, nbytes: False)
    path = tmp_path / "old"
    save_plain(path, sd)
    monkeypatch.undo()
    src = NativeSource.open(str(path), SourceOptions())
    h = read_header(src.paths[0])
    assert h.block_sums is None and BLOCK_SUMS_ENTRY not in h.ranges
    out = blank(sd)
    reader = UCPStorageReader(path)
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
    assert bit_equal(out["model"]["w"], sd["model"]["w"]) and out["step"] == 4
    assert reader.last_load.verified_bytes == sd["model"]["w"].nbytes + sd["model"]["b"].nbytes
    loc = src.locate("model.w", 0)
    flip(src.paths[0], loc.start + 12345, 0x10)
    with pytest.raises(BaseException) as ei:
        dcp.load(blank(sd), storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(), no_dist=True)
    err = unwrap(ei.value)
    assert isinstance(err, ChecksumError) and err.what == "tensor 'model.w' chunk at [0, 0]" and err.expected == loc.xxh3
    dcp.load(blank(sd), storage_reader=UCPStorageReader(path, options=ReadOptions(verify=False)), planner=UCPLoadPlanner(), no_dist=True)
    with pytest.raises(ChecksumError, match="tensor 'model.w' chunk at"):
        load_state_dict(path)


def test_a_whole_chunk_is_checked_against_its_entry_checksum(tmp_path: Path, sd: dict[str, Any]) -> None:
    """A chunk read whole is hashed once against its entry's xxh3-64 (not block by block): a
    flipped byte is still named by its block, and an entry checksum that disagrees with blocks
    that all match is named for the chunk."""
    path = tmp_path / "ck"
    save_plain(path, sd)
    src = NativeSource.open(str(path), SourceOptions())
    loc = src.locate("model.w", 0)
    reader = UCPStorageReader(path)
    out = blank(sd)
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
    assert bit_equal(out["model"]["w"], sd["model"]["w"])
    assert reader.last_load.verified_bytes == sd["model"]["w"].nbytes + sd["model"]["b"].nbytes

    flip(src.paths[0], loc.start + 9000, 0x04)
    with pytest.raises(BaseException) as ei:
        dcp.load(blank(sd), storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(), no_dist=True)
    err = unwrap(ei.value)
    assert isinstance(err, ChecksumError) and err.what == "tensor 'model.w' chunk at [0, 0], block 2 (bytes [8192, 12288) of the chunk)"
    flip(src.paths[0], loc.start + 9000, 0x04)  # undone

    # The entry's recorded checksum changed in the header (same length): every block matches.
    raw = Path(src.paths[0]).read_bytes()
    assert loc.xxh3 is not None and raw.count(loc.xxh3.encode()) == 1
    other = f"{int(loc.xxh3, 16) ^ 1:016x}"
    Path(src.paths[0]).write_bytes(raw.replace(loc.xxh3.encode(), other.encode()))
    with pytest.raises(BaseException) as ei:
        dcp.load(blank(sd), storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(), no_dist=True)
    err = unwrap(ei.value)
    assert isinstance(err, ChecksumError) and err.what == "tensor 'model.w' chunk at [0, 0]"
    assert (err.expected, err.actual) == (other, loc.xxh3)


def test_a_damaged_block_sum_entry_is_named(tmp_path: Path, sd: dict[str, Any]) -> None:
    """A flipped byte in the block checksums: loads fail naming them, verify reports them."""
    path = tmp_path / "ck"
    save_plain(path, sd)
    src = NativeSource.open(str(path), SourceOptions())
    rec = read_header(src.paths[0]).block_sums
    assert rec is not None and rec.nbytes == 8 * (-(-64 * 300 * 4 // 4096) + 1)
    flip(src.paths[0], rec.start + 5, 0x01)
    with pytest.raises(ChecksumError, match="the block checksums"):
        load_state_dict(path)
    with Checkpoint(path) as ck:
        problems = ck.verify()
    assert len(problems) == 1 and "the block checksums" in problems[0] and src.paths[0] in problems[0]
    assert load_state_dict(path, options=ReadOptions(verify=False))["step"] == 4


def test_single_process_tools_verify_by_default(tmp_path: Path, sd: dict[str, Any]) -> None:
    """Checkpoint.read_tensor, load_state_dict, load_into_module and the CLI (diff, export-hf,
    convert) fail on a flipped byte by default and read it with verify=False / --no-verify."""
    path = tmp_path / "ck"
    save_plain(path, sd)
    good = tmp_path / "good"
    save_plain(good, sd)
    src = NativeSource.open(str(path), SourceOptions())
    loc = src.locate("model.w", 0)
    flip(src.paths[0], loc.start + 40000, 0x80)
    with Checkpoint(path) as ck:
        with pytest.raises(ChecksumError, match=r"tensor 'model.w' chunk at \[0, 0\], block 9 "):
            ck.read_tensor("model.w")
        assert bit_equal(ck.read_tensor("model.b"), sd["model"]["b"])  # other tensors still read
        assert ck.verified_bytes >= sd["model"]["b"].nbytes
    with Checkpoint(path, options=ReadOptions(verify=False)) as ck:
        assert not bit_equal(ck.read_tensor("model.w"), sd["model"]["w"])
    with pytest.raises(ChecksumError):
        load_state_dict(path, "model.w")
    assert load_state_dict(path, "model.b")["model.b"].shape == (7,)  # reads only what it needs
    with pytest.raises(ChecksumError):
        load_into_module(_Wb(), path, prefix="model.")
    load_into_module(_Wb(), path, prefix="model.", options=ReadOptions(verify=False))
    assert cli_main(["-q", "diff", str(good), str(path)]) == 2  # a checksum error: one line, exit 2
    assert cli_main(["-q", "--no-verify", "diff", str(good), str(path)]) == 1  # differs
    assert cli_main(["-q", "convert", str(path), str(tmp_path / "conv")]) == 2
    assert not (tmp_path / "conv" / "ucp_index.json").exists()
    assert cli_main(["-q", "convert", "--no-verify", str(path), str(tmp_path / "conv2")]) == 0


class _Wb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64, 300))
        self.b = nn.Parameter(torch.zeros(7))
        self.e = nn.Parameter(torch.zeros(0, 5))


def test_convert_verifies_the_source_and_writes_block_sums(tmp_path: Path, sd: dict[str, Any]) -> None:
    """convert of a native checkpoint checks it (block checksums), and its output has block checksums."""
    from ucp_dcp.tools.convert import convert

    path = tmp_path / "ck"
    save_plain(path, sd)
    out = tmp_path / "out"
    convert(path, out)
    assert all(read_header(p).block_sums is not None for p in NativeSource.open(str(out), SourceOptions()).paths)
    got = load_state_dict(out)
    assert bit_equal(got["model.w"], sd["model"]["w"]) and got["step"] == 4


# ---------------------------------------------------------------- done callbacks


def test_range_reader_runs_done_once_after_the_last_byte(tmp_path: Path) -> None:
    """A segment's done callback runs once, after all of its bytes are in place: whole, merged
    with neighbours, or split across requests and threads; an exception in it fails the read."""
    data = os.urandom(10_000)
    f = tmp_path / "blob"
    f.write_bytes(data)
    for max_req in (7, 100, 1 << 20):
        calls: list[tuple[int, bytes]] = []
        bufs = [bytearray(n) for n in (1000, 10, 3000)]
        offs = [0, 1000, 5000]

        def done(i: int) -> Any:
            return lambda n: calls.extend([(i, bytes(bufs[i]))] * n)

        segs = [Segment(0, o, memoryview(b), done(i)) for i, (o, b) in enumerate(zip(offs, bufs))]
        with RangeReader([str(f)], threads=3, gap_bytes=16, max_request_bytes=max_req) as reader:
            reader.read(segs)
        assert sorted(i for i, _ in calls) == [0, 1, 2]
        for i, got in calls:
            assert got == data[offs[i] : offs[i] + len(bufs[i])]

    # Segments sharing a callback: every one of them is counted, once, however they are coalesced.
    for max_req in (7, 100, 1 << 20):
        counted: list[int] = []
        segs = [Segment(0, o, memoryview(bytearray(50)), counted.append) for o in (0, 50, 100, 400, 3000)]
        with RangeReader([str(f)], threads=2, gap_bytes=300, max_request_bytes=max_req) as reader:
            reader.read(segs)
        assert sum(counted) == 5
        assert all(bytes(s.dest) == data[s.offset : s.offset + 50] for s in segs)

    # Segments with callbacks are merged only up to HOOKED_REQUEST_BYTES (checked while in cache); others up to the limit.
    with RangeReader([str(f)], max_request_bytes=16 << 20) as reader:
        unit = HOOKED_REQUEST_BYTES // 4
        bare = [Segment(0, i * unit, memoryview(bytearray(unit))) for i in range(10)]
        hooked = [s._replace(done=counted.append) for s in bare]
        assert [r.nbytes for r in reader.plan(bare)] == [10 * unit]
        assert [r.nbytes for r in reader.plan(hooked)] == [4 * unit, 4 * unit, 2 * unit]
        big = [Segment(0, 0, memoryview(bytearray(3 * HOOKED_REQUEST_BYTES)), counted.append)]
        assert [r.nbytes for r in reader.plan(big)] == [3 * HOOKED_REQUEST_BYTES]  # one segment is never cut for it

    def boom(n: int) -> None:
        raise ChecksumError(str(f), "test", "0", "1")

    with RangeReader([str(f)], threads=2, max_request_bytes=64) as reader:
        with pytest.raises(ChecksumError):
            reader.read([Segment(0, 0, memoryview(bytearray(1000)), boom)])
        with pytest.raises(InvalidArgumentError, match="empty segment"):
            reader.read([Segment(0, 0, memoryview(bytearray(0)), boom)])
