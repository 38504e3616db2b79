"""Object-store requests that cannot stall a load or a save (issue 25): deadlines, hedged reads,
a bounded and throttle-aware request stream (``ucp_dcp.byteio.requests``).

Every test runs against moto's S3 server behind the fault proxy (tests/fault_proxy.py): a GET
or a part upload that never answers ("stall"), GETs much slower than the others ("slow"), a
503 SlowDown. Loads and saves finish bit-exact through a retry or a hedge, or fail with the
library's StorageError naming the object, the byte range, the rank and how long it waited,
within the configured deadlines (a rank whose GETs never answer failing every rank of a 3-rank
load, with and without the read-once exchange: tests/test_object_store.py, which spawns those
ranks already). Each test is bounded by a watchdog of its own; the deadlines
are short (under a second) so the file costs a few seconds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fault_proxy
import s3_server
from dist_utils import bit_equal, watchdog  # noqa: F401 (watchdog: an autouse fixture)
from ucp_dcp import ReadOptions, RequestPolicy, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.byteio.objstore import ObjectStore, discard
from ucp_dcp.errors import StorageError

s3_bucket = s3_server.s3_bucket  # session fixtures, made visible to this module
s3_proxy = fault_proxy.s3_proxy


# Short deadlines: a stalled request is abandoned after at most a second.
FAST = RequestPolicy(deadline_floor_s=0.3, deadline_cap_s=1.0, hedge_floor_s=0.1)



def _ranged_get(m: str, p: str, h: Any) -> bool:
    return m == "GET" and h.get("Range") is not None


def _part(number: int | None = None) -> Any:
    def match(m: str, p: str, h: Any) -> bool:
        return m == "PUT" and (f"partNumber={number}&" in p + "&" if number else "partNumber=" in p)

    return match


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(77, generator=g), "step": seed}


def _zeros(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in sd.items()}


def _same(got: dict[str, Any], sd: dict[str, Any]) -> bool:
    return all(bit_equal(got[k], v) if torch.is_tensor(v) else got[k] == v for k, v in sd.items())


def test_a_stalled_get_is_abandoned_at_its_deadline_and_the_load_is_bit_exact(s3_proxy: Any) -> None:
    base, options, proxy = s3_proxy
    url = f"{base}/stall-{uuid.uuid4().hex[:8]}"
    sd = _state(1)
    dcp.save(sd, storage_writer=UCPStorageWriter(url, storage_options=options), planner=UCPSavePlanner())
    proxy.reset_records()
    proxy.inject("stall", count=1, match=_ranged_get)  # the data file's first ranged GET never answers
    got = _zeros(sd)
    policy = RequestPolicy(deadline_floor_s=0.3, deadline_cap_s=1.0, hedge=False)  # deadlines only
    reader = UCPStorageReader(url, storage_options=options, options=ReadOptions(requests=policy))
    t0 = time.monotonic()
    dcp.load(got, storage_reader=reader, planner=UCPLoadPlanner())
    took = time.monotonic() - t0
    assert _same(got, sd)
    assert proxy.count(fault="stall") == 1
    stats = reader.source.store.stats
    # Nothing was observed before that first GET: it waited its size's time at 1 MiB/s (at least
    # the floor, 0.3 s; at most the cap, 1 s), then was sent again.
    assert stats.timeouts == 1 and stats.retries == 1, stats
    assert 0.3 <= took < 1.0 + 5, took


def _warmed(s3_proxy: Any, policy: RequestPolicy, piece: int, n: int) -> tuple[ObjectStore, bytes, list[Any]]:
    """A store under ``policy`` holding an object of ``n`` pieces, each read once (the running
    medians); the proxy's records start afresh. Returns the store, the object's bytes and the
    pieces' ranges."""
    base, options, proxy = s3_proxy
    store = ObjectStore(f"{base}/hedge-{uuid.uuid4().hex[:8]}", options, requests=policy)
    data = os.urandom(n * piece)
    store.put("obj", data)
    ranges = [("obj", o, o + piece) for o in range(0, len(data), piece)]
    assert b"".join(store.read_ranges(ranges)) == data
    proxy.reset_records()
    return store, data, ranges


# Deadlines far off: only a hedge can finish a slowed GET early.
PATIENT = RequestPolicy(deadline_floor_s=8.0, deadline_cap_s=10.0, hedge_floor_s=0.1)


