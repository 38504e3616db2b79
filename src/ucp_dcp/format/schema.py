"""Checks of untrusted JSON fields: the index and data-file headers are validated here before use.

Every check raises :class:`~ucp_dcp.CheckpointFormatError` naming ``where``
(the file and the record) and the field, so a damaged or hostile checkpoint
fails with a library error, never with a raw ``KeyError``/``TypeError`` or
an allocation of whatever size a field claims.

The options records users build (``ReadOptions``, ``RequestPolicy``, ...) are checked by the
same rules of what an int is: :func:`check_field_types`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Collection, Sequence
from typing import Any, TypeGuard

import torch

from ..core.boxes import Box
from ..core.sharding import tiles
from ..core.values import dtype_from_name, dtype_name
from ..errors import CheckpointFormatError, InvalidArgumentError, InvalidArgumentTypeError

__all__ = [
    "MAX_DIMS",
    "MAX_INT",
    "parse_json",
    "is_int",
    "field_int",
    "field_str",
    "field_list",
    "field_dict",
    "field_xxh3",
    "is_index_list",
    "field_dtype",
    "field_shape",
    "is_plain_file_name",
    "check_relative_name",
    "check_tensor_bytes",
    "check_chunk_box",
    "check_chunk_bytes",
    "check_paths",
    "check_field_types",
    "check_flags",
    "check_count",
]

MAX_DIMS = 64
"""Most dimensions a recorded tensor may have."""
MAX_INT = (1 << 63) - 1
"""Largest offset, size or count a record may hold (a file offset is a signed 64-bit integer)."""
_XXH3 = re.compile(r"[0-9a-f]{16}")


def parse_json(raw: bytes | str, message: str, advice: str = "") -> Any:
    """``raw`` parsed as JSON, or :class:`CheckpointFormatError` ``"<message> (<why>)<advice>"``.

    Catches everything ``json.loads`` raises on bad input: invalid UTF-8 or
    JSON, an integer of more than 4300 digits (``ValueError``), nesting too
    deep (``RecursionError``).
    """
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointFormatError(
            f"{message} ({type(e).__name__}: {str(e)[:200]}){advice}"
        ) from None


def is_int(v: Any) -> TypeGuard[int]:
    """An int that is not a bool (``True`` is an ``int`` subclass, never a size, count or index)."""
    return isinstance(v, int) and not isinstance(v, bool)


def field_int(d: Any, k: str, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """Integer field ``k`` of object ``d``, within ``[lo, hi]`` (booleans are not integers)."""
    v = d.get(k) if isinstance(d, dict) else None
    if not is_int(v):
        raise CheckpointFormatError(f"{where}: field {k!r} must be an integer, got {short_repr(v)}")
    if not lo <= v <= hi:
        raise CheckpointFormatError(f"{where}: field {k!r} is {short_repr(v)}, outside {lo}..{hi}")
    return v


def field_str(d: Any, k: str, where: str) -> str:
    """String field ``k`` of object ``d``."""
    v = d.get(k) if isinstance(d, dict) else None
    if not isinstance(v, str):
        raise CheckpointFormatError(f"{where}: field {k!r} must be a string, got {short_repr(v)}")
    return v


def field_list(d: Any, k: str, where: str) -> list[Any]:
    """List field ``k`` of object ``d``."""
    v = d.get(k) if isinstance(d, dict) else None
    if not isinstance(v, list):
        raise CheckpointFormatError(f"{where}: field {k!r} must be a list")
    return v


def field_dict(d: Any, k: str, where: str) -> dict[str, Any]:
    """Object field ``k`` of object ``d``."""
    v = d.get(k) if isinstance(d, dict) else None
    if not isinstance(v, dict):
        raise CheckpointFormatError(f"{where}: field {k!r} must be an object")
    return v


def field_xxh3(d: Any, k: str, where: str) -> str:
    """An xxh3-64 checksum: 16 lowercase hex digits."""
    return _field_hex64(d, k, where, "an xxh3-64 checksum")


def field_digest64(d: Any, k: str, where: str) -> str:
    """A placement digest (:mod:`ucp_dcp.core.placement_digest`): 16 lowercase hex digits."""
    return _field_hex64(d, k, where, "a 64-bit placement digest")


def _field_hex64(d: Any, k: str, where: str, what: str) -> str:
    v = field_str(d, k, where)
    if not _XXH3.fullmatch(v):
        raise CheckpointFormatError(
            f"{where}: field {k!r} must be {what} (16 hex digits), got {short_repr(v)}"
        )
    return v


def is_index_list(v: Any, n: int | None = None) -> TypeGuard[list[int]]:
    """Whether ``v`` is a list of non-negative integers (of length ``n``, when given) that fit in 63
    bits."""
    if not isinstance(v, list) or len(v) > MAX_DIMS or (n is not None and len(v) != n):
        return False
    for x in v:  # a plain loop: called for every shape and box of an index and of every header
        if type(x) is not int or not 0 <= x <= MAX_INT:  # int, not bool (a subclass of it)
            return False
    return True


# Quantized and sub-byte integer dtypes: torch has names for them, but no
# checkpoint holds them and most copies into them fail.
_NOT_STORED = re.compile(r"q.*|u?int[1-7]")


def field_dtype(d: Any, k: str, where: str) -> torch.dtype:
    """A torch dtype by name (``"float32"``)."""
    name = field_str(d, k, where)
    try:
        dtype = dtype_from_name(name)
    except ValueError as e:
        raise CheckpointFormatError(f"{where}: {e}") from None
    if _NOT_STORED.fullmatch(name):
        raise CheckpointFormatError(f"{where}: dtype {name!r} is not one a checkpoint holds")
    return dtype


def field_shape(d: Any, k: str, where: str) -> tuple[int, ...]:
    """A shape: at most :data:`MAX_DIMS` non-negative integers."""
    v = d.get(k) if isinstance(d, dict) else None
    if not is_index_list(v):
        raise CheckpointFormatError(f"{where}: malformed {k} {short_repr(v)}")
    return tuple(v)


def is_plain_file_name(name: Any) -> TypeGuard[str]:
    """Whether ``name`` is a string naming a file directly inside a directory: not empty, ``.`` or
    ``..``, no path separator (``/``, ``\\``: nor absolute), no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )


