"""Looking into checkpoints: a summary of one, and the differences between two.

:func:`inspect_checkpoint` reads only the index (and the ``step`` value, when
there is one): it reports format version, world size, files, and per tensor
its dtype, global shape, saved sharding and size. :func:`diff_checkpoints`
compares two checkpoints name by name: what only one of them holds, shape,
dtype and kind differences, per tensor the largest absolute difference
(NaN-aware), and differing values. Tensors are read one at a time and
compared in float64 slices, so memory stays at about two copies of the
largest tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..byteio.progress import ProgressFn, progress_fn
from ..errors import CheckpointFormatError, InvalidArgumentError
from ..format import TensorRecord, dtype_name
from ..format.schema import short_repr
from .checkpoint import Checkpoint

__all__ = [
    "inspect_checkpoint",
    "describe_sharding",
    "diff_checkpoints",
    "compare_tensors",
    "DiffReport",
    "TensorDiff",
    "Mismatch",
]


# Elements compared per slice: a few float64 temporaries of this many
# elements bound the memory the comparison adds on top of the two tensors.
_COMPARE_ELEMS = 1 << 22


# ====================================================================== inspect


def describe_sharding(rec: TensorRecord) -> str:
    """How a tensor was saved, in one short phrase.

    ``"mesh [2,2] SS(0,2),S(0)"`` for a DTensor layout (mesh shape, then one
    placement per mesh dimension), ``"replicated"`` for a plain tensor saved
    once, ``"explicit 3 chunks"`` for chunks that follow no regular layout.
    """
    if not rec.compact:
        n = len(rec.chunks)
        return f"explicit {n} chunk{'' if n == 1 else 's'}"
    layout = rec.layout
    if layout is None or not layout.mesh:
        return "replicated"
    return f"mesh [{','.join(map(str, layout.mesh))}] {','.join(layout.placements)}"


def _tensor_bytes(rec: TensorRecord) -> int:
    return math.prod(rec.shape) * rec.dtype.itemsize


def _as_step(v: Any) -> int | float | None:
    """A step counter as a plain number, or None when ``v`` is not one."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else None
    if hasattr(v, "item") and getattr(v, "size", None) == 1:  # numpy scalars and 1-element arrays
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v


def _step_key(ck: Checkpoint) -> str | None:
    """``"step"`` if such a value or single-element tensor exists, else the
    shallowest value whose key ends in ``.step``, else None."""
    if "step" in ck.index.values:
        return "step"
    rec = ck.index.tensors.get("step")
    if rec is not None and math.prod(rec.shape) == 1:
        return "step"
    nested = [k for k in ck.index.values if k.endswith(".step")]
    return min(nested, key=lambda k: (k.count("."), k)) if nested else None


def _read_step(ck: Checkpoint, key: str) -> int | float | None:
    if key in ck.index.values:
        return _as_step(ck.read_value(key))
    return _as_step(ck.read_tensor(key))


def inspect_checkpoint(
    path: str | os.PathLike[str],
    *,
    describe: Callable[[BaseException], str] = str,
    **open_kw: Any,
) -> dict[str, Any]:
    """A JSON-ready summary of the checkpoint at ``path`` (any format; ``open_kw`` as for
    :class:`Checkpoint`).

    ``path`` may be the fsspec URL of a universal checkpoint in object
    storage (``storage_options=`` among ``open_kw`` go to fsspec).

    Keys: ``path``, ``format`` (``"ucp_dcp version 1"``, ``"dcp"``, ``"hf"``, ...),
    ``format_version``, ``checksums`` (whether the format records them), ``world_size``, ``step``
    and ``step_key`` (None when no step counter is found), ``files`` (``count``, ``bytes``),
    ``tensors`` (per tensor: ``name``, ``dtype``, ``shape``, ``sharding``, ``bytes``; sorted by
    name), ``values`` and ``rank_local`` (names), ``totals`` (``tensors``, ``tensor_bytes``,
    ``values``, ``rank_local``) and ``warnings`` (problems met while reading the step counter, each
    put in words by ``describe``: the command line passes one that names its own flags; the rest of
    the summary needs only the index).

    Raises :class:`~ucp_dcp.CheckpointFormatError` when ``path`` is not a
    readable checkpoint.
    """
    with Checkpoint(path, **open_kw) as ck:
        index = ck.index
        tensors = [
            {
                "name": name,
                "dtype": dtype_name(rec.dtype),
                "shape": list(rec.shape),
                "sharding": describe_sharding(rec),
                "bytes": _tensor_bytes(rec),
            }
            for name, rec in sorted(index.tensors.items())
        ]
        warnings: list[str] = []
        key = _step_key(ck)
        step = None
        if key is not None:
            try:
                step = _read_step(ck, key)
            except (CheckpointFormatError, ValueError, OSError, EOFError) as e:
                warnings.append(f"cannot read the step counter {key!r}: {describe(e)}")
        return {
            "path": ck.path,
            "format": f"{ck.format} version {index.version}"
            if ck.format == "ucp_dcp"
            else ck.format,
            "format_version": index.version,
            "checksums": ck.has_checksums,
            "world_size": index.world_size,
            "step": step,
            "step_key": key,
            "files": {"count": len(index.files), "bytes": sum(f.size for f in index.files)},
            "tensors": tensors,
            "values": ck.value_names(),
            "rank_local": ck.rank_local_names(),
            "totals": {
                "tensors": len(tensors),
                "tensor_bytes": sum(t["bytes"] for t in tensors),
                "values": len(index.values),
                "rank_local": len(index.rank_local),
            },
            "warnings": warnings,
        }