def test_slow_gets_are_hedged_within_the_byte_budget(s3_proxy: Any) -> None:
    _, _, proxy = s3_proxy
    policy = PATIENT
    piece = 64 << 10
    store, data, ranges = _warmed(s3_proxy, policy, piece, 64)
    before = dataclasses.replace(store.stats)
    proxy.inject("slow", count=2, match=_ranged_get, delay_s=1.2)  # 20x and more the others' time
    t0 = time.monotonic()
    assert b"".join(store.read_ranges(ranges[:16])) == data[: 16 * piece]
    took = time.monotonic() - t0
    s, b = store.stats, before
    got = (s.hedges - b.hedges, s.hedge_wins - b.hedge_wins, s.hedged_bytes - b.hedged_bytes, s.timeouts)
    assert got == (2, 2, 2 * piece, 0), s
    assert s.hedge_extra_bytes <= max(policy.hedge_fraction * s.bytes_requested, policy.hedge_allowance_bytes), s
    assert took < 1.2, took  # the slowed answers came 1.2 s after they were asked for
    # At the server's side: the two slowed ranges were asked for twice, every other range once.
    slowed = {r.range for r in proxy.select("GET", fault="slow")}
    asked = [r.range for r in proxy.select("GET")]
    assert len(slowed) == 2 and all(asked.count(r) == 2 for r in slowed), asked
    assert len(asked) == 16 + 2


def test_a_hedge_costs_the_bytes_its_loser_sent_not_its_size(s3_proxy: Any) -> None:
    """Three GETs trickle (a piece of 64 KiB at once, the rest over 2 s): each is hedged and
    cancelled after its first piece or two. The budget (600 KiB) holds two hedges of 256 KiB in flight, not three hedges' sizes; it
    is charged what the losers sent (counted as their bodies arrived), so the third hedge fits once
    the first two are settled. The server's own count bounds the library's from above."""
    _, _, proxy = s3_proxy
    policy = dataclasses.replace(PATIENT, hedge_allowance_bytes=600 << 10)
    piece = 256 << 10
    store, data, ranges = _warmed(s3_proxy, policy, piece, 16)
    before = dataclasses.replace(store.stats)
    proxy.inject("trickle", count=3, match=_ranged_get, delay_s=2.0)
    t0 = time.monotonic()
    assert b"".join(store.read_ranges(ranges[:8])) == data[: 8 * piece]
    took = time.monotonic() - t0
    s = store.stats
    hedges, wins = s.hedges - before.hedges, s.hedge_wins - before.hedge_wins
    asked, extra = s.hedged_bytes - before.hedged_bytes, s.hedge_extra_bytes - before.hedge_extra_bytes
    assert (hedges, wins, asked, s.timeouts) == (3, 3, 3 * piece, 0), s
    assert asked > policy.hedge_allowance_bytes  # what the hedges asked for exceeds the budget...
    assert s.hedge_extra_bytes <= policy.hedge_allowance_bytes, s  # ...what they cost does not
    assert took < 2.0, took  # no trickled answer was waited for
    # The server's side: each trickled answer sent its first piece, and maybe the next (a write
    # into a connection the client closed succeeds once); the library counted the pieces that
    # arrived: each loser's first, at most what the server sent.
    trickled = proxy.select("GET", fault="trickle")
    sent = sum(r.response_bytes for r in trickled)
    assert len(trickled) == 3 and sent < 3 * piece, trickled
    assert 3 * fault_proxy.TRICKLE_PIECE <= extra <= sent, (extra, sent)
    assert proxy.bytes_sent("GET") == 8 * piece + sent


def test_a_slow_hedge_is_replaced_by_another(s3_proxy: Any) -> None:
    """A slowed GET whose hedge is slowed too (each of a load's GETs, hedges included, is as likely
    to be): once the hedge has taken as long, it is cancelled and another sent, which answers."""
    _, _, proxy = s3_proxy
    piece = 64 << 10
    store, data, ranges = _warmed(s3_proxy, PATIENT, piece, 32)
    before = dataclasses.replace(store.stats)
    third = f"bytes={2 * piece}-{3 * piece - 1}"
    proxy.inject("slow", count=2, match=lambda m, p, h: _ranged_get(m, p, h) and h["Range"] == third,
                 delay_s=2.0)
    t0 = time.monotonic()
    assert b"".join(store.read_ranges(ranges[:8])) == data[: 8 * piece]
    took = time.monotonic() - t0
    s = store.stats
    assert (s.hedges - before.hedges, s.hedge_wins - before.hedge_wins, s.timeouts) == (2, 1, 0), s
    asked = sorted((r for r in proxy.select("GET") if r.range == third), key=lambda r: r.started_s)
    assert [r.fault for r in asked] == ["slow", "slow", None], asked
    assert took < 2.0, took


