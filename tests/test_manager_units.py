"""The manager's pure parts on their own: save schedule, retention, restore order, node layout, config, records."""

from __future__ import annotations

import dataclasses
import errno
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ucp_dcp.byteio.durable as durable
from ucp_dcp.byteio.durable import copy_durable, replace_via_temp, swap_paths
from ucp_dcp import ReadOptions
from ucp_dcp.errors import (
    CheckpointExistsError,
    CheckpointWriteError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
)
from ucp_dcp.manager._collective import NodeLayout
from ucp_dcp.manager.config import steps_to_delete, tiers_due
from ucp_dcp.manager._restore import Candidate, order_candidates
from ucp_dcp.manager.config import CheckpointConfig
from ucp_dcp.manager.records import ReshardEvent, RestoreRecord, SaveRecord
from ucp_dcp.manager.tiers import CommitMarker, FileDigest

# ---------------------------------------------------------------- which tiers a step goes to


def test_tiers_due() -> None:
    due = [tiers_due(s, local_interval=2, persistent_interval=3) for s in range(7)]
    assert due == [
        ("local", "persistent"), (), ("local",), ("persistent",), ("local",), (), ("local", "persistent"),
    ]


def test_tiers_due_without_local_tier() -> None:
    assert tiers_due(4, local_interval=None, persistent_interval=2) == ("persistent",)
    assert tiers_due(3, local_interval=None, persistent_interval=2) == ()


# ---------------------------------------------------------------- retention


def test_keep_last() -> None:
    assert steps_to_delete([1, 2, 3, 4, 5], 5, keep_last=2, keep_every=None) == [1, 2, 3]
    assert steps_to_delete([1, 2], 2, keep_last=3, keep_every=None) == []


def test_keep_every() -> None:
    assert steps_to_delete([10, 15, 20, 25, 30, 35], 35, keep_last=1, keep_every=10) == [15, 25]


def test_newest_is_kept_even_when_older_than_the_last() -> None:
    # A re-save of an old step (e.g. after restoring it) stays, whatever is committed after it.
    assert steps_to_delete([3, 4, 5, 6], 4, keep_last=1, keep_every=None) == [3, 5]


@given(
    committed=st.lists(st.integers(0, 60), unique=True, max_size=20).map(sorted),
    keep_last=st.integers(1, 5),
    keep_every=st.none() | st.integers(1, 10),
    data=st.data(),
)
def test_retention_properties(committed: list[int], keep_last: int, keep_every: int | None, data: st.DataObject) -> None:
    newest = data.draw(st.sampled_from(committed)) if committed else 0
    gone = steps_to_delete(committed, newest, keep_last=keep_last, keep_every=keep_every)
    kept = [s for s in committed if s not in gone]
    assert gone == sorted(gone) and set(gone) <= set(committed)
    assert newest not in gone
    assert set(committed[-keep_last:]) <= set(kept)
    if keep_every:
        assert not any(s % keep_every == 0 for s in gone)
    for s in gone:  # nothing deleted that a rule keeps
        assert s != newest and s not in committed[-keep_last:]


# ---------------------------------------------------------------- restore order


def _marker(step: int, world_size: int = 2, nonfinite: dict[str, list[int]] | None = None) -> CommitMarker:
    files = (FileDigest("rank00000-a.safetensors", 10, "0" * 32, 0),)
    return CommitMarker(step, world_size, 1.0, files, nonfinite or {}, {})


def _order(local: list[dict[int, CommitMarker]] | None, persistent: dict[int, CommitMarker], *,
           step: int | None = None, load_flagged: bool = False, rpn: int = 2) -> list[tuple[int, str]]:
    got = order_candidates(local, persistent, ranks_per_node=rpn, step=step, load_flagged=load_flagged)
    return [(c.step, c.tier) for c in got]


def test_newest_first_local_before_persistent() -> None:
    local = [{4: _marker(4), 6: _marker(6)}, {}]
    persistent = {3: _marker(3), 4: _marker(4), 5: _marker(5)}
    assert _order(local, persistent) == [(6, "local"), (5, "persistent"), (4, "local"), (4, "persistent"),
                                         (3, "persistent")]


def test_no_local_tier() -> None:
    assert _order(None, {1: _marker(1), 2: _marker(2)}) == [(2, "persistent"), (1, "persistent")]
    assert _order(None, {}) == []


