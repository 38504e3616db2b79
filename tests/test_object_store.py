"""Checkpoints in object storage: a real S3-compatible server (moto) on loopback, through s3fs.

Saves on 4 gloo ranks stream their data files to the bucket; loads on 3
ranks reshard from it with ranged requests, bit-exactly, fetching about the
bytes they need. ``memory://`` covers the same paths without a server.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import s3_server
from dist_utils import bit_equal, run_ranks
from fault_proxy import FaultProxy, storage_options_via
from ucp_dcp import (RequestPolicy, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter,
                     load_state_dict)
from ucp_dcp.byteio.objrange import ObjectRangeReader
from ucp_dcp.byteio.objstore import ObjectStore, is_url, local_path
from ucp_dcp.byteio.segments import Segment
from ucp_dcp.errors import CheckpointFormatError, StorageError, TruncatedFileError, unwrap
from ucp_dcp.sources import formats_looked_for
from ucp_dcp import ReadOptions

s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module

# Four 1 MiB fp32 tensors split by rows, one split by columns, and a step value.
SHAPES = {"w0": (256, 1024), "w1": (512, 512), "w2": (1000, 262), "w3": (64, 4096)}
COLS = {"c0": (128, 2048)}


def full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The saved value of tensor ``name``: distinct bits everywhere."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def sharded_state(mesh: Any, col_dim: int) -> dict[str, Any]:
    """Every tensor as a DTensor on ``mesh``: rows split for ``w*``, dimension ``col_dim`` for ``c*``."""
    sd: dict[str, Any] = {}
    for name, shape in {**SHAPES, **COLS}.items():
        dim = col_dim if name in COLS else 0
        sd[name] = DTensor.from_local(_local(full(name, shape), mesh, dim), mesh, [Shard(dim)], run_check=False,
                                      shape=torch.Size(shape), stride=full(name, shape).stride())
    return sd


def _local(t: torch.Tensor, mesh: Any, dim: int) -> torch.Tensor:
    """This rank's ``Shard(dim)`` piece of ``t`` (torch's chunking: ceil-sized, last ones short or empty)."""
    n, r = mesh.size(), mesh.get_local_rank()
    size = -(-t.shape[dim] // n)
    return t.narrow(dim, min(r * size, t.shape[dim]), max(0, min(size, t.shape[dim] - r * size))).clone()


def _save(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = {"model": sharded_state(mesh, 0), "step": 7}
    dcp.save(sd, storage_writer=UCPStorageWriter(url, storage_options=options), planner=UCPSavePlanner())


def _load(rank: int, world: int, url: str, options: dict[str, Any], out_dir: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    expected = sharded_state(mesh, 1)  # the column tensor is loaded split the other way
    needed = sum(v.to_local().nbytes for v in expected.values())
    stats = {}
    # Each rank talks to the server through its own counting proxy: the server-side view of what
    # this rank fetched, headers and index included.
    with FaultProxy(options["client_kwargs"]["endpoint_url"]) as proxy:
        via = storage_options_via(proxy, options)
        # Exact reads (gap_bytes=0; without verification, which reads whole 4 KiB blocks at the edges
        # of a range), then the defaults: verified, gaps up to 32 KiB merged into one request.
        for mode, gap in (("exact", 0), ("default", None)):
            target = {"model": {k: DTensor.from_local(torch.full_like(v.to_local(), float("nan")), mesh,
                                                       v.placements, run_check=False, shape=v.shape,
                                                       stride=v.stride())
                                for k, v in expected.items()}, "step": 0}
            proxy.reset_records()
            # Exact reads send no hedges: a hedge cancelled by its request's answer before the server
            # saw it still counts as sent, which would blur the count of header GETs below.
            requests = RequestPolicy(hedge=False) if mode == "exact" else None
            reader = UCPStorageReader(url, storage_options=via,
                                      options=ReadOptions(gap_bytes=gap, verify=gap is None, requests=requests))
            dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
            wrong = [k for k, v in expected.items() if not bit_equal(target["model"][k].to_local(), v.to_local())]
            assert not wrong, f"rank {rank} ({mode} reads): {wrong} differ"
            assert target["step"] == 7
            store = reader.source.store
            # GETs beyond each request's first: hedges and retries (a slow server's, under load).
            again = store.stats.hedges + store.stats.retries
            stats[mode] = {"needed": needed, "requested": reader.last_load.bytes_requested, "calls": reader.last_load.read_calls,
                           "verified": reader.last_load.verified_bytes, "server_bytes": proxy.bytes_sent("GET"),
                           "server_gets": proxy.count("GET"), "again": again,
                           "hedged_bytes": store.stats.hedged_bytes}
        # Then rank 1's ranged GETs never answer (issue 25): every rank fails with its StorageError
        # within the deadlines, with and without the read-once exchange (costs no spawn of its own).
        if rank == 1:
            proxy.inject("stall", count=10**6, match=lambda m, p, h: m == "GET" and h.get("Range") is not None)
        for once in (False, True):
            fails_on_rank_1_within_the_deadline(url, via, expected, mesh, once)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(stats, f)


def fails_on_rank_1_within_the_deadline(url: str, via: dict[str, Any], expected: dict[str, Any], mesh: Any,
                                        read_once: bool) -> None:
    """A load whose rank 1 gets no answer fails on every rank with rank 1's error, naming the object,
    the byte range, the rank and the time it waited, within two tries of at most 0.5 s (and the load's
    work)."""
    target = {"model": {k: DTensor.from_local(torch.zeros_like(v.to_local()), mesh, v.placements, run_check=False,
                                               shape=v.shape, stride=v.stride()) for k, v in expected.items()},
              "step": 0}
    policy = RequestPolicy(attempts=2, deadline_floor_s=0.3, deadline_cap_s=0.5)
    reader = UCPStorageReader(url, storage_options=via, options=ReadOptions(requests=policy, read_once=read_once))
    t0 = time.monotonic()
    with pytest.raises(CheckpointException) as e:
        dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
    took = time.monotonic() - t0
    err = unwrap(e.value)
    assert isinstance(err, StorageError) and err.errno == errno.ETIMEDOUT, repr(e.value)
    m = re.fullmatch(
        re.escape(url) + r"/rank0000\d-\w+\.safetensors: reading bytes \[\d+, \d+\) failed \(after 2 tries\): "
        r"DeadlineExceeded: rank 1 got no answer within the deadline of each of 2 tries "
        r"\((\d\.\d\d), (\d\.\d\d) s for \d+ bytes\) and waited (\d+\.\d\d) s in all",
        str(err),
    )
    assert m, str(err)
    # Each try's deadline lies between the floor and the cap; the time waited is the two tries and a
    # backoff (at most 0.15 s), and the scheduling around them.
    first, second, waited = map(float, m.groups())
    assert 0.3 <= first <= 0.5 and 0.3 <= second <= 0.5 and first + second <= waited < first + second + 0.5, m.groups()
    assert took < 6.0, (read_once, took)


def _url(base: str) -> str:
    return f"{base}/ckpt-{uuid.uuid4().hex[:8]}"


def test_s3_save_on_4_load_resharded_on_3(s3_bucket: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    base, options = s3_bucket
    url = _url(base)
    run_ranks(4, _save, url, options)
    names = ObjectStore(url, options).list_sizes()
    assert sorted(n for n in names if n.endswith(".safetensors")) == sorted(
        n for n in names if n.startswith("rank"))
    assert len([n for n in names if n.startswith("rank")]) == 4 and "ucp_index.json" in names
    index_bytes = ObjectStore(url, options).size("ucp_index.json")
    run_ranks(3, _load, url, options, str(tmp_path))
    column_chunk = 4 * COLS["c0"][0] // 4 * COLS["c0"][1]  # bytes of one saved row-chunk of c0
    heads: list[int] = []
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        exact, default = got["exact"], got["default"]
        # Exact requests: the bytes the rank needs, less those that came with the headers' requests
        # (the reader is handed them). The server sent at most the needed bytes, the index, and the
        # first 64 KiB (the header) of each of the 4 data files.
        assert exact["requested"] <= 1.05 * exact["needed"], got
        assert exact["server_bytes"] <= (1.05 * exact["needed"] + index_bytes + 4 * (64 << 10)
                                         + exact["hedged_bytes"]), got
        # Every rank needs rows of c0 from all 4 files: one GET for the index, and its share of
        # the 4 headers' (a read-once load has each made by one rank, the others get it from there).
        heads.append(exact["server_gets"] - exact["calls"] - exact["again"] - 1)
        assert default["verified"] >= exact["needed"], got  # every byte used was checked against its block sums
        # The default merges the column slices of each row-chunk of c0 (gaps of 5 KiB) into one
        # request per chunk: at most the 4 chunks of c0 extra, in far fewer requests.
        assert default["requested"] <= 1.05 * exact["needed"] + 4 * column_chunk, got
        # (Exact reads inside a header's request cost none: about 105 requests remain, against 7-12.)
        assert default["calls"] * 8 < exact["calls"], got
    assert sorted(heads) == [1, 1, 2], heads


def test_many_streamed_writes_at_once_on_a_blocking_store_all_finish() -> None:
    """Each whole streamed write (a composite operation) runs on a thread of its own: forty at
    once on memory:// (whose requests run on the event loop's default executor, six threads
    here) all finish, each object whole. On the loop's executor a dozen held every thread while
    their own requests queued behind them, and none finished."""
    store = ObjectStore(f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt")
    n, done = 40, []

    def one(i: int) -> None:
        def fill(out: Any) -> int:
            out.write(bytes([i]) * 1000)
            time.sleep(0.1)  # every write is in flight at once
            out.write(bytes([i]) * 1000)
            return i

        done.append(store.write_stream(f"f{i}", "writing", fill))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert sorted(done) == list(range(n)), f"{len(done)} of {n} writes finished within 30 s"
    assert all(store.read(f"f{i}") == bytes([i]) * 2000 for i in range(n))


def test_memory_url_round_trip_and_overwrite() -> None:
    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    sd = {"a": full("a", (300, 70)), "b": {"ids": torch.arange(10), "name": "x"}}
    dcp.save(sd, storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    first = ObjectStore(url).list_sizes()
    got = load_state_dict(url)
    assert bit_equal(got["a"], sd["a"]) and bit_equal(got["b.ids"], sd["b"]["ids"]) and got["b.name"] == "x"
    sd["a"] = sd["a"] * 2
    dcp.save(sd, storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    second = ObjectStore(url).list_sizes()
    # The new save's data object replaced the old one, which is gone after the commit.
    assert len(second) == 2 and set(first) & set(second) == {"ucp_index.json"}
    assert bit_equal(load_state_dict(url)["a"], sd["a"])


def test_overwrite_false_refuses_a_committed_url() -> None:
    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    dcp.save({"a": torch.ones(3)}, storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    with pytest.raises(CheckpointException, match=r"already holds a committed checkpoint.*overwrite=False"):
        dcp.save({"a": torch.zeros(3)}, storage_writer=UCPStorageWriter(url, overwrite=False),
                 planner=UCPSavePlanner())
    assert bit_equal(load_state_dict(url)["a"], torch.ones(3))


def test_missing_checkpoint_names_the_url() -> None:
    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/nothing"
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(url)
    assert str(e.value) == f"{url} is not a checkpoint: found none of {', '.join(formats_looked_for())}; it is empty"


def test_a_missing_data_object_names_it() -> None:
    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    dcp.save({"a": torch.ones(3)}, storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    store = ObjectStore(url)
    data = [n for n in store.list_sizes() if n.startswith("rank")]
    store.remove(data)
    with pytest.raises(StorageError) as e:
        load_state_dict(url)
    assert str(e.value).startswith(f"{url}/{data[0]}: reading bytes [0, ")
    assert "failed: FileNotFoundError" in str(e.value) and e.value.errno == 2


def test_a_truncated_data_object_names_it() -> None:
    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    dcp.save({"a": full("a", (256, 256))}, storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    store = ObjectStore(url)
    name = next(n for n in store.list_sizes() if n.startswith("rank"))
    raw = store.read(name)
    store.put(name, raw[: len(raw) - 1000])
    with pytest.raises(TruncatedFileError) as e:
        load_state_dict(url)
    assert str(e.value) == (f"{url}/{name}: needed bytes [{len(raw) - 262144}, {len(raw)}) but got "
                            f"{262144 - 1000}: truncated object")


def test_corrupt_object_is_a_checksum_error() -> None:
    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    dcp.save({"a": full("a", (64, 64))}, storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    store = ObjectStore(url)
    name = next(n for n in store.list_sizes() if n.startswith("rank"))
    raw = bytearray(store.read(name))
    raw[-100] ^= 1  # a bit of the tensor's data (its last bytes end the file)
    store.put(name, bytes(raw))
    with pytest.raises(Exception, match="checksum") as e:
        load_state_dict(url)
    assert name in str(e.value)


def test_url_helpers() -> None:
    assert is_url("s3://b/k") and is_url("memory://x") and not is_url("/tmp/x") and not is_url("file:///tmp/x")
    assert local_path("file:///tmp/x") == "/tmp/x" and local_path("/tmp/x") == "/tmp/x"
    assert not is_url("C:/x") and not is_url("relative/dir")


def test_retry_policy_is_bounded() -> None:
    delays = RequestPolicy(attempts=4, backoff_s=0.1, max_backoff_s=0.25).delays()
    assert len(delays) == 3 and all(0.1 <= d <= 0.375 for d in delays) and delays[2] <= 0.375


def test_transient_errors_are_retried_then_reported() -> None:
    store = ObjectStore(f"memory://ucp-{uuid.uuid4().hex[:8]}/x", requests=RequestPolicy(attempts=3, backoff_s=0.001))
    calls = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return 42

    assert store.call("testing", "obj", flaky) == 42 and len(calls) == 3
    calls.clear()

    def broken() -> int:
        calls.append(1)
        raise ConnectionResetError("reset by peer")

    with pytest.raises(StorageError) as e:
        store.call("reading bytes [0, 8)", "obj", broken)
    assert len(calls) == 3
    assert str(e.value) == (f"{store.url}/obj: reading bytes [0, 8) failed (after 3 tries): "
                            "ConnectionResetError: reset by peer")

    def denied() -> int:
        calls.append(1)
        raise PermissionError("Access Denied")

    calls.clear()
    with pytest.raises(StorageError) as e:
        store.call("reading the object", "obj", denied)
    assert len(calls) == 1 and e.value.errno == 13  # permanent: no retry


def test_object_range_reader_coalesces_within_the_gap() -> None:
    store = ObjectStore(f"memory://ucp-{uuid.uuid4().hex[:8]}/x")
    blob = bytes(range(256)) * 64  # 16 KiB
    store.put("f", blob)
    dests = [bytearray(10), bytearray(20), bytearray(5), bytearray(7)]
    offs = [0, 100, 5000, 16000]
    segs = [Segment(0, o, memoryview(d)) for o, d in zip(offs, dests)]
    r = ObjectRangeReader(store, ["f"], gap_bytes=4096, max_request_bytes=1 << 20)
    assert [(q.offset, q.end) for q in r.plan(segs)] == [(0, 120), (5000, 5005), (16000, 16007)]
    r.read(segs)
    assert all(bytes(d) == blob[o : o + len(d)] for o, d in zip(offs, dests))
    assert r.stats.calls == 3 and r.stats.bytes == 120 + 5 + 7
    exact = ObjectRangeReader(store, ["f"], gap_bytes=0, max_request_bytes=8)
    assert [(q.offset, q.end) for q in exact.plan(segs[:2])] == [(0, 8), (8, 10), (100, 108), (108, 116), (116, 120)]


_BLOB = bytes((i * 7 + i // 251) % 256 for i in range(1 << 16))
_STORE: list[ObjectStore] = []


def _blob_store() -> ObjectStore:
    if not _STORE:
        store = ObjectStore(f"memory://ucp-{uuid.uuid4().hex[:8]}/blob")
        store.put("f", _BLOB)
        _STORE.append(store)
    return _STORE[0]


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(_BLOB)), min_size=2, max_size=40, unique=True),
       keep=st.lists(st.booleans(), min_size=40, max_size=40),
       gap=st.sampled_from([0, 1, 100, 4096, 1 << 15]), max_request=st.integers(1, 1 << 14),
       window=st.integers(1, 1 << 15))
def test_object_range_reader_reads_exact_bytes(cuts: list[int], keep: list[bool], gap: int, max_request: int,
                                               window: int) -> None:
    """Any disjoint ranges, gaps, request and window sizes: every destination gets its bytes, every
    callback fires once per segment after its bytes are in place."""
    cuts.sort()
    ranges = [(a, b) for (a, b), k in zip(zip(cuts, cuts[1:]), keep) if k]
    dests = [bytearray(b - a) for a, b in ranges]
    seen: list[int] = []

    def done_of(i: int) -> Any:
        def done(n: int) -> None:
            assert bytes(dests[i]) == _BLOB[ranges[i][0] : ranges[i][1]]
            seen.append(i)
        return done

    segs = [Segment(0, a, memoryview(d), done_of(i) if len(d) else None) for i, ((a, _), d) in enumerate(zip(ranges, dests))]
    reader = ObjectRangeReader(_blob_store(), ["f"], gap_bytes=gap, max_request_bytes=max_request, window_bytes=window)
    reader.read(segs)
    assert all(bytes(d) == _BLOB[a:b] for (a, b), d in zip(ranges, dests))
    assert sorted(seen) == [i for i, d in enumerate(dests) if len(d)]
    needed = sum(b - a for a, b in ranges)
    assert needed <= reader.stats.bytes <= needed + gap * max(len(ranges) - 1, 0)


@pytest.mark.parametrize("kind", ["local", "object"])
def test_commit_writes_the_index_then_removes_only_old_data_files(kind: str, tmp_path: Any) -> None:
    """The one commit, for both storages: the index is whole, then the data files of other saves
    go and nothing else kept there does."""
    from ucp_dcp.byteio.location import LocalDir, StoreDir, commit_index, location_at
    from ucp_dcp.format import FileRecord, Index

    where = str(tmp_path / "ck") if kind == "local" else f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    storage = location_at(where)
    assert isinstance(storage, LocalDir if kind == "local" else StoreDir)
    storage.make()
    for name in ("rank00000-old.safetensors", "rank00000-new.safetensors", "notes.txt"):
        storage.write_atomic(name, b"x")
    index = Index(1, [FileRecord("rank00000-new.safetensors", 0, 1)], {}, {}, {})
    commit_index(storage, index)
    assert sorted(storage.list()) == ["notes.txt", "rank00000-new.safetensors", "ucp_index.json"]
    assert storage.exists("ucp_index.json") and not storage.exists("rank00000-old.safetensors")


class CountingStore(ObjectStore):
    """An ObjectStore that records every ranged read it makes, as ``(name, start, end)``."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.reads: list[tuple[str, int | None, int | None]] = []

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        self.reads.append((name, start, end))
        return super().read(name, start, end)


