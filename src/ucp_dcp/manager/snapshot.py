"""Staging a training state into host memory, so that a save can run while training goes on.

:class:`Snapshotter` copies the state into host buffers it reuses from one save to the next
(steady-state saves allocate nothing); :func:`find_nonfinite` finds NaN/Inf values before they
are written over a good checkpoint. See docs/manager.md ("Snapshot isolation").

Both walk the same nested structure DCP saves: dicts (any key type, order
kept), lists and tuples (named tuples included) down to leaves. Tensor leaves
are plain tensors on any device, DTensors (each shard of a DTensor over a
``LocalShardsWrapper``) and the pieces of a :class:`~ucp_dcp.TensorPieces`
(flat shards, layout rules); every other leaf is copied with
:func:`copy.deepcopy`. Other tensor subclasses of DCP's checkpointable
protocol are refused: nothing says how to copy them.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._compat import (
    dtensor_like,
    dtensor_local,
    is_checkpointable,
    local_shards_like,
    local_shards_of,
)
from ..core.pieces import Piece, TensorPieces
from ..errors import (
    InvalidArgumentError,
    InvalidStateError,
    NonFiniteError,
    UnsupportedValueError,
)

__all__ = ["NonFiniteError", "find_nonfinite", "StagedState", "Snapshotter"]


# --------------------------------------------------------------------------- walking


def _children(obj: Any) -> Iterator[tuple[Any, Any]] | None:
    """``(key, child)`` pairs of a container DCP would descend into, or None for a leaf.

    One function decides what is a container for every walk here, so the
    collecting pass and the rebuilding pass of ``stage()`` meet the tensors in
    the same order (the buffers are matched to tensors by that order).
    """
    if isinstance(obj, Mapping):
        return iter(obj.items())
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return enumerate(obj)
    return None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _walk_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor leaf (plain or DTensor) of ``obj`` with its dotted path, in walk order."""
    if isinstance(obj, torch.Tensor):
        shards = local_shards_of(obj)
        if shards is not None:  # a LocalShardsWrapper DTensor: each shard is a leaf
            for offsets, t in shards:
                yield f"{path}@{','.join(map(str, offsets))}", t
            return
        if is_checkpointable(obj):
            kind = type(dtensor_local(obj)).__name__
            raise UnsupportedValueError(
                f"{path}: a {kind} (a tensor subclass of DCP's checkpointable protocol) cannot be "
                "staged by CheckpointManager, which copies tensors it can read; save it with "
                "dcp.save(..., planner=UCPSavePlanner(), storage_writer=UCPStorageWriter(path)) "
                "instead"
            )
        yield path, obj
        return
    if isinstance(obj, TensorPieces):
        for p in obj.pieces:
            yield f"{path}[{p.fqn}@{','.join(map(str, p.offsets))}]", p.data
        return
    kids = _children(obj)
    if kids is not None:
        for k, v in kids:
            yield from _walk_tensors(v, _join(path, k))


def _rebuild(
    obj: Any, on_tensor: Callable[[torch.Tensor], Any], memo: dict[int, Any], path: str = ""
) -> Any:
    """``obj`` with every tensor leaf replaced by ``on_tensor(t)`` and every other leaf
    deep-copied."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if isinstance(obj, TensorPieces):  # the copy is only saved: padding (fill) is not needed
        staged = [Piece(p.fqn, p.shape, p.offsets, on_tensor(p.data)) for p in obj.pieces]
        return TensorPieces(staged, replicated=obj.replicated, source=obj.source)
    kids = _children(obj)
    if kids is None:
        # One memo for the whole call keeps aliasing between leaves (an object
        # two RankLocals share stays one object in the copy). Containers are
        # rebuilt, not memoized: each visit of a shared container consumed its
        # own buffers in the collecting pass, so it must here too.
        try:
            return copy.deepcopy(obj, memo)
        except Exception as e:  # a generator, a lock, an open file: nothing to save of it
            raise UnsupportedValueError(
                f"{path or 'the state'}: a {type(obj).__name__} cannot be copied into host memory "
                f"for a save ({e})"
            ) from None
    items = [(k, _rebuild(v, on_tensor, memo, _join(path, k))) for k, v in kids]
    if isinstance(obj, Mapping):
        if type(obj) is dict or not isinstance(obj, dict):
            return dict(items)  # read-only Mappings (MappingProxyType) become plain dicts
        # Subclasses (OrderedDict, defaultdict, ...): a shallow copy keeps the
        # type and its extra state (a default_factory), then the values are
        # swapped for the copies.
        out = copy.copy(obj)
        out.clear()
        out.update(items)
        return out
    values = [v for _, v in items]
    if isinstance(obj, list):
        if type(obj) is list:
            return values
        seq = copy.copy(obj)
        seq[:] = values
        return seq
    if hasattr(type(obj), "_fields"):  # a namedtuple: positional constructor
        return type(obj)(*values)
    return tuple(values) if type(obj) is tuple else type(obj)(values)


# --------------------------------------------------------------------------- non-finite check

# dtypes whose isfinite kernel is missing (float8_e4m3fn on CPU)
_NO_ISFINITE: set[torch.dtype] = set()


def _finite(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor on ``t``'s device: all of ``t`` is finite. Does not sync."""
    if t.dtype not in _NO_ISFINITE:
        try:
            return torch.isfinite(t).all()
        except (RuntimeError, NotImplementedError):
            _NO_ISFINITE.add(t.dtype)
    # float32 holds every value of the float8 formats exactly, NaN included.
    return torch.isfinite(t.to(torch.float32)).all()


