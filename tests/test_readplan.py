"""The job-wide read plan (read_once/plan.py): who reads each needed byte, who sends it to whom.

Every plan here is checked byte by byte against boolean masks over small files: each needed
byte has exactly one reader, every rank receives exactly what it needs and does not read
itself, reads are whole pages the reader needs, and the exchange rounds keep to their budget.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from readplan_reference import exchange_windows, receives, schedule_rounds, sends

from ucp_dcp.dcp.read_once.plan import JobReadPlan, Transfers, plan_job_reads
from ucp_dcp.dcp.read_once.rounds import stream_positions
from ucp_dcp.errors import InvalidArgumentError

A = np.array
Needs = list[dict[int, tuple[np.ndarray, np.ndarray]]]


def _ranges(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    return A([s for s, _ in pairs], np.int64), A([n for _, n in pairs], np.int64)


def _need_masks(needs: Needs, sizes: dict[int, int]) -> list[dict[int, np.ndarray]]:
    out = []
    for extents in needs:
        masks = {f: np.zeros(n, bool) for f, n in sizes.items()}
        for f, (starts, lengths) in extents.items():
            for s, n in zip(starts.tolist(), lengths.tolist()):
                masks[f][s : s + n] = True
        out.append(masks)
    return out


def _pages(mask: np.ndarray, align: int) -> np.ndarray:
    """Every byte of each page that holds a True byte."""
    n = len(mask)
    padded = np.zeros(-(-n // align) * align, bool)
    padded[:n] = mask
    return np.repeat(padded.reshape(-1, align).any(axis=1), align)[:n]


def _add(count: dict[int, np.ndarray], t: Transfers, who: np.ndarray | None = None) -> None:
    for i in range(len(t)):
        f, s, n = int(t.file[i]), int(t.start[i]), int(t.length[i])
        count[f][s : s + n] += 1
        if who is not None:
            who[f][s : s + n] = t.reader[i]


def check_plan(needs: Needs, sizes: dict[int, int], plan: JobReadPlan) -> None:
    """Every property the module promises, on byte masks."""
    world, align = len(needs), plan.align
    need = _need_masks(needs, sizes)
    readers = {f: np.full(n, -1) for f, n in sizes.items()}
    read_count = {f: np.zeros(n, int) for f, n in sizes.items()}
    for r in range(world):
        total = 0
        for f, (starts, lengths) in plan.reads(r).items():
            assert np.all(lengths > 0)
            ends = starts + lengths
            assert np.all(starts[1:] > ends[:-1]), "reads sorted, apart"
            assert np.all(starts % align == 0)
            assert np.all((ends % align == 0) | (ends == sizes[f]))
            mine = np.zeros(sizes[f], bool)
            for s, e in zip(starts.tolist(), ends.tolist()):
                mine[s:e] = True
                readers[f][s:e] = r
                read_count[f][s:e] += 1
            # A reader reads only pages it needs itself.
            assert not np.any(mine & ~_pages(need[r][f], align))
            total += int(lengths.sum())
        assert plan.bytes_read_per_rank[r] == total
    any_need = (
        {f: np.any([need[r][f] for r in range(world)], axis=0) for f in sizes} if world else {}
    )
    for f in sizes:
        assert np.all(read_count[f] <= 1)
        if world:
            assert np.all(read_count[f][any_need[f]] == 1), "every needed byte has one reader"
            # A page one rank needs alone is read by that rank.
            page_need = np.array([_pages(need[r][f], align) for r in range(world)])
            alone = page_need.sum(axis=0) == 1
            assert np.array_equal(readers[f][alone], page_need.argmax(axis=0)[alone])
        if world:
            _check_pieces(readers[f], page_need, plan.min_run)
    for r in range(world):
        got = {f: np.zeros(n, int) for f, n in sizes.items()}
        who = {f: np.full(n, -1) for f, n in sizes.items()}
        recv = receives(plan, r)
        assert np.all(recv.receiver == r) and np.all(recv.reader != r) and np.all(recv.length > 0)
        _add(got, recv, who)
        for f in sizes:
            mine = readers[f] == r
            assert np.array_equal(got[f] > 0, need[r][f] & ~mine), (
                "receives what it needs, not reads"
            )
            assert np.all(got[f] <= 1)
            assert np.array_equal(who[f][got[f] > 0], readers[f][got[f] > 0]), "sent by its reader"
        sent = sends(plan, r)
        assert np.all(sent.reader == r)
        key = sent.receiver * (1 << 40) + sent.file * (1 << 32) + sent.start
        assert np.all(np.diff(key) > 0)
    assert len(plan.transfers) == sum(len(sends(plan, r)) for r in range(world))
    assert plan.needed_bytes == sum(int(m.sum()) for masks in need for m in masks.values())
    assert plan.unique_bytes == sum(int(m.sum()) for m in any_need.values())
    assert plan.transfers.nbytes == plan.needed_bytes - sum(
        int((need[r][f] & (readers[f] == r)).sum()) for r in range(world) for f in sizes
    )


def _runs(codes: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of equal values."""
    edges = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1], True])
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def _check_pieces(readers: np.ndarray, page_need: np.ndarray, min_run: int) -> None:
    """Inside a segment (a run of bytes whose pages the same ranks need) shared by several
    ranks, each reader's piece is the whole segment or at least ``min_run`` bytes."""
    codes = (page_need.astype(np.int64) << np.arange(len(page_need))[:, None]).sum(axis=0)
    for a, b in _runs(codes):
        if bin(int(codes[a])).count("1") > 1:
            pieces = _runs(readers[a:b])
            assert len(pieces) == 1 or all(e - s >= min_run for s, e in pieces)


