"""What one rank's storage requests may do: the policy a user configures (:class:`RequestPolicy`:
deadlines, retries, hedging, the bound on requests in flight), the deadline arithmetic every
request uses (:func:`deadline_for`, from what the same load or save observed:
:class:`Observed`), the counters a load or a save fills (:class:`ObjectStats`), and the errors
that name a failed request. How object-store requests run under it is
:mod:`~ucp_dcp.byteio.scheduler`'s; how local reads do, :mod:`~ucp_dcp.byteio.workers`'.
"""

from __future__ import annotations

import errno
import random
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ..errors import InvalidArgumentError, StorageError, UCPError
from ..format.schema import check_field_types

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "RequestPolicy",
    "ObjectStats",
    "Observed",
    "deadline_for",
    "SMALL_REQUEST",
    "SAMPLES",
    "DeadlineExceeded",
    "PERMANENT",
    "no_credentials",
    "storage_error",
    "current_rank",
    "rank_and_world",
]


# RequestPolicy's rates and factors, which must be more than 0 (True), and its waits and
# allowances, which may be 0 (False); the counts and deadlines are checked in pairs below.
_AMOUNTS = {
    "backoff_s": False,
    "max_backoff_s": False,
    "first_bytes_per_s": True,
    "deadline_factor": True,
    "hedge_factor": True,
    "first_hedge_s": False,
    "hedge_floor_s": False,
    "hedge_fraction": False,
    "hedge_allowance_bytes": False,
    "throttle_pause_s": False,
    "throttle_max_pause_s": False,
}


