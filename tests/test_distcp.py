"""DCP's default ``.distcp`` format: import it, or read it in place, bit-exact.

Checkpoints here are written by plain ``dcp.save`` with DCP's own
``FileSystemWriter``; nothing of ucp_dcp is involved in writing them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dist_utils import bit_equal, flatten, nest, run_ranks
from ucp_dcp import Checkpoint, CheckpointFormatError, ReadOptions, UCPLoadPlanner, UCPStorageReader
from ucp_dcp.errors import DCPValueError, unwrap
from ucp_dcp.sources import SourceOptions
from ucp_dcp.sources.distcp import DCPSource, read_dcp_metadata
from ucp_dcp.tools.convert import convert

# ---------------------------------------------------------------- helpers


def _full_state() -> dict[str, torch.Tensor]:
    """The full tensors of the training-like state (same on every rank and process)."""
    g = torch.Generator().manual_seed(7)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "model.embed": r(37, 64),  # uneven over 2 and 3 ranks
        "model.w": r(48, 30),
        "model.tiny": r(1, 5),  # fewer rows than ranks: an empty shard
        "model.bf": r(29, 16, dtype=torch.bfloat16),
        "model.wt": r(40, 24).t(),  # a plain tensor stored transposed
        "model.conv": r(6, 4, 3, 5).to(memory_format=torch.channels_last),
        "optim.embed.exp_avg": r(37, 64),
        "optim.w.exp_avg": r(48, 30),
        "optim.step": torch.tensor(12.0),
    }


_VALUES = {"optim.lr": 3e-4, "optim.betas": (0.9, 0.95), "optim.name": "adamw", "optim.params": [0, 1, 2], "step": 12}

# How the dp=2 source holds each tensor (None: a plain tensor, every rank has it).
_SOURCE = {
    "model.embed": Shard(0), "model.w": Shard(0), "model.tiny": Shard(0), "model.bf": Shard(0),
    "model.wt": None, "model.conv": None, "optim.embed.exp_avg": Shard(0), "optim.w.exp_avg": Shard(1),
    "optim.step": None,
}
# ... and how the 3-rank targets want them: other dims, so every read is a sub-box.
_TARGET = {
    "model.embed": Shard(1), "model.w": Shard(1), "model.tiny": Replicate(), "model.bf": Shard(1),
    "model.wt": Shard(0), "model.conv": Shard(2), "optim.embed.exp_avg": Shard(0), "optim.w.exp_avg": Shard(0),
    "optim.step": Replicate(),
}


def _blank_plain(full: dict[str, torch.Tensor], values: bool = True) -> dict[str, Any]:
    sd: dict[str, Any] = {k: torch.full(v.shape, 13, dtype=v.dtype) for k, v in full.items()}
    if values:
        sd.update({k: None for k in _VALUES})
    return nest(sd)


def _check_plain(sd: dict[str, Any], full: dict[str, torch.Tensor], values: bool = True) -> None:
    flat = flatten(sd)
    for k, v in full.items():
        assert bit_equal(flat[k], v), k
    if values:
        for k, v in _VALUES.items():
            assert flat[k] == v and type(flat[k]) is type(v), (k, flat[k])


class _CountingView(io.RawIOBase):
    """Counts the bytes DCP's reader pulls through one item's file view."""

    def __init__(self, inner: Any, owner: "CountingFileSystemReader") -> None:
        super().__init__()
        self.inner, self.owner = inner, owner

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, *args: Any) -> int:
        return self.inner.seek(*args)

    def tell(self) -> int:
        return self.inner.tell()

    def readinto(self, b: Any) -> int:
        n = self.inner.readinto(b) or 0
        self.owner.bytes_read += n
        return n

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.owner.bytes_read += len(data)
        return data


class CountingFileSystemReader(FileSystemReader):
    """DCP's own reader, counting the item bytes it reads (a lower bound: its file buffering is not counted)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.bytes_read = 0

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        return _CountingView(super()._slice_file(file, sinfo), self)


# ---------------------------------------------------------------- multi-process: dp=2 -> 3 ranks, 1 process


