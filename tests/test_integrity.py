"""Content checksums: digests of files and bytes, verified loads, and saves that fail cleanly.

* ``file_digest`` / ``bytes_digest`` / ``hash_range`` agree with xxhash itself.
* ``UCPStorageReader`` (``verify=True``, the default) detects any flipped
  byte in a block of a chunk the load touches, whether the read fills the
  whole chunk in place, into a strided target, through a dtype cast, or
  reads only part of the chunk (a reshard on another world size);
  ``verify=False`` does not look. ``test_block_sums.py`` has the property
  tests of the block checksums.
* A save that runs out of disk space (``ENOSPC`` injected through
  ``ucp_dcp.byteio.durable._pwrite``) fails naming the file, the rank and the
  error, leaves no partial data file and no index, and leaves earlier
  checkpoints loadable bit for bit; so does a commit whose index write fails.

Single-process tests run without a process group (DCP's "single process"
mode); errors then arrive wrapped in ``CheckpointException``.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import ucp_dcp.byteio.durable
from dist_utils import bit_equal, run_ranks
from ucp_dcp import load_index, ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.format import INDEX_FILE, Location
from ucp_dcp.sources import NativeSource, SourceOptions
from ucp_dcp.byteio.integrity import bytes_digest, file_digest, hash_range
from ucp_dcp.byteio.rangeio import RangeReader
from ucp_dcp.errors import ChecksumError, InvalidArgumentError, StorageError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ---------------------------------------------------------------- helpers


def make_state(seed: int = 0) -> dict[str, Any]:
    """Tensors of several dtypes and sizes (some above the 4 KiB alignment), a scalar, values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(40, 33, generator=g),  # 5280 bytes: aligned, spans pages
            "b": torch.randn(17, generator=g).to(torch.bfloat16),
            "emb": torch.randn(64, 24, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-(2**40), 2**40, (3, 50), generator=g, dtype=torch.int64),
        },
        "scalar": torch.tensor(2.5),
        "step": 11 + seed,
        "cfg": {"lr": 3e-4, "name": "adamw"},
    }


def flat_tensors(sd: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"model.w": tensor, ...}``: the tensors of ``sd`` under their checkpoint names."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def blank(sd: Any, mode: str = "plain") -> Any:
    """A load target shaped like ``sd``: ``plain`` zeroed tensors, ``strided`` non-contiguous
    views of zeroed tensors, ``cast`` float64 targets for floating tensors (a cast on load)."""
    if isinstance(sd, dict):
        return {k: blank(v, mode) for k, v in sd.items()}
    if not isinstance(sd, torch.Tensor):
        return None if isinstance(sd, int) else sd
    if mode == "strided" and sd.dim() == 2:
        return torch.zeros(sd.shape[1], sd.shape[0], dtype=sd.dtype).t()
    if mode == "cast" and sd.is_floating_point():
        return torch.zeros(sd.shape, dtype=torch.float64)
    return torch.zeros_like(sd)


def save(sd: dict[str, Any], path: Path, **kw: Any) -> None:
    dcp.save(sd, storage_writer=UCPStorageWriter(path, **kw), planner=UCPSavePlanner())


def load(path: Path, like: dict[str, Any], *, verify: bool, mode: str = "plain") -> tuple[dict[str, Any], UCPStorageReader]:
    out = blank(like, mode)
    reader = UCPStorageReader(path, options=ReadOptions(verify=verify))
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner(allow_dtype_cast=mode == "cast"))
    return out, reader


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            assert_same(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert bit_equal(got[k], v), k
        else:
            assert got[k] == v, k


def chunk_of(path: Path, fqn: str, i: int) -> tuple[Path, Location, int]:
    """File, location and writing rank of chunk ``i`` of tensor ``fqn``."""
    index = load_index(str(path))
    loc = NativeSource.open(str(path), SourceOptions()).locate(fqn, i)
    rec = index.files[loc.file]
    return path / rec.name, loc, rec.rank


def flip(file: Path, offset: int, mask: int) -> None:
    """XOR the byte at ``offset`` of ``file`` with ``mask`` (call again to undo)."""
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def failure_text(exc: CheckpointException) -> str:
    return "\n".join(str(e) for e, _ in exc.failures.values())


# ---------------------------------------------------------------- digests


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 17, 70_001])
def test_file_and_bytes_digest_match_xxhash(tmp_path: Path, size: int) -> None:
    """Whole-file and in-memory digests are xxh3-128 of the bytes, for any size vs block size."""
    data = random.Random(size).randbytes(size)
    f = tmp_path / "blob"
    f.write_bytes(data)
    want = xxhash.xxh3_128_hexdigest(data)
    for block in (1, 4096, 1 << 20):
        assert file_digest(f, block=block) == (size, want)
    assert file_digest(str(f)) == (size, want)
    assert bytes_digest(data) == want
    assert bytes_digest(memoryview(data)) == want
    assert bytes_digest(bytearray(data)) == want


