"""Non-tensor values of a training state: stored as tagged JSON (never pickled), put back in place.

DCP stores such values (``param_groups``, step counters, RNG states) with ``torch.save`` and reads
them with ``torch.load``, which can run code from an untrusted checkpoint. Here they are JSON with
a few tags for what JSON cannot say itself (tuples, non-string dict keys, non-finite floats, small
tensors, numpy arrays, bytes, ``io.BytesIO``, dtypes); anything else, a namedtuple or an enum
included, is refused at save time with the key that holds it, rather than silently stringified,
pickled or loaded back as another type.

A load puts a replaced leaf (a decoded value, a piece set) back where the caller's nested state
dict holds it, at the path of container keys DCP recorded when it flattened the dict:
:func:`set_in_place`, in containers :func:`copy_containers` may have copied first.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._compat import set_element
from ..errors import CheckpointFormatError, InvalidArgumentError, UnsupportedValueError

__all__ = [
    "RankLocal",
    "UnsupportedValueError",
    "encode_value",
    "decode_value",
    "ReshardFn",
    "copy_containers",
    "set_in_place",
]

_TAG = "__ucp__"

ReshardFn = Callable[[str, "dict[int, Any]", int, int], Any]
"""``fn(key, saved_values_by_rank, rank, world_size) -> value`` for a rank-local
value loaded into a different world size."""


@dataclass
class RankLocal:
    """Marks a state-dict value as belonging to this rank alone.

    Every rank saves its own copy (a dataloader position, an RNG state).
    Loading into the same world size gives each rank its own value back, in
    ``.value``. Loading into another world size calls ``reshard`` (here, or
    the load planner's ``rank_local_reshard``) with every saved rank's value;
    without one the load fails naming the key, rather than handing a rank
    another rank's value.
    """

    value: Any
    reshard: ReshardFn | None = None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


# Built-in types a value may be, whose subclasses would come back as the base: a namedtuple as a
# tuple, an IntEnum as an int. Dict subclasses (OrderedDict) come back as dicts with their order.
_EXACT = (bool, int, float, str, list, tuple, bytes, bytearray)


def _check_exact(obj: Any, path: str) -> None:
    base = next((b for b in _EXACT if isinstance(obj, b)), None)
    if base is not None and type(obj) is not base and not isinstance(obj, (bool, torch.Size)):
        raise UnsupportedValueError(
            f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} (a subclass of "
            f"{base.__name__}) would load as a plain {base.__name__}; convert it to one (or to "
            "its fields) to save it"
        )


def _encode(obj: Any, path: str) -> Any:
    # Subclasses before their bases: numpy.float64 is a float, torch.Size a
    # tuple, bool an int; each must keep its own type through a round trip.
    if obj is None:
        return None
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise UnsupportedValueError(f"{path}: numpy arrays of Python objects cannot be saved")
        return {
            _TAG: "ndarray",
            "dtype": obj.dtype.str,
            "shape": list(obj.shape),
            "data": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode("ascii"),
        }
    if isinstance(obj, np.generic):
        return {_TAG: "npscalar", "dtype": obj.dtype.str, "v": _encode(obj.item(), path)}
    _check_exact(obj, path)
    if isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {_TAG: "float", "v": repr(obj)}  # 'nan', 'inf', '-inf'
    if isinstance(obj, list):
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, torch.Size):
        return {_TAG: "size", "v": list(obj)}
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "v": [_encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: _encode(v, f"{path}.{k}") for k, v in obj.items()}
        return {
            _TAG: "dict",
            "v": [[_encode(k, path), _encode(v, f"{path}[{k!r}]")] for k, v in obj.items()],
        }
    if isinstance(obj, torch.dtype):
        return {_TAG: "dtype", "v": dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {_TAG: "device", "v": str(obj)}
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise UnsupportedValueError(
                f"{path}: a {type(obj).__name__} nested inside a non-tensor value cannot be saved; "
                "put it directly in the state dict so it is saved as a tensor"
            )
        return {
            _TAG: "tensor",
            "dtype": dtype_name(obj.dtype),
            "shape": list(obj.shape),
            "data": base64.b64encode(_tensor_bytes(obj)).decode("ascii"),
        }
    if isinstance(obj, (bytes, bytearray)):
        tag = "bytes" if isinstance(obj, bytes) else "bytearray"
        return {_TAG: tag, "v": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, io.BytesIO):
        # DCP stores a BytesIO value as its raw bytes (no pickle) and loads a BytesIO back.
        return {_TAG: "bytesio", "v": base64.b64encode(obj.getvalue()).decode("ascii")}
    raise UnsupportedValueError(
        f"{path}: values of type {type(obj).__module__}.{type(obj).__qualname__} cannot be saved "
        "without pickling; convert it to numbers, strings, lists, dicts or tensors "
        "(or a Stateful whose state_dict() returns those)"
    )


def encode_value(obj: Any, key: str) -> bytes:
    """Encode ``obj`` (stored under ``key``, used in error messages) as UTF-8 JSON."""
    return json.dumps(_encode(obj, key), separators=(",", ":"), allow_nan=False).encode("utf-8")


def dtype_name(dtype: torch.dtype) -> str:
    """``'float32'`` for ``torch.float32``: the name used in every record."""
    return str(dtype).removeprefix("torch.")


_DTYPES = {dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtype_from_name(name: str) -> torch.dtype:
    """``torch.float32`` for ``'float32'``; a clear error for anything else."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {name!r}") from None


