"""DCP's own ``FileSystemWriter`` / ``FsspecWriter`` checkpoints in object storage, read where they lie.

Checkpoints are written by DCP itself: with ``FileSystemWriter`` to a local
directory and uploaded to ``memory://`` with fsspec's ``put``, and with
``FsspecWriter`` straight to moto's S3 server on loopback (on 2 gloo ranks,
from row-sharded DTensors). Every load from a URL must give the saved
tensors bit for bit: ``load_state_dict``, ``Checkpoint``, ``ucp-dcp inspect``,
and ``dcp.load`` on 3 gloo ranks with ``UCPStorageReader(url, ...)``, each
rank requesting only its rows. A hostile ``.metadata`` is refused without
running, as it is locally.
"""

from __future__ import annotations

import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import s3_server
from cli_utils import run_cli
from dist_utils import bit_equal, run_ranks
from ucp_dcp import Checkpoint, load_state_dict, ReadOptions, UCPLoadPlanner, UCPStorageReader
from ucp_dcp.errors import CheckpointFormatError, DCPValueError, unwrap
from ucp_dcp.sources import DCPSource, SourceOptions, open_source
from ucp_dcp.sources._torch_archive import item_ends
from ucp_dcp.sources.distcp import read_dcp_metadata

fsspec = pytest.importorskip("fsspec")

s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module

MAX_RATIO = 1.05