def test_file_digest_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(StorageError, match=re.escape(str(missing))) as e:
        file_digest(missing)
    assert e.value.errno == errno.ENOENT
    with pytest.raises(StorageError, match=re.escape(str(tmp_path))) as e:
        file_digest(tmp_path)
    assert e.value.errno == errno.EISDIR
    with pytest.raises(InvalidArgumentError, match="block"):
        file_digest(missing, block=0)


@pytest.mark.parametrize("start,nbytes,buf", [(0, 0, 8), (3, 100, 7), (0, 5000, 4096), (123, 4096, 4096), (10, 9, 64)])
def test_hash_range_matches_xxh3_64(tmp_path: Path, start: int, nbytes: int, buf: int) -> None:
    """Streaming a byte range through a small reused buffer gives xxh3-64 of the range."""
    data = random.Random(start + nbytes).randbytes(6000)
    f = tmp_path / "blob"
    f.write_bytes(data)
    with RangeReader([str(f)]) as reader:
        got = hash_range(reader, Location(0, start, nbytes, ""), bytearray(buf))
    assert got == xxhash.xxh3_64_hexdigest(data[start : start + nbytes])


def test_hash_range_needs_a_buffer_and_a_chunk_is_checked_once_if_it_has_a_checksum(tmp_path: Path) -> None:
    from ucp_dcp.byteio.integrity import ChunkVerifier

    f = tmp_path / "blob"
    f.write_bytes(bytes(64))
    with RangeReader([str(f)]) as reader:
        with pytest.raises(InvalidArgumentError, match="^hash_range needs a non-empty buffer$"):
            hash_range(reader, Location(0, 0, 8, ""), bytearray())
        verifier = ChunkVerifier(reader, [str(f)], [0])
        verifier.add(Location(0, 0, 64, ""), "w", (0,))  # an imported DCP chunk: no checksum
        verifier.add(Location(0, 0, 64, "0" * 16), "v", (0,), torch.ones(16))
        with pytest.raises(ChecksumError, match="tensor 'v'"):
            verifier.check()
        verifier.add(Location(0, 0, 64, "0" * 16), "v", (0,))  # checked already: once per load
        verifier.check()
    assert verifier.bytes == 64  # v's bytes, once


def test_checksum_error_names_everything_and_pickles() -> None:
    """DCP pickles rank failures to gather them: the error must survive that, attributes and all."""
    e = ChecksumError("/ck/rank00001-ab.safetensors", "tensor 'layer.w' chunk at [0, 4]", "00ff", "1234", 1)
    text = str(e)
    for part in ("/ck/rank00001-ab.safetensors", "tensor 'layer.w' chunk at [0, 4]", "00ff", "1234", "rank 1",
                 "restore this checkpoint from another copy or load an earlier one"):
        assert part in text
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is ChecksumError and str(back) == text
    assert (back.path, back.what, back.expected, back.actual, back.rank) == (e.path, e.what, "00ff", "1234", 1)
    assert "rank" not in str(ChecksumError("/f", "value 'step'", "a", "b"))


# ---------------------------------------------------------------- verified loads (single process)


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    sd = make_state()
    path = tmp_path / "ckpt"
    save(sd, path)
    return path, sd


