"""How long one storage request may take: the deadline arithmetic every request of a load or a
save uses, on object storage (:mod:`~ucp_dcp.byteio.objrequests`) and on local files
(:class:`~ucp_dcp.byteio.rangeio.RangeReader`).

A request's deadline comes from its size and the times the same load's (or save's) requests took
so far (:class:`Observed`), within the floor and cap of the one
:class:`~ucp_dcp.byteio.reqpolicy.RequestPolicy` the user configures (:func:`deadline_for`).
What happens past it differs: an object-store request is abandoned and tried again, a local read
(which the kernel cannot cancel) fails the load.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

from .reqpolicy import RequestPolicy

__all__ = ["Observed", "deadline_for", "SMALL_REQUEST", "SAMPLES"]

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
