"""Hostile and damaged checkpoints fail with exact, library errors naming the file and the field.

The main cases of ``tests/test_fuzz_checkpoint.py``, pinned to their exact
messages: a field of the wrong type, a shape larger than the data files, a
negative offset, an index that does not match its digest, an edited or
deleted name (which only ``verify``'s cross-check of the index with the data
files' headers can see, when the edit also fixed the digest). Single
process, no process group.
"""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ucp_dcp import (
    Checkpoint,
    CheckpointFormatError,
    RankLocal,
    UCPError,
    UCPSavePlanner,
    UCPStorageWriter,
    load_index,
    load_state_dict,
    rebuild_index,
)
from ucp_dcp.core.values import decode_value
from ucp_dcp.byteio.rangeio import read_header
from ucp_dcp.errors import InvalidArgumentError
from ucp_dcp.format import BLOCK_SUMS_ENTRY, INDEX_FILE, WrittenEntry, build_index, index_digest
from ucp_dcp.format.header import EntryMeta, PlannedEntry
from ucp_dcp.format.records import FileRecord, Layout, decode_runs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    """A committed single-process checkpoint: two tensors, a value, a rank-local value."""
    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(0)
    sd = {"model": {"w": torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g)},
          "step": 7, "rng": RankLocal({"seed": 3})}
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    return path


def doc_of(path: Path) -> dict[str, Any]:
    return json.loads((path / INDEX_FILE).read_text())


def edit_index(path: Path, edit: Callable[[dict[str, Any]], Any], digest: str = "re-sign") -> dict[str, Any]:
    """Edit the index; ``digest``: "re-sign" (a hostile edit that fixes the digest), "keep" (now stale) or "drop"."""
    doc = doc_of(path)
    edit(doc)
    if digest == "re-sign":
        doc["digest"] = index_digest(doc)
    elif digest == "drop":
        del doc["digest"]
    (path / INDEX_FILE).write_text(json.dumps(doc))
    return doc


def data_file(path: Path) -> Path:
    (f,) = doc_of(path)["files"]
    return path / f["name"]


def edit_header(f: Path, edit: Callable[[dict[str, Any], dict[str, Any]], Any]) -> None:
    """Edit the safetensors header (and the ucp_dcp metadata in it) of data file ``f`` in place."""
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8:8 + n])
    md = json.loads(doc["__metadata__"]["ucp_dcp"])
    edit(doc, md)
    doc["__metadata__"]["ucp_dcp"] = json.dumps(md)
    new = json.dumps(doc).encode()
    assert len(new) <= n
    f.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])


def fails(path: Path, message: str) -> None:
    """Opening the index, ``Checkpoint`` and ``load_state_dict`` all fail with exactly ``message``."""
    for attempt in (lambda: load_index(str(path)), lambda: Checkpoint(path), lambda: load_state_dict(path)):
        with pytest.raises(CheckpointFormatError) as e:
            attempt()
        assert str(e.value) == message


# ---------------------------------------------------------------- wrong types


