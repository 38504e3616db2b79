"""Where each tensor-parallel slice of a DeepSpeed parameter lies in the merged one (rules only).

A Megatron-DeepSpeed (or AutoTP) checkpoint with tensor parallelism ``T`` holds, per
model-parallel rank, *slices* of each parameter. Its ``universal_checkpoint_info`` says how
``ds_to_universal``'s ``merge_tp_slices`` joins them: by the first rule whose patterns match
(:func:`re.match`-ed against the engine module's names), then a cut of a padded vocabulary. The
rules, in that order, are the table in docs/deepspeed-format.md ("The merge rules of
``ds_to_universal``, read in place"). Every rule but the mean (:mod:`._ds_merge`) is a
re-ordering: :class:`TPSlice` lists the pieces of one slice as pairs of boxes (of the slice, of
the merged tensor), so a rank of any new layout reads exactly the bytes of the pieces it needs.

:data:`INFO_KEYS` is the one table of the checkpoint's keys. A key this reader does not know is
refused, naming it (:func:`check_info_keys`): a key it ignored could change the merge (as
``parameter_with_2_sub_params_cat_dim_0`` once went unseen). The entries that need more than a
list of patterns (``SubparamShape`` entries with their widths, ``affine_map``) are read into
records (:class:`SubParams`, :class:`AffineMap`) and checked.

Where the checkpoint has no such patterns, or wrong ones, the user supplies rules (``tp_rules``:
:class:`~ucp_dcp.sources.base.SourceOptions`, read by :func:`user_tp_rules`). They are read as
data (``Rule.to_json()``), so this layer imports nothing of ``adapters``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.boxes import row_major_strides
from ..core.sharding import Box, intersect
from ..errors import CheckpointFormatError, InvalidArgumentError, listed
from ..format.schema import is_int
from ._ds_merge import MergeOp

__all__ = [
    "INFO_KEYS",
    "UNEVEN_RULES",
    "AffineMap",
    "AffinePiece",
    "SubParams",
    "TPRule",
    "TPRules",
    "TPSlice",
    "check_info_keys",
    "tp_rules",
    "user_tp_rules",
]

# ------------------------------------------------------------ universal_checkpoint_info, read

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
# The keys universal_checkpoint_info may hold (all but its own name).
_KNOWN = tuple(sorted(v for v in INFO_KEYS.values() if v != _INFO))
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
        if not isinstance(shape, (list, tuple)) or not is_int(dim) or not 0 <= dim < len(shape):
            raise CheckpointFormatError(
                f"{what}: shape {shape!r} with partition_dim {dim!r} is not a shape and one of "
                "its dimensions"
            )
        spec = shape[dim]
        dims = [d for i_, d in enumerate(shape) if i_ != dim]
        if not all(is_int(d) and (d > 0 or d == -1) for d in dims):
            raise CheckpointFormatError(f"{what}: shape {shape!r} has a dimension not a size")
        if isinstance(spec, (list, tuple)):
            sizes = tuple(spec)
        elif is_int(spec) and spec > 0 and version < 0.4:
            sizes = ()  # the number of equal sub-parameters: sized from the slices (see below)
        else:
            raise CheckpointFormatError(
                f"{what}: shape[{dim}] {spec!r} is neither the sub-parameters' sizes nor (before "
                "version 0.4) their number"
            )
        if sizes and not all(is_int(x) and x >= 0 for x in sizes):
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
                isinstance(x, (list, tuple)) and all(is_int(y) and y >= 0 for y in x) for x in w[0]
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
    if not is_int(offset) or not isinstance(strides, (list, tuple)) or len(strides) != len(of):
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
    unknown = sorted(str(k) for k in info if k not in _KNOWN)
    if unknown:
        raise CheckpointFormatError(
            f"{where}: {_INFO} has key(s) {', '.join(repr(k) for k in unknown)} that this "
            f"reader does not know (it knows {', '.join(_KNOWN)}); an "
            "unread key could change how the tensor-parallel slices merge"
        )


# ------------------------------------------------------------ tensor-parallel slices

# The rules that give each rank's widths, so slices of one parameter may differ in shape.
UNEVEN_RULES = (_SUB, _AFFINE)
# User rules this reader places (the adapters.rules class names).
_USER_KINDS = ("Shard", "VocabPad", "Replicated", "Averaged", "Fused")

Pieces = tuple[tuple[Box, Box], ...]


def _shift(box: Box, dim: int, by: int) -> Box:
    offsets = list(box.offsets)
    offsets[dim] += by
    return Box(tuple(offsets), box.sizes)


def _runs(outer: Box, inner: Box) -> list[tuple[int, Box]]:
    """``inner`` (inside ``outer``) as runs contiguous in ``outer``'s row-major order: each
    with its element offset there. One run unless ``inner`` is narrower than ``outer`` in a
    dimension after one where it spans more than one index."""
    nd = len(outer.sizes)
    k = max((d for d in range(nd) if inner.sizes[d] != outer.sizes[d]), default=-1)
    strides = row_major_strides(outer.sizes)
    lead = [range(inner.offsets[d], inner.offsets[d] + inner.sizes[d]) for d in range(max(k, 0))]
    out = []
    for idx in itertools.product(*lead):
        offsets = list(idx) + list(inner.offsets[len(idx) :])
        sizes = [1] * len(idx) + list(inner.sizes[len(idx) :])
        off = sum((o - b) * s for o, b, s in zip(offsets, outer.offsets, strides))
        out.append((off, Box(tuple(offsets), tuple(sizes))))
    return out


@dataclass(frozen=True)
class TPSlice:
    """Tensor-parallel rank ``rank``'s slice (laid out as shape ``local``) of a parameter whose
    merged shape is ``full_shape``: ``pieces`` pair a box of the slice with the box of the
    merged tensor it fills (equal sizes). ``replicated``: every rank holds the whole tensor (read
    from rank 0's); ``averaged``: the merged tensor is the mean of the slices (no pieces);
    ``rule`` names what placed it; ``cat_dim`` the dimension ``ds_to_universal`` records that it
    joined along (None where it records none)."""

    rank: int
    local: tuple[int, ...]
    full_shape: tuple[int, ...]
    pieces: Pieces
    rule: str
    replicated: bool = False
    averaged: bool = False
    cat_dim: int | None = None

    @property
    def merge(self) -> MergeOp | None:
        """Whether the merged tensor is computed from every slice (:mod:`._ds_merge`): their
        ``"mean"``, or the ``"replica"`` they all are (checked equal, as ds_to_universal does:
        not for a replicated vocabulary, which is cut); None: placed by :attr:`pieces`."""
        if self.averaged:
            return "mean"
        if self.replicated and self.full_shape == self.local:
            return "replica"
        return None

    def place(self, box: Box) -> list[tuple[int, Box]]:
        """The boxes of the merged tensor that ``box`` (of the slice, contiguous in its
        row-major order) fills, each with the offset in ``box``'s elements where its run
        starts."""
        out = []
        for src, dst in self.pieces:
            part = intersect(box, src)
            if part is None:
                continue
            for off, run in _runs(box, part):
                delta = [d - s for d, s in zip(dst.offsets, src.offsets)]
                out.append((off, Box(tuple(o + x for o, x in zip(run.offsets, delta)), run.sizes)))
        return out

    @staticmethod
    def cut(local: tuple[int, ...], rows: int) -> TPSlice:
        """A tensor of shape ``local`` whose first ``rows`` rows are kept (vocabulary padding
        stripped)."""
        box = Box.whole(local)
        return _with_rows(TPSlice(0, local, local, ((box, box),), "vocabulary padding"), rows)


def _joined(
    rank: int, local: tuple[int, ...], dim: int, degree: int, rule: str, cat: int | None
) -> TPSlice:
    """Slices of equal shape ``local`` joined along ``dim``."""
    full = list(local)
    full[dim] *= degree
    box = Box.whole(local)
    return TPSlice(
        rank, local, tuple(full), ((box, _shift(box, dim, rank * local[dim])),), rule, cat_dim=cat
    )


def _sub_params(
    rank: int,
    local: tuple[int, ...],
    dim: int,
    widths: Sequence[Sequence[int]],
    rule: str,
    cat: int | None = None,
) -> TPSlice:
    """Along ``dim`` each slice holds, for every sub-parameter ``s``, ``widths[s][rank]`` of it;
    the merged tensor holds the sub-parameters one after the other, each its ranks' shares in
    rank order."""
    sizes = [sum(w) for w in widths]
    full = list(local)
    full[dim] = sum(sizes)
    pieces = []
    pos = base = 0
    for w, size in zip(widths, sizes):
        n = w[rank]
        if n:
            sizes_ = list(local)
            sizes_[dim] = n
            off = [0] * len(local)
            off[dim] = pos
            src = Box(tuple(off), tuple(sizes_))
            pieces.append((src, _shift(src, dim, base + sum(w[:rank]) - pos)))
        pos += n
        base += size
    return TPSlice(rank, local, tuple(full), tuple(pieces), rule, cat_dim=cat)


def _with_rows(sl: TPSlice, rows: int) -> TPSlice:
    """``sl`` with the merged tensor cut to its first ``rows`` rows (``param[:rows]``)."""
    full = (min(rows, sl.full_shape[0]),) + sl.full_shape[1:]
    keep = Box.whole(full)
    pieces = []
    for src, dst in sl.pieces:
        d = intersect(dst, keep)
        if d is None:
            continue
        pieces.append((Box(src.offsets, d.sizes), d))  # only dimension 0 shrinks, from the end
    return TPSlice(
        sl.rank, sl.local, full, tuple(pieces), sl.rule, sl.replicated, sl.averaged, sl.cat_dim
    )


@dataclass(frozen=True)
class TPRule:
    """One user-supplied partitioning rule: parameters whose engine name ``pattern`` is
    ``re.search``-ed in are ``kind`` (an ``adapters.rules`` class name: ``Shard`` joined along
    ``dim``, ``VocabPad`` joined along 0 and cut to ``size`` rows, ``Replicated``, ``Averaged``,
    ``Fused`` sub-parameters of global ``widths`` along ``dim``, or with ``groups`` grouped, so
    joined along ``dim``); ``text`` is the rule as the user wrote it, for messages."""

    pattern: str
    kind: str
    dim: int = 0
    size: int = 0
    text: str = ""
    widths: tuple[int, ...] = ()
    groups: int | None = None

    def slice_of(
        self, where: str, name: str, rank: int, degree: int, local: tuple[int, ...]
    ) -> TPSlice:
        """Where ``rank``'s slice (shape ``local``) of ``name`` goes by this rule."""
        rule = f"tp_rules' {self.text}"
        box = Box.whole(local)
        if self.kind == "Averaged":
            return TPSlice(rank, local, local, (), rule, averaged=True)
        if self.kind == "Replicated":
            return TPSlice(rank, local, local, ((box, box),), rule, replicated=True)
        if not 0 <= self.dim < len(local):
            raise CheckpointFormatError(
                f"{where}: {name!r} of shape {local} cannot be joined along dimension "
                f"{self.dim} ({rule})"
            )
        if self.kind == "Shard" or (self.kind == "Fused" and self.groups is not None):
            return _joined(rank, local, self.dim, degree, rule, self.dim)
        if self.kind == "Fused":
            bad = [w for w in self.widths if w % degree]
            if bad:
                raise CheckpointFormatError(
                    f"{where}: {name!r}: {rule} has parts of widths {bad}, which do not split "
                    f"evenly over {degree} tensor-parallel ranks"
                )
            if sum(self.widths) != local[self.dim] * degree:
                raise CheckpointFormatError(
                    f"{where}: {name!r}: {rule} has parts of widths {list(self.widths)} adding "
                    f"up to {sum(self.widths)}, but its {degree} slices of {local[self.dim]} "
                    f"along dimension {self.dim} join to {local[self.dim] * degree}"
                )
            widths = [[w // degree] * degree for w in self.widths]
            return _sub_params(rank, local, self.dim, widths, rule)
        joined = local[0] * degree
        if self.size > joined:
            raise CheckpointFormatError(
                f"{where}: {name!r}: {rule} keeps {self.size} rows, but its "
                f"{degree} slices of {local[0]} rows join to {joined}"
            )
        return _with_rows(_joined(rank, local, 0, degree, rule, 0), self.size)


def _rule_text(d: dict[str, Any]) -> str:
    """A rule's JSON dict written as the rule (``Shard('x', dim=1)``), for messages."""
    args = [repr(d.get("pattern"))] + [
        f"{k}={v!r}"
        for k, v in d.items()
        if k not in ("rule", "pattern", "optional", "axis", "fill_value") and v not in (None, 0)
    ]
    return f"{d.get('rule')}({', '.join(args)})"


def user_tp_rules(rules: Any) -> tuple[TPRule, ...]:
    """The partitioning rules a user gives a DeepSpeed source: None, a ``LayoutSpec`` (its
    ``rules``), or a sequence of layout rules (``Shard``, ``VocabPad``, ``Replicated``,
    ``Averaged``, ``Fused``) or of their JSON dicts (``Rule.to_json()``). Anything else, and a
    ``VocabPad`` along a dimension other than 0, is refused naming the rule."""
    if rules is None:
        return ()
    if not isinstance(rules, (list, tuple)) and hasattr(rules, "rules"):
        rules = rules.rules  # a LayoutSpec: its axes describe a rank of the new layout, not this
    if isinstance(rules, (str, bytes, dict)) or not hasattr(rules, "__iter__"):
        raise InvalidArgumentError(
            f"tp_rules: expected a LayoutSpec or a list of layout rules ({', '.join(_USER_KINDS)})"
            f", got {type(rules).__name__}"
        )
    out = []
    for r in rules:
        d = r.to_json() if hasattr(r, "to_json") else r
        if not isinstance(d, dict) or not isinstance(d.get("pattern"), str):
            raise InvalidArgumentError(
                f"tp_rules: {r!r} is not a layout rule ({', '.join(_USER_KINDS)}) or its JSON"
            )
        text = r.describe() if hasattr(r, "describe") else _rule_text(d)
        if d.get("rule") not in _USER_KINDS:
            raise InvalidArgumentError(
                f"tp_rules: {text} is not a tensor-parallel partitioning rule: expected one of "
                f"{', '.join(_USER_KINDS)}"
            )
        try:
            re.compile(d["pattern"])
        except re.error as e:
            raise InvalidArgumentError(f"tp_rules: {text}: {e}") from None
        dim, size, groups = d.get("dim", 0), d.get("size", 0), d.get("groups")
        if not (is_int(dim) and is_int(size)):
            raise InvalidArgumentError(f"tp_rules: {text}: dim and size must be integers")
        if d["rule"] == "VocabPad" and (dim != 0 or size <= 0):
            raise InvalidArgumentError(
                f"tp_rules: {text}: vocabulary padding is cut along dimension 0 only, to a "
                "positive size"
            )
        widths: tuple[int, ...] = ()
        if d["rule"] == "Fused":
            parts = d.get("parts")
            try:
                widths = tuple(int(w) for _, w in parts)  # type: ignore[union-attr]
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"tp_rules: {text}: parts must be [name, width] pairs"
                ) from None
            if not widths or any(w <= 0 for w in widths):
                raise InvalidArgumentError(f"tp_rules: {text}: parts need positive widths")
            if groups is not None and (not isinstance(groups, int) or groups < 1):
                raise InvalidArgumentError(f"tp_rules: {text}: groups must be a positive integer")
        out.append(TPRule(d["pattern"], d["rule"], dim, size, text, widths, groups))
    return tuple(out)


@dataclass(frozen=True)
class TPRules:
    """The partitioning rules of one checkpoint (from ``where``), after the user's rules.

    ``missing`` says why the checkpoint's own patterns are absent (None: it has them); a
    parameter no rule places is then refused.
    """

    where: str
    replicated: tuple[str, ...]
    row: tuple[str, ...]
    vocab: tuple[str, ...]
    average: tuple[str, ...]
    vocab_rows: int | None
    user: tuple[TPRule, ...] = ()
    missing: str | None = None
    unsupported: tuple[tuple[str, str], ...] = ()  # AutoTP's (pattern, reason)
    two_sub: tuple[str, ...] = ()
    sub: tuple[SubParams, ...] = ()
    affine: tuple[tuple[str, AffineMap], ...] = ()

    def user_rule(self, name: str) -> TPRule | None:
        """The first user rule matching ``name``, if any."""
        return next((r for r in self.user if re.search(r.pattern, name)), None)

    def check_supported(self, names: list[str]) -> None:
        """Refuse those of ``names`` (not placed by a user rule) that AutoTP said it could not
        describe, naming them and its reasons."""
        bad = []
        for n in names:
            reason = next((r for p, r in self.unsupported if re.match(p, n)), None)
            if reason is not None and self.user_rule(n) is None:
                bad.append(f"{n} ({reason})")
        if bad:
            raise CheckpointFormatError(
                f"{self.where}: {_INFO}[{_AUTOTP_UNSUPPORTED!r}] says AutoTP cannot describe the "
                f"split of {', '.join(bad)}: give tp_rules for them"
            )

    def unused(self, names: list[str]) -> list[str]:
        """The user rules (as written) that match none of ``names``."""
        return [r.text for r in self.user if not any(re.search(r.pattern, n) for n in names)]

    def slice_of(
        self,
        name: str,
        rank: int,
        degree: int,
        local: tuple[int, ...],
        total: int | None = None,
    ) -> TPSlice:
        """Where ``rank``'s slice (shape ``local``) of parameter ``name`` goes (``total``: the
        elements of all its slices, where they may differ, for sub-parameter shapes)."""
        rule = self.user_rule(name)
        if rule is not None:
            return rule.slice_of(self.where, name, rank, degree, local)
        if self.missing is not None:
            raise _unknown_split(self.where, self.missing, [name], bool(self.user))
        self.check_supported([name])
        sl = self._merge(name, rank, degree, local, total)
        if _match(self.vocab, name):
            if self.vocab_rows is None:
                raise CheckpointFormatError(
                    f"{self.where}: {name!r} matches {_VOCAB} but {_INFO} has no "
                    f"{_K['ORIGINAL_VOCAB_SIZE']}"
                )
            sl = _with_rows(sl, self.vocab_rows)
        return sl

    def _merge(
        self, name: str, rank: int, degree: int, local: tuple[int, ...], total: int | None
    ) -> TPSlice:
        """ds_to_universal's merge of ``name``, before the vocabulary cut (its branch order)."""
        box = Box.whole(local)
        amap = next((m for p, m in self.affine if re.match(p, name)), None)
        if amap is not None:
            return _affine_slice(self.where, name, amap, rank, local)
        if _match(self.replicated, name):
            return TPSlice(rank, local, local, ((box, box),), _REPLICATED, replicated=True)
        if _match(self.average, name):
            return TPSlice(rank, local, local, (), _AVERAGE, averaged=True)
        if _match(self.two_sub, name):
            if not local:
                raise CheckpointFormatError(
                    f"{self.where}: {name!r} matches {_TWO_SUB} but is a scalar"
                )
            first = -(-local[0] // 2)  # torch.chunk(s, 2): the first chunk takes the odd row
            widths = [[first] * degree, [local[0] - first] * degree]
            return _sub_params(rank, local, 0, widths, _TWO_SUB, 0)
        sub = next((s for s in self.sub if any(re.match(p, name) for p in s.patterns)), None)
        if sub is not None:
            return _sub_param_slice(self.where, name, sub, rank, degree, local, total)
        dim = 1 if _match(self.row, name) else 0
        if dim >= len(local):
            raise CheckpointFormatError(
                f"{self.where}: {name!r} of shape {local} cannot be joined along dimension {dim}"
            )
        return _joined(rank, local, dim, degree, _ROW if dim else "column-parallel", dim)


def _match(patterns: tuple[str, ...], name: str) -> bool:
    return any(re.match(p, name) for p in patterns)


def _sub_param_slice(
    where: str,
    name: str,
    sub: SubParams,
    rank: int,
    degree: int,
    local: tuple[int, ...],
    total: int | None,
) -> TPSlice:
    """Rank ``rank``'s slice of ``name`` under ``sub`` (a ``SubparamShape``), as ds_to_universal
    views it: the merged shape's other dimensions, along ``dim`` the rank's widths."""
    sizes = sub.sizes
    if len(sizes) == 1 and sizes[0] < 0:  # before version 0.4: the number of equal parts
        n, full = -sizes[0], (local[sub.dim] if sub.dim < len(local) else 0) * degree
        if full % n:
            raise CheckpointFormatError(
                f"{where}: {name!r}: {n} sub-parameters do not evenly divide its {full} elements "
                f"along dimension {sub.dim}"
            )
        sizes = (full // n,) * n
    if sub.widths is None:
        uneven = [s for s in sizes if s % degree]
        if uneven:
            raise CheckpointFormatError(
                f"{where}: {name!r}: sub-parameter sizes {uneven} are not divisible by the "
                f"tensor-parallel degree {degree}, and the checkpoint records no {_WIDTHS!r}"
            )
    widths = sub.widths or tuple(tuple([s // degree] * degree) for s in sizes)
    if len(widths) != len(sizes) or any(
        len(w) != degree or sum(w) != s for w, s in zip(widths, sizes)
    ):
        raise CheckpointFormatError(
            f"{where}: {name!r}: {_INFO}[{_WIDTHS!r}] {[list(w) for w in widths]} does not give "
            f"each of the sub-parameters of sizes {list(sizes)} one width per "
            f"tensor-parallel rank ({degree}), adding up to its size"
        )
    shape = list(sub.shape)
    shape[sub.dim] = sum(sizes)
    numel = total if total is not None else math.prod(local) * degree
    if shape.count(-1) == 1:
        known = math.prod(s for s in shape if s != -1)
        if known <= 0 or numel % known:
            raise CheckpointFormatError(
                f"{where}: {name!r}: sub-parameter shape {shape} (sub-parameters of sizes "
                f"{list(sizes)} along dimension {sub.dim}) does not fit its {numel} elements"
            )
        shape[shape.index(-1)] = numel // known
    view = list(shape)
    view[sub.dim] = sum(w[rank] for w in widths)
    if any(s < 0 for s in shape) or math.prod(view) != math.prod(local):
        raise CheckpointFormatError(
            f"{where}: tensor-parallel rank {rank} holds {math.prod(local)} elements of "
            f"{name!r} (shape {list(local)}), but its {_SUB} widths describe a shape of {view}"
        )
    return _sub_params(rank, tuple(view), sub.dim, widths, _SUB)


def _affine_slice(
    where: str, name: str, amap: AffineMap, rank: int, local: tuple[int, ...]
) -> TPSlice:
    """Rank ``rank``'s slice by an ``affine_map`` entry: its pieces (a replicated piece from the
    lowest rank holding it)."""
    entry = amap.ranks.get(rank)
    if entry is None:
        raise CheckpointFormatError(
            f"{where}: {_INFO}[{_AFFINE!r}] for {name!r} has no tensor-parallel rank {rank}"
        )
    shape, pieces = entry
    if math.prod(shape) != math.prod(local):
        raise CheckpointFormatError(
            f"{where}: {_INFO}[{_AFFINE!r}] gives tensor-parallel rank {rank}'s slice of {name!r} "
            f"the shape {list(shape)}, but it holds {list(local)}"
        )
    mine = tuple((p.src, p.dst) for p in pieces if min(p.holders) == rank)
    for src, dst in mine:
        if not src.fits(shape) or not dst.fits(amap.shape):
            raise CheckpointFormatError(
                f"{where}: {_INFO}[{_AFFINE!r}]: a piece of {name!r} on rank {rank} lies outside "
                f"its slice {list(shape)} or the merged shape {list(amap.shape)}"
            )
    return TPSlice(rank, shape, amap.shape, mine, _AFFINE)


def _unknown_split(
    where: str, missing: str, params: list[str], user: bool
) -> CheckpointFormatError:
    """The refusal of ``params``, whose split no rule gives (``user``: the user gave some)."""
    shown = listed(params, 6)
    which = f"tp_rules match none of {shown}, so it is unknown which dimension each of them"
    return CheckpointFormatError(
        f"{where}: tensor-parallel checkpoint without partitioning rules: {_INFO} {missing}"
        + (f" and {which}" if user else f", so it is unknown which dimension each of {shown}")
        + " is split along (or whether it is replicated)"
    )


def tp_rules(info: Any, where: str, params: list[str], user: tuple[TPRule, ...] = ()) -> TPRules:
    """The rules of ``info`` (a model states file's ``universal_checkpoint_info``, read from
    ``where``), for a checkpoint whose split parameters are ``params``, with the user's rules
    (:func:`user_tp_rules`) first.

    Without ``info`` (or without any tensor-parallel pattern) nothing but the user's rules says
    how ``params`` are split: those no user rule matches are refused, naming them and the
    missing patterns. A key of ``info`` this reader does not know is refused.
    """
    check_info_keys(info, where)
    if not isinstance(info, dict) or not any(info.get(k) for k in _RULE_KEYS):
        missing = (
            "is missing" if not isinstance(info, dict) else f"has none of {', '.join(_RULE_KEYS)}"
        )
        rules = TPRules(where, (), (), (), (), None, user, missing)
        unplaced = [p for p in params if rules.user_rule(p) is None]
        if unplaced:
            raise _unknown_split(where, missing, unplaced, bool(user))
        return rules
    version = info.get(_VERSION, 0.0)
    if not isinstance(version, (int, float)) or isinstance(version, bool):
        raise CheckpointFormatError(f"{where}: {_INFO}[{_VERSION!r}] {version!r} is not a number")
    rows = info.get(_K["ORIGINAL_VOCAB_SIZE"])
    if rows is not None and not (is_int(rows) and rows > 0):
        raise CheckpointFormatError(
            f"{where}: {_INFO}[{_K['ORIGINAL_VOCAB_SIZE']!r}] {rows!r} is not a positive integer"
        )
    unsupported = info.get(_AUTOTP_UNSUPPORTED) or {}
    if not isinstance(unsupported, dict) or not all(isinstance(p, str) for p in unsupported):
        raise CheckpointFormatError(
            f"{where}: {_INFO}[{_AUTOTP_UNSUPPORTED!r}] is not a dict of patterns"
        )
    _patterns(info, _K["PIPELINE_REPLICATED_PARAMETER_PATTERNS"], where)
    rules = TPRules(
        where,
        _patterns(info, _REPLICATED, where),
        _patterns(info, _ROW, where),
        _patterns(info, _VOCAB, where),
        _patterns(info, _AVERAGE, where),
        rows,
        user,
        None,
        tuple((p, str(r)) for p, r in unsupported.items()),
        _patterns(info, _TWO_SUB, where),
        _sub_params_entries(info, where),
        _affine_maps(info, where),
    )
    rules.check_supported(params)
    return rules
