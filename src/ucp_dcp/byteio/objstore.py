"""A checkpoint directory at an fsspec URL (``s3://bucket/prefix``, ``gs://``, ``az://``,
``memory://``).

:class:`ObjectStore` is the one place the library talks to object storage.
It names objects relative to the checkpoint's URL, and wraps every request
in the same policy:

* **transient errors are retried** (connection resets, timeouts, 5xx,
  throttling: anything but the permanent errors below), with exponential
  backoff and jitter, a bounded number of times (:class:`RetryPolicy`), on
  top of whatever the client library retries by itself;
* **permanent errors fail at once** (no such object or bucket, access
  denied, a bad request): :class:`~ucp_dcp.errors.StorageError` naming the
  URL, the object and what was being done, keeping the errno;
* **reads are ranged** and batched (:meth:`ObjectStore.read_ranges`, which is
  fsspec's ``cat_ranges``: concurrent requests on async stores such as
  s3fs), and a short answer is a :class:`~ucp_dcp.errors.TruncatedFileError`;
* **writes stream** (:meth:`ObjectStore.open_write`: the store's own
  buffered file, a multipart upload on S3), and a write that fails is
  discarded, never completed: an object appears whole or not at all.

Local paths never come here: ``is_url`` tells them apart, and the readers
and writers keep their ``preadv``/``pwrite`` path for them.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from ..errors import StorageError, TruncatedFileError, UCPError
from .multipart import ParallelUpload, StreamedWrite, supports_parallel_upload
from .objrequests import (
    PERMANENT,
    Received,
    RequestScheduler,
    loop_of,
    no_credentials,
    storage_error,
)
from .reqpolicy import ObjectStats, RequestPolicy, RetryPolicy

__all__ = [
    "ObjectStore",
    "ObjectAccess",
    "fetch_heads",
    "RetryPolicy",
    "RequestPolicy",
    "ObjectStats",
    "discard",
    "is_url",
    "local_path",
]

_T = TypeVar("_T")

_LOCAL_PROTOCOLS = ("file", "local")


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names object storage (``proto://...``) rather than a local path.

    ``file://`` URLs are local paths (see :func:`local_path`).
    """
    s = os.fspath(path)
    proto, sep, _ = s.partition("://")
    return bool(sep) and proto.isidentifier() and proto not in _LOCAL_PROTOCOLS


def local_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a local path: a ``file://`` URL loses its scheme, anything else is unchanged."""
    s = os.fspath(path)
    for proto in _LOCAL_PROTOCOLS:
        if s.startswith(proto + "://"):
            return s[len(proto) + 3 :]
    return s