def test_local_candidate_names_the_nodes_holding_it() -> None:
    # 4 ranks, 2 per node: ranks 0 and 2 lead nodes 0 and 1; node 1 lost step 5.
    m0, m2 = _marker(5), dataclasses.replace(_marker(5), created=2.0)
    local = [{5: m0, 4: _marker(4)}, {}, {4: _marker(4)}, {}]
    got = order_candidates(local, {}, ranks_per_node=2, step=None, load_flagged=False)
    assert got[0] == Candidate(5, "local", m0, (0,))
    assert got[1].step == 4 and got[1].nodes_with_step == (0, 1)
    # The marker is the lowest rank's.
    got = order_candidates([{}, {}, {5: m2}, {}], {}, ranks_per_node=2, step=None, load_flagged=False)
    assert got == [Candidate(5, "local", m2, (1,))]


def test_asked_step_only() -> None:
    local = [{4: _marker(4), 6: _marker(6)}]
    persistent = {4: _marker(4), 5: _marker(5)}
    assert _order(local, persistent, step=4, rpn=1) == [(4, "local"), (4, "persistent")]
    assert _order(local, persistent, step=9, rpn=1) == []


def test_flagged_steps() -> None:
    flagged = _marker(7, nonfinite={"w": [1]})
    persistent = {6: _marker(6), 7: flagged}
    assert _order(None, persistent) == [(6, "persistent")]
    assert _order(None, persistent, load_flagged=True) == [(7, "persistent"), (6, "persistent")]
    # Asked for by number, a flagged step is loaded whatever load_flagged says.
    assert _order(None, persistent, step=7) == [(7, "persistent")]


def test_candidates_are_frozen() -> None:
    c = Candidate(1, "local", _marker(1), (0,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.step = 2  # type: ignore[misc]


# ---------------------------------------------------------------- node layout


@pytest.mark.parametrize(
    ("rank", "world", "asked", "env", "rpn", "node", "nodes", "leader"),
    [
        (0, 1, None, {}, 1, 0, 1, True),
        (5, 8, None, {"LOCAL_WORLD_SIZE": "4"}, 4, 1, 2, False),
        (4, 8, 4, {"LOCAL_WORLD_SIZE": "2"}, 4, 1, 2, True),  # the config wins over the environment
        (3, 4, None, {}, 4, 0, 1, False),  # default: one node
        (6, 7, 3, {}, 3, 2, 3, True),  # the last node is partial
        (1, 2, 16, {}, 2, 0, 1, False),  # clamped to the world size
    ],
)
def test_node_layout(rank: int, world: int, asked: int | None, env: dict[str, str], rpn: int, node: int,
                     nodes: int, leader: bool) -> None:
    lay = NodeLayout.detect(rank, world, asked, env)
    assert (lay.ranks_per_node, lay.node, lay.num_nodes, lay.is_leader) == (rpn, node, nodes, leader)
    assert lay.node_of(rank) == node


# ---------------------------------------------------------------- config and records


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("keep_last", 0, "keep_last must be an int >= 1, got 0 \\(keep_last=0 would delete"),
        ("local_interval", -1, "local_interval must be an int >= 1, got -1$"),
        # ReadOptions refuses a bad io_threads itself (test_read_options.py), before a config
        # can hold it: what the config checks is that `read` is one.
        ("read", {"io_threads": 1}, "CheckpointConfig.read must be a ReadOptions, got "),
        ("keep_every", 0, "keep_every must be None or an int >= 1"),
        ("nonfinite", "warn", "nonfinite must be 'off', 'error' or 'flag'"),
    ],
)
def test_config_validate(field: str, value: object, match: str) -> None:
    cfg = dataclasses.replace(CheckpointConfig(), **{field: value})
    with pytest.raises(InvalidArgumentError, match=match):
        cfg.validate()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        # A truthy string once meant True: async_save="no" saved in the background.
        ("async_save", "no", "CheckpointConfig.async_save must be True or False, got str"),
        ("peer_replication", "false", "CheckpointConfig.peer_replication must be True or False"),
        ("placement_digests", 1, "CheckpointConfig.placement_digests must be True or False, got int"),
        ("storage_options", 5, "CheckpointConfig.storage_options must be a dict or None, got int"),
        ("requests", {}, "CheckpointConfig.requests must be a RequestPolicy or None, got dict"),
    ],
)
def test_config_validate_refuses_a_field_of_the_wrong_type(field: str, value: object, says: str) -> None:
    cfg = dataclasses.replace(CheckpointConfig(), **{field: value})
    with pytest.raises(InvalidArgumentTypeError, match=says):
        cfg.validate()


def test_config_local_takes_a_path_like() -> None:
    dataclasses.replace(CheckpointConfig(), local=Path("/tmp/node{node}")).validate()