def _save_dp2(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = _full_state()
    sd: dict[str, Any] = {}
    for k, v in full.items():
        sd[k] = v if _SOURCE[k] is None else distribute_tensor(v, mesh, [_SOURCE[k]])
    sd.update(_VALUES)
    dcp.save(nest(sd), checkpoint_id=path)  # plain DCP: FileSystemWriter, DefaultSavePlanner


def _load_3(rank: int, world: int, direct: str, imported: str, out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = _full_state()
    counts: dict[str, int] = {}
    for what in ("imported", "direct", "dcp"):
        flat: dict[str, Any] = {
            k: distribute_tensor(torch.full(v.shape, 13, dtype=v.dtype), mesh, [_TARGET[k]]) for k, v in full.items()
        }
        flat.update({k: None for k in _VALUES})
        sd = nest(flat)
        if what == "dcp":
            reader: Any = CountingFileSystemReader(direct)
            dcp.load(sd, storage_reader=reader)
            counts["dcp"] = reader.bytes_read
        else:
            reader = UCPStorageReader(imported if what == "imported" else direct, dcp_values="weights_only")
            dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
            counts[what] = reader.last_load.bytes_requested
            if what == "direct":
                assert isinstance(reader.source, DCPSource)
                counts["direct_parse"] = reader.source.parse_stats.bytes
        got = flatten(sd)
        for k, v in full.items():
            t = got[k]
            assert isinstance(t, DTensor), (what, k)
            assert bit_equal(t.full_tensor(), v), f"{what}: {k} differs"
        for k, v in _VALUES.items():
            assert got[k] == v and type(got[k]) is type(v), (what, k, got[k])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(counts, f)


@pytest.mark.multiproc
def test_dcp_dp2_import_and_direct_load_bit_exact(tmp_path: Path) -> None:
    """dp=2 ``dcp.save`` -> import-dcp and direct reads, loaded by 3 ranks and by 1 process, bit-exact.

    The direct reader pulls fewer bytes than DCP's own reader (item parsing included).
    """
    src, dst = tmp_path / "dcp", tmp_path / "ucp"
    run_ranks(2, _save_dp2, str(src))
    assert (src / ".metadata").exists() and not (src / "ucp_index.json").exists()
    seen: list[tuple[int, int]] = []
    index = convert(src, dst, on_progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]
    md = read_dcp_metadata(src)
    assert set(index.tensors) | set(index.values) == set(md.state_dict_metadata)
    assert {f.rank for f in index.files} == {0, 1}
    for fqn, rec in index.tensors.items():  # chunk boxes of the source kept exactly (empty shards aside)
        want = sorted(tuple(c.offsets) for c in md.state_dict_metadata[fqn].chunks if c.sizes.numel())
        assert sorted(c.box.offsets for c in rec.chunk_list()) == want, fqn
    assert Checkpoint(dst).verify() == []

    counts_dir = tmp_path / "counts"
    counts_dir.mkdir()
    run_ranks(3, _load_3, str(src), str(dst), str(counts_dir))
    counts = [json.loads((counts_dir / f"rank{r}.json").read_text()) for r in range(3)]
    ours = sum(c["direct"] + c["direct_parse"] for c in counts)
    theirs = sum(c["dcp"] for c in counts)
    print(f"bytes read by 3 ranks: direct {ours} (parsing included), DCP's reader {theirs}: {counts}")
    assert ours < theirs, counts
    assert sum(c["imported"] for c in counts) < theirs, counts

    # One process, no process group: both forms, bit-exact.
    full = _full_state()
    for path in (dst, src):
        sd = _blank_plain(full)
        reader = UCPStorageReader(path, dcp_values="weights_only")
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
        _check_plain(sd, full)

    # Direct loading refuses DCP's pickled values by default, before reading anything.
    sd = _blank_plain(full)
    reader = UCPStorageReader(src)
    with pytest.raises(CheckpointException, match=r"value 'optim\.\w+' is stored by DCP as a pickle.*dcp_values='weights_only'"):
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    assert reader.last_load.bytes_requested == 0
    assert all((t == 13).all() for t in flatten(sd).values() if isinstance(t, torch.Tensor))
    # ... and tensors alone need no opt-in.
    sd = _blank_plain(full, values=False)
    with pytest.warns(UserWarning, match="not in the state dict"):
        dcp.load(sd, storage_reader=UCPStorageReader(src), planner=UCPLoadPlanner())
    _check_plain(sd, full, values=False)


# ---------------------------------------------------------------- single process


ODD = {
    "f32": torch.randn(7, 13),
    "transposed": torch.randn(13, 7).t(),
    "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "bf16": torch.randn(5, 3).bfloat16(),
    "u16": torch.arange(6).to(torch.uint16).reshape(2, 3),
    "f8": torch.randn(4).to(torch.float8_e4m3fn),
    "c64": torch.randn(3, dtype=torch.complex64),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.empty(0, 3),
    "i64": torch.arange(10, dtype=torch.int64),
}


def _zeros(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}


def test_direct_load_odd_dtypes_and_stored_layouts(tmp_path: Path) -> None:
    """Every dtype DCP writes, transposed and channels_last items, 0-d and empty: read in place, bit-exact."""
    dcp.save(dict(ODD), checkpoint_id=str(tmp_path))
    out = _zeros(ODD)
    holder = torch.zeros(13, 7)
    out["transposed"] = holder.t()  # a strided destination: must be filled in place
    reader = UCPStorageReader(tmp_path, options=ReadOptions(gap_bytes=0))  # no coalescing across items: count exact bytes
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner())
    for k, v in ODD.items():
        assert bit_equal(out[k], v), k
    assert bit_equal(holder, ODD["transposed"].t())
    assert reader.last_load.bytes_requested == sum(v.numel() * v.element_size() for v in ODD.values())
    # A cast (staged) read of an item stored transposed.
    out = {"transposed": torch.zeros(7, 13, dtype=torch.float64)}
    with pytest.warns(UserWarning, match="not in the state dict"):
        dcp.load(out, storage_reader=UCPStorageReader(tmp_path), planner=UCPLoadPlanner(allow_dtype_cast=True))
    assert torch.equal(out["transposed"], ODD["transposed"].double())


def test_import_dcp_then_load_bit_exact(tmp_path: Path) -> None:
    """import-dcp keeps every tensor, value and type; the result verifies and loads bit-exact."""
    src, dst = tmp_path / "dcp", tmp_path / "ucp"
    sd: dict[str, Any] = {**ODD, "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": "x", "ids": [1, 2], "none": None}}
    dcp.save(sd, checkpoint_id=str(src))
    convert(src, dst, options=ReadOptions(max_buffer_bytes=1))  # the smallest buffer: big chunks go slab by slab
    assert Checkpoint(dst).verify() == []
    out: dict[str, Any] = {**_zeros(ODD), "cfg": {k: None for k in sd["cfg"]}}
    dcp.load(out, storage_reader=UCPStorageReader(dst), planner=UCPLoadPlanner())
    for k, v in ODD.items():
        assert bit_equal(out[k], v), k
    for k, v in sd["cfg"].items():
        assert out["cfg"][k] == v and type(out["cfg"][k]) is type(v), k
    with pytest.raises(FileExistsError, match="already holds"):
        convert(src, dst)
    convert(src, dst, overwrite=True)
    assert len([n for n in os.listdir(dst) if n.endswith(".safetensors")]) == 1
    # In place: the universal index then takes precedence over .metadata.
    convert(src, src)
    reader = UCPStorageReader(src)
    out = {**_zeros(ODD), "cfg": {k: None for k in sd["cfg"]}}
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner())
    assert reader.source.format == "ucp_dcp" and bit_equal(out["channels_last"], ODD["channels_last"])


