"""A long-lived process stays flat: threads, descriptors and memory over hundreds of calls.

One load per process hides a leak. Here one process runs 200 cycles of everything a training job
or a checkpoint service calls: a manager save, wait and load; ``dcp.save`` and ``dcp.load`` with
the UCP classes; ``load_state_dict``; ``Checkpoint(path).verify()`` without ``close()`` (as the
docs write it); the command line's ``verify`` and ``inspect`` in-process. After the first cycle
(imports, caches, the manager's own threads) the thread count and open descriptors must not move,
and resident memory may grow by less than 64 MiB.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import threading
from pathlib import Path

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


def _cycle(step: int, mgr: CheckpointManager, plain: Path) -> None:
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


def test_two_hundred_cycles_leave_threads_descriptors_and_memory_flat(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    with CheckpointManager(str(tmp_path / "managed"), keep_last=2) as mgr:
        _cycle(1, mgr, plain)
        gc.collect()
        threads, fds, rss = threading.active_count(), _fds(), _rss_mib()
        for step in range(2, CYCLES + 1):
            _cycle(step, mgr, plain)
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