@pytest.mark.parametrize("layout", [True, 1, "S(0)", [2]])
def test_layout_of_wrong_type(ckpt: Path, layout: Any) -> None:
    """A layout that is not an object (was: AttributeError: 'bool' object has no attribute 'get')."""
    edit_index(ckpt, lambda d: d["tensors"]["model.w"].update(layout=layout))
    fails(ckpt, f"{ckpt / INDEX_FILE}: tensor 'model.w': field 'layout' must be an object or null, got {layout!r}")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["tensors"]["model.w"].update(dtype=3), "tensor 'model.w': field 'dtype' must be a string, got 3"),
        (lambda d: d["tensors"].update({"model.w": []}), "tensor 'model.w': must be an object, got []"),
        (lambda d: d["files"][0].update(rank=1), "files[0]: field 'rank' is 1, outside 0..0"),
        (lambda d: d["values"]["step"].update(xxh3="x"),
         "value 'step': field 'xxh3' must be an xxh3-64 checksum (16 hex digits), got 'x'"),
        (lambda d: d["tensors"]["model.w"].update(layout={"mesh": [2**30], "placements": ["S(0)"]}),
         "tensor 'model.w': layout mesh [1073741824] must have 1 to 16777216 devices, at least 1 per dimension"),
        (lambda d: d["tensors"]["model.w"].update(layout={"mesh": [2], "placements": ["S(5)"]}),
         "tensor 'model.w': placement 'S(5)' shards dimension 5 of a 2-d tensor"),
        (lambda d: d["tensors"]["model.w"].update(layout={"mesh": [2], "placements": ["X"]}),
         "tensor 'model.w': unknown placement 'X'; expected 'R', 'S(dim)' or 'SS(dim,split)'"),
        (lambda d: d["rank_local"]["rng"].update({"9" * 5000: d["rank_local"]["rng"]["0"]}),
         "rank-local value 'rng': malformed"),
    ],
    ids=["dtype", "record", "rank", "xxh3", "mesh", "placement_dim", "placement", "rank_key"],
)
def test_index_fields(ckpt: Path, edit: Callable[[dict[str, Any]], Any], message: str) -> None:
    """Wrong types and values anywhere in the index are refused naming the field."""
    edit_index(ckpt, edit)
    fails(ckpt, f"{ckpt / INDEX_FILE}: {message}")


def _two_chunks_at(rec: dict[str, Any], a: list[int], b: list[int]) -> dict[str, Any]:
    """``rec`` (of the 8x16 float32 ``model.w``) as an explicit list of two 4x16 chunks at offsets ``a`` and ``b``."""
    chunk = {"sizes": [4, 16], "file": 0, "start": 8, "nbytes": 256, "xxh3": "0" * 16}
    out = {k: v for k, v in rec.items() if k != "files"}
    out["chunks"] = [{**chunk, "offsets": a}, {**chunk, "offsets": b}]
    return out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["tensors"]["model.w"].update(files=[[0, 1 << 41, 0]]),
         "tensor 'model.w': malformed file runs [[0, 2199023255552, 0]]"),
        (lambda d: d["tensors"]["model.w"].update(files=[[0, 1 << 40, 0], [0, 1, 0]]),
         "tensor 'model.w': file runs list more than 1099511627776 chunks"),
        (lambda d: d["tensors"]["model.w"].update(layout={"mesh": [1], "placements": ["SS(0,0)"]}),
         "tensor 'model.w': placement 'SS(0,0)' has a split factor below 1"),
        (lambda d: d["tensors"]["model.w"].update(layout={"mesh": [131072], "placements": ["SS(0,2)"]}),
         "tensor 'model.w': layout {'mesh': [131072], 'placements': ['SS(0,2)']} does not apply to shape [8, 16]: "
         "layout mesh=[131072] placements=['SS(0,2)'] is irregular and has 131072 mesh coordinates, more than the "
         "65536 enumerated one by one"),
        (lambda d: d["files"].append(dict(d["files"][0])),
         "files[1]: data file '{file}' is listed twice"),
        (lambda d: d["rank_local"]["rng"].update({"5": d["rank_local"]["rng"]["0"]}),
         "rank-local value 'rng' of rank 5: rank 5 is outside world size 1"),
        (lambda d: d["tensors"]["model.w"].update(dtype="qint8"), "tensor 'model.w': dtype 'qint8' is not one a checkpoint holds"),
        (lambda d: d["tensors"]["model.w"].update(shape=[0, 1 << 62]),
         "tensor 'model.w': shape [0, 4611686018427387904] is too large to address"),
        (lambda d: d["tensors"].update({"model.w": _two_chunks_at(d["tensors"]["model.w"], [0, 0], [0, 0])}),
         "tensor 'model.w': its chunks hold as many elements as the tensor but overlap, so some elements "
         "are in none"),
        (lambda d: d.update(paths=[]), "paths: must be an object of key -> path"),
        (lambda d: d.update(paths={"model.w": ["model", "v"]}), "paths: 'model.w': malformed path ['model', 'v']"),
    ],
    ids=["run_range", "run_total", "split_factor", "layout_grid", "file_twice", "rank_local_rank", "dtype_not_stored",
         "shape_unaddressable", "chunks_overlap", "paths_list", "path_other_key"],
)
def test_index_structure(ckpt: Path, edit: Callable[[dict[str, Any]], Any], message: str) -> None:
    """Run lists, layouts, file lists and rank-local ranks that no save writes are refused naming the field."""
    name = doc_of(ckpt)["files"][0]["name"]
    edit_index(ckpt, edit)
    fails(ckpt, f"{ckpt / INDEX_FILE}: {message.replace('{file}', name)}")