def test_import_an_empty_tensor_listed_with_no_chunk(tmp_path: Path) -> None:
    """A DCP .metadata may list a tensor of no elements with no chunk at all (there is nothing to
    store): it loads directly, and converts to a checkpoint that records it (one empty chunk, as a
    save does), also when the source has no data file at all."""
    for name, sd in (("mixed", {"e": torch.zeros(0, 5), "w": torch.arange(3.0)}), ("alone", {"e": torch.zeros(0, 5)})):
        src = tmp_path / name
        dcp.save(sd, checkpoint_id=src, no_dist=True)
        md = pickle.loads((src / ".metadata").read_bytes())
        md.state_dict_metadata["e"].chunks.clear()
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "e"}
        (src / ".metadata").write_bytes(pickle.dumps(md))
        convert(src, tmp_path / f"{name}-out")
        for path in (src, tmp_path / f"{name}-out"):
            with Checkpoint(path) as ck:
                assert ck.tensor_names() == sorted(sd), path
                for k, v in sd.items():
                    got = ck.read_tensor(k)
                    assert got.dtype == v.dtype and bit_equal(got, v), (path, k)
        with Checkpoint(tmp_path / f"{name}-out") as ck:
            assert len(ck.chunks("e")) == 1 and ck.verify() == []


def test_large_item_sub_box_reads_only_needed_bytes(tmp_path: Path) -> None:
    """Rows of a big stored item are read as exact byte ranges, far less than the item."""
    big = torch.randn(512, 256)
    dcp.save({"big": big}, checkpoint_id=str(tmp_path))
    reader = UCPStorageReader(tmp_path)
    dcp.load({"big": torch.zeros(512, 256)}, storage_reader=reader, planner=UCPLoadPlanner())
    assert reader.last_load.bytes_requested == big.numel() * 4
    assert isinstance(reader.source, DCPSource) and reader.source.parse_stats.bytes <= 4096


