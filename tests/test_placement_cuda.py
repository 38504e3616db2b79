"""Placement digests of device tensors (``pytest -m cuda``; skipped without CUDA).

A box's share computed from a CUDA tensor (bf16, non-contiguous, an offset box) equals the
share of its CPU copy; a save from CUDA tensors records the same digests as a save of their
CPU copies, and a load into CUDA tensors with ``verify_placement`` passes, bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal

from ucp_dcp import (
    ReadOptions,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    load_index,
)
from ucp_dcp.core.placement_digest import box_share

pytestmark = pytest.mark.cuda


def _bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def test_box_share_of_a_cuda_tensor_equals_its_cpu_copy() -> None:
    cpu = _bits((70, 48), torch.bfloat16, 0)
    dev = cpu.t().contiguous().cuda().t()  # same values, column-major on the device
    assert not dev.is_contiguous()
    assert box_share(dev, (10, 0), (100, 48)) == box_share(cpu, (10, 0), (100, 48))
    sub = dev[5:20, 8:40]
    assert box_share(sub, (15, 8), (100, 48)) == box_share(cpu[5:20, 8:40].clone(), (15, 8), (100, 48))


def test_save_from_cuda_and_verified_load_into_cuda(tmp_path: Path) -> None:
    ref = {"w": _bits((129, 65), torch.float32, 1), "h": _bits((300,), torch.float16, 2)}
    for name, state in (("cpu", ref), ("cuda", {k: v.cuda() for k, v in ref.items()})):
        dcp.save(dict(state), storage_writer=UCPStorageWriter(str(tmp_path / name), placement_digests=True),
                 planner=UCPSavePlanner(), no_dist=True)
    digests = {name: {k: r.digest for k, r in load_index(str(tmp_path / name)).tensors.items()}
               for name in ("cpu", "cuda")}
    assert digests["cuda"] == digests["cpu"] and all(digests["cuda"].values())
    target = {k: torch.zeros_like(v, device="cuda") for k, v in ref.items()}
    reader = UCPStorageReader(str(tmp_path / "cuda"), options=ReadOptions(verify_placement=True))
    dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
    for k, v in ref.items():
        assert target[k].is_cuda and bit_equal(target[k], v), k