def test_the_last_gets_of_a_read_slowed_together_are_both_hedged(s3_proxy: Any) -> None:
    """The two GETs sent last are slowed: no GET sent after them can answer first (what marks a GET
    as slow among its peers), but with two tries left in flight each is judged on its own time."""
    _, _, proxy = s3_proxy
    piece = 64 << 10
    store, data, ranges = _warmed(s3_proxy, PATIENT, piece, 32)
    before = dataclasses.replace(store.stats)
    last = {f"bytes={k * piece}-{(k + 1) * piece - 1}" for k in (6, 7)}
    proxy.inject("slow", count=2, match=lambda m, p, h: _ranged_get(m, p, h) and h["Range"] in last,
                 delay_s=2.0)
    t0 = time.monotonic()
    assert b"".join(store.read_ranges(ranges[:8])) == data[: 8 * piece]
    took = time.monotonic() - t0
    s = store.stats
    assert (s.hedges - before.hedges, s.hedge_wins - before.hedge_wins) == (2, 2), s
    assert took < 2.0, took


def test_no_hedge_beyond_the_budget(s3_proxy: Any) -> None:
    base, options, proxy = s3_proxy
    policy = RequestPolicy(deadline_floor_s=8.0, deadline_cap_s=10.0, hedge_floor_s=0.1,
                           hedge_allowance_bytes=256 << 10)
    store = ObjectStore(f"{base}/budget-{uuid.uuid4().hex[:8]}", options, requests=policy)
    data = os.urandom(2 << 20)
    store.put("obj", data)
    ranges = [("obj", o, o + (512 << 10)) for o in range(0, len(data), 512 << 10)]
    store.read_ranges(ranges)  # 4 requests of 512 KiB: the running medians
    proxy.inject("slow", count=1, match=_ranged_get, delay_s=0.6)
    # 8 requests of 512 KiB in all: a budget of 5% of 4 MiB (205 KiB), or the allowance of 256 KiB
    # while that is more: less than one request.
    assert b"".join(store.read_ranges(ranges)) == data
    assert store.stats.hedges == 0 and store.stats.hedged_bytes == 0, store.stats


def test_part_bytes_is_half_the_hedge_budget_within_the_policy_bounds() -> None:
    from ucp_dcp.byteio.scheduler import RequestScheduler

    policy = RequestPolicy(hedge_allowance_bytes=0, min_part_bytes=1 << 20, max_part_bytes=8 << 20)
    sched = RequestScheduler(policy)
    assert sched.part_bytes(32 << 20) == 1 << 20  # 5% of 32 MiB / 2 = 0.8 MiB: the least part
    assert sched.part_bytes(160 << 20) == 4 << 20  # 5% of 160 MiB / 2
    sched.expect(320 << 20)  # a read of 320 MiB is under way: the budget counts it from now
    assert sched.part_bytes(32 << 20) == 8 << 20  # 5% of 320 MiB / 2
    sched.stats.bytes_requested = 10 << 30  # later in a load of 10 GiB
    assert sched.part_bytes(0) == 8 << 20  # the most
    no_hedge = RequestScheduler(dataclasses.replace(policy, hedge=False))
    assert no_hedge.part_bytes(64 << 20) == 8 << 20


