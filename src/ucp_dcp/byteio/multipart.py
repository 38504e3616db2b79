"""A streamed S3 upload with several parts in flight: what one rank's data file goes up as.

fsspec's buffered S3 file uploads a part each time its buffer fills and
waits for it before taking more data, so one rank gets one connection's
bandwidth. :class:`ParallelUpload` is a write-only file with the same
contract (``write``, ``close`` completes, ``discard`` aborts) that keeps
up to ``parallel`` parts of ``part_bytes`` uploading at once on s3fs's
event loop, holding at most ``parallel`` parts in memory. An object
smaller than one part goes up in one PUT.

The multipart upload is completed only by :meth:`ParallelUpload.close`
after every part succeeded; a failed part (after s3fs's and botocore's own
retries) aborts it, so the object appears whole or not at all.

Given the store's :class:`~ucp_dcp.byteio.scheduler.RequestScheduler`,
each part upload has a deadline from its size and the throughput seen so
far, is tried again past it, counts against the rank's requests in flight,
and waits out a throttling pause; a part that fails for good is a
:class:`~ucp_dcp.errors.StorageError` naming the object, the part, its byte
range and the rank. The upload's other requests (create, complete, abort,
the one PUT of a small object) get the same deadlines and retries, sized as
a round trip (or the PUT's length). A create abandoned at its deadline may
still start an upload at the server that nothing completes or aborts: a
bucket lifecycle rule for incomplete multipart uploads cleans those up.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .scheduler import RequestScheduler

__all__ = ["ParallelUpload", "StreamedWrite", "protocols", "supports_parallel_upload"]

_MIN_PART = 5 << 20  # S3's least part size (but the last)


def protocols(fs: Any) -> set[str]:
    """The protocols fsspec filesystem ``fs`` answers to."""
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


def supports_parallel_upload(fs: Any) -> bool:
    """Whether ``fs`` is s3fs (an async filesystem with S3's multipart calls)."""
    return bool(protocols(fs) & {"s3", "s3a"}) and hasattr(fs, "_call_s3") and hasattr(fs, "loop")


class StreamedWrite(Protocol):
    """An object being uploaded (:meth:`~ucp_dcp.byteio.objstore.ObjectStore.open_write`): written
    front to back; ``close()`` completes it, :func:`~ucp_dcp.byteio.objstore.discard` abandons
    it."""

    def write(self, data: Any) -> int:
        """Append ``data`` (bytes-like); returns its length."""
        ...

    def close(self) -> None:
        """Complete the upload: the object appears whole."""
        ...


class ParallelUpload(StreamedWrite):
    """A write-only file uploading object ``path`` of s3fs filesystem ``fs`` in parallel parts.

    Args:
        fs: an ``s3fs.S3FileSystem``.
        path: the object's path (``bucket/key``).
        part_bytes: size of every part but the last (at least 5 MiB).
        parallel: parts uploading at once (and held in memory).
        scheduler: deadlines, retries and the bound on requests for each part.
        where: the object's URL, for messages.
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        part_bytes: int = 16 << 20,
        parallel: int = 4,
        scheduler: RequestScheduler,
        where: str = "",
    ) -> None:
        self.scheduler = scheduler
        self.where = where or path
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_bytes = max(part_bytes, _MIN_PART)
        self.parallel = max(parallel, 1)
        self.closed = False
        self._pending: list[memoryview] = []  # written, not yet cut into a part
        self._pending_bytes = 0
        self._upload_id: str | None = None
        self._inflight: deque[Future[dict[str, Any]]] = deque()
        self._etags: list[dict[str, Any]] = []
        self._next_part = 1
        self._offset = 0  # where the next part starts in the object

    # ------------------------------------------------------------ the file
    def write(self, data: Any) -> int:
        """Queue ``data`` (bytes-like; kept by reference until its part is cut: do not change
        it)."""
        view = memoryview(data).cast("B")
        if view:
            self._pending.append(view)
            self._pending_bytes += len(view)
        while self._pending_bytes >= self.part_bytes:
            self._send(self._cut(self.part_bytes))
        return len(view)

    def close(self) -> None:
        """Upload what is left and complete the upload: the object appears, whole."""
        if self.closed:
            return
        if self._upload_id is None:
            # Smaller than one part: one PUT, atomic like any other.
            body = self._cut(self._pending_bytes)
            self._s3(
                "put_object",
                len(body),
                "uploading the object",
                Bucket=self.bucket,
                Key=self.key,
                Body=body,
            )
        else:
            if self._pending_bytes:
                self._send(self._cut(self._pending_bytes))
            while self._inflight:
                self._collect()
            parts = sorted(self._etags, key=lambda p: p["PartNumber"])
            self._s3(
                "complete_multipart_upload",
                None,  # S3 may take long to join many parts: the cap, not a round trip's floor
                "completing the upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        self.closed = True
        self.fs.invalidate_cache(self.path)

    def discard(self) -> None:
        """Abandon the upload: wait for parts in flight, then abort it (its parts are deleted)."""
        if self.closed:
            return
        self.closed = True
        for fut in self._inflight:
            try:
                fut.result()
            except Exception:
                pass
        self._inflight.clear()
        if self._upload_id is not None:
            self._s3(
                "abort_multipart_upload",
                0,
                "aborting the upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self._upload_id,
            )

    # ------------------------------------------------------------ parts
    def _cut(self, n: int) -> bytes:
        """The first ``n`` pending bytes, joined (the one copy a part costs)."""
        out, need = [], n
        while need:
            v = self._pending[0]
            if len(v) <= need:
                out.append(v)
                self._pending.pop(0)
                need -= len(v)
            else:
                out.append(v[:need])
                self._pending[0] = v[need:]
                need = 0
        self._pending_bytes -= n
        return b"".join(out)

    def _send(self, body: bytes) -> None:
        if self._upload_id is None:
            mpu = self._s3(
                "create_multipart_upload",
                0,
                "starting the upload",
                Bucket=self.bucket,
                Key=self.key,
            )
            self._upload_id = mpu["UploadId"]
        while len(self._inflight) >= self.parallel:
            self._collect()  # bounded memory: wait for the oldest part
        number = self._next_part
        self._next_part += 1
        start, self._offset = self._offset, self._offset + len(body)

        def part(_: Any) -> Any:
            return self.fs._call_s3(
                "upload_part",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
            )

        coro = self.scheduler.run(
            part,
            len(body),
            where=self.where,
            what=f"uploading part {number} (bytes [{start}, {self._offset}))",
        )
        fut = asyncio.run_coroutine_threadsafe(_tagged(coro, number), self.fs.loop)
        self._inflight.append(fut)

    def _collect(self) -> None:
        self._etags.append(self._inflight.popleft().result())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop).result()

    def _s3(self, method: str, nbytes: int | None, what: str, **kwargs: Any) -> Any:
        """S3 call ``method`` (of ``nbytes`` bytes: 0 for a create or abort, None (the deadline
        cap) for a complete), under the scheduler's deadline and retries; its answer. A small
        object's one PUT feeds the medians like a part; the other calls are not transfers and do
        not."""

        def make(_: Any = None) -> Any:
            return self.fs._call_s3(method, **kwargs)

        return self._run(
            self.scheduler.run(make, nbytes, where=self.where, what=what, observe=bool(nbytes))
        )


async def _tagged(coro: Any, number: int) -> dict[str, Any]:
    """The part record ``complete_multipart_upload`` needs, once part ``number`` is up."""
    out = await coro
    return {"PartNumber": number, "ETag": out["ETag"]}
