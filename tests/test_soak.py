"""A long-lived process stays flat: threads, descriptors and memory over hundreds of calls.

One load per process hides a leak. Here one process runs 200 cycles of everything a training job
or a checkpoint service calls: a manager save, wait and load; ``dcp.save`` and ``dcp.load`` with
the UCP classes; ``load_state_dict``; ``Checkpoint(path).verify()`` without ``close()`` (as the
docs write it); the command line's ``verify`` and ``inspect`` in-process; and two checkpoints
real frameworks wrote, loaded with ``dcp.load``: Megatron-core's (DCP's format) and an accelerate
folder holding a Megatron-DeepSpeed tensor-parallel checkpoint (three children read at once, one
with tensors merged at load). After the first cycle
(imports, caches, the manager's own threads) the thread count and open descriptors must not move,
and resident memory may grow by less than 64 MiB. On four real ranks, 100 managers made and
closed one after another leave no process group, thread or socket behind.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ucp_dcp import (
    Checkpoint,
    CheckpointManager,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    load_state_dict,
)
from ucp_dcp.tools.cli import main as cli

CYCLES = 200


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)},
        "step": step,
    }


FIXTURES = Path(__file__).parent / "fixtures"


def _framework_checkpoints(tmp_path: Path) -> list[tuple[Path, dict[str, torch.Tensor]]]:
    """Megatron-core's tp2 checkpoint, and accelerate's FSDP2 folders beside a Megatron-DeepSpeed
    TP2 checkpoint under one parent (``test_real_fixtures``), each with a state dict of every
    tensor, as the framework saved it."""
    both = tmp_path / "accelerate_with_megatron_ds"
    both.mkdir()
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        (both / sub).symlink_to(FIXTURES / "accelerate" / "fsdp2_w2" / sub)
    (both / "pytorch_model").symlink_to(FIXTURES / "deepspeed" / "megatron_ds" / "llama_tp2_dp2")
    out = []
    for path in (FIXTURES / "megatron" / "gpt_tp2", both):
        with Checkpoint(path) as ck:
            out.append((path, {k: ck.read_tensor(k) for k in ck.tensor_names()}))
    return out


def _cycle(
    step: int, mgr: CheckpointManager, plain: Path, real: list[tuple[Path, dict[str, torch.Tensor]]]
) -> None:
    state = _state(step)
    mgr.save(step, state)
    mgr.wait()
    into = _state(-1)
    assert mgr.load(into) == step
    assert torch.equal(into["model"]["w"], state["model"]["w"])  # type: ignore[index]
    dcp.save(state, storage_writer=UCPStorageWriter(plain), planner=UCPSavePlanner(), no_dist=True)
    dcp.load(into, storage_reader=UCPStorageReader(plain), planner=UCPLoadPlanner(), no_dist=True)
    assert torch.equal(load_state_dict(plain, "model.w")["model.w"], state["model"]["w"])  # type: ignore[index]
    assert Checkpoint(plain).verify() == []  # never closed: collected
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli(["verify", str(plain)]) == 0
        assert cli(["inspect", str(plain)]) == 0
    for path, want in real:
        got = {k: torch.empty_like(v) for k, v in want.items()}
        dcp.load(got, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(), no_dist=True)
        assert all(torch.equal(got[k], v) for k, v in want.items()), path


# The framework checkpoints are loaded tensors only; their pickled values (Megatron's
# _extra_state, the optimizer's param groups) stay behind.
@pytest.mark.filterwarnings(r"ignore:\d+ checkpoint key\(s\) not in the state dict:UserWarning")
def test_two_hundred_cycles_leave_threads_descriptors_and_memory_flat(tmp_path: Path) -> None:
    plain, real = tmp_path / "plain", _framework_checkpoints(tmp_path)
    with CheckpointManager(str(tmp_path / "managed"), keep_last=2) as mgr:
        _cycle(1, mgr, plain, real)
        gc.collect()
        threads, fds, rss = threading.active_count(), _fds(), _rss_mib()
        for step in range(2, CYCLES + 1):
            _cycle(step, mgr, plain, real)
        gc.collect()
        assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]
        assert _fds() <= fds, sorted(os.listdir("/proc/self/fd"))
        assert _rss_mib() - rss < 64, (rss, _rss_mib())


def test_an_open_reader_holds_no_idle_io_thread(tmp_path: Path) -> None:
    """I/O threads stop after IDLE_S without a read and start again with the next one."""
    import time

    from ucp_dcp.byteio.workers import IDLE_S

    plain = tmp_path / "plain"
    state = _state(1)
    dcp.save(state, storage_writer=UCPStorageWriter(plain), planner=UCPSavePlanner(), no_dist=True)

    def readers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("ucp-read")]

    with Checkpoint(plain) as ck:
        assert torch.equal(ck.read_tensor("model.w"), state["model"]["w"])  # type: ignore[index]
        deadline = time.monotonic() + IDLE_S + 5
        while readers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert readers() == []
        assert torch.equal(ck.read_tensor("model.b"), state["model"]["b"])  # type: ignore[index]


MANAGERS = 100


def _managers_one_after_another(rank: int, world: int, base: str) -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    def counts() -> tuple[int, int, int]:
        # OS threads (gloo's are not Python threads), descriptors (its sockets), live groups.
        return len(os.listdir("/proc/self/task")), _fds(), len(_world.pg_map)

    before = None
    for i in range(1, MANAGERS + 1):
        state = _state(i)
        with CheckpointManager(base, local=f"{base}-local/n{rank}", keep_last=2) as mgr:
            mgr.save(i, state)
            mgr.wait()
            if i % 10 == 0:  # a restart's load too, now and then (the restorer's group)
                into = _state(-1)
                assert mgr.load(into) == i
                assert torch.equal(into["model"]["w"], state["model"]["w"])  # type: ignore[index]
        if i == 1:
            gc.collect()
            before = counts()
    gc.collect()
    assert counts() == before, (before, counts())  # threads, descriptors, groups
    assert len(_world.pg_map) == 1, "the manager's process groups outlived it"
    dist.barrier()


@pytest.mark.multiproc
def test_a_hundred_managers_in_one_process_leave_no_group_thread_or_socket(tmp_path: Path) -> None:
    """A process that makes manager after manager (an elastic loop, a service): each one's two
    gloo groups (threads, a socket to every rank) go with it. Four ranks, four nodes."""
    from dist_utils import run_ranks

    run_ranks(4, _managers_one_after_another, str(tmp_path / "ckpt"))
