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

Where the checkpoint has no such patterns (Megatron-style code that never
recorded them), or wrong ones, the user supplies rules (:func:`user_tp_rules`):
the layout rules of :mod:`ucp_dcp.adapters.rules` (``Shard(pattern, dim=d)``,
``VocabPad(pattern, size=n)``, ``Replicated(pattern)``), a ``LayoutSpec``
holding them, or their JSON form (``Rule.to_json()``). They are read as data
(``to_json``), so this layer imports nothing of ``adapters``. A user rule is
``re.search``-ed in the engine name, the first match decides (as in a
``LayoutSpec``), and it wins over the checkpoint's patterns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..core.sharding import Box
from ..errors import CheckpointFormatError, InvalidArgumentError

__all__ = ["TPRule", "TPRules", "TPSlice", "tp_rules", "user_tp_rules"]

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
    "sub_param_shard_widths",
    "affine_params",
)
# AutoTP's parameters it could not describe ({pattern: reason}): refused unless a user rule
# places them.
_AUTOTP_UNSUPPORTED = "autotp_unsupported_parameter_patterns"
# User rules this reader places (the adapters.rules class names).
_USER_KINDS = ("Shard", "VocabPad", "Replicated", "Averaged")


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
class TPRule:
    """One user-supplied partitioning rule: parameters whose engine name ``pattern`` is
    ``re.search``-ed in are ``kind`` (an ``adapters.rules`` class name: ``Shard`` joined along
    ``dim``, ``VocabPad`` joined along 0 and cut to ``size`` rows, ``Replicated``, ``Averaged``);
    ``text`` is the rule as the user wrote it, for messages."""

    pattern: str
    kind: str
    dim: int = 0
    size: int = 0
    text: str = ""

    def slice_of(
        self, where: str, name: str, rank: int, degree: int, local: tuple[int, ...]
    ) -> TPSlice:
        """Where ``rank``'s slice (shape ``local``) of ``name`` goes by this rule."""
        if self.kind == "Averaged":
            raise CheckpointFormatError(
                f"{where}: {name!r} matches tp_rules' {self.text}: its value is the mean of the "
                "tensor-parallel slices, which cannot be read in place"
            )
        if self.kind == "Replicated":
            return TPSlice(rank, local, None, degree)
        if not 0 <= self.dim < len(local):
            raise CheckpointFormatError(
                f"{where}: {name!r} of shape {local} cannot be joined along dimension "
                f"{self.dim} (tp_rules' {self.text})"
            )
        if self.kind == "Shard":
            return TPSlice(rank, local, self.dim, degree)
        joined = local[0] * degree
        if self.size > joined:
            raise CheckpointFormatError(
                f"{where}: {name!r}: tp_rules' {self.text} keeps {self.size} rows, but its "
                f"{degree} slices of {local[0]} rows join to {joined}"
            )
        return TPSlice(rank, local, 0, degree, self.size)


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
    ``Averaged``) or of their JSON dicts (``Rule.to_json()``). Anything else, and a
    ``VocabPad`` along a dimension other than 0, is refused naming the rule."""
    if rules is None:
        return ()
    if not isinstance(rules, (list, tuple)) and hasattr(rules, "rules"):
        rules = rules.rules  # a LayoutSpec: its axes describe a rank of the new layout, not this
    if isinstance(rules, (str, bytes, dict)) or not hasattr(rules, "__iter__"):
        raise InvalidArgumentError(
            f"tp_rules: expected a LayoutSpec or a list of layout rules (Shard, VocabPad, "
            f"Replicated), got {type(rules).__name__}"
        )
    out = []
    for r in rules:
        d = r.to_json() if hasattr(r, "to_json") else r
        if not isinstance(d, dict) or not isinstance(d.get("pattern"), str):
            raise InvalidArgumentError(
                f"tp_rules: {r!r} is not a layout rule (Shard, VocabPad, Replicated) or its JSON"
            )
        text = r.describe() if hasattr(r, "describe") else _rule_text(d)
        if d.get("rule") not in _USER_KINDS:
            raise InvalidArgumentError(
                f"tp_rules: {text} is not a tensor-parallel partitioning rule: expected one of "
                f"{', '.join(_USER_KINDS)} (fused sub-parameter layouts are not supported)"
            )
        try:
            re.compile(d["pattern"])
        except re.error as e:
            raise InvalidArgumentError(f"tp_rules: {text}: {e}") from None
        dim, size = d.get("dim", 0), d.get("size", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dim, size)):
            raise InvalidArgumentError(f"tp_rules: {text}: dim and size must be integers")
        if d["rule"] == "VocabPad" and (dim != 0 or size <= 0):
            raise InvalidArgumentError(
                f"tp_rules: {text}: vocabulary padding is cut along dimension 0 only, to a "
                "positive size"
            )
        out.append(TPRule(d["pattern"], d["rule"], dim, size, text))
    return tuple(out)


@dataclass(frozen=True)
class TPRules:
    """The partitioning patterns of one checkpoint (from ``where``), after the user's rules.

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

    def slice_of(self, name: str, rank: int, degree: int, local: tuple[int, ...]) -> TPSlice:
        """Where ``rank``'s slice (shape ``local``) of parameter ``name`` goes."""
        rule = self.user_rule(name)
        if rule is not None:
            return rule.slice_of(self.where, name, rank, degree, local)
        if self.missing is not None:
            raise _unknown_split(self.where, self.missing, [name], bool(self.user))
        self.check_supported([name])
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


def _unknown_split(
    where: str, missing: str, params: list[str], user: bool
) -> CheckpointFormatError:
    """The refusal of ``params``, whose split no rule gives (``user``: the user gave some)."""
    shown = ", ".join(params[:6]) + (" ..." if len(params) > 6 else "")
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
    missing patterns.
    """
    if not isinstance(info, dict) or not any(
        info.get(k) for k in (_REPLICATED, _ROW, _VOCAB, _AVERAGE)
    ):
        missing = (
            "is missing"
            if not isinstance(info, dict)
            else f"has none of {_REPLICATED}, {_ROW}, {_VOCAB}, {_AVERAGE}"
        )
        rules = TPRules(where, (), (), (), (), None, user, missing)
        unplaced = [p for p in params if rules.user_rule(p) is None]
        if unplaced:
            raise _unknown_split(where, missing, unplaced, bool(user))
        return rules
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
    unsupported = info.get(_AUTOTP_UNSUPPORTED) or {}
    if not isinstance(unsupported, dict) or not all(isinstance(p, str) for p in unsupported):
        raise CheckpointFormatError(
            f"{where}: {_INFO}[{_AUTOTP_UNSUPPORTED!r}] is not a dict of patterns"
        )
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
    )
    rules.check_supported(params)
    return rules