def check_relative_name(name: Any, where: str, what: str = "data file name") -> str:
    """``name`` if it is a plain file name (:func:`is_plain_file_name`); else an error naming
    ``where`` and ``what``.

    A hostile index must not make the reader open files outside the checkpoint.
    """
    if not is_plain_file_name(name):
        raise CheckpointFormatError(
            f"{where}: {what} {name!r} is not a plain file name inside the checkpoint directory "
            "(it is absolute, holds a path separator or a NUL, or is '.' or '..')"
        )
    return name


def check_tensor_bytes(
    shape: Sequence[int], dtype: torch.dtype, available: int, where: str
) -> None:
    """Refuse a tensor the data files cannot hold, before anything is allocated for it.

    ``available`` is the total size of the data files. A tensor of ``numel``
    elements needs ``numel * itemsize`` bytes of them; an empty tensor must
    still have strides that fit in 63 bits.
    """
    need = math.prod(shape) * dtype.itemsize
    if need > available:
        raise CheckpointFormatError(
            f"{where}: {dtype_name(dtype)}{list(shape)} needs {need} bytes, more than the data "
            "files hold "
            f"together ({available} bytes)"
        )
    if math.prod(max(n, 1) for n in shape) * dtype.itemsize > MAX_INT:
        raise CheckpointFormatError(f"{where}: shape {list(shape)} is too large to address")


def check_chunk_box(offsets: Any, sizes: Any, shape: Sequence[int], where: str) -> Box:
    """The box ``offsets``+``sizes`` of a chunk of a tensor of ``shape``, refused unless both are
    index lists of its rank and the box lies inside the tensor."""
    if not (is_index_list(offsets, len(shape)) and is_index_list(sizes, len(shape))):
        raise CheckpointFormatError(
            f"{where}: malformed offsets/sizes for a tensor of shape {list(shape)}"
        )
    box = Box(tuple(offsets), tuple(sizes))
    if not box.fits(shape):
        raise CheckpointFormatError(
            f"{where}: box {offsets}+{sizes} lies outside shape {list(shape)}"
        )
    return box


def check_chunk_bytes(box: Box, dtype: torch.dtype, nbytes: int, where: str) -> None:
    """Refuse a chunk recorded as ``nbytes`` bytes that are not its elements times the item size."""
    if box.numel * dtype.itemsize != nbytes:
        raise CheckpointFormatError(
            f"{where}: {nbytes} bytes recorded for {box.numel} {dtype_name(dtype)} elements"
        )


