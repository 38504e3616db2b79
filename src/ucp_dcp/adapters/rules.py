"""Layout rules: the records of the layout language (:mod:`ucp_dcp.adapters.layout_spec`).

Each rule is a frozen dataclass matched by regular expression on a DCP key:
:class:`Rename` and :class:`Reindex` change the key, a
:class:`LayoutRule` (:class:`Shard`, :class:`Fused`, :class:`VocabPad`,
:class:`Replicated`, :class:`Averaged`) cuts a tensor into the pieces of its
logical tensors, and a :class:`StackRule` (:class:`Stacked`,
:class:`Unstacked`) then re-expresses those pieces between experts kept one
by one and experts stacked along one dimension. Rules round-trip through
JSON (:meth:`Rule.to_json`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.pieces import Piece, TensorPieces
from ..errors import LayoutRuleError
from ..format.schema import check_field_types

__all__ = [
    "Rule",
    "LayoutRule",
    "Rename",
    "Reindex",
    "Shard",
    "Fused",
    "VocabPad",
    "Replicated",
    "Averaged",
    "StackRule",
    "Stacked",
    "Unstacked",
    "RuleContext",
    "RULES",
    "full_piece",
]


def expand(rule: Any, m: re.Match[str], repl: str) -> str:
    """``m.expand(repl)`` for ``rule``; a replacement that names a group the pattern lacks (or a
    bad escape) is a :class:`LayoutRuleError` naming the rule, not ``re.error``."""
    try:
        return m.expand(repl)
    except re.error as e:
        raise LayoutRuleError(f"{rule.describe()}: replacement {repl!r}: {e}") from None


def _replace_match(rule: Any, name: str, m: re.Match[str], repl: str) -> str:
    """``name`` with match ``m`` of ``rule``'s pattern replaced by ``repl`` (:func:`expand`)."""
    return name[: m.start()] + expand(rule, m, repl) + name[m.end() :]


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
        check_field_types(self)
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
    def from_json(data: Mapping[str, Any]) -> Rule:
        """Rebuild a rule written by :meth:`to_json`."""
        data = dict(data)
        kind = data.pop("rule", None)
        cls = RULES.get(kind)
        if cls is None:
            raise LayoutRuleError(f"unknown layout rule {kind!r} (known: {sorted(RULES)})")
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
            raise LayoutRuleError(
                f"{self.describe()}: the pattern needs a capture group (the index)"
            )
        if (self.axis is None) != (self.per_rank == 0):
            raise LayoutRuleError(f"{self.describe()}: give axis and per_rank together, or neither")


@dataclass(frozen=True)
class LayoutRule(Rule):
    """Base of the rules that decide how a tensor maps to logical tensors.

    ``axis`` names the parallel axis (a key of :attr:`LayoutSpec.axes`) the
    tensor is split or replicated over; ``None``: not split (size 1).
    """

    axis: str | None = None

    def pieces(
        self, name: str, t: torch.Tensor, rank: int, size: int, ctx: RuleContext
    ) -> TensorPieces:
        """The pieces of local tensor ``t`` (logical name ``name``) at coordinate ``rank`` of
        ``size``."""
        # A LayoutRule itself (or a subclass without pieces()) in a LayoutSpec: name it.
        raise LayoutRuleError(
            f"{self.describe()} matches {ctx.key!r}, but {type(self).__name__} does not cut "
            "tensors (LayoutRule is a base class): use Shard, Fused, VocabPad, Replicated or "
            "Averaged"
        )


