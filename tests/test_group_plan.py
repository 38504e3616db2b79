"""The compact job read plan (dcp/read_once/rounds.py): ranks with identical needs as one group.

Checked byte by byte on random mixes of groups (everyone, a replica group, single ranks) with
partial overlaps: every needed byte has exactly one reader, which needs it; every rank receives,
from the rows to its group, exactly the bytes it needs, each once; the rounds each rank cuts
from its share (read_once ``rank_shares``) keep the budget and agree at both ends of
every message; and the plan's size does not grow with the ranks a group holds.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from readplan_reference import members, need_groups, per_rank, receives, sends
from test_readplan import ALIGNS, MIN_RUNS, Needs, _need_masks, _pages, _ranges, random_needs

from ucp_dcp.dcp.read_once import messages, rank_shares
from ucp_dcp.dcp.read_once.exchange import RankRounds
from ucp_dcp.dcp.read_once.plan import plan_job_reads
from ucp_dcp.dcp.read_once.ranges import water_fill
from ucp_dcp.dcp.read_once.rounds import GroupReadPlan, NeedGroups, needs_digest, plan_group_reads
from ucp_dcp.errors import InvalidArgumentError


def check_group_plan(needs: Needs, sizes: dict[int, int], plan: GroupReadPlan) -> None:
    """Exactly one reader per needed page, and exactly each rank's needs received."""
    world, align = len(needs), plan.align
    want = _need_masks(needs, sizes)
    readers = {f: np.full(n, -1) for f, n in sizes.items()}
    for r in range(world):
        lo, hi = int(plan.read_offsets[r]), int(plan.read_offsets[r + 1])
        assert np.all(plan.read_rank[lo:hi] == r)
        for f, s, n in zip(
            plan.read_file[lo:hi].tolist(),
            plan.read_start[lo:hi].tolist(),
            plan.read_length[lo:hi].tolist(),
        ):
            assert n > 0 and s % align == 0
            assert np.all(readers[f][s : s + n] == -1), "a byte read twice"
            readers[f][s : s + n] = r
            # A reader reads only pages it needs itself.
            assert _pages(want[r][f], align)[s : s + n].all()
    for f in sizes:
        anyone = np.any([want[r][f] for r in range(world)], axis=0)
        assert np.all(readers[f][anyone] >= 0), "a needed byte with no reader"
    got = [{f: np.zeros(n, np.int64) for f, n in sizes.items()} for _ in range(world)]
    t = plan.transfers
    for r in range(world):
        rows = receives(plan, r)
        for q, f, s, n in zip(
            rows.reader.tolist(), rows.file.tolist(), rows.start.tolist(), rows.length.tolist()
        ):
            got[r][f][s : s + n] += 1
            assert np.all(readers[f][s : s + n] == q), "sent by a rank that does not read it"
        for f in sizes:
            assert np.array_equal(got[r][f], want[r][f].astype(np.int64)), (r, f)
    # ``at`` is where the row starts in its reader's reads laid end to end.
    for i in range(len(t)):
        q, f, s, at = int(t.reader[i]), int(t.file[i]), int(t.start[i]), int(t.at[i])
        lo, hi = int(plan.read_offsets[q]), int(plan.read_offsets[q + 1])
        ends = np.cumsum(plan.read_length[lo:hi])
        j = int(np.searchsorted(ends, at, side="right"))
        assert int(plan.read_file[lo + j]) == f
        assert int(plan.read_start[lo + j]) + at - int(ends[j] - plan.read_length[lo + j]) == s
    assert plan.needed_bytes == sum(int(m.sum()) for w in want for m in w.values())
    assert plan.bytes_read_per_rank.sum() == plan.read_bytes
    own = [sum(int((got[r][f] * (readers[f] == r)).sum()) for f in sizes) for r in range(world)]
    received = [sum(int(got[r][f].sum()) for f in sizes) - own[r] for r in range(world)]
    assert plan.bytes_received_per_rank.tolist() == received


def check_shares(plan: GroupReadPlan, budget: int) -> None:
    """Each rank's rounds, cut from its own share: both ends of every message agree, every rank
    reads, sends and receives at most ``budget`` a round, and over all rounds each rank gets
    what the plan sends it, each byte once."""
    world = plan.world_size
    try:
        count, windows, sends, recvs = rank_shares(plan, budget)
    except InvalidArgumentError as e:
        assert "budget_bytes" in str(e)
        return
    group_of = plan.groups.group_of
    shares = [
        RankRounds(count, sends[r], recvs[int(group_of[r])], windows, group_of)
        for r in range(world)
    ]
    total = np.zeros(world, np.int64)
    for k in range(count):
        rounds = [shares[r].round(k, r, world) for r in range(world)]
        for me in range(world):
            out = sum(int(p[:, 2].sum()) for p in rounds[me].sends if len(p))
            into = sum(int(p[:, 2].sum()) for p in rounds[me].recvs if len(p))
            assert out <= budget and into <= budget, (k, me)
            for p in range(world):
                assert np.array_equal(rounds[me].sends[p], rounds[p].recvs[me]), (k, me, p)
                if len(rounds[me].sends[p]):
                    assert int(rounds[me].sends[p][:, 2].sum()) * _fan(plan, me) <= budget
            total[me] += into
    expect = np.array([int(receives(plan, r).length.sum()) for r in range(world)])
    assert np.array_equal(total, expect)


