"""Which checkpoint keys a load asked for: per rank as a bitmap, and the keys no rank asked for.

Under pipeline or expert parallelism each rank loads only its part, so a
key one rank did not ask for is not news; a key that no rank asked for is.
Each rank sends one bit per checkpoint key (whatever the world size); the
coordinator ORs them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from ..format import LAYOUT_KEY

__all__ = ["asked_keys", "keys_no_rank_asked", "key_list"]


def _reported(key: str) -> bool:
    # The layout record is written by every LayoutSpec save; a load that does
    # not ask for it is not warned about it.
    return not key.startswith(LAYOUT_KEY)


def asked_keys(keys: Sequence[str], known: Collection[str]) -> tuple[bytes, list[str]]:
    """The bitmap over ``keys`` (sorted checkpoint keys) of those in ``known``, and the others worth
    reporting."""
    wanted = [k in known for k in keys]
    unexpected = [k for k, w in zip(keys, wanted) if not w and _reported(k)]
    # dtype: an empty list (an empty checkpoint) would otherwise be float64, which packbits refuses.
    return np.packbits(np.array(wanted, dtype=bool)).tobytes(), unexpected


def keys_no_rank_asked(keys: Sequence[str], masks: Sequence[bytes]) -> list[str]:
    """The keys (sorted checkpoint keys) whose bit is set in none of ``masks``, except the layout
    record."""
    if not keys:
        return []
    asked = np.bitwise_or.reduce([np.frombuffer(m, dtype=np.uint8) for m in masks])
    flags = np.unpackbits(asked, count=len(keys))
    return [k for k, f in zip(keys, flags) if not f and _reported(k)]


def key_list(keys: list[str], limit: int = 20) -> str:
    """``keys`` for an error message: the first ``limit``, quoted, in brackets."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}]"
