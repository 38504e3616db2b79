"""DeepSpeed MoE checkpoints (``deepspeed.moe.layer.MoE``, ZeRO-1/2): where each expert is.

The expert parameters are in optimizer groups marked ``moe``, each partitioned over the ranks of
one expert-data-parallel group only, under *local* expert names (rank 0's view); the expert files
(``layer_{L}_expert_{G}_mp_rank_00_model_states.pt``) hold each *global* expert's entries.
:func:`expert_layout` reads which ranks hold which experts (names and pickles only); the ZeRO-1/2
layout of :mod:`.deepspeed` then records every expert parameter once per global expert, as
:class:`ExpertLayout` says (:meth:`~ExpertLayout.parts`, :meth:`~ExpertLayout.expert_name`).
The files and how the groups lie over the ranks: see docs/deepspeed-format.md (MoE).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import CheckpointFormatError
from ._ds_files import DSFiles
from ._ds_records import ModelStates, RankOptim, archive_pool, read_layer_states
from ._pickle import TensorRef
from ._torch_archive import TorchArchive

__all__ = ["ExpertLayout", "expert_layout"]

EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt")
# DeepSpeed's older naming (no layer id), and its per-expert-rank optimizer files (no ZeRO).
_OLD_EXPERT_FILE = re.compile(r"expert_(\d+)_mp_rank_(\d+)_model_states\.pt")
_EXPP_OPTIM = re.compile(r"expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
EXPERTS_INFIX = ".deepspeed_moe.experts.deepspeed_experts."
_EXPERT_NAME = re.compile(r"(.+)" + re.escape(EXPERTS_INFIX) + r"(\d+)\.(.+)")
_EP_GROUP = re.compile(r"ep_size_(\d+)")
_DATA_BEFORE_EXPERT = "use_data_before_expert_parallelism"


@dataclass(frozen=True)
class ExpertLayout:
    """The experts of a DeepSpeed MoE checkpoint: their files and how their optimizer groups lie
    over the ranks."""

    folder: str
    world: int
    ep_size: dict[int, int]
    """Optimizer group -> its expert-parallel size, for the groups marked ``moe``."""
    data_before_expert: bool
    """The config's ``use_data_before_expert_parallelism``: expert-parallel ranks strided."""
    layers: dict[str, int]
    """MoE module prefix (``moe``, ``layers.3.mlp``) -> its MoE layer id."""
    num_experts: dict[int, int]
    """MoE layer id -> its global expert count."""
    files: dict[tuple[int, int], tuple[TorchArchive, dict[str, TensorRef]]]
    """(MoE layer id, global expert) -> that expert file's archive and entries."""

    layer_ep: dict[int, int]
    """MoE layer id -> the expert-parallel size of the ``moe`` groups holding its experts."""

    def ranks(self, ep: int, e: int) -> list[int]:
        """The ranks holding expert-parallel rank ``e``'s partitions of a ``moe`` group of
        expert-parallel size ``ep``, in expert-data-parallel order."""
        edp = self.world // ep
        if self.data_before_expert:
            return [e * edp + d for d in range(edp)]
        return [d * ep + e for d in range(edp)]

    def parts(self, m0: ModelStates, g: int) -> list[tuple[list[int], int | None]]:
        """How optimizer group ``g`` (``m0.param_shapes[g]``) lies over the ranks: ``(ranks,
        expert-parallel rank)`` of each partitioning, once per expert-parallel rank for a group
        marked ``moe``, else all ranks once (expert-parallel rank None)."""
        if g in self.ep_size:
            ep = self.ep_size[g]
            return [(self.ranks(ep, e), e) for e in range(ep)]
        for fqn in m0.param_shapes[g]:
            if _EXPERT_NAME.fullmatch(fqn) and fqn.split(EXPERTS_INFIX)[0] in self.layers:
                raise CheckpointFormatError(
                    f"{m0.archive.path}: expert parameter {fqn!r} is in optimizer group {g}, which "
                    "is not marked moe"
                )
        return [(list(range(self.world)), None)]

    def expert_name(self, local_name: str, e: int, shape: tuple[int, ...]) -> str:
        """``param_shapes``' name of local expert ``i`` (``local_name``, an expert parameter of a
        known layer) on expert-parallel rank ``e`` -> the name of global expert ``e * E_local +
        i``, checked to be in its expert file with ``shape``."""
        m = _EXPERT_NAME.fullmatch(local_name)
        assert m is not None, local_name  # expert_layout checked every moe group's names
        layer = self.layers[m.group(1)]
        local = self.num_experts[layer] // self.layer_ep[layer]
        i = int(m.group(2))
        if i >= local:
            raise CheckpointFormatError(
                f"{self.folder}: {local_name!r} in param_shapes is local expert {i}, but MoE "
                f"layer {layer} has {self.num_experts[layer]} experts over "
                f"{self.layer_ep[layer]} expert-parallel ranks ({local} each)"
            )
        gid = e * local + i
        name = f"{m.group(1)}{EXPERTS_INFIX}{gid}.{m.group(3)}"
        archive, entries = self.files[(layer, gid)]
        t = entries.get(name)
        if t is None or tuple(t.size) != tuple(shape):
            got = "no such entry" if t is None else f"a {tuple(t.size)} entry"
            raise CheckpointFormatError(
                f"{archive.path}: expected {name!r} of shape {tuple(shape)} (param_shapes of the "
                f"model states, local expert name renumbered), found {got}"
            )
        return name

    def writers(self) -> list[int]:
        """The rank that wrote each expert file, in the order of :attr:`files`: expert-data-parallel
        rank 0 of its expert's expert-parallel rank."""
        out = []
        for layer, gid in self.files:
            ep = self.layer_ep.get(layer)
            # A layer with no trainable expert: nothing says which rank wrote its files.
            out.append(
                0 if ep is None else self.ranks(ep, gid // (self.num_experts[layer] // ep))[0]
            )
        return out


def _refuse_other_moe_files(folder: str, names: list[str]) -> None:
    for n in names:
        if _OLD_EXPERT_FILE.fullmatch(n):
            raise CheckpointFormatError(
                f"{folder}: {n} is an expert file of DeepSpeed's older naming (no MoE layer id); "
                "only layer_<L>_expert_<G>_mp_rank_00_model_states.pt files are read"
            )
        if _EXPP_OPTIM.fullmatch(n):
            raise CheckpointFormatError(
                f"{folder}: {n} holds the optimizer state of a MoE model trained without ZeRO; "
                "only ZeRO-1/2 MoE checkpoints (expert state in zero_pp_rank_* files) are read"
            )


def _expert_files(
    files: DSFiles, names: list[str], num_experts: list[int] | None, model_path: str
) -> tuple[dict[tuple[int, int], str], dict[int, int]]:
    """The expert files by (MoE layer id, global expert), every expert of every layer present,
    and each layer's expert count."""
    found: dict[tuple[int, int], str] = {}
    for n in names:
        if m := EXPERT_FILE.fullmatch(n):
            if int(m.group(3)) != 0:
                raise CheckpointFormatError(
                    f"{files.directory}: {n}: MoE checkpoints with tensor or pipeline parallelism "
                    "(mp_rank other than 00) are not supported"
                )
            found[(int(m.group(1)), int(m.group(2)))] = n
    layers = sorted({k[0] for k in found})
    counts = list(num_experts) if num_experts is not None else []
    if num_experts is None:  # not recorded: the files say how many
        counts = [1 + max(k[1] for k in found if k[0] == layer) for layer in layers]
    elif layers and layers[-1] >= len(counts):
        raise CheckpointFormatError(
            f"{files.directory}: expert files of MoE layers {layers}, but num_experts in "
            f"{model_path} lists {len(counts)} MoE layer(s): {counts}"
        )
    for layer, n_exp in enumerate(counts):
        gone = [e for e in range(n_exp) if (layer, e) not in found]
        if gone:
            raise CheckpointFormatError(
                f"{files.directory}: no layer_{layer}_expert_{gone[0]}_mp_rank_00_model_states.pt "
                f"(MoE layer {layer} has {n_exp} experts by num_experts in {model_path}"
                + (f"; missing experts {gone}" if len(gone) > 1 else "")
                + ")"
            )
    extra = [k for k in found if k[0] >= len(counts) or k[1] >= counts[k[0]]]
    if extra:
        raise CheckpointFormatError(
            f"{files.directory}: {found[extra[0]]} is beyond the {counts} experts per MoE layer "
            f"of num_experts in {model_path}"
        )
    return {k: files.folder.path_of(n) for k, n in sorted(found.items())}, dict(enumerate(counts))


def _ep_sizes(optims: list[RankOptim], world: int) -> dict[int, int]:
    """Group -> expert-parallel size, for the optimizer groups marked ``moe``."""
    o = optims[0]
    counts = o.archive.obj["optimizer_state_dict"].get("partition_count")
    out = {}
    for g, grp in enumerate(o.param_groups):
        if not grp.get("moe"):
            continue
        pc = counts[g] if isinstance(counts, list) and g < len(counts) else None
        if not isinstance(pc, int) or pc <= 0 or world % pc:
            raise CheckpointFormatError(
                f"{o.archive.path}: optimizer group {g} is marked moe, but its partition_count "
                f"{pc!r} does not divide the {world} data-parallel ranks"
            )
        named = _EP_GROUP.fullmatch(str(grp.get("name", "")))
        if named and int(named.group(1)) != world // pc:
            raise CheckpointFormatError(
                f"{o.archive.path}: optimizer group {g} is named {grp['name']!r} but is "
                f"partitioned over {pc} of {world} ranks (expert-parallel size {world // pc})"
            )
        out[g] = world // pc
    return out


def expert_layout(
    files: DSFiles, models: list[ModelStates], optims: list[RankOptim]
) -> ExpertLayout | None:
    """The experts of the checkpoint ``files`` (its model states and optimizer files read), or
    None when it has no MoE layer (no expert files and no optimizer group marked ``moe``).

    Raises :class:`CheckpointFormatError` naming the file when an expert file is missing or
    does not hold its expert, and for MoE checkpoints this does not read (without ZeRO, with
    tensor or pipeline parallelism, DeepSpeed's older expert file names).
    """
    folder = files.folder
    names = sorted(folder.list())
    _refuse_other_moe_files(files.directory, names)
    world = len(optims)
    ep_size = _ep_sizes(optims, world)
    has_files = any(EXPERT_FILE.fullmatch(n) for n in names)
    if not ep_size and not has_files:
        return None
    m0 = models[0]
    if files.layers or files.tp > 1:
        raise CheckpointFormatError(
            f"{files.directory}: a MoE checkpoint with tensor or pipeline parallelism is not "
            "supported"
        )
    if optims[0].stage == 3:
        raise CheckpointFormatError(
            f"{files.directory}: a ZeRO-3 MoE checkpoint is not supported (DeepSpeed's native MoE "
            "trains under ZeRO-1/2)"
        )
    raw = m0.archive.obj
    num = raw.get("num_experts")
    if num is not None and not (
        isinstance(num, list) and all(isinstance(n, int) and n > 0 for n in num)
    ):
        raise CheckpointFormatError(
            f"{m0.archive.path}: num_experts {num!r} is not a list of expert counts"
        )
    if not has_files:
        raise CheckpointFormatError(
            f"{files.directory}: optimizer groups {sorted(ep_size)} hold experts (marked moe), but "
            "there is no layer_<L>_expert_<G>_mp_rank_00_model_states.pt file"
        )
    paths, counts = _expert_files(files, names, num, m0.archive.path)
    with archive_pool(folder, len(paths)) as pool:
        read = list(pool.map(lambda p: read_layer_states(p, folder), paths.values()))
    experts = dict(zip(paths, read))
    layers: dict[str, int] = {}
    for (layer, gid), (archive, entries) in experts.items():
        for name in entries:
            m = _EXPERT_NAME.fullmatch(name)
            if m is None or int(m.group(2)) != gid:
                raise CheckpointFormatError(
                    f"{archive.path}: entry {name!r} is not a parameter or buffer of expert {gid} "
                    f"(<module>{EXPERTS_INFIX}{gid}.<name>)"
                )
            if layers.setdefault(m.group(1), layer) != layer:
                raise CheckpointFormatError(
                    f"{archive.path}: MoE module {m.group(1)!r} is in the files of MoE layers "
                    f"{layers[m.group(1)]} and {layer}"
                )
    layer_ep: dict[int, int] = {}
    for g, ep in ep_size.items():
        for fqn in m0.param_shapes[g] if g < len(m0.param_shapes) else ():
            m = _EXPERT_NAME.fullmatch(fqn)
            if m is None or m.group(1) not in layers:
                raise CheckpointFormatError(
                    f"{m0.archive.path}: optimizer group {g} is marked moe, but {fqn!r} is not "
                    f"an expert parameter of a MoE layer with expert files ({sorted(layers)})"
                )
            layer = layers[m.group(1)]
            if layer_ep.setdefault(layer, ep) != ep:
                raise CheckpointFormatError(
                    f"{m0.archive.path}: the experts of MoE layer {layer} are in moe optimizer "
                    f"groups of expert-parallel sizes {layer_ep[layer]} and {ep}"
                )
    for layer, ep in layer_ep.items():
        if counts[layer] % ep:
            raise CheckpointFormatError(
                f"{files.directory}: MoE layer {layer} has {counts[layer]} experts, not a "
                f"multiple of its expert-parallel size {ep}"
            )
    config = raw.get("ds_config")
    dbe = bool(config.get(_DATA_BEFORE_EXPERT, False)) if isinstance(config, dict) else False
    return ExpertLayout(files.directory, world, ep_size, dbe, layers, counts, experts, layer_ep)