def _fan(plan: GroupReadPlan, q: int) -> int:
    """The ranks reader ``q`` sends to."""
    groups = np.unique(sends(plan, q).group)
    return int(plan.groups.sizes[groups].sum())


@st.composite
def grouped_needs(draw: st.DrawFn) -> tuple[Needs, dict[int, int]]:
    """Random needs (partial overlaps, empty ranks) with ranks repeated: some needs given to a
    whole group (every rank, a replica group) and others to single ranks."""
    base, sizes = draw(random_needs())
    copies = draw(st.lists(st.integers(1, 5), min_size=len(base), max_size=len(base)))
    needs = [e for e, c in zip(base, copies) for _ in range(c)]
    order = draw(st.permutations(range(len(needs))))
    return [needs[i] for i in order], sizes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_needs(), ALIGNS, MIN_RUNS, st.booleans())
def test_grouped_needs_one_reader_and_exact_receipt(
    case: tuple[Needs, dict[int, int]], align: int, min_run: int, known: bool
) -> None:
    needs, sizes = case
    groups = need_groups(needs)
    plan = plan_group_reads(
        groups, align=align, min_run=min_run, file_sizes=sizes if known else None
    )
    check_group_plan(needs, sizes, plan)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_needs(), ALIGNS, st.integers(1, 20000))
def test_each_ranks_share_cuts_rounds_that_agree_and_keep_the_budget(
    case: tuple[Needs, dict[int, int]], align: int, budget: int
) -> None:
    needs, sizes = case
    plan = plan_group_reads(need_groups(needs), align=align, min_run=0, file_sizes=sizes)
    check_shares(plan, budget)


def test_everyone_needs_everything_one_row_per_piece_whatever_the_ranks() -> None:
    size = 4096 * 100
    rows = {}
    for world in (4, 64, 1024):
        needs = [{0: _ranges([(0, size)])} for _ in range(world)]
        groups = need_groups(needs)
        assert groups.group_of.tolist() == [0] * world and len(groups.extents) == 1
        plan = plan_group_reads(groups, align=4096, min_run=4096, file_sizes={0: size})
        # One piece per reader (100 pages over min(world, 100) readers), each to the one group.
        readers = min(world, 100)
        assert len(plan.transfers) == readers == len(plan.read_rank)
        assert plan.transfers.group.tolist() == [0] * readers
        loads = plan.bytes_read_per_rank
        assert loads.sum() == size and loads.max() - loads[loads > 0].min() <= 4096
        assert plan.needed_bytes == world * size and plan.unique_bytes == size
        rows[world] = len(plan.transfers)
    assert rows == {4: 4, 64: 64, 1024: 100}
    # Expanded per rank it is the per-rank plan's bytes: each reader's piece to every rank.
    expanded = per_rank(plan)
    assert len(expanded) == 100 * 1024 and expanded.nbytes == 1024 * size


def test_hsdp_replicas_and_everyone_mixed() -> None:
    """Ranks 0-3 all need a shared head [0, 8192); replicas (0, 2) and (1, 3) need one shard
    each of [8192, 40960); rank 4 needs only part of shard 0, unaligned."""
    head = (0, 8192)
    shard = [(8192, 16384), (24576, 16384)]
    needs: Needs = [{0: _ranges([head, shard[r % 2]])} for r in range(4)]
    needs.append({0: _ranges([(9000, 3000)])})
    groups = need_groups(needs)
    assert groups.group_of.tolist() == [0, 1, 0, 1, 2]
    plan = plan_group_reads(groups, align=4096, min_run=4096, file_sizes={0: 40960})
    check_group_plan(needs, {0: 40960}, plan)
    check_shares(plan, 1 << 16)
    # Every rank of group 0 gets the same rows; rank 4 only its 3000 bytes.
    assert receives(plan, 0).length.sum() == receives(plan, 2).length.sum() == 8192 + 16384
    r4 = receives(plan, 4)
    assert r4.length.sum() == 3000 and set(r4.group.tolist()) == {2}