@torch.no_grad()
def find_nonfinite(state: Mapping[str, Any]) -> list[str]:
    """Dotted paths of the floating-point tensors in ``state`` that hold a NaN or +/-Inf, sorted.

    Walks nested dicts, lists and tuples; checks plain tensors and the local
    shard of DTensors (no collective: every rank reports its own shards).
    Real and complex dtypes are checked, integer and bool tensors are not.
    On accelerators the per-tensor flags are stacked and read back with one
    device->host sync per device.
    """
    by_device: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    for path, t in _walk_tensors(state):
        loc = dtensor_local(t)
        if not (loc.is_floating_point() or loc.is_complex()) or loc.numel() == 0:
            continue
        paths, flags = by_device.setdefault(loc.device, ([], []))
        paths.append(path)
        flags.append(_finite(loc.detach()))
    bad: list[str] = []
    for device, (paths, flags) in by_device.items():
        if device.type == "cpu":
            ok = [bool(f) for f in flags]  # no sync to save on CPU
        else:
            ok = torch.stack(flags).tolist()  # the one sync for this device
        bad.extend(p for p, good in zip(paths, ok) if not good)
    return sorted(bad)


# --------------------------------------------------------------------------- staging


@dataclass
class StagedState:
    """A host copy of a training state made by :meth:`Snapshotter.stage`.

    ``state`` has the source's nested structure with every tensor replaced by
    a host tensor (DTensors by DTensors over a host local tensor). Its tensors
    are the snapshotter's reusable buffers: after :meth:`Snapshotter.release`
    a later ``stage()`` overwrites them, so nothing may use ``state`` then.
    """

    state: dict[str, Any]
    nbytes: int
    _events: list[Any] = field(default_factory=list, repr=False, compare=False)
    _set: Any = field(default=None, repr=False, compare=False)
    _owner: Any = field(default=None, repr=False, compare=False)

    def wait_ready(self) -> None:
        """Block until the device->host copies are complete (CUDA events); no-op on CPU."""
        for ev in self._events:
            ev.synchronize()
        self._events = []  # done once: later calls are free


