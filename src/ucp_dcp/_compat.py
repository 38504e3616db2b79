"""Every private torch API ucp_dcp uses, in one place.

torch does not promise to keep names that start with ``_`` (modules,
functions, classes, attributes) from one release to the next. Everything
of that kind that ucp_dcp needs is imported or read here, each with what it
is for, so that a torch upgrade that moves one touches this file only. The
rest of the package imports these names from here and uses public torch
APIs directly.

(Names that only appear inside pickles, such as ``torch._utils``'s tensor
rebuild functions or DCP's ``_StorageInfo``, are file-format names matched
as strings in the allow-list table of :mod:`ucp_dcp.sources._pickle`, not
APIs ucp_dcp calls; they are not listed here.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

# ShardedTensor (FSDP1's SHARDED_STATE_DICT, torchrec): shards at global
# offsets on each rank, saved and loaded like irregular DTensor chunks.
from torch.distributed._shard.sharded_tensor import ShardedTensor

# DCP's flattening of a nested state dict into dotted keys plus the path of
# each key: the planners flatten exactly as DCP does, so keys agree with it.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

# DCP's expansion of ShardedTensors into their shards, applied before
# flattening (what DefaultLoadPlanner.set_up_planner does).
from torch.distributed.checkpoint._sharded_tensor_utils import (
    _flatten_sharded_tensors as flatten_sharded_tensors,
)

# DCP's rule for putting a value at a flattened path, creating missing
# containers the way DCP itself does on load.
from torch.distributed.checkpoint._traverse import set_element

# DCP's write items for one tensor or DTensor (one per local shard), and the
# chunk list of a local shard: the save and load planners of DCP build these.
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_list as create_chunk_list,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_write_items as create_write_items,
)

# DCP's creation of optimizer state (one zero-gradient step at lr 0) when an
# optimizer has none yet, so that its tensors exist to be loaded into.
from torch.distributed.checkpoint.state_dict import _init_optim_state as init_optim_state
from torch.distributed.tensor import DTensor

# torchrec's local tensor of a DTensor sharded unevenly: several shards per
# rank at their own offsets (DCP plans it through its checkpointable methods).
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

# DTensor's own shard arithmetic: the box a mesh coordinate holds (mesh shape
# and coordinate given as numbers), and the box this rank holds of a DTensor
# (given a device mesh). Used so that uneven and strided shards agree with
# what DTensor stores.
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset as compute_shard_box_on_mesh_shape,
)
from torch.distributed.tensor._utils import (
    compute_local_shape_and_global_offset,
)

if TYPE_CHECKING:
    # FSDP1's unit module and its FlatParameter handle: types only (FSDP1 is
    # imported when a model uses it, see adapters/fsdp1.py).
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParamHandle

# FSDP2's placement for a dimension sharded both by FSDP and by TP (the FSDP
# shards are interleaved): named "SS(d,k)" in layouts.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# The dtype of a legacy typed storage class (``FloatStorage``...) named in a
# torch.save pickle, for reading tensors from such files without unpickling.
from torch.storage import _get_dtype_from_pickle_storage_type as dtype_from_pickle_storage_type

__all__ = [
    "ShardedTensor",
    "flatten_state_dict",
    "flatten_sharded_tensors",
    "set_element",
    "create_chunk_list",
    "create_write_items",
    "init_optim_state",
    "compute_shard_box_on_mesh_shape",
    "compute_local_shape_and_global_offset",
    "StridedShard",
    "dtype_from_pickle_storage_type",
    "dtensor_local",
    "dtensor_like",
    "is_checkpointable",
    "local_shards_of",
    "local_shards_like",
    "module_parameters",
    "module_persistent_buffers",
    "is_flat_param",
    "looks_like_fully_shard",
    "FlatParamInfo",
    "fsdp1_flat_param",
]


# --------------------------------------------------------------------- DTensor


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of ``t`` (``_local_tensor``) if it is a DTensor, without autograd or
    collectives; any other tensor is returned as it is.

    ``to_local()`` goes through autograd, and a DTensor op could issue a collective; this is
    read from a background thread and one rank at a time.
    """
    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_like(local: torch.Tensor, src: DTensor) -> DTensor:
    """A DTensor with ``src``'s spec (``_spec``: mesh, placements, global shape) over ``local``.

    DTensor's constructor, not ``from_local``: that one moves the local
    tensor onto the mesh's device type, which would copy a host staging
    buffer back to the GPU.
    """
    return DTensor(local, src._spec, requires_grad=False)