# ====================================================================== diff


@dataclass(frozen=True)
class Mismatch:
    """Entry ``name`` differs between the checkpoints: ``a`` and ``b`` describe each side."""

    name: str
    a: str
    b: str


@dataclass(frozen=True)
class TensorDiff:
    """The element-wise comparison of a tensor present in both checkpoints with the same shape.

    NaN equals NaN; ``-0.0`` equals ``0.0`` (values are compared, not bits).
    """

    name: str
    numel: int
    max_abs_diff: float  # largest |a - b| over elements where neither side is NaN
    num_different: int  # elements that differ (NaN on one side only counts)
    nan_mismatches: int  # elements that are NaN on exactly one side

    @property
    def identical(self) -> bool:
        """Every element is equal."""
        return self.num_different == 0

    def within(self, atol: float) -> bool:
        """No NaN mismatch and no element further apart than ``atol``."""
        return self.nan_mismatches == 0 and self.max_abs_diff <= atol


@dataclass
class DiffReport:
    """What differs between checkpoints ``a`` and ``b``.

    Names are those of tensors, values and rank-local values alike.
    ``tensors`` holds every tensor present in both with the same shape
    (also when the dtypes differ: they are compared as float64).
    """

    a: str
    b: str
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    kind_mismatches: list[Mismatch] = field(
        default_factory=list
    )  # tensor on one side, value on the other
    shape_mismatches: list[Mismatch] = field(default_factory=list)
    dtype_mismatches: list[Mismatch] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    value_mismatches: list[Mismatch] = field(default_factory=list)  # values and rank-local values
    values_compared: int = 0

    @property
    def identical(self) -> bool:
        """Same names, kinds, shapes, dtypes, and equal tensors and values."""
        return self.within(0.0) and all(t.identical for t in self.tensors)

    def within(self, atol: float) -> bool:
        """Like :attr:`identical`, but tensors may differ by up to ``atol`` per element."""
        structural = (
            self.only_in_a,
            self.only_in_b,
            self.kind_mismatches,
            self.shape_mismatches,
            self.dtype_mismatches,
            self.value_mismatches,
        )
        return not any(structural) and all(t.within(atol) for t in self.tensors)

    def differences(self, atol: float = 0.0) -> list[str]:
        """One human-readable line per difference (tensors within ``atol`` are not listed)."""
        lines = [f"only in {self.a}: {n}" for n in self.only_in_a]
        lines += [f"only in {self.b}: {n}" for n in self.only_in_b]
        lines += [
            f"{m.name}: a {m.a} in {self.a}, a {m.b} in {self.b}" for m in self.kind_mismatches
        ]
        lines += [f"{m.name}: shape {m.a} vs {m.b}" for m in self.shape_mismatches]
        lines += [f"{m.name}: dtype {m.a} vs {m.b}" for m in self.dtype_mismatches]
        for t in self.tensors:
            if t.identical or (atol > 0 and t.within(atol)):
                continue
            line = (
                f"{t.name}: max abs diff {t.max_abs_diff:.6g}, {t.num_different} of {t.numel} "
                "elements differ"
            )
            if t.nan_mismatches:
                line += f", {t.nan_mismatches} NaN on one side only"
            lines.append(line)
        lines += [f"{m.name}: value {m.a} vs {m.b}" for m in self.value_mismatches]
        return lines

    def to_json(self, atol: float = 0.0) -> dict[str, Any]:
        """A JSON-ready form (non-finite numbers as the strings ``"inf"``/``"nan"``)."""
        doc = _finite(asdict(self))
        doc.update(identical=self.identical, atol=atol, within_atol=self.within(atol))
        return doc


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _kinds(ck: Checkpoint) -> dict[str, str]:
    kinds = {n: "rank-local value" for n in ck.index.rank_local}
    kinds.update({n: "value" for n in ck.index.values})
    kinds.update({n: "tensor" for n in ck.index.tensors})
    return kinds


