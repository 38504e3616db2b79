"""Writing into the caller's nested state dict at a DCP-flattened path.

DCP flattens a nested state dict into dotted keys and remembers, per key,
the path of container keys that leads to the leaf. A load that replaces a
leaf (a decoded non-tensor value, a piece set) must put it back at that path
in the caller's own containers; the load planner and the layout rules both
do it with :func:`set_in_place`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._compat import set_element

__all__ = ["copy_containers", "set_in_place"]


def copy_containers(obj: Any) -> Any:
    """``obj`` with every dict and list copied (leaves shared): a state dict a load may fill and
    reshape without touching the caller's containers."""
    if isinstance(obj, Mapping):
        return {k: copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_containers(v) for v in obj]
    return obj


def set_in_place(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` of the caller's nested state dict.

    DCP's flattened paths hold ``str(key)`` for dict keys; where the caller's
    dict has a non-str key with that spelling (``{0: ...}`` in optimizer-style
    state), use the caller's key rather than adding a new str one.
    """
    cur = root
    for i, p in enumerate(path):
        key = p
        if isinstance(cur, dict) and p not in cur:
            key = next((k for k in cur if str(k) == str(p)), p)
        if i == len(path) - 1:
            cur[key] = value
            return
        try:
            cur = cur[key]
        except (KeyError, IndexError, TypeError):
            set_element(root, path, value)  # a missing container: DCP's own rules create it
            return
