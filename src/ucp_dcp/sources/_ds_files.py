"""DeepSpeed ZeRO checkpoints: which files a checkpoint folder holds.

A DeepSpeed checkpoint directory holds ``latest`` (the tag) and one folder per tag with the
model states (``[zero_pp_rank_{r}_]mp_rank_{m}_model_states.pt``), one optimizer file per rank
(``[bf16_]zero_pp_rank_{r}_mp_rank_{m}_optim_states.pt``) and, under a pipeline, one
``layer_{i}-model_{t}-model_states.pt`` per layer with state: which of them each layout (ZeRO-1/2
or 3, pipeline- or tensor-parallel) has is in docs/deepspeed-format.md. This module finds them
(in a local folder or one in a store), refusing a folder whose files do not fit one of these
layouts; what they hold is read by :mod:`._ds_records`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..byteio.location import LocalDir, ModelDir, StoreDir
from ..errors import CheckpointFormatError, listed
from ..format.schema import is_plain_file_name

__all__ = [
    "DSFiles",
    "LATEST_FILE",
    "LATEST_UNIVERSAL_FILE",
    "UNIVERSAL_DIR",
    "UNIVERSAL_MODEL_FILES",
    "check_layer_files",
    "find_deepspeed_files",
    "layer_files",
    "looks_like_deepspeed",
    "looks_like_universal",
    "universal_folder",
    "universal_model_files",
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
    folder: ModelDir
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
        _check_ranks(
            mp,
            max(mp) + 1,
            f"{folder}: model states of model-parallel ranks",
            "mp_rank_{:02d}_model_states.pt",
            name="mp_rank_{:02d}",
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
    _check_ranks(ranks, len(ranks), f"{folder}: ZeRO-3 model files for ranks")
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
    if not is_plain_file_name(tag):
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
            f" ({listed(names, 8) or 'it is empty'})"
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
    # One model-parallel rank here: the data-parallel ranks are the keys' second halves.
    _check_ranks(
        {k[1] for k in optim},
        world,
        f"{folder}: optimizer files for ranks",
        prefix + "zero_pp_rank_{}_mp_rank_00_optim_states.pt",
        note=", one per rank",
    )
    optim_files = [view.path_of(optim[(0, r)]) for r in range(world)]
    if model3:
        _check_ranks(
            {k[1] for k in model3},
            world,
            f"{folder}: ZeRO-3 model files for ranks",
            "zero_pp_rank_{}_mp_rank_00_model_states.pt",
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
    if layers:
        _check_ranks({k[1] for k in layers}, tp, f"{folder}: layer files of tensor-parallel ranks")
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
        _check_ranks(
            {k[1] for k in optim if k[0] == s},
            world,
            f"{folder}: model-parallel rank {s} has optimizer files for data-parallel ranks",
            prefix + "zero_pp_rank_{}_mp_rank_" + f"{s:02d}_optim_states.pt",
            note=", as rank 0",
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


def _check_ranks(
    have: Iterable[int],
    n: int,
    said: str,
    file: str | None = None,
    *,
    name: str = "{}",
    note: str = "",
) -> None:
    """Refuse ranks ``have`` unless they are ``0..n-1``, saying ``said``, the ranks, what was
    expected (``name`` formats the first and last rank; ``note`` follows) and the files missing
    (``file``: a pattern of the rank)."""
    ranks = sorted(have)
    if ranks != list(range(n)):
        raise CheckpointFormatError(
            f"{said} {ranks}; expected {name.format(0)}..{name.format(n - 1)}{note}"
            + (_missing(set(ranks), n, file) if file else "")
        )


def _missing(have: set[int], world: int, pattern: str) -> str:
    """`` (missing <file>, ...)`` for the ranks below ``world`` (or the highest seen) with no
    file."""
    gone = [
        pattern.format(r) for r in range(max(world, max(have, default=-1) + 1)) if r not in have
    ]
    return f" (missing {listed(gone, 6)})" if gone else ""
