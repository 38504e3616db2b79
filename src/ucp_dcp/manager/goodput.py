"""How often to checkpoint: Young/Daly intervals and the resulting goodput.

With failures arriving at random (exponentially, mean time between failures
``M``), checkpointing every ``tau`` seconds of work at a cost of ``C``
seconds each trades checkpoint overhead against lost work. Young (1974)
gave the first-order optimum ``sqrt(2 C M)``; Daly (2006, "A higher order
estimate of the optimum checkpoint interval for restart dumps") gave the
higher-order one used here, and the expected wall time that goes with it.

For an async manager the cost ``C`` is the time a save *blocks* training,
not the time the background write takes; the write time still matters,
because a failure during it falls back to the previous committed step. That
lag is added to the restart cost as extra lost work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["young_interval", "daly_interval", "effective_ratio", "GoodputEstimate", "estimate"]


def _check(**kw: float) -> None:
    for k, v in kw.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v)) or v < 0:
            raise InvalidArgumentError(f"{k} must be a finite number >= 0, got {v!r}")


def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints, ``sqrt(2 C M)`` seconds."""
    _check(save_cost_s=save_cost_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal compute time between checkpoints, in seconds.

    ``sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` for ``C < 2M``, else ``M``.
    """
    _check(save_cost_s=save_cost_s, mtbf_s=mtbf_s)
    c, m = save_cost_s, mtbf_s
    if m == 0:
        raise InvalidArgumentError("daly_interval: mtbf_s must be > 0, got 0")
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return max(math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c, 0.0)


def effective_ratio(
    interval_s: float,
    save_cost_s: float,
    mtbf_s: float,
    *,
    restart_s: float = 0.0,
    commit_lag_s: float = 0.0,
) -> float:
    """Expected fraction of wall time spent on useful training (0..1).

    Daly's model for exponential failures: the wall time per unit of work is
    ``M e^{R/M} (e^{(tau+C)/M} - 1) / tau``. ``restart_s`` (R) is the time to
    restart and restore; ``commit_lag_s`` (the background write time of an
    async save) is counted as extra work lost on each failure.
    """
    _check(
        interval_s=interval_s,
        save_cost_s=save_cost_s,
        mtbf_s=mtbf_s,
        restart_s=restart_s,
        commit_lag_s=commit_lag_s,
    )
    if interval_s == 0 or mtbf_s == 0:
        raise InvalidArgumentError(
            f"effective_ratio: interval_s and mtbf_s must be > 0, got interval_s={interval_s!r}, "
            f"mtbf_s={mtbf_s!r}"
        )
    m, r = mtbf_s, restart_s + commit_lag_s
    wall_per_work = m * math.exp(r / m) * math.expm1((interval_s + save_cost_s) / m) / interval_s
    return 1.0 / wall_per_work


@dataclass(frozen=True)
class GoodputEstimate:
    """Checkpoint cost measured by a manager and what it implies for a given MTBF."""

    saves: int  #: saves measured
    blocking_s: float  #: mean time a save blocked training
    write_s: float  #: mean background time from staging to commit
    bytes: float  #: mean bytes per save
    mtbf_s: float  #: mean time between failures assumed
    restart_s: float  #: restart + restore time assumed
    optimal_interval_s: float  #: Daly's interval for ``blocking_s``
    effective_ratio: float  #: expected useful fraction of wall time at that interval


def estimate(
    blocking_s: list[float],
    write_s: list[float],
    nbytes: list[int],
    *,
    mtbf_s: float,
    restart_s: float = 0.0,
) -> GoodputEstimate:
    """A :class:`GoodputEstimate` from per-save measurements (means over the lists)."""
    if not blocking_s:
        raise InvalidArgumentError(
            "no saves measured yet: save at least once before estimating goodput"
        )
    n = len(blocking_s)
    c = sum(blocking_s) / n
    w = sum(write_s) / max(len(write_s), 1)
    tau = daly_interval(c, mtbf_s)
    tau = max(tau, 1e-9)
    return GoodputEstimate(
        saves=n,
        blocking_s=c,
        write_s=w,
        bytes=sum(nbytes) / max(len(nbytes), 1),
        mtbf_s=mtbf_s,
        restart_s=restart_s,
        optimal_interval_s=tau,
        effective_ratio=effective_ratio(tau, c, mtbf_s, restart_s=restart_s, commit_lag_s=w),
    )
