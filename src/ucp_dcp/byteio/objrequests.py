"""Object-store requests that cannot stall a job: deadlines, hedged reads, bounded and
throttle-aware request streams, on an async store's event loop (s3fs).

One rank's requests to one checkpoint go through one :class:`RequestScheduler`
(owned by its :class:`~ucp_dcp.byteio.objstore.ObjectStore`):

* **deadlines**: every request gets a deadline from its size and the
  throughput observed so far by the same scheduler (a load's or a save's
  store), between :attr:`RequestPolicy.deadline_floor_s` and
  :attr:`RequestPolicy.deadline_cap_s`. A request past it is abandoned (its
  task cancelled, which closes its connection) and tried again; once the
  tries are spent the request fails with a
  :class:`~ucp_dcp.errors.StorageError` naming the object, the byte range,
  the rank and how long it waited. The HTTP client's own read timeout (15 s
  per read in s3fs, then retried) is far too patient for this: a stalled request held a load
  for the sum of those timeouts.
* **hedged reads**: a ranged GET that takes longer than
  :attr:`RequestPolicy.hedge_factor` times the median time of requests of its
  size (before any is observed: of its size at
  :attr:`RequestPolicy.first_bytes_per_s`) gets a second, identical request;
  the first complete answer wins and the other is cancelled. The hedges'
  bytes are bounded by :attr:`RequestPolicy.hedge_fraction` of the bytes
  requested so far plus :attr:`RequestPolicy.hedge_allowance_bytes`, and
  counted in :class:`ObjectStats`.
* **bounded**: at most :attr:`RequestPolicy.max_in_flight` requests of the
  scheduler are in flight at once (hedges included), whatever the callers
  batch.
* **throttle-aware**: a throttling answer (S3 ``SlowDown``/503, seen through
  botocore's retry hook or in an error) pauses every new request of the
  scheduler for a while (doubling while throttling goes on), instead of only
  the one request being retried.

Why not fsspec's ``cat_ranges``: it gathers a batch with no deadline, no
hedge and no bound shared across batches. The requests themselves are still
fsspec's (``_cat_file``, ``_call_s3``); nothing here speaks HTTP.
"""

from __future__ import annotations

import asyncio
import errno
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import StorageError, UCPError
from .deadlines import SMALL_REQUEST as _SMALL
from .deadlines import Observed as _Observed
from .deadlines import deadline_for

__all__ = [
    "RequestPolicy",
    "RetryPolicy",
    "ObjectStats",
    "RequestScheduler",
    "DeadlineExceeded",
    "PERMANENT",
    "no_credentials",
    "storage_error",
    "current_rank",
]

_T = TypeVar("_T")


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
    hedge: bool = True
    """Send a second, identical ranged GET for one that is slow (reads only)."""
    hedge_factor: float = 4.0
    """A ranged GET is hedged once it has taken this many times the median time of its size."""
    hedge_floor_s: float = 0.2
    """No GET is hedged before it has taken this long (a round trip is not worth a hedge)."""
    hedge_fraction: float = 0.05
    """Hedged bytes stay within this fraction of the bytes requested so far, plus
    ``hedge_allowance_bytes``."""
    hedge_allowance_bytes: int = 256 << 10
    """Hedged bytes allowed on top of ``hedge_fraction``: a stalled header request, one of the
    first of a load, can be hedged before the fraction amounts to anything."""
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
    """Bytes the hedged GETs asked for (the extra bytes hedging may cost)."""
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

_THROTTLE_WORDS = ("SlowDown", "Throttl", "TooManyRequests", "RequestLimitExceeded", "503")


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


def current_rank() -> int:
    """This process's rank in the default process group (0 outside one)."""
    import torch.distributed as dist  # the store itself needs no torch

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class _Try:
    """One try of a request: its deadline and what its hedging may do."""

    deadline_s: float
    hedge_after_s: float | None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


