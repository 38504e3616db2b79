"""Single-process round trips: dtypes, odd shapes, strided sources and targets, casts."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType

from dist_utils import bit_equal
from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.errors import InvalidArgumentError, InvalidArgumentTypeError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)  # every bit pattern, NaNs included


def _save(sd: dict[str, Any], path: Path) -> None:
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())


def _load(sd: dict[str, Any], path: Path, **kw: Any) -> UCPStorageReader:
    reader = UCPStorageReader(path, options=ReadOptions(**{k: v for k, v in kw.items() if k in ("max_buffer_bytes",)}))
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(**{k: v for k, v in kw.items() if k.startswith("allow")}))
    return reader


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    """Every dtype, 0-d, empty and odd shapes round-trip bit for bit."""
    sd = {"a": _rand((7, 13), dtype, 1), "scalar": _rand((), dtype, 2), "empty": _rand((0, 3), dtype, 3),
          "big": _rand((1100, 5), dtype, 4)}
    _save(sd, tmp_path)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    _load(out, tmp_path)
    for k in sd:
        assert bit_equal(out[k], sd[k]), k


def test_strided_source_and_target(tmp_path: Path) -> None:
    """Non-contiguous tensors save by value and load into strided views in place."""
    base = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    sd = {"t": base.t(), "slice": base[::2, 5:17]}
    _save(sd, tmp_path)
    holder = torch.zeros(30, 20)
    target_t = holder.t().t()  # a view: loading must write into holder's storage
    big = torch.zeros(12, 40)
    target_slice = big[:10, 3:15]
    assert not target_slice.is_contiguous()
    _load({"t": target_t, "slice": target_slice}, tmp_path)
    assert torch.equal(holder, base.t())
    assert torch.equal(big[:10, 3:15], base[::2, 5:17]) and big[:, :3].abs().sum() == 0 and big[10:].abs().sum() == 0
    transposed_target = torch.zeros(20, 30).t()  # storage order differs from the saved order
    _load({"t": transposed_target, "slice": torch.zeros(10, 12)}, tmp_path)
    assert torch.equal(transposed_target, base.t())


def test_dtype_cast_is_bounded_and_can_be_refused(tmp_path: Path) -> None:
    """A dtype change is cast (DCP's default) through a bounded staging buffer; allow_dtype_cast=False refuses it."""
    w = torch.randn(3000, 700)  # 8.4 MB: several 1 MiB slabs
    _save({"w": w}, tmp_path)
    with pytest.raises(CheckpointException, match=r"dtype mismatch for 'w': the checkpoint has float32, the state dict expects bfloat16"):
        _load({"w": torch.zeros(3000, 700, dtype=torch.bfloat16)}, tmp_path, allow_dtype_cast=False)
    out = torch.zeros(3000, 700, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=r"cast from the checkpoint's dtype on load: \['w \(float32 -> bfloat16\)'\]"):
        _load({"w": out}, tmp_path, max_buffer_bytes=1 << 20)
    assert bit_equal(out, w.to(torch.bfloat16))


def test_values_round_trip(tmp_path: Path) -> None:
    """Nested non-tensor values keep their types and contents; nothing is pickled.

    DCP flattens nested dicts into one key per leaf (with str keys), so the
    target mirrors the saved structure; a dict with int keys survives inside
    a leaf value (here a tuple).
    """
    import numpy as np

    values = {"step": 12, "nested": {"lr": 3e-4, "betas": (0.9, 0.95), "flags": [True, None, "x"],
                                     "inf": float("inf"), "by_int": ({1: "a", 2: "b"},)},
              "np_rng": ("MT19937", np.arange(5, dtype=np.uint32), 3, 0, 0.0), "blob": b"\x00\xff"}
    _save(values, tmp_path)
    out: dict[str, Any] = {"step": 0, "nested": {"lr": 0, "betas": None, "flags": None, "inf": 0, "by_int": None},
                           "np_rng": None, "blob": None}
    _load(out, tmp_path)
    assert out["step"] == 12 and out["nested"]["betas"] == (0.9, 0.95) and out["nested"]["by_int"] == ({1: "a", 2: "b"},)
    assert out["nested"]["flags"] == [True, None, "x"] and out["nested"]["inf"] == float("inf")
    assert out["np_rng"][0] == "MT19937" and np.array_equal(out["np_rng"][1], np.arange(5, dtype=np.uint32))
    assert out["blob"] == b"\x00\xff"
    index = json.loads((tmp_path / "ucp_index.json").read_text())
    assert set(index["values"]) >= {"step", "nested.lr", "np_rng", "blob"}


@pytest.mark.filterwarnings(r"ignore:7 checkpoint key\(s\) not in the state dict:UserWarning")
def test_reads_only_needed_bytes(tmp_path: Path) -> None:
    """Loading one tensor of many reads that tensor's bytes plus one header."""
    sd = {f"w{i}": torch.randn(256, 256) for i in range(8)}
    _save(sd, tmp_path)
    out = {"w3": torch.zeros(256, 256)}
    reader = _load(out, tmp_path, allow_partial_load=True)
    assert torch.equal(out["w3"], sd["w3"])
    assert reader.last_load.bytes_requested == 256 * 256 * 4


def test_bytesio_values_round_trip(tmp_path: Path) -> None:
    """An ``io.BytesIO`` value (DCP stores these as raw bytes) saves and loads back as a BytesIO, unpickled."""
    import io

    blob = bytes(range(256)) * 3
    _save({"w": torch.ones(3), "blob": io.BytesIO(blob), "nested": {"b": io.BytesIO(b"")}}, tmp_path)
    out: dict[str, Any] = {"w": torch.zeros(3), "blob": io.BytesIO(), "nested": {"b": io.BytesIO()}}
    _load(out, tmp_path)
    assert isinstance(out["blob"], io.BytesIO) and out["blob"].getvalue() == blob
    assert isinstance(out["nested"]["b"], io.BytesIO) and out["nested"]["b"].getvalue() == b""


def test_empty_state_dict_saves_and_loads(tmp_path: Path) -> None:
    """An empty state dict (a Stateful with nothing to save) round-trips; loading nothing from a
    non-empty checkpoint only warns about the keys nobody asked for (DCP's test_no_dist)."""
    _save({}, tmp_path / "empty")
    _load({}, tmp_path / "empty")
    _save({"w": torch.ones(2)}, tmp_path / "one")
    with pytest.warns(UserWarning, match=r"'w'"):
        _load({}, tmp_path / "one")


def test_load_into_an_empty_state_dict_rebuilds_the_nesting(tmp_path: Path) -> None:
    """DCP's own empty-state-dict planner (behind ``format_utils.dcp_to_torch_save``) loads a universal
    checkpoint through UCPStorageReader with the saved nesting (list indices, dotted keys) and values."""
    import io

    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd = {"model": {"w": torch.arange(6.0).reshape(2, 3), "layers": [torch.ones(2), torch.zeros(3)]},
          "step": 7, "dotted.key": torch.ones(1), "blob": io.BytesIO(b"raw")}
    _save(sd, tmp_path)
    out: dict[str, Any] = {}
    _load_state_dict(out, storage_reader=UCPStorageReader(tmp_path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert sorted(out) == ["blob", "dotted.key", "model", "step"] and sorted(out["model"]) == ["layers", "w"]
    assert bit_equal(out["model"]["w"], sd["model"]["w"]) and isinstance(out["model"]["layers"], list)
    assert all(bit_equal(a, b) for a, b in zip(out["model"]["layers"], sd["model"]["layers"]))
    assert out["step"] == 7 and bit_equal(out["dotted.key"], torch.ones(1)) and out["blob"].getvalue() == b"raw"


def test_load_metadata_reports_the_save_and_the_load(tmp_path: Path) -> None:
    """The reader's metadata names the checkpoint, the save that wrote it, this load and DCP's version, as DCP's does."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    writer = UCPStorageWriter(tmp_path)
    dcp.save({"a": torch.arange(4.0)}, storage_writer=writer, planner=UCPSavePlanner())
    assert len(writer.save_id) == 8
    assert all(f.name.endswith(f"-{writer.save_id}.safetensors") for f in tmp_path.glob("rank*.safetensors"))
    reader = UCPStorageReader(tmp_path)
    md = reader.read_metadata()
    assert md.storage_meta is not None
    assert (str(md.storage_meta.checkpoint_id), md.storage_meta.save_id) == (str(tmp_path), writer.save_id)
    assert md.storage_meta.load_id == reader.load_id and reader.load_id
    assert md.version == CURRENT_DCP_VERSION
    first = reader.load_id
    reader.reset(tmp_path)
    assert reader.load_id != first
    # A second save into the same directory is another save, with its own id.
    old = writer.save_id
    dcp.save({"a": torch.arange(4.0)}, storage_writer=writer, planner=UCPSavePlanner())
    assert writer.save_id != old and UCPStorageReader(tmp_path).read_metadata().storage_meta.save_id == writer.save_id


def test_load_errors_open_with_dcps_words(tmp_path: Path) -> None:
    """A missing key and a size mismatch raise with DCP's own phrases, which callers match on."""
    _save({"w": torch.zeros(2, 2)}, tmp_path)
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: 1 key"):
        _load({"w": torch.zeros(2, 2), "extra": torch.zeros(1)}, tmp_path)
    with pytest.raises(CheckpointException, match=r"Size mismatch for 'w': the checkpoint has shape \[2, 2\]"):
        _load({"w": torch.zeros(3, 2)}, tmp_path)


def test_load_pauses_the_garbage_collector_and_restores_it(tmp_path: Path) -> None:
    """read_data runs with the cyclic collector paused, and leaves it as it found it (on or off)."""
    import gc

    from ucp_dcp.dcp import reader as reader_module

    seen = []
    real = reader_module.UCPStorageReader._read_data

    def spy(self: Any, *args: Any) -> Any:
        seen.append(gc.isenabled())
        return real(self, *args)

    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    dcp.save(sd, storage_writer=UCPStorageWriter(tmp_path / "c"), planner=UCPSavePlanner(), no_dist=True)
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            out = {"w": torch.zeros(3, 4)}
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(reader_module.UCPStorageReader, "_read_data", spy)
                dcp.load(out, storage_reader=UCPStorageReader(tmp_path / "c"), planner=UCPLoadPlanner(), no_dist=True)
            assert torch.equal(out["w"], sd["w"])
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    assert seen == [False, False]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpoint_id_redirects_a_writer_and_a_reader(tmp_path: Path) -> None:
    """``checkpoint_id`` given to dcp.save / dcp.load overrides the path a writer or reader was
    made with (DCP resets them to it); a reader set up without read_metadata opens the source
    itself; a planner other than UCPSavePlanner is refused by name."""
    a, b = _rand((3, 5), torch.float32, 1), _rand((3, 5), torch.float32, 2)
    _save({"w": a}, tmp_path / "a")
    dcp.save({"w": b}, storage_writer=UCPStorageWriter(tmp_path / "unused"), planner=UCPSavePlanner(),
             checkpoint_id=tmp_path / "b")
    assert not (tmp_path / "unused").exists()
    reader = UCPStorageReader(tmp_path / "a")
    got = {"w": torch.zeros(3, 5)}
    dcp.load(got, storage_reader=reader, planner=UCPLoadPlanner(), checkpoint_id=tmp_path / "b")
    assert bit_equal(got["w"], b) and reader.checkpoint_id == str(tmp_path / "b")

    reader = UCPStorageReader(tmp_path / "a")
    metadata = reader.read_metadata()
    reader.reset()  # a new load: the source is opened again where DCP gives metadata alone
    reader.set_up_storage_reader(metadata, True)
    assert reader.source is not None and reader.source.path == str(tmp_path / "a")

    assert UCPStorageWriter.validate_checkpoint_id(tmp_path) and not UCPStorageWriter.validate_checkpoint_id(3)  # type: ignore[arg-type]
    # a reader recognises a checkpoint some source format can open, not a path holding none
    assert UCPStorageReader.validate_checkpoint_id(tmp_path / "a")
    assert not UCPStorageReader.validate_checkpoint_id(tmp_path / "unused-too")
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"w": a}, storage_writer=UCPStorageWriter(tmp_path / "c"))
    (err, _), = ei.value.failures.values()
    assert isinstance(err, InvalidArgumentTypeError), repr(err)
    assert str(err).startswith("UCPStorageWriter needs planner=UCPSavePlanner(): other planners pickle ")


class _NoOffsets(UCPLoadPlanner):
    """A planner whose tensor read items do not say which saved chunk they read."""

    def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
        plan = super().finish_plan(new_plan)
        items = [
            dataclasses.replace(ri, storage_index=MetadataIndex(ri.storage_index.fqn))
            if ri.type != LoadItemType.BYTE_IO else ri
            for ri in plan.items
        ]
        return dataclasses.replace(plan, items=items)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_read_item_without_offsets_is_refused_by_name(tmp_path: Path) -> None:
    _save({"w": torch.ones(3)}, tmp_path)
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"w": torch.zeros(3)}, storage_reader=UCPStorageReader(tmp_path), planner=_NoOffsets())
    (err, _), = ei.value.failures.values()
    assert type(err) is InvalidArgumentError and str(err) == (
        "tensor 'w': the load plan reads a chunk of it without its offsets (MetadataIndex.offset); "
        "a tensor read item must name the saved chunk it reads"
    )


