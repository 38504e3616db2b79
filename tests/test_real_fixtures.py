"""Checkpoints written by Megatron-core and accelerate themselves read bit-exactly.

The fixtures under tests/fixtures/megatron/ and tests/fixtures/accelerate/ are
written by those frameworks (``megatron.core.dist_checkpointing.save`` with the
``torch_dist`` strategy; accelerate's ``save_fsdp_model`` and
``save_fsdp_optimizer`` with ``SHARDED_STATE_DICT``), by the ``generate.py``
beside each, which also writes ``*_reference.safetensors``: every tensor key
with the full value the framework held, gathered from the live ranks (not
read back from the checkpoint). No megatron or accelerate import here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ucp_dcp import Checkpoint, UCPLoadPlanner, UCPStorageReader
from ucp_dcp.sources.distcp import read_dcp_metadata

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    # The tests load tensors only; the pickled values (Megatron's _extra_state,
    # the optimizer's param groups) stay behind.
    pytest.mark.filterwarnings(r"ignore:\d+ checkpoint key\(s\) not in the state dict:UserWarning"),
]

FIXTURES = Path(__file__).parent / "fixtures"
# name -> (checkpoint directory, format Checkpoint reports)
REAL = {
    "megatron": (FIXTURES / "megatron" / "gpt_tp2", "dcp"),
    "accelerate": (FIXTURES / "accelerate" / "fsdp2_w2", "subfolders"),
}


def reference(name: str) -> dict[str, torch.Tensor]:
    path, _ = REAL[name]
    refs = load_file(str(path.parent / f"{path.name}_reference.safetensors"))
    doc = json.loads((path.parent / f"{path.name}_reference.json").read_text())
    assert sorted(refs) == doc["keys"]
    return refs


@pytest.mark.parametrize("name", sorted(REAL))
def test_every_tensor_reads_bit_exact(name: str) -> None:
    """Checkpoint finds every key the framework wrote and reads each one bit-exactly."""
    path, fmt = REAL[name]
    refs = reference(name)
    with Checkpoint(path) as ck:
        assert ck.format == fmt
        assert sorted(ck.tensor_names()) == sorted(refs)
        for key, want in refs.items():
            rec = ck.tensor_record(key)
            assert (tuple(rec.shape), rec.dtype) == (tuple(want.shape), want.dtype), key
            assert bit_equal(ck.read_tensor(key), want), key


@pytest.mark.parametrize("name", sorted(REAL))
def test_dcp_load_in_one_process(name: str) -> None:
    """dcp.load through UCPStorageReader fills whole tensors bit-exactly."""
    path, _ = REAL[name]
    refs = reference(name)
    sd: dict[str, Any] = {k: torch.full_like(v, 7) for k, v in refs.items()}
    dcp.load(sd, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
    for key, want in refs.items():
        assert bit_equal(sd[key], want), key


def test_megatron_metadata_carries_every_ranks_plan() -> None:
    """The torch_dist .metadata carries all_local_plans, one SavePlan per saving rank."""
    path, _ = REAL["megatron"]
    doc = json.loads((path.parent / f"{path.name}_reference.json").read_text())
    md = read_dcp_metadata(path)
    plans = md.all_local_plans
    assert len(plans) == doc["world_size"] and all(type(p).__name__ == "SavePlan" for p in plans)
    assert json.loads((path / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


def test_accelerate_values_load_weights_only() -> None:
    """The optimizer's param groups (pickled values) read with dcp_values='weights_only'."""
    path, _ = REAL["accelerate"]
    with Checkpoint(path, dcp_values="weights_only") as ck:
        assert ck.read_value("optimizer.param_groups.0.lr") == 1e-2
        assert ck.read_value("optimizer.param_groups.0.params") == [
            "0.weight",
            "0.bias",
            "2.weight",
            "2.bias",
            "3.weight",
            "3.bias",
        ]


def _load_3(rank: int, world: int) -> None:
    """Each fixture into 3-rank DTensors, a layout neither framework saved with:
    dim 0 sharded where it exists (uneven), 0-d tensors replicated."""
    mesh = init_device_mesh("cpu", (world,))
    for name in sorted(REAL):
        path, _ = REAL[name]
        refs = reference(name)
        sd: dict[str, Any] = {
            k: distribute_tensor(
                torch.full_like(v, 7), mesh, [Shard(0) if v.dim() else Replicate()]
            )
            for k, v in refs.items()
        }
        dcp.load(sd, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
        for key, want in refs.items():
            assert isinstance(sd[key], DTensor) and bit_equal(sd[key].full_tensor(), want), (
                name,
                key,
            )


@pytest.mark.multiproc
def test_dcp_load_on_3_ranks() -> None:
    run_ranks(3, _load_3)


def test_reading_them_imports_neither_framework() -> None:
    """The library reads both fixtures without importing megatron or accelerate."""
    code = (
        "import sys, ucp_dcp\n"
        f"for p in {[str(p) for p, _ in REAL.values()]!r}:\n"
        "    with ucp_dcp.Checkpoint(p) as ck:\n"
        "        [ck.read_tensor(n) for n in ck.tensor_names()]\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'accelerate')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_accelerate_folder_holding_a_deepspeed_tensor_parallel_checkpoint(tmp_path: Path) -> None:
    """accelerate's DeepSpeed saves put the engine's checkpoint in a subfolder beside others.

    Here the subfolder is a Megatron-DeepSpeed tensor-parallel checkpoint, whose merged tensors
    are a file computed at load time, beside accelerate's FSDP model and optimizer folders: each
    child reads its bytes its own way (the merge included), and every tensor is bit-exact."""
    mds = FIXTURES / "deepspeed" / "megatron_ds" / "llama_tp2_dp2"
    acc, _ = REAL["accelerate"]
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        (tmp_path / sub).symlink_to(acc / sub)
    (tmp_path / "pytorch_model").symlink_to(mds)
    with Checkpoint(mds) as ck:
        want = {**reference("accelerate"), **{k: ck.read_tensor(k) for k in ck.tensor_names()}}
    with Checkpoint(tmp_path) as ck:
        assert ck.format == "subfolders"
        assert sorted(ck.tensor_names()) == sorted(want)
        for key, v in want.items():
            assert bit_equal(ck.read_tensor(key), v), key
    # dcp.load in one process: one joined reader over all three children's files.
    sd: dict[str, Any] = {k: torch.full_like(v, 7) for k, v in want.items()}
    reader = UCPStorageReader(tmp_path)
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    for key, v in want.items():
        assert bit_equal(sd[key], v), key
    assert reader.last_load.stats.bytes >= sum(v.nbytes for v in reference("accelerate").values())
