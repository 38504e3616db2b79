"""The names of a DeepSpeed ``PipelineModule``'s layer files' entries (names only, no files).

A pipeline-parallel checkpoint saves each layer's ``state_dict()`` on its own,
in ``layer_XX-model_YY-model_states.pt`` (``XX`` the global layer index), with
the layer's own names (``fc1.weight``). The engine module, whose names the
optimizer's ``param_shapes`` and ``buffer_names`` use, registers layer ``XX``
as ``XX`` (``3.fc1.weight``) and a ``TiedLayerSpec`` module once, as
``tied_modules.<key>`` (``tied_modules.embed.weight``), whichever layer indices
it appears at. Nothing in the files says which layer is tied to which key:
:func:`layer_prefix` tells it from the names the stages' model states know.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ..errors import CheckpointFormatError

__all__ = ["TIED_PREFIX", "layer_prefix", "tied_keys"]

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
