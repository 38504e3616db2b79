"""CheckpointConfig: every setting of a :class:`~ucp_dcp.manager.manager.CheckpointManager`, and
what they decide (:func:`tiers_due`: which tiers a step goes to; :func:`steps_to_delete`: which
steps a tier keeps; :func:`estimate`: how often to save, by Young's and Daly's model, which
docs/manager.md ("Goodput") describes).
"""

from __future__ import annotations

import inspect
import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..byteio.requests import RequestPolicy
from ..dcp import ReadOptions
from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..format.schema import check_count, check_field_types

__all__ = [
    "CheckpointConfig",
    "steps_to_delete",
    "tiers_due",
    "young_interval",
    "daly_interval",
    "effective_ratio",
    "GoodputEstimate",
    "estimate",
]


def _option(default: Any, doc: str, shown: str | None = None) -> Any:
    """A dataclass field with a default and a description (shown by ``help``); ``shown`` spells
    the default there where its repr would be long (a record of defaults)."""
    meta = {"doc": " ".join(doc.split()), "shown": shown or repr(default)}
    return field(default=default, metadata=meta)


def _list_fields(cls: type) -> type:
    """Append a "Fields" section, built from each field's description, to ``cls.__doc__``."""
    lines = [inspect.cleandoc(cls.__doc__ or ""), "", "Fields:"]
    for f in fields(cls):
        lines.append(f"    {f.name} (default {f.metadata['shown']}):")
        lines += textwrap.wrap(
            f.metadata["doc"],
            76,
            initial_indent=" " * 8,
            subsequent_indent=" " * 8,
            break_on_hyphens=False,
        )
    cls.__doc__ = "\n".join(lines) + "\n"
    return cls


