"""Data-file headers: the fast checks of plain entries accept nothing the full checks refuse.

``parse_header`` checks a well-formed entry in a few C-level operations and
sends anything else to the field-by-field checks; each mutated header here
must give exactly what the full checks give (the same record, or the same
error).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ucp_dcp import RankLocal, UCPSavePlanner, UCPStorageWriter
from ucp_dcp.errors import CheckpointFormatError
from ucp_dcp.format import header as H
from ucp_dcp.format.header import parse_header

LAYOUT = {"mesh": [4], "placements": ["S(0)"]}
VALUES: list[Any] = [
    True, 1.0, -1, 0, 3, 2**63, "x", [], [True], [1.0], [-1], [0], [8], [8, 16], [[1]], None, {},
    ["S(0)"], "float32", "bool", "qint8", "tensor", "value", "0123456789ABCDEF", LAYOUT,
    {"mesh": [4], "placements": ["S(2)"]}, {"mesh": [True], "placements": ["S(0)"]},
    {"mesh": [4.0], "placements": ["S(0)"]}, {"mesh": [4], "placements": [["S(0)"]]},
    {"mesh": [4]}, {"mesh": [], "placements": []}, "<del>",
]  # fmt: skip


class Mem:
    """A header in memory, with room after it for the entries it names."""

    def __init__(self, doc: dict[str, Any], md: dict[str, Any]) -> None:
        doc = {**doc, "__metadata__": {"ucp_dcp": json.dumps(md)}}
        raw = json.dumps(doc).encode()
        self.b = struct.pack("<Q", len(raw)) + raw
        self.size = len(self.b) + (1 << 20)

    def pread(self, n: int, offset: int) -> bytes:
        return self.b[offset : offset + n]


def outcome(access: Mem) -> str:
    try:
        return repr(parse_header("f", access))
    except CheckpointFormatError as e:
        return f"error: {e}"


@pytest.fixture(scope="module")
def header(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The safetensors header and the ucp_dcp metadata of a small checkpoint's data file, every
    tensor given the same DTensor-like layout."""
    path = tmp_path_factory.mktemp("plain") / "ckpt"
    sd = {"w": torch.ones(8, 16), "b": torch.ones(16), "step": 7, "rng": RankLocal(3)}
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    (f,) = Path(path).glob("*.safetensors")
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8 : 8 + n])
    md = json.loads(doc.pop("__metadata__")["ucp_dcp"])
    for m in md["entries"].values():
        if m["kind"] == "tensor":
            m["layout"] = LAYOUT
    return doc, md


def mutated(d: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    d = json.loads(json.dumps(d))
    if value == "<del>":
        d.pop(field, None)
    else:
        d[field] = value
    return d


@pytest.mark.parametrize(
    "field", ["kind", "fqn", "xxh3", "dtype", "shape", "offsets", "sizes", "layout"]
)
def test_metadata_fast_checks_agree(
    header: tuple[dict[str, Any], dict[str, Any]], field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc, md = header
    for name in md["entries"]:
        for value in VALUES:
            entries = {**md["entries"], name: mutated(md["entries"][name], field, value)}
            access = Mem(doc, {**md, "entries": entries})
            fast = outcome(access)
            with monkeypatch.context() as m:
                m.setattr(H, "_plain_entry_meta", lambda *a: None)
                assert fast == outcome(access), (name, field, value)


@pytest.mark.parametrize("field", ["data_offsets", "shape", "dtype"])
def test_safetensors_fast_checks_agree(
    header: tuple[dict[str, Any], dict[str, Any]], field: str
) -> None:
    doc, md = header
    for name in doc:
        for value in [*VALUES, [0, 1 << 30], [10, 5], [0, 2**63], "F32", "U8"]:
            e = mutated(doc[name], field, value)
            access = Mem({**doc, name: e}, md)
            try:
                full = repr(H._st_entry("f", name, e, len(access.b)))
            except CheckpointFormatError as err:
                full = f"error: {err}"
            try:
                got = repr(H.parse_safetensors("f", access).entries[name])
            except CheckpointFormatError as err:
                got = f"error: {err}"
                if not full.startswith("error") and ("overlap" in got or "truncated" in got):
                    continue  # a well-formed entry whose bytes clash with the others'
            assert got == full, (name, field, value)
