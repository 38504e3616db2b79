"""What the configuration decides, as pure functions: which tiers a step goes to, which steps a tier
keeps."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["tiers_due", "steps_to_delete"]


def tiers_due(
    step: int, *, local_interval: int | None, persistent_interval: int
) -> tuple[str, ...]:
    """The tiers ``step`` is saved to, fastest first: ``"local"`` (None: there is no local tier),
    ``"persistent"``."""
    due = []
    if local_interval is not None and step % local_interval == 0:
        due.append("local")
    if step % persistent_interval == 0:
        due.append("persistent")
    return tuple(due)


def steps_to_delete(
    committed: Sequence[int], newest: int, *, keep_last: int, keep_every: int | None
) -> list[int]:
    """The steps of ``committed`` (ascending) that retention removes, in that order.

    Kept: the last ``keep_last`` of ``committed``, the step just saved
    (``newest``, whatever else is committed), and with ``keep_every`` every
    step divisible by it.
    """
    keep = set(committed[-keep_last:]) | {newest}
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    return [s for s in committed if s not in keep]
