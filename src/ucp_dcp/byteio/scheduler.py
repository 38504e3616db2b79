"""How one rank's object-store requests run, under its
:class:`~ucp_dcp.byteio.requests.RequestPolicy` (whose fields say what each limit is and why).

Object-store requests cannot stall a job. One rank's requests to one checkpoint go through one
:class:`RequestScheduler` (owned by its :class:`~ucp_dcp.byteio.objstore.ObjectStore`), on the
store's event loop, which:

* gives every try a deadline (:func:`~ucp_dcp.byteio.requests.deadline_for`), abandons a try past
  it and tries again, then fails with a :class:`~ucp_dcp.errors.StorageError`;
* hedges a slow GET within the hedge budget (:class:`Slots`, :class:`Received`;
  :meth:`RequestScheduler.part_bytes` sizes the parts of a long GET to fit it);
* keeps at most ``max_in_flight`` requests in flight (hedges included);
* pauses every new request after a throttling answer, not only the one being retried.

The requests themselves are fsspec's (``_cat_file``, ``_call_s3``); nothing here speaks HTTP. The
behaviour in full: docs/object-storage.md ("Deadlines, hedged reads and throttling").
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import TruncatedFileError, UCPError
from .requests import (
    PERMANENT,
    SAMPLES,
    DeadlineExceeded,
    ObjectStats,
    Observed,
    RequestPolicy,
    current_rank,
    deadline_for,
    no_credentials,
    storage_error,
)

__all__ = ["Received", "RequestScheduler", "Slots"]

_T = TypeVar("_T")

_THROTTLE_WORDS = ("SlowDown", "Throttl", "TooManyRequests", "RequestLimitExceeded", "503")


class Slots:
    """At most ``n`` requests in flight; a waiting hedge is served before waiting requests.

    A hedge that queued behind a window of new requests would start only after them, too late
    to help: a slow request holds its window back, the hedge is what lets it go. (Not
    :class:`asyncio.Semaphore`: its waiters are served in arrival order.)
    """

    def __init__(self, n: int) -> None:
        self._free = n
        self._hedges: deque[asyncio.Future[None]] = deque()
        self._plain: deque[asyncio.Future[None]] = deque()

    async def acquire(self, hedge: bool = False) -> None:
        """Wait for a slot (hedges first)."""
        if self._free > 0 and not self._hedges and not self._plain:
            self._free -= 1
            return
        queue = self._hedges if hedge else self._plain
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot, then cancelled: pass it on
                self.release()
            elif fut in queue:
                queue.remove(fut)
            raise

    def release(self) -> None:
        """Free a slot: the longest-waiting hedge takes it, else the longest-waiting request."""
        for queue in (self._hedges, self._plain):
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)
                    return
        self._free += 1


@dataclass
class Received:
    """What one request's answer delivered: a GET that can count adds to ``bytes`` as the body
    arrives and sets ``counted``; the scheduler charges a hedge's cost by the loser's count."""

    bytes: int = 0
    """Body bytes received so far."""
    counted: bool = False
    """Whether ``bytes`` was counted as the answer arrived (else the request could not tell)."""
    sent: bool = False
    """Whether the request was sent (a hedge may be cancelled while it waits for a slot)."""

    def cost(self, nbytes: int) -> int:
        """The bytes this request cost if its answer is thrown away (``nbytes``: its size)."""
        if not self.sent:
            return 0
        return self.bytes if self.counted else nbytes


Make = Callable[[Received], Awaitable[_T]]
"""Makes one request (``make(got)``); a GET counts its answer's bytes into ``got``."""


@dataclass
class _Try:
    """One try of a request: its deadline and whether it may be hedged."""

    deadline_s: float
    hedge: bool
    observe: bool = True
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


_LATER_ANSWERED = 2  # requests sent after a GET, answered before it, that make it an outlier
_RECHECK_S = 0.05  # how often an unanswered GET is judged again against what completed since