def test_object_access_extends_its_prefix_in_one_request() -> None:
    """The first read fetches the prefix; a read past it that starts inside it (or right after)
    extends it by the prefix size again in one request; a read elsewhere is a request of its own."""
    from ucp_dcp.byteio.objrange import ObjectAccess

    store = CountingStore(f"memory://ucp-{uuid.uuid4().hex[:8]}/blob")
    store.put("f", _BLOB)
    a = ObjectAccess(store, "f", len(_BLOB), head_bytes=1000)
    assert a.pread(8, 0) == _BLOB[:8] and a.pread(900, 8) == _BLOB[8:908]
    assert store.reads == [("f", 0, 1000)]
    assert a.pread(500, 900) == _BLOB[900:1400]  # the header is longer than the prefix
    assert store.reads[1:] == [("f", 1000, 2400)]
    assert a.pread(800, 1500) == _BLOB[1500:2300]  # what follows the header came with it
    assert a.pread(10, 5000) == _BLOB[5000:5010] and store.reads[2:] == [("f", 5000, 5010)]
    a.release()
    assert a.pread(4, 2400) == _BLOB[2400:2404] and store.reads[3:] == [("f", 2400, 2404)]
    # The prefix never reaches past the object, and a first read beyond the prefix is exact.
    b = ObjectAccess(store, "f", len(_BLOB), head_bytes=10 * len(_BLOB))
    assert b.pread(8, 0) == _BLOB[:8] and store.reads[-1] == ("f", 0, len(_BLOB))
    c = ObjectAccess(store, "f", len(_BLOB), head_bytes=16)
    assert c.pread(4, 100) == _BLOB[100:104] and store.reads[-1] == ("f", 100, 104)
    n = len(store.reads)
    assert c.pread(4, len(_BLOB)) == b"" and c.pread(4, len(_BLOB) + 9) == b"" and len(store.reads) == n  # past the end


