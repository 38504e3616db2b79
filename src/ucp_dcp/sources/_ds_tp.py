"""Where each tensor-parallel slice of a DeepSpeed parameter lies in the full one (rules only).

A Megatron-DeepSpeed checkpoint with tensor parallelism ``T`` holds, per
model-parallel rank, *slices*: each parameter is cut evenly along one
dimension (column-parallel: 0, row-parallel: 1), or replicated, and the
vocabulary-parallel embedding has padding rows at the end. Which is which is
not in the tensors; the checkpoint says it in ``universal_checkpoint_info``
(the patterns ``ds_to_universal`` reads, matched with :func:`re.match` against
the engine module's names):

* ``tp_replicated_parameter_patterns``: every rank holds the whole parameter
  (read from rank 0);
* ``parameter_with_row_parallelism_patterns``: joined along dimension 1;
* ``vocabulary_parameter_patterns``: joined along 0, then cut to
  ``original_vocab_size`` rows;
* ``parameter_to_average_patterns``: the mean of the slices, which is no byte
  range and is refused;
* anything else: joined along dimension 0.

:func:`tp_rules` reads those patterns; :meth:`TPRules.slice_of` places one
rank's slice (:class:`TPSlice`), whose :meth:`TPSlice.place` maps a box of the
slice to the box of the full tensor it fills.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..core.sharding import Box
from ..errors import CheckpointFormatError

__all__ = ["TPRules", "TPSlice", "tp_rules"]

_INFO = "universal_checkpoint_info"
_REPLICATED = "tp_replicated_parameter_patterns"
_ROW = "parameter_with_row_parallelism_patterns"
_VOCAB = "vocabulary_parameter_patterns"
_AVERAGE = "parameter_to_average_patterns"
# Layouts this reader does not place (fused sub-parameters, affine maps): refused by name.
_UNSUPPORTED = (
    "parameters_with_2_sub_params_cat_dim_0",
    "parameter_with_sub_params",
    "sub_param_shape",
    "affine_params",
)


@dataclass(frozen=True)
class TPSlice:
    """Tensor-parallel rank ``rank``'s slice (of shape ``local``) of a parameter: joined along
    ``dim`` (None: replicated), the full tensor cut to ``rows`` rows of dimension 0 (vocabulary
    padding stripped; None: not cut)."""

    rank: int
    local: tuple[int, ...]
    dim: int | None
    degree: int
    rows: int | None = None

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the joined parameter."""
        shape = list(self.local)
        if self.dim is not None:
            shape[self.dim] *= self.degree
        if self.rows is not None:
            shape[0] = self.rows
        return tuple(shape)

    def place(self, box: Box) -> Box | None:
        """The box of the full tensor that ``box`` (of the slice) fills, or None when it lies in
        the stripped padding. A cut box keeps the first elements of the slice's box (dimension
        0 is its outermost), so its bytes are a prefix of the same run."""
        offsets = list(box.offsets)
        sizes = list(box.sizes)
        if self.dim is not None:
            offsets[self.dim] += self.rank * self.local[self.dim]
        if self.rows is not None:
            sizes[0] = min(sizes[0], self.rows - offsets[0])
            if sizes[0] <= 0:
                return None
        return Box(tuple(offsets), tuple(sizes))


@dataclass(frozen=True)
class TPRules:
    """The partitioning patterns of one checkpoint (from ``where``)."""

    where: str
    replicated: tuple[str, ...]
    row: tuple[str, ...]
    vocab: tuple[str, ...]
    average: tuple[str, ...]
    vocab_rows: int | None

    def slice_of(self, name: str, rank: int, degree: int, local: tuple[int, ...]) -> TPSlice:
        """Where ``rank``'s slice (shape ``local``) of parameter ``name`` goes."""
        if any(re.match(p, name) for p in self.average):
            raise CheckpointFormatError(
                f"{self.where}: {name!r} matches parameter_to_average_patterns: its value is the "
                "mean of the tensor-parallel slices, which cannot be read in place"
            )
        if any(re.match(p, name) for p in self.replicated):
            return TPSlice(rank, local, None, degree)
        dim = 1 if any(re.match(p, name) for p in self.row) else 0
        if dim >= len(local):
            raise CheckpointFormatError(
                f"{self.where}: {name!r} of shape {local} cannot be joined along dimension {dim}"
            )
        rows = None
        if any(re.match(p, name) for p in self.vocab):
            if self.vocab_rows is None:
                raise CheckpointFormatError(
                    f"{self.where}: {name!r} matches vocabulary_parameter_patterns but "
                    f"{_INFO} has no original_vocab_size"
                )
            rows = self.vocab_rows
        return TPSlice(rank, local, dim, degree, rows)


def _patterns(info: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    v = info.get(key) or []
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise CheckpointFormatError(f"{where}: {_INFO}[{key!r}] is not a list of patterns")
    for p in v:
        try:
            re.compile(p)
        except re.error as e:
            raise CheckpointFormatError(f"{where}: {_INFO}[{key!r}]: {p!r}: {e}") from None
    return tuple(v)


def tp_rules(info: Any, where: str, params: list[str]) -> TPRules:
    """The rules of ``info`` (a model states file's ``universal_checkpoint_info``, read from
    ``where``), for a checkpoint whose split parameters are ``params``.

    Without ``info`` (or without any tensor-parallel pattern) nothing says how
    ``params`` are split: refused, naming them and the missing patterns.
    """
    if not isinstance(info, dict) or not any(
        info.get(k) for k in (_REPLICATED, _ROW, _VOCAB, _AVERAGE)
    ):
        shown = ", ".join(params[:6]) + (" ..." if len(params) > 6 else "")
        missing = (
            "is missing"
            if not isinstance(info, dict)
            else f"has none of {_REPLICATED}, {_ROW}, {_VOCAB}, {_AVERAGE}"
        )
        raise CheckpointFormatError(
            f"{where}: tensor-parallel checkpoint without partitioning rules: {_INFO} {missing}, "
            f"so it is unknown which dimension each of {shown} is split along (or whether it is "
            "replicated)"
        )
    bad = [k for k in _UNSUPPORTED if info.get(k)]
    if bad:
        raise CheckpointFormatError(
            f"{where}: {_INFO} has {', '.join(bad)}: fused sub-parameter and affine layouts "
            "are not supported"
        )
    rows = info.get("original_vocab_size")
    if rows is not None and not (isinstance(rows, int) and not isinstance(rows, bool) and rows > 0):
        raise CheckpointFormatError(
            f"{where}: {_INFO}['original_vocab_size'] {rows!r} is not a positive integer"
        )
    return TPRules(
        where,
        _patterns(info, _REPLICATED, where),
        _patterns(info, _ROW, where),
        _patterns(info, _VOCAB, where),
        _patterns(info, _AVERAGE, where),
        rows,
    )