def test_run_list_slices() -> None:
    runs = decode_runs([[3, 2, 1], [9, 3, -2]], "here")
    assert list(runs) == [3, 4, 9, 7, 5] and runs[1:4] == [4, 9, 7] and runs[::-2] == [5, 9, 3]


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"world_size": ' + b"9" * 5000 + b"}"], ids=["deep", "digits"])
def test_index_json_python_cannot_parse(ckpt: Path, raw: bytes) -> None:
    """Nesting deeper than Python's recursion limit and 5000-digit integers are corrupt indexes, not crashes."""
    (ckpt / INDEX_FILE).write_bytes(raw)
    match = r"ucp_index\.json: truncated or corrupt index \((RecursionError|ValueError)"
    with pytest.raises(CheckpointFormatError, match=match):
        Checkpoint(ckpt)


# ---------------------------------------------------------------- sizes


def test_huge_shape_refused_before_anything_is_allocated(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape edited to 10^9 rows is refused when the index is read, naming the tensor
    (was: an attempt to allocate 64 GB before noticing the data cannot be there)."""
    size = data_file(ckpt).stat().st_size
    edit_index(ckpt, lambda d: d["tensors"]["model.w"].update(shape=[10**9, 16]))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("allocated"))
    fails(ckpt, f"{ckpt / INDEX_FILE}: tensor 'model.w': float32[1000000000, 16] needs 64000000000 bytes, "
                f"more than the data files hold together ({size} bytes)")


def test_huge_chunk_in_header(ckpt: Path) -> None:
    """A header entry whose shape claims more bytes than its range holds."""
    f = data_file(ckpt)
    edit_header(f, lambda doc, md: doc["model.w@0,0"].update(shape=[10**9, 16]))
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(f))
    assert str(e.value) == f"{f}: entry 'model.w@0,0' holds 512 bytes, but F32[1000000000, 16] needs 64000000000"
    assert any(str(e.value) == p for p in Checkpoint(ckpt).verify())


@pytest.mark.parametrize("block", [10**40, 0, -4096, "4096"])
def test_block_size_out_of_range_in_header(ckpt: Path, block: Any) -> None:
    """A block size the reader cannot work with (found by the fuzzer: 10**40 overflowed a C long)."""
    f = data_file(ckpt)
    edit_header(f, lambda doc, md: md["block_sums"].update(block=block))
    for attempt in (lambda: read_header(str(f)), lambda: load_state_dict(ckpt)):
        with pytest.raises(CheckpointFormatError) as e:
            attempt()
        assert str(e.value).startswith(f"{f}: malformed block_sums metadata {{'block': {block!r}, ")


def rewrite_header(f: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Replace the whole safetensors header of ``f`` by ``edit(doc)`` of it (its ``__metadata__``
    as written), JSON-encoded and space-padded to the old length."""
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8:8 + n])
    new = json.dumps(edit(doc)).encode()
    assert len(new) <= n
    f.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])


