"""DeepSpeed ZeRO checkpoints: what their model and optimizer state files hold.

The files :mod:`._ds_files` finds are pickles; read as inert records by
:mod:`._torch_archive` (the classes they may name are :mod:`._pickle`'s
``"deepspeed"`` entries), they become :class:`ModelStates` and
:class:`RankOptim` here, every field used checked, and the file and field
named when one is not what DeepSpeed writes.

Where each parameter's elements are inside the ranks' flat fp32 buffers is
arithmetic only (the ZeRO-1/2 and ZeRO-3 flat layouts of
docs/deepspeed-format.md): :func:`zero12_segments` and :func:`zero3_segments`
say, for each parameter, which element range of which rank's which buffer
holds which of its elements; :func:`segment_boxes` turns one such range into
boxes of the parameter's shape (a flat range of a row-major tensor is a few
boxes), each a contiguous run of the buffer.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from ..byteio.location import ModelDir, StoreDir
from ..core.sharding import Box, flat_range_boxes
from ..errors import CheckpointFormatError, LayoutError
from ..format.schema import is_index_list, is_int
from ._ds_tp import INFO_KEYS
from ._pickle import Inert, TensorRef
from ._torch_archive import TorchArchive, read_torch_archive

__all__ = [
    "ModelStates",
    "RankOptim",
    "Segment",
    "archive_pool",
    "check_zero12_groups",
    "moment",
    "read_archive",
    "read_layer_states",
    "read_model_states",
    "read_rank_optim",
    "segment_boxes",
    "tp_slice_totals",
    "zero12_group_segments",
    "zero12_segments",
    "zero3_segments",
]


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of a parameter (row-major, flattened), stored at
    element ``offset`` of buffer ``buffer`` of rank ``rank``."""

    rank: int
    buffer: int
    offset: int
    start: int
    stop: int


def zero12_segments(
    numels: Sequence[int], partition_sizes: Sequence[int], buffer: int = 0
) -> list[list[Segment]]:
    """Segments of each parameter of one ZeRO-1/2 group.

    ``numels`` are the group's parameters in flat order; ``partition_sizes``
    the length of each rank's partition of the group (rank order). The
    parameters must fit: ``sum(numels) <= sum(partition_sizes)`` (the rest
    is padding). ``buffer`` is recorded in every segment (the group index).
    """
    if sum(numels) > sum(partition_sizes):
        raise LayoutError(
            f"{sum(numels)} parameter elements do not fit in partitions of {sum(partition_sizes)}"
        )
    bounds = list(itertools.accumulate(partition_sizes, initial=0))
    out: list[list[Segment]] = []
    o = 0
    for n in numels:
        out.append(_split(o, o + n, bounds, o, buffer=buffer))
        o += n
    return out


def _split(
    a: int,
    b: int,
    bounds: Sequence[int],
    base: int,
    first: int = 0,
    *,
    rank: int | None = None,
    buffer: int | None = None,
) -> list[Segment]:
    """Cut positions ``[a, b)`` of concatenated buffers (``bounds``: their cumulative starts) at
    buffer ends.

    Element ``pos`` is parameter element ``pos - base + first``. The piece in the ``k``-th
    buffer goes to ``rank`` and ``buffer``, ``k`` standing for the one that is None: ZeRO-1/2's
    buffers are the ranks' partitions of one group, ZeRO-3's one rank's sub-group buffers.
    """
    segs = []
    while a < b:
        k = bisect.bisect_right(bounds, a) - 1
        e = min(b, bounds[k + 1])
        r = k if rank is None else rank
        buf = k if buffer is None else buffer
        segs.append(Segment(r, buf, a - bounds[k], a - base + first, e - base + first))
        a = e
    return segs


