"""A declarative layout language: regex rules that say how a rank's tensors map to logical tensors.

A :class:`LayoutSpec` is a list of rules, matched by regular expression on the
DCP-flattened key of every state-dict leaf, that turn each tensor into
:class:`~ucp_dcp.core.pieces.TensorPieces` of canonical *logical* tensors (global
names, unfused, unpadded). The checkpoint then holds ``layers.12.attn.q.weight``
whatever layout saved it, and the same kind of spec, built for the target
layout, loads it (docs/layouts.md, "Layout rules")::

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
4. The first *stack* rule (:class:`Stacked`, :class:`Unstacked`) that
   matches the renamed key then re-expresses those pieces (a DTensor's
   included) between experts stacked along one dim and experts one by one;
   under a stack rule a plain tensor no layout rule matches holds whole
   experts.

The rules themselves are in :mod:`ucp_dcp.adapters.rules`; every name used above is
importable from :mod:`ucp_dcp`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from .._compat import compute_local_shape_and_global_offset, flatten_state_dict
from ..byteio.transfer import narrowed
from ..core.pieces import Piece, TensorPieces
from ..core.sharding import Box, intersect
from ..core.values import RankLocal, copy_containers, set_in_place
from ..errors import LayoutRuleError
from ..format.names import LAYOUT_KEY
from .rules import LayoutRule, Reindex, Rename, Rule, RuleContext, StackRule, expand, full_piece

__all__ = ["LayoutSpec", "LAYOUT_KEY"]

_JSON_VERSION = 1


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
        if isinstance(self.rules, (str, bytes, Rule)) or not isinstance(self.rules, Iterable):
            raise LayoutRuleError(
                f"LayoutSpec: rules must be a list of layout rules, got {type(self.rules).__name__}"
            )
        self.rules = list(self.rules)
        if not isinstance(self.axes, Mapping):
            raise LayoutRuleError(
                "LayoutSpec: axes must map each axis name to (coordinate, size), got "
                f"{type(self.axes).__name__}"
            )
        bad = [r for r in self.rules if not isinstance(r, Rule)]
        if bad:
            raise LayoutRuleError(f"not layout rules: {bad!r}")
        axes = {}
        for name, coord in dict(self.axes).items():
            try:
                rank, size = (int(x) for x in coord)
            except (TypeError, ValueError):
                raise LayoutRuleError(
                    f"axis {name!r}: expected (coordinate, size), got {coord!r}"
                ) from None
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
                    name = r.regex.sub(functools.partial(_renamed, r), name)
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
                                f"{rule.describe()}: group 1 of the match in {key!r} is "
                                f"{m.group(1)!r}, "
                                f"not an integer"
                            ) from None
                        return text[: s - base] + str(idx + shift) + text[e - base :]

                    name = r.regex.sub(bump, name)
        return name

    def canonical_name(self, key: str) -> str:
        """The name ``key`` has after the :class:`Rename`/:class:`Reindex` rules."""
        return self._rename(key, set())

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
        if LAYOUT_KEY in state_dict:
            raise LayoutRuleError(f"the state dict already has the reserved key {LAYOUT_KEY!r}")
        flat, paths = flatten_state_dict(dict(state_dict))
        out = copy_containers(state_dict)
        used: set[int] = set()
        produced: _Produced = {}
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor):
                continue
            name = self._rename(key, used)
            new = self._pieces(key, name, value, used, record)
            if isinstance(new, TensorPieces):
                for p in new.pieces:
                    produced.setdefault(p.fqn, []).append((key, p.shape, p.box))
            else:
                produced.setdefault(name, []).append((key, tuple(value.shape), None))
            set_in_place(out, paths[key], new)
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

    def logical(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole logical tensors that one process's ``tensors`` hold (every axis of size
        1): renamed, fused ones split into their parts, each assembled from its pieces. Meta
        tensors give the names, shapes and dtypes without data. The hand-off tools use it to
        give a checkpoint's tensors another model's names (a Megatron QKV as Hugging Face's
        ``q_proj``, ``k_proj``, ``v_proj``).

        Raises:
            LayoutRuleError: an axis of size > 1, or a logical tensor its pieces do not cover
                whole (named).
        """
        wide = {a: n for a, (_, n) in self.axes.items() if n != 1}
        if wide:
            raise LayoutRuleError(
                f"logical tensors of one process need every axis of size 1, got {wide}"
            )
        out: dict[str, torch.Tensor] = {}
        covered: dict[str, int] = {}
        for key, value in self.apply(dict(tensors)).items():
            if not isinstance(value, TensorPieces):
                out[key] = value
                continue
            for p in value.pieces:
                t = out.get(p.fqn)
                if t is None:
                    t = out[p.fqn] = torch.empty(p.shape, dtype=p.data.dtype, device=p.data.device)
                    covered[p.fqn] = 0
                narrowed(t, p.offsets, p.data.shape).copy_(p.data)
                covered[p.fqn] += p.data.numel()
        short = [
            f"{k} ({n} of {out[k].numel()} elements)"
            for k, n in covered.items()
            if n != out[k].numel()
        ]
        if short:
            raise LayoutRuleError(f"the layout's pieces do not cover {', '.join(short)}")
        return out

    @staticmethod
    def update_values(state_dict: Mapping[str, Any], applied: Mapping[str, Any]) -> None:
        """Copy the non-tensor values a ``dcp.load`` put into ``applied`` back into ``state_dict``.

        Tensors load in place into the caller's tensors, but ``dcp.load``
        replaces non-tensor values (a step counter, ``param_groups``) in the
        dict it was given, the one :meth:`apply` returned. (A
        :class:`~ucp_dcp.RankLocal` is the same object in both.)
        """
        flat, paths = flatten_state_dict(dict(state_dict))
        loaded, _ = flatten_state_dict(dict(applied))  # same structure, so the same keys
        for key, path in paths.items():
            if not isinstance(flat[key], torch.Tensor):
                set_in_place(state_dict, path, loaded[key])

    def _pieces(self, key: str, name: str, value: torch.Tensor, used: set[int], save: bool) -> Any:
        rule = stack = None
        for i, r in enumerate(self.rules):
            if rule is None and isinstance(r, LayoutRule) and r.regex.search(name):
                rule, rule_index = r, i
            elif stack is None and isinstance(r, StackRule) and r.regex.search(name):
                stack, stack_index = r, i
        source = key if key == name else f"{key} -> {name}"
        ctx = RuleContext(key=key, source=source, save=save, groups=self.groups)
        if isinstance(value, DTensor):
            if rule is not None:
                raise LayoutRuleError(
                    f"{rule.describe()} matches {key!r}, a DTensor: a DTensor describes its own "
                    "layout; "
                    f"change the rule's pattern so it does not match it"
                )
            if stack is None:
                return value if name == key else _dtensor_pieces(name, value, source)
            if getattr(stack, "axis", None) is not None:
                raise LayoutRuleError(
                    f"{stack.describe()} matches {key!r}, a DTensor: its placements say which "
                    "experts this rank holds; leave the rule's axis unset"
                )
            used.add(stack_index)
            return stack.restack(_dtensor_pieces(name, value, source), 0, 1, ctx)
        if rule is None:
            if stack is None and self.strict:
                raise LayoutRuleError(
                    f"the layout cannot explain {key!r}"
                    + (f" (renamed {name!r})" if name != key else "")
                    + f" (shape {list(value.shape)}, {value.dtype}): no layout rule matches it; "
                    "add e.g. "
                    f"Replicated({re.escape(name.rsplit('.', 1)[-1])!r}) if every rank holds the "
                    "same copy"
                )
            # Under a stack rule a tensor no layout rule cuts holds its experts whole.
            pieces = full_piece(name, value.detach(), ctx)
        else:
            used.add(rule_index)
            rank, size = self._coord(rule.axis)
            pieces = rule.pieces(name, value.detach(), rank, size, ctx)
        if stack is None:
            return pieces
        used.add(stack_index)
        return stack.restack(pieces, *self._coord(getattr(stack, "axis", None)), ctx)

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
    def from_json(
        cls, data: Mapping[str, Any], *, groups: Mapping[str, Any] | None = None
    ) -> LayoutSpec:
        """Rebuild a spec written by :meth:`to_json` (``groups``: process groups, if averaging)."""
        version = data.get("version") if isinstance(data, Mapping) else None
        if version != _JSON_VERSION:
            raise LayoutRuleError(
                f"layout spec JSON version {version!r}; this code reads {_JSON_VERSION}"
            )
        try:
            return cls(
                [Rule.from_json(r) for r in data["rules"]],
                axes={k: (int(v[0]), int(v[1])) for k, v in data.get("axes", {}).items()},
                groups=dict(groups or {}),
                strict=bool(data.get("strict", True)),
                allow_unused_rules=bool(data.get("allow_unused_rules", False)),
            )
        except LayoutRuleError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            # A spec written by another version, or edited: a field this code does not know, or
            # one missing, is named, never taken as absent.
            raise LayoutRuleError(f"malformed layout spec JSON ({type(e).__name__}: {e})") from None