def test_groups_are_weighted_by_their_ranks() -> None:
    """Three replicas and one rank alone share every byte: each of the four reads a quarter
    (the unweighted group plan would give the lone rank half)."""
    size = 4096 * 64
    needs = [{0: _ranges([(0, size)])} for _ in range(3)] + [{0: _ranges([(0, size)])}]
    needs[3] = {0: _ranges([(0, size - 1), (size - 1, 1)])}  # the same bytes, written apart
    plan = plan_group_reads(need_groups(needs), align=4096, min_run=4096, file_sizes={0: size})
    assert plan.groups.group_of.tolist() == [0, 0, 0, 1]
    assert plan.bytes_read_per_rank.tolist() == [size // 4] * 4
    check_group_plan(needs, {0: size}, plan)


def test_water_fill_weighted_is_per_weight_and_exact() -> None:
    assert water_fill(np.array([5, 0, 100]), 50, np.array([1, 3, 1])).tolist() == [8, 42, 0]
    loads = np.array([7, 3, 0, 12])
    assert np.array_equal(
        water_fill(loads, 31, np.ones(4, np.int64)), water_fill(loads, 31)
    )  # all ones: the unweighted rule exactly
    assert water_fill(np.array([0, 0]), 7, np.array([2, 5])).tolist() == [2, 5]


def test_digest_tells_needs_apart_and_groups_are_numbered_by_lowest_rank() -> None:
    a, b = {0: _ranges([(0, 10)])}, {0: _ranges([(0, 11)])}
    assert needs_digest(a) == needs_digest({0: _ranges([(0, 10)])})
    assert needs_digest(a) != needs_digest(b) != needs_digest({1: _ranges([(0, 11)])})
    assert needs_digest({}) != needs_digest({0: _ranges([])})
    groups = need_groups([b, a, b, {}, a])
    assert groups.group_of.tolist() == [0, 1, 0, 2, 1]
    assert groups.sizes.tolist() == [2, 2, 1] and members(groups, 1).tolist() == [1, 4]


def test_bad_groups_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match="rank 2 is the lowest rank of its group"):
        NeedGroups.from_digests([b"x", b"x", b"y"], {0: {}})
    with pytest.raises(InvalidArgumentError, match="group 1 has no ranks"):
        plan_group_reads(NeedGroups(({}, {}), np.array([0, 0])))
    with pytest.raises(InvalidArgumentError, match=r"^group_of must name groups 0\.\.1, got \[0, 2\]$"):
        plan_group_reads(NeedGroups(({}, {}), np.array([0, 2])))
    with pytest.raises(InvalidArgumentError, match=r"^group_of must name groups 0\.\.1, got \[-1, 1\]$"):
        plan_group_reads(NeedGroups(({}, {}), np.array([-1, 1])))
    with pytest.raises(InvalidArgumentError, match="weights must be 2 positive integers"):
        plan_job_reads([{}, {}], weights=np.array([1, 0]))
    plan = plan_group_reads(need_groups([{0: _ranges([(0, 10)])}]))
    with pytest.raises(InvalidArgumentError, match="rank 1 is not in 0..0"):
        receives(plan, 1)


def test_messages_send_a_replicated_plan_once_not_per_rank() -> None:
    """The coordinator's messages for full replication: each rank's part holds its own sends
    only; the rows every rank receives go once in the shared part, whatever the ranks."""
    size = 4096 * 256
    shared = {}
    for world in (16, 256):
        needs = [{0: _ranges([(0, size)])} for _ in range(world)]
        plan = plan_group_reads(need_groups(needs), align=4096, min_run=4096)
        parts, common = messages(plan, 1 << 20)
        assert all(p.recvs is None and len(p.sends) == 1 for p in parts)
        assert list(common.group_recvs) == [0] and len(common.group_recvs[0]) == world
        rounds = common.rounds(parts[3], 3)
        assert rounds.recvs is common.group_recvs[0] and rounds.count == common.count
        shared[world] = common.nbytes
    # windows and group_of (8 bytes a rank each) and one 40-byte row per reader
    assert shared == {16: 16 * 56, 256: 256 * 56}


def test_messages_put_small_groups_rows_in_their_ranks_parts() -> None:
    """HSDP replica pairs on 16 ranks: groups of 2 < sqrt(16), so each rank's part carries its
    group's rows and the shared part none."""
    shard = 4096 * 8
    needs = [{0: _ranges([((r % 8) * shard, shard)])} for r in range(16)]
    plan = plan_group_reads(need_groups(needs), align=4096, min_run=4096)
    parts, common = messages(plan, 1 << 20)
    assert common.group_recvs == {}
    for r, p in enumerate(parts):
        assert p.recvs is not None and int(p.recvs[:, 3].sum()) == shard
        assert set(p.recvs[:, 0].tolist()) == {r % 8, r % 8 + 8}


def test_benchmark_shapes_compact_at_16_ranks() -> None:
    """bench_readplan.py's Llama-2-70B targets at W = 16 in compact form: one group for full
    replication (one row per reader), replica pairs for HSDP, balanced, each byte read once."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_readplan

    rep = bench_readplan.run_group("replicated", 16, 64 << 20)
    assert rep["groups"] == 1 and rep["transfer_rows"] == 16 and rep["read_rows"] == 16
    assert rep["max_read_over_ideal"] < 1.0001 and rep["read_over_unique"] == 1.0
    assert rep["exchanged_GB"] == pytest.approx(rep["unique_GB"] * 15, rel=1e-9)
    hsdp = bench_readplan.run_group("hsdp", 16, 64 << 20)
    assert hsdp["groups"] == 8 and hsdp["max_read_over_ideal"] < 1.001
    assert hsdp["exchanged_GB"] == pytest.approx(hsdp["unique_GB"], rel=1e-3)
