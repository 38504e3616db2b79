"""Pieces of logical tensors, held by a rank as views into its own memory.

State that is not a DTensor box (a ZeRO/FSDP1 flat buffer, a fused QKV weight, a stage-local
layer) enters a checkpoint as a :class:`TensorPieces`: :class:`Piece` records, each naming a
*logical* tensor, the box of it this rank holds and a view of the rank's memory of that box's
shape, which the planners save and load like any other chunk. Producers:
:class:`ucp_dcp.FlatShard` and :mod:`ucp_dcp.adapters.layout_spec`. See docs/layouts.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentTypeError, LayoutError
from .sharding import Box

__all__ = ["Piece", "TensorPieces"]


@dataclass(frozen=True)
class Piece:
    """Box ``offsets`` (sizes: ``data.shape``) of logical tensor ``fqn`` of global ``shape``.

    ``data`` is a view of this rank's memory. On save its values are written;
    on load the saved values are read into it.
    """

    fqn: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor):
            raise InvalidArgumentTypeError(
                f"piece of {self.fqn!r}: data must be a torch.Tensor, got "
                f"{type(self.data).__name__}"
            )
        try:
            shape = tuple(int(n) for n in self.shape)
            offsets = tuple(int(o) for o in self.offsets)
        except (TypeError, ValueError):
            raise InvalidArgumentTypeError(
                f"piece of {self.fqn!r}: shape and offsets must be sequences of ints, got "
                f"{self.shape!r} and {self.offsets!r}"[:300]
            ) from None
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "offsets", offsets)
        sizes = tuple(self.data.shape)
        if not (len(shape) == len(offsets) == len(sizes)):
            raise LayoutError(
                f"piece of {self.fqn!r}: global shape {list(shape)}, offsets {list(offsets)} and "
                "data shape "
                f"{list(sizes)} must have the same number of dimensions"
            )
        if not Box(offsets, sizes).fits(shape):
            raise LayoutError(
                f"piece of {self.fqn!r}: a box of size {list(sizes)} at offsets {list(offsets)} "
                "does not fit in "
                f"the global shape {list(shape)}"
            )

    @property
    def box(self) -> Box:
        """The box of the logical tensor this piece covers."""
        return Box(self.offsets, tuple(self.data.shape))


class TensorPieces:
    """A state-dict value that stands for pieces of one or more logical tensors.

    Put it anywhere in the state dict given to ``dcp.save``/``dcp.load``
    with :class:`~ucp_dcp.UCPSavePlanner`/:class:`~ucp_dcp.UCPLoadPlanner`;
    its key in the state dict is not stored (the pieces name their tensors).

    Args:
        pieces: the pieces; two pieces of one rank may not cover the same box.
        replicated: other ranks hold the same pieces (a TP-replicated layer
            norm). Save checks that every holder's bytes are equal, naming
            the tensor and ranks if not, and writes them once.
        fill: views of elements no logical tensor covers (alignment or
            vocabulary padding). Load sets them to ``fill_value``; save
            ignores them.
        fill_value: the value padding gets on load.
        source: what the pieces came from, for error messages.
    """

    def __init__(
        self,
        pieces: Iterable[Piece],
        *,
        replicated: bool = False,
        fill: Iterable[torch.Tensor] = (),
        fill_value: float = 0.0,
        source: str = "",
    ) -> None:
        self.pieces: tuple[Piece, ...] = tuple(pieces)
        bad = [p for p in self.pieces if not isinstance(p, Piece)]
        if bad:
            raise InvalidArgumentTypeError(
                f"TensorPieces{f' of {source}' if source else ''}: pieces must be Piece records, "
                f"got {type(bad[0]).__name__}"
            )
        self.replicated = replicated
        self.fill: tuple[torch.Tensor, ...] = tuple(fill)
        self.fill_value = fill_value
        self.source = source
        seen: dict[tuple[str, tuple[int, ...]], Piece] = {}
        meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for p in self.pieces:
            key = (p.fqn, p.offsets)
            if key in seen:
                raise LayoutError(
                    f"{self._where()}: two pieces of {p.fqn!r} start at offsets {list(p.offsets)}"
                )
            seen[key] = p
            m = meta.setdefault(p.fqn, (p.shape, p.data.dtype))
            if m != (p.shape, p.data.dtype):
                raise LayoutError(
                    f"{self._where()}: pieces of {p.fqn!r} disagree on shape/dtype: "
                    f"{list(m[0])} {m[1]} and {list(p.shape)} {p.data.dtype}"
                )

    def _where(self) -> str:
        return f"TensorPieces({self.source})" if self.source else "TensorPieces"

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the pieces hold (padding excluded)."""
        return sum(math.prod(p.data.shape) * p.data.element_size() for p in self.pieces)

    def fqns(self) -> list[str]:
        """The logical tensors the pieces belong to, in first-seen order."""
        return list(dict.fromkeys(p.fqn for p in self.pieces))

    def __repr__(self) -> str:
        names = self.fqns()
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        return f"{self._where()}[{len(self.pieces)} piece(s) of {shown}]"