def _renamed(rule: Rename, m: re.Match[str]) -> str:
    return expand(rule, m, rule.repl)


def _dtensor_pieces(name: str, value: Any, source: str) -> TensorPieces:
    """A renamed DTensor's local shard as a piece of logical tensor ``name``."""
    placements = tuple(value.placements)
    if any(not isinstance(p, (Replicate, DShard)) for p in placements) or any(
        type(p) is not DShard and isinstance(p, DShard) for p in placements
    ):
        raise LayoutRuleError(
            f"{source}: a renamed DTensor with placements {placements} (only Shard and Replicate "
            "can be renamed)"
        )
    local = value.to_local().detach()
    shape, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, placements
    )
    if tuple(shape) != tuple(local.shape):
        raise LayoutRuleError(
            f"{source}: DTensor local shape {list(local.shape)} is not the expected {list(shape)}"
        )
    replicated = any(isinstance(p, Replicate) for p in placements)
    pieces = [Piece(name, tuple(value.shape), tuple(offsets), local)] if local.numel() else []
    return TensorPieces(pieces, replicated=replicated, source=source)


_Produced = dict[str, list[tuple[str, tuple[int, ...], Box | None]]]


def _check_collisions(produced: _Produced) -> None:
    """No two state-dict keys may hold the same part of a logical tensor."""
    for fqn, items in produced.items():
        keys = list(dict.fromkeys(k for k, *_ in items))
        if len(keys) < 2:
            continue
        if any(box is None for _, _, box in items):  # a DTensor left as it is
            raise LayoutRuleError(f"keys {keys} all map to the logical tensor {fqn!r}")
        shapes = {shape for _, shape, _ in items}
        if len(shapes) > 1 and not all(len(s) == 0 for s in shapes):
            raise LayoutRuleError(
                f"keys {keys} map to the logical tensor {fqn!r} with different global shapes "
                f"{[list(s) for s in shapes]}"
            )
        boxes = [(k, box) for k, _, box in items if box is not None]
        for i, (ka, a) in enumerate(boxes):
            for kb, b in boxes[i + 1 :]:
                if ka != kb and intersect(a, b) is not None:
                    raise LayoutRuleError(
                        f"keys {ka!r} and {kb!r} both hold rows of the logical tensor {fqn!r} at "
                        "overlapping boxes "
                        f"(offsets {list(a.offsets)} and {list(b.offsets)}); check the "
                        "Rename/Reindex rules"
                    )
