"""The one restricted unpickler: every pickle the library reads goes through it.

Three kinds of pickle are read, each a *purpose* of :data:`ALLOWED`:

* ``"deepspeed"``: ``data.pkl`` of DeepSpeed's ``torch.save`` files of state
  (``*_model_states.pt``, ``*_optim_states.pt``, Universal's ``zero/*/*.pt``);
* ``"distcp_item"``: ``data.pkl`` of one item of a DCP ``.distcp`` data file,
  a single tensor;
* ``"dcp_metadata"``: DCP's ``.metadata``.

:data:`ALLOWED` is the one table of globals a pickle may name: per purpose,
``(module, name)`` -> what :meth:`RestrictedUnpickler.find_class` hands out
in its place. ``find_class`` is the only door from a pickle to code, and
REDUCE/NEWOBJ/BUILD only ever apply to what it handed out. Anything not in
the purpose's table is refused by name, before it is imported or built
(:class:`~ucp_dcp.errors.CheckpointFormatError` naming the file). How each
entry is built inert:

* torch's tensor rebuild functions (``torch._utils._rebuild_tensor_v2/v3``,
  ``_rebuild_parameter``, ``torch._tensor._rebuild_from_type_v2``) become
  builders that return a :class:`TensorRef` (storage key and geometry);
  :meth:`~RestrictedUnpickler.persistent_load` turns torch.save's storage
  ids into storage records, so no tensor data is read;
* DeepSpeed's classes become :class:`Inert` records of the arguments and
  state the pickle gives them; the real class is never imported;
* containers (``OrderedDict``, ``set``, ``frozenset``), ``torch.Size``,
  dtypes, layouts and memory formats are themselves (building them runs no
  checkpoint code);
* DCP's metadata and plan records (plain dataclasses and enums of torch's
  own, and ``pathlib`` paths) are imported by name (:data:`IMPORT`) when a
  pickle names them.

Nothing here needs pickletools-level scanning: what a tensor's bytes are is
in the arguments of its rebuild call and its storage's persistent id, both
handed to builders above. One kind of pickle does not come here: DCP's
non-tensor values, loaded only when asked for, with torch's own restricted
unpickler (:meth:`~ucp_dcp.sources.distcp.DCPSource.decode_value`).
"""

from __future__ import annotations

import io
import math
import pickle
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._compat import dtype_from_pickle_storage_type
from ..errors import CheckpointFormatError
from ..format.schema import is_index_list

__all__ = [
    "ALLOWED",
    "IMPORT",
    "Inert",
    "Purpose",
    "PurposeName",
    "RestrictedUnpickler",
    "StorageRef",
    "TensorRef",
    "unpickle",
]

PurposeName = Literal["deepspeed", "distcp_item", "dcp_metadata"]


# ------------------------------------------------------------ what the builders return


