"""The names of a DeepSpeed ``PipelineModule``'s layer files' entries, and where those entries
(frozen parameters and buffers) go in a source's index.

A pipeline-parallel checkpoint saves each layer's ``state_dict()`` on its own,
in ``layer_XX-model_YY-model_states.pt`` (``XX`` the global layer index), with
the layer's own names (``fc1.weight``). The engine module, whose names the
optimizer's ``param_shapes`` and ``buffer_names`` use, registers layer ``XX``
as ``XX`` (``3.fc1.weight``) and a ``TiedLayerSpec`` module once, as
``tied_modules.<key>`` (``tied_modules.embed.weight``), whichever layer indices
it appears at. Nothing in the files says which layer is tied to which key:
:func:`layer_prefix` tells it from the names the stages' model states know.
:func:`place_entries` records the entries that are not trainable (those are
read from the optimizer's fp32 masters) under the engine's names, for the
DeepSpeed source and for a Universal folder of a pipeline run alike.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from ..errors import CheckpointFormatError
from ._archive_index import ArchiveIndex
from ._ds_tp import TPRules
from ._pickle import TensorRef
from ._torch_archive import TorchArchive

__all__ = ["TIED_PREFIX", "EntryFile", "layer_prefix", "place_entries", "tied_keys"]

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
    tensor-parallel ``rank``; ``prefix`` None: told by :func:`layer_prefix`) or a model states
    file's ``module`` (full names: ``prefix`` ``""``)."""

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
    rules: TPRules | None,
    tp: int,
) -> None:
    """Record ``model.<name>`` for each entry of ``files`` not in ``skip`` (trainable parameters,
    read from the fp32 masters, and tied aliases).

    ``known``: the stages' parameter and buffer names (which tell a tied layer's
    prefix). A tied layer's copies at later indices are skipped. Under tensor
    parallelism (``rules``, degree ``tp``) a split entry is placed slice by
    slice, a replicated one read from rank 0. Layer files' archives are added to ``b``.
    """
    tied = tied_keys(known)
    first_file: dict[str, int] = {}  # name -> the layer index it is read from
    for f in files:
        prefix = f.prefix
        if prefix is None:
            prefix = layer_prefix(f.index, list(f.entries), known, tied, f.archive.path)
            b.add_archive(f.archive)
        for entry, t in f.entries.items():
            name = prefix + entry
            if name in skip or first_file.setdefault(name, f.index) != f.index:
                continue  # the fp32 master weight (or a tied alias), or a tied layer's copy
            key, path, what = f"model.{name}", ("model", name), f"layer entry {entry!r}"
            sl = rules.slice_of(name, f.rank, tp, t.size) if rules is not None else None
            if sl is None or (sl.replicated and sl.full_shape == sl.local):
                if f.rank == 0:
                    b.whole(key, path, f.archive, t, t.size, what)
            elif sl.replicated:
                if f.rank == 0:
                    b.placed_whole(key, path, f.archive, t, sl, what)
            else:
                b.placed_whole(key, path, f.archive, t, sl, what)