def test_overlapping_strides_refused_directly_but_imported(tmp_path: Path) -> None:
    """An item whose strides overlap cannot be byte ranges: the direct load names it; import handles it."""
    ov = torch.arange(4.0).as_strided((2, 2), (1, 1))  # storage of 4 floats, 16 bytes: DCP keeps the strides
    dcp.save({"ov": ov}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(CheckpointException, match=r"'ov'.*overlapping strides.*convert"):
        dcp.load({"ov": torch.zeros(2, 2)}, storage_reader=UCPStorageReader(tmp_path / "dcp"), planner=UCPLoadPlanner())
    convert(tmp_path / "dcp", tmp_path / "ucp")
    out = {"ov": torch.zeros(2, 2)}
    dcp.load(out, storage_reader=UCPStorageReader(tmp_path / "ucp"), planner=UCPLoadPlanner())
    assert torch.equal(out["ov"], ov)


def test_value_opt_in_uses_restricted_unpickler(tmp_path: Path) -> None:
    """With dcp_values='weights_only', a value torch's restricted unpickler refuses fails, naming the key."""
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "evil": _Evil(str(marker))}, checkpoint_id=str(tmp_path / "ck"))
    marker.unlink(missing_ok=True)  # (saving does not run it; be sure)
    sd = {"w": torch.zeros(2), "evil": None}
    with pytest.raises(CheckpointException, match=r"value 'evil' cannot be loaded with torch.load\(weights_only=True\)"):
        dcp.load(sd, storage_reader=UCPStorageReader(tmp_path / "ck", dcp_values="weights_only"), planner=UCPLoadPlanner())
    with pytest.raises(DCPValueError, match="'evil'"):
        convert(tmp_path / "ck", tmp_path / "ucp")
    assert not marker.exists()
    with pytest.raises(ValueError, match="dcp_values"):
        UCPStorageReader(tmp_path / "ck", dcp_values="yes")


