"""A declarative layout language: regex rules that say how a rank's tensors map to logical tensors.

Megatron-style training state is not described by DTensors: a fused QKV
weight holds this TP rank's rows of three matrices, an embedding carries
padding rows, a pipeline stage calls global layer 12 ``layers.0``, an
expert-parallel rank calls global expert 6 ``experts.0``. A
:class:`LayoutSpec` is a list of rules, matched by regular expression on the
DCP-flattened key of every state-dict leaf, that turn each tensor into
:class:`~ucp_dcp.core.pieces.TensorPieces` of canonical *logical* tensors (global
names, unfused, unpadded). The checkpoint then holds ``layers.12.attn.q.weight``
whatever layout saved it, and the same kind of spec, built for the target
layout, loads it::

    spec = LayoutSpec(
        [Rename(r"_orig_mod\\.", ""),
         Reindex(r"layers\\.(\\d+)\\.", offset=first_layer_of_stage),
         Reindex(r"experts\\.(\\d+)\\.", axis="ep", per_rank=experts_per_rank),
         Fused(r"\\.qkv\\.", dim=0, parts={".q.": nq * hd, ".k.": nkv * hd, ".v.": nkv * hd},
               groups=nkv, axis="tp"),
         Fused(r"\\.gate_up\\.", dim=0, parts={".gate.": ffn, ".up.": ffn}, axis="tp"),
         Shard(r"\\.(o|down)\\.weight", dim=1, axis="tp"),
         VocabPad(r"embed\\.weight", dim=0, size=vocab, axis="tp"),
         Replicated(r"norm", axis="tp")],
        axes={"tp": (tp_rank, tp_size), "ep": (ep_rank, ep_size)},
    )
    dcp.save(spec.apply(state, record=True), storage_writer=..., planner=UCPSavePlanner())
    dcp.load(target_spec.apply(state), storage_reader=..., planner=UCPLoadPlanner())

How a key is handled:

1. :class:`Rename` and :class:`Reindex` rules apply, in order, to the key
   (every rule whose pattern matches).
2. The first *layout* rule (:class:`Shard`, :class:`Fused`,
   :class:`VocabPad`, :class:`Replicated`, :class:`Averaged`) whose pattern
   ``re.search``-es the renamed key decides the pieces.
3. A tensor no layout rule matches: a DTensor describes itself (left as it
   is, or cut into pieces under its new name if renamed); a plain tensor is
   an error when ``strict`` (the layout cannot explain it), else saved as a
   full replicated copy.

Non-tensor leaves (ints, ``param_groups`` lists, :class:`~ucp_dcp.RankLocal`)
are kept at their keys. The returned state dict has the caller's structure,
so the keys DCP sees do not change; every piece is a view of the caller's
tensor, so a load writes in place.

``strict`` also makes a rule that matches no key on this rank an error. The
check is per rank: under pipeline or expert parallelism a rule that only
some ranks need (the embedding on the first stage) should be marked
``optional=True``, or the spec built per rank with only the rules it needs.

``apply(..., record=True)`` stores the spec (rules and this rank's axis
coordinates, as JSON) in the checkpoint under ``"__ucp_layout__"`` as a
:class:`~ucp_dcp.RankLocal`; :meth:`LayoutSpec.from_json` rebuilds it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from ..core.pieces import Piece, TensorPieces
from ..core.sharding import Box, intersect
from ..core.values import RankLocal
from ..errors import LayoutRuleError

__all__ = [
    "LayoutRuleError",
    "Rule",
    "LayoutRule",
    "Rename",
    "Reindex",
    "Shard",
    "Fused",
    "VocabPad",
    "Replicated",
    "Averaged",
    "LayoutSpec",
    "LAYOUT_KEY",
]

LAYOUT_KEY = "__ucp_layout__"
"""Top-level state-dict key under which ``apply(record=True)`` stores the spec."""

_JSON_VERSION = 1


# ----------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """Base of every rule: a regular expression searched in the (renamed) DCP key.

    Args:
        pattern: regular expression, ``re.search``-ed in the key.
        optional: do not count this rule as unused when it matches no key
            on this rank (a pipeline stage without the embedding).
    """

    pattern: str
    optional: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise LayoutRuleError(f"{self.describe()}: invalid regular expression: {e}") from None

    @property
    def regex(self) -> re.Pattern[str]:
        """The compiled pattern."""
        return re.compile(self.pattern)

    def describe(self) -> str:
        """The rule as written (for error messages)."""
        args = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" if i else repr(getattr(self, f.name))
            for i, f in enumerate(dataclasses.fields(self))
            if i == 0 or getattr(self, f.name) != f.default
        )
        return f"{type(self).__name__}({args})"

    def to_json(self) -> dict[str, Any]:
        """The rule as a JSON-safe dict (``{"rule": class name, field: value, ...}``)."""
        out: dict[str, Any] = {"rule": type(self).__name__}
        for f in dataclasses.fields(self):
            out[f.name] = getattr(self, f.name)
        return out

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "Rule":
        """Rebuild a rule written by :meth:`to_json`."""
        data = dict(data)
        kind = data.pop("rule", None)
        cls = _RULES.get(kind)  # type: ignore[arg-type]
        if cls is None:
            raise LayoutRuleError(f"unknown layout rule {kind!r} (known: {sorted(_RULES)})")
        if cls is Fused and isinstance(data.get("parts"), list):
            data["parts"] = {str(k): int(w) for k, w in data["parts"]}
        return cls(**data)


@dataclass(frozen=True)
class Rename(Rule):
    """Replace every match of ``pattern`` in the key by ``repl`` (``re.sub``; ``\\1`` works).

    ``Rename(r"_fsdp_wrapped_module\\.", "")`` strips a wrapper prefix;
    ``Rename(r"^model\\.decoder\\.", "model.")`` maps one naming scheme to another.
    """

    repl: str = ""


@dataclass(frozen=True)
class Reindex(Rule):
    """Add an offset to the integer captured by group 1 of ``pattern`` (every match).

    The offset is ``offset + per_rank * coordinate(axis)``:
    ``Reindex(r"layers\\.(\\d+)\\.", offset=12)`` makes stage-local ``layers.0``
    global ``layers.12``; ``Reindex(r"experts\\.(\\d+)\\.", axis="ep", per_rank=2)``
    makes EP rank 3's ``experts.1`` global ``experts.7``.
    """

    offset: int = 0
    axis: str | None = None
    per_rank: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.regex.groups < 1:
            raise LayoutRuleError(f"{self.describe()}: the pattern needs a capture group (the index)")
        if (self.axis is None) != (self.per_rank == 0):
            raise LayoutRuleError(f"{self.describe()}: give axis and per_rank together, or neither")


@dataclass(frozen=True)
class LayoutRule(Rule):
    """Base of the rules that decide how a tensor maps to logical tensors.

    ``axis`` names the parallel axis (a key of :attr:`LayoutSpec.axes`) the
    tensor is split or replicated over; ``None``: not split (size 1).
    """

    axis: str | None = None

    def pieces(self, name: str, t: torch.Tensor, rank: int, size: int, ctx: "_Context") -> TensorPieces:
        """The pieces of local tensor ``t`` (logical name ``name``) at coordinate ``rank`` of ``size``."""
        raise NotImplementedError


@dataclass(frozen=True)
class Shard(LayoutRule):
    """An even shard along ``dim``: coordinate r of n holds ``[r * L, (r + 1) * L)`` (L: local size).

    ``Shard(r"\\.(o|down)\\.weight", dim=1, axis="tp")``: row-parallel linear layers.
    """

    dim: int = 0

    def pieces(self, name: str, t: torch.Tensor, rank: int, size: int, ctx: "_Context") -> TensorPieces:
        d = _check_dim(self, name, t, self.dim)
        shape = list(t.shape)
        local = shape[d]
        shape[d] = local * size
        offsets = [0] * t.dim()
        offsets[d] = rank * local
        return TensorPieces([Piece(name, tuple(shape), tuple(offsets), t)], source=ctx.source)


@dataclass(frozen=True)
class Fused(LayoutRule):
    """Several logical tensors concatenated along ``dim``, each split over ``axis``.

    ``parts`` maps the text that replaces the pattern's match in the name
    (``re.sub``, once) to that part's *global* width along ``dim``; widths
    may differ (QKV under GQA). With ``groups=None`` (Megatron SwiGLU
    ``fc1``) each coordinate r of n holds ``w_0/n`` rows of part 0 (rows
    ``[r*w_0/n, (r+1)*w_0/n)`` of it), then ``w_1/n`` rows of part 1, ...
    With ``groups=G`` (Megatron's GQA QKV, ``G`` = number of KV heads) the
    global fused tensor is ``G`` groups, each ``[w_0/G | w_1/G | ...]``, and
    coordinate r holds groups ``[r*G/n, (r+1)*G/n)``, in order.
    """

    dim: int = 0
    parts: Mapping[str, int] = field(default_factory=dict)
    groups: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "parts", {str(k): int(w) for k, w in dict(self.parts).items()})
        if not self.parts:
            raise LayoutRuleError(f"{self.describe()}: parts is empty")
        if any(w <= 0 for w in self.parts.values()):
            raise LayoutRuleError(f"{self.describe()}: every part width must be positive")
        if self.groups is not None and self.groups < 1:
            raise LayoutRuleError(f"{self.describe()}: groups must be >= 1")

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["parts"] = [[k, w] for k, w in self.parts.items()]  # order matters
        return out

    def pieces(self, name: str, t: torch.Tensor, rank: int, size: int, ctx: "_Context") -> TensorPieces:
        d = _check_dim(self, name, t, self.dim)
        widths = list(self.parts.values())
        total = sum(widths)
        axis = self.axis or "axis"
        if total % size or t.shape[d] * size != total:
            raise LayoutRuleError(
                f"fused split of {ctx.key!r} by {self.describe()}: widths {widths} add up to {total}, but the "
                f"tensor has {t.shape[d]} along dim {d} at {axis} size {size} (expected {total}/{size} = "
                f"{total / size:g})"
            )
        groups = size if self.groups is None else self.groups
        if groups % size:
            raise LayoutRuleError(
                f"fused split of {ctx.key!r} by {self.describe()}: {groups} groups do not split evenly over "
                f"{axis} size {size}"
            )
        bad = [w for w in widths if w % groups]
        if bad:
            raise LayoutRuleError(
                f"fused split of {ctx.key!r} by {self.describe()}: widths {bad} are not divisible by "
                f"{groups} ({'groups' if self.groups else axis + ' size'})"
            )
        local_groups = groups // size
        pieces, pos = [], 0
        for g in range(local_groups):
            global_group = rank * local_groups + g
            for key, w in self.parts.items():
                block = w // groups
                part_name = self.regex.sub(key, name, count=1)
                shape = list(t.shape)
                shape[d] = w
                offsets = [0] * t.dim()
                offsets[d] = global_group * block
                pieces.append(Piece(part_name, tuple(shape), tuple(offsets), t.narrow(d, pos, block)))
                pos += block
        return TensorPieces(pieces, source=ctx.source)


@dataclass(frozen=True)
class VocabPad(LayoutRule):
    """A dimension padded past its true ``size``, then split evenly over ``axis``.

    Coordinate r of n holds rows ``[r * L, (r + 1) * L)`` of the padded
    tensor (L: local size, padded size ``n * L >= size``). Rows below
    ``size`` are saved as rows of a logical tensor with ``size`` rows; the
    padding rows are not saved and are set to ``fill_value`` on load.
    """

    dim: int = 0
    size: int = 0
    fill_value: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.size <= 0:
            raise LayoutRuleError(f"{self.describe()}: size (the true, unpadded size) must be positive")

    def pieces(self, name: str, t: torch.Tensor, rank: int, size: int, ctx: "_Context") -> TensorPieces:
        d = _check_dim(self, name, t, self.dim)
        local = t.shape[d]
        padded = local * size
        if self.size <= 0 or padded < self.size:
            raise LayoutRuleError(
                f"padded split of {ctx.key!r} by {self.describe()}: {local} rows along dim {d} at "
                f"{self.axis or 'axis'} size {size} make {padded} padded rows, fewer than the true size "
                f"{self.size}"
            )
        start = rank * local
        keep = max(0, min(local, self.size - start))
        shape = list(t.shape)
        shape[d] = self.size
        offsets = [0] * t.dim()
        offsets[d] = min(start, self.size)
        pieces = [Piece(name, tuple(shape), tuple(offsets), t.narrow(d, 0, keep))] if keep else []
        fill = [t.narrow(d, keep, local - keep)] if keep < local else []
        return TensorPieces(pieces, fill=fill, fill_value=self.fill_value, source=ctx.source)


@dataclass(frozen=True)
class Replicated(LayoutRule):
    """Every coordinate of ``axis`` holds the same full tensor (TP-replicated layer norms).

    Save checks that every holder's bytes are equal (an error naming the
    tensor and ranks if not) and writes one copy; load reads it on every rank.
    """

    def pieces(self, name: str, t: torch.Tensor, rank: int, size: int, ctx: "_Context") -> TensorPieces:
        return _full(name, t, ctx)


@dataclass(frozen=True)
class Averaged(LayoutRule):
    """Copies over ``axis`` that may drift apart and are saved as their mean.

    At save (``apply(record=True)``) the mean over the process group
    ``groups[axis]`` is computed into a new tensor (the training state is
    not modified) and saved as one replicated copy; at load every rank
    reads the mean into its tensor.
    """

    def pieces(self, name: str, t: torch.Tensor, rank: int, size: int, ctx: "_Context") -> TensorPieces:
        if not ctx.save or size == 1:
            return _full(name, t, ctx)
        if not t.is_floating_point():
            raise LayoutRuleError(f"{self.describe()}: cannot average {ctx.key!r} of dtype {t.dtype}")
        group = ctx.groups.get(self.axis) if self.axis else None
        if group is None:
            raise LayoutRuleError(
                f"{self.describe()} matches {ctx.key!r}: averaging over {self.axis!r} (size {size}) needs "
                f"its process group: LayoutSpec(..., groups={{{self.axis!r}: group}})"
            )
        import torch.distributed as dist

        if dist.get_world_size(group) != size:
            raise LayoutRuleError(
                f"{self.describe()}: the process group of axis {self.axis!r} has {dist.get_world_size(group)} "
                f"ranks, but axes says its size is {size}"
            )
        acc_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        acc = t.detach().to(acc_dtype, copy=True)
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
        mean = (acc / size).to(t.dtype)
        return _full(name, mean, ctx)


_RULES: dict[str, type[Rule]] = {
    c.__name__: c for c in (Rename, Reindex, Shard, Fused, VocabPad, Replicated, Averaged)
}


def _check_dim(rule: Rule, name: str, t: torch.Tensor, dim: int) -> int:
    if not -t.dim() <= dim < t.dim() or t.dim() == 0:
        raise LayoutRuleError(
            f"{rule.describe()} matches {name!r} of shape {list(t.shape)}, which has no dim {dim}"
        )
    return dim % t.dim()


def _full(name: str, t: torch.Tensor, ctx: "_Context") -> TensorPieces:
    return TensorPieces([Piece(name, tuple(t.shape), (0,) * t.dim(), t)], replicated=True, source=ctx.source)


@dataclass
class _Context:
    key: str
    source: str
    save: bool
    groups: Mapping[str, Any]


# ----------------------------------------------------------------------------
# The spec
# ----------------------------------------------------------------------------


@dataclass
class LayoutSpec:
    """Rules that map this rank's state dict to logical tensors, and this rank's place on each axis.

    Args:
        rules: :class:`Rename`/:class:`Reindex` (applied in order, all that
            match) and layout rules (first match decides), in one list.
        axes: this rank's ``(coordinate, size)`` per named parallel axis,
            e.g. ``{"tp": (tp_rank, tp_size)}``.
        groups: process group per axis; only :class:`Averaged` needs one,
            at save.
        strict: a plain tensor no layout rule matches, or a (non-optional)
            rule that matches no key on this rank, is a
            :class:`LayoutRuleError`. With ``strict=False`` an unexplained
            plain tensor is saved as a full replicated copy.
        allow_unused_rules: with ``strict``, do not fail on unused rules.
    """

    rules: Sequence[Rule]
    axes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    groups: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    strict: bool = True
    allow_unused_rules: bool = False

    def __post_init__(self) -> None:
        self.rules = list(self.rules)
        bad = [r for r in self.rules if not isinstance(r, Rule)]
        if bad:
            raise LayoutRuleError(f"not layout rules: {bad!r}")
        axes = {}
        for name, coord in dict(self.axes).items():
            try:
                rank, size = (int(x) for x in coord)
            except (TypeError, ValueError):
                raise LayoutRuleError(f"axis {name!r}: expected (coordinate, size), got {coord!r}") from None
            if not 0 <= rank < size:
                raise LayoutRuleError(f"axis {name!r}: coordinate {rank} is outside size {size}")
            axes[str(name)] = (rank, size)
        self.axes = axes
        for r in self.rules:
            axis = getattr(r, "axis", None)
            if axis is not None and axis not in self.axes:
                raise LayoutRuleError(
                    f"{r.describe()} uses axis {axis!r}, which is not in axes {sorted(self.axes)}"
                )

    # -- names -------------------------------------------------------------

    def _coord(self, axis: str | None) -> tuple[int, int]:
        return (0, 1) if axis is None else self.axes[axis]

    def _rename(self, key: str, used: set[int]) -> str:
        name = key
        for i, r in enumerate(self.rules):
            if isinstance(r, Rename):
                if r.regex.search(name):
                    used.add(i)
                    name = r.regex.sub(r.repl, name)
            elif isinstance(r, Reindex):
                if r.regex.search(name):
                    used.add(i)
                    shift = r.offset + r.per_rank * self._coord(r.axis)[0]

                    def bump(m: re.Match[str], shift: int = shift, rule: Reindex = r) -> str:
                        text, base = m.group(0), m.start(0)
                        s, e = m.span(1)
                        if s < 0:
                            return text
                        try:
                            idx = int(m.group(1))
                        except ValueError:
                            raise LayoutRuleError(
                                f"{rule.describe()}: group 1 of the match in {key!r} is {m.group(1)!r}, "
                                f"not an integer"
                            ) from None
                        return text[: s - base] + str(idx + shift) + text[e - base :]

                    name = r.regex.sub(bump, name)
        return name

    def canonical_name(self, key: str) -> str:
        """The name ``key`` has after the :class:`Rename`/:class:`Reindex` rules."""
        return self._rename(key, set())

    def rule_for(self, name: str) -> LayoutRule | None:
        """The first layout rule whose pattern matches (renamed) ``name``, if any."""
        for r in self.rules:
            if isinstance(r, LayoutRule) and r.regex.search(name):
                return r
        return None

    # -- apply -------------------------------------------------------------

    def apply(self, state_dict: Mapping[str, Any], *, record: bool = False) -> dict[str, Any]:
        """A copy of ``state_dict`` with every tensor leaf replaced by its pieces.

        The structure (and so every key DCP sees) is unchanged; non-tensor
        leaves are kept as they are; pieces are views of the caller's
        tensors. ``record=True`` (for ``dcp.save``) averages
        :class:`Averaged` tensors and adds the spec under
        :data:`LAYOUT_KEY` as a :class:`~ucp_dcp.RankLocal`; use
        ``record=False`` for ``dcp.load``. After a load, non-tensor values
        are in the returned dict: :meth:`update_values` copies them back.
        """
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        from ..dcp.planners import _set_in_place  # here: planners imports this module

        if LAYOUT_KEY in state_dict:
            raise LayoutRuleError(f"the state dict already has the reserved key {LAYOUT_KEY!r}")
        flat, paths = flatten_state_dict(dict(state_dict))
        out = _copy_containers(state_dict)
        used: set[int] = set()
        produced: _Produced = {}
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor):
                continue
            name = self._rename(key, used)
            new = self._pieces(key, name, value, used, record)
            if isinstance(new, TensorPieces):
                for p in new.pieces:
                    produced.setdefault(p.fqn, []).append((key, p.shape, p.offsets, tuple(p.data.shape)))
            else:
                produced.setdefault(name, []).append((key, tuple(value.shape), None, None))
            _set_in_place(out, paths[key], new)
        _check_collisions(produced)
        if self.strict and not self.allow_unused_rules:
            unused = [r for i, r in enumerate(self.rules) if i not in used and not r.optional]
            if unused:
                raise LayoutRuleError(
                    "layout rules match no tensor of this rank's state dict: "
                    + ", ".join(r.describe() for r in unused)
                    + " (mark a rule optional=True if only some ranks need it, or pass "
                    "allow_unused_rules=True / strict=False)"
                )
        if record:
            out[LAYOUT_KEY] = RankLocal(self.to_json())
        return out

    @staticmethod
    def update_values(state_dict: Mapping[str, Any], applied: Mapping[str, Any]) -> None:
        """Copy the non-tensor values a ``dcp.load`` put into ``applied`` back into ``state_dict``.

        Tensors load in place into the caller's tensors, but ``dcp.load``
        replaces non-tensor values (a step counter, ``param_groups``) in the
        dict it was given, the one :meth:`apply` returned. (A
        :class:`~ucp_dcp.RankLocal` is the same object in both.)
        """
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        from ..dcp.planners import _set_in_place  # here: planners imports this module

        flat, paths = flatten_state_dict(dict(state_dict))
        loaded, _ = flatten_state_dict(dict(applied))  # same structure, so the same keys
        for key, path in paths.items():
            if not isinstance(flat[key], torch.Tensor):
                _set_in_place(state_dict, path, loaded[key])

    def _pieces(self, key: str, name: str, value: torch.Tensor, used: set[int], save: bool) -> Any:
        from torch.distributed.tensor import DTensor

        rule = None
        for i, r in enumerate(self.rules):
            if isinstance(r, LayoutRule) and r.regex.search(name):
                rule, used_index = r, i
                break
        source = key if key == name else f"{key} -> {name}"
        ctx = _Context(key=key, source=source, save=save, groups=self.groups)
        if isinstance(value, DTensor):
            if rule is not None:
                raise LayoutRuleError(
                    f"{rule.describe()} matches {key!r}, a DTensor: a DTensor describes its own layout; "
                    f"change the rule's pattern so it does not match it"
                )
            return value if name == key else _dtensor_pieces(name, value, source)
        if rule is None:
            if self.strict:
                raise LayoutRuleError(
                    f"the layout cannot explain {key!r}"
                    + (f" (renamed {name!r})" if name != key else "")
                    + f" (shape {list(value.shape)}, {value.dtype}): no layout rule matches it; add e.g. "
                    f"Replicated({re.escape(name.rsplit('.', 1)[-1])!r}) if every rank holds the same copy"
                )
            return _full(name, value.detach(), ctx)
        used.add(used_index)
        rank, size = self._coord(rule.axis)
        return rule.pieces(name, value.detach(), rank, size, ctx)

    # -- JSON --------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Rules, axes and flags as a JSON-safe dict (process groups are not stored)."""
        return {
            "version": _JSON_VERSION,
            "rules": [r.to_json() for r in self.rules],
            "axes": {k: [r, n] for k, (r, n) in self.axes.items()},
            "strict": self.strict,
            "allow_unused_rules": self.allow_unused_rules,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, groups: Mapping[str, Any] | None = None) -> "LayoutSpec":
        """Rebuild a spec written by :meth:`to_json` (``groups``: process groups, if averaging)."""
        version = data.get("version")
        if version != _JSON_VERSION:
            raise LayoutRuleError(f"layout spec JSON version {version!r}; this code reads {_JSON_VERSION}")
        return cls(
            [Rule.from_json(r) for r in data["rules"]],
            axes={k: (int(v[0]), int(v[1])) for k, v in data.get("axes", {}).items()},
            groups=dict(groups or {}),
            strict=bool(data.get("strict", True)),
            allow_unused_rules=bool(data.get("allow_unused_rules", False)),
        )


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def _dtensor_pieces(name: str, value: Any, source: str) -> TensorPieces:
    from torch.distributed.tensor import Replicate, Shard as DShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(value.placements)
    if any(not isinstance(p, (Replicate, DShard)) for p in placements) or any(
        type(p) is not DShard and isinstance(p, DShard) for p in placements
    ):
        raise LayoutRuleError(
            f"{source}: a renamed DTensor with placements {placements} (only Shard and Replicate can be renamed)"
        )
    local = value.to_local().detach()
    shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, placements)
    if tuple(shape) != tuple(local.shape):
        raise LayoutRuleError(f"{source}: DTensor local shape {list(local.shape)} is not the expected {list(shape)}")
    replicated = any(isinstance(p, Replicate) for p in placements)
    pieces = [Piece(name, tuple(value.shape), tuple(offsets), local)] if local.numel() else []
    return TensorPieces(pieces, replicated=replicated, source=source)


