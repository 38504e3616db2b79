"""The request slots of one rank's object-store requests: at most ``n`` in flight, hedges first.

Not :class:`asyncio.Semaphore`: its waiters are served in arrival order, so a
hedge, decided on while a window of new requests waits for slots, would start
only after all of them (:mod:`ucp_dcp.byteio.objrequests`).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Slots"]


class Slots:
    """At most ``n`` requests in flight; a waiting hedge is served before waiting requests.

    A hedge that queued behind a window of new requests would start only after them, too late
    to help: a slow request holds its window back, the hedge is what lets it go.
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