def _tensors() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes, one stored transposed (DCP keeps its strides)."""
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(37, 19, generator=g),
        "h": torch.randn(11, 5, generator=g).to(torch.bfloat16),
        "t": torch.randn(13, 7, generator=g).t(),
        "ids": torch.randint(-(2**40), 2**40, (23,), generator=g, dtype=torch.int64),
        "s": torch.tensor(2.5, dtype=torch.float64),
    }


def _memory_url() -> str:
    return f"memory://ucp-dcp-{uuid.uuid4().hex[:8]}/ck"


def upload(local: Path, url: str, options: dict[str, Any] | None = None) -> None:
    """Copy every file of directory ``local`` to the objects under ``url`` (fsspec's ``put``)."""
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    for name in sorted(os.listdir(local)):
        fs.put(str(local / name), f"{root.rstrip('/')}/{name}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``(local directory, memory URL)`` of one ``FileSystemWriter`` checkpoint with tensors and a pickled value."""
    local = tmp_path_factory.mktemp("distcp_objstore") / "ck"
    dcp.save({**_tensors(), "step": 7}, storage_writer=dcp.FileSystemWriter(str(local)))
    url = _memory_url()
    upload(local, url)
    return local, url


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    wrong = [k for k, v in want.items() if not (bit_equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v)]
    assert not wrong, wrong


def test_filesystemwriter_checkpoint_uploaded_to_memory(saved: tuple[Path, str]) -> None:
    local, url = saved
    src = open_source(url)
    assert isinstance(src, DCPSource) and src.store is not None and src.format == "dcp"
    assert src.paths[0].startswith(url + "/") and src.paths[0].endswith(".distcp")
    assert src.index.files == DCPSource.open(local, SourceOptions()).index.files  # names, ranks and sizes, from the listing
    want = {**_tensors(), "step": 7}
    _same(load_state_dict(url, dcp_values="weights_only"), want)
    _same(load_state_dict(url, ["w", "t"]), {k: want[k] for k in ("w", "t")})  # tensors only: no value unpickled
    _same(load_state_dict(local, dcp_values="weights_only"), want)  # the local directory reads the same
    with Checkpoint(url, dcp_values="weights_only") as ck:
        assert ck.format == "dcp" and set(ck.tensor_names()) == set(_tensors()) and ck.value_names() == ["step"]
        assert bit_equal(ck.read_tensor("h"), want["h"]) and bit_equal(ck.read_tensor("t"), want["t"])
        assert ck.read_value("step") == 7
        assert ck.verify() == []  # every item parses as a torch.save archive inside its object


def test_pickled_value_is_refused_without_opting_in(saved: tuple[Path, str]) -> None:
    _, url = saved
    with pytest.raises(DCPValueError) as e:
        load_state_dict(url)
    msg = str(e.value)
    assert msg.startswith(f"{url}: value 'step' is stored by DCP as a pickle"), msg
    assert "dcp_values='weights_only'" in msg


def test_items_are_parsed_with_one_batch_of_ranged_requests(saved: tuple[Path, str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare() fetches both ends of every item a load needs in one batch; nothing opens a local file."""
    local, url = saved
    src = open_source(url)
    assert isinstance(src, DCPSource)
    chunks = [(fqn, 0) for fqn in src.index.tensors]
    requested: list[int] = []
    real_read_ranges = src.store.read_ranges  # type: ignore[union-attr]

    def read_ranges(ranges: Any) -> list[bytes]:
        requested.append(len(ranges))
        return real_read_ranges(ranges)

    def no_local_open(path: Any, *a: Any, **k: Any) -> int:
        raise AssertionError(f"opened local file {path}")

    monkeypatch.setattr(src.store, "read_ranges", read_ranges)
    with monkeypatch.context() as m:
        m.setattr(os, "open", no_local_open)
        src.prepare(chunks, [], threads=4)
    # The two ends of each item (one range for an item shorter than both): one batch, no read after it.
    ends = [item_ends(info.offset, info.length) for k, info in src.metadata.storage_data.items() if k.fqn != "step"]
    assert requested == [sum(map(len, ends))]
    assert src.parse_stats.calls == sum(map(len, ends))
    assert src.parse_stats.bytes == sum(e - s for r in ends for s, e in r)
    want = DCPSource.open(local, SourceOptions())
    assert [src.locate(*c) for c in chunks] == [want.locate(*c) for c in chunks]


def test_inspect_lists_the_tensors(capsys: pytest.CaptureFixture[str], saved: tuple[Path, str]) -> None:
    _, url = saved
    rc, out, err = run_cli(capsys, "inspect", url)
    assert rc == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0].split() == ["checkpoint", url]
    assert any(x.split()[:2] == ["format", "dcp"] for x in lines), out
    assert next(x for x in lines if x.startswith("w ")).split()[:3] == ["w", "float32", "[37,19]"]
    assert next(x for x in lines if x.startswith("h ")).split()[:3] == ["h", "bfloat16", "[11,5]"]
    assert next(x for x in lines if x.startswith("ids ")).split()[:3] == ["ids", "int64", "[23]"]


def test_convert_and_verify_from_a_url(capsys: pytest.CaptureFixture[str], saved: tuple[Path, str],
                                       tmp_path: Path) -> None:
    _, url = saved
    rc, out, err = run_cli(capsys, "verify", url)
    assert rc == 0 and out.startswith(f"OK {url}: 5 tensors, 1 value"), (out, err)
    rc, out, err = run_cli(capsys, "convert", url, tmp_path / "ucp", "--dcp-values", "weights_only")
    assert rc == 0, err
    _same(load_state_dict(tmp_path / "ucp"), {**_tensors(), "step": 7})


class _Evil:
    """Pickles as a call that would create ``path``: what a hostile checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_hostile_metadata_on_a_store_is_refused_without_running(saved: tuple[Path, str], tmp_path: Path) -> None:
    local, _ = saved
    url, marker = _memory_url(), tmp_path / "pwned"
    upload(local, url)
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/.metadata", pickle.dumps(_Evil(str(marker))))
    refused = r"refusing to unpickle (posix|os)\.system from \.metadata"
    with pytest.raises(CheckpointFormatError, match=refused) as e:
        load_state_dict(url)
    assert str(e.value).startswith(f"{url}/.metadata: "), str(e.value)
    with pytest.raises(CheckpointFormatError, match=refused):
        Checkpoint(url)
    with pytest.raises(CheckpointException, match=refused):
        dcp.load({"w": torch.zeros(37, 19)}, storage_reader=UCPStorageReader(url), planner=UCPLoadPlanner())
    assert not marker.exists()


def test_metadata_naming_a_missing_object(saved: tuple[Path, str]) -> None:
    local, _ = saved
    url = _memory_url()
    upload(local, url)
    fs, root = fsspec.core.url_to_fs(url)
    data = sorted(n for n in os.listdir(local) if n.endswith(".distcp"))
    fs.rm_file(f"{root}/{data[0]}")
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(url)
    assert str(e.value) == f"data file {url}/{data[0]} is missing (named by {url}/.metadata)"


def test_read_dcp_metadata_of_a_local_directory_is_unchanged(saved: tuple[Path, str], tmp_path: Path) -> None:
    local, _ = saved
    assert set(read_dcp_metadata(local).state_dict_metadata) == {*_tensors(), "step"}
    with pytest.raises(CheckpointFormatError) as e:
        read_dcp_metadata(tmp_path)
    assert str(e.value) == f"{tmp_path}: not a DCP checkpoint (no .metadata)"


# ====================================================================== FsspecWriter on S3, 2 -> 3 ranks

ROWS = {"a": (41, 9), "b": (30, 17), "c": (8, 3)}


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*ROWS[name], generator=g)


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``t`` under ``Shard(0)`` (torch.chunk's split)."""
    parts = list(torch.chunk(t, world, dim=0))
    return parts[rank] if rank < len(parts) else t[:0]


def _save_on_ranks(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {"model": {k: distribute_tensor(_full(k), mesh, [Shard(0)]) for k in ROWS}, "step": 11}
    dcp.save(sd, storage_writer=FsspecWriter(url, sync_files=False, **options))


def _load_on_ranks(rank: int, world: int, url: str, options: dict[str, Any], out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    msd = {k: DTensor.from_local(torch.full_like(_rows(_full(k), rank, world), float("nan")), mesh, [Shard(0)],
                                 run_check=False, shape=torch.Size(ROWS[k]), stride=(ROWS[k][1], 1))
           for k in ROWS}
    reader = UCPStorageReader(url, storage_options=options, options=ReadOptions(gap_bytes=0))
    dcp.load({"model": msd}, storage_reader=reader, planner=UCPLoadPlanner())
    wrong = [k for k in ROWS if not bit_equal(msd[k].to_local(), _rows(_full(k), rank, world))]
    assert not wrong, (rank, wrong)
    needed = sum(v.to_local().nbytes for v in msd.values())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"needed": needed, "requested": reader.last_load.bytes_requested}, f)


def test_fsspecwriter_on_s3_2_ranks_loads_on_3(s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    bucket, options = s3_bucket
    url = f"{bucket}/dcp-{uuid.uuid4().hex[:8]}"
    run_ranks(2, _save_on_ranks, url, options)
    src = open_source(url, storage_options=options)
    assert isinstance(src, DCPSource) and src.index.world_size == 2
    assert sorted(f.name for f in src.index.files) == ["__0_0.distcp", "__1_0.distcp"]
    # In one process: the full tensors and the value, bit for bit.
    got = load_state_dict(url, storage_options=options, dcp_values="weights_only")
    _same(got, {**{f"model.{k}": _full(k) for k in ROWS}, "step": 11})
    run_ranks(3, _load_on_ranks, url, options, str(tmp_path))
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["needed"] <= got["requested"] <= MAX_RATIO * got["needed"], (r, got)


def test_an_item_written_with_stream_transforms_is_refused_on_a_store(tmp_path: Path) -> None:
    """On a store the items' ends are fetched in one batch; an item written with DCP stream
    transforms is left out of it and refused when parsed, naming it."""
    import dataclasses
    import pickle

    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path))
    md = read_dcp_metadata(tmp_path)
    ((key, info),) = md.storage_data.items()
    md.storage_data[key] = dataclasses.replace(info, transform_descriptors=["zstd"])
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    url = _memory_url()
    upload(tmp_path, url)
    with pytest.raises(CheckpointException) as e:
        dcp.load({"w": torch.zeros(6)}, storage_reader=UCPStorageReader(url), planner=UCPLoadPlanner())
    err = unwrap(e.value)
    assert isinstance(err, CheckpointFormatError), e.value
    assert str(err) == (
        f"{url}/{info.relative_path}: item of 'w' chunk [0] at [{info.offset}, "
        f"{info.offset + info.length}): written with DCP stream transforms ['zstd'] (e.g. "
        "compression); such items cannot be byte-addressed and are not supported"
    )
