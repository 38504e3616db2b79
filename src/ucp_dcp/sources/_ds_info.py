"""``universal_checkpoint_info``, read: DeepSpeed's key names, and the entries that need more
than a list of patterns (``SubparamShape`` entries with their widths, ``affine_map``), checked.

:data:`INFO_KEYS` is the one table of the keys, as ``deepspeed.checkpoint.constants`` spells
them (the fixture generators assert it against the installed DeepSpeed); :func:`check_info_keys`
refuses any other. :mod:`._ds_tp` places the slices by what these records say.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.boxes import row_major_strides
from ..core.sharding import Box
from ..errors import CheckpointFormatError

__all__ = [
    "INFO_KEYS",
    "AffineMap",
    "AffinePiece",
    "SubParams",
    "check_info_keys",
]

# The keys of universal_checkpoint_info, as deepspeed.checkpoint.constants names them (the
# constant's name: the key). The fixture generators assert these against the installed
# DeepSpeed; nothing else in the package spells them.
INFO_KEYS: dict[str, str] = {
    "UNIVERSAL_CHECKPOINT_INFO": "universal_checkpoint_info",
    "UNIVERSAL_CHECKPOINT_VERSION_KEY": "universal_checkpoint_version",
    "ORIGINAL_VOCAB_SIZE": "original_vocab_size",
    "PADDED_VOCAB_SIZE": "padded_vocab_size",
    "TP_REPLICATED_PARAMETER_PATTERNS": "tp_replicated_parameter_patterns",
    "PARAMETER_TO_AVERAGE_PATTERNS": "parameter_to_average_patterns",
    "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS": "parameter_with_row_parallelism_patterns",
    "VOCABULARY_PARAMETER_PATTERNS": "vocabulary_parameter_patterns",
    "PIPELINE_REPLICATED_PARAMETER_PATTERNS": "pipeline_replicated_parameter_patterns",
    "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0": "parameter_with_2_sub_params_cat_dim_0",
    "PARAMETER_WITH_SUB_PARAMS": "parameter_with_sub_params",
    "SUB_PARAM_SHARD_WIDTHS": "sub_param_shard_widths",
    "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS": "autotp_unsupported_parameter_patterns",
    "AFFINE_MAP": "affine_map",
}
_K = INFO_KEYS
_INFO = _K["UNIVERSAL_CHECKPOINT_INFO"]
_VERSION = _K["UNIVERSAL_CHECKPOINT_VERSION_KEY"]
_REPLICATED = _K["TP_REPLICATED_PARAMETER_PATTERNS"]
_ROW = _K["PARAMETER_WITH_ROW_PARALLELISM_PATTERNS"]
_VOCAB = _K["VOCABULARY_PARAMETER_PATTERNS"]
_AVERAGE = _K["PARAMETER_TO_AVERAGE_PATTERNS"]
_TWO_SUB = _K["PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0"]
_SUB = _K["PARAMETER_WITH_SUB_PARAMS"]
_WIDTHS = _K["SUB_PARAM_SHARD_WIDTHS"]
_AFFINE = _K["AFFINE_MAP"]
_AUTOTP_UNSUPPORTED = _K["AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS"]
# Keys that say how slices merge: any of them makes the checkpoint's rules complete.
_RULE_KEYS = (_REPLICATED, _ROW, _VOCAB, _AVERAGE, _TWO_SUB, _SUB, _AFFINE)


# The affine map format versions ds_to_universal reads (deepspeed.checkpoint.affine).
_AFFINE_VERSIONS = (1,)


@dataclass(frozen=True)
class SubParams:
    """A ``parameter_with_sub_params`` entry (``SubparamShape``): ``patterns`` whose merged
    tensor has ``shape`` (``sizes``: each sub-parameter's size along ``dim``), each rank holding
    ``widths[s][rank]`` of sub-parameter ``s``."""

    patterns: tuple[str, ...]
    shape: tuple[int, ...]  # -1: resolved from the slices' elements
    dim: int
    sizes: tuple[int, ...]
    widths: tuple[tuple[int, ...], ...] | None  # None: an even split of each size


@dataclass(frozen=True)
class AffinePiece:
    """One piece of an ``affine_map`` entry: ``src`` (of the rank's slice) fills ``dst`` (of the
    merged tensor); ``holders``: the ranks that hold it."""

    src: Box
    dst: Box
    holders: tuple[int, ...]


@dataclass(frozen=True)
class AffineMap:
    """An ``affine_map`` entry: the merged ``shape``, per rank its slice's shape and pieces."""

    shape: tuple[int, ...]
    ranks: Mapping[int, tuple[tuple[int, ...], tuple[AffinePiece, ...]]]


def _patterns(info: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    v = info.get(key) or []
    if not isinstance(v, list):
        raise CheckpointFormatError(f"{where}: {_INFO}[{key!r}] is not a list of patterns")
    return _compiled(v, f"{where}: {_INFO}[{key!r}]")


def _compiled(patterns: Any, what: str) -> tuple[str, ...]:
    """``patterns`` (a list or tuple of regular expressions), each checked to compile."""
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise CheckpointFormatError(f"{what}: {patterns!r} are not patterns (strings)")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise CheckpointFormatError(f"{what}: {p!r}: {e}") from None
    return tuple(patterns)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _sub_params_entries(info: dict[str, Any], where: str) -> tuple[SubParams, ...]:
    """``parameter_with_sub_params`` (dicts of ``SubparamShape``'s fields, or its pickled
    record) with ``sub_param_shard_widths``, checked as ds_to_universal checks them."""
    raw = info.get(_SUB) or []
    widths_of = info.get(_WIDTHS) or {}
    version = info.get(_VERSION, 0.0)
    if not isinstance(raw, list) or not isinstance(widths_of, dict):
        raise CheckpointFormatError(
            f"{where}: {_INFO}[{_SUB!r}] is not a list or [{_WIDTHS!r}] not a dict"
        )
    out = []
    for i, s in enumerate(raw):
        what = f"{where}: {_INFO}[{_SUB!r}][{i}]"
        fields = s if isinstance(s, dict) else getattr(s, "state", None)
        if not isinstance(fields, dict) or set(fields) != {"patterns", "shape", "partition_dim"}:
            raise CheckpointFormatError(
                f"{what} is not a SubparamShape (patterns, shape, partition_dim): {s!r}"
            )
        patterns = _compiled(fields["patterns"], f"{what} patterns")
        shape, dim = fields["shape"], fields["partition_dim"]
        if not isinstance(shape, (list, tuple)) or not _is_int(dim) or not 0 <= dim < len(shape):
            raise CheckpointFormatError(
                f"{what}: shape {shape!r} with partition_dim {dim!r} is not a shape and one of "
                "its dimensions"
            )
        spec = shape[dim]
        dims = [d for i_, d in enumerate(shape) if i_ != dim]
        if not all(_is_int(d) and (d > 0 or d == -1) for d in dims):
            raise CheckpointFormatError(f"{what}: shape {shape!r} has a dimension not a size")
        if isinstance(spec, (list, tuple)):
            sizes = tuple(spec)
        elif _is_int(spec) and spec > 0 and version < 0.4:
            sizes = ()  # the number of equal sub-parameters: sized from the slices (see below)
        else:
            raise CheckpointFormatError(
                f"{what}: shape[{dim}] {spec!r} is neither the sub-parameters' sizes nor (before "
                "version 0.4) their number"
            )
        if sizes and not all(_is_int(x) and x >= 0 for x in sizes):
            raise CheckpointFormatError(f"{what}: sub-parameter sizes {list(sizes)} are not sizes")
        widths = None
        if version >= 0.4:
            w = [widths_of.get(p) for p in patterns if p in widths_of]
            if not w:
                raise CheckpointFormatError(
                    f"{what}: universal checkpoint version {version} records no {_WIDTHS!r} for "
                    f"its patterns {list(patterns)}"
                )
            if not isinstance(w[0], (list, tuple)) or not all(
                isinstance(x, (list, tuple)) and all(_is_int(y) and y >= 0 for y in x) for x in w[0]
            ):
                raise CheckpointFormatError(f"{what}: {_WIDTHS!r} {w[0]!r} is not a list of widths")
            widths = tuple(tuple(x) for x in w[0])
        merged = tuple(-1 if i_ == dim else d for i_, d in enumerate(shape))
        # Before 0.4 (a count), the sizes come from the slices: _sub_param_slice.
        out.append(SubParams(tuple(patterns), merged, dim, sizes or (-int(spec),), widths))
    return tuple(out)


def _box(at: Any, shape: tuple[int, ...], of: tuple[int, ...]) -> Box | None:
    """The box a piece of ``shape`` at ``at`` (``[offset, strides]``, ``torch.as_strided``'s) of
    a row-major tensor of shape ``of`` covers (None: not a box of it)."""
    if not isinstance(at, (list, tuple)) or len(at) != 2:
        return None
    offset, strides = at
    if not _is_int(offset) or not isinstance(strides, (list, tuple)) or len(strides) != len(of):
        return None
    rm = row_major_strides(of)
    if any(s != r for s, r, n in zip(strides, rm, shape) if n > 1) or len(shape) != len(of):
        return None
    offsets = []
    rest = offset
    for r in rm:
        offsets.append(rest // r if r else 0)
        rest = rest % r if r else rest
    return Box(tuple(offsets), shape)


def _affine_maps(info: dict[str, Any], where: str) -> tuple[tuple[str, AffineMap], ...]:
    """``affine_map``'s entries (format version 1): each piece a box of the slice and of the
    merged tensor. A scaled piece, or one that is no box of its tensors, is refused."""
    raw = info.get(_AFFINE)
    if not raw:
        return ()
    what = f"{where}: {_INFO}[{_AFFINE!r}]"
    if not isinstance(raw, dict) or set(raw) - {"version", "params"}:
        got = sorted(raw) if isinstance(raw, dict) else raw
        raise CheckpointFormatError(f"{what} has keys {got!r}; expected version and params")
    if raw.get("version", 1) not in _AFFINE_VERSIONS:
        raise CheckpointFormatError(
            f"{what}: format version {raw.get('version')!r}; this reader knows {_AFFINE_VERSIONS}"
        )
    out = []
    for pattern, entry in (raw.get("params") or {}).items():
        w = f"{what}[{pattern!r}]"
        try:
            re.compile(pattern)
            shape = tuple(int(x) for x in entry["logical_shape"])
            ranks = {}
            for r, v in entry["ranks"].items():
                sshape = tuple(int(x) for x in v["shard_shape"])
                pieces = []
                for p in v["pieces"]:
                    if set(p) - {"shape", "source", "dest", "locations", "scale"}:
                        raise CheckpointFormatError(f"{w}: a piece has keys {sorted(p)}")
                    if float(p.get("scale", 1.0)) != 1.0:
                        raise CheckpointFormatError(
                            f"{w}: a piece on rank {r} is scaled by {p['scale']}: the merged "
                            "tensor is no byte range of the slices (and DeepSpeed refuses its "
                            "optimizer moments)"
                        )
                    pshape = tuple(int(x) for x in p["shape"])
                    dst = _box(p["source"], pshape, shape)
                    src = _box(p["dest"], pshape, sshape)
                    if dst is None or src is None:
                        raise CheckpointFormatError(
                            f"{w}: a piece on rank {r} is not a box of the slice and of the "
                            f"merged tensor (strided pieces are not read in place): {p!r}"
                        )
                    pieces.append(AffinePiece(src, dst, tuple(int(x) for x in p["locations"])))
                ranks[int(r)] = (sshape, tuple(pieces))
        except CheckpointFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, re.error) as e:
            raise CheckpointFormatError(f"{w} is not an affine map entry ({e!r})") from None
        out.append((pattern, AffineMap(shape, ranks)))
    return tuple(out)


def check_info_keys(info: Any, where: str) -> None:
    """Refuse a ``universal_checkpoint_info`` holding a key this reader does not know (it could
    change how slices merge), naming it and the keys it knows."""
    if not isinstance(info, dict):
        return
    unknown = sorted(str(k) for k in info if k not in INFO_KEYS.values())
    if unknown:
        raise CheckpointFormatError(
            f"{where}: {_INFO} has key(s) {', '.join(repr(k) for k in unknown)} that this "
            f"reader does not know (it knows {', '.join(sorted(INFO_KEYS.values())[1:])}); an "
            "unread key could change how the tensor-parallel slices merge"
        )
