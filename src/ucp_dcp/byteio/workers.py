"""The I/O threads of a local load, and the deadline of every read they are in.

A ``preadv`` blocked in the kernel cannot be cancelled, so the thread that waits for the reads
keeps time: each read gets a deadline (:func:`~ucp_dcp.byteio.requests.deadline_for` times the
policy's ``attempts``: a local read is not tried again), and a read past it fails the load with a
:class:`~ucp_dcp.errors.StorageError` while its blocked thread is left behind. Hence daemon threads
of our own, not a ``ThreadPoolExecutor``: its threads are joined at exit and by ``shutdown``
(which would hang the process on the blocked read), and it has no notion of which read a thread is
in. The threads stop after :data:`IDLE_S` without a task, so a reader kept open between loads
holds no idle thread. See docs/object-storage.md ("Local reads and writes").
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from ..errors import StorageError
from .requests import (
    DeadlineExceeded,
    Observed,
    RequestPolicy,
    current_rank,
    deadline_for,
    storage_error,
)

__all__ = ["IOWorkers", "Abandoned", "IDLE_S"]

IDLE_S = 1.0
"""Seconds an I/O thread waits for a task before it stops (a load's reads come much closer
together; a thread costs ~0.1 ms to start again)."""


class Abandoned(Exception):
    """Raised in an I/O thread whose load already failed at a deadline: it reads nothing more."""


@dataclass
class _Read:
    """The read one I/O thread is in: where, since when, and its deadline (set by the waiting
    thread when it first looks: the I/O thread's own time goes to reading)."""

    path: str
    offset: int
    nbytes: int
    start: float
    deadline_s: float | None = None


class IOWorkers:
    """``threads`` daemon threads running one reader's tasks (:meth:`submit`), and the deadline
    of each read they make (:meth:`begin`/:meth:`end`), kept by the thread that waits for them
    (:meth:`wait`)."""

    def __init__(self, threads: int, policy: RequestPolicy) -> None:
        self.policy = policy
        self.observed = Observed()
        self.failed: StorageError | None = None
        """The deadline error of this reader's load, once one of its reads was left behind."""
        self._size = max(threads, 1)
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[Any], Any], Any] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # the thread list, and a thread's decision to stop
        self._started = 0  # threads ever started (their names)
        self._reads: dict[int, _Read] = {}  # per thread ident: the read it is in

    # ------------------------------------------------------------ tasks
    def submit(self, fn: Callable[[Any], Any], arg: Any) -> Future[Any]:
        """Run ``fn(arg)`` on an I/O thread; its future."""
        fut: Future[Any] = Future()
        with self._lock:  # a thread stopping for idleness decides under it: none misses this
            self._queue.put((fut, fn, arg))
            while len(self._threads) < self._size:
                t = threading.Thread(
                    target=self._work, name=f"ucp-read_{self._started}", daemon=True
                )
                self._started += 1
                self._threads.append(t)
                t.start()
        return fut

    def _work(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():  # idle: stop (submit starts another)
                        me = threading.current_thread()
                        if me in self._threads:
                            self._threads.remove(me)
                        return
                continue
            if item is None:
                return
            fut, fn, arg = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(arg))
            except BaseException as e:
                fut.set_exception(e)

    def close(self) -> None:
        """Stop the threads; wait for them unless a read was left behind (its thread may never
        return)."""
        with self._lock:
            threads, self._threads = self._threads, []
            for _ in threads:
                self._queue.put(None)
        if self.failed is None:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()

    # ------------------------------------------------------------ deadlines
    def check(self) -> None:
        """Raise :class:`Abandoned` once the load failed at a deadline (an I/O thread then
        stops)."""
        if self.failed is not None:
            raise Abandoned(str(self.failed))

    def begin(self, path: str, offset: int, nbytes: int) -> None:
        """The calling I/O thread starts reading ``nbytes`` at ``offset`` of ``path``; raises
        :class:`Abandoned` once the load failed."""
        self.check()
        self._reads[threading.get_ident()] = _Read(path, offset, nbytes, time.monotonic())

    def end(self, ok: bool = True) -> float:
        """The calling I/O thread's read returned (``ok``: completely); the seconds it took."""
        r = self._reads.pop(threading.get_ident())
        took = time.monotonic() - r.start
        if ok and self.policy.local_deadlines:
            self.observed.add(r.nbytes, took)
        return took

    def blocked(self) -> list[str]:
        """The files of the reads the I/O threads are in now (after a failure: those left
        behind)."""
        return [r.path for r in list(self._reads.values())]

    def wait(self, futures: Iterable[Future[Any]], error: BaseException | None = None) -> None:
        """Wait for every future; raise ``error`` or the first error among them, or at once the
        :class:`StorageError` of a read past its deadline (its thread is left behind; only
        with the policy's ``local_deadlines``)."""
        if self.failed is not None:
            raise self.failed
        pending = set(futures)
        timed = self.policy.local_deadlines
        while pending:
            if len(pending) == 1:  # the common case, without wait()'s waiter on each future
                (fut,) = pending
                try:
                    fut.exception(self._tick())
                    done, pending = pending, set()
                except FuturesTimeout:
                    done = set()
            else:
                done, pending = wait_futures(pending, self._tick(), FIRST_COMPLETED)
            for fut in done:
                e = fut.exception()
                if e is not None and error is None:
                    error = e
            late = self._late() if timed else None
            if late is not None:
                self.failed = late
                raise late
        if error is not None:
            raise error

    def _tick(self) -> float | None:
        """How long the waiting thread may sleep before a read it waits for could be late."""
        if not self.policy.local_deadlines:
            return None
        now = time.monotonic()
        lefts = [r.start + self._deadline(r) - now for r in list(self._reads.values())]
        return max(min(lefts, default=self.policy.deadline_floor_s), 0.0) + 1e-3

    def _deadline(self, r: _Read) -> float:
        # A local read cannot be tried again, so it gets the time all of an object-store
        # request's tries would: a slow but working file system (a first uncached read after
        # cached ones set a fast median) must not fail the load where a retry would have saved
        # an object-store request.
        if r.deadline_s is None:
            r.deadline_s = self.policy.attempts * deadline_for(self.policy, self.observed, r.nbytes)
        return r.deadline_s

    def _late(self) -> StorageError | None:
        now = time.monotonic()
        for r in list(self._reads.values()):
            waited = now - r.start
            deadline = self._deadline(r)
            if waited > deadline:
                why = DeadlineExceeded(
                    f"rank {current_rank()}'s read did not return within its deadline "
                    f"({deadline:.2f} s for {r.nbytes} bytes) and waited {waited:.2f} s; a "
                    f"blocked local read cannot be cancelled: its I/O thread is left behind"
                )
                where = f"reading bytes [{r.offset}, {r.offset + r.nbytes})"
                return storage_error(r.path, where, why)
        return None
