"""Storage tiers (ucp_dcp.manager.tiers): commit protocol, listing, replacement, deletion, crash states.

Every behavioural test runs on a LocalTier (tmp_path), an FsspecTier on
``memory://`` and an FsspecTier on a real S3-compatible server (moto on
loopback, started once per session; skipped when moto/s3fs are missing).
LocalTier crash safety is checked by stopping commit()/delete() before each
of their file system operations in turn (as a SIGKILL there would) and
checking what a fresh process then sees, before and after cleanup().
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import ucp_dcp.byteio.durable as durable
import ucp_dcp.byteio.location as location
import ucp_dcp.manager.tiers.local as local_tier
import s3_server
from ucp_dcp.format import INDEX_FILE
from ucp_dcp.manager.tiers import (
    MARKER_FILE,
    CommitMarker,
    FileDigest,
    FsspecTier,
    LocalTier,
    Tier,
    open_tier,
    step_dir_name,
)
from ucp_dcp.errors import CheckpointFormatError, InvalidArgumentError, StorageError

KINDS = ["local", "memory", "s3"]
s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module


# ---------------------------------------------------------------- fixtures


@pytest.fixture(params=KINDS)
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Tier]:
    """A factory of Tier objects over one fresh root (each call: a new object, as another process would open it)."""
    kind = request.param
    if kind == "local":
        root = str(tmp_path / "tier")
        return lambda: LocalTier(root, name="local")
    if kind == "memory":
        root = f"memory://ucp-tiers-{uuid.uuid4().hex[:10]}/run"
        request.addfinalizer(lambda: _rm_memory(root))
        return lambda: FsspecTier(root, name="mem")
    url, options = request.getfixturevalue("s3_bucket")
    root = f"{url}/{uuid.uuid4().hex[:10]}/ckpt"

    def make() -> Tier:
        tier = FsspecTier(root, name="s3", storage_options=options)
        tier.store.fs.invalidate_cache()
        return tier

    return make


def _rm_memory(root: str) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _hex(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _payload(step: int, tag: str, world: int = 2) -> dict[str, bytes]:
    files = {INDEX_FILE: json.dumps({"step": step, "tag": tag}).encode()}
    for r in range(world):
        # Distinct sizes and contents per step/tag/rank; a few KiB with all byte values.
        files[f"rank{r:05d}-{tag}.safetensors"] = bytes((i * 7 + r + step) % 256 for i in range(3000 + 17 * r + step))
    return files


def _marker(step: int, files: dict[str, bytes], *, created: float = 1.7e9, extra: dict[str, Any] | None = None) -> CommitMarker:
    digests = []
    for name, data in files.items():
        rank = -1 if name == INDEX_FILE else int(name[4:9])
        digests.append(FileDigest(name, len(data), _hex(data), rank))
    return CommitMarker(step, 2, created, tuple(digests), {}, extra or {})


def _save(
    tier: Tier,
    step: int,
    tag: str,
    tmp_path: Path,
    *,
    created: float = 1.7e9,
    commit: bool = True,
) -> tuple[str, CommitMarker, dict[str, bytes]]:
    """A whole save: begin, rank files through put_file, the index through put_bytes, commit."""
    files = _payload(step, tag)
    staging = tier.begin(step, tag)
    assert staging == tier.staging_path(step, tag)
    src = tmp_path / f"src-{tag}-{step}"
    src.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if name == INDEX_FILE:
            tier.put_bytes(staging, name, data)
        else:
            (src / name).write_bytes(data)
            tier.put_file(staging, str(src / name), name)
    marker = _marker(step, files, created=created, extra={"tag": tag})
    if commit:
        tier.commit(staging, marker)
    return staging, marker, files


def _check_step(tier: Tier, step: int, files: dict[str, bytes], dest: Path) -> None:
    """Step is listed, its marker describes ``files`` and fetch returns them byte for byte."""
    assert step in tier.steps()
    marker = tier.marker(step)
    assert {f.name for f in marker.files} == set(files)
    assert tier.files(step) == {n: len(d) for n, d in files.items()}
    tier.fetch(step, list(files), str(dest))
    assert sorted(os.listdir(dest)) == sorted(files)  # no temp names left behind
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
        assert marker.digest(name) == FileDigest(name, len(data), _hex((dest / name).read_bytes()), marker.digest(name).rank)


def _corrupt_marker(tier: Tier, step: int, data: bytes) -> None:
    if isinstance(tier, LocalTier):
        Path(tier.step_path(step), MARKER_FILE).write_bytes(data)
    else:
        assert isinstance(tier, FsspecTier)
        tier.store.fs.pipe_file(tier.store.fs._strip_protocol(tier.step_path(step)) + "/" + MARKER_FILE, data)


def _entries(tier: Tier) -> list[str]:
    """Names directly under the tier's root."""
    if isinstance(tier, LocalTier):
        return sorted(os.listdir(tier.url))
    assert isinstance(tier, FsspecTier)
    tier.store.fs.invalidate_cache()
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in tier.store.fs.ls(tier.store.root, detail=False))
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------- round trip