def test_a_large_ranged_get_is_sent_as_parts_and_joined_bit_exact(s3_proxy: Any) -> None:
    base, options, proxy = s3_proxy
    part = 256 << 10
    policy = RequestPolicy(min_part_bytes=part, max_part_bytes=part, max_in_flight=3)
    store = ObjectStore(f"{base}/parts-{uuid.uuid4().hex[:8]}", options, requests=policy)
    data = os.urandom(3 << 20)
    store.put("obj", data)
    proxy.reset_records()
    start, end = 1000, 1000 + 4 * part + 77  # 4 whole parts and 77 bytes
    assert store.read_ranges([("obj", start, end), ("obj", 0, 10)]) == [data[start:end], data[:10]]
    asked = sorted(r.range for r in proxy.select("GET"))
    want = [f"bytes={s}-{min(s + part, end) - 1}" for s in range(start, end, part)] + ["bytes=0-9"]
    assert asked == sorted(want), asked
    s = store.stats
    # The PUT is a scheduled request too (not counted in the bytes requested: those are the reads').
    assert (s.requests, s.bytes_requested, s.hedges, s.retries) == (1 + 6, end - start + 10, 0, 0), s
    assert s.most_in_flight <= 3 and proxy.max_in_flight("GET") <= 3


def test_slow_parts_of_a_large_get_are_hedged_sooner_than_the_prior_one_at_a_time_within_the_budget(
    s3_proxy: Any,
) -> None:
    base, options, proxy = s3_proxy
    part = 512 << 10
    # Deadlines far off, and nothing observed before: the prior (first_hedge_s) would hedge a
    # part only after 2 s; the parts that complete meanwhile tell sooner that it is slow.
    policy = RequestPolicy(deadline_floor_s=8.0, deadline_cap_s=10.0, hedge_floor_s=0.1,
                           min_part_bytes=part, max_part_bytes=part, max_in_flight=4,
                           hedge_allowance_bytes=256 << 10, first_hedge_s=2.0)
    store = ObjectStore(f"{base}/hedge-parts-{uuid.uuid4().hex[:8]}", options, requests=policy)
    data = os.urandom(12 << 20)
    store.put("obj", data)
    proxy.reset_records()
    # The first two parts (one GET of 12 MiB: 24 parts) are held 1.5 s. The budget, 5% of 12 MiB
    # (614 KiB), holds one hedge of 512 KiB in flight (more than the allowance, 256 KiB), not two:
    # the second is sent once the first has won, its loser having cost nothing.
    proxy.inject("slow", count=2, match=_ranged_get, delay_s=1.5)
    t0 = time.monotonic()
    assert store.read("obj", 0, len(data)) == data
    took = time.monotonic() - t0
    s = store.stats
    assert (s.hedges, s.hedge_wins, s.hedged_bytes, s.hedge_extra_bytes, s.timeouts) == (2, 2, 2 * part, 0, 0), s
    slowed = [r.range for r in proxy.select("GET", fault="slow")]
    gets = proxy.select("GET")
    assert len(slowed) == 2 and all([r.range for r in gets].count(x) == 2 for x in slowed), gets
    assert len(gets) == 24 + 2
    hedges = sorted((r for r in gets if r.range in slowed and r.fault is None), key=lambda r: r.started_s)
    first = min(r.started_s for r in gets)
    assert hedges[0].started_s - first < 1.0, hedges[0].started_s - first
    assert hedges[1].started_s >= hedges[0].started_s + hedges[0].elapsed_s  # one at a time
    assert took < 1.5, took  # neither slowed answer was waited for


def _query(p: str) -> list[str]:
    return p.partition("?")[2].split("&")


def test_a_stalled_multipart_create_complete_and_delete_are_abandoned_and_retried(s3_proxy: Any) -> None:
    """The multipart bookkeeping calls and DELETEs are scheduled requests too: each stalled once,
    each abandoned at its deadline and sent again; the object is whole, then gone."""
    base, options, proxy = s3_proxy
    store = ObjectStore(f"{base}/bookkeeping-{uuid.uuid4().hex[:8]}", options, write_block_bytes=5 << 20,
                        upload_parallel=2, requests=FAST)
    data = os.urandom(6 << 20)  # parts of 5 and 1 MiB
    proxy.reset_records()
    proxy.inject("stall", count=1, match=lambda m, p, h: m == "POST" and any(
        q in ("uploads", "uploads=") for q in _query(p)))
    proxy.inject("stall", count=1, match=lambda m, p, h: m == "POST" and any(
        q.startswith("uploadId=") for q in _query(p)))
    proxy.inject("stall", count=1, match=lambda m, p, h: m == "DELETE")
    t0 = time.monotonic()
    out = store.open_write("obj")
    out.write(data)
    out.close()
    assert store.read("obj") == data
    store.remove(["obj"])
    took = time.monotonic() - t0
    assert "obj" not in store.list_sizes()
    posts = [(r.query, r.fault) for r in proxy.select("POST")]
    assert [f for q, f in posts if "uploads" in q.split("&") or "uploads=" in q.split("&")] == ["stall", None], posts
    assert [f for q, f in posts if q.startswith("uploadId=") or "&uploadId=" in q] == ["stall", None], posts
    assert [r.fault for r in proxy.select("DELETE")] == ["stall", None]
    assert proxy.count(fault="stall") == 3 and store.stats.timeouts == 3, store.stats
    # Create and DELETE are round trips (the floor, 0.3 s); the complete gets the cap (1 s).
    assert took < 2 * FAST.deadline_floor_s + FAST.deadline_cap_s + 3, took