class RequestScheduler:
    """One rank's request stream to one store: see the module docstring.

    Everything here runs on the store's event loop (fsspec's loop thread);
    ``stats`` may be read from any thread.
    """

    def __init__(self, policy: RequestPolicy) -> None:
        self.policy = policy
        self.stats = ObjectStats()
        self._observed = Observed()
        self._slots: Slots | None = None
        self._in_flight = 0
        self._trying = 0  # tries in flight (a request and its hedges are one)
        self._hedges_held = 0  # bytes of the hedges in flight (or waiting for a slot)
        self._expected = 0  # bytes the reads announced so far will request (expect())
        self._sent = 0  # requests sent so far (first tries and retries; not hedges)
        self._answered: deque[int] = deque(maxlen=SAMPLES)  # when each answered one was sent
        self._paused_until = 0.0
        self._pause = 0.0
        self._hooked: set[int] = set()

    # ------------------------------------------------------------ the policy
    def deadline(self, n: int) -> float:
        """Seconds a request of ``n`` bytes gets now."""
        return deadline_for(self.policy, self._observed, n)

    def _hedge_after(self, n: int) -> float:
        """Seconds after which a GET of ``n`` bytes is hedged, by what was observed so far."""
        p = self.policy
        expected = self._observed.expected(n)
        if expected is None:  # nothing observed yet: a hedge costs budget, not correctness
            return max(p.hedge_floor_s, p.first_hedge_s)
        return max(p.hedge_floor_s, p.hedge_factor * expected)

    def part_bytes(self, batch_bytes: int) -> int:
        """The most bytes one GET of a batch of ``batch_bytes`` asks for: half the hedge budget
        once the batch is counted (two hedges of a part fit in flight at once; each gives the
        budget back, less what its loser received, when its race ends), within the policy's
        ``min_part_bytes`` and ``max_part_bytes`` (without hedging: ``max_part_bytes``)."""
        p = self.policy
        if not p.hedge:
            return p.max_part_bytes
        budget = self._hedge_budget(batch_bytes)
        return int(min(p.max_part_bytes, max(p.min_part_bytes, budget // 2)))

    def _hedge_budget(self, more: int = 0) -> float:
        """The bytes hedges may cost: ``hedge_fraction`` of the load's bytes (those requested so
        far and ``more``, or those announced, :meth:`expect`), at least
        ``hedge_allowance_bytes``."""
        p = self.policy
        load = max(self.stats.bytes_requested + more, self._expected)
        return max(p.hedge_fraction * load, p.hedge_allowance_bytes)

    def expect(self, nbytes: int) -> None:
        """A read of ``nbytes`` is under way (a load's planned ranges, fetched in windows): the
        hedge budget is a fraction of them from now, not only of the bytes requested so far. A
        window held back by a slow GET of a load's first windows can then be hedged, as can a
        slow hedge (every byte announced is requested before the read ends)."""
        self._expected += nbytes

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
        make: Make[_T],
        nbytes: int | None,
        *,
        where: str,
        what: str,
        hedge: bool = False,
        check: Callable[[_T], str | None] | None = None,
        observe: bool = True,
        timed: bool = True,
    ) -> _T:
        """Run the request ``make(got)`` makes (about ``nbytes`` bytes; None: unknown, it gets the
        deadline cap and no hedge) under the policy. A GET that can counts the bytes of its answer
        into ``got`` (:class:`Received`) as they arrive: what a hedge that lost cost.

        ``check(result)`` returns why an answer is wrong (a short read), or
        None; a wrong answer is tried again once, then it is the error.
        ``observe=False`` (a HEAD, a LIST, an index PUT): timed against what the reads and parts
        observed, but neither feeds the medians nor counts in ``bytes_requested`` (the hedge
        budget): its time is a round trip, not a throughput. ``timed=False``: an operation made of
        requests scheduled each (a whole streamed upload), tried again as a whole on a transient
        failure, but given no deadline and no slot of its own (its requests take theirs). Failures
        are :class:`StorageError` naming ``where`` (the object's URL) and ``what`` was being done.
        """
        self.stats.bytes_requested += (nbytes or 0) if observe else 0
        delays = self.policy.delays()
        t0 = time.monotonic()
        deadlines: list[float] = []
        wrong = 0
        for k in range(len(delays) + 1):
            if k:
                self.stats.retries += 1
            if nbytes is None:
                t = _Try(self.policy.deadline_cap_s, False)
            else:
                t = _Try(self.deadline(nbytes), hedge and self.policy.hedge, observe)
            try:
                if timed:
                    out, took = await self._try(make, nbytes, t)
                else:
                    out, took = await make(Received()), 0.0
                why = check(out) if check is not None else None
                if why is None:
                    if took > self.stats.slowest_s:
                        self.stats.slowest_s, self.stats.slowest = took, f"{where}: {what}"
                    return out
                wrong += 1
                last: BaseException = TruncatedFileError(f"{where}: {why}: truncated object")
                if wrong > 1:
                    raise last
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
            finally:
                deadlines.append(t.deadline_s)  # as a hedge may have extended it
            if k == len(delays):
                break
            await asyncio.sleep(delays[k])
        if isinstance(last, TruncatedFileError):
            raise last
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

    async def _slot(self, hedge: bool = False) -> None:
        if self._slots is None:  # made on the loop that uses it
            self._slots = Slots(self.policy.max_in_flight)
        await self._slots.acquire(hedge)
        try:  # a pause that began while this request waited for its slot holds it too
            await self._wait_for_pause()
        except BaseException:
            self._slots.release()
            raise
        self._in_flight += 1
        self.stats.most_in_flight = max(self.stats.most_in_flight, self._in_flight)

    def _free(self) -> None:
        assert self._slots is not None
        self._in_flight -= 1
        self._slots.release()

    def _outlier(self, seq: int) -> bool:
        """Whether the request sent ``seq``-th is slow among its peers: requests sent after it
        were answered first (:data:`_LATER_ANSWERED`), or too few are in flight for that to
        happen (a load's last requests, slowed together, have no later peer). When the
        store slows down for every request at once, none is an outlier: a hedge would only add
        to the load (measured: a fault-free load on a busy machine spent its whole budget)."""
        if self._trying <= _LATER_ANSWERED:
            return True
        return sum(1 for k in self._answered if k > seq) >= _LATER_ANSWERED

    def _may_hedge(self, nbytes: int, replaced: Received | None) -> bool:
        """Whether a hedge of ``nbytes`` fits the budget: what hedges cost so far, plus the whole
        size of each hedge in flight (its try has not ended: either answer may still lose). A
        hedge that replaces one in flight (``replaced``: what that one received) takes over its
        share, and adds what that one received."""
        more = nbytes if replaced is None else replaced.cost(nbytes)
        return self.stats.hedge_extra_bytes + self._hedges_held + more <= self._hedge_budget()

    async def _request(self, make: Make[_T], got: Received) -> tuple[_T, float]:
        """``make(got)``'s answer and when it was sent (its slot is held, and freed by the
        caller)."""
        self.stats.requests += 1
        sent = time.monotonic()
        got.sent = True
        return await make(got), sent

    async def _hedged(self, make: Make[_T], nbytes: int, got: Received) -> tuple[_T, float]:
        """A hedge: waits for a slot ahead of new requests, and is counted once it is sent."""
        await self._slot(hedge=True)
        try:
            self.stats.hedges += 1
            self.stats.hedged_bytes += nbytes
            return await self._request(make, got)
        finally:
            self._free()

    async def _try(self, make: Make[_T], nbytes: int | None, t: _Try) -> tuple[_T, float]:
        """One try: the request, and a hedge if it is slow; a hedge that is slow too is replaced
        by a new one (up to ``max_hedges`` sent), so that one hedge at most is in flight beside
        the request. The first complete answer wins. Returns the answer and the seconds it took
        (the winner's own time)."""
        await self._slot()  # waiting for a slot is not the request's time
        self._trying += 1
        start = time.monotonic()
        self._sent += 1
        seq = self._sent
        got = Received()
        first = asyncio.ensure_future(self._request(make, got))
        # Freed when the task ends, even if it is cancelled before it ever ran.
        first.add_done_callback(lambda _: self._free())
        t.tasks.append(first)
        pending: set[asyncio.Future[Any]] = {first}
        hedge: asyncio.Future[Any] | None = None  # the hedge in flight
        hedge_got = Received()
        sent = 0  # hedges sent
        last = start  # when the last request of the try (the GET, or its last hedge) was sent
        won: asyncio.Future[Any] | None = None
        until = start + t.deadline_s
        error: BaseException | None = None
        try:
            while pending:
                now = time.monotonic()
                if now >= until:
                    raise DeadlineExceeded(f"no answer within {t.deadline_s:.2f} s")
                wait = until - now
                # (A hedge still waiting for a slot is not judged: it has not been slow yet.)
                judge = hedge is None or hedge_got.sent
                if sent < self.policy.max_hedges and t.hedge and nbytes is not None and judge:
                    # Judged again at every look: what completed since (its peers of the same
                    # batch, as they come in) tells how long this one should take.
                    due = last + self._hedge_after(nbytes)
                    replaced = None if hedge is None else hedge_got
                    if now >= due and self._outlier(seq) and self._may_hedge(nbytes, replaced):
                        if hedge is None:
                            # Its whole size is held from now until the try ends (below):
                            # another GET judged meanwhile must not spend it too.
                            self._hedges_held += nbytes
                        else:  # a slow hedge is replaced: it costs what it received
                            hedge.cancel()
                            pending.discard(hedge)
                            self.stats.hedge_extra_bytes += hedge_got.cost(nbytes)
                        hedge_got = Received()
                        hedge = asyncio.ensure_future(self._hedged(make, nbytes, hedge_got))
                        sent += 1
                        t.tasks.append(hedge)
                        pending.add(hedge)
                        last = now
                        # The hedge gets a request's deadline from when it is sent, within the
                        # cap from the try's start (a failure stays bounded by the cap).
                        cap = start + self.policy.deadline_cap_s
                        until = max(until, min(now + self.deadline(nbytes), cap))
                        t.deadline_s = until - start
                        due = now + self._hedge_after(nbytes)  # when the next may be sent
                    wait = min(wait, _RECHECK_S if now >= due else min(due - now, _RECHECK_S))
                done, pending = await asyncio.wait(
                    pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task.exception() is None:
                        out, sent_at = task.result()
                        took = time.monotonic() - (start if task is first else sent_at)
                        if nbytes is not None and t.observe:
                            self._observed.add(nbytes, took)
                        self._answered.append(seq)
                        if task is not first:
                            self.stats.hedge_wins += 1
                        won = task
                        return out, took
                    error = error or task.exception()
            assert error is not None
            raise error
        finally:
            self._trying -= 1
            for task in t.tasks:
                task.cancel()  # a cancelled GET counts no more bytes (it never resumes)
            if hedge is not None and nbytes is not None:
                # What the hedge cost: the answer that lost (the hedge, unless it won; when the
                # try failed, the retry pays for the GET and the hedge was the extra).
                self._hedges_held -= nbytes
                self.stats.hedge_extra_bytes += (got if won is hedge else hedge_got).cost(nbytes)


def _is_throttle(text: str) -> bool:
    return any(w in text for w in _THROTTLE_WORDS)