@dataclass(frozen=True)
class TensorRef:
    """A tensor in a ``torch.save`` archive: its storage record and geometry, no data."""

    storage: str
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements (dense)."""
        return self.numel * self.dtype.itemsize


class Inert:
    """An object of an allowed class, recorded instead of built.

    ``qualname`` is ``"module.name"``; ``args`` are the constructor arguments
    the pickle passed (an enum member's value, a namedtuple's fields) and
    ``state`` what it set afterwards (usually the instance ``__dict__``).
    """

    qualname: str = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:  # NEWOBJ: cls.__new__(cls, *args)
        self = object.__new__(cls)
        self.args = args
        self.state = None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # REDUCE: cls(*args)
        self.args = args

    def __setstate__(self, state: Any) -> None:  # BUILD
        self.state = state

    def field(self, name: str, default: Any = None) -> Any:
        """Attribute ``name`` from the recorded state (a dict, or ``(dict, slots)``)."""
        st = self.state
        if isinstance(st, tuple) and len(st) == 2:
            st = {**(st[0] or {}), **(st[1] or {})}
        return st.get(name, default) if isinstance(st, dict) else default

    def __repr__(self) -> str:
        return f"<{self.qualname} args={self.args!r} state={self.state!r}>"


@dataclass(frozen=True)
class StorageRef:
    """A storage record ``data/<key>`` of the archive, as a persistent id names it."""

    key: str
    dtype: torch.dtype | None  # None: untyped (``_rebuild_tensor_v3`` gives the dtype)


@dataclass(frozen=True)
class _StorageType:
    """A storage class named in a pickle (``torch.FloatStorage``, ``UntypedStorage``)."""

    dtype: torch.dtype | None


class _Refused(CheckpointFormatError):
    """Raised inside the unpickler; :func:`unpickle` restates it naming the file (a
    :class:`RestrictedUnpickler` used directly raises it as it is)."""


def _tensor(
    storage: StorageRef, dtype: torch.dtype, offset: Any, size: Any, stride: Any
) -> TensorRef:
    if not (
        is_index_list([offset])
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and is_index_list(list(size))
        and is_index_list(list(stride), len(size))
    ):
        raise _Refused(f"a tensor with malformed geometry {offset!r}, {size!r}, {stride!r}")
    return TensorRef(storage.key, dtype, offset, tuple(size), tuple(stride))


_VIEW_BITS = {"conj": "conjugate", "neg": "negative"}


def _check_metadata(rest: tuple[Any, ...], at: int) -> None:
    """The tensor metadata ``torch.save`` appends (``rest[at]``, if there): a conjugate or
    negative view's storage holds other values than the tensor reads as, and any other entry
    is one this reader does not understand."""
    meta = rest[at] if len(rest) > at else None
    if meta is None or meta == {}:
        return
    if not isinstance(meta, dict):
        raise _Refused(f"a tensor with malformed metadata {meta!r}"[:200])
    for key, value in meta.items():
        if key in _VIEW_BITS and value is False:
            continue
        if key in _VIEW_BITS:
            raise _Refused(
                f"a tensor saved as a {_VIEW_BITS[key]} view, whose stored bytes are not its "
                f"values (resolve it before saving: tensor.resolve_{key}())"
            )
        raise _Refused(f"a tensor with metadata {key!r}, which this reader does not know"[:200])


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise _Refused(f"a tensor whose storage is {type(storage).__name__}, not a storage record")
    if storage.dtype is None:
        raise _Refused("a tensor (torch._utils._rebuild_tensor_v2) over an untyped storage")
    _check_metadata(rest, 2)  # (requires_grad, backward_hooks, metadata)
    return _tensor(storage, storage.dtype, offset, size, stride)


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, grad: Any, hooks: Any, dtype: Any, *rest: Any
) -> TensorRef:
    if not isinstance(storage, StorageRef) or storage.dtype is not None:
        raise _Refused(
            "a tensor (torch._utils._rebuild_tensor_v3) whose storage is not an untyped storage "
            "record"
        )
    if not isinstance(dtype, torch.dtype):
        raise _Refused(f"a tensor of unknown dtype {dtype!r}")
    _check_metadata(rest, 0)
    return _tensor(storage, dtype, offset, size, stride)


def _rebuild_parameter(data: Any, requires_grad: Any = False, hooks: Any = None, *rest: Any) -> Any:
    if not isinstance(data, TensorRef):
        raise _Refused(f"a Parameter around {type(data).__name__}")
    return data


class _PlainTensorType:
    """``torch.Tensor`` named in a pickle: only as the type argument of
    ``_rebuild_from_type_v2``."""


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # torch.save uses this for a plain tensor that carries Python attributes
    # (DeepSpeed tags its parameters): the attributes are dropped, the tensor kept.
    if (
        new_type is not _PlainTensorType
        or func not in (_rebuild_tensor_v2, _rebuild_tensor_v3)
        or not isinstance(args, tuple)
    ):
        raise _Refused("a tensor subclass (torch._tensor._rebuild_from_type_v2 of another type)")
    return func(*args)


def _inert(module: str, name: str) -> tuple[tuple[str, str], type[Inert]]:
    return (module, name), type(name, (Inert,), {"qualname": f"{module}.{name}"})


class _Import:
    """:data:`IMPORT`'s type."""

    def __repr__(self) -> str:
        return "IMPORT"


IMPORT = _Import()
"""A table value: the named object itself, imported by name when a pickle names it."""


# ------------------------------------------------------------ the table


@dataclass(frozen=True)
class Purpose:
    """One kind of pickle the library reads: the globals it may name, and how it is refused."""

    name: str  # what the pickle is, in messages
    globals: Mapping[tuple[str, str], Any]  # (module, name) -> what find_class hands out
    refusal: str  # follows "refusing to unpickle <module>.<name>" in the error
    unreadable: str  # the error's words for a pickle that fails to load
    storages: bool  # whether persistent ids of torch.save storage records are read


_TORCH_NAMES = {
    ("torch", n): v
    for n, v in vars(torch).items()
    if not n.startswith("_") and isinstance(v, (torch.dtype, torch.layout, torch.memory_format))
}
_DTYPES = {k: v for k, v in _TORCH_NAMES.items() if isinstance(v, torch.dtype)}


def _typed_storages() -> dict[tuple[str, str], _StorageType]:
    """``torch.FloatStorage`` & co.: the legacy typed storages torch.save names for v2 tensors."""
    out = {}
    for n in dir(torch):
        if n.endswith("Storage"):
            try:
                out[("torch", n)] = _StorageType(dtype_from_pickle_storage_type(n))
            except KeyError:
                pass
    return out


# What torch.save names for a plain tensor (any dtype; v3 for those without a typed storage).
_TENSOR = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("collections", "OrderedDict"): OrderedDict,  # the tensor's (empty) backward hooks
    **_typed_storages(),
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("torch", "UntypedStorage"): _StorageType(None),
    **_DTYPES,
}