class RequestScheduler:
    """One rank's request stream to one store: see the module docstring.

    Everything here runs on the store's event loop (fsspec's loop thread);
    ``stats`` may be read from any thread.
    """

    def __init__(self, policy: RequestPolicy, retry: RetryPolicy) -> None:
        self.policy = policy
        self.retry = retry
        self.stats = ObjectStats()
        self._observed = _Observed()
        self._slots: asyncio.Semaphore | None = None
        self._in_flight = 0
        self._paused_until = 0.0
        self._pause = 0.0
        self._hooked: set[int] = set()

    # ------------------------------------------------------------ the policy
    def deadline(self, n: int) -> float:
        """Seconds a request of ``n`` bytes gets now."""
        return deadline_for(self.policy, self._observed, n)

    def _hedge_after(self, n: int) -> float | None:
        p = self.policy
        if not p.hedge:
            return None
        expected = self._observed.expected(n)
        if expected is None:  # nothing observed yet: the time its size takes at the first rate
            expected = max(n, _SMALL) / p.first_bytes_per_s
        return max(p.hedge_floor_s, p.hedge_factor * expected)

    def throttled(self) -> None:
        """A throttling answer came back: pause every new request for a while."""
        now = time.monotonic()
        p = self.policy
        going_on = now < self._paused_until + self._pause
        pause = self._pause * 2 if going_on else p.throttle_pause_s
        self._pause = min(p.throttle_max_pause_s, pause)
        self._paused_until = max(self._paused_until, now + self._pause)
        self.stats.throttles += 1

    def hook(self, client: Any) -> None:
        """See throttling answers that botocore retries by itself (``client``: an aiobotocore
        client): its ``needs-retry`` event shows each answer before the client's own retry."""
        if client is None or id(client) in self._hooked:
            return
        events = getattr(getattr(client, "meta", None), "events", None)
        if events is None:
            return
        self._hooked.add(id(client))

        def seen(response: Any = None, **_: Any) -> None:
            if response is None:
                return
            http, parsed = response
            code = str((parsed or {}).get("Error", {}).get("Code", ""))
            if getattr(http, "status_code", 0) == 503 or _is_throttle(code):
                self.throttled()

        events.register("needs-retry.s3", seen, unique_id=f"ucp-throttle-{id(self)}")

    # ------------------------------------------------------------ requests
    async def run(
        self,
        make: Callable[[], Awaitable[_T]],
        nbytes: int | None,
        *,
        where: str,
        what: str,
        hedge: bool = False,
        check: Callable[[_T], str | None] | None = None,
    ) -> _T:
        """Run the request ``make()`` makes (about ``nbytes`` bytes; None: unknown, it gets the
        deadline cap and no hedge) under the policy.

        ``check(result)`` returns why an answer is wrong (a short read), or
        None; a wrong answer is tried again once, then it is the error.
        Failures are :class:`StorageError` naming ``where`` (the object's
        URL) and ``what`` was being done.
        """
        self.stats.bytes_requested += nbytes or 0
        delays = self.retry.delays()
        t0 = time.monotonic()
        deadlines: list[float] = []
        wrong = 0
        for k in range(len(delays) + 1):
            if k:
                self.stats.retries += 1
            if nbytes is None:
                t = _Try(self.policy.deadline_cap_s, None)
            else:
                t = _Try(self.deadline(nbytes), self._hedge_after(nbytes) if hedge else None)
            deadlines.append(t.deadline_s)
            try:
                out, took = await self._try(make, nbytes, t)
                why = check(out) if check is not None else None
                if why is None:
                    if took > self.stats.slowest_s:
                        self.stats.slowest_s, self.stats.slowest = took, f"{where}: {what}"
                    return out
                wrong += 1
                if wrong > 1:
                    raise _Wrong(why)
                last: BaseException = _Wrong(why)
            except _Wrong as e:
                from ..errors import TruncatedFileError

                raise TruncatedFileError(f"{where}: {e}: truncated object") from None
            except PERMANENT as e:
                if isinstance(e, UCPError):
                    raise
                raise storage_error(where, what, e) from e
            except DeadlineExceeded as e:
                self.stats.timeouts += 1
                last = e
            except Exception as e:  # the client's connection/HTTP errors: transient
                if _is_throttle(f"{type(e).__name__} {e}"):
                    self.throttled()
                if no_credentials(e):
                    raise storage_error(where, what, e) from e
                last = e
            if k == len(delays):
                break
            await asyncio.sleep(delays[k])
        if isinstance(last, _Wrong):
            from ..errors import TruncatedFileError

            raise TruncatedFileError(f"{where}: {last}: truncated object")
        if isinstance(last, DeadlineExceeded):
            waited = time.monotonic() - t0
            last = DeadlineExceeded(
                f"rank {current_rank()} got no answer within the deadline of each of "
                f"{len(deadlines)} tries ({', '.join(f'{d:.2f}' for d in deadlines)} s for "
                f"{nbytes if nbytes is not None else 'an unknown number of'} bytes) and waited "
                f"{waited:.2f} s in all"
            )
        raise storage_error(where, what, last, tries=len(deadlines)) from last

    async def _wait_for_pause(self) -> None:
        while (wait := self._paused_until - time.monotonic()) > 0:
            self.stats.throttle_wait_s += wait
            await asyncio.sleep(wait)

    async def _slot(self) -> None:
        if self._slots is None:  # made on the loop that uses it
            self._slots = asyncio.Semaphore(self.policy.max_in_flight)
        await self._slots.acquire()
        self._in_flight += 1
        self.stats.most_in_flight = max(self.stats.most_in_flight, self._in_flight)

    def _free(self) -> None:
        assert self._slots is not None
        self._in_flight -= 1
        self._slots.release()

    def _may_hedge(self, nbytes: int) -> bool:
        s = self.stats
        budget = self.policy.hedge_fraction * s.bytes_requested + self.policy.hedge_allowance_bytes
        return (
            s.hedged_bytes + nbytes <= budget
            and self._slots is not None
            and not self._slots.locked()
        )

    async def _start(self, make: Callable[[], Awaitable[Any]], t: _Try) -> None:
        await self._slot()
        try:  # a pause that began while this request waited for its slot holds it too
            await self._wait_for_pause()
        except BaseException:
            self._free()
            raise

        async def one() -> Any:
            try:
                return await make()
            finally:
                self._free()

        self.stats.requests += 1
        t.tasks.append(asyncio.ensure_future(one()))

    async def _try(
        self, make: Callable[[], Awaitable[_T]], nbytes: int | None, t: _Try
    ) -> tuple[_T, float]:
        """One try: the request, and its hedge if it is slow; the first complete answer wins.
        Returns the answer and the seconds it took."""
        await self._start(make, t)  # waiting for a slot is not the request's time
        start = time.monotonic()
        first = t.tasks[0]
        pending = set(t.tasks)
        error: BaseException | None = None
        try:
            while pending:
                now = time.monotonic() - start
                left = t.deadline_s - now
                if left <= 0:
                    raise DeadlineExceeded(f"no answer within {t.deadline_s:.2f} s")
                if t.hedge_after_s is not None and len(t.tasks) == 1:
                    left = min(left, max(t.hedge_after_s - now, 0.0) + 1e-3)
                done, pending = await asyncio.wait(
                    pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task.exception() is None:
                        took = time.monotonic() - start
                        if nbytes is not None:
                            self._observed.add(nbytes, took)
                        if task is not first:
                            self.stats.hedge_wins += 1
                        return task.result(), took
                    error = error or task.exception()
                now = time.monotonic() - start
                hedge_due = t.hedge_after_s is not None and now >= t.hedge_after_s
                if pending and len(t.tasks) == 1 and hedge_due and nbytes is not None:
                    if self._may_hedge(nbytes):
                        self.stats.hedges += 1
                        self.stats.hedged_bytes += nbytes
                        await self._start(make, t)
                        pending.add(t.tasks[-1])
                    else:
                        t.hedge_after_s = now + 0.05  # no budget or slot yet: look again soon
            assert error is not None
            raise error
        finally:
            for task in t.tasks:
                task.cancel()


class _Wrong(Exception):
    """An answer ``check`` refused (a short read)."""


def _is_throttle(text: str) -> bool:
    return any(w in text for w in _THROTTLE_WORDS)


def loop_of(fs: Any) -> Any:
    """The event loop of an async fsspec filesystem (s3fs), or None for a blocking one."""
    if not getattr(fs, "async_impl", False) or not hasattr(fs, "_cat_file"):
        return None
    return getattr(fs, "loop", None)