class ObjectStore:
    """The objects under one fsspec URL, with retries and errors that name the URL.

    Args:
        url: the checkpoint directory, e.g. ``s3://bucket/run/step-100``.
        storage_options: passed to fsspec as they are (credentials,
            ``client_kwargs={"endpoint_url": ...}``, ...).
        retry: how transient errors are retried (default: ``requests.attempts`` tries).
        write_block_bytes: the buffer of a streamed write;
        on S3 the size of
            each part of the multipart upload (at least 5 MiB there).
        upload_parallel: on S3, parts of one streamed write uploading at
            once (:class:`~ucp_dcp.byteio.multipart.ParallelUpload`); 1, or
            another store, uploads through fsspec's buffered file, part
            after part.
        requests: deadlines, hedging and the bound on requests in flight
            (:class:`~ucp_dcp.byteio.reqpolicy.RequestPolicy`), applied to
            every request on an async store (s3fs): GETs, part uploads, and
            the HEADs, LISTs, PUTs and DELETEs of the other methods; a
            blocking store (``memory://``) calls fsspec as it is, with
            retries but no deadline.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        write_block_bytes: int = 16 << 20,
        upload_parallel: int = 4,
        requests: RequestPolicy | None = None,
    ) -> None:
        import fsspec  # only object storage needs it

        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.write_block_bytes = write_block_bytes
        self.upload_parallel = upload_parallel
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        except (ImportError, ValueError) as e:  # unknown protocol, or its package is not installed
            raise StorageError(f"{self.url}: cannot open this URL with fsspec: {e}") from None
        self.root = root.rstrip("/")
        self.requests = requests or RequestPolicy()
        self.retry = retry or RetryPolicy(attempts=self.requests.attempts)
        self.scheduler = RequestScheduler(self.requests, self.retry)
        self._loop = loop_of(self.fs)  # None: a blocking store, called as it is

    # ------------------------------------------------------------ names
    def path(self, name: str) -> str:
        """The store's path of object ``name`` (relative to the checkpoint's URL)."""
        return f"{self.root}/{name}" if name else self.root

    def url_of(self, name: str) -> str:
        """The full URL of object ``name``, as shown in messages."""
        return f"{self.url}/{name}" if name else self.url

    def name_of(self, url_or_path: str) -> str:
        """The object name of a full URL or store path under this checkpoint."""
        for prefix in (self.url + "/", self.root + "/"):
            if url_or_path.startswith(prefix):
                return url_or_path[len(prefix) :]
        return url_or_path.rsplit("/", 1)[-1]

    # ------------------------------------------------------------ policy
    def call(self, what: str, name: str, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` (one request about object ``name``), retrying transient errors.

        ``what`` says what was being done, for the message of the error
        raised when the request fails for good.
        """
        delays = self.retry.delays()
        for k in range(len(delays) + 1):
            try:
                return fn()
            except PERMANENT as e:
                if isinstance(e, UCPError):
                    raise
                raise self.error(what, name, e) from e
            except Exception as e:  # the client's connection/HTTP errors: transient
                if k == len(delays) or no_credentials(e):  # a retry finds no credentials either
                    raise self.error(what, name, e, tries=k + 1) from e
                time.sleep(delays[k])
        raise AssertionError("unreachable")

    def error(self, what: str, name: str, e: BaseException, tries: int = 1) -> StorageError:
        """A :class:`StorageError` naming the URL of ``name``, what failed and why."""
        return storage_error(self.url_of(name), what, e, tries)

    @property
    def stats(self) -> ObjectStats:
        """What this store's scheduled requests did (deadlines, hedges, throttling)."""
        return self.scheduler.stats

    def _sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run coroutine function ``fn(*args)`` on the store's event loop; its result."""
        import fsspec.asyn

        return fsspec.asyn.sync(self._loop, fn, *args)

    def _scheduled(
        self, what: str, name: str, make: Callable[[], Coroutine[Any, Any, _T]], nbytes: int | None
    ) -> _T:
        """Run the request ``make()`` makes (about object ``name``, of ``nbytes`` bytes) on the
        store's event loop under the scheduler: deadline, retries, bound on requests in flight.

        ``nbytes``: 0 for a HEAD, LIST or DELETE (the deadline floor, or ``deadline_factor``
        times what small requests took if that is more), a PUT's length, None when unknown (the
        deadline cap). Such a request does not feed the read medians (``observe=False``).
        """

        async def run() -> _T:
            await self._hook()
            return await self.scheduler.run(
                lambda _: make(), nbytes, where=self.url_of(name), what=what, observe=False
            )

        return self._sync(run)

    async def _hook(self) -> None:
        """Let the scheduler see the throttling answers the S3 client retries by itself."""
        if hasattr(self.fs, "set_session"):
            try:
                self.scheduler.hook(await self.fs.set_session())
            except Exception:  # no client yet (credentials...): the request will say why
                pass

    async def _get(self, name: str, start: int | None, end: int | None, part: int) -> bytes:
        """Bytes ``[start, end)`` of ``name`` (all of it by default): one scheduled GET, or for a
        range over ``part`` bytes concurrent GETs of its parts, joined."""
        if start is None or end is None or end - start <= part:
            return await self._get_one(name, start, end)
        return b"".join(
            await _gather(
                [self._get_one(name, s, min(s + part, end)) for s in range(start, end, part)]
            )
        )

    async def _get_one(self, name: str, start: int | None, end: int | None) -> bytes:
        """One scheduled GET of bytes ``[start, end)`` of ``name`` (all of it by default)."""
        path = self.path(name)
        ranged = start is not None and end is not None
        n = end - start if start is not None and end is not None else None

        def check(data: bytes) -> str | None:
            if n is None or len(data) == n:
                return None
            return f"needed bytes [{start}, {end}) but got {len(data)}"

        return await self.scheduler.run(
            lambda got: _cat_counted(self.fs, path, start, end, got),
            n,
            where=self.url_of(name),
            what=f"reading bytes [{start}, {end})" if start is not None else "reading the object",
            hedge=ranged,
            check=check,
        )

    async def _get_all(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Scheduled GETs of every range; the first failure cancels the others and is raised."""
        await self._hook()
        part = self.scheduler.part_bytes(sum(e - s for _, s, e in ranges if s is not None))
        return await _gather([self._get(n, s, e, part) for n, s, e in ranges])

    # ------------------------------------------------------------ reads
    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists (listing caches are bypassed: other processes write)."""
        path = self.path(name)
        what = "checking for the object"
        if self._loop is not None:

            async def ask_async() -> bool:
                self.fs.invalidate_cache(path)  # each try asks the store, never a cache
                return bool(await self.fs._exists(path))

            return self._scheduled(what, name, ask_async, 0)

        def ask() -> bool:
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

        return self.call(what, name, ask)

    def size(self, name: str) -> int:
        """Size of object ``name`` in bytes; a missing one is a :class:`StorageError` (ENOENT)."""
        path = self.path(name)
        what = "reading the object's size"
        if self._loop is not None:
            return int(self._scheduled(what, name, lambda: self.fs._info(path), 0)["size"])
        return int(self.call(what, name, lambda: self.fs.info(path)["size"]))

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``name`` (the whole object by default), checked for
        length."""
        if self._loop is not None:
            return bytes(self._sync(self._get_all, [(name, start, end)])[0])
        path = self.path(name)
        data = self.call(
            f"reading bytes [{start}, {end})" if start is not None else "reading the object",
            name,
            lambda: self.fs.cat_file(path, start=start, end=end),
        )
        if start is not None and end is not None and len(data) != end - start:
            raise TruncatedFileError(
                f"{self.url_of(name)}: needed bytes [{start}, {end}) but got {len(data)}: "
                "truncated object"
            )
        return bytes(data)

    def read_if_exists(self, name: str) -> bytes | None:
        """The whole of object ``name``, or None when there is no such object (one request either
        way). On an async store its size is unknown: it gets the deadline cap, like any whole-object
        read."""
        path = self.path(name)
        if self._loop is not None:

            async def cat_async() -> bytes | None:
                try:
                    return bytes(await self.fs._cat_file(path))
                except FileNotFoundError:  # an answer, not a failure (PERMANENT in the scheduler)
                    return None

            return self._scheduled("reading the object", name, cat_async, None)

        def cat() -> bytes | None:
            try:
                return bytes(self.fs.cat_file(path))
            except FileNotFoundError:
                return None

        return self.call("reading the object", name, cat)

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of each ``(name, start, end)``, fetched concurrently where the
        store can.

        On an async store (s3fs) each request is scheduled under the store's
        :class:`~ucp_dcp.byteio.reqpolicy.RequestPolicy` (deadline, hedge,
        bounded in flight); elsewhere one batch of fsspec's ``cat_ranges``.
        Requests that fail are retried on their own under the same policy as
        :meth:`call`.
        """
        if not ranges:
            return []
        if self._loop is not None:
            return list(self._sync(self._get_all, ranges))
        paths = [self.path(n) for n, _, _ in ranges]
        starts = [s for _, s, _ in ranges]
        ends = [e for _, _, e in ranges]
        try:
            got: list[Any] = list(self.fs.cat_ranges(paths, starts, ends, on_error="return"))
        except Exception as e:  # a store whose cat_ranges raises instead of returning errors
            got = [e] * len(ranges)
        out: list[bytes] = []
        for (name, s, end), data in zip(ranges, got):
            if isinstance(data, BaseException) or len(data) != end - s:
                data = self.read(name, s, end)  # retried, or raises naming the object
            out.append(data)
        return out

    def list(self) -> list[str]:
        """Names of the objects directly under the checkpoint's URL (none if it does not exist)."""
        return list(self.list_sizes())

    def list_sizes(self) -> dict[str, int]:
        """Name -> size of the objects directly under the checkpoint's URL, from one listing."""
        self.fs.invalidate_cache(self.root)

        def sizes(entries: Any) -> dict[str, int]:
            return {
                self.name_of(e["name"]): int(e.get("size") or 0)
                for e in entries
                if e.get("type", "file") != "directory"
            }

        what = "listing the checkpoint"
        if self._loop is not None:

            async def ls_async() -> dict[str, int]:
                self.fs.invalidate_cache(self.root)  # a retry must not answer from a cache
                try:
                    return sizes(await self.fs._ls(self.root, detail=True))
                except FileNotFoundError:
                    return {}

            return self._scheduled(what, "", ls_async, 0)

        def ls() -> dict[str, int]:
            try:
                return sizes(self.fs.ls(self.root, detail=True))
            except FileNotFoundError:
                return {}

        return self.call(what, "", ls)

    # ------------------------------------------------------------ writes
    def put(self, name: str, data: bytes) -> None:
        """Write object ``name`` in one request: it appears whole, replacing any older one, or not
        at all."""
        path = self.path(name)
        what = "writing the object"
        if self._loop is not None:  # a deadline from its size, like a part upload's
            self._scheduled(what, name, lambda: self.fs._pipe_file(path, data), len(data))
            return
        self.call(what, name, lambda: self.fs.pipe_file(path, data))

    def open_write(self, name: str) -> StreamedWrite:
        """A streamed write of object ``name``: call :func:`discard` on failure, ``close()`` to
        complete it.

        On S3, up to ``upload_parallel`` parts of ``write_block_bytes`` upload
        at once; elsewhere the store's buffered file uploads a part each time
        its buffer fills. Either way the object appears only when ``close()``
        completes the upload.
        """
        path = self.path(name)
        if self.upload_parallel > 1 and supports_parallel_upload(self.fs):
            self._sync(self._hook)
            return ParallelUpload(
                self.fs,
                path,
                part_bytes=self.write_block_bytes,
                parallel=self.upload_parallel,
                scheduler=self.scheduler,
                where=self.url_of(name),
            )
        return self.call(
            "starting the upload",
            name,
            lambda: self.fs.open(path, "wb", block_size=self.write_block_bytes),
        )

    def remove(self, names: Sequence[str]) -> None:
        """Delete objects ``names`` (missing ones are not an error)."""
        for name in names:
            path = self.path(name)
            if self._loop is not None:

                async def rm_async(path: str = path) -> None:
                    try:
                        await self.fs._rm_file(path)
                    except FileNotFoundError:
                        pass

                self._scheduled("deleting the object", name, rm_async, 0)
                continue

            def rm(path: str = path) -> None:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass

            self.call("deleting the object", name, rm)


async def _gather(coros: Sequence[Coroutine[Any, Any, bytes]]) -> list[bytes]:
    """The results of ``coros``, run concurrently; the first failure cancels the others and is
    raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()


_CHUNK = 1 << 20  # the most bytes one read of a GET's body takes (it returns what has arrived)


async def _cat_counted(
    fs: Any, path: str, start: int | None, end: int | None, got: Received
) -> bytes:
    """Bytes ``[start, end)`` of ``path``: on S3 one ranged GET whose body is read as it arrives,
    counted into ``got`` (a hedge that loses costs what its answer delivered before it was
    cancelled, not its size); elsewhere, and for a whole object, fsspec's ``_cat_file``."""
    if not hasattr(fs, "_call_s3") or start is None or end is None or end <= start:
        return bytes(await fs._cat_file(path, start=start, end=end))
    bucket, key, version = fs.split_path(path)
    got.counted = True  # from now on: an answer cancelled before its headers came cost nothing
    resp = await fs._call_s3(  # s3fs's call: its session, and its errors as OSErrors
        "get_object",
        Bucket=bucket,
        Key=key,
        Range=f"bytes={start}-{end - 1}",
        **({"VersionId": version} if version else {}),
    )
    body = resp["Body"]
    parts = []
    try:
        while chunk := await body.read(_CHUNK):
            got.bytes += len(chunk)
            parts.append(chunk)
    finally:
        body.close()
    return b"".join(parts)


def discard(f: Any) -> None:
    """Abandon streamed write ``f`` without completing it (aborts a multipart upload); never
    raises."""
    try:
        if hasattr(f, "discard"):
            f.discard()
        # A buffered file left open would complete its upload when garbage-collected.
        f.closed = True
    except Exception:
        pass


_HEAD_BYTES = 64 << 10


class ObjectAccess:
    """One object as :class:`~ucp_dcp.format.header.RandomAccess`: header parsing reads it through
    this.

    The first read that starts within the first ``head_bytes`` fetches at least that prefix (64
    KiB by default), which holds a data file's header in one request (it is read as its length,
    then its body). A later read that starts inside the prefix held, or right after it, extends
    the prefix in one request, to its end plus ``head_bytes`` more: what usually follows a
    header (a native data file's block checksums) comes with it. Any other read is one request
    of its own. ``size``, when the caller knows it (an index records every data file's size),
    saves the request that would ask the store; an object shorter than that fails its first read
    that reaches past its end (:class:`~ucp_dcp.errors.TruncatedFileError`, naming it).
    """

    def __init__(
        self,
        store: ObjectStore,
        name: str,
        size: int | None = None,
        *,
        head_bytes: int = _HEAD_BYTES,
    ) -> None:
        self.store = store
        self.name = name
        self.size = store.size(name) if size is None else size
        self.head_bytes = max(head_bytes, 1)
        self._head = b""

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the object)."""
        end = min(offset + n, self.size)
        if offset >= end:
            return b""
        held = len(self._head)
        if end > held and offset <= max(held, self.head_bytes - 1):
            # One request extends the prefix held (the first fetches it) past this read.
            want = min(self.size, max(end + (self.head_bytes if held else 0), self.head_bytes))
            self._head += self.store.read(self.name, held, want)
        if end <= len(self._head):
            return self._head[offset:end]
        return self.store.read(self.name, offset, end)

    def first_request(self) -> tuple[str, int, int]:
        """``(name, start, end)`` of the first request (the prefix, or the whole of a shorter
        object)."""
        return self.name, 0, min(self.size, self.head_bytes)

    def hold_head(self, data: bytes) -> None:
        """Take the first request's bytes, fetched by someone else (no request is made)."""
        self._head = data

    @property
    def head(self) -> bytes:
        """The prefix held (from byte 0; empty before the first read and after :meth:`release`)."""
        return self._head

    def release(self) -> None:
        """Forget the prefix held (the bytes parsed from it are no longer read)."""
        self._head = b""


def fetch_heads(objects: Sequence[ObjectAccess]) -> None:
    """Fetch the prefix of every object of ``objects`` (of one store) not held yet, in one batch
    of concurrent requests (:meth:`ObjectStore.read_ranges`): a source reads the headers of every
    object a load reads at once, not one round trip after another."""
    todo = [o for o in objects if not o.head and o.size]
    if todo:
        for o, data in zip(todo, todo[0].store.read_ranges([o.first_request() for o in todo])):
            o.hold_head(data)
