"""A load reads all its values with one read call: on object storage one request for the values at
the end of a data file, not one each; each value still checked against its checksum."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ucp_dcp import ChecksumError, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter


def _state() -> dict:
    return {
        "w": torch.arange(4096, dtype=torch.float32),
        "lr": 0.1,
        "betas": [0.9, 0.95],
        "name": "adamw",
        "step": 1000,
        "groups": {"a": 1, "b": [1, 2, 3]},
    }


def test_values_are_read_in_one_request_from_an_object_store() -> None:
    url = f"memory://values-{uuid.uuid4().hex[:8]}"
    # A tensor past the header's first request (64 KiB and a little more at this size): a file
    # smaller than that comes whole with the header, and its load needs no request at all.
    state = {**_state(), "w": torch.arange(1 << 16, dtype=torch.float32)}
    dcp.save(state, storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    target = {"w": torch.zeros(1 << 16), "lr": 0.0, "betas": [0.0, 0.0], "name": "", "step": -1,
              "groups": {"a": 0, "b": [0, 0, 0]}}
    reader = UCPStorageReader(url)
    dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
    assert torch.equal(target["w"], state["w"])
    assert {k: v for k, v in target.items() if k != "w"} == {k: v for k, v in state.items() if k != "w"}
    # One request: the tensor's reads on to the end of the file, which holds all six values (one
    # request each before, then one for them all).
    assert reader.last_load.read_calls == 1, reader.last_load.read_calls


def test_a_corrupt_value_read_with_others_still_fails_its_checksum(tmp_path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=UCPStorageWriter(str(path)), planner=UCPSavePlanner())
    reader = UCPStorageReader(str(path))
    reader.read_metadata()
    src = reader.source
    loc = src.value_location("name")
    data = path / src.paths[loc.file].rsplit("/", 1)[-1]
    raw = bytearray(data.read_bytes())
    raw[loc.start] ^= 0x20
    data.write_bytes(bytes(raw))
    target = {"w": torch.zeros(4096), "lr": 0.0, "betas": [0.0, 0.0], "name": "", "step": -1,
              "groups": {"a": 0, "b": [0, 0, 0]}}
    with pytest.raises(CheckpointException) as e:
        dcp.load(target, storage_reader=UCPStorageReader(str(path)), planner=UCPLoadPlanner())
    err = e.value.failures[0]
    err = err[0] if isinstance(err, tuple) else err
    assert isinstance(err, ChecksumError) and "checksum mismatch for value 'name'" in str(err), err