def _overlap(doc: dict[str, Any]) -> dict[str, Any]:
    doc["model.b@0"]["data_offsets"] = list(doc["model.w@0,0"]["data_offsets"])
    doc["model.b@0"]["data_offsets"][1] = doc["model.b@0"]["data_offsets"][0] + 64
    return doc


def _metadata(edit: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def run(doc: dict[str, Any]) -> dict[str, Any]:
        edit(doc["__metadata__"])
        return doc
    return run


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda doc: ["not", "an", "object"], "header is not a JSON object"),
        (lambda doc: {**doc, "__metadata__": "ucp_dcp"}, "__metadata__ is not a JSON object"),
        (_overlap, "entries 'model.w@0,0' and 'model.b@0' overlap"),
        (_metadata(lambda md: md.pop("ucp_dcp")), "safetensors file without ucp_dcp metadata"),
        (_metadata(lambda md: md.update(ucp_dcp="[1]")), "safetensors file without ucp_dcp metadata"),
        (_metadata(lambda md: md.update(ucp_dcp=json.dumps({**json.loads(md["ucp_dcp"]), "version": 99}))),
         "unsupported format version 99"),
        (lambda doc: {**doc, BLOCK_SUMS_ENTRY: {**doc[BLOCK_SUMS_ENTRY], "dtype": "I64"}},
         f"block_sums metadata without a U64 {BLOCK_SUMS_ENTRY} entry"),
    ],
    ids=["list", "metadata", "overlap", "no_ucp", "ucp_list", "version", "block_sums_dtype"],
)
def test_header_structure(ckpt: Path, edit: Callable[[dict[str, Any]], Any], message: str) -> None:
    """A header that is not the structure written is refused naming the file, by itself and in a load."""
    f = data_file(ckpt)
    rewrite_header(f, edit)
    for attempt in (lambda: read_header(str(f)), lambda: load_state_dict(ckpt)):
        with pytest.raises(CheckpointFormatError) as e:
            attempt()
        assert str(e.value) == f"{f}: {message}"


def test_header_chunk_stored_under_another_name(ckpt: Path) -> None:
    f = data_file(ckpt)
    edit_header(f, lambda doc, md: md["entries"]["model.b@0"].update(fqn="model.c"))
    with pytest.raises(CheckpointFormatError) as e:
        read_header(str(f))
    assert str(e.value) == (f"{f}: metadata of entry 'model.b@0': a chunk of 'model.c' at [0] must be stored "
                            "as entry 'model.c@0'")


def test_a_file_shorter_than_the_header_length(ckpt: Path) -> None:
    f = data_file(ckpt)
    f.write_bytes(f.read_bytes()[:5])
    for attempt in (lambda: read_header(str(f)), lambda: load_state_dict(ckpt)):
        with pytest.raises(CheckpointFormatError) as e:
            attempt()
        assert str(e.value) == f"{f}: truncated (5 bytes; a safetensors file starts with 8)"


# ---------------------------------------------------------------- offsets


def test_negative_offset_in_index(ckpt: Path) -> None:
    """A negative start of a value's byte range."""
    doc = edit_index(ckpt, lambda d: d["values"]["step"].update(start=-4))
    f = doc["files"][0]
    fails(ckpt, f"{ckpt / INDEX_FILE}: value 'step': byte range [-4, {doc['values']['step']['nbytes'] - 4}) "
                f"lies outside {f['name']} ({f['size']} bytes)")


def test_negative_offset_in_header(ckpt: Path) -> None:
    """A negative data offset in a safetensors header."""
    f = data_file(ckpt)
    edit_header(f, lambda doc, md: doc["model.b@0"].update(data_offsets=[-4, 60]))
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(ckpt)
    assert str(e.value) == f"{f}: entry 'model.b@0' has bad data_offsets [-4, 60]"


# ---------------------------------------------------------------- the digest


