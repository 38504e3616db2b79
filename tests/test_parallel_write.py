"""Multi-threaded writes of data files (``DataFileWriter(threads=N)``, ``UCPStorageWriter(threads=N)``).

Writer threads write disjoint pieces of one data file while the caller's
thread hashes the same bytes. Nothing about the result may depend on the
thread count or the piece size:

* a data file written by N threads in pieces of any size (not aligned to
  blocks or pages) is byte for byte the file one thread writes, and the
  entries carry the same checksums;
* a whole ``dcp.save`` with N writer threads loads bit-exactly with
  checksum verification on, and its files equal a one-thread save's except
  for the save id (random per save) in names and headers;
* a write that fails in a writer thread (ENOSPC) fails the save with the
  errno, the file and the rank, and leaves no partial file.

Hypothesis chooses tensor shapes, dtypes, counts, thread counts, piece and
block sizes.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp.byteio.datafile
import ucp_dcp.byteio.durable
from test_block_sums import DTYPES, block_size, full_tensor
from test_integrity import assert_same, load
from ucp_dcp import UCPSavePlanner, UCPStorageWriter
from ucp_dcp.byteio.datafile import DataFileWriter, chunk_entry, value_entry
from ucp_dcp.byteio.rangeio import tensor_view
from ucp_dcp.byteio.rangeio import read_header
from ucp_dcp.errors import CheckpointWriteError, InvalidArgumentError
from ucp_dcp.format import INDEX_FILE

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@contextmanager
def piece_size(n: int) -> Iterator[None]:
    """Writer threads write stable data in pieces of ``n`` bytes inside."""
    old = ucp_dcp.byteio.datafile.PIECE_BYTES
    ucp_dcp.byteio.datafile.PIECE_BYTES = n
    try:
        yield
    finally:
        ucp_dcp.byteio.datafile.PIECE_BYTES = old


shapes = st.lists(st.integers(0, 37), min_size=0, max_size=3).map(tuple)
tensors = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=6)


def write_file(path: str, ts: list[torch.Tensor], values: list[bytes], threads: int, *, split: int) -> DataFileWriter:
    """One data file of ``ts`` (each in ``split`` writes, stable) and ``values``, by ``threads`` threads."""
    entries = [chunk_entry(f"t{k}", t.dtype, t.shape, (0,) * t.dim(), t.shape) for k, t in enumerate(ts)]
    entries += [value_entry(f"v{k}", len(v)) for k, v in enumerate(values)]
    out = DataFileWriter(path, entries, rank=3, world_size=5, save_id="abcd1234", threads=threads)
    with out:
        for k, t in enumerate(ts):
            view = tensor_view(t)
            step = max(1, -(-len(view) // split))
            for o in range(0, len(view), step):
                out.write(k, view[o : o + step], stable=True)
        for k, v in enumerate(values):
            out.write(len(ts) + k, v, stable=k % 2 == 0)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=tensors,
    values=st.lists(st.binary(max_size=300), max_size=3),
    threads=st.integers(2, 5),
    piece=st.sampled_from([1, 7, 512, 4096, 5000, 1 << 20]),
    block=st.sampled_from([64, 4096]),
    split=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_threaded_file_is_byte_identical(
    specs: list[tuple[tuple[int, ...], torch.dtype]], values: list[bytes], threads: int, piece: int, block: int,
    split: int, seed: int,
) -> None:
    """N writer threads, any piece size: the same bytes, checksums and block checksums as one thread."""
    ts = [full_tensor(shape, dtype, seed + k) for k, (shape, dtype) in enumerate(specs)]
    with tempfile.TemporaryDirectory() as d, block_size(block), piece_size(piece):
        one = write_file(os.path.join(d, "one"), ts, values, 1, split=1)
        many = write_file(os.path.join(d, "many"), ts, values, threads, split=split)
        assert Path(d, "one").read_bytes() == Path(d, "many").read_bytes()
        assert [e.meta for e in one.entries] == [e.meta for e in many.entries]
        assert one.starts == many.starts and one.size == many.size == os.path.getsize(os.path.join(d, "many"))
        header = read_header(os.path.join(d, "many"))
        assert header is not None


def state(specs: list[tuple[tuple[int, ...], torch.dtype]], seed: int) -> dict[str, Any]:
    sd: dict[str, Any] = {f"t{k}": full_tensor(shape, dtype, seed + k) for k, (shape, dtype) in enumerate(specs)}
    sd["nested"] = {"x": torch.arange(10_000, dtype=torch.float32)[::3]}  # not contiguous: saved from a copy
    sd["step"] = seed
    return sd


def _save(sd: dict[str, Any], path: Path, threads: int) -> None:
    dcp.save(sd, storage_writer=UCPStorageWriter(path, threads=threads), planner=UCPSavePlanner())


def files_without_save_id(path: Path) -> dict[str, Any]:
    """The checkpoint's files, with the save id (random per save) cut out of names and contents.

    The index is compared as JSON without its digest (a hash of its text, save id included)."""
    data = [p for p in path.iterdir() if p.name != INDEX_FILE]
    ids = {re.fullmatch(r"rank\d+-([0-9a-f]{8})\.safetensors", p.name).group(1) for p in data}  # type: ignore[union-attr]
    assert len(ids) == 1, ids
    sid = ids.pop().encode()
    out: dict[str, Any] = {p.name.replace(sid.decode(), "ID"): p.read_bytes().replace(sid, b"ID") for p in path.iterdir()}
    index = json.loads(out.pop(INDEX_FILE))
    index.pop("digest")
    out[INDEX_FILE] = index
    return out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=tensors, threads=st.integers(2, 4), piece=st.sampled_from([100, 4096, 1 << 20]), seed=st.integers(0, 99))
def test_threaded_save_loads_bit_exactly(
    specs: list[tuple[tuple[int, ...], torch.dtype]], threads: int, piece: int, seed: int,
) -> None:
    """A save with N writer threads loads bit-exactly and verified, and equals a one-thread save."""
    sd = state(specs, seed)
    with tempfile.TemporaryDirectory() as d, piece_size(piece):
        one, many = Path(d, "one"), Path(d, "many")
        _save(sd, one, 1)
        _save(sd, many, threads)
        out, _ = load(many, sd, verify=True)
        assert_same(out, sd)
        assert files_without_save_id(one) == files_without_save_id(many)


def test_threads_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="threads=0"):
        UCPStorageWriter(tmp_path, threads=0)


@pytest.mark.parametrize("fail_after", [0, 3])
def test_writer_thread_enospc_fails_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_after: int) -> None:
    """ENOSPC in a writer thread: the save raises it naming file and rank; no partial file, no index;
    a checkpoint already in the directory stays loadable."""
    sd = {"big": torch.randn(300_000), "small": torch.randn(10), "step": 1}
    path = tmp_path / "ckpt"
    _save(sd, path, 1)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    real = os.pwrite
    calls = {"n": 0}

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > fail_after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(ucp_dcp.byteio.durable, "_pwrite", pwrite)
    with piece_size(64 << 10), pytest.raises(CheckpointException) as ei:
        _save({**sd, "big": sd["big"] + 1}, path, 3)
    monkeypatch.undo()
    (err, _), = ei.value.failures.values()
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    text = str(ei.value)
    assert "No space left on device" in text and "rank 0" in text
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # no partial file; old index intact
    out, _ = load(path, sd, verify=True)
    assert_same(out, sd)


def test_stable_views_keep_tensors_alive(tmp_path: Path) -> None:
    """A stable write may be written after the caller dropped its tensor: the view keeps it alive."""
    ts = [full_tensor((1000, 3), torch.float32, k) for k in range(4)]
    entries = [chunk_entry(f"t{k}", t.dtype, t.shape, (0, 0), t.shape) for k, t in enumerate(ts)]
    want = [tensor_view(t).tobytes() for t in ts]
    with piece_size(1000):
        out = DataFileWriter(str(tmp_path / "f"), entries, rank=0, world_size=1, save_id="00000000", threads=3)
        with out:
            for k in range(len(ts)):
                t = ts[k].clone()
                out.write(k, tensor_view(t), stable=True)
                del t
    raw = (tmp_path / "f").read_bytes()
    for k, s in enumerate(out.starts):
        assert raw[s : s + math.prod(ts[k].shape) * 4] == want[k]


def test_a_file_size_over_the_limit_fails_the_save_naming_file_and_rank(tmp_path: Path) -> None:
    """The data file cannot be sized (ftruncate: EFBIG under a file size limit): the save fails
    naming the file and the rank, and the file it created is removed."""
    import resource

    path = tmp_path / "ckpt"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # Python ignores SIGXFSZ: an error
    try:
        with pytest.raises(CheckpointException) as ei:
            _save({"big": torch.randn(100_000)}, path, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    (err, _), = ei.value.failures.values()
    assert isinstance(err, CheckpointWriteError) and err.errno == errno.EFBIG
    assert re.search(rf"rank 0 could not write checkpoint data file {re.escape(str(path))}/rank00000-\w+\.safetensors: "
                     r"File too large; its partial file was removed", str(err)), str(err)
    assert os.listdir(path) == []


def test_a_writer_refuses_more_or_fewer_bytes_than_an_entry_has(tmp_path: Path) -> None:
    """A caller's miscount is an InvalidArgumentError naming the file and the entry, and no file is left."""
    from ucp_dcp.byteio.datafile import stream_data_file

    f = str(tmp_path / "f")
    entries = [value_entry("a", 4), value_entry("b", 2)]
    with pytest.raises(InvalidArgumentError, match=re.escape(f"{f}: entry '__ucp_value__/a' gets more than its 4 bytes")):
        with DataFileWriter(f, entries, rank=0, world_size=1, save_id="00000000") as out:
            out.write(0, b"abc")
            out.write(0, b"de")
    with pytest.raises(InvalidArgumentError, match=re.escape(f"{f}: entries ['__ucp_value__/b'] were not written in full")):
        with DataFileWriter(f, entries, rank=0, world_size=1, save_id="00000000") as out:
            out.write(0, b"abcd")
            out.write(1, b"e")
    assert os.listdir(tmp_path) == []
    with pytest.raises(InvalidArgumentError, match=re.escape("obj: entry '__ucp_value__/b' has 1 bytes, not 2")):
        stream_data_file(io.BytesIO(), entries, [b"abcd", b"e"], path="obj", rank=0, world_size=1, save_id="00000000")
