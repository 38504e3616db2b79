"""Flat-range shards: a rank's slice of a flat buffer of several parameters.

ZeRO, FSDP1's ``FlatParameter`` and Megatron's distributed optimizer give each rank a
contiguous range of a buffer of many flattened parameters, which can start and end inside a
row. DCP has no way to describe that; :class:`FlatShard` does (docs/layouts.md, "Flat
shards")::

    params, total = pack_flat([("layer.w", (512, 300)), ("layer.b", (512,))], align=64)
    start, stop = flat_partition(total, world_size, rank)
    local = buffer[start:stop]                   # this rank's slice (any 1-D tensor)
    state = {"model": {"flat": FlatShard(local, params, start, prefix="model.")}}
    dcp.save(state, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.pieces import Piece, TensorPieces
from ..core.sharding import flat_range_boxes
from ..errors import InvalidArgumentError, InvalidArgumentTypeError, LayoutError
from ..format.schema import is_int

__all__ = ["FlatParam", "FlatShard", "pack_flat", "flat_partition"]


@dataclass(frozen=True)
class FlatParam:
    """Logical tensor ``fqn`` of ``shape``, stored row-major at element ``offset`` of a flat
    buffer."""

    fqn: str
    shape: tuple[int, ...]
    offset: int

    def __post_init__(self) -> None:
        shape, offset = self.shape, self.offset
        if (
            not isinstance(shape, (tuple, list, torch.Size))
            or not all(is_int(n) for n in shape)
            or not is_int(offset)
        ):
            raise InvalidArgumentError(
                f"flat parameter {self.fqn!r}: shape must be a tuple of ints and offset an int, "
                f"got {shape!r} and {offset!r}"
            )
        object.__setattr__(self, "shape", tuple(shape))
        if self.offset < 0 or any(n < 0 for n in self.shape):
            raise InvalidArgumentError(
                f"flat parameter {self.fqn!r}: negative offset {self.offset} or shape "
                f"{list(self.shape)}"
            )

    @property
    def numel(self) -> int:
        """Number of elements of the parameter."""
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        """Buffer element just past the parameter."""
        return self.offset + self.numel


def pack_flat(
    named_shapes: Sequence[tuple[str, Sequence[int]]], align: int = 1
) -> tuple[list[FlatParam], int]:
    """Lay parameters out back to back, each starting on a multiple of ``align`` elements.

    Returns the parameters and the buffer length (rounded up to ``align``).
    This is how ZeRO and FSDP1 (``use_orig_params=True``) pad; any other
    packing works with :class:`FlatShard` as long as it is described by
    :class:`FlatParam` offsets.
    """
    if align < 1:
        raise InvalidArgumentError(f"align must be >= 1, got {align}")
    out, pos = [], 0
    for fqn, shape in named_shapes:
        # A shape that is not a sequence (a bare int) is left for FlatParam to name.
        dims: Any = tuple(shape) if isinstance(shape, (tuple, list)) else shape
        p = FlatParam(fqn, dims, pos)
        out.append(p)
        pos = -(-p.end // align) * align
    return out, pos


def flat_partition(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """ZeRO-style partition: rank ``rank``'s ``[start, stop)`` of a buffer of ``total`` elements.

    Every rank gets ``ceil(total / world_size)`` elements; the last ranks'
    ranges may run past ``total`` (into the padding the buffer is extended
    with) or be empty.
    """
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} is outside world size {world_size}")
    per = -(-total // world_size)
    return rank * per, (rank + 1) * per


class FlatShard(TensorPieces):
    """This rank's slice ``[start, start + local.numel())`` of a flat buffer holding ``params``.

    Args:
        local: the rank's slice, a contiguous tensor (viewed as 1-D). Loads
            write into it in place.
        params: the parameters the whole buffer holds, with their offsets.
            Only those overlapping the slice matter; elements of the slice
            that no parameter covers are padding (not saved; zeroed on load).
        start: buffer element at which ``local`` begins.
        prefix: prepended to every parameter name (``"model."``,
            ``"optim.state."``): the logical name in the checkpoint.
        suffix: appended to every parameter name (``".exp_avg"``).

    Parameters must not overlap one another in the buffer.
    """

    def __init__(
        self,
        local: torch.Tensor,
        params: Sequence[FlatParam],
        start: int,
        *,
        prefix: str = "",
        suffix: str = "",
    ) -> None:
        if not isinstance(local, torch.Tensor):
            raise InvalidArgumentTypeError(
                f"FlatShard: local must be a torch.Tensor, got {type(local).__name__}"
            )
        if not is_int(start) or start < 0:
            raise InvalidArgumentError(
                f"FlatShard: start must be a buffer offset (an int >= 0), got {start!r}"
            )
        bad = [p for p in params if not isinstance(p, FlatParam)]
        if bad:
            raise InvalidArgumentTypeError(
                f"FlatShard at buffer offset {start}: params must be FlatParams, got "
                f"{type(bad[0]).__name__}"
            )
        if not local.is_contiguous():
            raise InvalidArgumentError(
                f"FlatShard at buffer offset {start}: the local slice must be contiguous"
            )
        flat = local.detach().reshape(-1)
        stop = start + flat.numel()
        ordered = sorted(params, key=lambda p: p.offset)
        for a, b in zip(ordered, ordered[1:]):
            if a.end > b.offset:
                raise LayoutError(
                    f"flat parameters {a.fqn!r} [{a.offset}, {a.end}) and {b.fqn!r} [{b.offset}, "
                    f"{b.end}) overlap"
                )
        pieces, fill, pos = [], [], start
        for p in ordered:
            name = prefix + p.fqn + suffix
            if math.prod(p.shape) == 0:
                # No bytes, but a key of the model: recorded (by every rank holding a slice, alike)
                # so that a load into full tensors finds it.
                pieces.append(Piece(name, p.shape, (0,) * len(p.shape), flat[:0].view(p.shape)))
                continue
            lo, hi = max(p.offset, start), min(p.end, stop)
            if lo >= hi:
                continue
            if lo > pos:
                fill.append(flat[pos - start : lo - start])
            first = lo - start  # the boxes come in flat order, each a contiguous range of it
            for box in flat_range_boxes(p.shape, lo - p.offset, hi - p.offset):
                data = flat[first : first + box.numel].view(box.sizes)
                pieces.append(Piece(name, p.shape, box.offsets, data))
                first += box.numel
            pos = hi
        if pos < stop:
            fill.append(flat[pos - start :])
        super().__init__(pieces, fill=fill, source=f"flat buffer slice [{start}, {stop})")
        self.local = local
        self.start = start
        self.params = tuple(params)
