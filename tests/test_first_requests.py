"""Who makes each data file's first request in a read-once load (read_once/first_requests.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_dcp.core.spans import merge_ranges
from ucp_dcp.dcp.read_once.first_requests import _readers, _wants


def _runs(files: set[int]) -> tuple[np.ndarray, np.ndarray]:
    f = np.array(sorted(files), dtype=np.int64)
    return merge_ranges(f, f + 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(st.integers(0, 40), max_size=30), min_size=1, max_size=12))
def test_each_file_read_has_one_reader_among_the_ranks_that_read_it(reads: list[set[int]]) -> None:
    reader = _readers([_runs(r) for r in reads])
    wanted = set().union(*reads)
    for f in range(len(reader)):
        if f in wanted:
            assert f in reads[reader[f]], (f, reader[f])
        else:
            assert reader[f] == -1
    assert len(reader) == (max(wanted) + 1 if wanted else 0)
    # Each rank hands on exactly the files it fetches that a peer reads.
    for p, r in enumerate(reads):
        mine = np.flatnonzero(reader == p).tolist()
        assert _wants(_runs(r), mine) == [f for f in mine if f in r]


def test_a_replicated_target_spreads_the_first_requests_evenly() -> None:
    """Every rank reads every file: file f is fetched by rank f mod world."""
    world, files = 7, 23
    reader = _readers([_runs(set(range(files)))] * world)
    assert reader.tolist() == [f % world for f in range(files)]


def test_a_failed_rank_is_no_reader() -> None:
    """An entry that is not runs (a failed rank's error, raised before this is asked) reads nothing."""
    reader = _readers([_runs({0, 1}), ValueError("x"), _runs({1})])
    assert reader.tolist() == [0, 2]
