"""Checks of a whole save, on the coordinator: what is saved once must be the same everywhere, and
whole.

* :func:`divergent_keys`: values and plain tensors, which are saved once for
  all ranks, must hash the same on every rank (or become rank-local).
* :func:`check_replicated_pieces`: pieces declared replicated must too.
* :func:`check_tiling`: the boxes saved for a tensor given as pieces must
  cover it exactly once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

from ._plan_records import SaveRankReport
from ._ranks import describe_ranks
from ._save_chunks import ChunkTable

__all__ = ["divergent_keys", "check_replicated_pieces", "check_tiling"]

K = TypeVar("K", bound=Hashable)


def _holders_by_digest(per_rank: Iterable[dict[K, str]]) -> dict[K, dict[str, list[int]]]:
    """key -> digest -> ranks that hold that digest (ranks in order)."""
    per_key: dict[K, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, digests in enumerate(per_rank):
        for key, d in digests.items():
            per_key[key][d].append(r)
    return per_key


def divergent_keys(reports: Sequence[SaveRankReport], allow_rank_local: bool) -> set[str]:
    """Keys whose value differs across ranks.

    Raises ``ValueError`` for a plain tensor that differs, and for a value
    that differs unless ``allow_rank_local`` (the caller then saves each
    rank's copy as a rank-local value).
    """
    per_key = _holders_by_digest(r.digests for r in reports)
    divergent = {fqn: groups for fqn, groups in per_key.items() if len(groups) > 1}
    tensors = {fqn for r in reports for fqn in r.layouts}
    bad_tensors = sorted(f for f in divergent if f in tensors)
    if bad_tensors or (divergent and not allow_rank_local):
        fqn = (bad_tensors or sorted(divergent))[0]
        groups = sorted(divergent[fqn].values())
        what = "plain tensor" if fqn in tensors else "non-tensor value"
        raise ValueError(
            f"{what} {fqn!r} differs across ranks (ranks {describe_ranks(groups[0])} hold one "
            "value, "
            f"ranks {describe_ranks(groups[1])} another; {len(divergent)} key(s) differ in all). "
            "Saving one copy "
            "would hand every rank the same value on load. Wrap per-rank state in "
            "ucp_dcp.RankLocal(...)"
            + (
                ", or pass UCPSavePlanner(divergent_values='rank_local')"
                if fqn not in tensors
                else ", or make it a DTensor with the placements it really has"
            )
        )
    return set(divergent)


def check_replicated_pieces(reports: Sequence[SaveRankReport]) -> None:
    """Pieces declared replicated must hold the same bytes on every rank that has them."""
    per_key = _holders_by_digest(r.piece_digests for r in reports)
    bad = sorted(k for k, groups in per_key.items() if len(groups) > 1)
    if bad:
        groups = sorted(per_key[bad[0]].values())
        fqn, offs = bad[0]
        raise ValueError(
            f"replicated tensor {fqn!r} (box at offsets {list(offs)}) differs across ranks: ranks "
            f"{describe_ranks(groups[0])} hold one value, ranks {describe_ranks(groups[1])} "
            f"another ({len(bad)} "
            "replicated piece(s) differ in all). A tensor declared replicated (Replicated layout "
            "rule, "
            "TensorPieces(replicated=True)) is saved once, so every rank that holds it must hold "
            "the same bytes: "
            "synchronise it, or declare how it is sharded"
        )


def check_tiling(reports: Sequence[SaveRankReport], table: ChunkTable) -> None:
    """Every element of a tensor saved as pieces is held by exactly one distinct box.

    DTensor chunks tile their tensor by construction; pieces come from flat
    ranges and layout rules, which can leave gaps or overlap when they are
    described wrongly. Distinct boxes whose element counts add up to the
    tensor's and that never overlap tile it; overlaps are caught by the sum
    (an overlap that exactly cancels a gap is not, a rare double fault).
    """
    fqns = {f for r in reports for f in r.pieces}
    for fqn in sorted(fqns):
        keys = table.by_tensor.get(fqn, [])
        if not keys:
            continue  # only empty pieces
        size = table.first[keys[0]].tensor_data.size
        total = math.prod(size)
        covered = sum(math.prod(table.first[k].tensor_data.chunk.sizes) for k in keys)
        if covered != total:
            how = (
                "leaving elements that no rank holds"
                if covered < total
                else "so some of them overlap"
            )
            raise ValueError(
                f"tensor {fqn!r} of shape {list(size)}: the boxes saved by all ranks hold "
                f"{covered} elements in "
                f"all, {how}; the tensor has {total}. Check the flat ranges (FlatParam offsets, "
                "each rank's start) "
                "or layout rules that describe it"
            )