def _fan(plan: JobReadPlan) -> int:
    """The most peers one rank sends to or receives from."""
    pairs = set(zip(plan.transfers.reader.tolist(), plan.transfers.receiver.tolist()))
    outs = [sum(1 for q, _ in pairs if q == r) for r in range(plan.world_size)]
    ins = [sum(1 for _, q in pairs if q == r) for r in range(plan.world_size)]
    return max(outs + ins, default=0)


def _stream(plan: JobReadPlan, rank: int, file: int, start: int) -> int:
    """Where byte ``start`` of ``file`` is in ``rank``'s reads laid end to end."""
    base = 0
    for f, (starts, lengths) in sorted(plan.reads(rank).items()):
        for s, n in zip(starts.tolist(), lengths.tolist()):
            if f == file and s <= start < s + n:
                return base + start - s
            base += n
    raise AssertionError(f"rank {rank} does not read byte {start} of file {file}")


def check_rounds(plan: JobReadPlan, budget: int) -> None:
    """Rounds keep the budget, send each byte in the round its reader reads it, and together
    are the transfers."""
    if budget < _fan(plan):
        with pytest.raises(InvalidArgumentError, match="budget_bytes"):
            schedule_rounds(plan, budget)
        return
    rounds = schedule_rounds(plan, budget)
    windows = exchange_windows(plan, budget)
    world = plan.world_size
    assert np.all((windows >= 1) & (windows <= budget))
    assert not rounds or len(rounds[-1])
    for k, t in enumerate(rounds):
        assert np.all(t.length > 0)
        if not len(t):
            continue
        assert np.bincount(t.reader, weights=t.length, minlength=world).max() <= budget
        assert np.bincount(t.receiver, weights=t.length, minlength=world).max() <= budget
        for i in range(len(t)):
            q = int(t.reader[i])
            u = _stream(plan, q, int(t.file[i]), int(t.start[i]))
            assert k * windows[q] <= u and u + t.length[i] <= (k + 1) * windows[q]
    if not rounds:
        assert len(plan.transfers) == 0
        return
    # Together the rounds are the transfers, each byte once.
    cat = Transfers(
        *(
            np.concatenate([getattr(t, k) for t in rounds])
            for k in ("reader", "receiver", "file", "start", "length")
        )
    )
    order = np.lexsort((cat.start, cat.file, cat.receiver, cat.reader))
    cat = cat.take(order)
    end = cat.start + cat.length
    same = (
        (cat.reader[1:] == cat.reader[:-1])
        & (cat.receiver[1:] == cat.receiver[:-1])
        & (cat.file[1:] == cat.file[:-1])
    )
    assert np.all(~same | (cat.start[1:] >= end[:-1])), "no byte in two rounds"
    new = np.r_[True, ~same | (cat.start[1:] != end[:-1])]
    first = np.flatnonzero(new)
    merged_end = np.maximum.reduceat(end, first)
    t = plan.transfers
    assert np.array_equal(cat.reader[first], t.reader)
    assert np.array_equal(cat.receiver[first], t.receiver)
    assert np.array_equal(cat.file[first], t.file)
    assert np.array_equal(cat.start[first], t.start)
    assert np.array_equal(merged_end - cat.start[first], t.length)


