"""DeepSpeed ZeRO checkpoints: file names and their records.

A DeepSpeed checkpoint directory holds ``latest`` (the tag) and one folder
per tag with, for data-parallel degree ``W`` and no tensor/pipeline
parallelism:

* ZeRO-1/2: ``mp_rank_00_model_states.pt`` (module state dict, parameter
  shapes per optimizer group, tied and frozen parameters, buffers) and
  ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per rank (that
  rank's fp32 partition of every group, ``single_partition_of_fp32_groups``,
  and the inner optimizer's ``state_dict`` over those flat partitions);
* ZeRO-3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` and
  ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per rank (``fp32_flat_groups``,
  one flat buffer per sub-group, and the inner optimizer over them).

A pipeline- or tensor-parallel checkpoint has ``mp_rank_{m}_model_states.pt``
and ``zero_pp_rank_{r}_mp_rank_{m}_optim_states.pt`` per model-parallel rank
``m`` (stage ``m // T``, tensor-parallel rank ``m % T``) and, under a
pipeline, ``layer_{i}-model_{t}-model_states.pt`` per layer with state
(global index ``i``, tensor-parallel rank ``t``; the model states' ``module``
is then None). Without layer files every model-parallel rank is a
tensor-parallel one.

This module finds those files and turns their pickles, read as inert records
by :mod:`._torch_archive` (the classes they may name are :mod:`._pickle`'s
``"deepspeed"`` entries), into :class:`ModelStates` and :class:`RankOptim`,
checking every field it uses and naming the file and field when one is not
what DeepSpeed writes. Where each parameter's elements are inside the flat
buffers is :mod:`._zero_layout`'s business.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from ..byteio.location import LocalDir, ModelDir, StoreDir
from ..errors import CheckpointFormatError
from ._pickle import Inert, TensorRef, is_index_tuple
from ._torch_archive import TorchArchive, read_torch_archive
from ._zero_layout import Segment, zero12_segments

__all__ = [
    "DSFiles",
    "ModelStates",
    "RankOptim",
    "check_layer_files",
    "find_deepspeed_files",
    "layer_files",
    "looks_like_deepspeed",
    "read_archive",
    "read_layer_states",
    "read_model_states",
    "read_rank_optim",
    "looks_like_universal",
    "universal_folder",
    "UNIVERSAL_DIR",
    "archive_pool",
    "check_zero12_groups",
    "tp_slice_totals",
    "zero12_group_segments",
]

LATEST_FILE = "latest"
LATEST_UNIVERSAL_FILE = "latest_universal"
UNIVERSAL_DIR = "zero"  # one folder per parameter: fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt
_MODEL_12 = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_MODEL_3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# A PipelineModule's per-layer files: global layer index, then the tensor-parallel rank
# (``-model_YY``, absent under a topology without a "model" axis).
_LAYER = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")


@dataclass(frozen=True)
class DSFiles:
    """The files of one DeepSpeed tag folder, model files and optimizer files in rank order."""

    directory: str
    model: list[str]
    optim: list[str]
    bf16_optimizer: bool
    folder: ModelDir | None = None
    """The tag folder's view (local or in a store), which the files are read through."""
    layers: dict[tuple[int, int], str] = field(default_factory=dict)
    """Pipeline-parallel checkpoints: the ``layer_XX[-model_YY]-model_states.pt`` files by
    (global layer index, tensor-parallel rank) (empty otherwise). ``model`` then holds one
    ``mp_rank_MM_model_states.pt`` per model-parallel rank ``MM`` (stage ``MM // tp``,
    tensor-parallel rank ``MM % tp``) and ``optim`` their optimizer files, rank by rank, each's
    in data-parallel rank order."""
    tp: int = 1
    """The tensor-parallel degree (pipeline-parallel checkpoints: the layer files' ``YY``)."""


def looks_like_deepspeed(d: ModelDir) -> bool:
    """Whether directory view ``d`` is a DeepSpeed checkpoint directory (with ``latest``) or tag
    folder, by names alone."""
    return d.is_file(LATEST_FILE) or any(_OPTIM.fullmatch(n) for n in d.list())