def test_an_error_placing_a_window_stops_the_read_before_later_windows_are_placed() -> None:
    """A segment's callback that fails (as a block check does) fails the read with its own error;
    the windows fetched ahead are dropped, none of their segments completed."""
    store = ObjectStore(f"memory://ucp-{uuid.uuid4().hex[:8]}/blob")
    store.put("f", _BLOB)
    done: list[int] = []

    def check(k: int) -> Any:
        def fn(n: int) -> None:
            if k == 0:
                raise CheckpointFormatError(f"block {k} of f differs")
            done.append(k)
        return fn

    segments = [Segment(0, 2048 * k, memoryview(bytearray(1024)), check(k)) for k in range(4)]
    with ObjectRangeReader(store, ["f"], gap_bytes=0, max_request_bytes=1024, window_bytes=1024) as reader:
        with pytest.raises(CheckpointFormatError, match=r"^block 0 of f differs$"):
            reader.read(segments)
    assert done == []


def test_object_range_reader_reads_to_a_near_end_and_keeps_it() -> None:
    """A request ending within the gap of its object's end reads to the end; a later segment there
    is filled from the bytes kept (no request), one elsewhere is not."""
    store = CountingStore(f"memory://ucp-{uuid.uuid4().hex[:8]}/blob")
    store.put("f", _BLOB)
    n = len(_BLOB)
    reader = ObjectRangeReader(store, ["f"], sizes=[n], gap_bytes=100)
    calls: list[tuple[str, int, int]] = []
    real = store.read_ranges
    store.read_ranges = lambda rs: calls.extend(rs) or real(rs)  # type: ignore[method-assign]
    first, tail, before = bytearray(1000), bytearray(50), bytearray(10)
    reader.read([Segment(0, n - 1100, memoryview(first))])
    assert calls == [("f", n - 1100, n)] and bytes(first) == _BLOB[n - 1100 : n - 100]
    seen: list[int] = []
    reader.read([Segment(0, n - 60, memoryview(tail), seen.append)])
    assert len(calls) == 1 and bytes(tail) == _BLOB[n - 60 : n - 10] and seen == [1]
    reader.read([Segment(0, n - 1200, memoryview(before))])
    assert calls[1:] == [("f", n - 1200, n - 1190)] and bytes(before) == _BLOB[n - 1200 : n - 1190]
    assert reader.stats.calls == 2 and reader.stats.bytes == 1100 + 10