@_list_fields
@dataclass
class CheckpointConfig:
    """Settings of a :class:`CheckpointManager`; every field can also be passed to it as a keyword.

    Intervals decide which tiers a step is saved to (a step divisible by the
    interval); the ``keep`` fields decide which committed steps each tier
    keeps (the newest committed step always stays). How a restore reads is one
    :class:`~ucp_dcp.ReadOptions` (``read``), as for every other reader.
    """

    local: str | os.PathLike[str] | None = _option(
        None,
        """
        Fast tier: a node-local directory (NVMe, ``/dev/shm``). ``{node}`` in the
        path is replaced by the node index (lets tests simulate nodes on one machine).
        None: no local tier, saves go straight to the persistent tier.""",
    )

    local_interval: int = _option(
        1,
        """
        Save to the local tier every this many steps (a step divisible by it).""",
    )

    persistent_interval: int = _option(
        1,
        """
        Save to the persistent tier (``root``) every this many steps. With a local
        tier, a persistent save drains the local copy in the background.""",
    )

    keep_last: int = _option(
        3,
        """
        Persistent tier: keep the newest this many committed steps (at least 1).""",
    )

    keep_every: int | None = _option(
        None,
        """
        Persistent tier: also keep every step divisible by this, forever.""",
    )

    local_keep_last: int = _option(
        2,
        """
        Local tier: keep the newest this many committed steps (at least 1).""",
    )

    max_in_flight: int = _option(
        1,
        """
        Saves staged or writing at once; ``save`` blocks (backpressure) beyond it.
        Each in-flight save holds one host copy of the state.""",
    )

    async_save: bool = _option(
        True,
        """
        Write in the background. False: ``save`` returns after the commit.""",
    )

    nonfinite: Literal["off", "error", "flag"] = _option(
        "off",
        """
        NaN/Inf guard: "error" refuses the save (naming the tensors), "flag"
        saves and records them in the commit marker, "off" does not look.""",
    )

    load_flagged: bool = _option(
        False,
        """
        Whether ``load()`` without a step may pick a step flagged non-finite.""",
    )

    ranks_per_node: int | None = _option(
        None,
        """
        Ranks sharing one node-local directory; default ``$LOCAL_WORLD_SIZE``, else
        the world size (one node).""",
    )

    peer_replication: bool = _option(
        True,
        """
        Local tier with several nodes: also copy each node's files to the next
        node over torch.distributed, so losing one node's disk loses nothing.""",
    )

    storage_options: dict[str, Any] | None = _option(
        None,
        """
        fsspec options for a URL ``root`` (e.g. S3 endpoint and credentials).""",
    )

    requests: RequestPolicy | None = _option(
        None,
        """
        For a URL ``root``: the policy every request to it runs under (each request's
        deadline, retries, hedged reads, the bound on requests in flight): the uploads,
        downloads, listings and deletes of the persistent tier, and the reads of a
        restore from it unless ``read.requests`` names another. None:
        ``RequestPolicy()``'s defaults.""",
    )

    direct_restore: bool = _option(
        True,
        """
        A step that only an object-store persistent tier (``s3://``...) holds is
        loaded from it directly: each rank fetches only the byte ranges its
        shards need, verified as they arrive, and a configured local tier is
        refilled in the background afterwards. False: the whole step is
        downloaded to local disk first, then loaded.""",
    )

    placement_digests: bool = _option(
        False,
        """
        Record every tensor's placement digest in each step's index
        (``UCPStorageWriter(placement_digests=True)``), on every tier (the local
        copy, and the persistent one written from it or uploaded), so that a
        restore can prove where it put every element. Off by default: the
        hashing made a local save 1.5-1.8x as long in the measurements of
        docs/format.md ("Placement digests").""",
    )

    read: ReadOptions = _option(
        ReadOptions(),
        """
        How every restore reads a step, from either tier: the reader's
        :class:`~ucp_dcp.ReadOptions`, the same fields as for ``dcp.load`` with the UCP
        classes. ``read.verify`` (on by default) checks every chunk ``load`` reads
        against its xxh3 checksum (cost: see benchmarks/README.md); the index is
        checked against the commit marker either way. ``read.verify_placement`` checks
        after every restore that each element landed where the save found it
        (1.5-3.4x a load's time in docs/format.md's measurements): a wrong placement,
        or a step saved without ``placement_digests``, fails that copy naming the
        tensor (or saying the step has no digests) and the restore falls back to the
        next copy, as for a failed checksum; ``last_restore.placement`` says what was
        checked. ``read.requests`` None: ``requests`` above. ``read.max_request_bytes``
        at its default: 64 MiB for a restore straight from an object store (a request
        costs a round trip).""",
        shown="ReadOptions()",
    )

    def validate(self) -> None:
        """Raise :class:`~ucp_dcp.errors.InvalidArgumentError` (a ``ValueError``) naming the first
        field out of range."""
        for k in (
            "local_interval",
            "persistent_interval",
            "keep_last",
            "local_keep_last",
            "max_in_flight",
        ):
            check_count("CheckpointConfig", k, getattr(self, k), why=_WHY.get(k, ""))
        if not isinstance(self.read, ReadOptions):
            raise InvalidArgumentError(
                f"CheckpointConfig.read must be a ReadOptions, got {self.read!r}"
            )
        for k in ("keep_every", "ranks_per_node"):
            check_count("CheckpointConfig", k, getattr(self, k), optional=True)
        if self.local is not None and not isinstance(self.local, (str, os.PathLike)):
            raise InvalidArgumentTypeError(
                "CheckpointConfig.local must be None or a directory (str or os.PathLike, "
                f"'{{node}}' standing for the node), got {type(self.local).__name__}"
            )
        if self.local is not None:
            try:
                os.fspath(self.local).format(node=0)
            except (KeyError, IndexError, ValueError) as e:
                raise InvalidArgumentError(
                    f"CheckpointConfig.local={os.fspath(self.local)!r}: the only placeholder is "
                    f"'{{node}}' ({e!r})"
                ) from None
        if self.nonfinite not in ("off", "error", "flag"):
            raise InvalidArgumentError(
                "CheckpointConfig.nonfinite must be 'off', 'error' or 'flag', got "
                f"{self.nonfinite!r}"
            )
        check_field_types(self)  # the flags, requests and storage_options (counts: above)


# What a count's lower bound protects, said after a value below it.
_WHY = {"keep_last": " (keep_last=0 would delete the only good checkpoint)"}


# What the configuration decides, as pure functions: which tiers a step goes to, which steps a
# tier keeps.


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
    committed: Sequence[int],
    newest: int,
    *,
    keep_last: int,
    keep_every: int | None,
    last_good: int | None = None,
) -> list[int]:
    """The steps of ``committed`` (ascending) that retention removes, in that order.

    Kept: the last ``keep_last`` of ``committed``, the step just saved
    (``newest``, whatever else is committed), ``last_good`` (the newest step a default
    :meth:`~ucp_dcp.CheckpointManager.load` restores: with ``nonfinite="flag"``, steps holding
    NaN or Inf after it would otherwise push it out), and with ``keep_every`` every step
    divisible by it.
    """
    keep = set(committed[-keep_last:]) | {newest}
    if last_good is not None:
        keep.add(last_good)
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    return [s for s in committed if s not in keep]


# ------------------------------------------ how often to save: Young/Daly intervals, goodput


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