@dataclass(frozen=True)
class RequestPolicy:
    """Deadlines, hedging and the request stream of one rank on an object store.

    Given to :class:`~ucp_dcp.UCPStorageReader` and :class:`~ucp_dcp.UCPStorageWriter`
    as ``requests=``; the defaults suit a real object store (a request's
    deadline is never under 5 s). Tests and benchmarks shorten them. A local
    load's reads get their deadlines from the same fields (and arithmetic,
    :func:`deadline_for`), times ``attempts``; one past it fails
    the load instead of being retried (:mod:`~ucp_dcp.byteio.workers`).
    """

    attempts: int = 5
    """Tries of a request in all (1: no retry), with exponential backoff and jitter between
    them (:meth:`delays`). A request that never answers fails after at most
    ``attempts * deadline_cap_s`` plus the backoffs."""
    backoff_s: float = 0.1
    """Wait before the first retry; doubled for each next one (plus up to 50% jitter)."""
    max_backoff_s: float = 5.0
    """Upper bound on one wait before a retry."""
    deadline_floor_s: float = 5.0
    """The least time a request gets before it is abandoned and tried again."""
    deadline_cap_s: float = 60.0
    """The most time a request gets."""
    first_bytes_per_s: float = float(1 << 20)
    """Before any request was observed, a request gets the time its size takes at this rate
    (within the floor and cap); a request of unknown size gets the cap."""
    deadline_factor: float = 8.0
    """A request's deadline is this many times the time its size took so far (the median of
    requests of its size, else its size at the median throughput), within the floor and cap."""
    max_part_bytes: int = 8 << 20
    """A ranged GET of more bytes is sent as parts, concurrently (within ``max_in_flight``), each
    with its own deadline and hedge. A part is at most this long, and at most half the hedge
    budget (:meth:`RequestScheduler.part_bytes`): a slow part can
    then be hedged, which a GET of several MB in a load of a hundred MB would not fit."""
    min_part_bytes: int = 2 << 20
    """Parts are at least this long: a part costs a round trip (measured in
    docs/object-storage.md, "Parts")."""
    hedge: bool = True
    """Send a second, identical ranged GET for one that is slow (reads only)."""
    hedge_factor: float = 3.0
    """A ranged GET is hedged once it has taken this many times the median time of its size
    (about the 95th percentile of an object store's GETs; an unneeded hedge costs at most the
    budget)."""
    first_hedge_s: float = 0.1
    """Before any request was observed, a GET is hedged after this long, not at the deadline's
    patient prior (``first_bytes_per_s``): that left a stalled first request (a data file's
    header) unhedged for seconds (measured in docs/object-storage.md)."""
    max_hedges: int = 2
    """Hedges one try of a GET may send: a hedge as slow as the GET it doubles is replaced by a
    new one (a load's slowed share of GETs slows that share of its hedges as well). One hedge at
    most is in flight beside the GET, so a try holds one hedge's size of the budget."""
    hedge_floor_s: float = 0.1
    """No GET is hedged before it has taken this long (a round trip is not worth a hedge: tens of
    milliseconds on S3)."""
    hedge_fraction: float = 0.05
    """The bytes hedging costs stay within this fraction of the load's bytes (those requested so
    far, or those the read under way announced if more; or ``hedge_allowance_bytes`` while that
    is more): the bytes received for answers that lost to
    their hedge and for hedges that lost (:attr:`ObjectStats.hedge_extra_bytes`), plus the whole
    size of each hedge still in flight. Not what the hedges asked for: a slow answer cancelled
    after a few bytes cost those bytes."""
    hedge_allowance_bytes: int = 1 << 20
    """Hedging's cost allowed before ``hedge_fraction`` amounts to as much: a stalled request
    among the first of a load (a data file's header and block checksums, a few hundred KiB
    for a large file) can be hedged. Not added to the fraction: a load of at least 20 times
    this wastes at most ``hedge_fraction`` of its bytes on hedges."""
    max_in_flight: int = 8
    """Requests of one rank in flight at once (hedges included): a job of thousands of ranks
    must not open a burst of connections per rank to one prefix."""
    throttle_pause_s: float = 0.5
    """After a throttling answer (S3 ``SlowDown``/503), no new request starts for this long;
    doubled while throttling goes on."""
    throttle_max_pause_s: float = 8.0
    """Upper bound on one throttling pause."""
    local_deadlines: bool = True
    """Local loads: every read runs on an I/O thread under its deadline, the loading thread keeping
    time (:mod:`~ucp_dcp.byteio.workers`). False: the loading thread makes one share of the reads
    itself and nothing is timed, saving a thread hand-off per read call (tens of microseconds;
    docs/object-storage.md), but a read blocked in the kernel then holds the load forever."""

    def delays(self) -> list[float]:
        """The waits before each retry (``attempts - 1`` of them)."""
        out = []
        for k in range(max(self.attempts, 1) - 1):
            d = min(self.backoff_s * (2**k), self.max_backoff_s)
            out.append(d * (1 + random.random() / 2))
        return out

    def __post_init__(self) -> None:
        check_field_types(self)
        for name, positive in _AMOUNTS.items():
            v = getattr(self, name)
            if not (v > 0 if positive else v >= 0):  # a NaN is neither
                raise InvalidArgumentError(
                    f"RequestPolicy({name}={v}): needs {'more than' if positive else 'at least'} 0"
                )
        if not 0 < self.deadline_floor_s <= self.deadline_cap_s:
            raise InvalidArgumentError(
                f"RequestPolicy: needs 0 < deadline_floor_s <= deadline_cap_s, got "
                f"{self.deadline_floor_s} and {self.deadline_cap_s}"
            )
        if self.attempts < 1:
            raise InvalidArgumentError(f"RequestPolicy(attempts={self.attempts}): needs at least 1")
        if not 0 < self.min_part_bytes <= self.max_part_bytes:
            raise InvalidArgumentError(
                f"RequestPolicy: needs 0 < min_part_bytes <= max_part_bytes, got "
                f"{self.min_part_bytes} and {self.max_part_bytes}"
            )
        if self.max_hedges < 0:
            raise InvalidArgumentError(
                f"RequestPolicy(max_hedges={self.max_hedges}): needs at least 0"
            )
        if self.max_in_flight < 1:
            raise InvalidArgumentError(
                f"RequestPolicy(max_in_flight={self.max_in_flight}): needs at least 1"
            )


@dataclass
class ObjectStats:
    """What one scheduler's requests did (a load's or a save's, on one rank)."""

    requests: int = 0
    """Requests sent (tries, retries and hedges included)."""
    bytes_requested: int = 0
    """Bytes of the requests asked for (each logical request once, hedges and retries not)."""
    hedges: int = 0
    """Hedged GETs sent."""
    hedged_bytes: int = 0
    """Bytes the hedged GETs asked for."""
    hedge_extra_bytes: int = 0
    """Bytes received for the answers that lost (a GET to its hedge, or a hedge to its GET):
    what hedging cost. Counted as they arrive on S3 (up to the moment the loser is cancelled;
    bytes still in flight on the connection then are not seen); on a store whose GETs cannot be
    counted, the loser's whole size."""
    hedge_wins: int = 0
    """Hedges that answered before the request they doubled."""
    timeouts: int = 0
    """Tries abandoned at their deadline."""
    retries: int = 0
    """Tries after the first of a request (after a deadline, an error or a short answer)."""
    throttles: int = 0
    """Throttling answers seen (each pauses the stream)."""
    throttle_wait_s: float = 0.0
    """Seconds requests waited, in all, for a throttling pause to end."""
    most_in_flight: int = 0
    """The most requests in flight at once."""
    slowest_s: float = 0.0
    """The longest time one successful request took."""
    slowest: str = ""
    """What that request was (object and byte range)."""