def zero3_segments(
    numels: Sequence[int], world_size: int, buffer_sizes: Sequence[int]
) -> list[list[Segment]]:
    """Segments of each parameter of a ZeRO-3 model.

    ``numels`` are all trainable parameters in order (every group's, as in
    ``param_shapes``); ``buffer_sizes`` the lengths of one rank's
    sub-group buffers (equal on every rank). Each parameter is padded to a
    multiple of ``world_size``, and rank ``r`` holds slice ``r`` of each, end to
    end; the slices must fit in the buffers, whose ends may cut one.
    """
    bounds = list(itertools.accumulate(buffer_sizes, initial=0))
    total = sum(math.ceil(n / world_size) for n in numels)
    if total > bounds[-1]:
        raise LayoutError(
            f"parameter slices of {total} elements per rank do not fit in buffers of {bounds[-1]}"
        )
    out: list[list[Segment]] = []
    q = 0  # where this parameter's slice starts in each rank's concatenated buffers
    for n in numels:
        ps = math.ceil(n / world_size)
        segs: list[Segment] = []
        for r in range(world_size):
            a, b = r * ps, min((r + 1) * ps, n)
            if a < b:
                segs += _split(q, q + b - a, bounds, q, a, rank=r)
        out.append(segs)
        q += ps
    return out


def segment_boxes(shape: Sequence[int], seg: Segment) -> list[tuple[Box, int]]:
    """Boxes of a parameter of ``shape`` held by ``seg``, each with its element offset in the
    buffer."""
    out = []
    off = seg.offset
    for box in flat_range_boxes(shape, seg.start, seg.stop):
        out.append((box, off))
        off += box.numel
    return out


@dataclass
class ModelStates:
    """What a ``*_model_states.pt`` file says about the model."""

    archive: TorchArchive
    module: dict[str, TensorRef]
    param_shapes: list[dict[str, tuple[int, ...]]]
    frozen_shapes: dict[str, tuple[int, ...]]
    frozen_fragments: dict[str, TensorRef]
    shared: dict[str, str]  # tied name -> the name that owns the storage
    buffer_names: list[str]
    dp_world_size: int | None  # the data-parallel degree it was saved at, where recorded
    module_is_none: bool = False  # a PipelineModule's: its state is in the layer files
    universal_info: Any = None  # universal_checkpoint_info (Megatron-DeepSpeed's client state)
    tp_degree: int | None = None  # checkpoint_parallel_dimensions' tp_degree, where recorded


@dataclass
class RankOptim:
    """What one rank's ``*_optim_states.pt`` holds: its flat fp32 buffers and the inner optimizer's
    state over them."""

    archive: TorchArchive
    stage: int
    fp32: list[TensorRef]  # ZeRO-1/2: one partition per group; ZeRO-3: one buffer per sub-group
    # The inner optimizer's state per flat buffer (moments are TensorRefs).
    state: dict[int, dict[str, Any]]
    param_groups: list[dict[str, Any]]  # inner optimizer groups; "params" lists flat buffer numbers
    # ZeRO-1/2: this rank's padding at the end of each group.
    paddings: list[int] = field(default_factory=list)


def _need(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointFormatError(f"{where}: no {key!r} entry")
    v = obj[key]
    if not isinstance(v, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CheckpointFormatError(f"{where}: {key!r} is a {type(v).__name__}, expected {names}")
    return v


def _shape(v: Any, where: str) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)) and is_index_list(list(v)):
        return tuple(v)
    raise CheckpointFormatError(f"{where}: {v!r} is not a shape")


def _tensors(d: Any, where: str) -> dict[str, TensorRef]:
    if not isinstance(d, dict) or not all(
        isinstance(k, str) and isinstance(v, TensorRef) for k, v in d.items()
    ):
        raise CheckpointFormatError(f"{where}: expected a dict of name -> tensor")
    return dict(d)


def read_archive(path: str, folder: ModelDir | None = None) -> TorchArchive:
    """File ``path`` of ``folder`` as inert records (with ranged requests when the folder is in a
    store)."""
    if isinstance(folder, StoreDir):
        name = folder.store.name_of(path)
        return read_torch_archive(path, "deepspeed", store=folder.store, size=folder.size(name))
    return read_torch_archive(path, "deepspeed")


_P = ParamSpec("_P")
_T = TypeVar("_T")


class _InOrder(Executor):
    """Runs each call when it is submitted (a failure raises there, as a plain call would)."""

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        done: Future[_T] = Future()
        done.set_result(fn(*args, **kwargs))
        return done


def archive_pool(folder: ModelDir | None, n: int) -> Executor:
    """Where ``n`` archives of ``folder`` are read (``with`` it, ``submit`` or ``map`` the reads):
    in a store, up to 16 side by side (each archive is a few round trips: tail, pickle, local
    headers); locally, one after the other."""
    if isinstance(folder, StoreDir) and n:
        return ThreadPoolExecutor(max_workers=min(16, n))
    return _InOrder()