def test_digest_mismatch(ckpt: Path) -> None:
    """An edit that does not fix the digest: the index was changed after it was written."""
    doc = edit_index(ckpt, lambda d: d["values"]["step"].update(xxh3="0" * 16), digest="keep")
    actual = index_digest(doc)
    fails(ckpt, f"{ckpt / INDEX_FILE}: the index does not match its digest (recorded {doc['digest']!r}, its "
                f"content hashes to {actual}): it was changed after it was written; if the data files are "
                "complete, rebuild it with ucp_dcp.rebuild_index(path, write=True, replace=True)")


def test_index_without_digest_loads(ckpt: Path) -> None:
    """An index written before digests existed has none, and loads."""
    want = load_state_dict(ckpt, rank_local=True)
    assert "digest" in doc_of(ckpt)
    edit_index(ckpt, lambda d: None, digest="drop")
    got = load_state_dict(ckpt, rank_local=True)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in ("model.w", "model.b"))
    assert Checkpoint(ckpt).verify() == []


def test_digest_is_of_the_canonical_json(ckpt: Path) -> None:
    """Key order and whitespace are not content: a re-serialised index still matches its digest."""
    doc = doc_of(ckpt)
    (ckpt / INDEX_FILE).write_text(json.dumps(dict(reversed(list(doc.items()))), indent=2))
    assert load_index(str(ckpt)).to_json() == {k: v for k, v in doc.items() if k != "digest"}


# ---------------------------------------------------------------- names


def test_renamed_tensor(ckpt: Path) -> None:
    """A tensor renamed in the index (digest fixed too): the load fails naming the entry it
    cannot find, verify also names the entry the index no longer lists."""
    f = data_file(ckpt)
    edit_index(ckpt, lambda d: d["tensors"].update({"model.c": d["tensors"].pop("model.b")}))
    missing = f"{f}: the index says it holds chunk [0] of 'model.c' (entry 'model.c@0'), but it does not"
    unlisted = f"{f}: entry 'model.b@0' holds chunk [0] of tensor 'model.b', which the index does not list there"
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(ckpt)
    assert str(e.value) == missing
    assert sorted(Checkpoint(ckpt).verify()) == sorted([unlisted, missing])


def test_renamed_value(ckpt: Path) -> None:
    """A value renamed in the index."""
    f = data_file(ckpt)
    edit_index(ckpt, lambda d: d["values"].update({"epoch": d["values"].pop("step")}))
    assert sorted(Checkpoint(ckpt).verify()) == sorted([
        f"{f}: entry '__ucp_value__/step' holds value 'step', which the index does not list there",
        f"{f}: the index says it holds value 'epoch' (entry '__ucp_value__/epoch'), but it does not",
    ])
    with pytest.raises(UCPError):
        load_state_dict(ckpt)


def test_deleted_tensor(ckpt: Path) -> None:
    """A tensor deleted from the index: loads leave it out, verify reports it."""
    f = data_file(ckpt)
    edit_index(ckpt, lambda d: d["tensors"].pop("model.b"))
    assert "model.b" not in load_state_dict(ckpt)
    assert Checkpoint(ckpt).verify() == [
        f"{f}: entry 'model.b@0' holds chunk [0] of tensor 'model.b', which the index does not list there"
    ]


def test_swapped_value_locations(ckpt: Path) -> None:
    """An index that points a value at another entry's bytes (with that entry's checksum)."""
    f = data_file(ckpt)

    def swap(d: dict[str, Any]) -> None:
        d["values"]["step"] = dict(d["rank_local"]["rng"]["0"])

    doc = edit_index(ckpt, swap)
    loc = doc["values"]["step"]
    hdr = read_header(str(f))
    start, nbytes = hdr.ranges["__ucp_value__/step"]
    message = (
        f"{f}: the index records value 'step' at bytes [{loc['start']}, {loc['start'] + loc['nbytes']}) with xxh3 "
        f"{loc['xxh3']}, the file's header at [{start}, {start + nbytes}) with xxh3 "
        f"{hdr.meta['__ucp_value__/step'].xxh3}"
    )
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(ckpt)
    assert str(e.value) == message
    assert message in Checkpoint(ckpt).verify()


