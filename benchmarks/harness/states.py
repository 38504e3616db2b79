"""Synthetic training states: closed-form values, AdamW-shaped state dicts, the 70B-class model, comparisons.

Values from :func:`synth_values` are exact in fp32 and computable for any
slice, so every rank builds (and checks) exactly its own shards without a
full tensor. :func:`adamw_state` nests tensors the way
``get_state_dict(model, optim)`` does. :func:`llama_entries` is the
Llama-2-70B tensor list (meta shapes only) the planning benchmarks use.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

ADAMW_HYPER: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""AdamW hyperparameters of every synthetic ``param_groups`` entry."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def synth_values(seed: int, flat_index: torch.Tensor) -> torch.Tensor:
    """Exact fp32 values from global flat element indices.

    ``(n * odd_constant + seed) mod 2^24`` fits in the fp32 mantissa, so the
    conversion is exact and any rank can regenerate any slice bit for bit
    without materialising the full tensor. The multiplier is odd, so values
    are distinct for n < 2^24: shifted rows or columns cannot compare equal.
    """
    h = (flat_index * 2654435761 + seed) & 0xFFFFFF
    return (h - (1 << 23)).to(torch.float32) * (2.0**-20)


def seed_of(fqn: str, kind: str) -> int:
    """The :func:`synth_values` seed of one tensor (``kind``: param, exp_avg, ...)."""
    return zlib.crc32(f"{fqn}/{kind}".encode())


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) pairs of a nested dict; lists and plain values are leaves."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, obj


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data this rank holds in ``obj`` (DTensors: the local shard)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors(obj))


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads included); compared where the tensors live."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    iv = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.reshape(-1).view(iv), b.reshape(-1).view(iv))


def adamw_state(fqns: Iterable[str], make: Callable[[str, str], torch.Tensor],
                step: Callable[[str], torch.Tensor], hyper: dict[str, Any] = ADAMW_HYPER) -> dict[str, Any]:
    """``{"model": {fqn: param}, "optim": {"state": {fqn: {exp_avg, exp_avg_sq, step}}, "param_groups": [...]}}``.

    ``make(fqn, kind)`` builds each tensor (kind: param, exp_avg, exp_avg_sq;
    called in that order per fqn); ``step(fqn)`` the 0-d step tensor.
    """
    model: dict[str, torch.Tensor] = {}
    optim_state: dict[str, Any] = {}
    names = list(fqns)
    for fqn in names:
        model[fqn] = make(fqn, "param")
        optim_state[fqn] = {"exp_avg": make(fqn, "exp_avg"), "exp_avg_sq": make(fqn, "exp_avg_sq"),
                            "step": step(fqn)}
    group = {**hyper, "params": names}
    return {"model": model, "optim": {"state": optim_state, "param_groups": [group]}}


# ---------------------------------------------------------------- the 70B-class planning model

TP = 8  # tensor-parallel degree of the fsdp_tp mesh
MESHES = ("fsdp", "fsdp_tp")


@dataclass(frozen=True)
class Entry:
    """One tensor of a planning state dict: nested path, global shape, TP role, dtype."""

    path: tuple[str, ...]  # nested state-dict path
    shape: tuple[int, ...]
    role: str  # col | row | embed | norm
    dtype: torch.dtype

    @property
    def fqn(self) -> str:
        """DCP's flattened key."""
        return ".".join(self.path)


def llama_weights(layers: int, vocab: int = 32000, hidden: int = 8192, inter: int = 28672,
                  heads: int = 64, kv_heads: int = 8) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, role) of Llama-2-70B's weights (torchtitan names) with ``layers`` layers."""
    kv = hidden // heads * kv_heads
    out: list[tuple[str, tuple[int, ...], str]] = [("tok_embeddings.weight", (vocab, hidden), "embed")]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (hidden, hidden), "col"),
            (p + "attention.wk.weight", (kv, hidden), "col"),
            (p + "attention.wv.weight", (kv, hidden), "col"),
            (p + "attention.wo.weight", (hidden, hidden), "row"),
            (p + "feed_forward.w1.weight", (inter, hidden), "col"),
            (p + "feed_forward.w2.weight", (hidden, inter), "row"),
            (p + "feed_forward.w3.weight", (inter, hidden), "col"),
            (p + "attention_norm.weight", (hidden,), "norm"),
            (p + "ffn_norm.weight", (hidden,), "norm"),
        ]
    out += [("norm.weight", (hidden,), "norm"), ("output.weight", (vocab, hidden), "col")]
    return out


def llama_entries(layers: int, optimizer: bool) -> list[Entry]:
    """bf16 weights under ``model``; with ``optimizer``, fp32 exp_avg/exp_avg_sq under ``optim.state``."""
    weights = llama_weights(layers)
    entries = [Entry(("model", fqn), shape, role, torch.bfloat16) for fqn, shape, role in weights]
    if optimizer:
        for fqn, shape, role in weights:
            for k in ("exp_avg", "exp_avg_sq"):
                entries.append(Entry(("optim", "state", fqn, k), shape, role, torch.float32))
    return entries


def placements_for(mesh_kind: str, role: str, strided: bool) -> tuple[Placement, ...]:
    """Placements of a tensor of ``role`` on the ``fsdp`` or ``fsdp_tp`` mesh (torchtitan's TP plan).

    ``strided``: FSDP2's ``_StridedShard(0, TP)`` on dp for tensors TP shards on dim 0.
    """
    if mesh_kind == "fsdp":
        return (Shard(0),)
    if role in ("col", "embed"):
        return (_StridedShard(0, split_factor=TP) if strided else Shard(0), Shard(0))
    if role == "row":
        return (Shard(0), Shard(1))
    return (Shard(0), Replicate())


def mesh_shape_of(mesh_kind: str, world: int) -> tuple[int, ...]:
    """Mesh shape of ``mesh_kind`` at world size ``world``: (W,) or (W/TP, TP)."""
    return (world,) if mesh_kind == "fsdp" else (world // TP, TP)


def state_nbytes(entries: Sequence[Entry]) -> int:
    """Global bytes of every entry."""
    return sum(math.prod(e.shape) * e.dtype.itemsize for e in entries)