def read_model_states(path: str, folder: ModelDir | None = None) -> ModelStates:
    """Read a ``*_model_states.pt`` file (its pickle only, as inert records) of ``folder`` (default:
    local)."""
    a = read_archive(path, folder)
    sd = a.obj
    if not isinstance(sd, dict):
        raise CheckpointFormatError(
            f"{path}: holds a {type(sd).__name__}, not DeepSpeed's model states dict"
        )
    # A PipelineModule's engine saves module=None: its layers are in layer_XX files.
    raw_module = _need(sd, "module", (dict, type(None)), path)
    module = _tensors(raw_module if raw_module is not None else {}, f"{path}: 'module'")
    shapes_raw = _need(sd, "param_shapes", list, path)
    param_shapes = []
    for g, d in enumerate(shapes_raw):
        if not isinstance(d, dict):
            raise CheckpointFormatError(
                f"{path}: param_shapes[{g}] is a {type(d).__name__}, expected a dict"
            )
        param_shapes.append(
            {str(k): _shape(v, f"{path}: param_shapes[{g}][{k!r}]") for k, v in d.items()}
        )
    frozen_shapes = {
        str(k): _shape(v, f"{path}: frozen_param_shapes[{k!r}]")
        for k, v in (sd.get("frozen_param_shapes") or {}).items()
    }
    frozen_fragments = _tensors(
        sd.get("frozen_param_fragments") or {}, f"{path}: 'frozen_param_fragments'"
    )
    shared = sd.get("shared_params") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items()):
        raise CheckpointFormatError(f"{path}: 'shared_params' is not a dict of name -> name")
    buffers = sd.get("buffer_names") or []
    if not isinstance(buffers, list) or not all(isinstance(b, str) for b in buffers):
        raise CheckpointFormatError(f"{path}: 'buffer_names' is not a list of names")
    dp = sd.get("dp_world_size")
    if dp is not None and not (is_int(dp) and dp > 0):
        raise CheckpointFormatError(f"{path}: dp_world_size {dp!r} is not a positive integer")
    dims = sd.get("checkpoint_parallel_dimensions")
    tp = dims.get("tp_degree") if isinstance(dims, dict) else None
    if tp is not None and not (is_int(tp) and tp > 0):
        raise CheckpointFormatError(
            f"{path}: checkpoint_parallel_dimensions['tp_degree'] {tp!r} is not a positive integer"
        )
    return ModelStates(
        a,
        module,
        param_shapes,
        frozen_shapes,
        frozen_fragments,
        dict(shared),
        list(buffers),
        dp,
        raw_module is None,
        sd.get(INFO_KEYS["UNIVERSAL_CHECKPOINT_INFO"]),
        tp,
    )


def read_layer_states(
    path: str, folder: ModelDir | None = None
) -> tuple[TorchArchive, dict[str, TensorRef]]:
    """Read a pipeline layer file (``layer_XX-model_YY-model_states.pt``: the layer's own
    ``state_dict()``), its pickle only, as inert records."""
    a = read_archive(path, folder)
    return a, _tensors(a.obj, f"{path}: the layer's state dict")


def _stage(v: Any, where: str) -> int:
    if isinstance(v, Inert) and v.qualname.endswith("ZeroStageEnum") and len(v.args) == 1:
        v = v.args[0]
    if is_int(v) and v in (1, 2, 3):
        return v
    raise CheckpointFormatError(f"{where}: zero_stage {v!r} is not 1, 2 or 3")