# ---------------------------------------------------------------- values and other sources


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"__ucp__": "tuple"}', "value 'k' is not valid ucp_dcp JSON (KeyError: 'v')"),
        (b'{"__ucp__": "tensor", "dtype": "float32", "shape": [3], "data": "AAAAAA=="}',
         "value 'k' is not valid ucp_dcp JSON (RuntimeError: shape '[3]' is invalid for input of size 1)"),
        (b"\xff", "value 'k' is not valid ucp_dcp JSON (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff "
                  "in position 0: invalid start byte)"),
        (b'{"__ucp__": "frozenset", "v": []}', "value 'k': unknown tag 'frozenset' (written by a newer ucp_dcp?)"),
    ],
    ids=["tag_field", "tensor_shape", "utf8", "unknown_tag"],
)
def test_malformed_value(raw: bytes, message: str) -> None:
    """A value whose bytes pass their checksum but do not decode is a format error, not a KeyError."""
    with pytest.raises(CheckpointFormatError) as e:
        decode_value(raw, "k")
    assert str(e.value) == message


def test_dcp_metadata_shape_larger_than_its_files(tmp_path: Path) -> None:
    """DCP's .metadata claiming a tensor larger than all its data files."""
    path = tmp_path / "dcp"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(path))
    md = pickle.loads((path / ".metadata").read_bytes())
    md.state_dict_metadata["w"].size = torch.Size([10**9])
    (path / ".metadata").write_bytes(pickle.dumps(md))
    size = sum(f.stat().st_size for f in path.glob("*.distcp"))
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(path)
    assert str(e.value) == (f"{path / '.metadata'}: tensor 'w': float32[1000000000] needs 4000000000 bytes, more "
                            f"than the data files hold together ({size} bytes)")


def test_hf_header_shape_larger_than_its_bytes(tmp_path: Path) -> None:
    """A Hugging Face file whose header claims a shape its byte range cannot hold."""
    f = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [10**9], "data_offsets": [0, 16]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(tmp_path)
    assert str(e.value) == f"{f}: entry 'w' holds 16 bytes, but F32[1000000000] needs 4000000000"


# ---------------------------------------------------------------- building the index


@pytest.mark.parametrize("layout", [{"mesh": [131072], "placements": ["SS(0,2)"]}, {"mesh": [2], "placements": ["S(0)"]}],
                         ids=["too_irregular_to_enumerate", "more_chunks_than_written"])
def test_rebuild_index_lists_the_chunks_a_recorded_layout_does_not_match(ckpt: Path, layout: dict[str, Any]) -> None:
    """A header's layout whose chunk grid cannot be enumerated, or is not the chunks written: the
    rebuilt index lists the chunks written instead of the layout's grid."""
    edit_header(data_file(ckpt), lambda doc, md: md["entries"]["model.w@0,0"].update(layout=layout))
    committed = load_index(str(ckpt)).to_json()["tensors"]["model.w"]
    rec = rebuild_index(str(ckpt)).to_json()["tensors"]["model.w"]
    (loc,) = committed["files"]
    assert "files" not in rec and rec["layout"] == layout
    assert [(c["offsets"], c["sizes"], c["file"]) for c in rec["chunks"]] == [([0, 0], [8, 16], loc[0])]


def _written(fqn: str, dtype: str, shape: tuple[int, ...], start: int) -> WrittenEntry:
    meta = EntryMeta("tensor", fqn, dtype, shape, (0,) * len(shape), shape, "0" * 16)
    return WrittenEntry(f"{fqn}@0", meta, start, 4 * shape[0])


