"""The read-once policy without ranks: ``decide``, ``shared_storage``, ``check_read_once``.

``decide(mode, shared, storage, plan)`` is a pure function of the reader's
``read_once``, what the storage is, and the job's read plan (the bytes every
rank needs summed, against the bytes at least one rank needs); these tests
build plans as the coordinator does
(:func:`~ucp_dcp.dcp.read_once.rounds.plan_group_reads`) from needs whose
overlap is known to the byte. ``shared_storage`` reads
``/proc/mounts``: a fake one shows which mount a path falls under.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from readplan_reference import need_groups

from ucp_dcp import ReadOptions, UCPStorageReader
from ucp_dcp.dcp import read_once as _read_once
from ucp_dcp.dcp.read_once import (
    OVERLAP_TO_EXCHANGE,
    READ_ONCE_MODES,
    ReadOnceCosts,
    check_read_once,
    decide,
    shared_storage,
)
from ucp_dcp.dcp.read_once.rounds import GroupReadPlan, plan_group_reads
from ucp_dcp.errors import InvalidArgumentError, UCPError

PAGE = 4096


def _plan(*pages_per_rank: int) -> GroupReadPlan:
    """Rank ``r`` needs the first ``pages_per_rank[r]`` pages of file 0: the needs overlap."""
    needs = [
        {0: (np.array([0], np.int64), np.array([n * PAGE], np.int64))} if n else {}
        for n in pages_per_rank
    ]
    return plan_group_reads(need_groups(needs))


# ---------------------------------------------------------------- decide


def test_plans_count_needed_and_unique_bytes() -> None:
    plan = _plan(100, 6)
    assert (plan.needed_bytes, plan.unique_bytes) == (106 * PAGE, 100 * PAGE)


def test_false_never_exchanges_whatever_the_storage_and_overlap() -> None:
    for shared, storage in ((True, "object store"), (False, "ext4")):
        for plan in (None, _plan(100, 100)):
            d = decide(False, shared, storage, plan)
            assert not d.exchange and d.reason == "read_once=False", d
            assert (d.mode, d.shared, d.storage) == (False, shared, storage)


def test_true_exchanges_on_any_storage_even_without_overlap() -> None:
    for shared, storage in ((True, "object store"), (False, "ext4")):
        d = decide(True, shared, storage, _plan(10, 0))
        assert d.exchange and d.reason == "read_once=True", d
        assert (d.needed_bytes, d.unique_bytes) == (10 * PAGE, 10 * PAGE)


def test_nothing_to_read_in_place_never_exchanges() -> None:
    for mode in (True, "auto"):
        d = decide(mode, True, "object store", _plan(0, 0))
        assert not d.exchange and d.reason == "nothing to read in place", d


def test_auto_on_local_storage_reads_directly_before_any_plan() -> None:
    # The reader asks decide() with no plan on local storage: no collective at all.
    d = decide("auto", False, "ext4", None)
    assert not d.exchange
    assert d.reason == "local storage (ext4): the ranks of a machine share its page cache"
    # Even with replicas reading the same bytes (the page cache reads them once).
    assert not decide("auto", False, "ext4", _plan(100, 100)).exchange


FREE_ROUNDS = ReadOnceCosts(round_seconds=0.0)  # the overlap rule alone decides


@pytest.mark.parametrize("storage", ["object store", "nfs4", "lustre"])
def test_auto_on_shared_storage_exchanges_above_5_percent_overlap(storage: str) -> None:
    assert OVERLAP_TO_EXCHANGE == 1.05
    above = decide("auto", True, storage, _plan(100, 6), FREE_ROUNDS)  # 1.06x
    assert above.exchange, above
    assert above.reason == (
        f"shared storage ({storage}), the ranks' needs overlap by 1.06x: "
        f"{above.exchange_s:.3g} s exchanging against {above.direct_s:.3g} s reading directly"
    )
    assert (above.needed_bytes, above.unique_bytes) == (106 * PAGE, 100 * PAGE)
    replicas = decide("auto", True, storage, _plan(50, 50, 50, 50), FREE_ROUNDS)  # replicated: 4x
    assert replicas.exchange and "overlap by 4.00x" in replicas.reason, replicas


@pytest.mark.parametrize("pages", [0, 4, 5])  # 1.00x, 1.04x, exactly 1.05x
def test_auto_on_shared_storage_reads_directly_at_or_below_5_percent(pages: int) -> None:
    d = decide("auto", True, "object store", _plan(100, pages), FREE_ROUNDS)
    assert not d.exchange, d
    assert d.reason == f"the ranks' needs overlap by {(100 + pages) / 100:.3f}x: no gain"


def test_auto_weighs_the_costs_and_reports_them() -> None:
    """Direct: every rank's bytes through the job's storage bandwidth; exchanging: the unique
    bytes through it, or the most a rank receives through its link, plus a fixed cost a round."""
    plan = _plan(100, 100, 100, 100)  # 400 KiB, 4 replicas
    costs = ReadOnceCosts(storage_bytes_per_s=1e6, network_bytes_per_s=1e7, round_seconds=0.0)
    d = decide("auto", True, "object store", plan, costs, budget=1 << 20)
    assert d.exchange and d.costs == costs
    assert d.direct_s == pytest.approx(400 * PAGE / 1e6)
    assert d.exchange_s == pytest.approx(max(100 * PAGE / 1e6, 75 * PAGE / 1e7))
    # A slow interconnect: moving the bytes costs more than reading them again.
    slow = ReadOnceCosts(storage_bytes_per_s=1e9, network_bytes_per_s=1e6, round_seconds=0.0)
    d = decide("auto", True, "object store", plan, slow, budget=1 << 20)
    assert not d.exchange
    assert d.reason.startswith("shared storage (object store), the ranks' needs overlap by 4.00x,")
    assert "but exchanging would take" in d.reason
    # A tiny load: the rounds' fixed cost outweighs what reading once saves.
    tiny = decide("auto", True, "object store", _plan(1, 1), ReadOnceCosts(round_seconds=1.0))
    assert not tiny.exchange and tiny.exchange_s > tiny.direct_s


def test_decisions_leave_rounds_and_budget_to_the_coordinator() -> None:
    d = decide(True, True, "object store", _plan(8, 8))
    assert (d.rounds, d.budget) == (0, 0)


# ---------------------------------------------------------------- shared_storage


@pytest.mark.parametrize("url", ["s3://bucket/ckpt", "gs://b/c", "memory://x/y"])
def test_urls_are_shared_object_stores(url: str) -> None:
    assert shared_storage(url) == (True, "object store")


def test_a_local_tmp_dir_is_not_shared(tmp_path: Path) -> None:
    shared, kind = shared_storage(str(tmp_path))
    assert not shared
    with open("/proc/mounts", encoding="utf-8") as f:
        kinds = {line.split()[2] for line in f if len(line.split()) >= 3}
    assert kind in kinds  # the type of the mount the directory is on


def _fake_mounts(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    real_open = open

    def fake_open(path: Any, *a: Any, **kw: Any) -> Any:
        if path == "/proc/mounts":
            return io.StringIO(text)
        return real_open(path, *a, **kw)

    # The module's own name `open` shadows the builtin for shared_storage only.
    monkeypatch.setattr(_read_once, "open", fake_open, raising=False)


def test_the_longest_mount_prefix_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = str(tmp_path.resolve())
    inner = f"{real}/on nfs"  # /proc/mounts writes a space as \040
    _fake_mounts(
        monkeypatch,
        "/dev/vda / ext4 rw 0 0\n"
        f"server:/export {inner.replace(' ', chr(92) + '040')} nfs4 rw 0 0\n"
        f"lus@tcp:/fs {real}/lustre lustre rw 0 0\n"
        f"tmpfs {real}/lustre-not tmpfs rw 0 0\n",
    )
    assert shared_storage(f"{inner}/ckpt") == (True, "nfs4")
    assert shared_storage(inner) == (True, "nfs4")
    assert shared_storage(f"{real}/lustre/step_5") == (True, "lustre")
    assert shared_storage(f"{real}/lustre-not/x") == (False, "tmpfs")  # not under /lustre
    assert shared_storage(f"{real}/elsewhere") == (False, "ext4")


def test_unreadable_mounts_count_as_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_mounts(path: Any, *a: Any, **kw: Any) -> Any:
        raise PermissionError(path)

    monkeypatch.setattr(_read_once, "open", no_mounts, raising=False)
    assert shared_storage(str(tmp_path)) == (False, "unknown")


# ---------------------------------------------------------------- check_read_once


def test_modes_pass_through() -> None:
    assert READ_ONCE_MODES == (True, False, "auto")
    for mode in READ_ONCE_MODES:
        assert check_read_once(mode) is mode


@pytest.mark.parametrize("bad", ["always", "Auto", 1, 0, None, "true"])
def test_other_values_are_refused_naming_the_value(bad: object) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        check_read_once(bad)
    assert str(ei.value) == f"read_once must be True, False or 'auto', got {bad!r}"
    assert isinstance(ei.value, UCPError)


def test_the_reader_refuses_a_bad_mode_before_opening_anything(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        UCPStorageReader(tmp_path / "missing", options=ReadOptions(read_once="yes"))
    assert str(ei.value) == "read_once must be True, False or 'auto', got 'yes'"