def read_rank_optim(path: str, bf16_optimizer: bool, folder: ModelDir | None = None) -> RankOptim:
    """Read one rank's ``*_optim_states.pt`` file (its pickle only, as inert records) of ``folder``
    (default: local)."""
    a = read_archive(path, folder)
    osd = _need(a.obj, "optimizer_state_dict", dict, path)
    where = f"{path}: optimizer_state_dict"
    if "fp32_flat_groups" in osd:
        stage = _stage(osd.get("zero_stage", 3), where)
        fp32 = _need(osd, "fp32_flat_groups", list, where)
        inner = _need(osd, "optimizer_state_dict", dict, where)
        paddings: list[int] = []
    else:
        stage = _stage(osd.get("zero_stage", 1 if bf16_optimizer else None), where)
        fp32 = _need(osd, "single_partition_of_fp32_groups", list, where)
        inner = _need(osd, "base_optimizer_state", dict, where)
        paddings = _need(osd, "group_paddings", list, where)
        if len(paddings) != len(fp32) or not all(isinstance(p, int) and p >= 0 for p in paddings):
            raise CheckpointFormatError(
                f"{where}: group_paddings {paddings!r} does not give one count per group"
            )
        extra = osd.get("param_alignment_paddings")
        if extra and any(any(x for x in g) for g in extra):
            raise CheckpointFormatError(
                f"{where}: per-parameter alignment padding (param_alignment_paddings {extra!r}) "
                "is not supported"
            )
    if not all(isinstance(t, TensorRef) and len(t.size) == 1 for t in fp32):
        raise CheckpointFormatError(f"{where}: the fp32 buffers are not all 1-D tensors")
    state = _need(inner, "state", dict, f"{where}: inner optimizer")
    groups = _need(inner, "param_groups", list, f"{where}: inner optimizer")
    for k, s in state.items():
        if not isinstance(k, int) or not 0 <= k < len(fp32) or not isinstance(s, dict):
            raise CheckpointFormatError(
                f"{where}: inner optimizer state key {k!r} is not a flat buffer number"
            )
    covered = []
    for g, grp in enumerate(groups):
        ps = grp.get("params") if isinstance(grp, dict) else None
        if not isinstance(ps, list) or not all(isinstance(p, int) for p in ps):
            raise CheckpointFormatError(
                f"{where}: inner optimizer param_groups[{g}] has no list of 'params'"
            )
        covered += ps
    if sorted(covered) != list(range(len(fp32))):
        raise CheckpointFormatError(
            f"{where}: inner optimizer groups cover flat buffers {sorted(covered)}, expected "
            f"0..{len(fp32) - 1}"
        )
    return RankOptim(a, stage, list(fp32), dict(state), list(groups), list(paddings))


def tp_slice_totals(models: Sequence[ModelStates], tp: int) -> dict[str, int]:
    """Parameter -> the elements of all its tensor-parallel slices in the first stage holding it
    (``models[m]``: model-parallel rank ``m``, stage ``m // tp``; its ``param_shapes`` hold the
    slices), which a rule giving each rank's widths sizes its merged shape by."""
    first: dict[str, int] = {}
    totals: dict[str, int] = {}
    for mi, m in enumerate(models):
        for shapes in m.param_shapes:
            for fqn, shape in shapes.items():
                if first.setdefault(fqn, mi // tp) == mi // tp:
                    totals[fqn] = totals.get(fqn, 0) + math.prod(shape)
    return totals


def check_zero12_groups(m0: ModelStates, o: RankOptim) -> None:
    """Refuse model states ``m0`` unless its ``param_shapes`` has one group per ZeRO-1/2
    partition of optimizer file ``o``."""
    if len(m0.param_shapes) != len(o.fp32):
        raise CheckpointFormatError(
            f"{m0.archive.path}: param_shapes has {len(m0.param_shapes)} groups, the optimizer "
            f"files {len(o.fp32)}"
        )


def zero12_group_segments(
    m0: ModelStates, optims: Sequence[RankOptim], g: int
) -> list[list[Segment]]:
    """The segments of each parameter of ZeRO-1/2 group ``g`` (``m0.param_shapes[g]``) over the
    partitions of ``optims`` (a segment's rank: its position in ``optims``)."""
    # Each rank's partition is padded to the same length; the saved fp32 partition leaves the
    # padding out (group_paddings).
    sizes = [o.fp32[g].numel + o.paddings[g] for o in optims]
    try:
        return zero12_segments([math.prod(s) for s in m0.param_shapes[g].values()], sizes, g)
    except ValueError as e:
        raise CheckpointFormatError(f"{m0.archive.path}: group {g}: {e}") from None


def moment(st: dict[str, Any], name: str, numel: int, where: str) -> TensorRef | None:
    """Moment ``name`` of one flat buffer's optimizer state (None if the optimizer keeps none),
    checked against ``numel``."""
    t = st.get(name)
    if t is None:
        return None
    if not isinstance(t, TensorRef) or t.numel < numel or len(t.size) != 1:
        raise CheckpointFormatError(
            f"{where}: {name} is not a 1-D tensor of at least {numel} elements"
        )
    return t