def looks_like_universal(d: ModelDir) -> bool:
    """Whether directory view ``d`` is a DeepSpeed Universal checkpoint (``latest_universal``, or a
    tag folder with ``zero/`` and its model states), by names alone."""
    if d.is_file(LATEST_UNIVERSAL_FILE):
        return True
    return (
        any(
            d.is_file(n)
            for n in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
        )
        and d.child(UNIVERSAL_DIR).is_dir()
    )


def universal_folder(path: str) -> str:
    """The tag folder of a DeepSpeed Universal checkpoint (``path`` itself, or what
    ``latest_universal`` names)."""
    return _tag_folder(LocalDir(path), LATEST_UNIVERSAL_FILE).where


# ds_to_universal copies the source's model states: one mp_rank_00 file from
# ZeRO-1/2, one zero_pp_rank_R file per rank from ZeRO-3 (each holds the full
# param_shapes; the frozen parameters' fragments are per rank).
UNIVERSAL_MODEL_FILES = (
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_<R>_mp_rank_00_model_states.pt",
)


def universal_model_files(folder: str) -> list[str]:
    """The model-states files of a Universal tag folder: ZeRO-1/2's ``mp_rank_MM`` (one per
    model-parallel rank of a pipeline- or tensor-parallel run) in rank order, or ZeRO-3's per
    data-parallel rank in rank order.

    Empty when there are none; :class:`CheckpointFormatError` when ranks are
    missing or a ZeRO-3 model is tensor- or pipeline-parallel.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    mp = {int(m.group(1)): n for n in names if (m := _MODEL_12.fullmatch(n))}
    if mp:
        if sorted(mp) != list(range(len(mp))):
            raise CheckpointFormatError(
                f"{folder}: model states of model-parallel ranks {sorted(mp)}; expected "
                f"mp_rank_00..mp_rank_{max(mp):02d}"
                + _missing(set(mp), len(mp), "mp_rank_{:02d}_model_states.pt")
            )
        return [os.path.join(folder, mp[r]) for r in sorted(mp)]
    ranks: dict[int, str] = {}
    for n in names:
        if m := _MODEL_3.fullmatch(n):
            if int(m.group(2)) != 0:
                raise CheckpointFormatError(
                    f"{folder}: {n}: tensor- or pipeline-parallel Universal folders are not "
                    "supported"
                )
            ranks[int(m.group(1))] = os.path.join(folder, n)
    if ranks and sorted(ranks) != list(range(len(ranks))):
        raise CheckpointFormatError(
            f"{folder}: ZeRO-3 model files for ranks {sorted(ranks)}; expected 0..{len(ranks) - 1}"
        )
    return [ranks[r] for r in sorted(ranks)]


def layer_files(d: ModelDir, names: Iterable[str] | None = None) -> dict[tuple[int, int], str]:
    """The pipeline layer files (``layer_XX[-model_YY]-model_states.pt``) of folder ``d``, as
    paths, by (global layer index, tensor-parallel rank) in that order; empty when it has none or
    is no directory. ``names``: the folder's file names where the caller has listed them."""
    if names is None:
        try:
            names = d.list()
        except OSError:
            return {}
    found = {(int(m[1]), int(m[2] or 0)): n for n in names if (m := _LAYER.fullmatch(n))}
    return {k: d.path_of(n) for k, n in sorted(found.items())}


def check_layer_files(layers: dict[tuple[int, int], str], tp: int, where: str) -> None:
    """Refuse ``layers`` (:func:`layer_files` of folder ``where``) when a layer lacks the file of
    one of the ``tp`` tensor-parallel ranks."""
    for i in sorted({k[0] for k in layers}):
        gone = [t for t in range(tp) if (i, t) not in layers]
        if gone:
            raise CheckpointFormatError(
                f"{where}: no layer_{i:02d}-model_{gone[0]:02d}-model_states.pt, though other "
                f"tensor-parallel ranks of layer {i} have one"
            )


def _tag_folder(d: ModelDir, latest_name: str = LATEST_FILE) -> ModelDir:
    if not d.is_file(latest_name):
        return d
    latest = d.path_of(latest_name)
    try:
        if isinstance(d, StoreDir):  # the first 4 KiB, as locally
            n = min(d.size(latest_name) or 0, 4096)
            raw = d.store.read(latest_name, 0, n) if n else b""
        else:
            with open(latest, "rb") as f:
                raw = f.read(4096)
        tag = raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{latest}: cannot read the tag ({e})") from None
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\0" in tag:
        raise CheckpointFormatError(f"{latest}: {tag!r} is not a tag folder name")
    folder = d.child(tag)
    if not folder.is_dir():
        raise CheckpointFormatError(
            f"{latest}: names tag {tag!r}, but {folder.where} is not a directory"
        )
    return folder