@dataclass(frozen=True)
class Shard(LayoutRule):
    """An even shard along ``dim``: coordinate r of n holds ``[r * L, (r + 1) * L)`` (L: local
    size).

    ``Shard(r"\\.(o|down)\\.weight", dim=1, axis="tp")``: row-parallel linear layers.
    """

    dim: int = 0

    def pieces(
        self, name: str, t: torch.Tensor, rank: int, size: int, ctx: RuleContext
    ) -> TensorPieces:
        d = _check_dim(self, name, t, self.dim)
        local = t.shape[d]
        piece = _piece_along(name, t, d, local * size, rank * local)
        return TensorPieces([piece], source=ctx.source)


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
        try:  # a mapping, or the [name, width] pairs of the rule's JSON
            parts = {str(k): int(w) for k, w in dict(self.parts).items()}
        except (TypeError, ValueError):
            raise LayoutRuleError(
                f"Fused({self.pattern!r}): parts must map each part's name to its width, got "
                f"{self.parts!r}"[:300]
            ) from None
        object.__setattr__(self, "parts", parts)
        super().__post_init__()
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

    def pieces(
        self, name: str, t: torch.Tensor, rank: int, size: int, ctx: RuleContext
    ) -> TensorPieces:
        d = _check_dim(self, name, t, self.dim)
        widths = list(self.parts.values())
        total = sum(widths)
        axis = self.axis or "axis"
        if total % size or t.shape[d] * size != total:
            raise LayoutRuleError(
                f"fused split of {ctx.key!r} by {self.describe()}: widths {widths} add up to "
                f"{total}, but the "
                f"tensor has {t.shape[d]} along dim {d} at {axis} size {size} (expected "
                f"{total}/{size} = "
                f"{total / size:g})"
            )
        groups = size if self.groups is None else self.groups
        if groups % size:
            raise LayoutRuleError(
                f"fused split of {ctx.key!r} by {self.describe()}: {groups} groups do not split "
                "evenly over "
                f"{axis} size {size}"
            )
        bad = [w for w in widths if w % groups]
        if bad:
            raise LayoutRuleError(
                f"fused split of {ctx.key!r} by {self.describe()}: widths {bad} are not divisible "
                "by "
                f"{groups} ({'groups' if self.groups else axis + ' size'})"
            )
        local_groups = groups // size
        pieces, pos = [], 0
        for g in range(local_groups):
            global_group = rank * local_groups + g
            for key, w in self.parts.items():
                block = w // groups
                m = self.regex.search(name)
                part_name = name if m is None else _replace_match(self, name, m, key)
                data = t.narrow(d, pos, block)
                pieces.append(_piece_along(part_name, data, d, w, global_group * block))
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
            raise LayoutRuleError(
                f"{self.describe()}: size (the true, unpadded size) must be positive"
            )

    def pieces(
        self, name: str, t: torch.Tensor, rank: int, size: int, ctx: RuleContext
    ) -> TensorPieces:
        d = _check_dim(self, name, t, self.dim)
        local = t.shape[d]
        padded = local * size
        if self.size <= 0 or padded < self.size:
            raise LayoutRuleError(
                f"padded split of {ctx.key!r} by {self.describe()}: {local} rows along dim {d} at "
                f"{self.axis or 'axis'} size {size} make {padded} padded rows, fewer than the "
                "true size "
                f"{self.size}"
            )
        start = rank * local
        keep = max(0, min(local, self.size - start))
        kept = t.narrow(d, 0, keep)
        pieces = [_piece_along(name, kept, d, self.size, min(start, self.size))] if keep else []
        fill = [t.narrow(d, keep, local - keep)] if keep < local else []
        return TensorPieces(pieces, fill=fill, fill_value=self.fill_value, source=ctx.source)


@dataclass(frozen=True)
class Replicated(LayoutRule):
    """Every coordinate of ``axis`` holds the same full tensor (TP-replicated layer norms).

    Save checks that every holder's bytes are equal (an error naming the
    tensor and ranks if not) and writes one copy; load reads it on every rank.
    """

    def pieces(
        self, name: str, t: torch.Tensor, rank: int, size: int, ctx: RuleContext
    ) -> TensorPieces:
        return full_piece(name, t, ctx)


@dataclass(frozen=True)
class Averaged(LayoutRule):
    """Copies over ``axis`` that may drift apart and are saved as their mean.

    At save (``apply(record=True)``) the mean over the process group
    ``groups[axis]`` is computed into a new tensor (the training state is
    not modified) and saved as one replicated copy; at load every rank
    reads the mean into its tensor.
    """

    def pieces(
        self, name: str, t: torch.Tensor, rank: int, size: int, ctx: RuleContext
    ) -> TensorPieces:
        if not ctx.save or size == 1:
            return full_piece(name, t, ctx)
        if not t.is_floating_point():
            raise LayoutRuleError(
                f"{self.describe()}: cannot average {ctx.key!r} of dtype {t.dtype}"
            )
        group = ctx.groups.get(self.axis) if self.axis else None
        if group is None:
            raise LayoutRuleError(
                f"{self.describe()} matches {ctx.key!r}: averaging over {self.axis!r} (size "
                f"{size}) needs "
                f"its process group: LayoutSpec(..., groups={{{self.axis!r}: group}})"
            )
        import torch.distributed as dist

        if dist.get_world_size(group) != size:
            raise LayoutRuleError(
                f"{self.describe()}: the process group of axis {self.axis!r} has "
                f"{dist.get_world_size(group)} "
                f"ranks, but axes says its size is {size}"
            )
        acc_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        acc = t.detach().to(acc_dtype, copy=True)
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
        mean = (acc / size).to(t.dtype)
        return full_piece(name, mean, ctx)