def test_build_index_refuses_records_that_disagree() -> None:
    files = [FileRecord("rank00000-a.safetensors", 0, 100), FileRecord("rank00001-a.safetensors", 1, 100)]
    with pytest.raises(CheckpointFormatError) as e:
        build_index(2, files, [[_written("w", "float32", (4,), 8)], [_written("w", "int32", (4,), 8)]])
    assert str(e.value) == "tensor 'w' is saved as float32[4] in one file and as int32[4] in rank00001-a.safetensors"
    compact = build_index(1, files[:1], [[_written("w", "float32", (4,), 8)]]).tensors
    with pytest.raises(CheckpointFormatError) as e:
        build_index(1, files[:1], [[_written("w", "float32", (4,), 8)]], compact=compact)
    assert str(e.value) == "tensor 'w' was written both per chunk and through its mesh group"
    # Rows written, the layout's grid in columns: as many chunks, other boxes; listed as written.
    rows = [WrittenEntry(f"m@{r},0", EntryMeta("tensor", "m", "float32", (4, 4), (r, 0), (2, 4), "0" * 16), 8 + 32 * r, 32)
            for r in (0, 2)]
    index = build_index(1, files[:1], [rows], layouts={"m": Layout((2,), ("S(1)",))})
    assert not index.tensors["m"].compact
    assert [(c.box.offsets, c.box.sizes) for c in index.tensors["m"].chunks] == [((0, 0), (2, 4)), ((2, 0), (2, 4))]


def test_written_entry_of_padding_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^entry '__pad__' is padding or block checksums, not a tensor"):
        WrittenEntry.of(PlannedEntry("__pad__", "U8", (4,), 4, None), 0)


def test_an_index_json_cannot_hold_fails_its_digest(ckpt: Path) -> None:
    """A NaN (Python's JSON reads it; canonical JSON has none) cannot match any digest."""
    doc = doc_of(ckpt)
    raw = (ckpt / INDEX_FILE).read_text().replace('"world_size":1', '"world_size":NaN')
    assert raw != json.dumps(doc, separators=(",", ":"))
    (ckpt / INDEX_FILE).write_text(raw)
    with pytest.raises(CheckpointFormatError, match=r"ucp_index\.json: the index does not match its digest "
                       rf"\(recorded '{doc['digest']}', its content hashes to \(not canonical JSON\)\)"):
        load_index(str(ckpt))


# ---------------------------------------------------------------- index and headers disagree


def test_a_header_of_another_world_size_is_refused(ckpt: Path) -> None:
    """A data file whose header says it was written in a save of 2 ranks, where the index
    says 1: another save's file put in its place."""
    f = data_file(ckpt)
    edit_header(f, lambda doc, md: md.update(world_size=2))
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(ckpt)
    assert str(e.value) == f"{f}: written by rank 0 of world size 2, but the index says rank 0 of 1"


def test_a_header_entry_of_another_shape_is_refused(ckpt: Path) -> None:
    """The entry the index's chunk names holds, by its header, a chunk of a tensor of another
    global shape (32 elements, where the index says 16)."""
    f = data_file(ckpt)
    edit_header(f, lambda doc, md: md["entries"]["model.b@0"].update(shape=[32]))
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(ckpt)
    assert str(e.value) == (
        f"{f}: entry 'model.b@0' is a float32[16] chunk of 'model.b' [32], but the index has "
        "chunk [0] of 'model.b' as float32[16] of [16]"
    )


def test_block_checksums_of_another_block_size_are_refused(ckpt: Path) -> None:
    """A header whose block size does not give the blocks its checksum entry holds: refused
    naming the counts, not read as checksums of other bytes."""
    f = data_file(ckpt)
    edit_header(f, lambda doc, md: md["block_sums"].update(block=64))
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(ckpt)
    assert str(e.value) == f"{f}: 2 block checksums recorded for the 9 blocks of its tensor chunks"


