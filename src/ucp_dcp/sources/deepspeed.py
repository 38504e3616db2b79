"""A DeepSpeed ZeRO checkpoint (stage 1, 2 or 3, fp32 or bf16; data-, pipeline-, tensor- or
expert-parallel) as a source, read in place.

Opening reads the pickles only, as inert records (:mod:`._torch_archive`; ``deepspeed`` is never
imported), and lays each parameter over the ranks' flat fp32 buffers (:mod:`._ds_records`), so
a rank of any new layout reads exactly the slices it needs, with no conversion pass.
Tensor-parallel slices are joined as :mod:`._ds_tp` says, MoE experts found by :mod:`._ds_moe`.
The keys (those of ``get_state_dict(model, optim)``) and how each layout is read: see
docs/sources.md and docs/deepspeed-format.md.

The functions that record what every DeepSpeed layout holds (a parameter over flat buffers, the
entries of a model states or layer file, tied aliases) are shared with the Universal folders
(:mod:`.ds_universal`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from ..byteio.location import ModelDir, StoreDir
from ..errors import CheckpointFormatError, InvalidArgumentError
from ._archive_index import ArchiveIndex, ArchiveSource
from ._ds_files import (
    LATEST_FILE,
    find_deepspeed_files,
    looks_like_deepspeed,
)
from ._ds_moe import ExpertLayout, expert_layout
from ._ds_records import (
    ModelStates,
    RankOptim,
    Segment,
    archive_pool,
    check_zero12_groups,
    moment,
    read_layer_states,
    read_model_states,
    read_rank_optim,
    tp_slice_totals,
    zero3_segments,
    zero12_group_segments,
)
from ._ds_tp import UNEVEN_RULES, TPRule, TPRules, TPSlice, tp_rules, user_tp_rules
from ._pickle import TensorRef
from ._torch_archive import TorchArchive
from .base import SourceOptions, register

__all__ = [
    "DeepSpeedSource",
    "EntryFile",
    "add_groups",
    "alias_tied",
    "check_placed",
    "place_entries",
    "zero3_frozen",
]

# Inner optimizer state that is one value per flat buffer, not per element.
_SCALAR_STATE = ("step",)


def zero3_frozen(
    b: ArchiveIndex, models: list[ModelStates], fqn: str, shape: tuple[int, ...]
) -> None:
    """``model.<fqn>`` of a ZeRO-3 frozen parameter: one padded slice per rank's
    ``frozen_param_fragments``."""
    world = len(models)
    ps = -(-math.prod(shape) // world)
    segs = zero3_segments([math.prod(shape)], world, [ps])[0]

    def frag(seg: Segment) -> tuple[TorchArchive, TensorRef]:
        return models[seg.rank].archive, _frozen_fragment(models[seg.rank], fqn)

    b.flat(("model", fqn), shape, segs, frag, f"frozen parameter {fqn!r}")


def _frozen_fragment(m: ModelStates, fqn: str) -> TensorRef:
    """Frozen parameter ``fqn``'s entry in the ``frozen_param_fragments`` of model states ``m``
    (its whole tensor, or under ZeRO-3 the rank's padded slice)."""
    t = m.frozen_fragments.get(fqn)
    if t is None:
        raise CheckpointFormatError(
            f"{m.archive.path}: no frozen_param_fragments entry for {fqn!r}"
        )
    return t


def record_param(
    b: ArchiveIndex,
    fqn: str,
    shape: tuple[int, ...],
    segs: list[Segment],
    optims: list[RankOptim],
    first_buffer: int,
    place: TPSlice | None = None,
) -> None:
    """``model.<fqn>``, the fp32 weight laid out as ``segs`` of the ranks' fp32 buffers, and
    ``optim.state.<fqn>.*``: its per-element moments laid out the same way, plus the step
    (``place``: ``shape`` is that tensor-parallel slice of them)."""
    b.flat(
        ("model", fqn),
        shape,
        segs,
        lambda s: (optims[s.rank].archive, optims[s.rank].fp32[s.buffer]),
        f"fp32 weight {fqn!r}",
        place,
    )
    st0 = optims[0].state.get(first_buffer, {})
    for name, v in st0.items():
        path = ("optim", "state", fqn, name)
        # Every entry is a tensor: a per-element moment or a scalar (the step). Anything else
        # is state this reader does not know how to place: refused, never dropped.
        if not isinstance(v, TensorRef):
            raise CheckpointFormatError(
                f"{optims[0].archive.path}: optimizer state {name!r} of flat buffer "
                f"{first_buffer} is a {type(v).__name__}, not a tensor"
            )
        if name in _SCALAR_STATE or not v.size:
            b.whole(path, optims[0].archive, v, (), f"{name} of flat buffer {first_buffer}")
            continue

        def buffer_of(seg: Segment, name: str = name) -> tuple[TorchArchive, TensorRef]:
            o = optims[seg.rank]
            t = moment(
                o.state.get(seg.buffer, {}),
                name,
                o.fp32[seg.buffer].numel,
                f"{o.archive.path}: optimizer state of flat buffer {seg.buffer}",
            )
            if t is None:
                raise CheckpointFormatError(
                    f"{o.archive.path}: flat buffer {seg.buffer} has no {name!r} state"
                )
            return o.archive, t

        b.flat(path, shape, segs, buffer_of, f"{name} of {fqn!r}", place)


# keep(fqn, shape): whether to record a parameter here, and as which tensor-parallel slice.
_Keep = Callable[[str, tuple[int, ...]], tuple[bool, TPSlice | None]]


def _zero12(
    b: ArchiveIndex,
    m0: ModelStates,
    optims: list[RankOptim],
    keep: _Keep | None = None,
    moe: ExpertLayout | None = None,
) -> list[list[str]]:
    """Each ZeRO-1/2 group's parameters (``m0.param_shapes``) laid over the partitions of
    ``optims`` (``keep``: which to record here); ``moe``'s expert groups once per
    expert-parallel rank, over its ranks, under global expert names. The groups' fqns."""
    check_zero12_groups(m0, optims[0])
    groups = []
    for g, shapes in enumerate(m0.param_shapes):
        names: list[str] = []
        parts = moe.parts(m0, g) if moe is not None else [(list(range(len(optims))), None)]
        for ranks, e in parts:
            all_segs = zero12_group_segments(m0, [optims[r] for r in ranks], g)
            for (fqn, shape), segs in zip(shapes.items(), all_segs):
                if moe is not None and e is not None:
                    fqn = moe.expert_name(fqn, e, shape)
                    segs = [replace(s, rank=ranks[s.rank]) for s in segs]
                record, place = keep(fqn, shape) if keep is not None else (True, None)
                if record:
                    record_param(b, fqn, shape, segs, optims, g, place)
                names.append(fqn)
        groups.append(names)
    return groups


def add_groups(groups: list[dict[str, None]], more: Iterable[Iterable[str]]) -> None:
    """Add the names of each group of ``more`` to the same group of ``groups`` (its names in the
    order first seen, once each), adding groups as needed."""
    for g, names in enumerate(more):
        if g == len(groups):
            groups.append({})
        groups[g].update(dict.fromkeys(names))


def alias_tied(b: ArchiveIndex, models: Iterable[ModelStates]) -> None:
    """``model.<tied>`` of each of the models' ``shared_params``: the bytes of its owner."""
    for m in models:
        for tied, owner in m.shared.items():
            b.alias(("model", tied), ("model", owner))


def recorded_names(b: ArchiveIndex) -> set[str]:
    """The names of the ``model.<name>`` tensors recorded so far."""
    return {k[len("model.") :] for k in b.tensors if k.startswith("model.")}


# A pipeline-parallel run's layer files save each layer's ``state_dict()`` on its own, with the
# layer's own names (``fc1.weight``). The engine module, whose names the optimizer's
# ``param_shapes`` and ``buffer_names`` use, registers layer ``XX`` as ``XX`` (``3.fc1.weight``)
# and a ``TiedLayerSpec`` module once, as ``tied_modules.<key>``, whichever layer indices it
# appears at. Nothing in the files says which layer is tied to which key: layer_prefix tells it
# from the names the stages' model states know.

TIED_PREFIX = "tied_modules."


def tied_keys(names: Iterable[str]) -> list[str]:
    """The ``TiedLayerSpec`` keys among engine-module names (``tied_modules.<key>.*``), sorted."""
    return sorted(
        {n[len(TIED_PREFIX) :].split(".", 1)[0] for n in names if n.startswith(TIED_PREFIX)}
    )


def layer_prefix(
    index: int, entries: Collection[str], known: Collection[str], tied: Iterable[str], path: str
) -> str:
    """The engine-module prefix of layer file ``path`` (global layer ``index``, holding
    ``entries``): ``"<index>."``, or ``"tied_modules.<key>."`` of the one tied module whose
    names ``known`` (the stages' parameter and buffer names) share an entry with it.

    A layer none of whose entries the stages name (only frozen parameters, say) is
    ``"<index>."``; one that two tied modules could be is refused.
    """
    own = f"{index}."
    if any(own + e in known for e in entries):
        return own
    hits = [k for k in tied if any(f"{TIED_PREFIX}{k}.{e}" in known for e in entries)]
    if len(hits) > 1:
        raise CheckpointFormatError(
            f"{path}: layer {index}'s entries {sorted(entries)} match tied modules "
            f"{', '.join(hits)} alike; cannot tell which one this layer is"
        )
    return f"{TIED_PREFIX}{hits[0]}." if hits else own


@dataclass(frozen=True)
class EntryFile:
    """A file holding frozen parameters and buffers: a layer file (global layer ``index``,
    tensor-parallel ``rank``; ``prefix`` None: told by :func:`layer_prefix`), or a model states
    file's ``module`` or an expert file (full names: ``prefix`` ``""``)."""

    index: int
    rank: int
    archive: TorchArchive
    entries: dict[str, TensorRef]
    prefix: str | None


def place_entries(
    b: ArchiveIndex,
    files: Iterable[EntryFile],
    known: Collection[str],
    skip: Collection[str],
    rules: TPRules | None = None,
    tp: int = 1,
) -> None:
    """Record ``model.<name>`` for each entry of ``files`` not in ``skip`` (trainable parameters,
    read from the fp32 masters, tied aliases, whatever is recorded already): the one way every
    DeepSpeed layout records the entries no optimizer holds.

    ``known``: the stages' parameter and buffer names (which tell a layer file's prefix). A
    tied layer's copies at later indices are skipped. Under tensor parallelism (``rules``,
    degree ``tp``) a split entry is placed slice by slice, a replicated one read from rank 0.
    The files' archives not in ``b`` yet are added to it.
    """
    tied = tied_keys(known)
    first_file: dict[str, int] = {}  # name -> the layer index it is read from
    for f in files:
        prefix = f.prefix
        if prefix is None:
            prefix = layer_prefix(f.index, list(f.entries), known, tied, f.archive.path)
        if id(f.archive) not in b.file_of:
            b.add_archive(f.archive)
        kind = "layer entry" if f.prefix is None else "module entry"
        for entry, t in f.entries.items():
            name = prefix + entry
            if name in skip or first_file.setdefault(name, f.index) != f.index:
                continue  # the fp32 master weight (or a tied alias), or a tied layer's copy
            path, what = ("model", name), f"{kind} {entry!r}"
            sl = rules.slice_of(name, f.rank, tp, t.size) if rules is not None else None
            if sl is None or sl.merge == "replica":  # the same on every rank: rank 0's
                if f.rank == 0:
                    b.whole(path, f.archive, t, t.size, what)
            elif f.rank == 0 or not sl.replicated:  # a replicated vocabulary is cut from rank 0's
                b.whole(path, f.archive, t, t.size, what, sl)


def check_placed(
    b: ArchiveIndex,
    models: list[ModelStates],
    named: Mapping[str, int],
    buffers: Collection[str],
    where: str,
) -> None:
    """Refuse the first of ``named`` (name -> the model-parallel rank whose model states name
    it) that is not recorded: a buffer (in ``buffers``) or frozen parameter that is ``where``
    (``"in no layer file"``)."""
    for name, mi in named.items():
        if f"model.{name}" not in b.tensors:
            kind = "buffer" if name in buffers else "frozen parameter"
            raise CheckpointFormatError(
                f"{models[mi].archive.path}: {kind} {name!r} of model-parallel rank {mi} is {where}"
            )


@register
class DeepSpeedSource(ArchiveSource):
    """A DeepSpeed ZeRO-1/2/3 checkpoint, data-, pipeline- or tensor-parallel: the directory with
    ``latest``, or one tag folder, as a directory view (local, or a
    :class:`~ucp_dcp.byteio.location.StoreDir`).

    ``tp_rules``: as :attr:`SourceOptions.tp_rules <ucp_dcp.sources.base.SourceOptions.tp_rules>`,
    matched against the engine's parameter names (``1.fc2.weight``,
    ``model.layers.0.mlp.down_proj.weight``). A rule that matches no parameter is refused;
    without tensor parallelism the rules are not needed and not read.
    """

    format = "deepspeed"
    title = "DeepSpeed"
    looks_for = f"{LATEST_FILE} / *zero_pp_rank_*_optim_states.pt"
    detect_order = 30

    def __init__(self, d: ModelDir, *, tp_rules: object = None) -> None:
        self._user_rules: tuple[TPRule, ...] = user_tp_rules(tp_rules)
        files = find_deepspeed_files(d)
        folder = files.folder
        layer_paths = list(files.layers.values())
        with archive_pool(folder, len(files.model) + len(files.optim) + len(layer_paths)) as pool:
            mf = [pool.submit(read_model_states, p, folder) for p in files.model]
            of = [
                pool.submit(read_rank_optim, p, files.bf16_optimizer, folder) for p in files.optim
            ]
            lf = [pool.submit(read_layer_states, p, folder) for p in layer_paths]
            models = [f.result() for f in mf]
            optims = [f.result() for f in of]
            layers = [f.result() for f in lf]
        # Pipeline- or tensor-parallel: one model states file per model-parallel rank (stage x
        # tensor-parallel rank), the optimizer files rank by rank.
        parallel = bool(files.layers) or files.tp > 1
        moe = expert_layout(files, models, optims)
        mp = len(models) if parallel else 1
        dp = len(optims) // mp
        self.world_size = len(optims)
        for m, mpath in zip(models if parallel else models[:1], files.model):
            if m.dp_world_size is not None and m.dp_world_size != dp:
                raise CheckpointFormatError(
                    f"{files.directory}: saved by {m.dp_world_size} data-parallel ranks "
                    f"(dp_world_size in {os.path.basename(mpath)}) but holds optimizer files of "
                    f"{dp}: "
                    f"{', '.join(os.path.basename(p) for p in files.optim)}"
                )
            if m.module_is_none and not files.layers:
                raise CheckpointFormatError(
                    f"{mpath}: 'module' is None (a pipeline-parallel engine's model states) but "
                    f"{files.directory} holds no layer_XX-model_YY-model_states.pt files"
                )
        self.stage = optims[0].stage
        for p, o in zip(files.optim, optims):
            if o.stage != self.stage or len(o.fp32) != len(optims[0].fp32):
                raise CheckpointFormatError(
                    f"{p}: ZeRO stage {o.stage} with {len(o.fp32)} flat buffers; "
                    f"{files.optim[0]} has stage {self.stage} with {len(optims[0].fp32)}"
                )
        if not parallel and (self.stage == 3) != (len(models) > 1):
            raise CheckpointFormatError(
                f"{files.directory}: ZeRO stage {self.stage} optimizer files with "
                f"{'per-rank' if len(models) > 1 else 'one'} model states file(s)"
            )
        b = ArchiveIndex([m.archive for m in models] + [o.archive for o in optims])
        m0 = models[0]
        if parallel:
            groups = self._pipeline(b, models, optims, dict(zip(files.layers, layers)), files.tp)
        elif self.stage == 3:
            groups = self._zero3(b, models, optims)
        else:
            groups = _zero12(b, m0, optims, moe=moe)
            if moe is not None:  # the expert files' entries no optimizer holds (buffers)
                experts = [EntryFile(k[0], 0, a, e, "") for k, (a, e) in moe.files.items()]
                place_entries(b, experts, (), recorded_names(b))
        self._param_groups(b, optims[0], groups)
        if not parallel:
            self._frozen_and_buffers(b, models)
        alias_tied(b, [m0])
        if parallel:
            # The global rank that wrote each file, on Megatron-DeepSpeed's (pipe, data, model)
            # grid: data-parallel rank 0 of each model-parallel rank wrote its model states
            # and layer files.
            tp = files.tp

            def grid_rank(m: int, r: int) -> int:
                return (m // tp) * dp * tp + r * tp + m % tp

            ranks = [grid_rank(m, 0) for m in range(mp)]
            ranks += [grid_rank(m, r) for m in range(mp) for r in range(dp)]
            ranks += [grid_rank(self._layer_stage.get(i, 0) * tp + t, 0) for i, t in files.layers]
        else:
            ranks = [r if self.stage == 3 else 0 for r in range(len(models))] + list(
                range(len(optims))
            )
            ranks += moe.writers() if moe is not None else []
        super().__init__(d.where, b, self.world_size, ranks)
        if isinstance(folder, StoreDir):
            self.store = folder.store  # the tag folder's: paths are its objects' URLs

    # ------------------------------------------------------------ layouts
    def _pipeline(
        self,
        b: ArchiveIndex,
        models: list[ModelStates],
        optims: list[RankOptim],
        layers: dict[tuple[int, int], tuple[TorchArchive, dict[str, TensorRef]]],
        tp: int,
    ) -> list[list[str]]:
        """A PipelineModule's checkpoint: each model-parallel rank's ZeRO-1/2 partitions
        (``models[m]``, its share of ``optims``: stage ``m // tp``, tensor-parallel rank
        ``m % tp``) under the engine module's names, then the layer files' frozen parameters
        and buffers; the param groups' fqns over all stages.

        A tied parameter is in every stage that uses it, equal (DeepSpeed all-reduces its
        gradient over those stages): read from the first. Under tensor parallelism a
        replicated parameter is read from tensor-parallel rank 0.
        """
        if self.stage == 3:
            raise CheckpointFormatError(
                f"{models[0].archive.path}: ZeRO-3 optimizer files in a pipeline- or "
                "tensor-parallel checkpoint"
            )
        dp = len(optims) // len(models)
        trainable = {n for m in models for shapes in m.param_shapes for n in shapes}
        totals = tp_slice_totals(models, tp)
        m0 = models[0]
        rules = (
            tp_rules(m0.universal_info, m0.archive.path, sorted(trainable), self._user_rules)
            if tp > 1
            else None
        )
        groups: list[dict[str, None]] = []
        self._layer_stage: dict[int, int] = {}
        owner: dict[str, int] = {}  # fqn -> the stage it is read from
        local: dict[str, tuple[tuple[int, ...], int]] = {}  # fqn -> (slice shape, mp rank)
        hyper0 = [{k: v for k, v in g.items() if k != "params"} for g in optims[0].param_groups]
        for mi, m in enumerate(models):
            stage, rank = divmod(mi, tp)
            mine = optims[mi * dp : (mi + 1) * dp]
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in mine[0].param_groups]
            if hyper != hyper0:
                raise CheckpointFormatError(
                    f"{mine[0].archive.path}: model-parallel rank {mi}'s optimizer groups "
                    f"{hyper} differ from rank 0's {hyper0} ({optims[0].archive.path})"
                )

            def keep(
                fqn: str,
                shape: tuple[int, ...],
                stage: int = stage,
                rank: int = rank,
                mi: int = mi,
                m: ModelStates = m,
            ) -> tuple[bool, TPSlice | None]:
                if owner.setdefault(fqn, stage) != stage:
                    return False, None
                if rules is None:
                    return True, None
                sl = rules.slice_of(fqn, rank, tp, shape, totals[fqn])
                # Slices are placed at rank x their size unless their rule gives each rank's
                # widths: only then may they differ.
                first = local.setdefault(fqn, (shape, mi))
                if first[0] != shape and sl.rule not in UNEVEN_RULES:
                    raise CheckpointFormatError(
                        f"{m.archive.path}: {fqn!r} is a {shape} slice; model-parallel rank "
                        f"{first[1]} holds a {first[0]} one (uneven tensor-parallel slices are "
                        f"not supported by its rule, {sl.rule})"
                    )
                if sl.replicated and sl.merge is None:  # a cut vocabulary: rank 0's
                    return rank == 0, sl
                return True, sl  # replicated: every rank's, checked equal (_ds_merge)

            stage_groups = _zero12(b, m, mine, keep)
            add_groups(groups, stage_groups)
            for names in stage_groups:
                for n in names:
                    head = n.split(".", 1)[0]  # a PipelineModule's layer index
                    if layers and head.isdigit():
                        self._layer_stage.setdefault(int(head), stage)
        buffers = {n: mi for mi, m in enumerate(models) for n in m.buffer_names}
        # Frozen parameters and buffers: in the layer files under a pipeline, else in each
        # tensor-parallel rank's module state dict (full names).
        sources = [
            EntryFile(index, rank, archive, entries, None)
            for (index, rank), (archive, entries) in sorted(layers.items())
        ]
        if not layers:
            sources = [EntryFile(0, mi, m.archive, m.module, "") for mi, m in enumerate(models)]
        shared = {n for m in models for n in m.shared}
        place_entries(b, sources, trainable | set(buffers), trainable | shared, rules, tp)
        if rules is not None:
            b.finish_merges(tp, os.path.dirname(models[0].archive.path))
        placed = recorded_names(b)
        unused = rules.unused(sorted(trainable | placed)) if rules is not None else []
        if unused:
            raise InvalidArgumentError(
                f"tp_rules: no parameter of {os.path.dirname(models[0].archive.path)} matches "
                f"{', '.join(unused)}"
            )
        where = "in no layer file" + ("" if layers else " (and not in its module)")
        check_placed(b, models, buffers, buffers, where)
        return [list(g) for g in groups]

    def _zero3(
        self, b: ArchiveIndex, models: list[ModelStates], optims: list[RankOptim]
    ) -> list[list[str]]:
        m0 = models[0]
        W = self.world_size
        sizes = [t.numel for t in optims[0].fp32]
        for o in optims:
            if [t.numel for t in o.fp32] != sizes:
                raise CheckpointFormatError(
                    f"{o.archive.path}: fp32_flat_groups of {[t.numel for t in o.fp32]} elements; "
                    f"rank 0 has {sizes}"
                )
        flat = [(fqn, shape, k) for k, d in enumerate(m0.param_shapes) for fqn, shape in d.items()]
        try:
            all_segs = zero3_segments([math.prod(s) for _, s, _ in flat], W, sizes)
        except ValueError as e:
            raise CheckpointFormatError(f"{m0.archive.path}: {e}") from None
        by_buffer: dict[int, list[str]] = {}
        for (fqn, shape, k), segs in zip(flat, all_segs):
            record_param(b, fqn, shape, segs, optims, segs[0].buffer if segs else k)
            by_buffer.setdefault(k, []).append(fqn)
        return [
            [f for k in grp["params"] for f in by_buffer.get(k, [])]
            for grp in optims[0].param_groups
        ]

    def _param_groups(self, b: ArchiveIndex, o: RankOptim, groups: list[list[str]]) -> None:
        """``optim.param_groups.<g>.*`` from the inner optimizer's groups, with fqns for
        ``params``."""
        if self.stage != 3 and len(o.param_groups) != len(groups):
            raise CheckpointFormatError(
                f"{o.archive.path}: {len(o.param_groups)} inner optimizer groups for "
                f"{len(groups)} parameter groups"
            )
        for g, (grp, fqns) in enumerate(zip(o.param_groups, groups)):
            for hp, v in grp.items():
                b.value(("optim", "param_groups", g, hp), fqns if hp == "params" else v)

    def _frozen_and_buffers(self, b: ArchiveIndex, models: list[ModelStates]) -> None:
        m0 = models[0]
        for fqn, shape in m0.frozen_shapes.items():
            if self.stage == 3:
                zero3_frozen(b, models, fqn, shape)
            else:
                t = _frozen_fragment(m0, fqn)
                b.whole(("model", fqn), m0.archive, t, shape, f"frozen parameter {fqn!r}")
        # Buffers, and parameters known only from the module state dict
        # (frozen parameters of ZeRO-1, which records no fragments). Under
        # ZeRO-3 the module holds empty placeholders for parameters.
        skip = recorded_names(b) | set(m0.shared)
        buffers = set(m0.buffer_names)
        for name in m0.module:
            if self.stage == 3 and name not in skip and name not in buffers:
                raise CheckpointFormatError(
                    f"{m0.archive.path}: module entry {name!r} is neither in param_shapes, "
                    "frozen_param_shapes, "
                    "shared_params nor buffer_names; under ZeRO-3 its module copy is a placeholder"
                )
        place_entries(b, [EntryFile(0, 0, m0.archive, m0.module, "")], (), skip)

    # ------------------------------------------------------------ Source
    @classmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """A directory with ``latest``, or a folder of ``*zero_pp_rank_*_optim_states.pt`` files."""
        return looks_like_deepspeed(d)

    @classmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> DeepSpeedSource:
        """Read every file's pickle (as inert records; tensor data is not read).

        ``latest`` and the listings come through the directory view; in a
        store each archive's zip directory and pickle are read with a few
        ranged requests (archives side by side), tensor bytes later through
        :meth:`~ucp_dcp.sources.base.Source.open_reader`.
        """
        return cls(d, tp_rules=options.tp_rules)