def test_a_503_burst_pauses_the_whole_stream(s3_proxy: Any) -> None:
    base, options, proxy = s3_proxy
    # The pause outlasts botocore's own backoff before it retries a 503 (under 1 s for the first
    # retry): requests still wait for a slot when the throttled ones are answered, then wait for
    # the pause (throttle_wait_s).
    policy = RequestPolicy(max_in_flight=2, throttle_pause_s=1.2, throttle_max_pause_s=1.2, hedge=False)
    store = ObjectStore(f"{base}/slowdown-{uuid.uuid4().hex[:8]}", options, requests=policy)
    data = os.urandom(1 << 20)
    store.put("obj", data)
    proxy.reset_records()
    proxy.inject("503", count=2, match=_ranged_get)
    ranges = [("obj", o, o + (64 << 10)) for o in range(0, len(data), 64 << 10)]
    assert b"".join(store.read_ranges(ranges)) == data
    recs = proxy.select("GET")
    throttled = [r for r in recs if r.fault == "503"]
    assert len(throttled) == 2 and store.stats.throttles == 2, store.stats
    first_503 = min(r.started_s + r.elapsed_s for r in throttled)
    # No new request started within the pause after the first SlowDown (botocore's own retries of
    # the throttled ranges may), and never more than 2 at once.
    again = {r.range for r in throttled}
    new = [r.started_s - first_503 for r in recs if r.range not in again and r.started_s > first_503]
    assert new and min(new) >= 1.15, sorted(new)
    assert store.stats.throttle_wait_s > 0 and store.stats.most_in_flight <= 2, store.stats
    assert proxy.max_in_flight("GET") <= 2


def test_a_stalled_part_upload_is_retried_and_a_dead_one_fails_naming_the_part_and_is_aborted(
    s3_proxy: Any,
) -> None:
    base, options, proxy = s3_proxy
    url = f"{base}/parts-{uuid.uuid4().hex[:8]}"
    # A floor of 1 s, not FAST's 0.3: a 5 MiB part through moto on a loaded 2-core machine can
    # take longer than 0.3 s without stalling, and only the stalled part may time out here.
    patient = RequestPolicy(deadline_floor_s=1.0, deadline_cap_s=2.0, hedge_floor_s=0.1)
    store = ObjectStore(url, options, write_block_bytes=5 << 20, upload_parallel=2, requests=patient)
    data = os.urandom(6 << 20)  # parts of 5 and 1 MiB
    proxy.inject("stall", count=1, match=_part(2))
    out = store.open_write("obj")
    out.write(data)
    out.close()
    assert store.read("obj") == data
    assert proxy.count(fault="stall") == 1 and store.stats.timeouts == 1, store.stats

    policy = RequestPolicy(attempts=2, deadline_floor_s=0.3, deadline_cap_s=0.5)
    store = ObjectStore(url, options, write_block_bytes=5 << 20, upload_parallel=2, requests=policy)
    proxy.inject("stall", count=1000, match=_part(1))
    out = store.open_write("dead")
    t0 = time.monotonic()
    with pytest.raises(StorageError) as e:
        out.write(data)
        out.close()
    took = time.monotonic() - t0
    # The abort that discard() sends stalls once too: abandoned at its deadline, sent again.
    proxy.reset_records()
    proxy.inject("stall", count=1, match=lambda m, p, h: m == "DELETE" and "uploadId=" in p)
    t1 = time.monotonic()
    discard(out)
    aborted_in = time.monotonic() - t1
    proxy.clear()
    assert [r.fault for r in proxy.select("DELETE")] == ["stall", None]
    assert aborted_in < 2 * policy.deadline_floor_s + 1.0, aborted_in
    bucket, _, prefix = store.root.partition("/")
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert not [u for u in uploads if u["Key"].endswith("/dead")], uploads
    assert re.fullmatch(
        re.escape(f"{url}/dead") + r": uploading part 1 \(bytes \[0, 5242880\)\) failed \(after 2 tries\): "
        r"DeadlineExceeded: rank 0 got no answer within the deadline of each of 2 tries "
        r"\(0\.50, 0\.50 s for 5242880 bytes\) and waited 1\.\d\d s in all",
        str(e.value),
    ), str(e.value)
    assert took < 3.0, took
    assert "dead" not in store.list_sizes()