class _Evil:
    """Pickles as a call that would create ``path``: what a hostile checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _hostile_metadata(path: Path, marker: Path) -> None:
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(path))
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))


def test_hostile_metadata_is_refused_without_running(tmp_path: Path) -> None:
    """A .metadata that would call os.system is refused, naming the class; nothing runs."""
    path, marker = tmp_path / "ck", tmp_path / "pwned"
    _hostile_metadata(path, marker)
    with pytest.raises(CheckpointFormatError, match=r"refusing to unpickle (posix|os)\.system from \.metadata"):
        read_dcp_metadata(path)
    with pytest.raises(CheckpointException, match=r"refusing to unpickle (posix|os)\.system"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
    with pytest.raises(CheckpointFormatError, match="refusing to unpickle"):
        convert(path, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_metadata_naming_files_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """storage_data entries must name plain files inside the checkpoint, within their sizes."""
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path))
    md = read_dcp_metadata(tmp_path)
    good = dict(md.storage_data)
    (key, info), = good.items()
    md.storage_data = {key: type(info)("../outside.distcp", info.offset, info.length)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointFormatError, match="is not a plain file name inside the checkpoint directory"):
        DCPSource.open(tmp_path, SourceOptions())
    md.storage_data = {key: type(info)(info.relative_path, info.offset, info.length + 10)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointFormatError, match="lies outside.*truncated"):
        DCPSource.open(tmp_path, SourceOptions())


def test_corrupt_item_is_named(tmp_path: Path) -> None:
    """An item that is not a torch.save archive fails with the file, key and byte range."""
    dcp.save({"w": torch.ones(300)}, checkpoint_id=str(tmp_path))
    (data,) = tmp_path.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[-200:] = b"\0" * 200  # the zip directory at the end of the item
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match=r"__0_0\.distcp: item of 'w' chunk \[0\].*not a readable torch.save archive"):
        dcp.load({"w": torch.zeros(300)}, storage_reader=UCPStorageReader(tmp_path), planner=UCPLoadPlanner())



@pytest.mark.parametrize(
    "field, bit, says",
    [
        (6, 7, "zip file version"),  # version needed to extract: 128 + 20
        (8, 0, "encrypted"),  # general-purpose flags: bit 0, encrypted
        (10, 3, "decompressing"),  # compression method: 8, deflate, over stored bytes
    ],
    ids=["version", "encrypted", "compression"],
)
def test_damaged_zip_directory_of_an_item_is_named(tmp_path: Path, field: int, bit: int, says: str) -> None:
    """One bit flipped in an item's zip directory entry (fields zipfile reports with its own
    NotImplementedError, RuntimeError or zlib.error) fails as a CheckpointFormatError naming
    the file, key and byte range."""
    dcp.save({"w": torch.arange(64.0).reshape(8, 8)}, checkpoint_id=str(tmp_path))
    (data,) = tmp_path.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[raw.find(b"PK\x01\x02") + field] ^= 1 << bit  # the first central directory entry
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as e:
        dcp.load({"w": torch.zeros(8, 8)}, storage_reader=UCPStorageReader(tmp_path), planner=UCPLoadPlanner())
    err = unwrap(e.value)
    assert isinstance(err, CheckpointFormatError), e.value
    assert re.search(r"__0_0\.distcp: item of 'w' chunk \[0, 0\].*not a readable torch.save archive", str(err)), err
    assert says in str(err)


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_conjugate_or_negative_view_saved_by_dcp_is_refused(tmp_path: Path, view: str) -> None:
    """DCP's writer saves a conjugate or negative view as the view's memory plus a bit in the
    pickle's tensor metadata; the memory is not the tensor's values, so the load refuses it,
    naming the key and how to save it (DCP's own reader applies the bit)."""
    base = torch.tensor([1 + 2j, 3 - 4j]) if view == "conj" else torch.tensor([1.0, -2.0, 3.0])
    saved = base.conj() if view == "conj" else torch._neg_view(base)
    dcp.save({"c": saved}, storage_writer=dcp.FileSystemWriter(tmp_path))
    with pytest.raises(CheckpointException) as e:
        dcp.load({"c": torch.zeros_like(base)}, storage_reader=UCPStorageReader(tmp_path), planner=UCPLoadPlanner())
    err = unwrap(e.value)
    assert isinstance(err, CheckpointFormatError), e.value
    kind = {"conj": "conjugate", "neg": "negative"}[view]
    assert f"item of 'c' chunk [0]" in str(err) and f"saved as a {kind} view" in str(err), err
    assert f"resolve_{view}()" in str(err)


def _edit_metadata(path: Path, fqn: str, edit: Any) -> None:
    """Rewrite ``.metadata`` with ``edit(TensorStorageMetadata)`` for ``fqn`` (our own file: a
    plain pickle round trip)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = pickle.loads((path / ".metadata").read_bytes())
    old = md.state_dict_metadata[fqn]
    md.state_dict_metadata[fqn] = TensorStorageMetadata(old.properties, *edit(old))
    (path / ".metadata").write_bytes(pickle.dumps(md))


def test_chunks_that_do_not_cover_the_tensor_are_refused(tmp_path: Path) -> None:
    """A tensor whose chunks leave elements out (a size larger than they cover, a chunk missing
    from the list) would load with those elements as whatever memory held: refused at open,
    naming the tensor. A chunk listed twice (as a replica may be) is read once."""
    import shutil

    w = torch.arange(64.0).reshape(8, 8)
    _save_rows(tmp_path / "saved", w)  # one tensor of four row chunks, as four ranks list it
    edits = {
        "larger": (lambda m: (torch.Size([10, 8]), m.chunks), "64 of its 80"),
        "chunk_gone": (lambda m: (m.size, m.chunks[:3]), "48 of its 64"),
        "chunk_twice": (lambda m: (m.size, [*m.chunks, m.chunks[1]]), None),
    }
    for damage, (edit, says) in edits.items():
        path = tmp_path / damage
        shutil.copytree(tmp_path / "saved", path)
        _edit_metadata(path, "w", edit)
        if says is None:
            out = {"w": torch.zeros(8, 8)}
            dcp.load(out, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
            assert bit_equal(out["w"], w)
            continue
        with pytest.raises(CheckpointFormatError, match=rf"\.metadata: tensor 'w': its chunks hold {says} elements"):
            Checkpoint(path)


def _save_rows(path: Path, w: torch.Tensor) -> None:
    run_ranks(4, _save_rows_rank, str(path), w)


def _save_rows_rank(rank: int, world: int, path: str, w: torch.Tensor) -> None:
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"w": distribute_tensor(w, mesh, [Shard(0)])}, checkpoint_id=path)


def _md_edit(path: Path, edit: Any) -> None:
    """Rewrite ``path``'s ``.metadata`` with ``edit(Metadata)`` done on it (in place where
    ``edit`` returns None)."""
    md = pickle.loads((path / ".metadata").read_bytes())
    out = edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md if out is None else out))


def _info(md: Any, fqn: str = "w") -> tuple[Any, Any]:
    """``(key, _StorageInfo)`` of ``fqn``'s first stored item."""
    return next((k, v) for k, v in md.storage_data.items() if k.fqn == fqn)