def test_verify_names_a_rank_local_value_the_index_leaves_out(ckpt: Path) -> None:
    f = data_file(ckpt)
    edit_index(ckpt, lambda d: d.update(rank_local={}))
    assert Checkpoint(ckpt).verify() == [
        f"{f}: entry '__ucp_rank_local__/rng' holds rank 0's rank-local value 'rng', which the "
        "index does not list there"
    ]


def test_an_index_that_cannot_be_read_is_refused_naming_it(ckpt: Path) -> None:
    (ckpt / INDEX_FILE).unlink()
    (ckpt / INDEX_FILE).mkdir()
    with pytest.raises(CheckpointFormatError) as e:
        load_index(str(ckpt))
    assert str(e.value) == f"{ckpt / INDEX_FILE}: cannot read the index (Is a directory)"


def test_rebuild_index_refuses_headers_that_do_not_cover_a_tensor(ckpt: Path) -> None:
    """Data files whose headers give model.w a global shape of 16 x 16 but hold 8 x 16 of it:
    one of the save's data files is missing, and the rebuilt index would have a hole."""
    from ucp_dcp.sources.native import rebuild_index

    f = data_file(ckpt)
    save_id = read_header(str(f)).save_id
    edit_header(f, lambda doc, md: md["entries"]["model.w@0,0"].update(shape=[16, 16]))
    with pytest.raises(CheckpointFormatError) as e:
        rebuild_index(str(ckpt))
    assert str(e.value) == (
        f"{ckpt}: the data files of save {save_id} cover 128 of the 256 elements of 'model.w': "
        "a data file is missing"
    )


def test_verify_names_a_header_entry_at_offsets_the_index_has_no_chunk_at(ckpt: Path) -> None:
    """A header whose model.b entry is moved to offsets [16] of a 32-element tensor: the index
    has no chunk there; verify names the entry it cannot place and the chunk it cannot find,
    and convert fails naming the chunk."""
    from ucp_dcp.tools.convert import convert

    f = data_file(ckpt)

    def move(doc: dict[str, Any], md: dict[str, Any]) -> None:
        doc["model.b@16"] = doc.pop("model.b@0")
        md["entries"]["model.b@16"] = {**md["entries"].pop("model.b@0"), "shape": [32], "offsets": [16]}

    edit_header(f, move)
    missing = f"{f}: the index says it holds chunk [0] of 'model.b' (entry 'model.b@0'), but it does not"
    assert sorted(Checkpoint(ckpt).verify()) == sorted([
        f"{f}: entry 'model.b@16' holds chunk [16] of tensor 'model.b', which the index does not list there",
        missing,
    ])
    with pytest.raises(CheckpointFormatError) as e:
        convert(ckpt, ckpt.parent / "out")
    assert str(e.value) == missing


def test_a_value_the_index_does_not_hold_is_refused_naming_it(ckpt: Path) -> None:
    from ucp_dcp.sources import NativeSource, open_source

    assert not NativeSource.detect(ckpt.parent / "gone")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(ckpt).value_location("epoch")
    assert str(e.value) == f"{ckpt}: no saved value for 'epoch'"


def test_a_rank_local_value_in_the_file_of_another_rank_is_refused(ckpt: Path) -> None:
    """An index (of a 2-rank save, as is the file's header) that puts rank 1's rank-local
    value in rank 0's file: refused naming the file and both ranks, not read as rank 1's."""
    f = data_file(ckpt)
    edit_header(f, lambda doc, md: md.update(world_size=2))

    def to_rank_1(d: dict[str, Any]) -> None:
        d["world_size"] = 2
        d["rank_local"]["rng"] = {"1": d["rank_local"]["rng"]["0"]}

    edit_index(ckpt, to_rank_1)
    with pytest.raises(CheckpointFormatError) as e:
        Checkpoint(ckpt).read_rank_local("rng")
    assert str(e.value) == (
        f"{f}: the index has rank-local value 'rng' of rank 1 in the file of rank 0"
    )
