"""One ReadOptions for every reading entry point, a narrow reader, one LoadReport per load."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ucp_dcp import (
    Checkpoint,
    LoadReport,
    ReadOptions,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    convert,
    export_hf,
    load_into_module,
    load_state_dict,
)
from ucp_dcp.byteio.rangeio import IO_THREADS
from ucp_dcp.errors import CheckpointKeyError, InvalidArgumentError, InvalidArgumentTypeError

ENTRY_POINTS = [UCPStorageReader, Checkpoint, load_state_dict, load_into_module, export_hf, convert]


def test_the_reader_takes_six_arguments_or_fewer() -> None:
    params = list(inspect.signature(UCPStorageReader.__init__).parameters)
    assert params[0] == "self" and len(params) - 1 <= 6, params


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_every_entry_point_takes_the_same_options(entry: object) -> None:
    sig = inspect.signature(entry)  # type: ignore[arg-type]
    assert sig.parameters["options"].default is None
    # No knob of ReadOptions is also a keyword of its own: one way to set each.
    knobs = {f.name for f in dataclasses.fields(ReadOptions)}
    assert not knobs & set(sig.parameters), knobs & set(sig.parameters)


def test_one_default_per_knob() -> None:
    opts = ReadOptions()
    assert opts.io_threads == IO_THREADS and opts.verify is True and opts.read_once == "auto"
    assert opts.max_buffer_bytes == 64 << 20 and opts.buffer_bytes == 64 << 20
    assert ReadOptions(max_buffer_bytes=1).buffer_bytes == 1 << 20  # the floor every reader keeps
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.verify = False  # type: ignore[misc]


def test_a_bad_dcp_values_is_refused_by_every_entry_point(tmp_path: Path) -> None:
    for make in (lambda: UCPStorageReader(tmp_path, dcp_values="pickle"),
                 lambda: Checkpoint(tmp_path, dcp_values="pickle")):
        with pytest.raises(InvalidArgumentError) as ei:
            make()
        assert str(ei.value) == "dcp_values must be one of (None, 'weights_only'), got 'pickle'"


@pytest.mark.parametrize(
    ("field", "value", "error", "says"),
    [
        ("io_threads", 0, InvalidArgumentError, "ReadOptions.io_threads must be an int >= 1, got 0"),
        ("io_threads", 1.5, InvalidArgumentTypeError, "ReadOptions.io_threads must be an int"),
        ("io_threads", True, InvalidArgumentTypeError, "ReadOptions.io_threads must be an int"),
        ("max_buffer_bytes", -1, InvalidArgumentError, "must be an int >= 0, got -1"),
        ("gap_bytes", -1, InvalidArgumentError, "ReadOptions.gap_bytes must be an int >= 0"),
        ("max_request_bytes", 0, InvalidArgumentError, "ReadOptions.max_request_bytes must be"),
        ("verify", "no", InvalidArgumentTypeError, "ReadOptions.verify must be True or False"),
        ("requests", {}, InvalidArgumentTypeError, "must be a RequestPolicy or None, got dict"),
        ("progress", None, InvalidArgumentTypeError, "ReadOptions.progress must be a Progress"),
    ],
)
def test_a_bad_option_is_refused_when_made_naming_it(
    field: str, value: object, error: type[Exception], says: str
) -> None:
    """Not deep in a load, as a raw TypeError from a thread pool (io_threads=1.5 once was), nor
    taken silently (io_threads=0 once was)."""
    with pytest.raises(error) as ei:
        ReadOptions(**{field: value})  # type: ignore[arg-type]
    assert says in str(ei.value)


def test_options_that_are_not_read_options_are_refused_by_the_reader(tmp_path: Path) -> None:
    for make, who in ((UCPStorageReader, "UCPStorageReader"), (Checkpoint, "Checkpoint")):
        with pytest.raises(InvalidArgumentTypeError) as ei:
            make(tmp_path, options={"verify": False})  # type: ignore[arg-type]
        assert str(ei.value) == f"{who}: options must be a ReadOptions, got dict"


def test_load_state_dict_names_an_unmatched_key_given_by_a_generator(tmp_path: Path) -> None:
    sd = {"w": torch.arange(16, dtype=torch.float32), "b": torch.ones(3)}
    dcp.save(sd, storage_writer=UCPStorageWriter(tmp_path), planner=UCPSavePlanner(), no_dist=True)
    got = load_state_dict(tmp_path, keys=(k for k in ["w"]))
    assert list(got) == ["w"] and torch.equal(got["w"], sd["w"])
    with pytest.raises(CheckpointKeyError, match="no key matches \\['nope'\\]"):
        load_state_dict(tmp_path, keys=(k for k in ["w", "nope"]))


def test_last_load_is_replaced_by_each_load(tmp_path: Path) -> None:
    sd = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7)}
    dcp.save(sd, storage_writer=UCPStorageWriter(tmp_path), planner=UCPSavePlanner(), no_dist=True)
    reader = UCPStorageReader(tmp_path)
    assert reader.last_load == LoadReport()  # nothing loaded yet
    nbytes = sum(t.nbytes for t in sd.values())
    reports = []
    for _ in range(2):
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        reports.append(reader.last_load)
    first, second = reports
    assert first is not second  # a new record per load, not one that adds up
    for report in reports:
        assert report.bytes_requested >= nbytes and report.verified_bytes == nbytes
        assert report.rank_record is not None and report.rank_record.bytes == report.bytes_requested
        assert report.slowest == report.rank_record  # one process: its own record
        assert report.read_once is None and report.exchange is None and report.placement is None
    assert second.bytes_requested == first.bytes_requested


def test_provided_files_are_used_once(tmp_path: Path) -> None:
    sd = {"w": torch.arange(16, dtype=torch.float32)}
    dcp.save(sd, storage_writer=UCPStorageWriter(tmp_path), planner=UCPSavePlanner(), no_dist=True)
    index = (tmp_path / "ucp_index.json").read_bytes()
    (tmp_path / "ucp_index.json").write_bytes(b"not json")  # only the provided bytes can open it
    reader = UCPStorageReader(tmp_path)
    reader.provide_files({"ucp_index.json": index})
    out = {"w": torch.zeros(16)}
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
    assert torch.equal(out["w"], sd["w"])
    assert reader._known is None  # used once: a later opening reads the files as they are then
