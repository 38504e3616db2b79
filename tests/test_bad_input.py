"""Damaged, foreign or mismatched checkpoints fail loudly, with a message that
says what is wrong, and a failed attempt never changes what is on disk.

Single process, no process group: ``dcp.save``/``dcp.load`` run in
"single process" mode. DCP wraps errors raised by planners and storage in
``CheckpointException`` (a ``BaseException``) whose text holds the original
message; the tests match on that text.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp.byteio.location
from ucp_dcp import (
    Checkpoint,
    ProgressConfig,
    ReadOnceCosts,
    ReadOptions,
    RequestPolicy,
    CheckpointFormatError,
    RankLocal,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    UCPWarning,
    load_index,
    load_state_dict,
    rebuild_index,
)
from ucp_dcp.format import ALIGN, BLOCK_SUMS_ENTRY, INDEX_FILE, PAD_PREFIX, VALUE_PREFIX, RANK_LOCAL_PREFIX, chunk_entry_name
from ucp_dcp.byteio.rangeio import read_header
from ucp_dcp.sources import formats_looked_for
from ucp_dcp.core.values import decode_value
from ucp_dcp.errors import (
    CheckpointWriteError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    LayoutRuleError,
    UCPError,
    UnsupportedModelError,
    UnsupportedValueError,
    listed,
    unwrap,
)
from ucp_dcp import FlatShard, Fused, LayoutSpec, Piece, Rename, Shard, TensorPieces, convert, export_hf, fsdp1_state_dict, import_hf, load_into_module
from ucp_dcp.tools.inspection import diff_checkpoints

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    # Many tests load only part of the checkpoint on purpose.
    pytest.mark.filterwarnings(r"ignore:\d+ checkpoint key\(s\) not in the state dict:UserWarning"),
]


# ---------------------------------------------------------------- helpers


class Opaque:
    """A user class that can only be stored by pickling."""


def make_state() -> dict[str, Any]:
    """A small training-like state: tensors of several dtypes and shapes, values, a rank-local value."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(8, 16, generator=g),
            "b": torch.randn(16, generator=g).to(torch.bfloat16),
            "big": torch.randn(1100, generator=g),  # >= ALIGN bytes: stored aligned, after padding
            "i": torch.arange(10, dtype=torch.int64) * -3,
            "c": torch.randn(3, generator=g, dtype=torch.complex64),  # no safetensors code: raw U8
        },
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "step": 7,
        "cfg": {"lr": 1e-3, "betas": (0.9, 0.999), "name": "adamw", "eps": [1e-8, float("inf")]},
        "rng": RankLocal({"seed": 1234, "pos": (3, 4)}),
    }


def blank_like(obj: Any) -> Any:
    """A load target with the structure of ``obj``: zeroed tensors, placeholder values."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, RankLocal):
        return RankLocal(None)
    if isinstance(obj, dict):
        return {k: blank_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [blank_like(v) for v in obj]
    return None


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_state_equal(got: Any, want: Any, path: str = "") -> None:
    """Bit-exact tensors, equal values with identical types, RankLocal values unwrapped."""
    if isinstance(want, RankLocal):
        assert isinstance(got, RankLocal), path
        assert_state_equal(got.value, want.value, path)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and bit_equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {set(got)} != {set(want)}"
        for k in want:
            assert_state_equal(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_state_equal(g, w, f"{path}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


def save(sd: dict[str, Any], path: Path, **writer_kw: Any) -> None:
    """Save with the ucp_dcp writer and planner."""
    dcp.save(sd, storage_writer=UCPStorageWriter(path, **writer_kw), planner=UCPSavePlanner())


def load(sd: dict[str, Any], path: Path, planner: UCPLoadPlanner | None = None, **reader_kw: Any) -> UCPLoadPlanner:
    """Load with the ucp_dcp reader and planner; returns the planner."""
    planner = planner or UCPLoadPlanner()
    dcp.load(sd, storage_reader=UCPStorageReader(path, options=ReadOptions(**reader_kw)), planner=planner)
    return planner


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (hidden ones too) with its bytes."""
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_load_fails(path: Path, match: str, sd: dict[str, Any] | None = None, **kw: Any) -> None:
    """``dcp.load`` fails with a message matching ``match`` and leaves ``path`` byte-for-byte as it was."""
    before = snapshot(path)
    existed = path.exists()
    with pytest.raises(CheckpointException, match=match):
        load(sd if sd is not None else blank_like(make_state()), path, **kw)
    assert snapshot(path) == before, "a failed load changed the checkpoint on disk"
    assert path.exists() == existed


def index_doc(path: Path) -> dict[str, Any]:
    """The parsed ``ucp_index.json``."""
    return json.loads((path / INDEX_FILE).read_text())