def test_round_trip(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    assert tier.steps() == []
    staging, marker, files = _save(tier, 100, "tokA", tmp_path)
    other = make_tier()  # another process
    assert other.steps() == [100]
    assert other.marker(100) == marker
    assert other.marker(100).extra == {"tag": "tokA"}
    _check_step(other, 100, files, tmp_path / "dest")
    assert other.read_bytes(100, INDEX_FILE) == files[INDEX_FILE]
    path = other.step_path(100)
    if other.local:
        assert path == os.path.join(other.url, step_dir_name(100))
        assert sorted(os.listdir(path)) == sorted([*files, MARKER_FILE])
        assert not os.path.exists(staging)
    else:
        assert path.rstrip("/").endswith("/step-000000000100-tokA")
        assert path == staging
    assert other.cleanup() == []
    assert other.steps() == [100]


def test_many_steps_sorted_and_junk_ignored(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    for step in (30, 2, 1000):
        _save(tier, step, f"t{step}", tmp_path)
    # Junk of every kind next to the steps.
    if isinstance(tier, LocalTier):
        root = Path(tier.url)
        (root / "notes.txt").write_text("hi")
        (root / "step-abc").mkdir()
        (root / "step-5").mkdir()  # not the canonical %012d name
        (root / step_dir_name(7)).mkdir()  # uncommitted
        (root / step_dir_name(8)).write_text("a file")
    else:
        assert isinstance(tier, FsspecTier)
        tier.store.fs.pipe_file(tier.store.root + "/notes.txt", b"hi")
        tier.store.fs.pipe_file(tier.store.root + "/step-abc/x", b"x")
        tier.store.fs.pipe_file(tier.store.root + f"/{step_dir_name(7)}/x", b"x")  # no token
        tier.store.fs.pipe_file(tier.store.root + f"/{step_dir_name(9)}-tok/x", b"x")  # uncommitted
    fresh = make_tier()
    assert fresh.steps() == [2, 30, 1000]
    assert fresh.markers() == {s: fresh.marker(s) for s in (2, 30, 1000)}  # junk left out there too
    if isinstance(fresh, FsspecTier):
        copy = fresh.copy_of(30)
        assert (copy.marker, copy.url) == (fresh.marker(30), fresh.step_path(30))
        assert copy.sizes == fresh.files(30)
        assert fresh.read_at(copy, INDEX_FILE) == fresh.read_bytes(30, INDEX_FILE)


# ---------------------------------------------------------------- staging


def test_uncommitted_never_listed_and_cleaned(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    _, _, files1 = _save(tier, 1, "one", tmp_path)
    staging, _, _ = _save(tier, 5, "five", tmp_path, commit=False)
    other = make_tier()
    assert other.steps() == [1]
    with pytest.raises(CheckpointFormatError, match="step 5"):
        other.marker(5)
    with pytest.raises(CheckpointFormatError, match="step 5"):
        other.fetch(5, [INDEX_FILE], str(tmp_path / "x"))
    done = other.cleanup()
    assert len(done) == 1 and "step-000000000005" in done[0], done
    if other.local:
        assert not os.path.exists(staging)
    assert _entries(other) == [os.path.basename(other.step_path(1).rstrip("/"))]
    _check_step(make_tier(), 1, files1, tmp_path / "d1")


def test_begin_removes_leftover_staging(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    staging, _, _ = _save(tier, 3, "same", tmp_path, commit=False)
    tier.put_bytes(staging, "stale.bin", b"stale")
    # The process died; a new attempt uses the same token.
    _, marker, files = _save(make_tier(), 3, "same", tmp_path)
    tier = make_tier()
    assert tier.marker(3) == marker
    assert tier.files(3) == {n: len(d) for n, d in files.items()}  # stale.bin gone


def test_commit_refuses_missing_or_wrong_size(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    staging, marker, files = _save(tier, 4, "bad", tmp_path, commit=False)
    name = next(n for n in files if n != INDEX_FILE)
    missing = CommitMarker(4, 2, 1.0, marker.files + (FileDigest("rank00001-x.safetensors", 3, "0" * 32, 1),))
    with pytest.raises(CheckpointFormatError, match=r"rank00001-x\.safetensors.*lacks it") as ei:
        tier.commit(staging, missing)
    assert repr(tier.name) in str(ei.value) and "step 4" in str(ei.value)
    wrong = CommitMarker(
        4, 2, 1.0, tuple(FileDigest(f.name, f.size + 1, f.xxh3, f.rank) if f.name == name else f for f in marker.files)
    )
    with pytest.raises(CheckpointFormatError, match=f"{name}.*says {len(files[name]) + 1} bytes"):
        tier.commit(staging, wrong)
    with pytest.raises(InvalidArgumentError, match="marker is for step 5"):
        tier.commit(staging, CommitMarker(5, 2, 1.0, marker.files))
    assert make_tier().steps() == []
    tier.commit(staging, marker)  # the staging is still usable
    assert make_tier().steps() == [4]


def test_bad_names_and_tokens(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    staging = tier.begin(1, "tok")
    for bad in ("../x", "a/b", "", ".", "..", MARKER_FILE):
        with pytest.raises(InvalidArgumentError):
            tier.put_bytes(staging, bad, b"x")
    for tok in ("", "a/b", "a.b", "x" * 65, ".."):
        with pytest.raises(InvalidArgumentError, match="token"):
            tier.begin(1, tok)
    with pytest.raises(InvalidArgumentError, match="step"):
        tier.begin(-1, "tok")
    with pytest.raises(InvalidArgumentError, match="not a staging"):
        tier.put_bytes(tier.url + "/elsewhere", "a", b"x")


# ---------------------------------------------------------------- replace, delete


@pytest.mark.parametrize("exchange", [True, False], ids=["swap", "renames"])
def test_recommit_replaces(
    make_tier: Callable[[], Tier], tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    if not exchange:
        if not tier.local:
            pytest.skip("the atomic swap only exists for LocalTier")
        monkeypatch.setattr(durable, "_renameat2", False)
    _save(tier, 6, "keep", tmp_path)
    _, old_marker, old_files = _save(tier, 7, "old", tmp_path, created=2e9)
    # The re-save's clock is behind: it must win anyway.
    _, new_marker, new_files = _save(make_tier(), 7, "new", tmp_path, created=1e9)
    other = make_tier()
    assert other.steps() == [6, 7]
    assert other.marker(7) == new_marker
    assert set(other.files(7)) == set(new_files)  # old rank files gone
    assert not set(old_files) - {INDEX_FILE} & set(other.files(7))
    _check_step(other, 7, new_files, tmp_path / "d7")
    entries = _entries(other)
    assert len(entries) == 2, entries  # one dir per step, nothing left over
    assert other.cleanup() == []


def test_delete(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    saved = {s: _save(tier, s, f"t{s}", tmp_path)[2] for s in (1, 2, 3)}
    tier.delete(2)
    other = make_tier()
    assert other.steps() == [1, 3]
    with pytest.raises(CheckpointFormatError, match="step 2"):
        other.marker(2)
    with pytest.raises(CheckpointFormatError, match="cannot delete: no such step"):
        other.delete(2)
    assert other.cleanup() == []
    assert len(_entries(other)) == 2
    for s in (1, 3):
        _check_step(other, s, saved[s], tmp_path / f"d{s}")
    other.delete(1)
    other.delete(3)
    assert make_tier().steps() == []


# ---------------------------------------------------------------- corrupt markers


@pytest.mark.parametrize(
    "data, message",
    [
        (b'{"format": "ucp_dcp.commit", "vers', "truncated or corrupt commit marker"),
        (b"\xff\xfe", "truncated or corrupt commit marker"),
        (b"[]", "must be a JSON object"),
        (b'{"format": "other"}', "field 'format'"),
    ],
)
def test_corrupt_marker(make_tier: Callable[[], Tier], tmp_path: Path, data: bytes, message: str) -> None:
    tier = make_tier()
    _, _, files1 = _save(tier, 1, "a", tmp_path)
    _save(tier, 2, "b", tmp_path)
    _corrupt_marker(tier, 2, data)
    other = make_tier()
    assert other.steps() == [1]
    with pytest.raises(CheckpointFormatError, match=message) as ei:
        other.marker(2)
    text = str(ei.value)
    assert repr(other.name) in text and other.url in text and "step 2" in text and MARKER_FILE in text
    _check_step(other, 1, files1, tmp_path / "d1")


def test_marker_of_another_step_ignored(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    _save(tier, 2, "b", tmp_path)
    _corrupt_marker(tier, 2, _marker(3, _payload(3, "b")).encode())
    other = make_tier()
    assert other.steps() == []
    with pytest.raises(CheckpointFormatError, match="names step 3, expected 2"):
        other.marker(2)


def test_fetch_missing_file_names_everything(make_tier: Callable[[], Tier], tmp_path: Path) -> None:
    tier = make_tier()
    _save(tier, 9, "z", tmp_path)
    dest = tmp_path / "dest"
    with pytest.raises(CheckpointFormatError) as ei:
        tier.fetch(9, ["nope.bin"], str(dest))
    text = str(ei.value)
    assert repr(tier.name) in text and tier.url in text and "step 9" in text and "'nope.bin'" in text
    assert "expected" in text
    assert not dest.exists() or os.listdir(dest) == []
    with pytest.raises(CheckpointFormatError, match="nope.bin"):
        tier.read_bytes(9, "nope.bin")


def test_fetch_failure_leaves_no_partial_file(make_tier: Callable[[], Tier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    _, _, files = _save(tier, 9, "z", tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    name = next(n for n in files if n != INDEX_FILE)

    class Boom(Exception):
        pass

    if isinstance(tier, LocalTier):
        real = location.copy_durable

        def copy(src: str, dst: str) -> None:
            Path(dst).write_bytes(Path(src).read_bytes()[:100])
            raise Boom

        monkeypatch.setattr(location, "copy_durable", copy)
    else:
        assert isinstance(tier, FsspecTier)
        real = tier.store.download

        def copy(name: str, dst: str, size: int | None = None) -> None:
            Path(dst).write_bytes(b"partial")
            raise Boom

        monkeypatch.setattr(tier.store, "download", copy)
    with pytest.raises(Boom):
        tier.fetch(9, [name], str(dest))
    assert os.listdir(dest) == []
    del real


# ---------------------------------------------------------------- LocalTier crash states


class Crash(BaseException):
    """Stands for SIGKILL: nothing after it runs, no except clause catches it."""


class _Crasher:
    """Counts the file system operations of commit()/delete() and crashes before the k-th."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.n = 0

    def tick(self) -> None:
        if self.n == self.k:
            raise Crash
        self.n += 1


def _instrument(monkeypatch: pytest.MonkeyPatch, crasher: _Crasher) -> None:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **kw: Any) -> Any:
            crasher.tick()
            return fn(*a, **kw)

        return inner

    class OsProxy:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

    proxy = OsProxy()
    proxy.rename = wrap(os.rename)  # type: ignore[attr-defined]
    proxy.replace = wrap(os.replace)  # type: ignore[attr-defined]
    monkeypatch.setattr(local_tier, "os", proxy)
    for name in ("fsync_path", "swap_paths", "fsync_file"):
        monkeypatch.setattr(local_tier, name, wrap(getattr(local_tier, name)))
    monkeypatch.setattr(local_tier.LocalDir, "write_atomic", wrap(local_tier.LocalDir.write_atomic))
    real_remove = local_tier._remove_dir

    def remove(path: str) -> None:
        crasher.tick()
        if os.path.isdir(path) and os.path.exists(os.path.join(path, MARKER_FILE)):
            os.unlink(os.path.join(path, MARKER_FILE))
        crasher.tick()  # half removed: marker gone, data still there
        if os.path.isdir(path) and os.listdir(path):
            os.unlink(os.path.join(path, sorted(os.listdir(path))[0]))
        crasher.tick()  # more of it gone
        real_remove(path)

    monkeypatch.setattr(local_tier, "_remove_dir", remove)


def _crash_points(action: Callable[[], None], setup: Callable[[], None], check: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch) -> int:
    """Run ``action`` crashing before its k-th operation, for every k; ``check(finished)`` after each."""
    k = 0
    while True:
        setup()
        crasher = _Crasher(k)
        with monkeypatch.context() as mp:
            _instrument(mp, crasher)
            try:
                action()
                finished = True
            except Crash:
                finished = False
        check(finished)
        if finished:
            return k
        k += 1


@pytest.mark.parametrize("exchange", [True, False], ids=["swap", "renames"])
@pytest.mark.parametrize("resave", [False, True], ids=["new-step", "re-save"])
def test_local_commit_crash_at_every_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool, resave: bool) -> None:
    if not exchange:
        monkeypatch.setattr(durable, "_renameat2", False)
    root = tmp_path / "tier"
    src = tmp_path / "src"
    state: dict[str, Any] = {}
    (tmp_path / "probe-a").mkdir()
    (tmp_path / "probe-b").mkdir()
    # With an atomic swap a re-saved step is never even briefly unlisted.
    never_unlisted = resave and exchange and durable.swap_paths(str(tmp_path / "probe-a"), str(tmp_path / "probe-b"))

    def setup() -> None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        tier = LocalTier(root, name="local")
        state["before"] = {s: _save(tier, s, f"t{s}", src)[2] for s in (1, 3)}
        if resave:
            state["old"] = _save(tier, 2, "old", src)[2]
        staging, marker, files = _save(tier, 2, "new", src, commit=False)
        state["commit"] = (tier, staging, marker)
        state["new"] = files

    def action() -> None:
        tier, staging, marker = state["commit"]
        tier.commit(staging, marker)

    def check(finished: bool) -> None:
        tier = LocalTier(root, name="local")  # a new process after the crash
        listed = tier.steps()
        for s in (1, 3):  # unrelated committed steps: always listed and loadable
            assert s in listed
            _check_step(tier, s, state["before"][s], tmp_path / f"c{uuid.uuid4().hex}")
        if finished:
            assert listed == [1, 2, 3] and tier.marker(2).extra["tag"] == "new"
        if never_unlisted:
            assert 2 in listed
        state["points"].append(listed)
        tier.cleanup()
        after = tier.steps()
        if resave:
            # The previous copy of step 2 is never lost: old or new, complete.
            assert after == [1, 2, 3]
        else:
            assert after in ([1, 3], [1, 2, 3])
        if 2 in listed:  # once listed, cleanup never takes it back
            assert 2 in after
        if 2 in after:
            got = tier.marker(2).extra["tag"]
            assert got in (("new", "old") if resave else ("new",))
            if finished:
                assert got == "new"
            _check_step(tier, 2, state[got], tmp_path / f"c{uuid.uuid4().hex}")
        assert sorted(os.listdir(root)) == [step_dir_name(s) for s in after]  # no leftovers
        assert tier.cleanup() == []

    state["points"] = []
    points = _crash_points(action, setup, check, monkeypatch)
    assert points >= 4
    if resave and not exchange:  # the fallback's window, which cleanup() closes, was exercised
        assert [1, 3] in state["points"]


def test_local_delete_crash_at_every_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "tier"
    src = tmp_path / "src"
    state: dict[str, Any] = {}

    def setup() -> None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        tier = LocalTier(root, name="local")
        state["files"] = {s: _save(tier, s, f"t{s}", src)[2] for s in (1, 2, 3)}
        state["tier"] = tier

    def check(finished: bool) -> None:
        tier = LocalTier(root, name="local")
        listed = tier.steps()
        assert listed in ([1, 2, 3], [1, 3])
        if finished:
            assert listed == [1, 3]
        for s in listed:  # never listed half deleted
            _check_step(tier, s, state["files"][s], tmp_path / f"c{uuid.uuid4().hex}")
        tier.cleanup()
        assert tier.steps() == listed
        assert sorted(os.listdir(root)) == [step_dir_name(s) for s in listed]

    points = _crash_points(lambda: state["tier"].delete(2), setup, check, monkeypatch)
    assert points >= 3


def test_local_constructed_crash_states(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The states a crash leaves between the two renames of a re-save, built by hand."""
    monkeypatch.setattr(durable, "_renameat2", False)
    tier = LocalTier(tmp_path / "tier", name="local")
    root = Path(tier.url)
    _, _, files4 = _save(tier, 4, "v1", tmp_path)
    _, _, files5 = _save(tier, 5, "v1", tmp_path)
    _, _, files6 = _save(tier, 6, "v1", tmp_path)
    # Step 4: only .old-step-4 present (crash right after the first rename).
    os.rename(root / step_dir_name(4), root / f".old-{step_dir_name(4)}-abc")
    # Step 5: .old present and the new copy committed (crash before the old copy was removed).
    os.rename(root / step_dir_name(5), root / f".old-{step_dir_name(5)}-abc")
    staging, _, new5 = _save(tier, 5, "v2", tmp_path)
    # Step 6: .old present, step-6 uncommitted junk (no marker).
    os.rename(root / step_dir_name(6), root / f".old-{step_dir_name(6)}-abc")
    (root / step_dir_name(6)).mkdir()
    (root / step_dir_name(6) / "junk").write_bytes(b"j")
    # Step 7: a half-removed .old copy (marker gone) with step-7 missing: nothing to restore.
    (root / f".old-{step_dir_name(7)}-abc").mkdir()
    (root / f".old-{step_dir_name(7)}-abc" / "rank00000-x.safetensors").write_bytes(b"x")
    # A half-done delete and an unfinished save.
    (root / f".del-{step_dir_name(8)}-abc").mkdir()
    (root / f".tmp-{step_dir_name(9)}-abc").mkdir()

    assert tier.steps() == [5]
    done = tier.cleanup()
    assert any(line.startswith("restored step 4") for line in done), done
    assert any(line.startswith("restored step 6") for line in done), done
    assert tier.steps() == [4, 5, 6]
    assert tier.marker(5).extra == {"tag": "v2"}
    _check_step(tier, 4, files4, tmp_path / "d4")
    _check_step(tier, 5, new5, tmp_path / "d5")
    _check_step(tier, 6, files6, tmp_path / "d6")
    assert sorted(os.listdir(root)) == [step_dir_name(s) for s in (4, 5, 6)]
    assert tier.cleanup() == []
    del files5, staging


def test_local_two_old_copies_newest_restored(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "tier", name="local")
    root = Path(tier.url)
    _save(tier, 3, "a", tmp_path, created=1e9)
    os.rename(root / step_dir_name(3), root / f".old-{step_dir_name(3)}-a")
    _, _, newer = _save(tier, 3, "b", tmp_path, created=2e9)
    os.rename(root / step_dir_name(3), root / f".old-{step_dir_name(3)}-b")
    assert tier.steps() == []
    tier.cleanup()
    assert tier.steps() == [3]
    _check_step(tier, 3, newer, tmp_path / "d")
    assert os.listdir(root) == [step_dir_name(3)]


def test_local_dcp_writes_in_place(tmp_path: Path) -> None:
    """A local tier's staging is a plain directory: files written there in place commit as they are."""
    tier = LocalTier(tmp_path / "tier", name="local")
    staging = tier.begin(11, "inplace")
    files = _payload(11, "inplace")
    for name, data in files.items():
        Path(staging, name).write_bytes(data)
    tier.put_file(staging, os.path.join(staging, INDEX_FILE), INDEX_FILE)  # same file: only fsync'd
    marker = _marker(11, {n: Path(staging, n).read_bytes() for n in files})
    tier.commit(staging, marker)
    _check_step(tier, 11, files, tmp_path / "d")
    tier.fetch(11, [INDEX_FILE], tier.step_path(11))  # fetching into itself is a no-op
    assert tier.read_bytes(11, INDEX_FILE) == files[INDEX_FILE]


# ---------------------------------------------------------------- records


def _good_doc() -> dict[str, Any]:
    return _marker(12, _payload(12, "j"), extra={"k": [1, 2.5, None, "s"]}).to_json()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=10,
)
names = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=12).filter(lambda s: s not in (".", "..", MARKER_FILE))


@st.composite
def markers(draw: st.DrawFn) -> CommitMarker:
    world = draw(st.integers(1, 64))
    fnames = draw(st.lists(names, unique=True, max_size=6))
    files = tuple(
        FileDigest(n, draw(st.integers(0, 2**50)), draw(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)), draw(st.integers(-1, world - 1)))
        for n in fnames
    )
    nonfinite = draw(st.dictionaries(st.text(max_size=10), st.lists(st.integers(0, world - 1), max_size=4), max_size=3))
    extra = draw(st.dictionaries(st.text(max_size=6), json_values, max_size=4))
    created = draw(st.floats(0, 4e9, allow_nan=False))
    return CommitMarker(draw(st.integers(0, 2**53)), world, created, files, nonfinite, extra)


@settings(max_examples=60, deadline=None)
@given(markers())
def test_marker_json_round_trip(m: CommitMarker) -> None:
    again = CommitMarker.decode(m.encode(), "x")
    assert again == m
    assert CommitMarker.from_json(json.loads(json.dumps(m.to_json())), "x") == m
    for f in m.files:
        assert m.digest(f.name) == f


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.pop("step"), "'step'"),
        (lambda d: d.update(step=-1), "'step'"),
        (lambda d: d.update(step=True), "'step'"),
        (lambda d: d.update(step="3"), "'step'"),
        (lambda d: d.update(world_size=0), "'world_size'"),
        (lambda d: d.update(created="now"), "'created'"),
        (lambda d: d.update(created=-5), "'created'"),
        (lambda d: d.update(version=2), "'version'"),
        (lambda d: d.pop("format"), "'format'"),
        (lambda d: d.update(surprise=1), "'surprise'"),
        (lambda d: d.update(files={}), "'files'"),
        (lambda d: d["files"].append(d["files"][0]), "twice"),
        (lambda d: d["files"][0].update(name="../etc"), "files\\[0\\].*'name'"),
        (lambda d: d["files"][0].update(name="a/b"), "'name'"),
        (lambda d: d["files"][0].update(name=MARKER_FILE), "'name'"),
        (lambda d: d["files"][1].update(size=-1), "files\\[1\\].*'size'"),
        (lambda d: d["files"][1].update(size=1.5), "'size'"),
        (lambda d: d["files"][1].update(xxh3="ABC"), "'xxh3'"),
        (lambda d: d["files"][1].update(xxh3="0" * 16), "'xxh3'"),
        (lambda d: d["files"][1].update(rank=-2), "'rank'"),
        (lambda d: d["files"][1].update(rank=2), "world_size"),
        (lambda d: d["files"][1].pop("rank"), "files\\[1\\]"),
        (lambda d: d["files"][1].update(more=1), "files\\[1\\]"),
        (lambda d: d.update(nonfinite=[]), "'nonfinite'"),
        (lambda d: d.update(nonfinite={"w": [5]}), "'nonfinite'"),
        (lambda d: d.update(nonfinite={"w": "0"}), "'nonfinite'"),
        (lambda d: d.update(extra=[]), "'extra'"),
    ],
)
def test_marker_strict_errors(mutate: Callable[[dict[str, Any]], Any], field: str) -> None:
    doc = _good_doc()
    CommitMarker.from_json(doc, "somewhere/COMMIT.json")
    mutate(doc)
    with pytest.raises(CheckpointFormatError, match=f"somewhere/COMMIT.json: .*{field}"):
        CommitMarker.from_json(doc, "somewhere/COMMIT.json")


def test_marker_misc() -> None:
    m = CommitMarker.from_json(_good_doc(), "w")
    assert m.digest(INDEX_FILE).rank == -1
    with pytest.raises(CheckpointFormatError, match="lists no file 'nope'"):
        m.digest("nope")
    with pytest.raises(CheckpointFormatError, match="must be a JSON object"):
        CommitMarker.from_json([1], "w")
    with pytest.raises(InvalidArgumentError, match="'extra' must be JSON-able"):
        CommitMarker(1, 1, 0.0, (), {}, {"x": object()})
    with pytest.raises(InvalidArgumentError, match="'extra' must be JSON-able"):
        CommitMarker(1, 1, 0.0, (), {}, {"x": float("nan")})
    assert CommitMarker(1, 1, 3, [], {}, {}).files == ()  # list normalised, int time accepted
    assert step_dir_name(100) == "step-000000000100"
    with pytest.raises(InvalidArgumentError):
        step_dir_name(-1)


def test_open_tier(tmp_path: Path) -> None:
    t = open_tier(tmp_path / "a", name="n")
    assert isinstance(t, LocalTier) and t.local and t.url == str(tmp_path / "a")
    assert isinstance(open_tier(str(tmp_path / "b"), name="n"), LocalTier)
    f = open_tier(f"file://{tmp_path}/c", name="n")
    assert isinstance(f, LocalTier) and f.url == f"{tmp_path}/c" and os.path.isdir(f.url)
    mem = open_tier("memory://ucp-open-tier/x", name="m")
    assert isinstance(mem, FsspecTier) and not mem.local and mem.name == "m"


def test_local_tier_odd_paths(tmp_path: Path) -> None:
    """A root that cannot be created, a root removed under the tier, leftovers at a staging
    path that are a file or a symlink (removed, the link's target untouched), a commit of a
    staging directory that was never begun, verify of a step that is not there."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(StorageError, match=rf"^tier 'local' \({blocker}/root\): cannot create the tier directory {blocker}/root: Not a directory$"):
        LocalTier(blocker / "root", name="local")
    with pytest.raises(StorageError, match=rf"cannot create the tier directory {blocker}: File exists"):
        LocalTier(blocker, name="local")

    tier = LocalTier(tmp_path / "tier", name="local")
    assert repr(tier) == f"LocalTier(name='local', url='{tmp_path}/tier')"
    staging = tier.staging_path(5, "tok")
    Path(staging).write_bytes(b"leftover")
    assert tier.begin(5, "tok") == staging and os.listdir(staging) == []
    os.rmdir(staging)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / MARKER_FILE).write_bytes(b"kept")
    os.symlink(target, staging)
    assert tier.begin(5, "tok") == staging
    assert not os.path.islink(staging) and os.listdir(staging) == []
    assert (target / MARKER_FILE).read_bytes() == b"kept"

    never = tier.staging_path(6, "tok")
    with pytest.raises(StorageError, match=f"staging directory {never} does not exist \\(call begin\\(\\) first\\)"):
        tier.commit(never, _marker(6, {}))
    assert tier.verify(6) == [
        f"step 6 in the local tier ({tier.url}): tier 'local' ({tier.url}), step 6: no such step "
        f"(expected a committed step directory {tier.step_path(6)})"
    ]

    for p in (staging, tier.url):
        os.rmdir(p)
    assert tier.markers() == {} and tier.steps() == []  # the root is gone: nothing committed
    assert open_tier("file://", name="n").url == "/"


def test_marker_constructor_refusals() -> None:
    with pytest.raises(InvalidArgumentError, match=r"field 'files' must be a sequence of FileDigest, got \('a',\)"):
        CommitMarker(1, 1, 0.0, ("a",), {}, {})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="field 'nonfinite': tensor names must be strings, got 3"):
        CommitMarker(1, 1, 0.0, (), {3: [0]}, {})  # type: ignore[dict-item]


def test_fsspec_file_missing_from_a_copy_and_a_marker_that_is_a_directory(tmp_path: Path) -> None:
    """read_at of a file gone from a copy names the object expected; a commit marker that is a
    directory (a file:// tier) is 'not a file', and the step is not listed."""
    tier = FsspecTier(f"file://{tmp_path}/root", name="f")
    _, _, files = _save(tier, 4, "b", tmp_path)
    copy = tier.copy_of(4)
    name = sorted(files)[1]
    step_dir = copy.url.removeprefix("file://")
    os.unlink(f"{step_dir}/{name}")
    with pytest.raises(CheckpointFormatError) as ei:
        tier.read_at(copy, name)
    assert str(ei.value) == f"tier 'f' ({tier.url}), step 4, file '{name}': missing (expected an object {copy.url}/{name})"

    os.unlink(f"{step_dir}/{MARKER_FILE}")
    os.mkdir(f"{step_dir}/{MARKER_FILE}")
    with pytest.raises(CheckpointFormatError) as ei:
        tier.marker(4)
    assert str(ei.value) == (
        f"tier 'f' ({tier.url}), step 4, file '{MARKER_FILE}' ({copy.url}/{MARKER_FILE}): not a file "
        f"([Errno 21] Is a directory: '{step_dir}/{MARKER_FILE}')"
    )
    assert tier.steps() == []


def test_fsspec_cleanup_removes_an_older_copy_of_a_step(tmp_path: Path) -> None:
    """Two committed copies of one step (a crash between a re-save's commit and the old copy's
    removal): cleanup removes the older one, the step stays listed with the newer copy."""
    tier = FsspecTier(f"file://{tmp_path}/root", name="f")
    _save(tier, 5, "a", tmp_path)
    old = tier.copy_of(5).url.removeprefix("file://")
    new = old.replace("step-000000000005-a", "step-000000000005-z")
    shutil.copytree(old, new)  # same marker: the later name wins the tie
    assert tier.copy_of(5).url == f"file://{new}"
    assert tier.cleanup() == [f"removed file://{old} (older copy of step 5)"]
    assert not os.path.exists(old) and tier.steps() == [5] and tier.verify(5) == []