@dataclass(frozen=True)
class StackRule(Rule):
    """Base of the rules between experts kept one by one and experts stacked along ``dim``.

    A stack rule does not cut a tensor itself: the first layout rule that
    matches the key (a :class:`Shard` of a tensor-parallel dim inside each
    expert, say), or a DTensor's own placements, or, with neither, the whole
    tensor, gives its pieces, and the stack rule then renames and reshapes
    each piece, keeping its view of the caller's memory. ``repl`` is the text
    that replaces the pattern's match in a piece's name (``re`` template:
    ``\\1`` works); ``experts`` is the global number of experts ``E``.
    """

    repl: str = ""
    dim: int = 0
    experts: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.experts < 0:
            raise LayoutRuleError(f"{self.describe()}: experts must be >= 0")

    def restack(self, pieces: TensorPieces, rank: int, size: int, ctx: RuleContext) -> TensorPieces:
        """``pieces`` (what the layout rule or DTensor made of the key) re-expressed; ``rank`` of
        ``size``: this rank's place on the rule's axis."""
        # A StackRule itself (or a subclass without restack()) in a LayoutSpec: name it.
        raise LayoutRuleError(
            f"{self.describe()} matches {ctx.key!r}, but {type(self).__name__} does not restack "
            "tensors (StackRule is a base class): use Stacked or Unstacked"
        )

    def _match(self, fqn: str, ctx: RuleContext) -> re.Match[str]:
        m = self.regex.search(fqn)
        if m is None:
            raise LayoutRuleError(
                f"{self.describe()} matches {ctx.key!r}, but not {fqn!r}, the name a layout rule "
                "gave one of its pieces: widen the pattern so it matches every piece"
            )
        return m


@dataclass(frozen=True)
class Stacked(StackRule):
    """A tensor whose ``dim`` stacks experts, as one logical tensor per expert.

    ``Stacked(r"\\.experts\\.(w[123])$", repl=r".experts.{}.\\1.weight", axis="ep")``
    makes torchtitan's ``experts.w1`` of shape ``[E_local, ffn, hidden]``
    the pieces ``experts.{e}.w1.weight`` of shape ``[ffn, hidden]`` (the
    names Hugging Face and Megatron use), each viewed as ``local[e - e0]``:
    ``{}`` in ``repl`` stands for the global expert index ``e``. The local
    experts are a contiguous range starting at ``e0``: a DTensor says where
    (``Shard(dim)`` over an expert-parallel mesh, uneven shards included;
    leave ``axis`` unset); for a plain tensor, coordinate r of ``axis``
    holds ``[r * E_local, (r + 1) * E_local)``. A tensor-parallel split
    inside each expert is a layout rule matching the stacked name
    (``Shard(r"\\.experts\\.w[13]$", dim=1, axis="tp")``), or the DTensor's
    placements. ``experts`` (0: not checked) is the global E the tensor
    must describe.
    """

    axis: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.repl.count("{}") != 1:
            raise LayoutRuleError(
                f"{self.describe()}: repl must hold '{{}}' once, where the expert index goes"
            )

    def restack(self, pieces: TensorPieces, rank: int, size: int, ctx: RuleContext) -> TensorPieces:
        out = []
        for p in pieces.pieces:
            d = _check_dim(self, ctx.key, p.data, self.dim)
            m = self._match(p.fqn, ctx)
            stacked, offset = p.shape[d], p.offsets[d]
            if self.axis is not None:
                if p.data.shape[d] != stacked:
                    raise LayoutRuleError(
                        f"{self.describe()} splits dim {d} of {ctx.key!r} over {self.axis!r}, "
                        "but the layout rule that matches it already cut that dim "
                        f"({p.data.shape[d]} of {stacked}): cut it with one of them only"
                    )
                offset, stacked = rank * stacked, stacked * size
            if self.experts and stacked != self.experts:
                how = (
                    f" ({p.shape[d]} on each of {size} {self.axis!r} coordinates)"
                    if self.axis is not None
                    else ""
                )
                raise LayoutRuleError(
                    f"{self.describe()}: {ctx.key!r} stacks {stacked} experts along dim {d}{how}, "
                    f"expected experts={self.experts}"
                )
            head, tail = p.fqn[: m.start()], p.fqn[m.end() :]
            template = expand(self, m, self.repl)
            shape = p.shape[:d] + p.shape[d + 1 :]
            offsets = p.offsets[:d] + p.offsets[d + 1 :]
            for i in range(p.data.shape[d]):
                name = head + template.replace("{}", str(offset + i)) + tail
                out.append(Piece(name, shape, offsets, p.data.select(d, i)))
        return _like(pieces, out)