class _BufferSet:
    """One staged copy's worth of host tensors, in walk order."""

    def __init__(self, signature: tuple[Any, ...], buffers: list[torch.Tensor]) -> None:
        self.signature = signature
        self.buffers = buffers
        self.held = False

    @property
    def nbytes(self) -> int:
        """The bytes of its buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers)


class Snapshotter:
    """Copies a training state into reusable host buffers, so training may change every tensor in
    place as soon as stage() returns and the copy still holds the values at the call.

    CPU tensors are copied synchronously. CUDA tensors are copied into pinned
    buffers with ``non_blocking=True`` on the current stream of their device,
    and :meth:`StagedState.wait_ready` waits for those copies. Isolation for
    CUDA tensors rests on stream order: training ops issued later on the same
    stream run after the copy. Work on other streams that writes the state
    must be synchronized with the current stream by the caller before
    ``stage()``; and a source tensor freed right after ``stage()`` is safe
    only through the caching allocator's per-stream reuse, as usual.

    ``release()`` may be called from another thread (a save finishing in the
    background) while ``stage()`` runs.

    Args:
        pin_memory: pin host buffers for CUDA tensors (default: True when CUDA is available).
        max_buffers: how many staged copies may exist at once (one per in-flight save).
    """

    def __init__(self, *, pin_memory: bool | None = None, max_buffers: int = 1) -> None:
        if max_buffers < 1:
            raise InvalidArgumentError(f"Snapshotter: max_buffers must be >= 1, got {max_buffers}")
        self._pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._max = max_buffers
        self._sets: list[_BufferSet] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def buffer_bytes(self) -> int:
        """Host bytes currently held in buffers (all sets)."""
        with self._lock:
            return sum(s.nbytes for s in self._sets)

    def _acquire(self, signature: tuple[Any, ...], specs: list[tuple[Any, ...]]) -> _BufferSet:
        """A free set for ``signature``: reused if one matches, else newly allocated."""
        with self._lock:
            if self._closed:
                raise InvalidStateError(
                    "Snapshotter is closed (close() was called); create a new one"
                )
            free = [s for s in self._sets if not s.held]
            for s in free:
                if s.signature == signature:
                    s.held = True
                    return s
            if len(self._sets) >= self._max:
                if not free:
                    raise InvalidStateError(
                        f"cannot stage: all {self._max} staging buffers are held by in-flight "
                        "saves; "
                        "release() one first"
                    )
                # The state's structure changed (a new param group, a resized
                # tensor): the old buffers are useless, drop them before
                # allocating so peak host memory stays at max_buffers sets.
                self._sets.remove(free[0])
            # Reserve the slot under the lock; allocate outside it (pinning is slow).
            new = _BufferSet(signature, [])
            new.held = True
            self._sets.append(new)
        try:
            new.buffers = [self._alloc(*spec) for spec in specs]
        except BaseException:
            with self._lock:
                self._sets.remove(new)
            raise
        return new

    def _alloc(self, shape: torch.Size, dtype: torch.dtype, device_type: str) -> torch.Tensor:
        # Pinned memory only for CUDA sources: it is what makes their
        # non_blocking copy truly asynchronous, and pinning host memory for CPU
        # sources would cost page-locked RAM for nothing. Empty tensors cannot
        # be pinned (no allocation to register).
        pin = self._pin and device_type == "cuda" and math.prod(shape) > 0
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    @torch.no_grad()
    def stage(self, state: Mapping[str, Any]) -> StagedState:
        """Copy state; blocks only for CPU-source copies (memcpy) and for enqueueing device copies.

        Tensors become contiguous host tensors of the same dtype and shape
        (detached: a Parameter becomes a plain tensor); a DTensor becomes a
        DTensor with the same mesh, placements, global shape and stride over a
        host copy of its local shard. Other leaves are deep-copied, so later
        changes to lists/dicts of the training state do not reach the copy.

        Raises :class:`~ucp_dcp.errors.InvalidStateError` (a ``RuntimeError``) if max_buffers
        staged copies are still held (not released).
        """
        tensors = [(p, dtensor_local(t)) for p, t in _walk_tensors(state)]
        for p, t in tensors:
            if t.device.type == "meta":
                raise UnsupportedValueError(f"{p}: a meta tensor holds no data to save")
            if t.layout != torch.strided:
                raise UnsupportedValueError(
                    f"{p}: cannot stage a {t.layout} tensor; only dense (strided) tensors"
                )
        specs = [(t.shape, t.dtype, t.device.type) for _, t in tensors]
        signature = tuple((p, *spec) for (p, _), spec in zip(tensors, specs))
        bset = self._acquire(signature, specs)
        try:
            events = self._copy([t for _, t in tensors], bset.buffers)
            it = iter(bset.buffers)

            def on_tensor(src: torch.Tensor) -> torch.Tensor:
                if not isinstance(src, DTensor):
                    return next(it)
                shards = local_shards_of(src)
                if shards is not None:  # one buffer per shard, in walk order
                    offsets = [o for o, _ in shards]
                    return local_shards_like([next(it) for _ in shards], offsets, src)
                buf = next(it)
                # Not DTensor.from_local: it moves a local tensor onto the
                # mesh's device type, i.e. would copy this host buffer straight
                # back to the GPU for a "cuda" mesh. The constructor keeps the
                # source's spec (mesh, placements, global shape/stride, dtype)
                # over the host tensor: a CPU-local DTensor on a possibly
                # "cuda" mesh, which is also what DCP's own async staging
                # (_create_cpu_state_dict: DTensor.to("cpu")) hands to save.
                # Saving only reads the local tensor and the spec's metadata.
                return dtensor_like(buf, src)

            out = _rebuild(state, on_tensor, {})
        except BaseException:
            self._give_back(bset)
            raise
        return StagedState(
            state=out,
            nbytes=bset.nbytes,
            _events=events,
            _set=bset,
            _owner=self,
        )

    def _copy(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> list[Any]:
        """Copy every source into its buffer; returns the CUDA events to wait on."""
        cuda_devices: dict[torch.device, None] = {}
        for src, dst in zip(srcs, dsts):
            src = src.detach()
            if src.device.type == "cuda":
                # Enqueued on the source device's current stream, so it is
                # ordered before anything training issues there afterwards.
                dst.copy_(src, non_blocking=True)
                cuda_devices[src.device] = None
            else:
                dst.copy_(src)  # CPU (and other devices): synchronous
        events = []
        for dev in cuda_devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            events.append(ev)
        return events

    def _give_back(self, bset: _BufferSet) -> None:
        with self._lock:
            bset.held = False

    def release(self, staged: StagedState) -> None:
        """Give staged's buffers back for reuse by a later stage() call.

        Waits for staged's device copies first, so a later copy into the same
        buffers cannot race an unfinished one. Releasing twice is a no-op.
        """
        if staged._owner is not self:
            raise InvalidArgumentError(
                "release(): this StagedState was made by another Snapshotter"
            )
        staged.wait_ready()
        self._give_back(staged._set)

    def close(self) -> None:
        """Drop every buffer; the snapshotter cannot stage afterwards.

        Staged states still held keep their tensors alive until they are
        dropped; releasing them later is harmless.
        """
        with self._lock:
            self._closed = True
            self._sets.clear()