def find_deepspeed_files(path: str | ModelDir) -> DSFiles:
    """The model and optimizer files of the checkpoint at ``path`` (the directory with ``latest``,
    or a tag folder; a local path, or a directory view).

    Raises :class:`CheckpointFormatError` naming the folder when it holds no
    optimizer files, when files are missing (a rank's optimizer or model
    states file, a tensor-parallel rank's layer file), when bf16 and fp32
    optimizer files are mixed, or when a pipeline- or tensor-parallel
    checkpoint (several ``mp_rank_XX``, or layer files) has ZeRO-3 model
    files, which is not supported.
    """
    view = _tag_folder(path if isinstance(path, ModelDir) else LocalDir(path))
    folder = view.where
    try:
        names = sorted(view.list())
    except OSError as e:
        raise CheckpointFormatError(f"{folder}: cannot list ({e.strerror or e})") from None
    model12: dict[int, str] = {}
    model3: dict[tuple[int, int], str] = {}
    optim: dict[tuple[int, int], str] = {}
    bf16 = set()
    for n in names:
        if m := _MODEL_12.fullmatch(n):
            model12[int(m.group(1))] = n
        elif m := _MODEL_3.fullmatch(n):
            model3[(int(m.group(2)), int(m.group(1)))] = n
        elif m := _OPTIM.fullmatch(n):
            optim[(int(m.group(3)), int(m.group(2)))] = n
            bf16.add(bool(m.group(1)))
    if not optim:
        raise CheckpointFormatError(
            f"{folder}: not a DeepSpeed ZeRO checkpoint: no "
            "*zero_pp_rank_*_mp_rank_*_optim_states.pt files"
            f" ({', '.join(names[:8]) or 'it is empty'})"
        )
    mp = sorted({k[0] for k in optim} | set(model12) | {k[0] for k in model3})
    if len(bf16) > 1:
        raise CheckpointFormatError(
            f"{folder}: holds both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files"
        )
    layers = layer_files(view, names)
    if layers or mp != [0]:
        return _pipeline_files(view, model12, model3, optim, layers, bf16.pop())
    world = len(optim)
    prefix = "bf16_" if True in bf16 else ""
    if sorted(k[1] for k in optim) != list(range(world)):
        raise CheckpointFormatError(
            f"{folder}: optimizer files for ranks {sorted(k[1] for k in optim)}; expected "
            f"0..{world - 1}, one per rank"
            + _missing(
                {k[1] for k in optim}, world, prefix + "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
            )
        )
    optim_files = [view.path_of(optim[(0, r)]) for r in range(world)]
    if model3:
        if sorted(k[1] for k in model3) != list(range(world)):
            raise CheckpointFormatError(
                f"{folder}: ZeRO-3 model files for ranks {sorted(k[1] for k in model3)}; expected "
                f"0..{world - 1}"
                + _missing(
                    {k[1] for k in model3}, world, "zero_pp_rank_{}_mp_rank_00_model_states.pt"
                )
            )
        model_files = [view.path_of(model3[(0, r)]) for r in range(world)]
    elif 0 in model12:
        model_files = [view.path_of(model12[0])]
    else:
        raise CheckpointFormatError(
            f"{folder}: no mp_rank_00_model_states.pt (or zero_pp_rank_*_model_states.pt)"
        )
    return DSFiles(folder, model_files, optim_files, bf16.pop(), view)