def test_config_defaults_valid() -> None:
    CheckpointConfig().validate()


def test_config_help_describes_every_field() -> None:
    doc = CheckpointConfig.__doc__ or ""
    for f in dataclasses.fields(CheckpointConfig):
        shown = f.metadata["shown"]  # the default's repr, or a shorter spelling equal to it
        assert f"    {f.name} (default {shown}):" in doc
        assert eval(shown, {"ReadOptions": ReadOptions}) == f.default
        assert f.metadata["doc"].split()[0] in doc
    assert "Fields:" in doc and "backpressure" in doc


def test_records_are_frozen() -> None:
    for rec in (ReshardEvent(1, 4, 3, "local"), SaveRecord(1, 0.1, 0.2, 3, ("local",)),
                RestoreRecord(1, "local", 0.1, (), 0)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            rec.step = 2  # type: ignore[misc]


# ---------------------------------------------------------------- durable helpers used by the tiers


def test_replace_via_temp_leaves_nothing_on_failure(tmp_path: Path) -> None:
    dst = tmp_path / "f.bin"
    dst.write_bytes(b"old")

    def fill(tmp: str) -> None:
        Path(tmp).write_bytes(b"partial")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        replace_via_temp(str(dst), fill)
    assert os.listdir(tmp_path) == ["f.bin"] and dst.read_bytes() == b"old"
    src = tmp_path / "src.bin"
    src.write_bytes(b"new" * 1000)
    replace_via_temp(str(dst), lambda tmp: copy_durable(str(src), tmp))
    assert dst.read_bytes() == b"new" * 1000 and sorted(os.listdir(tmp_path)) == ["f.bin", "src.bin"]


def test_swap_paths(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"a")
    (tmp_path / "b").mkdir()
    if not swap_paths(str(tmp_path / "a"), str(tmp_path / "b")):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == ["x"]


def test_swap_paths_missing_side_is_a_write_error(tmp_path: Path) -> None:
    """renameat2 failing for a reason other than "unsupported" names both paths and the errno."""
    (tmp_path / "b").mkdir()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    if durable._libc("renameat2", []) is False:
        pytest.skip("no renameat2 here")
    with pytest.raises(CheckpointWriteError, match=f"renameat2.*{a} and {b} failed") as info:
        swap_paths(a, b)
    assert info.value.errno == errno.ENOENT and os.listdir(tmp_path) == ["b"]


def test_swap_paths_across_file_systems_is_refused(tmp_path: Path) -> None:
    """Paths on two file systems (EXDEV) give False, nothing moved, for the caller's fallback."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system here")
    (tmp_path / "a").write_bytes(b"a")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        Path(other, "b").write_bytes(b"b")
        if durable._libc("renameat2", []) is False:
            pytest.skip("no renameat2 here")
        assert swap_paths(str(tmp_path / "a"), os.path.join(other, "b")) is False
        assert Path(other, "b").read_bytes() == b"b"
    assert (tmp_path / "a").read_bytes() == b"a"


def test_libc_missing_function_is_false() -> None:
    assert durable._libc("ucp_dcp_no_such_libc_function", []) is False


def test_write_all_zero_progress_is_a_write_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that returns 0 (it never does for a regular file) raises instead of spinning."""
    monkeypatch.setattr(durable, "_pwrite", lambda fd, view, offset: 0)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(CheckpointWriteError, match="write made no progress at offset 7") as info:
            durable.write_all(fd, b"abc", 7)
    finally:
        os.close(fd)
    assert info.value.errno == errno.EIO


def test_fsync_path_and_remove_quietly_are_best_effort(tmp_path: Path) -> None:
    """A missing path, or one whose fsync is refused (a character device), is no error."""
    assert durable.fsync_path(str(tmp_path / "missing")) is None
    assert durable.fsync_path(os.devnull) is None  # fsync(/dev/null) is EINVAL
    assert durable.remove_quietly(str(tmp_path / "missing")) is None
    assert os.listdir(tmp_path) == []


def test_building_dir_into_non_empty_dst(tmp_path: Path) -> None:
    """A destination that filled up meanwhile refuses the move and the build directory goes."""
    dst = tmp_path / "out"
    with pytest.raises(CheckpointExistsError, match=f"{dst}: cannot move the finished output into place"):
        with durable.building_dir(str(dst)) as tmp:
            Path(tmp, "x").write_bytes(b"x")
            dst.mkdir()
            (dst / "other").write_bytes(b"o")
    assert os.listdir(tmp_path) == ["out"] and os.listdir(dst) == ["other"]
