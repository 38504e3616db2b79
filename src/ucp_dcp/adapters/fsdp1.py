"""FSDP1 (``FullyShardedDataParallel``) training state as universal pieces.

FSDP1 keeps each wrapped unit's parameters in one ``FlatParameter``, split into equal
contiguous slices, one per rank, that cut through rows and parameters.
:func:`fsdp1_state_dict` describes that memory, and the optimizer state laid out the same way,
as :class:`~ucp_dcp.FlatShard` values named like the state DCP's ``get_state_dict`` gives for
the same module under FSDP2, so the checkpoint loads into FSDP2, TP, HSDP, a plain module, or
FSDP1 on another world size (docs/layouts.md, "FSDP1", says what is supported)::

    from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
    from ucp_dcp.adapters.fsdp1 import fsdp1_apply_loaded, fsdp1_state_dict

    model = FSDP(Model(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ...
    sd = fsdp1_state_dict(model, optim)  # {"model": {...}, "optim": {...}}
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())

    # Resume, possibly on another world size or from an FSDP2 checkpoint:
    sd = fsdp1_state_dict(model, optim)          # creates optimizer state if empty
    dcp.load(sd, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
    fsdp1_apply_loaded(model, optim, sd)         # param-group hyperparameters

Logical names are ``model.<fqn>``, ``optim.state.<fqn>.<state>`` and
``optim.param_groups.<i>.<key>`` with FSDP1 wrapper prefixes
(``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``,
``_orig_mod.``) removed: exactly the keys DCP flattens
``{"model": msd, "optim": osd}`` from ``get_state_dict`` to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._compat import (
    fsdp1_flat_param,
    init_optim_state,
    is_flat_param,
    looks_like_fully_shard,
    module_parameters,
    module_persistent_buffers,
)
from ..byteio.requests import rank_and_world
from ..core.pieces import Piece, TensorPieces
from ..errors import TorchInternalsError, UnsupportedModelError
from .flat import FlatParam, FlatShard

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel

__all__ = ["fsdp1_state_dict", "fsdp1_apply_loaded", "SUPPORTED_SHARDING_STRATEGIES"]

_WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})

#: Names of the FSDP1 sharding strategies :func:`fsdp1_state_dict` accepts.
SUPPORTED_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


def _clean(name: str) -> str:
    """``name`` without FSDP1 / activation-checkpoint / torch.compile wrapper components."""
    return ".".join(c for c in name.split(".") if c and c not in _WRAPPER_COMPONENTS)


@dataclass
class _Unit:
    """One FSDP1 unit's FlatParameter and where its original parameters lie.

    Attributes:
        flat_param: the unit's FlatParameter (this rank's shard).
        params: its parameters, cleaned fqns relative to the model root, with their offsets in
            the unsharded buffer.
        start: the unsharded-buffer element at which this rank's shard starts.
        in_shard: per parameter, whether this rank's shard holds any of its elements.
        intra_start: per parameter, its first element in this rank's shard (if in_shard).
        orig_params: the original parameters (``use_orig_params=True``), else None.
    """

    flat_param: nn.Parameter
    params: list[FlatParam]
    start: int
    in_shard: list[bool]
    intra_start: list[int]
    orig_params: list[nn.Parameter] | None

    def fqns(self, i: int | None = None) -> list[str]:
        """The fqn of parameter ``i`` (None: of every parameter of the unit)."""
        return [p.fqn for p in self.params] if i is None else [self.params[i].fqn]


def _fsdp_class() -> type[FullyShardedDataParallel]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _units(model: nn.Module) -> list[_Unit]:
    """Every FlatParameter of ``model`` (an FSDP1 root), validated, in module order."""
    fsdp = _fsdp_class()
    if not isinstance(model, fsdp):
        hint = ""
        if isinstance(model, nn.Module) and (
            any(type(m).__name__.startswith("FSDP") for m in model.modules())
            or looks_like_fully_shard(model)
        ):
            hint = (
                " (for fully_shard/FSDP2 models use"
                " torch.distributed.checkpoint.state_dict.get_state_dict)"
            )
        raise UnsupportedModelError(
            f"fsdp1_state_dict: the model is a {type(model).__name__}, not a "
            f"torch.distributed.fsdp.FullyShardedDataParallel (FSDP1) root module{hint}; wrap the "
            "whole model "
            f"with FullyShardedDataParallel (nested units via auto_wrap_policy are fine)"
        )
    world = rank_and_world()[1]
    units: list[_Unit] = []
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, fsdp):
            continue
        # Named as the checkpoint names it: without the wrapper components FSDP1 inserts.
        unit_name = _clean(mod_name)
        where = f"FSDP unit {unit_name!r}" if unit_name else "the root FSDP unit"
        strategy = mod.sharding_strategy.name
        if strategy not in SUPPORTED_SHARDING_STRATEGIES:
            raise UnsupportedModelError(
                f"fsdp1_state_dict: {where} uses sharding strategy {strategy}; supported are "
                f"{', '.join(SUPPORTED_SHARDING_STRATEGIES)} (one flat shard per rank over all "
                "ranks). "
                "NO_SHARD and HYBRID_SHARD/_HYBRID_SHARD_ZERO2 (replicated shards) are not "
                "supported"
            )
        flat = fsdp1_flat_param(mod)
        if flat is None:  # a unit that manages no parameters
            continue
        handle = flat.handle
        fp = handle.flat_param
        if handle.world_size != world:
            raise UnsupportedModelError(
                f"fsdp1_state_dict: {where} shards over a process group of {handle.world_size} "
                "ranks, but the "
                f"default process group has {world}; only FSDP1 over all ranks is supported"
            )
        sharded = flat.sharded_size
        if sharded is None or fp.numel() != sharded.numel() or fp.dim() != 1:
            raise UnsupportedModelError(
                f"fsdp1_state_dict: {where}'s FlatParameter is not in its sharded state (called "
                "inside "
                f"forward/backward or summon_full_params?); call it between training steps"
            )
        prefix = _clean(mod_name)
        prefix = prefix + "." if prefix else ""
        params: list[FlatParam] = []
        pos, i = 0, 0
        for numel, is_padding in zip(flat.numels_with_padding, flat.is_padding_mask):
            if not is_padding:
                shape = tuple(flat.shapes[i])
                if numel != flat.numels[i]:
                    raise TorchInternalsError(
                        f"{where}: numel of {flat.fqns[i]!r} disagrees in FlatParameter metadata"
                    )
                params.append(FlatParam(prefix + _clean(flat.fqns[i]), shape, pos))
                i += 1
            pos += numel
        if i != len(flat.fqns):
            raise TorchInternalsError(
                f"{where}: FlatParameter metadata lists {len(flat.fqns)} parameters, found {i}"
            )
        start = fp.numel() * handle.rank
        in_shard, intra_start = [], []
        for p, info in zip(params, flat.shard_param_infos):
            in_shard.append(bool(info.in_shard))
            intra_start.append(int(info.intra_param_start_idx) if info.in_shard else 0)
            # Cross-check our layout with FSDP's own view of this rank's shard.
            if (
                info.in_shard
                and p.offset + info.intra_param_start_idx != start + info.offset_in_shard
            ):
                raise TorchInternalsError(
                    f"{where}: computed layout of {p.fqn!r} disagrees with FSDP's shard metadata "
                    f"(this torch version's FlatParameter layout is not understood)"
                )
        units.append(_Unit(fp, params, start, in_shard, intra_start, flat.orig_params))
    return units


def _extra_model_tensors(model: nn.Module, units: list[_Unit]) -> dict[str, torch.Tensor]:
    """Persistent buffers and parameters no FlatParameter manages (ignored modules), by cleaned
    name."""
    managed = {id(u.flat_param) for u in units}
    for u in units:
        managed.update(id(p) for p in u.orig_params or ())
    out: dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        pre = mname + "." if mname else ""
        for pname, p in module_parameters(mod):
            if p is not None and id(p) not in managed and not is_flat_param(p):
                out.setdefault(_clean(pre + pname), p.detach())
        for bname, b in module_persistent_buffers(mod):
            if b is not None:
                out.setdefault(_clean(pre + bname), b)
    return out


def _optim_index(
    model: nn.Module, optim: torch.optim.Optimizer, units: list[_Unit]
) -> list[list[tuple[_Unit, int | None]]]:
    """For every param group, for every param: its unit and (use_orig_params) its index in the
    unit."""
    flat = {id(u.flat_param): u for u in units}
    orig = {id(p): (u, i) for u in units for i, p in enumerate(u.orig_params or ())}
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for gi, group in enumerate(optim.param_groups):
        row: list[tuple[_Unit, int | None]] = []
        for pi, p in enumerate(group["params"]):
            if id(p) in flat:
                row.append((flat[id(p)], None))
            elif id(p) in orig:
                row.append(orig[id(p)])
            else:
                what = (
                    f"model parameter {_clean(names[id(p)])!r}"
                    if id(p) in names
                    else "not a parameter of the model"
                )
                raise UnsupportedModelError(
                    f"fsdp1_state_dict: optimizer param group {gi}, param {pi} (shape "
                    f"{list(p.shape)}; {what}) "
                    "is neither a FlatParameter of this FSDP1 model nor one of its original "
                    "parameters "
                    "(use_orig_params=True); build the optimizer from the FSDP1-wrapped model's "
                    "parameters()"
                )
        out.append(row)
    return out


def _group_fqns(row: list[tuple[_Unit, int | None]]) -> list[str]:
    return [f for u, i in row for f in u.fqns(i)]


def fsdp1_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """The training state of an FSDP1 ``model`` (and ``optim``) over this rank's local shard memory.

    Returns ``{"model": {...}}``, plus ``"optim": {...}`` when ``optim`` is
    given, for ``dcp.save``/``dcp.load`` with :class:`~ucp_dcp.UCPSavePlanner`
    / :class:`~ucp_dcp.UCPLoadPlanner`:

    * every FlatParameter becomes one :class:`~ucp_dcp.FlatShard` over its
      local shard, whose pieces are ``model.<fqn>`` of each original param;
    * every optimizer state tensor laid out like a FlatParameter becomes a
      FlatShard with suffix ``.<state>`` and prefix ``optim.state.``; with
      ``use_orig_params=True`` each original param's state (this rank's 1-D
      slice of it) is a FlatShard of that one parameter;
    * a 0-d state tensor (``step``) becomes a replicated
      :class:`~ucp_dcp.TensorPieces` whose pieces ``optim.state.<fqn>.step``
      (one per original param it applies to) all view that tensor;
    * ``optim.param_groups`` is the list of hyperparameter dicts with
      ``params`` the original fqns, as ``get_state_dict`` gives it;
    * persistent buffers and parameters FSDP does not manage are plain tensors.

    Non-tensor per-param state values are plain entries under
    ``optim.state.<fqn>.<state>``. With ``use_orig_params=True``, a rank
    contributes state only for parameters its shard holds elements of (as
    FSDP1's own optimizer state dict does).

    The dict keys that hold FlatShards are internal (not stored). Writes by
    a load land in the model's and optimizer's memory; afterwards call
    :func:`fsdp1_apply_loaded` to apply loaded hyperparameters. If the
    optimizer has no state yet it is created (a zero-gradient step at lr 0).

    Raises:
        UnsupportedModelError: ``model`` is not an FSDP1 root, a unit uses an
            unsupported sharding strategy or process group, or an optimizer
            param does not belong to the model's FlatParameters.
    """
    units = _units(model)
    model_sd: dict[str, Any] = dict(_extra_model_tensors(model, units))
    for k, u in enumerate(units):
        model_sd[f"__fsdp1_flat__/{k}"] = FlatShard(
            u.flat_param.detach(), u.params, u.start, prefix="model."
        )
    out: dict[str, Any] = {"model": model_sd}
    if optim is None:
        return out
    index = _optim_index(model, optim, units)
    init_optim_state(optim)  # DCP's own: one zero-gradient step at lr 0 when there is no state yet
    unit_no = {id(u): k for k, u in enumerate(units)}
    optim_sd: dict[str, Any] = {}
    plain_state: dict[str, dict[str, Any]] = {}
    for row, group in zip(index, optim.param_groups):
        for (u, i), p in zip(row, group["params"]):
            state = optim.state.get(p)
            if not state:
                continue
            if i is None:
                fqns, layout, start = u.fqns(), u.params, u.start
                tag = f"__fsdp1_flat__/{unit_no[id(u)]}"
            else:
                if not u.in_shard[i]:
                    continue  # this rank holds none of the param: nothing of it to save or load
                fp_i = u.params[i]
                fqns, layout, start = (
                    [fp_i.fqn],
                    [FlatParam(fp_i.fqn, fp_i.shape, 0)],
                    u.intra_start[i],
                )
                tag = f"__fsdp1_orig__/{fp_i.fqn}"
            for name, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    pieces = [Piece(f"optim.state.{f}.{name}", (), (), v) for f in fqns]
                    optim_sd[f"{tag}.{name}"] = TensorPieces(
                        pieces, replicated=True, source=f"FSDP1 optimizer state {name!r} of {tag}"
                    )
                elif isinstance(v, torch.Tensor):
                    if v.shape != p.shape or not v.is_contiguous():
                        raise UnsupportedModelError(
                            f"fsdp1_state_dict: optimizer state {name!r} of {tag} "
                            f"({', '.join(fqns[:3])}"
                            f"{', ...' if len(fqns) > 3 else ''}) has shape "
                            f"{list(v.shape)}, not the parameter's {list(p.shape)}; only state "
                            "shaped like "
                            f"the (flat) parameter, 0-d tensors and plain values are supported"
                        )
                    optim_sd[f"{tag}.{name}"] = FlatShard(
                        v, layout, start, prefix="optim.state.", suffix=f".{name}"
                    )
                else:
                    for f in fqns:
                        plain_state.setdefault(f, {})[name] = v
    if plain_state:
        optim_sd["state"] = plain_state
    optim_sd["param_groups"] = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": _group_fqns(row)}
        for row, group in zip(index, optim.param_groups)
    ]
    out["optim"] = optim_sd
    return out


def fsdp1_apply_loaded(
    model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Apply what ``dcp.load`` put into ``state`` (from :func:`fsdp1_state_dict`) but not in place.

    Tensors (parameters, ``exp_avg``, ``step``, ...) were loaded in place;
    this sets each optimizer param group's hyperparameters (``lr``,
    ``betas``, ...) from ``state["optim"]["param_groups"]`` and plain
    (non-tensor) per-param optimizer state from ``state["optim"]["state"]``.
    Loaded group ``i`` must hold the same set of parameter fqns as
    ``optim.param_groups[i]`` (their order may differ).

    Raises:
        UnsupportedModelError: a loaded param group does not match the optimizer's.
    """
    units = _units(model)
    index = _optim_index(model, optim, units)
    osd = state.get("optim", {})
    groups = osd.get("param_groups", [])
    if len(groups) != len(optim.param_groups):
        raise UnsupportedModelError(
            f"fsdp1_apply_loaded: state has {len(groups)} param groups, the optimizer "
            f"{len(optim.param_groups)}"
        )
    for gi, (row, group, loaded) in enumerate(zip(index, optim.param_groups, groups)):
        want = _group_fqns(row)
        got = list(loaded.get("params", want))
        if set(got) != set(want):
            raise UnsupportedModelError(
                f"fsdp1_apply_loaded: loaded param group {gi} holds "
                f"{sorted(set(got) ^ set(want))[:5]} that the "
                f"optimizer's group {gi} does not share (or vice versa)"
            )
        for k, v in loaded.items():
            if k != "params":
                group[k] = v
    plain = osd.get("state", {})
    if plain:
        for row, group in zip(index, optim.param_groups):
            for (u, i), p in zip(row, group["params"]):
                fqns = u.fqns(i)
                st = optim.state.get(p)
                if st is None:
                    continue
                for name, v in st.items():
                    if isinstance(v, torch.Tensor):
                        continue
                    values = [plain[f][name] for f in fqns if name in plain.get(f, {})]
                    if values:
                        if any(x != values[0] for x in values):
                            raise UnsupportedModelError(
                                f"fsdp1_apply_loaded: optimizer state {name!r} differs between "
                                "parameters "
                                f"{fqns} that share one FlatParameter: {values}"
                            )
                        st[name] = values[0]
