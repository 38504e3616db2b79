"""DeepSpeed ZeRO checkpoints read at an fsspec URL (issue #16): the committed real fixtures, uploaded.

The directory as DeepSpeed writes it (``latest`` and the tag folder) is put
on ``memory://`` and on a moto S3 server, then loaded as the local copy is:
the same keys and bit-identical tensors, pickles read as inert records with
a few ranged requests per archive, tensor bytes through the source's
ranged reader (on 3 gloo ranks into FSDP2: each rank asks for exactly the
bytes the local load asks for). A hostile pickle is refused, never run.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

import s3_server
import test_deepspeed as tds
from dist_utils import bit_equal, flatten, run_ranks
from ucp_dcp import load_state_dict, ReadOptions, UCPLoadPlanner, UCPStorageReader
from ucp_dcp.byteio.objstore import ObjectStore
from ucp_dcp.errors import CheckpointFormatError
from ucp_dcp.sources import DeepSpeedSource, open_source
from ucp_dcp.sources import _torch_archive

fsspec = pytest.importorskip("fsspec")

s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module

FIXTURES = tds.FIXTURES
VARIANTS = ["zero2_fp32_w2", "zero3_fp32_w2"]


def _memory_url() -> str:
    return f"memory://ucp-ds-{uuid.uuid4().hex}/ck"


def upload(local: Path, url: str, options: dict[str, Any] | None = None) -> None:
    """The directory's files under ``url``, as a user's ``aws s3 cp --recursive`` would put them."""
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.put(str(local), root, recursive=True)


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(got[k], torch.Tensor) and bit_equal(got[k], v), k
        else:
            assert got[k] == v, k


def _count_requests(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Requests per object name from now on: a batch of ranged reads counts one per range."""
    seen: Counter[str] = Counter()
    real_read, real_ranges = ObjectStore.read, ObjectStore.read_ranges

    def read(self: ObjectStore, name: str, start: int | None = None, end: int | None = None) -> bytes:
        seen[name] += 1
        return real_read(self, name, start, end)

    def read_ranges(self: ObjectStore, ranges: Any) -> list[bytes]:
        for n, _, _ in ranges:
            seen[n] += 1
        return real_ranges(self, ranges)

    monkeypatch.setattr(ObjectStore, "read", read)
    monkeypatch.setattr(ObjectStore, "read_ranges", read_ranges)
    return seen