def _replace_info(md: Any, **fields: Any) -> None:
    import dataclasses

    key, info = _info(md)
    md.storage_data[key] = dataclasses.replace(info, **fields)


def _chunk(md: Any, offsets: Any, sizes: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    md.state_dict_metadata["w"].chunks[0] = ChunkStorageMetadata(offsets, sizes)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda md: {"w": 1}, "<md>: holds a dict, not DCP Metadata"),
        (
            lambda md: setattr(md, "state_dict_metadata", None),
            "<md>: DCP metadata without state_dict_metadata/storage_data",
        ),
        (lambda md: md.storage_data.pop(_info(md)[0]) and None, "<md>: no stored item for chunk [0, 0] of 'w'"),
        (
            lambda md: _replace_info(md, offset=-1),
            "<md>: chunk [0, 0] of 'w': malformed byte range -1+<len>",
        ),
        (
            lambda md: md.state_dict_metadata.update(w="a tensor"),
            "<md>: 'w' has unknown storage metadata str",
        ),
        (
            lambda md: setattr(md.state_dict_metadata["w"], "size", "8x8"),
            "<md>: malformed tensor metadata for 'w'",
        ),
        (lambda md: _chunk(md, [0], [8, 8]), "<md>: malformed chunk of 'w'"),
        (
            lambda md: _chunk(md, torch.Size([4, 0]), torch.Size([8, 8])),
            "<md>: chunk [4, 0]+[8, 8] of 'w' lies outside shape [8, 8]",
        ),
    ],
)
def test_malformed_dcp_metadata_is_refused_naming_the_entry(
    tmp_path: Path, edit: Any, message: str
) -> None:
    """A real .metadata whose records are not DCP's (another object, a missing or malformed
    storage entry, an unknown storage kind, a malformed size or chunk, a chunk outside the
    tensor) is refused at open, naming the file and the key."""
    dcp.save({"w": torch.arange(64.0).reshape(8, 8), "step": torch.tensor(3)}, checkpoint_id=str(tmp_path))
    length = _info(read_dcp_metadata(tmp_path))[1].length
    _md_edit(tmp_path, edit)
    with pytest.raises(CheckpointFormatError) as e:
        DCPSource.open(tmp_path, SourceOptions())
    want = message.replace("<md>", str(tmp_path / ".metadata")).replace("<len>", str(length))
    assert str(e.value) == want


