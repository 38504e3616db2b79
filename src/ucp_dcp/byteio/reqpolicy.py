"""What one rank's storage requests may do, and what they did: the policy a user configures
(:class:`RequestPolicy`, with :class:`RetryPolicy`) and the counters a load or a save fills
(:class:`ObjectStats`).

The scheduler that applies them to object-store requests is
:mod:`~ucp_dcp.byteio.objrequests`; a local load's reads take their deadlines from the same
policy (:mod:`~ucp_dcp.byteio.workers`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["RequestPolicy", "RetryPolicy", "ObjectStats"]


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how patiently, a failing request is tried again."""

    attempts: int = 5
    """Tries in all (1: no retry)."""
    backoff_s: float = 0.1
    """Wait before the first retry; doubled for each next one (plus up to 50% jitter)."""
    max_backoff_s: float = 5.0
    """Upper bound on one wait."""

    def delays(self) -> list[float]:
        """The waits before each retry (``attempts - 1`` of them)."""
        out = []
        for k in range(max(self.attempts, 1) - 1):
            d = min(self.backoff_s * (2**k), self.max_backoff_s)
            out.append(d * (1 + random.random() / 2))
        return out


@dataclass(frozen=True)
class RequestPolicy:
    """Deadlines, hedging and the request stream of one rank on an object store.

    Given to :class:`~ucp_dcp.UCPStorageReader` and :class:`~ucp_dcp.UCPStorageWriter`
    as ``requests=``; the defaults suit a real object store (a request's
    deadline is never under 5 s). Tests and benchmarks shorten them. A local
    load's reads get their deadlines from the same fields (and arithmetic,
    :mod:`~ucp_dcp.byteio.deadlines`), times ``attempts``; one past it fails
    the load instead of being retried (:mod:`~ucp_dcp.byteio.workers`).
    """

    attempts: int = 5
    """Tries of a request in all (1: no retry), with exponential backoff and jitter between
    them (:class:`RetryPolicy`). A request that never answers fails after at most
    ``attempts * deadline_cap_s`` plus the backoffs."""
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
    max_request_bytes: int = 8 << 20
    """A ranged GET of more bytes is sent as parts, concurrently (within ``max_in_flight``), each
    with its own deadline and hedge. A part is at most this long, and at most half the hedge
    budget (:meth:`~ucp_dcp.byteio.objrequests.RequestScheduler.part_bytes`): a slow part can
    then be hedged, which a GET of several MB in a load of a hundred MB would not fit."""
    min_request_bytes: int = 2 << 20
    """Parts are at least this long: a part costs a round trip (on S3 one of about 1 MiB takes
    little more than the round trip itself), and on the benchmark's server a load of 64 MB per
    rank in parts of 1 MiB took 1.29x its time in parts of 2 MiB (docs/object-storage.md)."""
    hedge: bool = True
    """Send a second, identical ranged GET for one that is slow (reads only)."""
    hedge_factor: float = 3.0
    """A ranged GET is hedged once it has taken this many times the median time of its size
    (about the 95th percentile of an object store's GETs; an unneeded hedge costs at most the
    budget)."""
    first_hedge_s: float = 0.1
    """Before any request was observed, a GET is hedged after this long. Not the deadline's
    patient prior (``first_bytes_per_s``): a stalled first request of a load (a data file's
    header, read before anything else) held every rank 4 x 0.47 s at that rate. A hedge that
    was not needed costs the bytes its loser sent by then, a round trip's worth or none."""
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

    def __post_init__(self) -> None:
        from ..errors import InvalidArgumentError

        if not 0 < self.deadline_floor_s <= self.deadline_cap_s:
            raise InvalidArgumentError(
                f"RequestPolicy: needs 0 < deadline_floor_s <= deadline_cap_s, got "
                f"{self.deadline_floor_s} and {self.deadline_cap_s}"
            )
        if self.attempts < 1:
            raise InvalidArgumentError(f"RequestPolicy(attempts={self.attempts}): needs at least 1")
        if not 0 < self.min_request_bytes <= self.max_request_bytes:
            raise InvalidArgumentError(
                f"RequestPolicy: needs 0 < min_request_bytes <= max_request_bytes, got "
                f"{self.min_request_bytes} and {self.max_request_bytes}"
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
