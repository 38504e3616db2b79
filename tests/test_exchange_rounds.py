"""Exchange rounds with each rank's reads for itself (read_once/plan.py ``plan_job_reads`` with
``own_reads=True``).

What the read-once exchange (read_once/exchange.py) relies on, checked byte by byte on random and
structured needs: every rank gets, over all rounds, exactly the bytes it needs (from itself or
from others), each once; every reader reads each byte in one round only; rounds keep the budget.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from readplan_reference import need_groups, schedule_rounds
from test_readplan import (
    ALIGNS,
    MIN_RUNS,
    Needs,
    _need_masks,
    check_rounds,
    random_needs,
    structured_needs,
)

from ucp_dcp.core.spans import merge_ranges
from ucp_dcp.dcp.read_once import rank_shares
from ucp_dcp.dcp.read_once.exchange import RankRounds
from ucp_dcp.dcp.read_once.plan import plan_job_reads
from ucp_dcp.dcp.read_once.ranges import intersect_ranges
from ucp_dcp.dcp.read_once.rounds import plan_group_reads
from ucp_dcp.errors import InvalidArgumentError


def _check_own(needs: Needs, sizes: dict[int, int], align: int, min_run: int, budget: int) -> None:
    plan = plan_job_reads(needs, align=align, min_run=min_run, file_sizes=sizes)
    full = plan_job_reads(needs, align=align, min_run=min_run, file_sizes=sizes, own_reads=True)
    check_rounds(full, budget)  # the rounds' rules hold with the own rows in
    want = _need_masks(needs, sizes)
    got = [{f: np.zeros(n, np.int64) for f, n in sizes.items()} for _ in needs]
    t = full.transfers
    for i in range(len(t)):
        f, s, n = int(t.file[i]), int(t.start[i]), int(t.length[i])
        got[int(t.receiver[i])][f][s : s + n] += 1
    for r in range(len(needs)):
        for f in sizes:
            assert np.array_equal(got[r][f], want[r][f].astype(np.int64)), (r, f)
    # Own rows: a rank reads for itself only what the plan has it read.
    own = t.reader == t.receiver
    for r in range(len(needs)):
        reads = plan.reads(r)
        for f in np.unique(t.file[own & (t.reader == r)]).tolist():
            sel = own & (t.reader == r) & (t.file == f)
            rs, rl = reads[f]
            a, b = intersect_ranges(t.start[sel], t.start[sel] + t.length[sel], rs, rs + rl)
            assert int((b - a).sum()) == int(t.length[sel].sum())
    if budget >= len(needs):
        rounds = schedule_rounds(full, budget)
        assert sum(len(x) for x in rounds) >= len(t)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_needs(), ALIGNS, MIN_RUNS, st.integers(1, 20000))
def test_own_reads_complete_every_rank_on_random_needs(
    case: tuple[Needs, dict[int, int]], align: int, min_run: int, budget: int
) -> None:
    needs, sizes = case
    _check_own(needs, sizes, align, min_run, budget)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structured_needs(), ALIGNS, MIN_RUNS, st.integers(1, 20000))
def test_own_reads_complete_every_rank_on_structured_needs(
    case: tuple[Needs, dict[int, int], bool], align: int, min_run: int, budget: int
) -> None:
    needs, sizes, _ = case
    _check_own(needs, sizes, align, min_run, budget)


def test_merge_and_intersect_ranges() -> None:
    a, b = merge_ranges(np.array([5, 0, 3, 20]), np.array([8, 3, 4, 25]))
    assert a.tolist() == [0, 5, 20] and b.tolist() == [4, 8, 25]
    s, e = intersect_ranges(
        np.array([0, 10]), np.array([6, 30]), np.array([2, 5, 28]), np.array([3, 12, 40])
    )
    assert list(zip(s.tolist(), e.tolist())) == [(2, 3), (5, 6), (10, 12), (28, 30)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_needs(), ALIGNS, st.integers(1, 20000))
def test_each_ranks_windows_cut_the_same_rounds_as_the_schedule(
    case: tuple[Needs, dict[int, int]], align: int, budget: int
) -> None:
    """What the read-once exchange runs (each rank cutting its own transfers by windows,
    read_once/__init__.py) is schedule_rounds' schedule, both ends of every message alike: where
    no two ranks need the same (each group one rank), the compact plan is the per-rank one."""
    needs, sizes = case
    groups = need_groups(needs)
    assume(len(groups.extents) == len(needs))
    full = plan_job_reads(needs, align=align, file_sizes=sizes, own_reads=True)
    world = full.world_size
    if budget < max(len(needs), 1) * 2:  # under the peers one rank exchanges with: refused
        return
    try:
        rounds = schedule_rounds(full, budget)
    except InvalidArgumentError:
        return
    plan = plan_group_reads(groups, align=align, file_sizes=sizes)
    assert groups.group_of.tolist() == list(range(world))
    count, windows, sends, recvs = rank_shares(plan, budget)
    shares = [RankRounds(count, sends[r], recvs[r], windows, groups.group_of) for r in range(world)]
    assert count == len(rounds)
    for k, t in enumerate(rounds):
        for me in range(world):
            got = shares[me].round(k, me, world)
            for p in range(world):
                sel = (t.reader == me) & (t.receiver == p)
                want = np.stack([t.file[sel], t.start[sel], t.length[sel]], axis=1)
                want = want[np.lexsort((want[:, 1], want[:, 0]))]
                assert np.array_equal(got.sends[p], want), (k, me, p)
                back = shares[p].round(k, p, world).recvs[me]
                assert np.array_equal(back, want), (k, me, p)