def check_tiling(boxes: Sequence[Box], shape: Sequence[int], where: str) -> None:
    """Refuse chunks that do not hold every element of the tensor exactly once: a gap would
    load as whatever memory held, an overlap as whichever chunk came last."""
    if tiles(boxes, shape):
        return
    covered, total = sum(b.numel for b in boxes), math.prod(shape)
    if covered != total:
        raise CheckpointFormatError(f"{where}: its chunks hold {covered} of its {total} elements")
    raise CheckpointFormatError(
        f"{where}: its chunks hold as many elements as the tensor but overlap, so some elements "
        "are in none"
    )


def short_repr(v: Any) -> str:
    """``repr(v)``, cut to 80 characters (an error message quotes what it was given)."""
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def check_paths(doc: Any, where: str, keys: Collection[str]) -> dict[str, tuple[str | int, ...]]:
    """Nesting paths ``{key: [component, ...]}``: each for a known key, and naming that key when
    joined with dots."""
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{where}: must be an object of key -> path")
    out: dict[str, tuple[str | int, ...]] = {}
    for k, path in doc.items():
        ok = (
            isinstance(path, list)
            and 0 < len(path) <= 64
            and all(isinstance(c, str) or (is_int(c) and c >= 0) for c in path)
        )
        if not ok or k not in keys or ".".join(map(str, path)) != k:
            raise CheckpointFormatError(f"{where}: {k!r}: malformed path {path!r}"[:300])
        out[k] = tuple(path)
    return out


def check_field_types(record: Any) -> None:
    """Refuse a dataclass ``record`` (an options record: ``ReadOptions``, ``RequestPolicy``, ...)
    a field of which holds another type than its annotation, with
    :class:`~ucp_dcp.errors.InvalidArgumentTypeError` naming the class and field.

    An ``int`` field takes an int, not a bool; a ``float`` field any int or float, not a bool; a
    ``bool`` field True or False (a truthy ``"no"`` is refused); ``X | None`` None too; a class
    an instance of it, a generic (``dict[str, Any]``) an instance of its class. Other
    annotations (``object``, ``Any``, ``Literal``) accept anything.
    """
    cls: Any = type(record)
    for name, kinds in _checked_fields(cls):
        v = getattr(record, name)
        if not any(_holds(k, v) for k in kinds):
            said = " or ".join(_KIND_WORDS.get(k, f"a {k.__name__}") for k in kinds)
            raise InvalidArgumentTypeError(
                f"{cls.__name__}.{name} must be {said}, got {type(v).__name__}"
            )


@functools.cache
def _checked_fields(cls: Any) -> tuple[tuple[str, tuple[type, ...]], ...]:
    """The fields of dataclass ``cls`` that :func:`check_field_types` checks, each with the
    types its annotation allows: worked out once per class (``get_type_hints`` evaluates every
    annotation, and a reader makes a ``RequestPolicy`` per load)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = tuple(
            typing.get_origin(k) or k for k in (typing.get_args(hint) if union else (hint,))
        )
        if all(isinstance(k, type) for k in kinds) and object not in kinds:
            out.append((f.name, kinds))
    return tuple(out)


def check_count(
    owner: str, name: str, v: Any, low: int = 1, *, optional: bool = False, why: str = ""
) -> None:
    """Field ``name`` of options record ``owner`` must be an int >= ``low`` (or None, where
    ``optional``): :class:`~ucp_dcp.errors.InvalidArgumentError` naming it otherwise, with
    ``why`` (what the bound protects) after the value."""
    if (optional and v is None) or (is_int(v) and v >= low):
        return
    none = "None or " if optional else ""
    raise InvalidArgumentError(f"{owner}.{name} must be {none}an int >= {low}, got {v!r}{why}")


def check_flags(who: str, **flags: object) -> None:
    """Each keyword argument ``flags`` of call ``who`` must be True or False:
    :class:`~ucp_dcp.errors.InvalidArgumentTypeError` naming it otherwise (a truthy ``"no"``
    must not mean True)."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise InvalidArgumentTypeError(
                f"{who}({name}={v!r}): takes True or False, got {type(v).__name__}"[:300]
            )


_KIND_WORDS = {bool: "True or False", int: "an int", float: "a number", type(None): "None"}


def _holds(kind: type, v: Any) -> bool:
    """Whether ``v`` is of annotated type ``kind`` (an int is a float; a bool is neither)."""
    if kind is int:
        return is_int(v)
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, kind)
