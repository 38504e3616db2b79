"""Hand-off: a training checkpoint into one process, or into a plain module.

For fine-tuning, evaluation or inference jobs that do not run the training
job's parallel layout: no process group, full tensors, reading only the
selected tensors' bytes, one tensor at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..adapters.layout_spec import LayoutSpec
from ..dcp.options import ReadOptions
from ..errors import CheckpointKeyError, InvalidArgumentTypeError
from .checkpoint import Checkpoint

__all__ = ["load_state_dict", "load_into_module", "KeySelector", "ModuleLoadResult"]

KeySelector = str | Iterable[str] | Callable[[str], bool] | None
"""Which keys to load: None (all), a name or prefix, several, or a predicate."""


def _selector(keys: KeySelector) -> Callable[[str], bool]:
    if keys is None:
        return lambda _: True
    if callable(keys):
        return keys
    wanted = [keys] if isinstance(keys, str) else list(keys)
    # "model" and "model." both select everything under model.
    prefixes = tuple(k if k.endswith(".") else k + "." for k in wanted)
    exact = set(wanted)
    return lambda name: name in exact or name.startswith(prefixes)


def load_state_dict(
    path: str | os.PathLike[str],
    keys: KeySelector = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    rank_local: bool = False,
    layout: LayoutSpec | None = None,
    options: ReadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "",
    dcp_values: str | None = None,
) -> dict[str, Any]:
    """Full tensors and values of a checkpoint of any format, in this process.

    Args:
        path: the checkpoint (see :class:`~ucp_dcp.Checkpoint` for the formats).
        keys: names (``"model.layers.0.w"``), prefixes (``"model."``), a list of either, or a
            predicate on the name; None for everything. Only the selected tensors' bytes are read.
        dtype: cast floating-point tensors to this dtype (integer and bool tensors, such as step
            counters, keep theirs).
        device: where the tensors go.
        rank_local: also return rank-local values, as ``{rank: value}``.
        layout: return the logical tensors this :class:`~ucp_dcp.LayoutSpec` makes of the selected
            tensors (:meth:`~ucp_dcp.LayoutSpec.logical`: renamed, fused ones split into their
            parts, e.g. a Megatron QKV as Hugging Face's q/k/v) instead of them.
        options: how to read (:class:`~ucp_dcp.ReadOptions`, as :class:`~ucp_dcp.Checkpoint`
            uses them: ``verify`` checks every byte read against the checksums recorded at
            save, ``tp_rules`` partitions a DeepSpeed checkpoint that does not record it).
        storage_options: for a checkpoint at an fsspec URL (``s3://...``), passed to fsspec as they
            are.
        prefix: prepended to the tensor names of a Hugging Face model.
        dcp_values: ``"weights_only"`` loads the pickled values of a DCP checkpoint with
            ``torch.load(weights_only=True)``; refused by default.

    Keys are DCP's flattened names (``"model.embed.weight"``,
    ``"optim.state.embed.weight.exp_avg"``). Tensors are read one at a
    time, so peak memory is the result plus a fixed staging buffer.
    """
    select = _selector(keys)
    out: dict[str, Any] = {}
    with Checkpoint(
        path,
        options=options,
        storage_options=storage_options,
        prefix=prefix,
        dcp_values=dcp_values,
    ) as ckpt:
        for name in ckpt.tensor_names():
            if select(name):
                src = ckpt.tensor_record(name).dtype
                cast = dtype if dtype is not None and src.is_floating_point else None
                out[name] = ckpt.read_tensor(name, dtype=cast, device=device)
        for name in ckpt.value_names():
            if select(name):
                out[name] = ckpt.read_value(name)
        if rank_local:
            for name in ckpt.rank_local_names():
                if select(name):
                    out[name] = ckpt.read_rank_local(name)
    if keys is not None and not callable(keys):
        wanted = [keys] if isinstance(keys, str) else list(keys)
        unmatched = [k for k in wanted if not any(_selector(k)(n) for n in out)]
        if unmatched:
            raise CheckpointKeyError(f"{os.fspath(path)}: no key matches {unmatched}")
    if layout is not None:
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        out = {**{k: v for k, v in out.items() if k not in tensors}, **layout.logical(tensors)}
    return out


class ModuleLoadResult(NamedTuple):
    """What :func:`load_into_module` could not match (empty lists when ``strict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_into_module(
    module: nn.Module,
    path: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    strict: bool = True,
    options: ReadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ModuleLoadResult:
    """Fill ``module``'s parameters and buffers in place from checkpoint ``path``.

    The module's state-dict key ``k`` is read from checkpoint tensor ``prefix + k``; ``path`` may be
    any format :class:`~ucp_dcp.Checkpoint` reads (for a Hugging Face model saved from the same
    class, ``prefix=""``). Each tensor is read straight into the module's own storage when dtypes
    agree, and through the bounded staging buffer (cast to the module's dtype, or copied to its
    device) otherwise: no full copy of the model is ever made.

    With ``strict`` (the default) a module key missing from the checkpoint,
    or a checkpoint tensor under ``prefix`` that the module lacks, is an
    error that lists the keys, as with the load planner. A shape mismatch is
    always an error naming the tensor and both shapes.

    Every byte read is checked against the checksums recorded at save
    (:class:`~ucp_dcp.ChecksumError` on a mismatch) unless ``options`` (a
    :class:`~ucp_dcp.ReadOptions`, as :class:`~ucp_dcp.Checkpoint` uses them) say
    ``verify=False``. ``storage_options`` go to fsspec for a checkpoint at a URL.
    """
    targets = module.state_dict(keep_vars=True)
    with Checkpoint(path, options=options, storage_options=storage_options) as ckpt:
        available = {n[len(prefix) :] for n in ckpt.tensor_names() if n.startswith(prefix)}
        missing = sorted(k for k in targets if k not in available)
        unexpected = sorted(k for k in available if k not in targets)
        if strict and (missing or unexpected):
            raise CheckpointKeyError(
                f"{os.fspath(path)}: loading into {type(module).__name__} with prefix {prefix!r}: "
                f"missing keys {missing[:20]}{' ...' if len(missing) > 20 else ''}, "
                f"unexpected keys {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}. "
                "Pass strict=False to load the keys that match"
            )
        for key, target in targets.items():
            if key not in available:
                continue
            rec = ckpt.tensor_record(prefix + key)
            if tuple(target.shape) != rec.shape:
                raise CheckpointKeyError(
                    f"size mismatch for {prefix + key!r}: the checkpoint has shape "
                    f"{list(rec.shape)}, "
                    f"the module expects {list(target.shape)}"
                )
            if hasattr(target, "device_mesh"):
                raise InvalidArgumentTypeError(
                    f"{key!r} is a DTensor: use dcp.load with UCPStorageReader/UCPLoadPlanner for "
                    "sharded modules"
                )
            with torch.no_grad():
                ckpt.read_into(prefix + key, target.detach())
    return ModuleLoadResult(missing, unexpected)