SMALL_REQUEST = 64 << 10
"""Requests up to this size cost a round trip (or a page fault), whatever their size."""
SAMPLES = 256
"""Observations kept (the recent ones: throughput changes during a job)."""
_MIN_SAMPLES = 3  # observations needed before a median is trusted


class Observed:
    """Recent (bytes, seconds) of successful requests: the medians deadlines and hedges use.

    Thread-safe: a local load's I/O threads add to it while the thread that waits for them asks
    for deadlines.
    """

    def __init__(self) -> None:
        self._all: deque[tuple[int, float]] = deque(maxlen=SAMPLES)
        self._by_size: dict[int, deque[float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _bucket(n: int) -> int:
        # Sizes within a factor of 4 share a bucket; all small requests share one.
        return max(n, SMALL_REQUEST).bit_length() // 2

    def add(self, n: int, seconds: float) -> None:
        """Record that a request of ``n`` bytes took ``seconds``."""
        with self._lock:
            self._all.append((n, seconds))
            same = self._by_size.setdefault(self._bucket(n), deque(maxlen=SAMPLES // 4))
            same.append(seconds)

    def expected(self, n: int) -> float | None:
        """The time a request of ``n`` bytes should take (None before enough observations)."""
        with self._lock:
            same = self._by_size.get(self._bucket(n))
            if same is not None and len(same) >= _MIN_SAMPLES:
                return statistics.median(same)
            if len(self._all) < _MIN_SAMPLES:
                return None
            all_ = list(self._all)
        rate = statistics.median(max(b, SMALL_REQUEST) / max(s, 1e-6) for b, s in all_)
        return max(n, SMALL_REQUEST) / rate


def deadline_for(policy: RequestPolicy, observed: Observed, n: int) -> float:
    """Seconds a request of ``n`` bytes gets now: ``deadline_factor`` times the time its size took
    so far (before anything was observed: its size at ``first_bytes_per_s``), within
    ``deadline_floor_s`` and ``deadline_cap_s``."""
    expected = observed.expected(n)
    if expected is None:
        wanted = n / policy.first_bytes_per_s
    else:
        wanted = policy.deadline_factor * expected
    return min(policy.deadline_cap_s, max(policy.deadline_floor_s, wanted))


_T = TypeVar("_T")


class DeadlineExceeded(TimeoutError):
    """A try got no complete answer within its deadline (internal: the scheduler retries it)."""


# Errors a retry cannot fix. Anything else a store raises (the client's own
# connection, timeout and HTTP errors, OSError(EIO) for a 5xx that outlived
# the client's retries) is treated as transient.
PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
    TypeError,
    ValueError,
    UCPError,
)


def no_credentials(e: BaseException) -> bool:
    """Whether ``e`` says the client found no usable credentials (botocore's
    ``NoCredentialsError``, ``PartialCredentialsError``...): a retry cannot fix that."""
    return any("Credentials" in c.__name__ for c in type(e).__mro__)


def storage_error(where: str, what: str, e: BaseException, tries: int = 1) -> StorageError:
    """A :class:`StorageError` naming ``where`` (an object's URL), what failed and why."""
    after = f" (after {tries} tries)" if tries > 1 else ""
    code = getattr(e, "errno", None)
    if isinstance(e, FileNotFoundError):
        code = code or errno.ENOENT
    elif isinstance(e, PermissionError):
        code = code or errno.EACCES
    elif isinstance(e, DeadlineExceeded):
        code = errno.ETIMEDOUT
    msg = f"{where}: {what} failed{after}: {type(e).__name__}: {e}"
    return StorageError(code, msg) if code else StorageError(msg)


def rank_and_world(group: ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (the default process group when
    ``None``); ``(0, 1)`` where torch.distributed is not initialized. Every rank and group
    size ucp_dcp reads comes from here."""
    import torch.distributed as dist  # the store itself needs no torch

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def current_rank() -> int:
    """This process's rank in the default process group (0 outside one)."""
    return rank_and_world()[0]