def _head(m: str, p: str, h: Any) -> bool:
    return m == "HEAD"


def _index_put(m: str, p: str, h: Any) -> bool:
    return m == "PUT" and "ucp_index.json" in p


def _list(m: str, p: str, h: Any) -> bool:
    return m == "GET" and "list-type=" in p


def test_a_stalled_head_and_a_stalled_index_put_are_abandoned_and_the_save_is_bit_exact(
    s3_proxy: Any,
) -> None:
    base, options, proxy = s3_proxy
    url = f"{base}/meta-{uuid.uuid4().hex[:8]}"
    sd = _state(2)
    proxy.reset_records()
    # The save's first HEAD (is there a committed index already?) and its index PUT never answer.
    proxy.inject("stall", count=1, match=_head)
    proxy.inject("stall", count=1, match=_index_put)
    # A floor of 0.6 s, not FAST's 0.3 s: the save's other requests (a 2 MB PUT among them) must
    # not pass theirs on a busy machine (a third timeout was seen once in CI).
    policy = dataclasses.replace(FAST, deadline_floor_s=0.6)
    writer = UCPStorageWriter(url, storage_options=options, requests=policy)
    t0 = time.monotonic()
    dcp.save(sd, storage_writer=writer, planner=UCPSavePlanner())
    took = time.monotonic() - t0
    stats = writer.storage.store.stats
    assert proxy.count(fault="stall") == 2 and proxy.pending() == 0
    assert stats.timeouts == 2 and stats.retries == 2, stats
    # Each was sent again: one stalled HEAD and one stalled index PUT, each followed by an answer.
    assert [r.fault for r in proxy.select("PUT") if "ucp_index.json" in r.path] == ["stall", None]
    assert took < 2 * policy.deadline_cap_s + 3, took
    got = _zeros(sd)
    dcp.load(got, storage_reader=UCPStorageReader(url, storage_options=options, options=ReadOptions(requests=FAST)),
             planner=UCPLoadPlanner())
    assert _same(got, sd)


def test_metadata_requests_that_stall_on_every_try_fail_naming_the_object_within_the_deadlines(
    s3_proxy: Any,
) -> None:
    base, options, proxy = s3_proxy
    url = f"{base}/meta-dead-{uuid.uuid4().hex[:8]}"
    policy = RequestPolicy(attempts=2, deadline_floor_s=0.3, deadline_cap_s=0.5)
    store = ObjectStore(url, options, requests=policy)
    store.put("obj", b"x" * 1000)
    # What they answer when nothing stalls: a missing object is an answer, not a failure.
    assert store.exists("obj") and not store.exists("nothing")
    assert store.read_if_exists("nothing") is None and store.read_if_exists("obj") == b"x" * 1000
    assert store.size("obj") == 1000 and store.list_sizes() == {"obj": 1000}
    failed = {}
    for what, match, call in [
        ("listing the checkpoint", _list, store.list_sizes),
        ("reading the object's size", _head, lambda: store.size("obj")),
    ]:
        proxy.inject("stall", count=1000, match=match)
        t0 = time.monotonic()
        with pytest.raises(StorageError) as e:
            call()
        failed[what] = time.monotonic() - t0
        proxy.clear()
        where = url + ("/obj" if "size" in what else "")
        assert re.fullmatch(
            re.escape(f"{where}: {what} failed (after 2 tries): ") + r"DeadlineExceeded: rank 0 got no "
            r"answer within the deadline of each of 2 tries \(0\.30, 0\.30 s for 0 bytes\) and waited "
            r"0\.\d\d s in all",
            str(e.value),
        ), str(e.value)
    assert all(took < 1.5 for took in failed.values()), failed
    assert store.stats.timeouts == 4, store.stats