@dataclass(frozen=True)
class Unstacked(StackRule):
    """Tensors of one expert each, as boxes of one logical tensor stacking all ``E`` along ``dim``.

    ``Unstacked(r"\\.experts\\.(\\d+)\\.(w[123])\\.weight$", repl=r".experts.\\2", experts=8)``
    makes ``experts.5.w1.weight`` of shape ``[ffn, hidden]`` the box
    ``[5:6]`` of ``experts.w1`` of shape ``[8, ffn, hidden]``, viewed with
    ``dim`` unsqueezed. Group 1 of the pattern is the global expert index
    (a :class:`Reindex` before it turns an expert-parallel rank's local
    index into the global one); ``repl`` replaces the match to give the
    stacked name. A tensor-parallel split inside the expert is a layout rule
    matching the per-expert name, or the DTensor's placements.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.regex.groups < 1:
            raise LayoutRuleError(
                f"{self.describe()}: the pattern needs a capture group (the expert index)"
            )
        if self.experts <= 0:
            raise LayoutRuleError(
                f"{self.describe()}: give experts, the number of experts the stacked tensor holds"
            )

    def restack(self, pieces: TensorPieces, rank: int, size: int, ctx: RuleContext) -> TensorPieces:
        out = []
        for p in pieces.pieces:
            m = self._match(p.fqn, ctx)
            try:
                e = int(m.group(1))
            except (TypeError, ValueError):
                raise LayoutRuleError(
                    f"{self.describe()}: group 1 of the match in {p.fqn!r} is {m.group(1)!r}, "
                    "not an expert index"
                ) from None
            if not 0 <= e < self.experts:
                raise LayoutRuleError(
                    f"{self.describe()}: {p.fqn!r} (from {ctx.key!r}) is expert {e}, outside "
                    f"the {self.experts} experts of the stacked tensor"
                )
            n = len(p.shape)
            if not -(n + 1) <= self.dim <= n:
                raise LayoutRuleError(
                    f"{self.describe()}: {ctx.key!r} has {n} dims, so the stacked tensor has "
                    f"{n + 1}, which have no dim {self.dim}"
                )
            d = self.dim % (n + 1)
            name = _replace_match(self, p.fqn, m, self.repl)
            shape = p.shape[:d] + (self.experts,) + p.shape[d:]
            offsets = p.offsets[:d] + (e,) + p.offsets[d:]
            out.append(Piece(name, shape, offsets, p.data.unsqueeze(d)))
        return _like(pieces, out)


def _like(pieces: TensorPieces, new: list[Piece]) -> TensorPieces:
    """``new`` with the replication, padding and source of ``pieces``."""
    return TensorPieces(
        new,
        replicated=pieces.replicated,
        fill=pieces.fill,
        fill_value=pieces.fill_value,
        source=pieces.source,
    )


RULES: dict[str, type[Rule]] = {
    c.__name__: c
    for c in (Rename, Reindex, Shard, Fused, VocabPad, Replicated, Averaged, Stacked, Unstacked)
}
"""Every rule class by name (what :meth:`Rule.from_json` reads back)."""


def _check_dim(rule: Rule, name: str, t: torch.Tensor, dim: int) -> int:
    """``dim`` of ``t`` made non-negative; an error naming the rule if ``t`` has no such dim.
    (That ``dim`` is an int, every rule's constructor checks: ``check_field_types``.)"""
    if not -t.dim() <= dim < t.dim() or t.dim() == 0:
        raise LayoutRuleError(
            f"{rule.describe()} matches {name!r} of shape {list(t.shape)}, which has no dim {dim}"
        )
    return dim % t.dim()


def _piece_along(name: str, data: torch.Tensor, d: int, size: int, offset: int) -> Piece:
    """``data`` as a box of logical tensor ``name``: at ``offset`` of ``size`` along dim ``d``,
    whole along the others."""
    shape = list(data.shape)
    shape[d] = size
    offsets = [0] * data.dim()
    offsets[d] = offset
    return Piece(name, tuple(shape), tuple(offsets), data)


def full_piece(name: str, t: torch.Tensor, ctx: RuleContext) -> TensorPieces:
    """``t`` as one replicated piece: the whole logical tensor ``name``."""
    return TensorPieces(
        [Piece(name, tuple(t.shape), (0,) * t.dim(), t)], replicated=True, source=ctx.source
    )


@dataclass
class RuleContext:
    """What a layout rule knows about the key it cuts: the key, how errors name it, save or load,
    process groups."""

    key: str
    source: str
    save: bool
    groups: Mapping[str, Any]