def is_checkpointable(t: Any) -> bool:
    """Whether ``t`` plans its own chunks through DCP's checkpointable-tensor protocol.

    That is a tensor subclass other than DTensor with ``__create_write_items__``
    / ``__create_chunk_list__`` / ``__get_tensor_shard__`` (the protocol of
    ``torch.distributed.checkpoint._checkpointable``), or a DTensor whose local
    tensor has them (a ``LocalShardsWrapper``: several shards per rank at their
    own offsets). DTensor itself implements the protocol for its regular
    shards; those are planned from their placements instead.
    """
    if isinstance(t, DTensor):
        return hasattr(t._local_tensor, "__create_chunk_list__")
    return isinstance(t, torch.Tensor) and (
        hasattr(t, "__create_write_items__") or hasattr(t, "__create_chunk_list__")
    )


def local_shards_of(t: Any) -> list[tuple[tuple[int, ...], torch.Tensor]] | None:
    """``(global offsets, shard)`` of each local shard of a DTensor over a
    ``LocalShardsWrapper``; None for any other value."""
    if not isinstance(t, DTensor) or not isinstance(t._local_tensor, LocalShardsWrapper):
        return None
    w = t._local_tensor
    return [(tuple(c.offsets), s) for s, c in zip(w.local_shards(), w.local_chunks)]


def local_shards_like(
    shards: list[torch.Tensor], offsets: list[tuple[int, ...]], src: DTensor
) -> DTensor:
    """A DTensor with ``src``'s spec over a ``LocalShardsWrapper`` of ``shards`` at ``offsets``
    (those of ``src``'s shards, as :func:`local_shards_of` gives them)."""
    return dtensor_like(LocalShardsWrapper(shards, offsets), src)


# ------------------------------------------------------------------- nn.Module


def module_parameters(mod: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, parameter or None)`` registered on ``mod`` itself (``_parameters``; duplicates
    kept)."""
    return iter(mod._parameters.items())


def module_persistent_buffers(mod: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, buffer or None)`` registered on ``mod`` itself, except non-persistent ones
    (``_buffers``, ``_non_persistent_buffers_set``)."""
    return ((n, b) for n, b in mod._buffers.items() if n not in mod._non_persistent_buffers_set)


# ------------------------------------------------------------------------ FSDP


def is_flat_param(p: Any) -> bool:
    """Whether ``p`` is an FSDP1 ``FlatParameter`` (its ``_is_flat_param`` marker)."""
    return bool(getattr(p, "_is_flat_param", False))


def looks_like_fully_shard(model: nn.Module) -> bool:
    """Whether ``model`` carries FSDP2 (``fully_shard``) state (its ``_get_fsdp_state`` method)."""
    return hasattr(model, "_get_fsdp_state")


@dataclass(frozen=True)
class FlatParamInfo:
    """What FSDP1 records about one unit's ``FlatParameter`` and its handle (private attributes).

    ``numels_with_padding`` / ``is_padding_mask`` lay out the unsharded
    buffer (parameters and alignment padding, back to back); ``shapes``,
    ``numels`` and ``fqns`` describe each original parameter;
    ``shard_param_infos`` is FSDP's view of this rank's shard of each;
    ``sharded_size`` is None unless the FlatParameter is in its sharded
    state; ``orig_params`` lists the original parameters under
    ``use_orig_params=True``, else None.
    """

    handle: FlatParamHandle  # flat_param, rank, world_size
    sharded_size: torch.Size | None
    numels_with_padding: Sequence[int]
    is_padding_mask: Sequence[bool]
    shapes: Sequence[torch.Size]
    numels: Sequence[int]
    fqns: Sequence[str]
    shard_param_infos: Sequence[Any]
    orig_params: list[nn.Parameter] | None


def fsdp1_flat_param(unit: FullyShardedDataParallel) -> FlatParamInfo | None:
    """The FlatParameter record of FSDP1 unit ``unit`` (``_handle``), or None when it manages no
    parameters."""
    handle = unit._handle
    if handle is None:
        return None
    fp = handle.flat_param
    orig = getattr(fp, "_params", None)
    return FlatParamInfo(
        handle=handle,
        sharded_size=getattr(fp, "_sharded_size", None),
        numels_with_padding=fp._numels_with_padding,
        is_padding_mask=fp._is_padding_mask,
        shapes=fp._shapes,
        numels=fp._numels,
        fqns=fp._fqns,
        shard_param_infos=fp._shard_param_infos,
        orig_params=list(orig) if handle._use_orig_params and orig is not None else None,
    )