def optimum(needs: Needs, sizes: dict[int, int], align: int) -> float:
    """T*: the largest, over sets S of ranks, of the bytes of pages needed only inside S, / |S|."""
    world = len(needs)
    need = _need_masks(needs, sizes)
    pages = np.concatenate(
        [np.array([_pages(need[r][f], align) for r in range(world)]) for f in sizes], axis=1
    )
    best = 0.0
    for k in range(1, world + 1):
        for s in itertools.combinations(range(world), k):
            inside = pages[list(s)].any(axis=0) & ~np.delete(pages, list(s), axis=0).any(axis=0)
            best = max(best, inside.sum() / k)
    return best


# ---------------------------------------------------------------- examples


def test_replicated_file_is_read_once_in_one_stretch_per_rank() -> None:
    size, world = 10 << 20, 4
    needs = [{0: _ranges([(0, size)])} for _ in range(world)]
    plan = plan_job_reads(needs, align=4096, min_run=1 << 20, file_sizes={0: size})
    check_plan(needs, {0: size}, plan)
    loads = plan.bytes_read_per_rank
    assert loads.sum() == size and loads.max() < size / world + (1 << 20) + 4096
    for r in range(world):
        assert [len(s) for s, _ in plan.reads(r).values()] == [1]  # one contiguous stretch
        assert len(sends(plan, r)) == world - 1
    assert plan.needed_bytes == world * size and plan.unique_bytes == size
    check_rounds(plan, 1 << 20)
    # Each reader broadcasts to 3 ranks: windows of a third of the budget, in whole pages.
    assert exchange_windows(plan, 1 << 20).tolist() == [(1 << 20) // 3 // 4096 * 4096] * world


def test_hsdp_replica_pairs_split_their_shard() -> None:
    # 2 replicas x 3 shards of one file: rank (g, i) = g * 3 + i needs shard i.
    shard = 3 << 20
    needs = [{0: _ranges([(i * shard, shard)])} for _ in range(2) for i in range(3)]
    plan = plan_job_reads(needs, align=4096, min_run=1 << 20)
    check_plan(needs, {0: 3 * shard}, plan)
    assert plan.bytes_read_per_rank.tolist() == [shard // 2] * 6
    assert set(zip(plan.transfers.reader.tolist(), plan.transfers.receiver.tolist())) == {
        (0, 3),
        (3, 0),
        (1, 4),
        (4, 1),
        (2, 5),
        (5, 2),
    }


def test_column_pieces_read_each_page_once() -> None:
    # Shard(1) of 4000-byte rows on 4 ranks: every page holds bytes of every rank.
    rows, row, world = 32, 4000, 4
    needs = [{0: _ranges([(k * row + r * 1000, 1000) for k in range(rows)])} for r in range(world)]
    plan = plan_job_reads(needs, align=4096, min_run=16384, file_sizes={0: rows * row})
    check_plan(needs, {0: rows * row}, plan)
    assert plan.read_bytes == rows * row  # each byte once, instead of a page per rank
    check_rounds(plan, 10000)


def test_cuts_closer_than_min_run_are_thinned() -> None:
    # Six ranks share 30000 bytes: 5000 each would cut pieces under min_run = 10000, so the
    # cuts move down until every reader's piece is at least min_run.
    needs = [{0: _ranges([(0, 30000)])} for _ in range(6)]
    plan = plan_job_reads(needs, align=64, min_run=10000, file_sizes={0: 30000})
    check_plan(needs, {0: 30000}, plan)
    loads = plan.bytes_read_per_rank
    assert loads.sum() == 30000 and loads[loads > 0].min() >= 10000
    assert loads.max() < 5000 + 1 + 2 * 10000 + 64


def test_water_filling_counts_what_a_rank_must_read_alone() -> None:
    # Rank 0 needs four units, ranks 1-3 one each of the first three: rank 0 reads the unit only
    # it needs, each other rank its own unit, so no rank reads more than one unit (T* = 1).
    u = 40960
    needs = [{0: _ranges([(0, 4 * u)])}] + [{0: _ranges([(i * u, u)])} for i in range(3)]
    plan = plan_job_reads(needs, align=4096, min_run=4096)
    check_plan(needs, {0: 4 * u}, plan)
    assert plan.bytes_read_per_rank.tolist() == [u] * 4


def test_plans_stay_exact_when_set_fingerprints_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments are grouped by fingerprints of their rank sets and then checked exactly: with
    every rank's key the same, all sets of one size collide, and the exact grouping decides."""
    import ucp_dcp.dcp.read_once.ranges as ranges_module

    monkeypatch.setattr(ranges_module, "_mix", lambda x: np.zeros(len(x), np.uint64))
    needs = [
        {0: _ranges([(0, 20000)])},
        {0: _ranges([(10000, 20000)])},
        {0: _ranges([(0, 5000), (25000, 5000)])},
        {0: _ranges([(15000, 15000)])},
    ]
    plan = plan_job_reads(needs, align=64, min_run=1000, file_sizes={0: 30000})
    check_plan(needs, {0: 30000}, plan)


def test_ranges_needed_by_one_rank_are_not_exchanged() -> None:
    needs = [{0: _ranges([(0, 8192)])}, {0: _ranges([(16384, 8192)]), 1: _ranges([(5, 3)])}]
    plan = plan_job_reads(needs, align=4096)
    assert len(plan.transfers) == 0
    assert {f: (s.tolist(), n.tolist()) for f, (s, n) in plan.reads(1).items()} == {
        0: ([16384], [8192]),
        1: ([0], [4096]),
    }


def test_overlapping_and_touching_ranges_of_one_rank_merge() -> None:
    needs = [{0: _ranges([(100, 50), (120, 100), (220, 10), (5000, 0)])}]
    plan = plan_job_reads(needs, align=1)
    s, n = plan.reads(0)[0]
    assert s.tolist() == [100] and n.tolist() == [130]
    assert plan.needed_bytes == 130


def test_empty_inputs() -> None:
    for needs in ([], [{}], [{}, {0: (A([], np.int64), A([], np.int64))}]):
        plan = plan_job_reads(needs)
        assert plan.read_bytes == 0 and len(plan.transfers) == 0 and plan.unique_bytes == 0
        assert schedule_rounds(plan, 1) == []
        for r in range(len(needs)):
            assert plan.reads(r) == {} and len(receives(plan, r)) == 0


def test_same_input_same_plan_whatever_the_dict_order() -> None:
    rng = np.random.default_rng(0)
    base = [
        {
            f: _ranges(
                [(int(rng.integers(0, 50000)), int(rng.integers(0, 30000))) for _ in range(5)]
            )
            for f in (3, 1, 7)
        }
        for _ in range(5)
    ]
    flipped = [dict(reversed(list(e.items()))) for e in base]
    a, b = plan_job_reads(base, min_run=8192), plan_job_reads(flipped, min_run=8192)
    for name in ("read_rank", "read_file", "read_start", "read_length", "recv_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    for name in ("reader", "receiver", "file", "start", "length"):
        assert np.array_equal(getattr(a.transfers, name), getattr(b.transfers, name))


def test_a_transfer_larger_than_the_budget_is_split() -> None:
    needs = [{0: _ranges([(0, 100000)])}, {0: _ranges([(0, 100000)])}]
    plan = plan_job_reads(needs, align=1, min_run=1)
    rounds = schedule_rounds(plan, 7000)
    assert len(rounds) == -(-50000 // 7000)
    check_rounds(plan, 7000)


@pytest.mark.parametrize(
    "needs, kwargs, words",
    [
        ([{0: (A([0]), A([-1]))}], {}, "rank 0, file 0"),
        ([{}, {2: (A([-5]), A([1]))}], {}, "rank 1, file 2"),
        ([{0: (A([0, 1]), A([1]))}], {}, "one length"),
        ([{0: (A([0.5]), A([1]))}], {}, "integer arrays"),
        ([{0: (A([0]), A([10]))}], {"align": 0}, "align"),
        ([{0: (A([0]), A([10]))}], {"min_run": -1}, "min_run"),
        (
            [{0: (A([0]), A([10]))}, {0: (A([5]), A([10]))}],
            {"file_sizes": {0: 12}},
            "rank 1, file 0",
        ),
    ],
)
def test_bad_arguments_name_what_is_wrong(needs: Needs, kwargs: dict, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words):
        plan_job_reads(needs, **kwargs)


def test_bad_budget_and_rank() -> None:
    plan = plan_job_reads([{0: _ranges([(0, 10)])}])
    with pytest.raises(InvalidArgumentError, match="budget_bytes"):
        schedule_rounds(plan, 0)
    with pytest.raises(InvalidArgumentError, match="rank 1"):
        receives(plan, 1)


# ---------------------------------------------------------------- random inputs

ALIGNS = st.sampled_from([1, 7, 64, 512, 4096])
MIN_RUNS = st.sampled_from([0, 1, 100, 3000, 10000])


@st.composite
def random_needs(draw: st.DrawFn) -> tuple[Needs, dict[int, int]]:
    """Random files and random ranges per rank: partial overlaps, empty ranks, zero lengths."""
    nfiles = draw(st.integers(1, 3))
    sizes = {f * 2 + 1: draw(st.integers(1, 30000)) for f in range(nfiles)}
    world = draw(st.integers(1, 6))
    needs: Needs = []
    for _ in range(world):
        extents = {}
        for f, size in sizes.items():
            count = draw(st.integers(0, 4))
            pairs = []
            for _ in range(count):
                s = draw(st.integers(0, size - 1))
                pairs.append((s, draw(st.integers(0, size - s))))
            if pairs or draw(st.booleans()):
                extents[f] = _ranges(pairs)
        needs.append(extents)
    return needs, sizes


@st.composite
def structured_needs(draw: st.DrawFn) -> tuple[Needs, dict[int, int], bool]:
    """Replicated, HSDP (replica groups x shards) and column-piece targets; the flag says whether
    the ranks sharing a byte form a partition (where the T* bound holds)."""
    kind = draw(st.sampled_from(["replicated", "hsdp", "columns"]))
    rows, row = draw(st.integers(1, 40)), draw(st.integers(1, 2000))
    size = rows * row
    if kind == "replicated":
        world = draw(st.integers(1, 6))
        return [{0: _ranges([(0, size)])} for _ in range(world)], {0: size}, True
    if kind == "hsdp":
        groups, shards = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        per = -(-rows // shards)
        needs = []
        for _ in range(groups):
            for i in range(shards):
                lo, hi = min(i * per, rows), min((i + 1) * per, rows)
                needs.append({0: _ranges([(lo * row, (hi - lo) * row)])})
        return needs, {0: size}, False
    world = draw(st.integers(1, 5))
    cols = -(-row // world)
    needs = [
        {
            0: _ranges(
                [
                    (k * row + min(r * cols, row), max(0, min(cols, row - r * cols)))
                    for k in range(rows)
                ]
            )
        }
        for r in range(world)
    ]
    return needs, {0: size}, False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_needs(), ALIGNS, MIN_RUNS, st.booleans(), st.integers(1, 20000))
def test_random_needs(
    case: tuple[Needs, dict[int, int]], align: int, min_run: int, known: bool, budget: int
) -> None:
    needs, sizes = case
    plan = plan_job_reads(needs, align=align, min_run=min_run, file_sizes=sizes if known else None)
    sizes_seen = sizes if known else {f: -(-n // align) * align for f, n in sizes.items()}
    check_plan(needs, sizes_seen, plan)
    check_rounds(plan, budget)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structured_needs(), ALIGNS, MIN_RUNS, st.integers(1, 20000))
def test_structured_needs(
    case: tuple[Needs, dict[int, int], bool], align: int, min_run: int, budget: int
) -> None:
    needs, sizes, _ = case
    plan = plan_job_reads(needs, align=align, min_run=min_run, file_sizes=sizes)
    check_plan(needs, sizes, plan)
    check_rounds(plan, budget)
    if len(needs) <= 6:
        bound = optimum(needs, sizes, align) + 1 + 2 * min_run + align
        if case[2] or _partitioned(needs, sizes, align):
            assert plan.bytes_read_per_rank.max() < bound


def _partitioned(needs: Needs, sizes: dict[int, int], align: int) -> bool:
    """Whether the sets of ranks sharing a page are pairwise equal or disjoint."""
    need = _need_masks(needs, sizes)
    pages = np.concatenate(
        [np.array([_pages(need[r][f], align) for r in range(len(needs))]) for f in sizes], axis=1
    )
    sets = {frozenset(np.flatnonzero(col).tolist()) for col in pages.T if col.sum() > 1}
    return all(a == b or not (a & b) for a in sets for b in sets)


@settings(max_examples=200, deadline=None)
@given(random_needs(), ALIGNS, MIN_RUNS)
def test_balance_on_random_needs(
    case: tuple[Needs, dict[int, int]], align: int, min_run: int
) -> None:
    """Where the sharing sets form a partition, the proven bound; always, no rank reads more than
    the pages it needs (checked in check_plan) and pieces of a shared segment keep min_run."""
    needs, sizes = case
    plan = plan_job_reads(needs, align=align, min_run=min_run, file_sizes=sizes)
    if _partitioned(needs, sizes, align):
        assert (
            plan.bytes_read_per_rank.max() < optimum(needs, sizes, align) + 1 + 2 * min_run + align
        )


# ---------------------------------------------------------------- the benchmark's shapes


def test_benchmark_shapes_at_16_ranks() -> None:
    """bench_readplan.py's Llama-2-70B targets at W = 16: the job reads each needed page once
    (padding of sub-page chunks aside), balanced, in as many rounds as the busiest rank needs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_readplan

    for target in ("hsdp", "replicated"):
        row = bench_readplan.run(target, 16, 64 << 20)
        assert 1.0 <= row["read_over_unique"] < 1.001, row
        assert row["max_read_over_ideal"] < 1.001, row
        assert row["rounds"] <= row["least_rounds"] + 1, row
        # HSDP: each byte to its one other replica; replicated: to the 15 other ranks.
        copies = 1 if target == "hsdp" else 15
        assert row["exchanged_GB"] == pytest.approx(row["unique_GB"] * copies, rel=1e-3), row


def test_offsets_too_far_apart_for_one_sort_key_plan_the_same() -> None:
    """Ranges 2**61 bytes into a file: a rank's ranges (and a reader's stream positions) no
    longer fit one int64 sort key per rank and are merged rank by rank; the plan is the one of
    the same ranges at offset 0, moved up."""
    from ucp_dcp.dcp.read_once.rounds import stream_positions

    far = 1 << 61

    def needs(base: int) -> list[dict[int, tuple[np.ndarray, np.ndarray]]]:
        return [
            {0: _ranges([(base, 10000), (base + 20000, 5000)]), 1: _ranges([(0, 8192)])},
            {0: _ranges([(base + 4096, 30000)]), 1: _ranges([(4096, 8192)])},
        ]

    near, moved = plan_job_reads(needs(0)), plan_job_reads(needs(far))
    up = np.where(near.read_file == 0, far, 0)
    assert np.array_equal(moved.read_start, near.read_start + up)
    assert np.array_equal(moved.read_file, near.read_file)
    assert np.array_equal(moved.read_length, near.read_length)
    t, u = near.transfers, moved.transfers
    assert np.array_equal(u.start, t.start + np.where(t.file == 0, far, 0))
    for f in ("reader", "receiver", "file", "length"):
        assert np.array_equal(getattr(u, f), getattr(t, f)), f
    assert np.array_equal(stream_positions(moved), stream_positions(near))
    assert stream_positions(near).tolist() == [4096, 7712, 24576]
