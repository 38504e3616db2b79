"""Rechecking a committed copy of a step against its commit marker, one line per problem."""

from __future__ import annotations

import os
import shutil
import tempfile

from ..byteio.integrity import file_digest
from ..errors import CheckpointFormatError
from ..tools.checkpoint import Checkpoint
from ._collective import NodeLayout, describe
from .tiers import Tier

__all__ = ["verify_copy"]


def verify_copy(
    tier: Tier, step: int, layout: NodeLayout, *, node_local: bool, peer: bool = True
) -> list[str]:
    """Problems of the copy of ``step`` in ``tier`` ([] = intact).

    Whole-file xxh3-128 digests against the commit marker (catches any
    flipped byte, header and padding included), then, for a damaged data
    file, every chunk checksum to name the tensors hit. A ``node_local``
    tier is expected to hold the files :meth:`NodeLayout.held_files` names (the index, this
    node's data files and, with ``peer`` replication, its partner's); others it holds are
    checked too.
    """
    where = f"step {step} in the {tier.name} tier ({tier.url})"
    try:
        marker = tier.marker(step)
    except CheckpointFormatError as e:
        return [f"{where}: {e}"]
    tmp: str | None = None
    try:
        if tier.local:
            path = tier.step_path(step)
            present = tier.files(step)
        else:
            tmp = tempfile.mkdtemp(prefix=f"ucp-verify-{step}-")
            path = tmp
            tier.fetch(step, [d.name for d in marker.files], tmp)
            present = {n: os.path.getsize(os.path.join(tmp, n)) for n in os.listdir(tmp)}
        problems: list[str] = []
        damaged = False
        held = set(layout.held_files(marker, peer=peer)) if node_local else None
        for d in marker.files:
            own = held is None or d.name in held
            who = "the index" if d.rank == -1 else f"written by rank {d.rank}"
            if d.name not in present:
                if own:
                    problems.append(f"{where}: {d.name} ({who}) is missing")
                continue
            size, digest = file_digest(os.path.join(path, d.name))
            if size != d.size or digest != d.xxh3:
                damaged = True
                problems.append(
                    f"{where}: {d.name} ({who}) is corrupt: {size} bytes with xxh3-128 {digest}, "
                    f"the commit recorded {d.size} bytes with {d.xxh3}"
                )
        if damaged and all(d.name in present for d in marker.files):
            try:
                with Checkpoint(path) as ck:
                    problems += [f"{where}: {p}" for p in ck.verify()]
            except Exception as e:  # a damaged index: the digest line above already says so
                problems.append(f"{where}: cannot check chunks: {describe(e)}")
        return problems
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