def test_a_native_header_and_its_block_checksums_come_in_one_request(monkeypatch: Any) -> None:
    """A data file whose header is over 64 KiB (hundreds of entries): its header and block
    checksums are one request (a header under a 128th of the file, as here, is), its tensors and
    values the others; the load is bit-exact."""
    from ucp_dcp.sources.native import head_request_bytes

    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    sd = {f"layer{i}.weight": full(f"w{i}", (64, 512)) for i in range(250)}
    sd["step"] = 5
    dcp.save(sd, storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    name = next(n for n in ObjectStore(url).list_sizes() if n.endswith(".safetensors"))
    size = ObjectStore(url).size(name)
    reads: list[tuple[str, Any, Any]] = []
    ranges: list[tuple[str, int, int]] = []
    real_read, real_ranges = ObjectStore.read, ObjectStore.read_ranges

    def read(self: ObjectStore, n: str, start: Any = None, end: Any = None) -> bytes:
        reads.append((n, start, end))
        return real_read(self, n, start, end)

    def read_ranges(self: ObjectStore, rs: Any) -> list[bytes]:
        ranges.extend(rs)
        return real_ranges(self, rs)

    monkeypatch.setattr(ObjectStore, "read", read)
    monkeypatch.setattr(ObjectStore, "read_ranges", read_ranges)
    got: dict[str, Any] = {k: torch.zeros_like(v) for k, v in sd.items() if k != "step"}
    got["step"] = -1
    dcp.load(got, storage_reader=UCPStorageReader(url), planner=UCPLoadPlanner())
    assert all(bit_equal(got[k], v) for k, v in sd.items() if k != "step") and got["step"] == 5
    # The header's request goes out with those of the load's other data files (none here).
    assert [r for r in reads if r[0] == name] == [], reads
    header, ranges = ranges[0], ranges[1:]
    assert header == (name, 0, head_request_bytes(size)), header
    (n,) = struct_unpack_header(real_read(ObjectStore(url), name, 0, 8))
    assert n > 64 << 10  # the old 64 KiB first request would have needed two more
    # The tensors in 16 MiB requests (the reader's default); the last reads on to the end of the
    # file, where the value is, which then needs no request of its own.
    tensors = 250 * 64 * 512 * 4
    assert [r[0] for r in ranges] == [name] * -(-tensors // (16 << 20)), ranges
    assert ranges[-1][2] == size, ranges


def struct_unpack_header(head: bytes) -> tuple[int]:
    """The header length a safetensors file starts with."""
    import struct

    return struct.unpack("<Q", head)


def _save_local_2(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": DTensor.from_local(_local(full("w", (64, 256)), mesh, 0), mesh, [Shard(0)]), "step": 3}
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())


def test_the_headers_of_a_load_are_fetched_at_once_and_what_they_hold_costs_no_request(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """A load that reads 2 data files asks for both headers in one batch of concurrent requests
    (not one round trip after the other); the files are smaller than a header's request, so the
    tensors and the value cost no other request."""
    from ucp_dcp.sources.native import head_request_bytes

    run_ranks(2, _save_local_2, str(tmp_path / "ckpt"))
    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    store = ObjectStore(url)
    for f in sorted(os.listdir(tmp_path / "ckpt")):
        store.put(f, (tmp_path / "ckpt" / f).read_bytes())
    data = sorted(n for n in store.list_sizes() if n.endswith(".safetensors"))
    sizes = [store.size(n) for n in data]
    assert len(data) == 2 and all(s <= head_request_bytes(s) for s in sizes)
    batches: list[list[tuple[str, Any, Any]]] = []
    real_read, real_ranges = ObjectStore.read, ObjectStore.read_ranges

    def read(self: ObjectStore, n: str, start: Any = None, end: Any = None) -> bytes:
        batches.append([(n, start, end)])
        return real_read(self, n, start, end)

    def read_ranges(self: ObjectStore, rs: Any) -> list[bytes]:
        batches.append(list(rs))
        return real_ranges(self, rs)

    monkeypatch.setattr(ObjectStore, "read", read)
    monkeypatch.setattr(ObjectStore, "read_ranges", read_ranges)
    got: dict[str, Any] = {"w": torch.zeros(64, 256), "step": -1}
    dcp.load(got, storage_reader=UCPStorageReader(url), planner=UCPLoadPlanner(), no_dist=True)
    assert bit_equal(got["w"], full("w", (64, 256))) and got["step"] == 3
    heads = [(n, 0, s) for n, s in zip(data, sizes)]
    assert [b for b in batches if b[0][0] != "ucp_index.json"] == [heads], batches


def test_a_url_fsspec_cannot_open_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match=r"^nosuchproto://b/x: cannot open this URL with fsspec: Protocol not known"):
        ObjectStore("nosuchproto://b/x")


def test_an_s3_client_that_cannot_be_made_fails_the_request_naming_the_object() -> None:
    """An endpoint the client refuses: the throttling hook lets it be, and the request itself says why."""
    store = ObjectStore("s3://b/x", {"endpoint_url": "not a url", "key": "k", "secret": "s"},
                        requests=RequestPolicy(attempts=1))
    with pytest.raises(StorageError, match=r"^s3://b/x/y: reading the object failed: ValueError: Invalid endpoint: not a url$"):
        store.read("y")


def test_name_of_a_path_outside_the_checkpoint_is_its_last_part() -> None:
    store = ObjectStore(f"memory://ucp-{uuid.uuid4().hex[:8]}/x")
    assert store.name_of(store.url_of("a/b.bin")) == "a/b.bin" and store.name_of(store.path("c")) == "c"
    assert store.name_of("memory://elsewhere/d/e.bin") == "e.bin"


def _joined_composite_threads() -> None:
    for t in threading.enumerate():
        if t.name == "ucp-composite":
            t.join(5)


def test_a_composite_operation_ending_after_its_waiter_left_is_dropped(monkeypatch: Any) -> None:
    """Its waiter cancelled (the future is done), or its loop closed meanwhile: the thread's result
    is dropped, and the thread ends without an error."""
    import asyncio

    from ucp_dcp.byteio.objstore import _in_own_thread

    errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    release = threading.Event()

    async def cancelled() -> None:
        task = asyncio.ensure_future(_in_own_thread(lambda: release.wait(5)))
        await asyncio.sleep(0.01)
        task.cancel()
        release.set()
        await asyncio.sleep(0.05)  # the thread settles on this loop: the future is already done
        assert task.cancelled()

    asyncio.run(cancelled())
    _joined_composite_threads()
    release.clear()

    async def timed_out() -> None:
        await asyncio.wait_for(_in_own_thread(lambda: release.wait(5)), 0.01)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(timed_out())  # the loop is closed before the thread ends
    release.set()
    _joined_composite_threads()
    assert errors == [] and not [t for t in threading.enumerate() if t.name == "ucp-composite"]


def test_discard_never_raises() -> None:
    """A file whose abandon fails (and that takes no attributes) is left as it is, quietly."""
    from ucp_dcp.byteio.objstore import discard

    class Refusing:
        __slots__ = ()

        def discard(self) -> None:
            raise OSError("connection gone")

    assert discard(Refusing()) is None


# ---------------------------------------------------------------- the request scheduler on its own


def test_slots_a_waiter_cancelled_queued_or_after_being_served_loses_no_slot() -> None:
    import asyncio

    from ucp_dcp.byteio.scheduler import Slots

    async def go() -> None:
        slots = Slots(1)
        await slots.acquire()
        queued = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        queued.cancel()  # cancelled while queued: it leaves the queue
        served = asyncio.ensure_future(slots.acquire(hedge=True))
        await asyncio.sleep(0)
        slots.release()  # hands the slot to `served`...
        served.cancel()  # ...cancelled before it ran: it passes the slot on
        for task in (queued, served):
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.wait_for(slots.acquire(), 1)  # the one slot is free again
        late = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0.01)
        assert not late.done()  # and it was the only one
        late.cancel()

    asyncio.run(go())


def test_received_cost() -> None:
    from ucp_dcp.byteio.scheduler import Received

    assert Received(bytes=5, counted=True, sent=False).cost(100) == 0  # never sent: costs nothing
    assert Received(bytes=5, counted=True, sent=True).cost(100) == 5
    assert Received(bytes=5, counted=False, sent=True).cost(100) == 100


def test_throttling_answers_seen_through_the_clients_event_hook_pause_the_stream() -> None:
    """botocore's needs-retry event: a 503 or a SlowDown code counts as a throttle; an event without
    a response (a connection error) or another error does not; a client without events is not hooked."""
    import types

    from botocore.hooks import HierarchicalEmitter

    from ucp_dcp.byteio.scheduler import RequestScheduler

    sched = RequestScheduler(RequestPolicy(throttle_pause_s=0.01))
    sched.hook(object())
    sched.hook(None)
    events = HierarchicalEmitter()
    client = types.SimpleNamespace(meta=types.SimpleNamespace(events=events))
    sched.hook(client)
    sched.hook(client)  # once per client
    events.emit("needs-retry.s3.GetObject", response=None)
    events.emit("needs-retry.s3.GetObject", response=(types.SimpleNamespace(status_code=500), {"Error": {"Code": "InternalError"}}))
    assert sched.stats.throttles == 0
    events.emit("needs-retry.s3.GetObject", response=(types.SimpleNamespace(status_code=503), {}))
    events.emit("needs-retry.s3.PutObject", response=(types.SimpleNamespace(status_code=400), {"Error": {"Code": "SlowDown"}}))
    assert sched.stats.throttles == 2


def test_a_throttling_error_pauses_and_a_short_answer_on_the_one_try_is_truncated() -> None:
    import asyncio

    from ucp_dcp.byteio.scheduler import RequestScheduler

    sched = RequestScheduler(RequestPolicy(attempts=1, throttle_pause_s=0.01))

    async def slow_down(got: Any) -> bytes:
        raise OSError("SlowDown: please reduce your request rate")

    with pytest.raises(StorageError, match=r"^s3://b/o: reading bytes \[0, 8\) failed: OSError: SlowDown"):
        asyncio.run(sched.run(slow_down, 8, where="s3://b/o", what="reading bytes [0, 8)"))
    assert sched.stats.throttles == 1

    async def short(got: Any) -> bytes:
        return b"abc"

    with pytest.raises(TruncatedFileError) as e:
        asyncio.run(sched.run(short, 8, where="s3://b/o", what="reading bytes [0, 8)",
                              check=lambda b: f"got {len(b)} of 8 bytes" if len(b) != 8 else None))
    assert str(e.value) == "s3://b/o: got 3 of 8 bytes: truncated object"


def test_a_request_cancelled_while_paused_by_a_throttle_frees_its_slot() -> None:
    import asyncio

    from ucp_dcp.byteio.scheduler import RequestScheduler

    sched = RequestScheduler(RequestPolicy(max_in_flight=1, throttle_pause_s=0.2))

    async def answer(got: Any) -> bytes:
        return b"ok"

    async def go() -> bytes:
        sched.throttled()
        waiting = asyncio.ensure_future(sched.run(answer, 2, where="s3://b/o", what="reading"))
        await asyncio.sleep(0.02)  # it holds the one slot, waiting for the pause to end
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return await asyncio.wait_for(sched.run(answer, 2, where="s3://b/o", what="reading"), 2)

    assert asyncio.run(go()) == b"ok"


@pytest.mark.parametrize("kind", ["local", "object"])
def test_a_model_dir_answers_for_missing_files(kind: str, tmp_path: Any) -> None:
    """A missing file has no size and removing it is no error, on both storages; the sizes come
    from the file system or the store's listing."""
    from ucp_dcp.byteio.location import location_at

    where = str(tmp_path / "ck") if kind == "local" else f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    storage = location_at(where)
    storage.make()
    storage.write_atomic("a.bin", b"abc")
    storage = location_at(where)  # a fresh view: an object store lists again
    assert storage.size("a.bin") == 3 and storage.size("gone.bin") is None
    assert storage.holds("a.bin") and not storage.holds("gone.bin")  # an object store: from its listing
    storage.remove(["gone.bin", "a.bin"])
    assert storage.list() == []


def test_a_local_file_that_cannot_be_read_is_named(tmp_path: Any) -> None:
    from ucp_dcp.byteio.location import location_at

    storage = location_at(str(tmp_path))
    (tmp_path / "ucp_index.json").mkdir()  # a directory where the file should be
    with pytest.raises(CheckpointFormatError) as e:
        storage.read("ucp_index.json")
    assert str(e.value) == f"{tmp_path}/ucp_index.json: cannot read (Is a directory)"