@pytest.mark.parametrize("mode", ["plain", "strided", "cast"])
def test_verified_load_hashes_every_tensor_byte_once(ckpt: tuple[Path, dict[str, Any]], mode: str) -> None:
    """An intact checkpoint loads bit-exactly with verify=True, and every tensor byte is hashed
    exactly once, whichever way the bytes reach their target (in place, strided, cast)."""
    path, sd = ckpt
    out, reader = load(path, sd, verify=True, mode=mode)
    if mode == "cast":
        want = {k: v.double() if v.is_floating_point() else v for k, v in flat_tensors(sd).items()}
        got = flat_tensors(out)
        assert all(bit_equal(got[k], want[k]) for k in want)
        assert out["step"] == sd["step"]
    else:
        assert_same(out, sd)
    assert reader.last_load.verified_bytes == sum(t.nbytes for t in flat_tensors(sd).values())
    assert reader.last_load.verify_seconds > 0
    _, plain = load(path, sd, verify=False)
    assert plain.last_load.verified_bytes == 0 and plain.last_load.verify_seconds == 0


def test_flipped_byte_in_any_chunk_fails_verified_load(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """30 random single-byte corruptions inside tensor chunks: verify=True (the default) names the
    tensor, the chunk, the block, the file and the writing rank; verify=False loads without looking."""
    path, sd = ckpt
    names = sorted(flat_tensors(sd))
    rng = random.Random(1234)
    for trial in range(30):
        fqn = rng.choice(names)
        file, loc, rank = chunk_of(path, fqn, 0)
        offset, mask = loc.start + rng.randrange(loc.nbytes), rng.randrange(1, 256)
        mode = rng.choice(["plain", "strided", "cast"])
        flip(file, offset, mask)
        try:
            with pytest.raises(CheckpointException) as ei:
                load(path, sd, verify=True, mode=mode)
            (err, _), = ei.value.failures.values()
            assert isinstance(err, ChecksumError), (trial, err)
            block = (offset - loc.start) // 4096
            assert (err.path, err.what, err.rank) == (
                str(file), f"tensor {fqn!r} chunk at {[0] * sd_dim(sd, fqn)}, block {block} (bytes "
                f"[{block * 4096}, {min(block * 4096 + 4096, loc.nbytes)}) of the chunk)", rank)
            assert err.actual != err.expected
            text = str(ei.value)
            assert f"tensor {fqn!r}" in text and str(file) in text and "ChecksumError" in text
            load(path, sd, verify=False, mode=mode)  # opted out: tensors are not checked
        finally:
            flip(file, offset, mask)
    out, _ = load(path, sd, verify=True)  # every flip was undone
    assert_same(out, sd)


def sd_dim(sd: dict[str, Any], fqn: str) -> int:
    return flat_tensors(sd)[fqn].dim()


# ---------------------------------------------------------------- disk full (single process)


def failing_pwrite(monkeypatch: pytest.MonkeyPatch, should_fail: Callable[[int, int], bool]) -> dict[str, int]:
    """Route data writes through a ``_pwrite`` that writes normally until ``should_fail(written, offset)``,
    then writes part of the buffer (like a disk filling up mid-write) and raises ENOSPC after that."""
    state = {"written": 0, "failed": 0}
    real = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if state["failed"] or should_fail(state["written"], offset):
            state["failed"] += 1
            if state["failed"] == 1 and len(data) > 1:
                return real(fd, memoryview(data)[: len(data) // 2], offset)  # a short write first
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real(fd, data, offset)
        state["written"] += n
        return n

    monkeypatch.setattr(ucp_dcp.byteio.durable, "_pwrite", pwrite)
    return state


FAIL_AT = {
    "first_write": lambda written, offset: True,
    "after_5000_bytes": lambda written, offset: written >= 5000,
    "header_write": lambda written, offset: offset == 0,  # the header is written last, at offset 0
}


@pytest.mark.parametrize("when", sorted(FAIL_AT))
def test_disk_full_save_fails_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """ENOSPC while writing data: the save raises naming file, rank and error; no index and no
    data file are left in a new directory; an existing checkpoint saved over (overwrite=True)
    and one in another directory both stay committed and load bit-exactly."""
    old_sd, new_sd = make_state(0), make_state(1)
    other, same = tmp_path / "other", tmp_path / "same"
    save(old_sd, other)
    save(old_sd, same)
    before = {p.name: p.read_bytes() for p in same.iterdir()}
    state = failing_pwrite(monkeypatch, FAIL_AT[when])

    fresh = tmp_path / "fresh"
    with pytest.raises(CheckpointException) as ei:
        save(new_sd, fresh)
    assert state["failed"] >= 1
    (err, _), = ei.value.failures.values()
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    text = str(ei.value)
    assert "No space left on device" in text and "rank 0" in text
    assert re.search(re.escape(str(fresh)) + r"/rank00000-[0-9a-f]{8}\.safetensors", text), text
    assert os.listdir(fresh) == []  # no partial data file, no index

    state["failed"] = state["written"] = 0
    with pytest.raises(CheckpointException, match="No space left on device"):
        save(new_sd, same, overwrite=True)
    assert {p.name: p.read_bytes() for p in same.iterdir()} == before  # old files and index untouched

    monkeypatch.undo()
    for path in (other, same):
        out, _ = load(path, old_sd, verify=True)
        assert_same(out, old_sd)


def test_disk_full_convert_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while convert writes: a CheckpointWriteError (errno kept) naming the file, that
    nothing is committed and the remedy; the destination holds no index."""
    from ucp_dcp import convert
    from ucp_dcp.errors import CheckpointWriteError

    src, dst = tmp_path / "src", tmp_path / "dst"
    save(make_state(0), src)
    failing_pwrite(monkeypatch, FAIL_AT["first_write"])
    with pytest.raises(CheckpointWriteError) as ei:
        convert(src, dst)
    assert ei.value.errno == errno.ENOSPC
    assert re.fullmatch(
        r"\[Errno 28\] " + re.escape(str(dst)) + r"/rank00000-[0-9a-f]{8}\.safetensors: convert could not write \(No space left on device\); "
        r"nothing is committed in " + re.escape(str(dst)) + r": free space \(or save elsewhere\), and convert again",
        str(ei.value),
    ), str(ei.value)
    assert not (dst / INDEX_FILE).exists()


def test_disk_full_at_index_commit_keeps_previous_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while writing the index: the save raises, the previous index and its data files
    are untouched and no index temp file remains. The new save's (complete) data files stay
    until the next save that commits here removes them."""
    old_sd = make_state(0)
    path = tmp_path / "ckpt"
    save(old_sd, path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    real_write = os.write
    calls = {"n": 0}

    def write(fd: int, data: Any) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if f".{INDEX_FILE}." not in os.path.basename(target):
            return real_write(fd, data)
        calls["n"] += 1
        if calls["n"] == 1 and len(data) > 1:
            return real_write(fd, memoryview(data)[: len(data) // 2])  # part of it lands first
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(CheckpointException) as ei:
        save(make_state(1), path, overwrite=True)
    monkeypatch.undo()
    assert calls["n"] >= 2
    text = str(ei.value)
    assert "No space left on device" in text and INDEX_FILE in text and str(path) in text
    after = {p.name: p.read_bytes() for p in path.iterdir()}
    assert {k: v for k, v in after.items() if k in before} == before  # old index and data intact
    left = sorted(set(after) - set(before))
    assert len(left) == 1 and re.fullmatch(r"rank00000-[0-9a-f]{8}\.safetensors", left[0]), left  # no temp index
    out, _ = load(path, old_sd, verify=True)
    assert_same(out, old_sd)
    new_sd = make_state(2)
    save(new_sd, path, overwrite=True)  # the next commit clears out the failed save's file
    assert not (path / left[0]).exists() and not any(n in before for n in os.listdir(path) if n != INDEX_FILE)
    out, _ = load(path, new_sd, verify=True)
    assert_same(out, new_sd)


# ---------------------------------------------------------------- multi-process: partial chunks, one rank's disk full


W_FULL = torch.randn(10, 6, generator=torch.Generator().manual_seed(7))
B_FULL = torch.randn(6, 10, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)


def _save_two_ranks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(W_FULL, mesh, [Shard(0)]), "b": distribute_tensor(B_FULL, mesh, [Shard(1)]), "step": 5}
    dcp.save(sd, storage_writer=UCPStorageWriter(os.path.join(root, "good")), planner=UCPSavePlanner())

    # Rank 1's disk fills up during a second save into another directory.
    failed = os.path.join(root, "failed")
    real = ucp_dcp.byteio.durable._pwrite
    if rank == 1:
        def pwrite(fd: int, data: Any, offset: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        ucp_dcp.byteio.durable._pwrite = pwrite
    try:
        with pytest.raises(CheckpointException) as ei:
            dcp.save(sd, storage_writer=UCPStorageWriter(failed), planner=UCPSavePlanner())
    finally:
        ucp_dcp.byteio.durable._pwrite = real
    assert set(ei.value.failures) == {1}  # on every rank: DCP gathers the failures
    err = ei.value.failures[1][0]
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert re.search(re.escape(failed) + r"/rank00001-[0-9a-f]{8}\.safetensors", str(err)) and "rank 1" in str(err)
    dist.barrier()
    names = os.listdir(failed)
    assert INDEX_FILE not in names  # finish() never ran
    assert not [n for n in names if n.startswith("rank00001")]  # rank 1 removed its partial file


def _rows(rank: int, world: int, n: int) -> range:
    """Rows of an ``n``-row tensor that Shard(0) gives ``rank`` of ``world`` (torch's chunking)."""
    size = -(-n // world)
    return range(min(rank * size, n), min((rank + 1) * size, n))


def _load_three_ranks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    good = os.path.join(root, "good")

    def target() -> dict[str, Any]:
        return {"w": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]),
                "b": distribute_tensor(torch.zeros(6, 10, dtype=torch.bfloat16), mesh, [Shard(0)]), "step": 0}

    # Intact: loads bit-exactly; every block touched (here every chunk is one block) is hashed
    # once, whole, even when only part of it is read (w: saved rows 0-4 | 5-9, loaded 0-3 | 4-7 | 8-9; b: saved by
    # columns, loaded by rows, so every rank reads part of both chunks).
    sd = target()
    reader = UCPStorageReader(good, options=ReadOptions(verify=True))
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    rows = _rows(rank, world, 10)
    assert isinstance(sd["w"], DTensor) and sd["step"] == 5
    assert bit_equal(sd["w"].to_local(), W_FULL[rows.start : rows.stop])
    assert bit_equal(sd["b"].to_local(), B_FULL[_rows(rank, world, 6).start : _rows(rank, world, 6).stop])
    w_chunks = sum(1 for c in (range(0, 5), range(5, 10)) if set(c) & set(rows))
    assert reader.last_load.verified_bytes == w_chunks * 5 * 6 * 4 + B_FULL.nbytes

    # Corrupt the last row of w, which only rank 2 reads. Rank 1 reads rows 5-7 of the same
    # chunk, never the bad byte, and must still fail: the chunk (120 bytes) is one block.
    dist.barrier()
    index = load_index(good)
    locator = NativeSource.open(good, SourceOptions())
    loc = locator.locate("w", locator.chunk_index("w", (5, 0), None))
    file = os.path.join(good, index.files[loc.file].name)
    if rank == 0:
        flip(Path(file), loc.start + 4 * 6 * 4 + 3, 0x40)
    dist.barrier()
    with pytest.raises(CheckpointException) as ei:
        dcp.load(target(), storage_reader=UCPStorageReader(good, options=ReadOptions(verify=True)), planner=UCPLoadPlanner())
    assert set(ei.value.failures) == {1, 2}, failure_text(ei.value)
    for r in (1, 2):
        err = ei.value.failures[r][0]
        assert isinstance(err, ChecksumError), err
        assert (err.path, err.what, err.rank) == (file, "tensor 'w' chunk at [5, 0], block 0 (bytes [0, 120) of the chunk)", 1)
    assert "ChecksumError" in str(ei.value) and file in str(ei.value)
    dcp.load(target(), storage_reader=UCPStorageReader(good, options=ReadOptions(verify=False)), planner=UCPLoadPlanner())  # not checked


@pytest.mark.multiproc
def test_partial_chunk_reads_are_verified_and_one_full_disk_fails_the_save(tmp_path: Path) -> None:
    """Saved on 2 ranks, loaded on 3 with verify=True: partial-chunk reads verify every block they
    touch, and a corrupt byte fails the load on every rank that reads its block, naming the writing rank. A save in
    which one rank hits ENOSPC fails on every rank, writes no index, leaves no partial file."""
    run_ranks(2, _save_two_ranks, str(tmp_path))
    run_ranks(3, _load_three_ranks, str(tmp_path))


def test_write_index_out_of_space_leaves_old_index_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ucp_dcp.byteio.location import write_index

    path = tmp_path / "ck"
    dcp.save({"w": torch.arange(10.0)}, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    before = (path / INDEX_FILE).read_bytes()
    index = load_index(str(path))
    real_write = os.write

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left on device"):
        write_index(str(path), index)
    monkeypatch.setattr(os, "write", real_write)
    assert (path / INDEX_FILE).read_bytes() == before
    assert [n for n in os.listdir(path) if n.endswith(".tmp")] == []