@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_url_loads_as_the_local_directory(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _memory_url()
    upload(FIXTURES / variant, url)
    seen = _count_requests(monkeypatch)
    src = open_source(url)
    assert isinstance(src, DeepSpeedSource) and src.stage == tds.meta(variant)["zero_stage"]
    assert src.store is not None and src.store.url == f"{url}/step2"
    local = open_source(FIXTURES / variant)
    assert [os.path.basename(p) for p in src.paths] == [os.path.basename(p) for p in local.paths]
    assert [f.name for f in src.index.files] == [f.name for f in local.index.files]
    # Files this small are read whole by the first (tail) request: one per archive, and latest.
    assert seen == Counter({"latest": 1, **{os.path.basename(p): 1 for p in src.paths}}), seen
    assert src.check_files() == []
    got = load_state_dict(url)
    _same(got, load_state_dict(FIXTURES / variant))
    want = tds.expected(variant)
    assert all(bit_equal(got[k], v) for k, v in want.items())
    # The tag folder's own URL opens too.
    assert isinstance(open_source(f"{url}/step2"), DeepSpeedSource)


def test_larger_archives_take_a_few_requests_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tail smaller than the file: the tail, the rest of the zip directory, the pickle, the local headers."""
    variant = "llama_zero2_fp32_w2"
    url = _memory_url()
    upload(FIXTURES / variant, url)
    monkeypatch.setattr(_torch_archive, "_TAIL_BYTES", 1024)
    real_ranges = ObjectStore.read_ranges
    batches: Counter[str] = Counter()

    def read_ranges(self: ObjectStore, ranges: Any) -> list[bytes]:
        for n in {n for n, _, _ in ranges}:
            batches[n] += 1
        return real_ranges(self, ranges)

    monkeypatch.setattr(ObjectStore, "read_ranges", read_ranges)
    src = open_source(url)
    names = [os.path.basename(p) for p in src.paths]
    assert set(batches) == set(names) and all(batches[n] <= 4 for n in names), batches
    monkeypatch.undo()
    _same(load_state_dict(url), load_state_dict(FIXTURES / variant))


@pytest.mark.parametrize("variant", VARIANTS)
def test_s3_url_loads_as_the_local_directory(variant: str, s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, options = s3_bucket
    url = f"{bucket}/ds-{uuid.uuid4().hex[:8]}/ck"
    upload(FIXTURES / variant, url, options)
    src = open_source(url, storage_options=options)
    assert isinstance(src, DeepSpeedSource) and src.check_files() == []
    _same(load_state_dict(url, storage_options=options), load_state_dict(FIXTURES / variant))


def _fsdp2_from(rank: int, world: int, variants: list[str], urls: list[str], options: dict[str, Any],
                out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    report = {}
    for variant, url in zip(variants, urls):
        m = tds.meta(variant)
        states = []
        for where, opts in ((url, options), (str(FIXTURES / variant), None)):
            model, _ = tds._model_and_optim(m["model"])
            fully_shard(model)
            optim = torch.optim.AdamW(tds.GEN.param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
            msd, osd = get_state_dict(model, optim)
            state: dict[str, Any] = {"model": msd, "optim": osd}
            for v in flatten(state).values():
                if isinstance(v, torch.Tensor):
                    (v.to_local() if isinstance(v, DTensor) else v).fill_(13)
            reader = UCPStorageReader(where, storage_options=opts, options=ReadOptions(gap_bytes=0))
            dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
            states.append((flatten(state), reader.last_load.bytes_requested))
        (flat, requested), (local_flat, local_requested) = states
        for k, v in tds.expected(variant).items():
            t = flat[k]
            full = t.full_tensor() if isinstance(t, DTensor) else t
            assert bit_equal(full, v.to(full.dtype) if k == "model.frozen" else v), (variant, rank, k)
        for k, v in local_flat.items():
            if isinstance(v, torch.Tensor):
                a = flat[k].to_local() if isinstance(flat[k], DTensor) else flat[k]
                b = v.to_local() if isinstance(v, DTensor) else v
                assert bit_equal(a, b), (variant, rank, k)
            else:
                assert flat[k] == v, (variant, rank, k)
        needed = tds._needed_bytes(open_source(url, storage_options=options), flat)
        report[variant] = {"needed": needed, "requested": requested, "local": local_requested}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def test_s3_into_fsdp2_on_3_ranks_reading_what_each_needs(s3_bucket: tuple[str, dict[str, Any]],
                                                          tmp_path: Path) -> None:
    bucket, options = s3_bucket
    urls = []
    for variant in VARIANTS:
        url = f"{bucket}/ds-{uuid.uuid4().hex[:8]}/ck"
        upload(FIXTURES / variant, url, options)
        urls.append(url)
    run_ranks(3, _fsdp2_from, VARIANTS, urls, options, str(tmp_path))
    for r in range(3):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        for variant in VARIANTS:
            got = report[variant]
            # Exactly the bytes the rank holds, as the local load reads them.
            assert got["requested"] == got["needed"] == got["local"], (r, variant, got)


def test_a_hostile_pickle_in_the_store_is_refused_before_anything_runs(tmp_path: Path) -> None:
    d = tds._copy("zero2_fp32_w2", tmp_path)
    victim = d / "step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer_state_dict": {"x": Payload()}}, victim)
    url = _memory_url()
    upload(d, url)
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(url)
    assert str(e.value) == (f"{url}/step2/zero_pp_rank_1_mp_rank_00_optim_states.pt: refusing to unpickle "
                            "posix.system: it is not one of the classes this format stores")
    assert not marker.exists()


def test_damaged_tag_folders_in_the_store_name_what_is_wrong(tmp_path: Path) -> None:
    url = _memory_url()
    upload(FIXTURES / "zero3_fp32_w2", url)
    fs = fsspec.filesystem("memory")
    root = url[len("memory://"):]
    fs.rm_file(f"{root}/step2/zero_pp_rank_1_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(url)
    assert str(e.value) == (f"{url}/step2: ZeRO-3 model files for ranks [0]; expected 0..1 "
                            "(missing zero_pp_rank_1_mp_rank_00_model_states.pt)")
    # A rank's optimizer file gone (not the last one).
    url = _memory_url()
    upload(FIXTURES / "zero2_fp32_w2", url)
    fs.rm_file(f"{url[len('memory://'):]}/step2/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointFormatError, match="missing zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        open_source(url)
    # latest naming a tag with no objects.
    url = _memory_url()
    upload(FIXTURES / "zero2_fp32_w2", url)
    ObjectStore(url).put("latest", b"step9")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(url)
    assert str(e.value) == f"{url}/latest: names tag 'step9', but {url}/step9 is not a directory"
    # A truncated archive: named.
    url = _memory_url()
    d = tds._copy("zero2_fp32_w2", tmp_path)
    victim = d / "step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    upload(d, url)
    with pytest.raises(CheckpointFormatError, match=f"{url}/step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        load_state_dict(url)


def test_a_url_holding_only_checkpoint_folders_says_what_to_do() -> None:
    """accelerate's layout at a URL (subfolders that are checkpoints, no object of its own) is not
    read as one: the error says it holds folders, names them, and says what to open instead."""
    url = _memory_url()
    upload(FIXTURES / "zero2_fp32_w2", f"{url}/pytorch_model")
    upload(FIXTURES / "zero3_fp32_w2", f"{url}/other")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(url)
    assert "it holds only folders (other, pytorch_model): open a subfolder's URL" in str(e.value)
    assert isinstance(open_source(f"{url}/pytorch_model"), DeepSpeedSource)


def test_a_universal_folder_in_the_store_is_refused_naming_it() -> None:
    """A ds_to_universal folder is read from a local directory only: at a URL, refused saying so."""
    url = _memory_url()
    upload(FIXTURES / "zero2_fp32_w2_universal", url)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(url)
    assert str(e.value) == (
        f"{url}: a DeepSpeed Universal checkpoint is read from a local directory only; copy it "
        "to one first"
    )