def compare_tensors(x: torch.Tensor, y: torch.Tensor, name: str = "") -> TensorDiff:
    """Compare same-shape tensors ``x`` and ``y`` element-wise, in float64 slices.

    Integer and bool tensors of the same dtype are counted as different
    exactly (not through float64); the magnitude of a difference is always
    computed in float64 (complex128 when either side is complex).
    """
    if x.shape != y.shape:
        raise InvalidArgumentError(
            f"{name}: cannot compare shapes {list(x.shape)} and {list(y.shape)}"
        )
    exact_ints = x.dtype == y.dtype and not (x.dtype.is_floating_point or x.dtype.is_complex)
    work = torch.complex128 if (x.dtype.is_complex or y.dtype.is_complex) else torch.float64
    xf, yf = x.reshape(-1), y.reshape(-1)
    max_abs, ndiff, nnan = 0.0, 0, 0
    for s in range(0, xf.numel(), _COMPARE_ELEMS):
        xs, ys = xf[s : s + _COMPARE_ELEMS], yf[s : s + _COMPARE_ELEMS]
        xd, yd = xs.to(work), ys.to(work)
        xn, yn = torch.isnan(xd), torch.isnan(yd)
        same = (xd == yd) | (xn & yn)
        one_nan = xn ^ yn
        ndiff += int((xs != ys).sum()) if exact_ints else int((~same).sum())
        nnan += int(one_nan.sum())
        d = (xd - yd).abs().masked_fill_(same | one_nan, 0)
        max_abs = max(max_abs, float(d.max()))
    return TensorDiff(name, xf.numel(), max_abs, ndiff, nnan)


def _same_value(x: Any, y: Any) -> bool:
    """Deep equality of decoded values: types must match; NaN equals NaN."""
    if type(x) is not type(y):
        return False
    if isinstance(x, torch.Tensor):
        return x.dtype == y.dtype and x.shape == y.shape and compare_tensors(x, y).identical
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_value(v, y[k]) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_value(a, b) for a, b in zip(x, y))
    if type(x).__module__ == "numpy" and hasattr(x, "dtype"):
        import numpy as np

        if x.dtype != y.dtype or np.shape(x) != np.shape(y):
            return False
        return bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))
    if x != x and y != y:  # NaN scalars
        return True
    return bool(x == y)


def _diff_structure(ca: Checkpoint, cb: Checkpoint, report: DiffReport) -> list[str]:
    """Fill names-only-on-one-side and kind/shape/dtype mismatches; return tensors to compare."""
    ka, kb = _kinds(ca), _kinds(cb)
    report.only_in_a = sorted(ka.keys() - kb.keys())
    report.only_in_b = sorted(kb.keys() - ka.keys())
    to_compare = []
    for name in sorted(ka.keys() & kb.keys()):
        if ka[name] != kb[name]:
            report.kind_mismatches.append(Mismatch(name, ka[name], kb[name]))
            continue
        if ka[name] != "tensor":
            continue
        ra, rb = ca.index.tensors[name], cb.index.tensors[name]
        if ra.shape != rb.shape:
            report.shape_mismatches.append(Mismatch(name, str(list(ra.shape)), str(list(rb.shape))))
            continue
        if ra.dtype != rb.dtype:
            report.dtype_mismatches.append(
                Mismatch(name, dtype_name(ra.dtype), dtype_name(rb.dtype))
            )
        to_compare.append(name)
    return to_compare


def _diff_values(ca: Checkpoint, cb: Checkpoint, report: DiffReport) -> None:
    for names, read_a, read_b in (
        (ca.index.values.keys() & cb.index.values.keys(), ca.read_value, cb.read_value),
        (
            ca.index.rank_local.keys() & cb.index.rank_local.keys(),
            ca.read_rank_local,
            cb.read_rank_local,
        ),
    ):
        for name in sorted(names):
            va, vb = read_a(name), read_b(name)
            report.values_compared += 1
            if not _same_value(va, vb):
                report.value_mismatches.append(Mismatch(name, short_repr(va), short_repr(vb)))


def diff_checkpoints(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    on_progress: ProgressFn | None = None,
    **open_kw: Any,
) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (any formats; ``open_kw`` as for :class:`Checkpoint`:
    ``options``, ``storage_options``, ``prefix``, ``dcp_values``) entry by entry.

    Tensors present in both with the same shape are read one at a time
    (each side once) and compared in float64 slices; ``on_progress(done,
    total)`` reports the bytes read of both sides. Values and rank-local
    values are decoded and compared deeply. Either side may be an fsspec URL
    (one ``storage_options=`` among ``open_kw`` serves both). Raises
    :class:`~ucp_dcp.CheckpointFormatError` when either side cannot be read.
    """
    progress = progress_fn(on_progress, "diff_checkpoints")
    with Checkpoint(a, **open_kw) as ca, Checkpoint(b, **open_kw) as cb:
        report = DiffReport(ca.path, cb.path)
        names = _diff_structure(ca, cb, report)
        total = sum(
            _tensor_bytes(ca.index.tensors[n]) + _tensor_bytes(cb.index.tensors[n]) for n in names
        )
        done = 0
        for name in names:
            ta, tb = ca.read_tensor(name), cb.read_tensor(name)
            report.tensors.append(compare_tensors(ta, tb, name))
            done += ta.nbytes + tb.nbytes
            del ta, tb
            progress(done, total)
        _diff_values(ca, cb, report)
        return report
