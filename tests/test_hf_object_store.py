"""A Hugging Face ``save_pretrained`` model in object storage, read where it lies.

A tiny real ``transformers`` Llama (hidden 64, ffn 96, 2 layers, 8 query /
4 KV heads, vocabulary 128, untied head; every parameter re-drawn from a
seeded normal, so no two tensors hold the same bytes) is saved twice
locally: as one ``model.safetensors``, and sharded (an index and several
shards). The files are uploaded to ``memory://`` and to moto's S3 server on
loopback; every load from a URL must give the local load's tensors bit for
bit: ``load_state_dict``, ``load_into_module`` into a fresh model of the
same class, and ``dcp.load`` on 3 gloo ranks into row-sharded (FSDP2-style
``Shard(0)``) DTensors, each rank requesting only its rows.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import s3_server
from dist_utils import bit_equal, run_ranks
from test_hf_into_layouts import CONFIG  # the same tiny untied Llama
from ucp_dcp import Checkpoint, load_into_module, load_state_dict, ReadOptions, UCPLoadPlanner, UCPStorageReader
from ucp_dcp.byteio.objstore import ObjectStore
from ucp_dcp.errors import CheckpointFormatError
from ucp_dcp.sources import formats_looked_for, open_source

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model comes from a local config
transformers = pytest.importorskip("transformers")
fsspec = pytest.importorskip("fsspec")

s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module

MAX_RATIO = 1.05


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"single": dir with model.safetensors, "sharded": dir with an index and its shards}`` of one model."""
    root = tmp_path_factory.mktemp("hf_objstore")
    model = _model(0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # norms start as ones: make them distinct too
            p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="200KB")
    assert (root / "single" / "model.safetensors").exists()
    shards = sorted(f for f in os.listdir(root / "sharded") if f.endswith(".safetensors"))
    assert (root / "sharded" / "model.safetensors.index.json").exists() and len(shards) >= 2, shards
    return {"single": root / "single", "sharded": root / "sharded"}


def upload(local: Path, url: str, options: dict[str, Any] | None = None) -> None:
    """Copy every file of directory ``local`` to the objects under ``url`` (fsspec's ``put``)."""
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    for name in sorted(os.listdir(local)):
        fs.put(str(local / name), f"{root.rstrip('/')}/{name}")


def _memory_url() -> str:
    return f"memory://ucp-hf-{uuid.uuid4().hex[:8]}/m"


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    wrong = [k for k in want if not bit_equal(got[k], want[k])]
    assert not wrong, wrong