def write_doc(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``ucp_index.json`` (a deliberate edit, not through the library).

    The edit drops the index's digest, as an index written before digests
    existed has none: what is tested is the check of the edited field.
    """
    doc = {k: v for k, v in doc.items() if k != "digest"}
    (path / INDEX_FILE).write_text(json.dumps(doc))


def data_file(path: Path) -> Path:
    """The single data file of a single-process checkpoint."""
    files = index_doc(path)["files"]
    assert len(files) == 1
    return path / files[0]["name"]


def make_explicit(path: Path, fqn: str) -> dict[str, Any]:
    """Rewrite tensor ``fqn`` of the index from the compact form to the explicit
    form (file, byte range, box and checksum per chunk), taken from the data file's header."""
    doc = index_doc(path)
    t = doc["tensors"][fqn]
    assert "files" in t, "expected a compact entry"
    hdr = read_header(str(data_file(path)))
    offsets = [0] * len(t["shape"])
    name = chunk_entry_name(fqn, offsets)
    start, nbytes = hdr.ranges[name]
    del t["files"]
    t["chunks"] = [
        {"offsets": offsets, "sizes": list(t["shape"]), "file": 0, "start": start, "nbytes": nbytes, "xxh3": hdr.meta[name].xxh3}
    ]
    write_doc(path, doc)
    return doc


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A committed checkpoint of ``make_state()`` and the state it holds."""
    sd = make_state()
    path = tmp_path / "ckpt"
    save(sd, path)
    return path, make_state()


# ---------------------------------------------------------------- sanity


def test_roundtrip_is_bit_exact(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """The undamaged checkpoint loads bit-exactly (the baseline for every damage below)."""
    path, sd = ckpt
    out = blank_like(sd)
    load(out, path)
    assert_state_equal(out, sd)


def test_load_into_non_contiguous_targets(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """Transposed and narrowed target tensors are filled in place, without touching
    the rest of their storage."""
    path, sd = ckpt
    out = blank_like(sd)
    wt = torch.full((16, 8), -7.0)
    out["model"]["w"] = wt.t()
    big_base = torch.full((1300,), -7.0)
    out["model"]["big"] = big_base[100:1200]
    load(out, path)
    assert bit_equal(out["model"]["w"].contiguous(), sd["model"]["w"])
    assert bit_equal(out["model"]["big"].contiguous(), sd["model"]["big"])
    assert bool((big_base[:100] == -7).all() and (big_base[1200:] == -7).all())


# Regression: DCP's flattened paths hold str(key); values under int dict keys used to
# land under a new str key (DCP's own DefaultLoadPlanner still does that).
def test_int_keyed_nested_values_load_under_their_keys(tmp_path: Path) -> None:
    """Non-tensor values nested under int dict keys (optimizer-style state) load back
    under the same int keys."""
    path = tmp_path / "intkeys"
    sd = {"opt": {"state": {0: {"step": 5, "m": torch.ones(2)}, 1: {"step": 6, "m": torch.zeros(2)}}}}
    save(sd, path)
    out = {"opt": {"state": {0: {"step": None, "m": torch.full((2,), 9.0)}, 1: {"step": None, "m": torch.full((2,), 9.0)}}}}
    load(out, path)
    assert set(out["opt"]["state"]) == {0, 1}, f"keys after load: {list(out['opt']['state'])}"
    assert_state_equal(out, sd)


# ---------------------------------------------------------------- not a checkpoint


def test_missing_directory(tmp_path: Path) -> None:
    """A path that does not exist is reported as such, and is not created."""
    path = tmp_path / "nope"
    with pytest.raises(CheckpointFormatError, match="not a checkpoint.*no such directory"):
        load_index(str(path))
    assert_load_fails(path, match=r"nope: not a checkpoint \(no such directory\)")
    assert not path.exists()


def test_empty_directory(tmp_path: Path) -> None:
    """An empty directory is not a checkpoint: the index is missing; nothing is created."""
    path = tmp_path / "empty"
    path.mkdir()
    with pytest.raises(CheckpointFormatError, match="ucp_index.json is missing"):
        load_index(str(path))
    assert_load_fails(path, match=re.escape(f"{path} is not a checkpoint: found none of {', '.join(formats_looked_for())}; it is empty"))
    assert list(path.iterdir()) == []


def test_a_long_listing_says_how_many_it_left_out(tmp_path: Path) -> None:
    """A directory of 13 unrelated files: the error shows the first ten and counts the rest
    (errors.listed, every message's one form), rather than cutting the list silently."""
    path = tmp_path / "notes"
    path.mkdir()
    names = [f"note{i:02d}.txt" for i in range(13)]
    for n in names:
        (path / n).write_text("x")
    assert_load_fails(path, match=re.escape(f"it holds {', '.join(names[:10])} ... (3 more)"))
    assert sorted(p.name for p in path.iterdir()) == names
    assert listed(["a", "b"], 2) == "a, b" and listed([1, 2, 3], 2, "; ") == "1; 2 ... (1 more)"


def test_dcp_default_format_is_recognised(tmp_path: Path) -> None:
    """DCP's default format: load_index names it; UCPStorageReader reads it directly, touching nothing."""
    path = tmp_path / "dcp_default"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(path))
    assert (path / ".metadata").exists()
    with pytest.raises(CheckpointFormatError, match="DCP's default FileSystemWriter"):
        load_index(str(path))
    before = snapshot(path)
    sd = {"w": torch.zeros(3)}
    load(sd, path)
    assert torch.equal(sd["w"], torch.ones(3))
    assert snapshot(path) == before


def test_not_a_ucp_index(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A JSON document that is not a ucp_dcp index is refused."""
    path, _ = ckpt
    doc = index_doc(path)
    doc["format"] = "something-else"
    write_doc(path, doc)
    assert_load_fails(path, match=r'not a ucp_dcp index \(no "format": "ucp_dcp"\)')


# ---------------------------------------------------------------- damaged index


@pytest.mark.parametrize("version", [0, 2, 99, "1", None])
def test_unknown_format_version(ckpt: tuple[Path, dict[str, Any]], version: Any) -> None:
    """An index of another format version is refused, naming the version found."""
    path, _ = ckpt
    doc = index_doc(path)
    doc["version"] = version
    write_doc(path, doc)
    msg = rf"unsupported format version {re.escape(repr(version))}; this ucp_dcp reads version 1"
    with pytest.raises(CheckpointFormatError, match=msg):
        load_index(str(path))
    assert_load_fails(path, match=msg)


def test_truncated_index(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """An index cut in half is reported as truncated or corrupt."""
    path, _ = ckpt
    raw = (path / INDEX_FILE).read_bytes()
    (path / INDEX_FILE).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointFormatError, match="truncated or corrupt index"):
        load_index(str(path))
    assert_load_fails(path, match=r"ucp_index\.json: truncated or corrupt index")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(world_size="1"), r"field 'world_size' must be an integer, got '1'"),
        (lambda d: d.update(files={}), r"field 'files' must be a list"),
        (lambda d: d["files"][0].update(size=True), r"files\[0\]: field 'size' must be an integer"),
        (lambda d: d.update(tensors=[]), r"field 'tensors' must be an object"),
        (lambda d: d["tensors"]["model.w"].update(dtype="float128"), r"tensor 'model\.w': unknown dtype 'float128'"),
        (lambda d: d["tensors"]["model.w"].update(shape=[8, -16]), r"tensor 'model\.w': malformed shape \[8, -16\]"),
        (lambda d: d["tensors"]["model.w"].update(files=[[5, 1, 0]]), r"compact chunk list names 1 files for 1 chunks, or a file outside 0\.\.0"),
        (lambda d: d["tensors"]["model.w"].update(files=[[0, 2, 0]]), r"compact chunk list names 2 files for 1 chunks"),
        (lambda d: d["tensors"]["model.w"].update(files="0"), r"tensor 'model\.w': malformed file runs '0'"),
        (lambda d: d["tensors"]["model.w"].update(layout=None), r"tensor 'model\.w': compact chunk list without a layout"),
        (lambda d: d["tensors"]["model.w"].update(layout={"mesh": [2], "placements": []}), r"layout has 1 mesh dims but 0 placements"),
        (lambda d: d["values"]["step"].pop("xxh3"), r"value 'step': field 'xxh3' must be a string"),
        (lambda d: d["rank_local"].update(rng={"zero": {}}), r"rank-local value 'rng': malformed"),
    ],
    ids=[
        "world_size", "files", "file_size", "tensors", "dtype", "shape", "compact_file", "compact_count",
        "compact_runs", "no_layout", "layout_arity", "value_xxh3", "rank_local",
    ],
)
def test_malformed_index_fields(ckpt: tuple[Path, dict[str, Any]], edit: Callable[[dict[str, Any]], Any], match: str) -> None:
    """Malformed index fields are refused when the index is read, naming the field."""
    path, _ = ckpt
    doc = index_doc(path)
    edit(doc)
    write_doc(path, doc)
    with pytest.raises(CheckpointFormatError, match=match):
        load_index(str(path))
    assert_load_fails(path, match=match)


# ---------------------------------------------------------------- damaged data files


def test_truncated_data_file_tensors(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """Loading a tensor from a data file that lost its tail fails naming the file."""
    path, sd = ckpt
    f = data_file(path)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 10)
    out = {"model": {"w": torch.zeros(8, 16)}}
    assert_load_fails(
        path,
        match=re.escape(str(f)) + rf": truncated: entries need {size} bytes but the file has {size - 10}",
        sd=out,
        planner=UCPLoadPlanner(),
    )


def test_truncated_data_file_values(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """Loading values whose bytes were cut off fails naming the file: each value is
    cross-checked with its entry in the data file's header, whose check notices."""
    path, _ = ckpt
    f = data_file(path)
    first_value = min(v["start"] for v in index_doc(path)["values"].values())
    with open(f, "r+b") as fh:
        fh.truncate(first_value)
    match = re.escape(str(f)) + rf": truncated: entries need \d+ bytes but the file has {first_value}"
    assert_load_fails(path, match=match, sd={"step": None})


def test_data_file_cut_inside_header(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A data file cut inside its safetensors header fails naming the file."""
    path, _ = ckpt
    f = data_file(path)
    with open(f, "r+b") as fh:
        fh.truncate(100)
    assert_load_fails(path, match=re.escape(str(f)) + r": header length \d+ exceeds the file \(100 bytes\)")


def test_data_file_replaced_by_a_directory(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A directory where a data file should be opens, then fails its first read: named as what
    it is instead (and ``verify`` lists it)."""
    path, _ = ckpt
    f = data_file(path)
    f.unlink()
    f.mkdir()
    assert_load_fails(path, match=re.escape(f"data file {f} is not a regular file"), sd={"model": {"w": torch.zeros(8, 16)}})
    with Checkpoint(path) as ck:
        assert ck.verify() == [f"data file {f} is not a regular file"]


def test_dcp_data_file_that_is_a_symlink_loop(tmp_path: Path) -> None:
    """A path that cannot even be looked at (a symlink to itself) is named, not raised as OSError."""
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path))
    (data,) = tmp_path.glob("*.distcp")
    data.unlink()
    data.symlink_to(data.name)
    with pytest.raises(CheckpointFormatError, match=re.escape(f"{data}: cannot open (Too many levels of symbolic links)")):
        Checkpoint(tmp_path)


def test_missing_data_file(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A data file named by the index but deleted is reported missing, by name."""
    path, _ = ckpt
    f = data_file(path)
    f.unlink()
    assert_load_fails(path, match=re.escape(f"data file {f} is missing"), sd={"model": {"w": torch.zeros(8, 16)}})


def test_corrupted_value_fails_checksum(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """Flipping one byte inside a value's byte range fails the load with a checksum
    error naming the key and the file."""
    path, _ = ckpt
    f = data_file(path)
    loc = index_doc(path)["values"]["cfg.betas"]
    raw = bytearray(f.read_bytes())
    raw[loc["start"] + loc["nbytes"] // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    out = {"cfg": {"betas": None}}
    assert_load_fails(path, match=re.escape(str(f)) + r": checksum mismatch for value 'cfg\.betas': the file is corrupt", sd=out)


def test_corrupted_rank_local_value_fails_checksum(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A corrupted rank-local value fails its checksum too, naming the key."""
    path, _ = ckpt
    f = data_file(path)
    loc = index_doc(path)["rank_local"]["rng"]["0"]
    raw = bytearray(f.read_bytes())
    raw[loc["start"]] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert_load_fails(path, match=r"checksum mismatch for rank-local value 'rng' of rank 0", sd={"rng": RankLocal(None)})


# ---------------------------------------------------------------- index entries out of range


def test_explicit_chunk_entry_loads(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """The explicit chunk form (see Index.to_json) written by hand loads like the compact one."""
    path, sd = ckpt
    make_explicit(path, "model.w")
    make_explicit(path, "model.big")
    assert not load_index(str(path)).tensors["model.w"].compact
    out = blank_like(sd)
    load(out, path)
    assert_state_equal(out, sd)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("start_past_end", r"tensor 'model\.w' chunk 0: byte range \[\d+, \d+\) lies outside rank\d+-\w+\.safetensors \(\d+ bytes\)"),
        ("negative_start", r"tensor 'model\.w' chunk 0: byte range \[-\d+, \d+\) lies outside"),
        ("bad_file", r"tensor 'model\.w' chunk 0: file index 3 out of range \(index lists 1 files\)"),
        ("nbytes", r"tensor 'model\.w' chunk 0: 8 bytes recorded for 128 float32 elements"),
        ("box_outside", r"tensor 'model\.w' chunk 0: box \[4, 0\]\+\[8, 16\] lies outside shape \[8, 16\]"),
    ],
)
def test_explicit_chunk_out_of_range(ckpt: tuple[Path, dict[str, Any]], edit: str, match: str) -> None:
    """An explicit chunk entry pointing outside its file, at no file, with the wrong
    byte count or outside the tensor is refused when the index is read."""
    path, _ = ckpt
    doc = make_explicit(path, "model.w")
    size = doc["files"][0]["size"]
    c = doc["tensors"]["model.w"]["chunks"][0]
    if edit == "start_past_end":
        c["start"] = size - c["nbytes"] + 1
    elif edit == "negative_start":
        c["start"] = -4
    elif edit == "bad_file":
        c["file"] = 3
    elif edit == "nbytes":
        c["nbytes"] = 8
    elif edit == "box_outside":
        c["offsets"] = [4, 0]
    write_doc(path, doc)
    with pytest.raises(CheckpointFormatError, match=match):
        load_index(str(path))
    assert_load_fails(path, match=match)


@pytest.mark.parametrize(
    ("section", "key", "field", "delta"),
    [
        ("values", "step", "start", "size"),
        ("values", "cfg.name", "nbytes", "size"),
        ("rank_local", "rng", "start", "size"),
    ],
)
def test_value_range_outside_file(ckpt: tuple[Path, dict[str, Any]], section: str, key: str, field: str, delta: str) -> None:
    """A value or rank-local value whose start/nbytes reach past its file is refused, naming it."""
    path, _ = ckpt
    doc = index_doc(path)
    size = doc["files"][0]["size"]
    loc = doc[section][key] if section == "values" else doc[section][key]["0"]
    loc[field] = size
    write_doc(path, doc)
    what = f"value {key!r}" if section == "values" else f"rank-local value {key!r} of rank 0"
    match = re.escape(what) + r": byte range \[\d+, \d+\) lies outside"
    with pytest.raises(CheckpointFormatError, match=match):
        load_index(str(path))
    assert_load_fails(path, match=match)


@pytest.mark.parametrize(
    "name",
    ["/etc/passwd", "../other/rank00000-x.safetensors", "..", ".", "sub/rank00000-x.safetensors", "a\\b.safetensors", ""],
)
def test_data_file_name_outside_checkpoint(ckpt: tuple[Path, dict[str, Any]], name: str) -> None:
    """A data file name that is absolute, or contains '..' or a path separator, is refused
    before any file is opened."""
    path, _ = ckpt
    doc = index_doc(path)
    doc["files"][0]["name"] = name
    write_doc(path, doc)
    match = r"files\[0\]: data file name .* is not a plain file name inside the checkpoint directory"
    with pytest.raises(CheckpointFormatError, match=match):
        load_index(str(path))
    assert_load_fails(path, match=match)


# ---------------------------------------------------------------- strictness


def test_missing_key(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A state-dict key the checkpoint lacks fails the load, listing the keys;
    allow_partial_load=True loads everything else and leaves it alone."""
    path, sd = ckpt
    out = blank_like(sd)
    out["model"]["extra"] = torch.full((3,), 42.0)
    out["other"] = torch.full((2,), 42.0)
    assert_load_fails(
        path,
        match=re.escape("Missing key in checkpoint state_dict: 2 key(s) of the state dict are missing from the checkpoint: ['model.extra', 'other']")
        + r".*allow_partial_load=True",
        sd=out,
    )
    assert bool((out["model"]["w"] == 0).all()), "a refused load must not have filled anything"
    planner = load(out, path, UCPLoadPlanner(allow_partial_load=True))
    assert planner.missing_keys == ["model.extra", "other"]
    assert bool((out["model"]["extra"] == 42).all() and (out["other"] == 42).all())
    del out["model"]["extra"], out["other"]
    assert_state_equal(out, sd)


def test_unexpected_key(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """Checkpoint keys the state dict does not ask for are skipped with a warning
    listing them, and recorded in planner.unexpected_keys."""
    path, sd = ckpt
    out = blank_like(sd)
    del out["model"]["i"], out["step"]
    planner = UCPLoadPlanner()
    with pytest.warns(UCPWarning, match=re.escape("2 checkpoint key(s) not in the state dict were not loaded: ['model.i', 'step']")):
        load(out, path, planner)
    assert planner.unexpected_keys == ["model.i", "step"]
    del sd["model"]["i"], sd["step"]
    assert_state_equal(out, sd)


def test_shape_mismatch(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A tensor of another shape fails the load, naming the tensor and both shapes."""
    path, sd = ckpt
    out = blank_like(sd)
    out["model"]["w"] = torch.zeros(16, 8)
    assert_load_fails(
        path,
        match=re.escape("Size mismatch for 'model.w': the checkpoint has shape [8, 16], the state dict expects [16, 8]"),
        sd=out,
    )


def test_tensor_vs_value_mismatch(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A key that is a value in the checkpoint but a tensor in the state dict (and vice versa) fails, naming it."""
    path, sd = ckpt
    out = blank_like(sd)
    out["step"] = torch.zeros(1)
    assert_load_fails(path, match=r"'step' is a non-tensor value in the checkpoint but a tensor in the state dict", sd=out)
    out = blank_like(sd)
    out["scalar"] = 0
    assert_load_fails(path, match=r"'scalar' is a tensor of shape \[\] in the checkpoint but a int in the state dict", sd=out)


def test_dtype_mismatch_refused_when_strict(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """With allow_dtype_cast=False a tensor of another dtype fails the load, naming both dtypes."""
    path, sd = ckpt
    out = blank_like(sd)
    out["model"]["w"] = torch.zeros(8, 16, dtype=torch.float64)
    assert_load_fails(
        path,
        match=re.escape("dtype mismatch for 'model.w': the checkpoint has float32, the state dict expects float64, "
                        "and the load was made with UCPLoadPlanner(allow_dtype_cast=False)"),
        sd=out,
        planner=UCPLoadPlanner(allow_dtype_cast=False),
    )


def test_dtype_cast_by_default_says_which_keys(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """As in DCP, a tensor of another dtype is cast by default; one warning names the keys cast."""
    path, sd = ckpt
    out = blank_like(sd)
    out["model"]["w"] = torch.zeros(8, 16, dtype=torch.float64)
    with pytest.warns(UCPWarning, match=re.escape("1 tensor(s) are cast from the checkpoint's dtype on load: "
                                                  "['model.w (float32 -> float64)']")) as said:
        planner = load(out, path)
    cast = next(w.message for w in said if isinstance(w.message, UCPWarning))
    # The fix is named as data too (the ucp-dcp command says it in its own words).
    assert (cast.option, cast.option_value, cast.hint) == (
        "allow_dtype_cast", False, "UCPLoadPlanner(allow_dtype_cast=False)")
    assert planner.cast_keys == {"model.w": (torch.float32, torch.float64)}
    assert torch.equal(out["model"]["w"], sd["model"]["w"].to(torch.float64))


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (torch.float32, torch.float64),
        (torch.float32, torch.float16),  # overflows to inf like .to()
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.int32),  # truncation toward zero like .to()
        (torch.bfloat16, torch.float32),
        (torch.int64, torch.float32),
        (torch.float32, torch.bool),
    ],
)
def test_dtype_cast_matches_to(tmp_path: Path, src: torch.dtype, dst: torch.dtype) -> None:
    """With allow_dtype_cast=True a tensor is cast exactly like ``.to(dtype)``, including a
    tensor larger than the staging buffer (several slabs) and a non-contiguous target."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(600, 1000, generator=g) * 1e5  # 2.4 MB: more than the 1 MiB staging minimum
    base[0, :4] = torch.tensor([0.0, -0.0, 0.5, -2.7])
    sd = {"big": base.to(src), "small": (torch.randn(5, 7, generator=g) * 300).to(src)}
    path = tmp_path / "cast"
    save(sd, path)
    before = snapshot(path)
    out = {"big": torch.zeros(600, 1000, dtype=dst), "small": torch.zeros(7, 5, dtype=dst).t()}
    load(out, path, UCPLoadPlanner(allow_dtype_cast=True), max_buffer_bytes=1)  # clamped to 1 MiB
    for k in sd:
        assert bit_equal(out[k].contiguous(), sd[k].to(dst)), k
    assert snapshot(path) == before


# ---------------------------------------------------------------- saving over a checkpoint


def test_save_into_committed_checkpoint_refused_when_asked(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """With overwrite=False, saving into a directory that holds a committed checkpoint is refused and
    changes nothing (the default, as in DCP, replaces it atomically: see the tests below)."""
    path, sd = ckpt
    before = snapshot(path)
    with pytest.raises(CheckpointException, match=r"already holds a committed checkpoint.*overwrite=False"):
        save({"x": torch.ones(2)}, path, overwrite=False)
    assert snapshot(path) == before
    out = blank_like(sd)
    load(out, path)
    assert_state_equal(out, sd)


def test_overwrite_replaces_checkpoint(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """overwrite=True (the default) replaces the checkpoint: the new state loads, the old data files
    are gone, and no temporary file is left behind."""
    path, _ = ckpt
    old_files = {f["name"] for f in index_doc(path)["files"]}
    new = {"x": torch.arange(5, dtype=torch.int16), "step": 8}
    save(new, path)  # the default, as in DCP
    names = set(os.listdir(path))
    new_files = {f["name"] for f in index_doc(path)["files"]}
    assert names == new_files | {INDEX_FILE}, names
    assert not old_files & names
    out = {"x": torch.zeros(5, dtype=torch.int16), "step": 0}
    load(out, path)
    assert_state_equal(out, new)


def test_overwrite_is_atomic_when_commit_fails(ckpt: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """If an overwriting save dies before its index is committed, the old checkpoint
    still loads intact; the next successful save removes the orphaned data files."""
    path, sd = ckpt
    old_index = (path / INDEX_FILE).read_bytes()

    def boom(directory: str, index: Any) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ucp_dcp.byteio.location, "write_index", boom)
    with pytest.raises(CheckpointException, match="disk full"):
        save({"model": {"w": torch.ones(8, 16)}}, path, overwrite=True)
    monkeypatch.undo()
    assert (path / INDEX_FILE).read_bytes() == old_index
    out = blank_like(sd)
    load(out, path)
    assert_state_equal(out, sd)
    new = {"y": torch.ones(3)}
    save(new, path, overwrite=True)
    assert len([n for n in os.listdir(path) if n.endswith(".safetensors")]) == 1


def test_unpicklable_value_fails_save(tmp_path: Path) -> None:
    """A value that could only be pickled fails the save naming its key; nothing is committed."""
    path = tmp_path / "bad"
    sd = {"w": torch.ones(3), "cfg": {"obj": Opaque()}}
    with pytest.raises(CheckpointException, match=r"cfg\.obj: values of type .*Opaque cannot be saved without pickling"):
        save(sd, path)
    assert not (path / INDEX_FILE).exists()
    assert not [n for n in (os.listdir(path) if path.exists() else []) if n.endswith(".safetensors")]


def test_unpicklable_value_leaves_existing_checkpoint(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A refused save with overwrite=True leaves the existing checkpoint untouched."""
    path, _ = ckpt
    before = snapshot(path)
    with pytest.raises(CheckpointException, match=r"opt\.hook: values of type builtins\.function"):
        save({"w": torch.ones(3), "opt": {"hook": lambda: None}}, path, overwrite=True)
    assert snapshot(path) == before


# ---------------------------------------------------------------- rebuild


def test_rebuild_index_reproduces_committed_index(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """rebuild_index from the data files alone gives the committed index."""
    path, _ = ckpt
    before = snapshot(path)
    assert rebuild_index(str(path)).to_json() == load_index(str(path)).to_json()
    assert snapshot(path) == before, "rebuild_index without write=True must not write"


def test_rebuild_index_recovers_lost_index(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A checkpoint whose index was deleted is named as such, and rebuild_index(write=True)
    makes it load bit-exactly again; a second rebuild refuses to overwrite."""
    path, sd = ckpt
    committed = load_index(str(path)).to_json()
    (path / INDEX_FILE).unlink()
    assert_load_fails(path, match=re.escape(
        f"{path}: not a ucp_dcp checkpoint: {INDEX_FILE} is missing. A save that did not finish leaves no index; "
        "load an earlier checkpoint or rebuild the index from complete data files with "
        "ucp_dcp.rebuild_index(path, write=True)"))
    rebuilt = rebuild_index(str(path), write=True)
    assert rebuilt.to_json() == committed
    assert load_index(str(path)).to_json() == committed
    out = blank_like(sd)
    load(out, path)
    assert_state_equal(out, sd)
    with pytest.raises(FileExistsError):
        rebuild_index(str(path), write=True)


def test_rebuild_index_replaces_a_corrupt_index_on_request(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """The corrupt-index error says how to rebuild, and exactly that call works."""
    path, sd = ckpt
    committed = load_index(str(path)).to_json()
    (path / INDEX_FILE).write_text('{"format": "ucp_dcp", "vers')
    assert_load_fails(path, match=r"truncated or corrupt index.*rebuild_index\(path, write=True, replace=True\)")
    with pytest.raises(FileExistsError, match="replace=True"):
        rebuild_index(str(path), write=True)
    assert rebuild_index(str(path), write=True, replace=True).to_json() == committed
    out = blank_like(sd)
    load(out, path)
    assert_state_equal(out, sd)


# Regression: rebuild_index used to mix the data files of a committed save with
# those of a save that crashed before its commit.
def test_rebuild_index_does_not_mix_saves(ckpt: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """rebuild_index does not silently combine data files of two different saves: without
    ``save_id`` it refuses and lists them; ``save_id=`` picks one, and rebuilding the committed
    save (``write=True``) makes the checkpoint load bit-exactly again."""
    path, sd = ckpt
    committed = load_index(str(path))

    def boom(directory: str, index: Any) -> None:
        raise OSError("crash before commit (simulated)")

    monkeypatch.setattr(ucp_dcp.byteio.location, "write_index", boom)
    with pytest.raises(CheckpointException, match="crash before commit"):
        save(make_state() | {"step": 8}, path, overwrite=True)
    monkeypatch.undo()
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(names) == 2  # committed + orphan
    (path / INDEX_FILE).unlink()  # the index is lost: this is what rebuild_index is for
    save_of = {n: read_header(str(path / n)).save_id for n in names}
    (committed_file,) = [f.name for f in committed.files]
    (orphan_file,) = [n for n in names if n != committed_file]
    committed_id, orphan_id = save_of[committed_file], save_of[orphan_file]
    assert committed_id != orphan_id
    before = snapshot(path)
    listing = "; ".join(f"{s}: 1 file(s)" for s in sorted(save_of.values()))
    refusal = (
        f"holds data files of 2 different saves ({listing}); "
        "pass rebuild_index(path, save_id=...) to choose the one to rebuild"
    )
    with pytest.raises(CheckpointFormatError, match=re.escape(refusal)):
        rebuild_index(str(path))
    assert rebuild_index(str(path), save_id=committed_id).to_json() == committed.to_json()
    assert [f.name for f in rebuild_index(str(path), save_id=orphan_id).files] == [orphan_file]
    with pytest.raises(CheckpointFormatError, match="no data files of save 'no-such-save'"):
        rebuild_index(str(path), save_id="no-such-save")
    assert snapshot(path) == before, "rebuild_index without write=True must not write"
    rebuild_index(str(path), save_id=committed_id, write=True)
    assert load_index(str(path)).to_json() == committed.to_json()
    out = blank_like(make_state())
    load(out, path)
    assert_state_equal(out, sd)


def test_rebuild_index_on_empty_directory(tmp_path: Path) -> None:
    """rebuild_index on a directory without data files says so."""
    with pytest.raises(CheckpointFormatError, match="no .safetensors data files"):
        rebuild_index(str(tmp_path))


# ---------------------------------------------------------------- interoperability


def test_data_files_open_with_stock_safetensors(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """Every data file opens with ``safetensors.safe_open(path, "pt")``; its tensors equal the
    saved chunks, its values decode to the saved values, and large tensors are aligned."""
    path, sd = ckpt
    flat_tensors = {f"model.{k}": v for k, v in sd["model"].items()} | {"scalar": sd["scalar"], "empty": sd["empty"]}
    flat_values = {"step": sd["step"]} | {f"cfg.{k}": v for k, v in sd["cfg"].items()}
    index = load_index(str(path))
    seen_tensors: set[str] = set()
    seen_values: set[str] = set()
    for rec in index.files:
        fpath = str(path / rec.name)
        hdr = read_header(fpath)
        with safe_open(fpath, "pt") as f:
            meta = json.loads(f.metadata()["ucp_dcp"])
            assert meta["format"] == "ucp_dcp" and meta["version"] == 1
            for name in f.keys():
                t = f.get_tensor(name)
                if name.startswith(PAD_PREFIX):
                    continue
                if name == BLOCK_SUMS_ENTRY:  # block checksums (test_block_sums.py checks them)
                    assert t.dtype == torch.uint64 and hdr.block_sums is not None
                    continue
                if name.startswith(VALUE_PREFIX):
                    key = name[len(VALUE_PREFIX) :]
                    got = decode_value(t.numpy().tobytes(), key)
                    assert type(got) is type(flat_values[key]) and got == flat_values[key], key
                    seen_values.add(key)
                    continue
                if name.startswith(RANK_LOCAL_PREFIX):
                    assert decode_value(t.numpy().tobytes(), name) == sd["rng"].value
                    continue
                fqn, _, offs = name.rpartition("@")
                want = flat_tensors[fqn]
                assert offs == ",".join(["0"] * want.dim())  # one process: the whole tensor is one chunk
                if t.dtype != want.dtype:  # dtypes safetensors cannot name are stored as raw bytes
                    assert t.dtype == torch.uint8
                    t = t.view(want.dtype).reshape(want.shape)
                assert bit_equal(t, want), name
                start, nbytes = hdr.ranges[name]
                if nbytes >= ALIGN:
                    assert start % ALIGN == 0, f"{name} at {start} is not {ALIGN}-aligned"
                seen_tensors.add(fqn)
    assert seen_tensors == set(flat_tensors)
    assert seen_values == set(flat_values)


# ---------------------------------------------------------------- what a save may touch
def test_a_save_removes_only_the_data_files_saves_name(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A save removes the data files of older saves (the names it gives them, convert's
    ``-<n>`` ones too), never a user's own ``rank*.safetensors`` kept beside them."""
    path, sd = ckpt
    old = sorted(p.name for p in path.glob("rank*.safetensors"))
    (path / "rank_0.safetensors").write_bytes(b"mine")
    (path / "ranker_head.safetensors").write_bytes(b"mine too")
    (path / "rank00007-0ld5ave-1.safetensors").write_bytes(b"a convert's second file")
    save(sd, path)
    names = sorted(p.name for p in path.iterdir())
    assert "rank_0.safetensors" in names and "ranker_head.safetensors" in names, names
    assert not set(old) & set(names) and "rank00007-0ld5ave-1.safetensors" not in names, names
    assert_state_equal(_loaded(path), sd)


def _loaded(path: Path) -> dict[str, Any]:
    out = blank_like(make_state())
    load(out, path)
    return out


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"align": -4096}, "align=-4096): needs a whole number of bytes"),
        ({"align": 0}, "align=0): needs a whole number of bytes"),
        ({"align": True}, "align=True): needs a whole number of bytes"),
        ({"threads": "2"}, "threads='2'): needs a whole number of writer threads"),
        ({"progress": 5}, "progress=...) takes a ProgressConfig, got int"),
        ({"requests": {}}, "requests=...) takes a RequestPolicy, got dict"),
        # A truthy string once meant True: overwrite="no" replaced the committed checkpoint.
        ({"overwrite": "no"}, "overwrite='no'): takes True or False, got str"),
        ({"sync_files": "false"}, "sync_files='false'): takes True or False"),
        ({"placement_digests": 1}, "placement_digests=1): takes True or False, got int"),
    ],
)
def test_writer_arguments_are_checked_before_anything_is_written(
    ckpt: tuple[Path, dict[str, Any]], kw: dict[str, Any], says: str
) -> None:
    """A writer argument out of range is refused when the writer is made: the committed
    checkpoint in the directory stays as it was (a negative alignment once committed an index
    no reader accepts, and removed the good checkpoint's files)."""
    path, sd = ckpt
    before = snapshot(path)
    with pytest.raises(UCPError, match=re.escape(says)):
        save(sd, path, **kw)
    assert snapshot(path) == before


def test_a_save_where_a_file_is_in_the_way_is_named(tmp_path: Path) -> None:
    """A checkpoint path that is a file, or lies under one, is a CheckpointWriteError naming it."""
    (tmp_path / "afile").write_bytes(b"x")
    for where in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(CheckpointException) as e:
            save(make_state(), where)
        err = unwrap(e.value)
        assert isinstance(err, CheckpointWriteError) and f"{where}: cannot make the checkpoint directory" in str(err)
    assert (tmp_path / "afile").read_bytes() == b"x"
    with pytest.raises(UCPError, match="UCPStorageWriter: path must be a path or URL"):
        UCPStorageWriter(None)  # type: ignore[arg-type]


def test_unwrap_finds_no_library_error_behind_other_errors() -> None:
    """unwrap looks at each cause once ('raise X from e' makes e both the cause and the context)
    and gives None when no error in the chain is the library's."""
    try:
        try:
            raise ValueError("inner")
        except ValueError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as outer:
        err = outer
    assert err.__cause__ is err.__context__
    assert unwrap(err) is None
    try:
        try:
            raise CheckpointWriteError("/ck: cannot write")
        except CheckpointWriteError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as outer:
        found = unwrap(outer)
    assert isinstance(found, CheckpointWriteError) and str(found) == "/ck: cannot write"


@pytest.mark.parametrize(
    "sd, says",
    [
        ({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, "two state-dict entries flatten to one key"),
        ({"__ucp_rank_local__/0/x": torch.ones(1)}, "begin with '__ucp_rank_local__/'"),
    ],
    ids=["flattened_collision", "reserved_prefix"],
)
def test_keys_a_save_cannot_keep_apart_are_refused(tmp_path: Path, sd: dict[str, Any], says: str) -> None:
    """Two entries that flatten to one key, or a key in the format's reserved rank-local
    namespace (it would be read back as another rank's value), are refused, naming them."""
    with pytest.raises(CheckpointException) as e:
        save(sd, tmp_path / "c")
    err = unwrap(e.value)
    assert isinstance(err, UnsupportedValueError) and says in str(err), e.value
    assert not (tmp_path / "c" / "ucp_index.json").exists()


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: RequestPolicy(attempts=1.5), "RequestPolicy.attempts must be an int, got float"),
        (lambda: RequestPolicy(hedge=1), "RequestPolicy.hedge must be True or False, got int"),
        (lambda: RequestPolicy(backoff_s="1"), "RequestPolicy.backoff_s must be a number, got str"),
        (lambda: RequestPolicy(first_bytes_per_s=0), "RequestPolicy(first_bytes_per_s=0): needs more"),
        (lambda: RequestPolicy(hedge_factor=float("nan")), "RequestPolicy(hedge_factor=nan): needs"),
        (lambda: RequestPolicy(throttle_pause_s=-1), "RequestPolicy(throttle_pause_s=-1): needs at"),
        (lambda: RequestPolicy(deadline_floor_s=2, deadline_cap_s=1),
         "RequestPolicy: needs 0 < deadline_floor_s <= deadline_cap_s, got 2 and 1"),
        (lambda: RequestPolicy(deadline_floor_s=0), "RequestPolicy: needs 0 < deadline_floor_s <= deadline_cap_s, got 0 and"),
        (lambda: RequestPolicy(attempts=0), "RequestPolicy(attempts=0): needs at least 1"),
        (lambda: RequestPolicy(min_part_bytes=2, max_part_bytes=1),
         "RequestPolicy: needs 0 < min_part_bytes <= max_part_bytes, got 2 and 1"),
        (lambda: RequestPolicy(max_hedges=-1), "RequestPolicy(max_hedges=-1): needs at least 0"),
        (lambda: RequestPolicy(max_in_flight=0), "RequestPolicy(max_in_flight=0): needs at least 1"),
        (lambda: ProgressConfig(interval="10"), "ProgressConfig.interval must be a number, got str"),
        (lambda: ReadOnceCosts(storage_bytes_per_s=0), "ReadOnceCosts(storage_bytes_per_s=0): needs"),
        (lambda: ReadOnceCosts(round_seconds=-1.0), "ReadOnceCosts(round_seconds=-1.0): needs a"),
        (lambda: ReadOnceCosts(network_bytes_per_s=None), "network_bytes_per_s must be a number"),
    ],
)
def test_an_options_record_refuses_a_bad_field_when_made(make: Callable[[], object], says: str) -> None:
    """Each record names the field, instead of a raw TypeError deep in a load (ProgressConfig's
    interval="10" once was one) or a division by a zero rate."""
    with pytest.raises(UCPError, match=re.escape(says)):
        make()


def test_every_options_record_accepts_its_defaults_and_ints_for_floats() -> None:
    for record in (RequestPolicy, ProgressConfig, ReadOnceCosts, ReadOptions):
        record()
    assert RequestPolicy(backoff_s=1, first_bytes_per_s=1).backoff_s == 1
    assert ProgressConfig(interval=1, threshold=float("inf")).interval == 1


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda p: UCPStorageReader(5), "UCPStorageReader: path must be a path or URL"),
        (lambda p: load_state_dict(p, prefix=5), "SourceOptions.prefix must be a str, got int"),
        (lambda p: load_state_dict(p, layout="tp"), "layout must be a LayoutSpec, got str"),
        (lambda p: Checkpoint(p, dcp_values=b"x"), "dcp_values"),
    ],
)
def test_an_entry_points_argument_of_the_wrong_type_is_named(
    ckpt: tuple[Path, dict[str, Any]], call: Callable[[Path], object], says: str
) -> None:
    """Not a raw TypeError or AttributeError from inside (UCPStorageReader(5) and layout="tp"
    once were), nor taken silently (prefix=5 once was)."""
    path, _ = ckpt
    with pytest.raises(UCPError, match=re.escape(says)):
        call(path)


@pytest.mark.parametrize(
    "make, error, says",
    [
        (lambda: LayoutSpec(5), LayoutRuleError, "LayoutSpec: rules must be a list of layout rules, got int"),
        (lambda: LayoutSpec(Shard("w", dim=0)), LayoutRuleError, "rules must be a list of layout rules, got Shard"),
        (lambda: FlatShard("x", [], 0), InvalidArgumentTypeError, "FlatShard: local must be a torch.Tensor, got str"),
        (lambda: FlatShard(torch.zeros(4), [], -1), InvalidArgumentError, "start must be a buffer offset (an int >= 0), got -1"),
        (lambda: FlatShard(torch.zeros(4), [("w", (4,), 0)], 0), InvalidArgumentTypeError, "params must be FlatParams, got tuple"),
        (lambda: fsdp1_state_dict("model"), UnsupportedModelError, "fsdp1_state_dict: the model is a str, not a"),
        (lambda: Shard(5, dim=0), InvalidArgumentTypeError, "Shard.pattern must be a str, got int"),
        (lambda: Shard("w", dim="1"), InvalidArgumentTypeError, "Shard.dim must be an int, got str"),
        (lambda: Rename(r"\.", 5), InvalidArgumentTypeError, "Rename.repl must be a str, got int"),
        (lambda: Fused("w", dim=0, parts="qkv"), LayoutRuleError, "Fused('w'): parts must map each part's name"),
        (lambda: LayoutSpec([], axes="tp"), LayoutRuleError, "LayoutSpec: axes must map each axis name"),
        (lambda: Piece("w", (4,), (0,), [1.0]), InvalidArgumentTypeError, "piece of 'w': data must be a torch.Tensor"),
        (lambda: Piece("w", ("x",), (0,), torch.ones(1)), InvalidArgumentTypeError, "shape and offsets must be"),
        (lambda: TensorPieces(["w"]), InvalidArgumentTypeError, "TensorPieces: pieces must be Piece records, got str"),
        (lambda: load_index(5), InvalidArgumentTypeError, "load_index: directory must be a path or URL"),
        # os.listdir(5) lists whatever directory file descriptor 5 is.
        (lambda: rebuild_index(5), InvalidArgumentTypeError, "rebuild_index: directory must be a path or URL"),
    ],
)
def test_an_adapter_given_the_wrong_kind_of_argument_names_it(
    make: Callable[[], object], error: type[Exception], says: str
) -> None:
    """Not a raw TypeError or AttributeError (each of these once was), nor a negative offset
    taken silently."""
    with pytest.raises(error, match=re.escape(says)):
        make()


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda p: Checkpoint(p).read_value(5), "a value name must be a string, got int"),
        (lambda p: Checkpoint(p).read_rank_local(["x"]), "a rank-local value name must be a string, got list"),
        (lambda p: Checkpoint(p).read_tensor(["w"]), "a tensor name must be a string, got list"),
        (lambda p: Checkpoint(p).verify("bar"), "verify: on_progress must be a function of (done_bytes, total_bytes), got str"),
        (lambda p: convert(p, p.parent / "out", on_progress=1), "convert: on_progress must be a function"),
        (lambda p: export_hf(p, p.parent / "hf", on_progress=1), "export_hf: on_progress must be a function"),
        (lambda p: diff_checkpoints(p, p, on_progress=1), "diff_checkpoints: on_progress must be a function"),
        (lambda p: export_hf(5, p.parent / "hf"), "export_hf: src must be a path or URL (str or os.PathLike), got int"),
        (lambda p: import_hf(p, 5), "import_hf: dst must be a path or URL"),
        (lambda p: load_into_module(torch.nn.Linear(2, 2), p, strict="no"), "load_into_module(strict='no'): takes True or False"),
        # allow_partial_load="no" meant True: a checkpoint lacking keys loaded without a word.
        (lambda p: UCPLoadPlanner(allow_partial_load="no"), "UCPLoadPlanner(allow_partial_load='no'): takes True or False"),
        (lambda p: UCPLoadPlanner(allow_dtype_cast="no"), "UCPLoadPlanner(allow_dtype_cast='no'): takes True or False"),
        (lambda p: UCPLoadPlanner(rank_local_reshard=5), "UCPLoadPlanner(rank_local_reshard=...) takes a function or None, got int"),
        (lambda p: UCPSavePlanner(check_replicated_tensors="no"), "UCPSavePlanner(check_replicated_tensors='no'): takes True"),
        (lambda p: UCPSavePlanner(compact_plans=0), "UCPSavePlanner(compact_plans=0): takes True or False, got int"),
        (lambda p: UCPStorageReader(p, process_group="world"), "process_group must be a torch.distributed ProcessGroup"),
    ],
)
def test_a_call_given_the_wrong_kind_of_argument_names_it_before_working(
    ckpt: tuple[Path, dict[str, Any]], call: Callable[[Path], object], says: str
) -> None:
    """Each of these once raised a raw TypeError (read_value(5), verify("bar") after the first
    chunk, export_hf(5, ...)) or took the argument silently (strict="no" meant strict=True);
    nothing is written."""
    path, _ = ckpt
    before = snapshot(path.parent)
    with pytest.raises(UCPError, match=re.escape(says)):
        call(path)
    assert snapshot(path.parent) == before