def test_a_storage_entry_that_is_not_dcps_is_refused_naming_it(tmp_path: Path) -> None:
    """A storage_data key that is no MetadataIndex (a plain name): refused naming it."""
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path))
    md = read_dcp_metadata(tmp_path)
    (key, info), = md.storage_data.items()
    md.storage_data = {"w": info}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointFormatError) as e:
        DCPSource.open(tmp_path, SourceOptions())
    assert str(e.value) == f"{tmp_path / '.metadata'}: storage_data entry 'w' -> {info!r} is malformed"


def _load_error(path: Path, state: dict[str, Any], **options: Any) -> str:
    with pytest.raises(CheckpointException) as e:
        dcp.load(state, storage_reader=UCPStorageReader(path, options=ReadOptions(**options)), planner=UCPLoadPlanner())
    err = unwrap(e.value)
    assert isinstance(err, CheckpointFormatError), e.value
    return str(err)


def test_items_that_disagree_with_the_metadata_are_refused_at_load(tmp_path: Path) -> None:
    """An item written with stream transforms, one whose tensor is not the dtype .metadata
    says, one whose storage record is shorter than its tensor: each refused naming the data
    file, key, chunk and byte range."""
    import shutil

    w = torch.arange(64.0).reshape(8, 8)
    dcp.save({"w": w}, checkpoint_id=str(tmp_path / "saved"))
    (data,) = (tmp_path / "saved").glob("*.distcp")
    info = _info(read_dcp_metadata(tmp_path / "saved"))[1]
    where = f"item of 'w' chunk [0, 0] at [{info.offset}, {info.offset + info.length})"

    d = shutil.copytree(tmp_path / "saved", tmp_path / "transforms")
    _md_edit(d, lambda md: _replace_info(md, transform_descriptors=["zstd"]))
    assert _load_error(d, {"w": torch.zeros(8, 8)}) == (
        f"{d / data.name}: {where}: written with DCP stream transforms ['zstd'] (e.g. "
        "compression); such items cannot be byte-addressed and are not supported"
    )
    d = shutil.copytree(tmp_path / "saved", tmp_path / "dtype")
    _md_edit(d, lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", torch.float64))
    mismatch = f"{d / data.name}: {where}: holds a float32[8, 8] tensor, but .metadata says float64[8, 8]"
    assert _load_error(d, {"w": torch.zeros(8, 8, dtype=torch.float64)}) == mismatch
    assert DCPSource.open(d, SourceOptions()).check_files() == [mismatch]  # verify: a finding
    d = shutil.copytree(tmp_path / "saved", tmp_path / "short")
    raw = bytearray((d / data.name).read_bytes())
    at = raw.find(b"PK\x01\x02")  # the item's first central directory entry: its data/0 record
    while not raw[at + 46 : at + 46 + 40].split(b"/", 1)[-1].startswith(b"data/0"):
        at = raw.find(b"PK\x01\x02", at + 4)
    raw[at + 20 : at + 28] = (128).to_bytes(4, "little") * 2  # 128 of the 256 bytes
    (d / data.name).write_bytes(bytes(raw))
    assert _load_error(d, {"w": torch.zeros(8, 8)}) == (
        f"{d / data.name}: {where}: the tensor runs past its storage (128 bytes)"
    )


def test_a_value_written_with_stream_transforms_is_refused_naming_it(tmp_path: Path) -> None:
    """Even with dcp_values='weights_only', a value item written with stream transforms is
    not unpickled: refused naming the key."""
    dcp.save({"w": torch.ones(2), "cfg": "adamw"}, checkpoint_id=str(tmp_path))
    import dataclasses

    def transformed(md: Any) -> None:
        key, info = _info(md, "cfg")
        md.storage_data[key] = dataclasses.replace(info, transform_descriptors=["zstd"])

    _md_edit(tmp_path, transformed)
    with pytest.raises(CheckpointFormatError) as e:
        Checkpoint(tmp_path, dcp_values="weights_only").read_value("cfg")
    assert str(e.value) == f"{tmp_path}: value 'cfg' was written with DCP stream transforms ['zstd']; not supported"
