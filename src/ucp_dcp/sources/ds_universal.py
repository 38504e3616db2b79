"""A DeepSpeed Universal checkpoint (``ds_to_universal`` output) as a source, read in place.

One ``torch.save`` file per parameter and state (``zero/<fqn>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``), next to the model states
DeepSpeed copied from the checkpoint it converted. Each tensor is one chunk
at its byte range; the pickles are read as inert records
(:mod:`._torch_archive`). Names are those of :mod:`.deepspeed`'s source.
Folders of pipeline- or tensor-parallel runs (one ``mp_rank_MM`` per stage x
tensor-parallel rank) hold the tensors already merged, checked against the
slices' shapes by the checkpoint's ``universal_checkpoint_info``
(:mod:`._ds_tp`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..byteio.location import LocalDir, ModelDir
from ..errors import CheckpointFormatError, listed
from ._archive_index import ArchiveIndex, ArchiveSource
from ._ds_files import (
    LATEST_UNIVERSAL_FILE,
    UNIVERSAL_DIR,
    UNIVERSAL_MODEL_FILES,
    check_layer_files,
    layer_files,
    looks_like_universal,
    universal_folder,
    universal_model_files,
)
from ._ds_records import (
    ModelStates,
    read_archive,
    read_layer_states,
    read_model_states,
    tp_slice_totals,
)
from ._ds_tp import INFO_KEYS, TPSlice, tp_rules
from ._pickle import TensorRef
from ._torch_archive import TorchArchive
from .base import SourceOptions, register
from .deepspeed import (
    EntryFile,
    add_groups,
    alias_tied,
    check_placed,
    place_entries,
    zero3_frozen,
)

__all__ = ["DeepSpeedUniversalSource", "UniversalEntry"]


@dataclass(frozen=True)
class UniversalEntry:
    """One ``zero/<fqn>/<kind>.pt`` file (its path: ``archive.path``): its tensor and the dict's
    other entries (``cat_dim``, ``vocab_tensor``; empty for a bare tensor such as ``step.pt``)."""

    archive: TorchArchive
    t: TensorRef
    entries: dict[str, Any]


@register
class DeepSpeedUniversalSource(ArchiveSource):
    """A DeepSpeed Universal checkpoint (``ds_to_universal`` output): the directory with
    ``latest_universal``, or the tag folder, local only.

    Each ``zero/<fqn>/{fp32,exp_avg,exp_avg_sq}.pt`` holds the full tensor under ``"param"``,
    ``step.pt`` the step. Names are as for :class:`DeepSpeedSource`. The folder records no
    optimizer hyperparameters, so ``optim.param_groups.<g>`` has ``params`` only: load the
    others from your own optimizer (``allow_partial_load=True``). A parameter whose folder
    lacks optimizer state ``ds_to_universal`` writes (one moment without the other, or what the
    rest of its group has: a partial copy) is refused, naming the missing files. What folders
    converted from ZeRO-3 and from pipeline- or tensor-parallel runs hold, and where their
    frozen parameters and buffers are read from: see docs/deepspeed-format.md.
    """

    format = "deepspeed-universal"
    title = "DeepSpeed Universal"
    looks_for = f"{LATEST_UNIVERSAL_FILE} / {UNIVERSAL_DIR}/"
    detect_order = 40

    def __init__(self, path: str) -> None:
        folder = universal_folder(path)
        model_files = universal_model_files(folder)
        if not model_files:
            raise CheckpointFormatError(
                f"{folder}: a DeepSpeed Universal folder without model states "
                f"(expected {' or '.join(UNIVERSAL_MODEL_FILES)})"
            )
        models = [read_model_states(f) for f in model_files]
        b = ArchiveIndex([m.archive for m in models])
        zero = os.path.join(folder, UNIVERSAL_DIR)
        if len(models) > 1 and os.path.basename(model_files[0]).startswith("mp_rank_"):
            groups = _parallel(b, models, folder)
        else:
            groups = _data_parallel(b, models, zero)
        for g, names in enumerate(groups):
            b.value(("optim", "param_groups", g, "params"), names)
        super().__init__(path, b, 1, [0] * len(b.archives))

    @classmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """A directory with ``latest_universal``, or a folder with ``zero/`` and its model states
        (ZeRO-1/2 or 3)."""
        return looks_like_universal(d)

    @classmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> DeepSpeedUniversalSource:
        """Read every file's pickle (as inert records; tensor data is not read). A local directory
        only: one in object storage is refused, naming it."""
        if d.store is not None:
            raise CheckpointFormatError(
                f"{d.where}: a DeepSpeed Universal checkpoint is read from a local directory only; "
                "copy it to one first"
            )
        return cls(d.where)


def _read(b: ArchiveIndex, zero: str, fqn: str, kind: str) -> UniversalEntry | None:
    """``zero/<fqn>/<kind>.pt`` (None if absent), its archive added to ``b``."""
    f = os.path.join(zero, fqn, f"{kind}.pt")
    if not os.path.isfile(f):
        return None
    a = read_archive(f)
    entries = a.obj if isinstance(a.obj, dict) else {}
    t = entries.get("param") if isinstance(a.obj, dict) else a.obj
    if not isinstance(t, TensorRef):
        raise CheckpointFormatError(
            f"{f}: holds no tensor (expected a dict with 'param', or a tensor)"
        )
    unknown = sorted(str(k) for k in entries if k not in _ENTRY_KEYS)
    if unknown:
        raise CheckpointFormatError(
            f"{f}: holds key(s) {', '.join(repr(k) for k in unknown)} this reader does not know "
            f"(it knows {', '.join(_ENTRY_KEYS)}); an unread key could change what the tensor is"
        )
    b.add_archive(a)
    return UniversalEntry(a, t, entries)


# The keys ds_to_universal writes beside a merged tensor (deepspeed.checkpoint.constants:
# PARAM, CAT_DIM, PARAM_N_SUB_PARAMS, SUB_PARAM_SHAPE, VOCAB_TENSOR); the layout they describe is
# checked against universal_checkpoint_info's.
_ENTRY_KEYS = ("param", "cat_dim", "param_n_sub_params", "sub_param_shape", "vocab_tensor")


def _data_parallel(b: ArchiveIndex, models: list[ModelStates], zero: str) -> list[list[str]]:
    """The folder of a data-parallel run (one ``mp_rank_00``, or ZeRO-3's per-rank model states):
    the tensors in ``param_shapes``' shapes; the param groups' fqns (none from ZeRO-3)."""
    m0 = models[0]

    def one(fqn: str, kind: str, shape: tuple[int, ...] | None) -> UniversalEntry | None:
        e = _read(b, zero, fqn, kind)
        # From a ZeRO-3 source, ds_to_universal saves each tensor flattened
        # (1-D, the same elements in row-major order): read as the shape.
        if (
            e is not None
            and shape is not None
            and e.t.size != shape
            and not (e.t.size == (math.prod(shape),) and e.t.stride == (1,))
        ):
            raise CheckpointFormatError(
                f"{e.archive.path}: a tensor of shape {list(e.t.size)}, expected {list(shape)} "
                "from param_shapes"
            )
        return e

    shapes = {fqn: shape for d in m0.param_shapes for fqn, shape in d.items()}
    present: dict[str, frozenset[str]] = {}
    for fqn, shape in {**shapes, **m0.frozen_shapes}.items():
        got = one(fqn, "fp32", shape)
        if got is None and fqn not in shapes and len(models) > 1:
            # From ZeRO-3, ds_to_universal writes no files for frozen
            # parameters; the copied per-rank model states hold them.
            zero3_frozen(b, models, fqn, shape)
            continue
        if got is None:
            raise CheckpointFormatError(f"{zero}: no {fqn}/fp32.pt for parameter {fqn!r}")
        _record_entry(b, ("model", fqn), got, shape, f"parameter {fqn!r}")
        if fqn in shapes:

            def state(
                kind: str, fqn: str = fqn, shape: tuple[int, ...] = shape
            ) -> UniversalEntry | None:
                return one(fqn, kind, None if kind == "step" else shape)

            present[fqn] = _moments(b, zero, fqn, state, shape)
    if len(models) == 1:
        groups = [(f"param_shapes[{g}]", list(d)) for g, d in enumerate(m0.param_shapes)]
        _check_groups(zero, groups, present, shapes, required=False)
    else:
        # From ZeRO-3 (param_shapes: sub-groups), every parameter's: extract_zero_shards_stage3
        # takes both moments of every sub-group, and DeepSpeed's loader reads both.
        _check_groups(zero, [("param_shapes", list(shapes))], present, shapes, required=True)
    alias_tied(b, [m0])
    buffers = {n: m0.module[n] for n in m0.buffer_names if n in m0.module}
    place_entries(b, [EntryFile(0, 0, m0.archive, buffers, "")], (), ())
    check_placed(b, models, dict.fromkeys(m0.buffer_names, 0), buffers, "not in its module")
    # From ZeRO-3, param_shapes lists the optimizer's sub-groups, not its
    # parameter groups: no optim.param_groups there.
    return [list(d) for d in m0.param_shapes] if len(models) == 1 else []


# What ds_to_universal writes beside fp32.pt of a parameter of the optimizer (one of
# param_shapes'), from the optimizer state of its group: exp_avg and exp_avg_sq together
# (extract_zero_shards and extract_zero_shards_stage3 take both from the same state;
# merge_tp_slices and merge_zero3_slices write fp32, exp_avg, exp_avg_sq), with step where
# that state has one (ZeRO-1/2: "step" in the group's state; from ZeRO-3: never).
_MOMENTS = ("exp_avg", "exp_avg_sq")
_STATE = (*_MOMENTS, "step")


def _moments(
    b: ArchiveIndex,
    zero: str,
    fqn: str,
    one: Callable[[str], UniversalEntry | None],
    shape: tuple[int, ...],
) -> frozenset[str]:
    """``optim.state.<fqn>.{exp_avg,exp_avg_sq,step}`` of a parameter of the optimizer (``one``
    reads and checks one file, None if absent; the moments are of ``shape``,
    :func:`_record_entry`); the kinds its folder holds.

    A folder with some of the files ``ds_to_universal`` writes together but not all (one
    moment without the other, ``step.pt`` without both) is refused, naming it and the missing
    file(s): a partial copy, whose absent file is lost state. Whether a parameter should have
    them at all, and ``step.pt``, is checked across its group: :func:`_check_groups`.
    """
    got = {kind: one(kind) for kind in _STATE}
    has = frozenset(kind for kind, e in got.items() if e is not None)
    if has and not has.issuperset(_MOMENTS):
        missing = [f"{kind}.pt" for kind in _MOMENTS if kind not in has]
        held = [f"{kind}.pt" for kind in _STATE if kind in has]
        raise CheckpointFormatError(
            f"{os.path.join(zero, fqn)}: holds {' and '.join(held)} but no "
            f"{' and no '.join(missing)} for parameter {fqn!r}; ds_to_universal writes exp_avg.pt "
            "and exp_avg_sq.pt together, from the same optimizer state (a partial copy of the "
            "folder?)"
        )
    for kind, e in got.items():
        if e is None:
            continue
        path, what = ("optim", "state", fqn, kind), f"{kind} of {fqn!r}"
        if kind == "step":
            b.whole(path, e.archive, e.t, e.t.size, what)
        else:
            _record_entry(b, path, e, shape, what)
    return has


def _record_entry(
    b: ArchiveIndex, path: tuple[str, ...], e: UniversalEntry, shape: tuple[int, ...], what: str
) -> None:
    """The tensor of file ``e`` as the key at ``path``, of ``shape``: a ``vocab_tensor`` that
    still holds padding rows cut to ``shape`` (:func:`_padded`)."""
    b.whole(path, e.archive, e.t, shape, what, _padded(e, shape))


def _check_groups(
    zero: str,
    groups: list[tuple[str, list[str]]],
    present: dict[str, frozenset[str]],
    shapes: dict[str, tuple[int, ...]],
    *,
    required: bool,
) -> None:
    """Refuse a group (where it is listed, its fqns) whose parameters' folders do not all hold
    the same optimizer state (``present``: fqn -> the kinds its folder holds).

    ``ds_to_universal`` takes a parameter's state from its group's flat optimizer state, so
    every parameter of a group has ``exp_avg.pt`` and ``exp_avg_sq.pt`` (and ``step.pt``
    where that state has a step), or, where the group has no optimizer state, none of them
    (ZeRO-1/2: DeepSpeed 0.19 then writes ``fp32.pt`` from ``module`` alone). ``required``:
    every parameter has the moments (from ZeRO-3). A parameter of no elements may lack
    them (its partitions hold no fragment of it).
    """
    for where, names in groups:
        fqns = [f for f in names if f in present and (present[f] or math.prod(shapes[f]))]
        stateful = [f for f in fqns if present[f]]
        if not stateful and not (required and fqns):
            continue
        want = _STATE if any("step" in present[f] for f in stateful) else _MOMENTS
        bad = [
            f"{os.path.join(zero, f)}: no {', '.join(f'{k}.pt' for k in want if k not in has)}"
            for f, has in ((f, present[f]) for f in fqns)
            if not has.issuperset(want)
        ]
        if bad:
            why = (
                f"ds_to_universal writes {' and '.join(f'{k}.pt' for k in _MOMENTS)} for every "
                "parameter of a ZeRO-3 checkpoint"
                if required
                else "ds_to_universal writes an optimizer group's state for all its parameters "
                f"or for none, and {len(fqns) - len(bad)} of the {len(fqns)} parameters of "
                f"{where} have {', '.join(f'{k}.pt' for k in want)}"
            )
            raise CheckpointFormatError(
                f"{listed(bad, 5, '; ')} ({why}; a partial copy of the folder?)"
            )


def _parallel(b: ArchiveIndex, models: list[ModelStates], folder: str) -> list[list[str]]:
    """The folder of a pipeline- or tensor-parallel run: one ``mp_rank_MM`` per model-parallel
    rank (stage ``MM // tp``, tensor-parallel rank ``MM % tp``), whose ``param_shapes`` hold
    local slices under the engine module's names; ``zero/<fqn>/*.pt`` hold them merged.

    Each file's tensor must have the full shape the checkpoint's ``universal_checkpoint_info``
    gives the slices (:mod:`._ds_tp`), its ``cat_dim`` the dimension they say; a
    ``vocab_tensor`` still holding its padding rows is cut to ``original_vocab_size``. Frozen
    parameters and buffers come from the model states' ``module`` (tensor-parallel rank 0's
    where replicated, as :class:`~ucp_dcp.sources.deepspeed.DeepSpeedSource` reads them), or
    under a pipeline (``module`` None) from layer files: :func:`_layer_entry_files`.
    """
    zero = os.path.join(folder, UNIVERSAL_DIR)
    m0 = models[0]
    tps = {m.tp_degree for m in models}
    if len(tps) != 1 or None in tps:
        bad = next(m for m in models if m.tp_degree is None or m.tp_degree != m0.tp_degree)
        raise CheckpointFormatError(
            f"{bad.archive.path}: checkpoint_parallel_dimensions['tp_degree'] is "
            f"{bad.tp_degree!r} ({m0.archive.path}: {m0.tp_degree!r}); a Universal folder of "
            f"{len(models)} model-parallel ranks needs it to tell stages from tensor-parallel "
            "ranks"
        )
    tp = m0.tp_degree or 1
    if len(models) % tp:
        raise CheckpointFormatError(
            f"{m0.archive.path}: {len(models)} model states files (mp_rank_XX) are not a "
            f"multiple of tp_degree {tp}"
        )
    local: dict[str, tuple[int, ...]] = {}  # fqn -> tensor-parallel rank 0's slice shape
    groups: list[dict[str, None]] = []  # each group's fqns in stage order
    # Each stage's optimizer groups (tensor-parallel rank 0's names, as ``local``'s).
    stage_groups: dict[tuple[int, int], list[str]] = {}
    for mi, m in enumerate(models):
        add_groups(groups, m.param_shapes)
        if mi % tp == 0:
            for g, d in enumerate(m.param_shapes):
                stage_groups.setdefault((mi // tp, g), []).extend(d)
                for fqn, shape in d.items():
                    local.setdefault(fqn, shape)
    totals = tp_slice_totals(models, tp)
    info = m0.universal_info
    rules = (
        tp_rules(info, m0.archive.path, sorted(local))
        if tp > 1
        or (isinstance(info, dict) and info.get(INFO_KEYS["VOCABULARY_PARAMETER_PATTERNS"]))
        else None
    )

    def merged(fqn: str, shape: tuple[int, ...]) -> TPSlice | None:
        """How the slices of ``fqn`` were joined (None: replicated, averaged, or no tensor
        parallelism: the slice's shape)."""
        if rules is None:
            return None
        sl = rules.slice_of(fqn, 0, tp, shape, totals.get(fqn))
        return None if sl.merge else sl

    present: dict[str, frozenset[str]] = {}
    fulls: dict[str, tuple[int, ...]] = {}
    for fqn, shape in local.items():
        sl = merged(fqn, shape)
        full = sl.full_shape if sl is not None else shape

        def one(
            kind: str,
            fqn: str = fqn,
            full: tuple[int, ...] = full,
            sl: TPSlice | None = sl,
            shape: tuple[int, ...] = shape,
        ) -> UniversalEntry | None:
            e = _read(b, zero, fqn, kind)
            if e is None or kind == "step":
                return e
            cat = e.entries.get("cat_dim")
            if sl is not None and sl.cat_dim is not None and cat is not None and cat != sl.cat_dim:
                raise CheckpointFormatError(
                    f"{e.archive.path}: cat_dim {cat!r}, but universal_checkpoint_info joins "
                    f"{fqn!r} along dimension {sl.cat_dim} ({sl.rule})"
                )
            if e.t.size != full and _padded(e, full) is None:
                raise CheckpointFormatError(
                    f"{e.archive.path}: a tensor of shape {list(e.t.size)}, expected {list(full)}: "
                    f"param_shapes' {list(shape)} of {tp} tensor-parallel rank(s) joined as "
                    "universal_checkpoint_info says"
                )
            return e

        e = one("fp32")
        if e is None:
            raise CheckpointFormatError(f"{zero}: no {fqn}/fp32.pt for parameter {fqn!r}")
        _record_entry(b, ("model", fqn), e, full, f"parameter {fqn!r}")
        fulls[fqn] = full
        present[fqn] = _moments(b, zero, fqn, one, full)
    _check_groups(
        zero,
        [
            (f"param_shapes[{g}] of {os.path.basename(models[st * tp].archive.path)}", fqns)
            for (st, g), fqns in stage_groups.items()
        ],
        present,
        fulls,
        required=False,
    )
    alias_tied(b, models)
    # Frozen parameters and buffers: in the module state dicts without a pipeline, in layer
    # files under one.
    buffers = {n: mi for mi, m in enumerate(models) for n in m.buffer_names}
    frozen = {n: mi for mi, m in enumerate(models) for n in m.frozen_shapes}
    if any(m.module_is_none for m in models):
        files = _layer_entry_files(folder, models, tp, sorted(buffers), sorted(frozen))
    else:
        files = [EntryFile(0, mi % tp, m.archive, m.module, "") for mi, m in enumerate(models)]
    skip = set(local) | {n for m in models for n in m.shared}
    place_entries(b, files, set(local) | set(buffers), skip, rules if tp > 1 else None, tp)
    layers = [f for f in files if f.prefix is None]
    where = (
        f"in no layer file of {os.path.dirname(layers[0].archive.path)}"
        if layers
        else "not in its module"
    )
    check_placed(b, models, {**frozen, **buffers}, buffers, where)
    return [list(g) for g in groups]


def _layer_entry_files(
    folder: str, models: list[ModelStates], tp: int, buffers: list[str], frozen: list[str]
) -> list[EntryFile]:
    """The layer files of a pipeline run's Universal folder (whose model states' ``module`` is
    None): the ``layer_XX-model_YY-model_states.pt`` files copied into ``folder``, else those of
    the tag folder it was converted from next to it (Megatron-DeepSpeed's layout:
    ``<tag>_universal`` beside ``<tag>``).

    ``ds_to_universal`` copies no layer files, so a folder with neither holds the
    frozen parameters and ``buffers`` in no file: refused, naming them (``frozen``:
    those the model states record; ZeRO-1's record none), unless there are none.
    """
    base = os.path.basename(os.path.normpath(folder))
    sibling = (
        os.path.join(os.path.dirname(os.path.normpath(folder)), base.removesuffix("_universal"))
        if base.endswith("_universal")
        else None
    )
    found = layer_files(LocalDir(folder))
    if not found and sibling is not None:
        found = layer_files(LocalDir(sibling))
        if found:
            _check_converted_from(sibling, folder, models)
    if not found:
        names = [f"buffer {n!r}" for n in buffers] + [f"frozen parameter {n!r}" for n in frozen]
        if not names:
            return []
        raise CheckpointFormatError(
            f"{folder}: a Universal folder of a pipeline run holds no layer files, so "
            f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} in no file "
            "(ds_to_universal does not copy the layer_XX-model_YY-model_states.pt files that "
            "hold frozen parameters and buffers): copy them from the checkpoint it was "
            "converted from into this folder, where DeepSpeed's PipelineEngine reads them too"
            + (f", or keep that checkpoint's tag folder as {sibling}" if sibling else "")
        )
    check_layer_files(found, tp, os.path.dirname(next(iter(found.values()))))
    return [
        EntryFile(index, rank, *read_layer_states(path), None)
        for (index, rank), path in sorted(found.items())
    ]


def _padded(e: UniversalEntry, full: tuple[int, ...]) -> TPSlice | None:
    """A ``vocab_tensor`` entry that still holds padding rows beyond ``full``'s: its first
    ``full[0]`` rows (None otherwise)."""
    t = e.t.size
    if (
        e.entries.get("vocab_tensor") is True
        and len(t) == len(full) >= 1
        and t[0] > full[0]
        and t[1:] == full[1:]
    ):
        return TPSlice.cut(t, full[0])
    return None


def _check_converted_from(sibling: str, folder: str, models: list[ModelStates]) -> None:
    """Refuse tag folder ``sibling`` unless it is the checkpoint Universal ``folder`` was
    converted from: ``ds_to_universal`` copies each ``mp_rank_MM_model_states.pt`` byte for
    byte (small under a pipeline: ``module`` is None), so another run's layer files are not
    read as this one's."""
    for m in models:
        name = os.path.basename(m.archive.path)
        try:
            theirs: bytes | None = Path(sibling, name).read_bytes()
        except FileNotFoundError:
            theirs = None
        if theirs != Path(m.archive.path).read_bytes():
            what = (
                f"it has no {name}"
                if theirs is None
                else f"its {name} differs from the byte copy ds_to_universal made of it"
            )
            raise CheckpointFormatError(
                f"{sibling}: not the checkpoint {folder} was converted from ({what}), so its "
                "layer files are not read"
            )