def _copy_containers(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_containers(v) for v in obj]
    return obj


_Produced = dict[str, list[tuple[str, tuple[int, ...], Optional[tuple[int, ...]], Optional[tuple[int, ...]]]]]


def _check_collisions(produced: _Produced) -> None:
    for fqn, items in produced.items():
        keys = list(dict.fromkeys(k for k, *_ in items))
        if len(keys) < 2:
            continue
        if any(off is None for _, _, off, _ in items):  # a DTensor left as it is
            raise LayoutRuleError(f"keys {keys} all map to the logical tensor {fqn!r}")
        shapes = {shape for _, shape, _, _ in items}
        if len(shapes) > 1 and not all(len(s) == 0 for s in shapes):
            raise LayoutRuleError(
                f"keys {keys} map to the logical tensor {fqn!r} with different global shapes "
                f"{[list(s) for s in shapes]}"
            )
        for i, (ka, _, ao, asz) in enumerate(items):
            for kb, _, bo, bsz in items[i + 1 :]:
                if ka != kb and intersect(Box(ao, asz), Box(bo, bsz)) is not None:
                    raise LayoutRuleError(
                        f"keys {ka!r} and {kb!r} both hold rows of the logical tensor {fqn!r} at overlapping "
                        f"boxes (offsets {list(ao)} and {list(bo)}); check the Rename/Reindex rules"
                    )
