"""Writing into the caller's nested state dict at a DCP-flattened path.

DCP flattens a nested state dict into dotted keys and remembers, per key,
the path of container keys that leads to the leaf. A load that replaces a
leaf (a decoded non-tensor value, a piece set) must put it back at that path
in the caller's own containers; the load planner and the layout rules both
do it with :func:`set_in_place`.
"""

from __future__ import annotations

from typing import Any

from .._compat import set_element

__all__ = ["set_in_place"]


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