def _decode(obj: Any, key: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, key) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: _decode(v, key) for k, v in obj.items()}
    if tag == "float":
        return float(obj["v"])
    if tag == "tuple":
        return tuple(_decode(v, key) for v in obj["v"])
    if tag == "dict":
        return {_hashable(_decode(k, key)): _decode(v, key) for k, v in obj["v"]}
    if tag == "size":
        return torch.Size(obj["v"])
    if tag == "dtype":
        return dtype_from_name(obj["v"])
    if tag == "device":
        return torch.device(obj["v"])
    if tag == "bytes":
        return base64.b64decode(obj["v"])
    if tag == "bytearray":
        return bytearray(base64.b64decode(obj["v"]))
    if tag == "bytesio":
        return io.BytesIO(base64.b64decode(obj["v"]))
    if tag == "tensor":
        dtype = dtype_from_name(obj["dtype"])
        raw = bytearray(base64.b64decode(obj["data"]))
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(obj["shape"])
    if tag == "ndarray":
        arr = np.frombuffer(base64.b64decode(obj["data"]), dtype=np.dtype(obj["dtype"]))
        return arr.reshape(obj["shape"]).copy()
    if tag == "npscalar":
        return np.dtype(obj["dtype"]).type(_decode(obj["v"], key))
    raise CheckpointFormatError(f"value {key!r}: unknown tag {tag!r} (written by a newer ucp_dcp?)")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


def decode_value(data: bytes, key: str) -> Any:
    """Inverse of :func:`encode_value`; ``key`` names the value in errors.

    The bytes come from a file: anything that does not decode (not JSON, a
    tag with missing or malformed fields, a tensor whose data does not fill
    its shape, nesting too deep) raises :class:`CheckpointFormatError`.
    """
    try:
        return _decode(json.loads(data.decode("utf-8")), key)
    except CheckpointFormatError:
        raise
    except _MALFORMED as e:
        raise CheckpointFormatError(
            f"value {key!r} is not valid ucp_dcp JSON ({type(e).__name__}: {e})"[:400]
        ) from None


# What bad input raises: invalid UTF-8 or JSON, an integer of over 4300 digits,
# bad base64 or numpy dtypes (ValueError), missing or mistyped fields, shapes
# or devices torch refuses (RuntimeError), nesting too deep.
_MALFORMED = (
    KeyError,
    TypeError,
    ValueError,
    IndexError,
    AttributeError,
    OverflowError,
    RuntimeError,
    RecursionError,
)


# ------------------------------------------------------------ putting loaded values back


def copy_containers(obj: Any) -> Any:
    """``obj`` with every dict and list copied (leaves shared): a state dict a load may fill and
    reshape without touching the caller's containers."""
    if isinstance(obj, Mapping):
        return {k: copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_containers(v) for v in obj]
    return obj


def set_in_place(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` of the caller's nested state dict.

    DCP's flattened paths hold ``str(key)`` for dict keys; where the caller's
    dict has a non-str key with that spelling (``{0: ...}`` in optimizer-style
    state), use the caller's key rather than adding a new str one.
    """
    cur = root
    for i, p in enumerate(path):
        key = p
        if isinstance(cur, dict) and p not in cur:
            key = next((k for k in cur if str(k) == str(p)), p)
        if i == len(path) - 1:
            cur[key] = value
            return
        try:
            cur = cur[key]
        except (KeyError, IndexError, TypeError):
            set_element(root, path, value)  # a missing container: DCP's own rules create it
            return