def _check_loads(local: Path, url: str, options: dict[str, Any] | None) -> None:
    """``load_state_dict`` and ``load_into_module`` from ``url`` give the local directory's tensors."""
    want = load_state_dict(local)
    assert len(want) == 2 + 9 * CONFIG["num_hidden_layers"] + 1  # embed, norm, head + 9 per layer
    got = load_state_dict(url, storage_options=options)
    _same(got, want)
    with Checkpoint(url, storage_options=options, prefix="model.") as ckpt:
        assert ckpt.format == "hf" and ckpt.source.store is not None
        assert set(ckpt.tensor_names()) == {"model." + k for k in want}
        assert ckpt.source.check_files() == []
    fresh = _model(123)  # other weights: the load must replace every one
    assert not bit_equal(fresh.state_dict()["lm_head.weight"], want["lm_head.weight"])
    result = load_into_module(fresh, url, prefix="", storage_options=options)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _same(dict(fresh.state_dict()), want)


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_memory_url_loads_like_the_local_directory(hf_dirs: dict[str, Path], kind: str) -> None:
    url = _memory_url()
    upload(hf_dirs[kind], url)
    _check_loads(hf_dirs[kind], url, None)


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_s3_url_loads_like_the_local_directory(
    hf_dirs: dict[str, Path], kind: str, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    base, options = s3_bucket
    url = f"{base}/hf-{kind}-{uuid.uuid4().hex[:8]}"
    upload(hf_dirs[kind], url, options)
    _check_loads(hf_dirs[kind], url, options)


def test_a_file_named_directly(hf_dirs: dict[str, Path]) -> None:
    """The URL of ``model.safetensors`` or of the index, as a local path may name either."""
    for kind, name in (("single", "model.safetensors"), ("sharded", "model.safetensors.index.json")):
        url = _memory_url()
        upload(hf_dirs[kind], url)
        _same(load_state_dict(f"{url}/{name}"), load_state_dict(hf_dirs[kind] / name))


def test_one_ranged_read_per_header(hf_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening the sharded model reads the index once and each shard's header with one request, nothing more."""
    url = _memory_url()
    upload(hf_dirs["sharded"], url)
    reads: list[tuple[str, int | None, int | None]] = []
    real = ObjectStore.read

    def counted(self: ObjectStore, name: str, start: int | None = None, end: int | None = None) -> bytes:
        reads.append((name, start, end))
        return real(self, name, start, end)

    monkeypatch.setattr(ObjectStore, "read", counted)
    with Checkpoint(url):
        pass
    shards = sorted(f for f in os.listdir(hf_dirs["sharded"]) if f.endswith(".safetensors"))
    assert sorted(r[0] for r in reads) == sorted(["model.safetensors.index.json", *shards]), reads
    assert all(r[1] == 0 for r in reads if r[0] in shards), reads


def test_a_url_holding_neither_format_names_it(hf_dirs: dict[str, Path]) -> None:
    url = _memory_url()
    store = ObjectStore(url)
    store.put("config.json", (hf_dirs["single"] / "config.json").read_bytes())
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(url)
    msg = str(e.value)
    assert msg == f"{url} is not a checkpoint: found none of {', '.join(formats_looked_for())}; it holds config.json", msg
    assert "model.safetensors.index.json / one .safetensors file (Hugging Face)" in msg and ".metadata (DCP)" in msg, msg


def test_hostile_index_on_a_store(hf_dirs: dict[str, Path]) -> None:
    """Names that leave the directory are refused; a shard the index lists but the store lacks is named."""
    url = _memory_url()
    upload(hf_dirs["sharded"], url)
    store = ObjectStore(url)
    index = json.loads(store.read("model.safetensors.index.json"))
    key, shard = next(iter(index["weight_map"].items()))
    for bad in ("../" + shard, "/abs/" + shard, "sub/" + shard):
        hostile = {**index, "weight_map": {**index["weight_map"], key: bad}}
        store.put("model.safetensors.index.json", json.dumps(hostile).encode())
        with pytest.raises(CheckpointFormatError, match="file name .* is not a plain file name inside the checkpoint directory") as e:
            load_state_dict(url)
        assert str(e.value).startswith(f"{url}/model.safetensors.index.json: weight_map[{key!r}]"), str(e.value)
    store.put("model.safetensors.index.json", json.dumps(index).encode())
    store.remove([shard])
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(url)
    assert str(e.value) == f"{url}/model.safetensors.index.json: lists {shard}, which is missing from {url}"


# ---------------------------------------------------------------- 3 ranks from S3


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's ``Shard(0)`` rows of ``t`` (torch's chunking: ceil-sized, the last ones short)."""
    size = -(-t.shape[0] // world)
    start = min(rank * size, t.shape[0])
    return t[start : min(start + size, t.shape[0])]


def _load_on_ranks(rank: int, world: int, url: str, options: dict[str, Any], local: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (world,))
    ref = load_state_dict(local)  # the local directory's tensors: what every rank's rows must hold
    stats: dict[str, Any] = {}
    for mode, gap in (("exact", 0), ("default", None)):
        # get_state_dict(model) of an FSDP2 model: the file's names, every tensor split by rows.
        msd = {k: DTensor.from_local(torch.full_like(_rows(v, rank, world), float("nan")), mesh, [Shard(0)],
                                     run_check=False, shape=v.shape, stride=v.stride())
               for k, v in ref.items()}
        reader = UCPStorageReader(url, storage_options=options, prefix="model.", options=ReadOptions(gap_bytes=gap))
        dcp.load({"model": msd}, storage_reader=reader, planner=UCPLoadPlanner())
        wrong = [k for k, v in ref.items() if not bit_equal(msd[k].to_local(), _rows(v, rank, world))]
        assert not wrong, (rank, mode, wrong)
        needed = sum(v.to_local().nbytes for v in msd.values())
        stats[mode] = {"needed": needed, "requested": reader.last_load.bytes_requested}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(stats, f)


def test_s3_sharded_model_into_row_shards_on_3_ranks(
    hf_dirs: dict[str, Path], s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    base, options = s3_bucket
    url = f"{base}/hf-ranks-{uuid.uuid4().hex[:8]}"
    upload(hf_dirs["sharded"], url, options)
    run_ranks(3, _load_on_ranks, url, options, str(hf_dirs["sharded"]), str(tmp_path))
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        exact, default = got["exact"], got["default"]
        assert exact["needed"] <= exact["requested"] <= MAX_RATIO * exact["needed"], (r, got)
        # The default merges gaps up to 32 KiB (other ranks' rows between this rank's pieces of
        # neighbouring tensors, all under 32 KiB in this tiny model): more bytes, never fewer.
        assert default["requested"] >= exact["needed"], (r, got)


def test_check_files_names_a_shard_removed_from_the_store(hf_dirs: dict[str, Path]) -> None:
    """A shard deleted from the store after the open is a finding of check_files (the store
    answered: no such object), not an error that stops the check."""
    url = _memory_url()
    upload(hf_dirs["sharded"], url)
    src = open_source(url)
    assert src.check_files() == []
    fs, root = fsspec.core.url_to_fs(url)
    gone = sorted(n for n in os.listdir(hf_dirs["sharded"]) if n.endswith(".safetensors"))[0]
    fs.rm(f"{root}/{gone}")
    problems = src.check_files()
    assert len(problems) == 1 and f"{url}/{gone}" in problems[0], problems


def test_check_files_raises_when_the_store_fails_rather_than_answering(
    hf_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that fails (access denied here) says nothing about the files: check_files
    raises its error, naming the URL, instead of reporting the file as a finding."""
    import errno

    from ucp_dcp.errors import StorageError

    url = _memory_url()
    upload(hf_dirs["single"], url)
    src = open_source(url)

    def denied(self: ObjectStore, name: str) -> int:
        raise StorageError(errno.EACCES, f"{url}/{name}: access denied")

    monkeypatch.setattr(ObjectStore, "size", denied)
    with pytest.raises(StorageError) as e:
        src.check_files()
    assert str(e.value) == f"{url}/model.safetensors: access denied"