def _planned_results(sd: dict[str, Any], path: Path) -> list[Any]:
    """UCPStorageWriter.planned_results of a one-rank save of ``sd`` (DCP's steps, no write)."""
    planner = UCPSavePlanner()
    planner.set_up_planner(sd, None, True)
    writer = UCPStorageWriter(path)
    writer.set_up_storage_writer(True)
    (plan,), _ = planner.create_global_plan([writer.prepare_local_plan(planner.create_local_plan())])
    (plan,) = writer.prepare_global_plan([plan])
    return writer.planned_results(planner.finish_plan(plan), planner)


def test_planned_results_of_an_empty_and_a_one_tensor_rank(tmp_path: Path) -> None:
    """What the scale simulator builds its index from: nothing for a rank with nothing to save;
    one file holding the tensor's bytes otherwise; nothing is written."""
    assert _planned_results({}, tmp_path / "empty") == []
    (res,) = _planned_results({"w": torch.ones(2)}, tmp_path / "one")
    (entry,) = res.storage_data.entries
    assert (entry.meta.fqn, entry.meta.shape, entry.nbytes) == ("w", (2,), 8)
    assert res.storage_data.file == res.index.fqn and res.size_in_bytes == entry.start + 8
    assert not any(p.exists() and any(p.iterdir()) for p in (tmp_path / "empty", tmp_path / "one"))