def _pipeline_files(
    view: ModelDir,
    model12: dict[int, str],
    model3: dict[tuple[int, int], str],
    optim: dict[tuple[int, int], str],
    layers: dict[tuple[int, int], str],
    bf16: bool,
) -> DSFiles:
    """The files of a pipeline- or tensor-parallel checkpoint: per model-parallel rank ``MM`` one
    ``mp_rank_MM_model_states.pt`` and one optimizer file per data-parallel rank, and the layer
    files (none without a pipeline: every model-parallel rank is then a tensor-parallel one)."""
    folder = view.where
    tp = len({k[1] for k in layers}) if layers else len(set(model12) | {k[0] for k in optim})
    if layers and sorted({k[1] for k in layers}) != list(range(tp)):
        raise CheckpointFormatError(
            f"{folder}: layer files of tensor-parallel ranks {sorted({k[1] for k in layers})}; "
            f"expected 0..{tp - 1}"
        )
    check_layer_files(layers, tp, folder)
    if model3:
        raise CheckpointFormatError(
            f"{folder}: ZeRO-3 model files ({sorted(model3.values())[0]}) of a pipeline- or "
            "tensor-parallel checkpoint are not supported"
        )
    stages = sorted({k[0] for k in optim} | set(model12))
    if stages != list(range(len(stages))) or sorted(model12) != stages or len(stages) % tp:
        raise CheckpointFormatError(
            f"{folder}: model-parallel ranks (mp_rank_XX) {stages} with model states files for "
            f"{sorted(model12)}; expected mp_rank_00..mp_rank_{len(stages) - 1:02d} of each, a "
            f"multiple of the {tp} tensor-parallel ranks"
        )
    world = len([k for k in optim if k[0] == 0])
    prefix = "bf16_" if bf16 else ""
    optim_files = []
    for s in stages:
        ranks = {k[1] for k in optim if k[0] == s}
        if sorted(ranks) != list(range(world)):
            raise CheckpointFormatError(
                f"{folder}: model-parallel rank {s} has optimizer files for data-parallel ranks "
                f"{sorted(ranks)}; expected 0..{world - 1}, as rank 0"
                + _missing(
                    ranks, world, prefix + "zero_pp_rank_{}_mp_rank_" + f"{s:02d}_optim_states.pt"
                )
            )
        optim_files += [view.path_of(optim[(s, r)]) for r in range(world)]
    return DSFiles(
        folder,
        [view.path_of(model12[s]) for s in stages],
        optim_files,
        bf16,
        view,
        layers,
        tp,
    )


def _missing(have: set[int], world: int, pattern: str) -> str:
    """`` (missing <file>, ...)`` for the ranks below ``world`` (or the highest seen) with no
    file."""
    gone = [
        pattern.format(r) for r in range(max(world, max(have, default=-1) + 1)) if r not in have
    ]
    return f" (missing {', '.join(gone[:6])}{' ...' if len(gone) > 6 else ''})" if gone else ""


# ------------------------------------------------------------ records


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
    state: dict[
        int, dict[str, Any]
    ]  # inner optimizer state per flat buffer (moments are TensorRefs)
    param_groups: list[dict[str, Any]]  # inner optimizer groups; "params" lists flat buffer numbers
    paddings: list[int] = field(
        default_factory=list
    )  # ZeRO-1/2: this rank's padding at the end of each group


def _need(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointFormatError(f"{where}: no {key!r} entry")
    v = obj[key]
    if not isinstance(v, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CheckpointFormatError(f"{where}: {key!r} is a {type(v).__name__}, expected {names}")
    return v


def _shape(v: Any, where: str) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)) and is_index_tuple(tuple(v)):
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
    if dp is not None and not (isinstance(dp, int) and not isinstance(dp, bool) and dp > 0):
        raise CheckpointFormatError(f"{path}: dp_world_size {dp!r} is not a positive integer")
    dims = sd.get("checkpoint_parallel_dimensions")
    tp = dims.get("tp_degree") if isinstance(dims, dict) else None
    if tp is not None and not (isinstance(tp, int) and not isinstance(tp, bool) and tp > 0):
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
        sd.get("universal_checkpoint_info"),
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
    if isinstance(v, int) and not isinstance(v, bool) and v in (1, 2, 3):
        return v
    raise CheckpointFormatError(f"{where}: zero_stage {v!r} is not 1, 2 or 3")


def read_rank_optim(path: str, bf16_optimizer: bool, folder: ModelDir | None = None) -> RankOptim:
    """Read one rank's ``*_optim_states.pt`` file (its pickle only, as inert records) of ``folder``
    (default: local)."""
    a = read_archive(path, folder)
    osd = _need(a.obj, "optimizer_state_dict", dict, path)
    where = f"{path}: optimizer_state_dict"
    if "fp32_flat_groups" in osd:
        stage = _stage(osd.get("zero_stage", 3), f"{where}")
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
