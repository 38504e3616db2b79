"""A checkpoint directory at an fsspec URL (``s3://bucket/prefix``, ``gs://``, ``az://``,
``memory://``), and the ways its objects are read and written.

:class:`ObjectStore` is the one place the library talks to object storage: it names objects
relative to the checkpoint's URL and runs every request, each operation written once, through its
:class:`~ucp_dcp.byteio.scheduler.RequestScheduler` on the store's event loop (a blocking store
such as ``memory://`` wrapped by fsspec's ``AsyncFileSystemWrapper``), under the
:class:`~ucp_dcp.byteio.requests.RequestPolicy`: transient errors retried, permanent ones a
:class:`~ucp_dcp.errors.StorageError` at once, reads ranged and batched (a short answer is a
:class:`~ucp_dcp.errors.TruncatedFileError`), writes streamed (:class:`ParallelUpload` on S3) and
appearing whole or not at all. See docs/object-storage.md ("How a save works", "Errors and
retries").

Local paths never come here (:func:`is_url` tells them apart); reading byte ranges of objects into
place is :mod:`ucp_dcp.byteio.objrange`'s.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from ..errors import StorageError
from .requests import ObjectStats, RequestPolicy
from .scheduler import Received, RequestScheduler

__all__ = [
    "ObjectStore",
    "ParallelUpload",
    "StreamedWrite",
    "protocols",
    "supports_parallel_upload",
    "DOWNLOAD_BYTES",
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
    """The objects under one fsspec URL, every request under one policy, errors naming the URL.

    Args:
        url: the checkpoint directory, e.g. ``s3://bucket/run/step-100``.
        storage_options: passed to fsspec as they are (credentials,
            ``client_kwargs={"endpoint_url": ...}``, ...).
        write_block_bytes: the buffer of a streamed write; on S3 the size of
            each part of the multipart upload (at least 5 MiB there).
        upload_parallel: on S3, parts of one streamed write uploading at
            once (:class:`ParallelUpload`); 1, or
            another store, uploads through fsspec's buffered file, part
            after part.
        requests: deadlines, retries, hedging and the bound on requests in
            flight (:class:`~ucp_dcp.byteio.requests.RequestPolicy`), applied
            to every request: GETs, part uploads, and the HEADs, LISTs, PUTs
            and DELETEs of the other methods.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
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
        self.scheduler = RequestScheduler(self.requests)
        self._afs = self.fs  # the async view every request goes through
        if not (getattr(self.fs, "async_impl", False) and hasattr(self.fs, "_cat_file")):
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            self._afs = AsyncFileSystemWrapper(self.fs, asynchronous=False)
        self._loop = self._afs.loop

    # ------------------------------------------------------------ names
    def path(self, name: str) -> str:
        """The store's path of object ``name`` (relative to the checkpoint's URL)."""
        return f"{self.root}/{name}" if name else self.root

    def url_of(self, name: str) -> str:
        """The full URL of object ``name``, as shown in messages."""
        return f"{self.url}/{name}" if name else self.url

    def child(self, name: str) -> ObjectStore:
        """The objects under folder ``name`` as a store of that URL, sharing this store's file
        system, options and :class:`~ucp_dcp.byteio.scheduler.RequestScheduler`: every request of
        the rank under one bound on requests in flight, counted in one :attr:`stats`."""
        sub = copy.copy(self)  # the same file system, event loop and scheduler
        sub.url, sub.root = self.url_of(name), self.path(name)
        return sub

    def name_of(self, url_or_path: str) -> str:
        """The object name of a full URL or store path under this checkpoint."""
        for prefix in (self.url + "/", self.root + "/"):
            if url_or_path.startswith(prefix):
                return url_or_path[len(prefix) :]
        return url_or_path.rsplit("/", 1)[-1]

    # ------------------------------------------------------------ policy
    def call(self, what: str, name: str, fn: Callable[[], _T]) -> _T:
        """Run ``fn``, an operation about object ``name`` made of requests that are scheduled
        each (a whole streamed upload), tried again as a whole on a transient error.

        ``what`` says what was being done, for the message of the error
        raised when the operation fails for good. ``fn`` runs on a thread of
        its own (:func:`_in_own_thread`), under no deadline of its own: its
        requests have theirs.
        """
        return self._run(what, name, lambda: _in_own_thread(fn), None, timed=False)

    @property
    def stats(self) -> ObjectStats:
        """What this store's requests did (deadlines, hedges, throttling)."""
        return self.scheduler.stats

    def _sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run coroutine function ``fn(*args)`` on the store's event loop; its result."""
        import fsspec.asyn

        return fsspec.asyn.sync(self._loop, fn, *args)

    def _run(
        self,
        what: str,
        name: str,
        make: Callable[[], Coroutine[Any, Any, _T]],
        nbytes: int | None,
        timed: bool = True,
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
                lambda _: make(),
                nbytes,
                where=self.url_of(name),
                what=what,
                observe=False,
                timed=timed,
            )

        return self._sync(run)

    async def _hook(self) -> None:
        """Let the scheduler see the throttling answers the S3 client retries by itself."""
        if hasattr(self._afs, "set_session"):
            try:
                self.scheduler.hook(await self._afs.set_session())
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
        n = end - start if start is not None and end is not None else None

        def check(data: bytes) -> str | None:
            if n is None or len(data) == n:
                return None
            return f"needed bytes [{start}, {end}) but got {len(data)}"

        return await self.scheduler.run(
            lambda got: _cat_counted(self._afs, path, start, end, got),
            n,
            where=self.url_of(name),
            what=f"reading bytes [{start}, {end})" if start is not None else "reading the object",
            hedge=n is not None,  # a ranged GET
            check=check,
        )

    async def _get_all(self, ranges: Sequence[tuple[str, int | None, int | None]]) -> list[bytes]:
        """Scheduled GETs of every range; the first failure cancels the others and is raised."""
        await self._hook()
        part = self.scheduler.part_bytes(
            sum(e - s for _, s, e in ranges if s is not None and e is not None)
        )
        return await _gather([self._get(n, s, e, part) for n, s, e in ranges])

    # ------------------------------------------------------------ reads
    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists (listing caches are bypassed: other processes write)."""
        path = self.path(name)

        async def ask() -> bool:
            self.fs.invalidate_cache(path)  # each try asks the store, never a cache
            return bool(await self._afs._exists(path))

        return self._run("checking for the object", name, ask, 0)

    def size(self, name: str) -> int:
        """Size of object ``name`` in bytes; a missing one is a :class:`StorageError` (ENOENT)."""
        path = self.path(name)
        info = self._run("reading the object's size", name, lambda: self._afs._info(path), 0)
        return int(info["size"])

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``name`` (the whole object by default), checked for
        length."""
        return bytes(self._sync(self._get_all, [(name, start, end)])[0])

    def read_if_exists(self, name: str) -> bytes | None:
        """The whole of object ``name``, or None when there is no such object (one request either
        way). Its size is unknown: it gets the deadline cap, like any whole-object read."""
        path = self.path(name)

        async def cat() -> bytes | None:
            try:
                return bytes(await self._afs._cat_file(path))
            except FileNotFoundError:  # an answer, not a failure (PERMANENT in the scheduler)
                return None

        return self._run("reading the object", name, cat, None)

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of each ``(name, start, end)``, fetched concurrently.

        Each request is scheduled under the store's
        :class:`~ucp_dcp.byteio.requests.RequestPolicy` (deadline, hedge, retries, bounded in
        flight); a long range goes as parts. Why not fsspec's ``cat_ranges``: it gathers a batch
        with no deadline, no hedge and no bound shared across batches.
        """
        if not ranges:
            return []
        return list(self._sync(self._get_all, ranges))

    def list_sizes(self) -> dict[str, int]:
        """Name -> size of the objects directly under the checkpoint's URL, from one listing (none
        if it does not exist)."""
        return self._list()[0]

    def list_folders(self) -> list[str]:
        """Names of the folders (prefixes) directly under the checkpoint's URL, from one
        listing."""
        return self._list()[1]

    def _list(self) -> tuple[dict[str, int], list[str]]:
        """One listing of the checkpoint's URL: its objects' sizes by name, and its folders."""
        path = self.root

        async def ls() -> tuple[dict[str, int], list[str]]:
            self.fs.invalidate_cache(path)  # a retry must not answer from a cache
            try:
                entries = await self._afs._ls(path, detail=True)
            except FileNotFoundError:
                return {}, []
            files, folders = {}, []
            for e in entries:
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if e.get("type", "file") == "directory":
                    folders.append(name)
                else:
                    files[name] = int(e.get("size") or 0)
            return files, folders

        return self._run("listing the checkpoint", "", ls, 0)

    def download(self, name: str, dst: str, size: int | None = None) -> None:
        """Object ``name`` into local file ``dst`` (created or truncated), in ranged GETs of at most
        :data:`DOWNLOAD_BYTES` each (each sent as concurrent parts); ``size``, when the caller
        knows it, saves the request that asks the store."""
        size = self.size(name) if size is None else size
        with open(dst, "wb") as f:
            for start in range(0, size, DOWNLOAD_BYTES):
                f.write(self.read(name, start, min(start + DOWNLOAD_BYTES, size)))

    # ------------------------------------------------------------ writes
    def put(self, name: str, data: bytes) -> None:
        """Write object ``name`` in one request: it appears whole, replacing any older one, or not
        at all. Its deadline comes from its size, like a part upload's."""
        path = self.path(name)
        self._run("writing the object", name, lambda: self._afs._pipe_file(path, data), len(data))

    def open_write(self, name: str) -> StreamedWrite:
        """A streamed write of object ``name``: call :func:`discard` on failure, ``close()`` to
        complete it.

        On S3, up to ``upload_parallel`` parts of ``write_block_bytes`` upload
        at once, each a scheduled request; elsewhere the store's buffered file
        uploads a part each time its buffer fills. Either way the object
        appears only when ``close()`` completes the upload.
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

    def write_stream(self, name: str, what: str, fill: Callable[[StreamedWrite], _T]) -> _T:
        """Object ``name`` written by ``fill(out)`` through a streamed write (:meth:`open_write`),
        which is completed when ``fill`` returns and aborted when it raises: the object appears
        whole or not at all. A transient failure restarts it from its first byte (``what`` names
        it in the error). Returns what ``fill`` returned."""

        def go() -> _T:
            out = self.open_write(name)
            try:
                result = fill(out)
                out.close()  # completes the upload: the object appears whole
                return result
            except BaseException:
                discard(out)  # an upload that failed is aborted, never completed
                raise

        return self.call(what, name, go)

    def upload(self, name: str, src: str) -> None:
        """Local file ``src`` as object ``name`` (:meth:`write_stream`)."""

        def fill(out: StreamedWrite) -> None:
            with open(src, "rb") as f:
                while chunk := f.read(self.write_block_bytes):
                    out.write(chunk)

        self.write_stream(name, "uploading the object", fill)

    def remove(self, names: Sequence[str]) -> None:
        """Delete objects ``names`` (missing ones are not an error), one request each."""
        for name in names:
            path = self.path(name)

            async def rm(path: str = path) -> None:
                try:
                    await self._afs._rm_file(path)
                except FileNotFoundError:
                    pass

            self._run("deleting the object", name, rm, 0)


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


DOWNLOAD_BYTES = 64 << 20
"""The most bytes one read of :meth:`ObjectStore.download` asks for (and holds in memory)."""

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


async def _in_own_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` run on a new thread, awaited on the running loop.

    Not ``asyncio.to_thread``: a composite operation waits for requests of its own, and on a
    blocking store (``memory://`` through ``AsyncFileSystemWrapper``) each of those runs on the
    loop's default executor. A dozen composite operations at once held every thread of that
    executor while their requests queued behind them: a deadlock. A thread per composite
    operation (whole uploads: a few at a time) cannot starve it, and ends with the operation.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():  # the awaiting request was cancelled meanwhile
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def work() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # handed to the awaiting coroutine, raised there
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop was closed meanwhile: nobody waits any more
            pass

    threading.Thread(target=work, name="ucp-composite", daemon=True).start()
    return await fut


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


# ------------------------------------------------------------ S3 uploads in parallel parts
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

    fsspec's buffered S3 file uploads a part each time its buffer fills and waits for it, so one
    rank would get one connection's bandwidth; this one keeps ``parallel`` parts uploading at once
    on s3fs's event loop, each a scheduled request with its own deadline and retries, and completes
    the upload only after every part succeeded.

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
        part_bytes: int,
        parallel: int,
        scheduler: RequestScheduler,
        where: str,
    ) -> None:
        self.scheduler = scheduler
        self.where = where
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_bytes = max(part_bytes, _MIN_PART)
        self.parallel = parallel
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

    def _s3(self, method: str, nbytes: int | None, what: str, **kwargs: Any) -> Any:
        """S3 call ``method`` (of ``nbytes`` bytes: 0 for a create or abort, None (the deadline
        cap) for a complete), under the scheduler's deadline and retries; its answer. A small
        object's one PUT feeds the medians like a part; the other calls are not transfers and do
        not."""

        def make(_: Any = None) -> Any:
            return self.fs._call_s3(method, **kwargs)

        coro = self.scheduler.run(make, nbytes, where=self.where, what=what, observe=bool(nbytes))
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop).result()


async def _tagged(coro: Any, number: int) -> dict[str, Any]:
    """The part record ``complete_multipart_upload`` needs, once part ``number`` is up."""
    out = await coro
    return {"PartNumber": number, "ETag": out["ETag"]}