_ARCHIVE_REFUSAL = ": it is not one of the classes this format stores"
_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_PLAN = "torch.distributed.checkpoint.planner"
_DCP_FS = "torch.distributed.checkpoint.filesystem"

ALLOWED: dict[PurposeName, Purpose] = {
    "deepspeed": Purpose(
        "data.pkl",
        {
            **_TENSOR,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
            ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
            ("torch", "Tensor"): _PlainTensorType,
            ("torch", "Size"): torch.Size,
            # protocol 2 (torch.save's) names builtins the Python 2 way
            **{
                (mod, name): obj
                for mod in ("builtins", "__builtin__")
                for name, obj in (("set", set), ("frozenset", frozenset))
            },
            # DeepSpeed's own classes in its checkpoints: records of their fields
            **dict(
                _inert(mod, name)
                for mod, name in (
                    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                    ("deepspeed.utils.tensor_fragment", "fragment_address"),
                    # ds_to_universal's record of a fused parameter's sub-parameter layout
                    ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
                )
            ),
        },
        _ARCHIVE_REFUSAL,
        "data.pkl is not a readable pickle",
        True,
    ),
    "distcp_item": Purpose(
        "data.pkl",
        _TENSOR,
        ": only plain dense tensors (torch._utils._rebuild_tensor_v2/v3) are read from DCP items",
        "data.pkl is not a readable pickle",
        True,
    ),
    "dcp_metadata": Purpose(
        ".metadata",
        {
            **{
                (_DCP_MD, n): IMPORT
                for n in (
                    "Metadata",
                    "TensorStorageMetadata",
                    "BytesStorageMetadata",
                    "ChunkStorageMetadata",
                    "TensorProperties",
                    "_MEM_FORMAT_ENCODING",
                    "MetadataIndex",
                    "StorageMeta",
                )
            },
            (_DCP_FS, "_StorageInfo"): IMPORT,
            (_DCP_FS, "_StoragePrefix"): IMPORT,
            # Megatron-core's torch_dist strategy attaches every rank's local save
            # plan to the metadata (``all_local_plans``): DCP's own plan records.
            **{
                (_DCP_PLAN, n): IMPORT
                for n in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")
            },
            (_DCP_PLAN, "WriteItemType"): IMPORT,
            ("torch", "Size"): torch.Size,
            ("torch.serialization", "_get_layout"): IMPORT,  # torch.strided & co. by name
            ("collections", "OrderedDict"): OrderedDict,
            **{
                (mod, cls): IMPORT
                for mod in ("pathlib", "pathlib._local")
                for cls in ("PosixPath", "PurePosixPath")
            },
            **_TORCH_NAMES,
        },
        " from .metadata: only DCP's own metadata and plan records (and torch.Size, dtypes, "
        "layouts) are loaded; this file is damaged, hostile, or was written by a planner that "
        "stores its own classes in the metadata",
        "not a readable DCP metadata file",
        False,
    ),
}
"""Per purpose, every global a pickle may name and what it becomes; see the module docstring."""


# ------------------------------------------------------------ the unpickler


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles what :data:`ALLOWED` lists for one purpose, and nothing else.

    ``storages``: the storage keys the archive holds (``data/<key>``); a
    persistent id naming another is refused.
    """

    def __init__(self, file: io.BytesIO, purpose: PurposeName, storages: Collection[str] = ()):
        super().__init__(file)
        self.purpose = ALLOWED[purpose]
        self.storages = storages

    def find_class(self, module: str, name: str) -> Any:
        got = self.purpose.globals.get((module, name))
        if got is None:
            raise _Refused(f"refusing to unpickle {module}.{name}{self.purpose.refusal}")
        if got is IMPORT:
            return super().find_class(module, name)
        return got

    def persistent_load(self, pid: Any) -> Any:
        if not self.purpose.storages:
            raise _Refused(f"refusing persistent id {pid!r} in {self.purpose.name}")
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
        ):
            raise _Refused(
                f"refusing persistent id {pid!r}: only torch.save storage records are read"
            )
        if pid[2] not in self.storages:
            raise _Refused(
                f"the pickle refers to storage data/{pid[2]}, which the archive does not hold"
            )
        return StorageRef(pid[2], pid[1].dtype)


def unpickle(data: bytes, where: str, purpose: PurposeName, storages: Collection[str] = ()) -> Any:
    """``data`` unpickled by :class:`RestrictedUnpickler` for ``purpose``.

    Raises :class:`CheckpointFormatError` starting with ``where`` (the file)
    for a global outside the purpose's table (naming it, before it is built),
    a malformed tensor or storage reference, or a pickle that does not load.
    """
    try:
        return RestrictedUnpickler(io.BytesIO(data), purpose, storages).load()
    except _Refused as e:
        raise CheckpointFormatError(f"{where}: {e}") from None
    except Exception as e:  # truncated or garbage pickles raise all sorts
        raise CheckpointFormatError(
            f"{where}: {ALLOWED[purpose].unreadable} ({type(e).__name__}: {e})"
        ) from None
