"""Moving a box of a saved chunk into a destination tensor.

Two ways, chosen by the destination: a CPU tensor of the saved dtype is
filled in place (its storage is the read buffer); anything else (a dtype
cast, a device tensor) goes through bounded staging memory in the saved
dtype, slab by slab (:class:`StagingBuffers`, made once per batch of reads
and reused by all of them; double-buffered for CUDA destinations). The
chunk-read engine (:class:`~ucp_dcp.byteio.engine.ChunkReads`) runs every read through them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.boxes import row_major_strides, runs, slabs
from ..core.sharding import Box
from ..core.spans import expand, prefer_span, region_starts, span_of, span_slabs
from ..errors import UnsupportedValueError
from ..format import Location
from .blocksums import ChunkCheck, read_verified
from .rangeio import MAX_REQUEST_BYTES, ByteSource, Extents, MappedSpan, storage_view
from .segments import Segment

__all__ = [
    "ChunkRegion",
    "extents",
    "needs_staging",
    "check_writable",
    "narrowed",
    "shares_elements",
    "permuted",
    "segments_into",
    "StagingBuffers",
    "spanned",
    "staging_plan",
]

# Half boundaries are multiples of this: a multiple of every itemsize (the
# largest, complex128, is 16) so that each half can be viewed as any dtype.
_HALF_ALIGN = 16
# The smallest buffer ever allocated: two halves of one complex128 element.
_MIN_BYTES = 32


@dataclass(frozen=True, slots=True)
class ChunkRegion:
    """Box ``region`` (in the chunk's own coordinates) of a saved chunk of ``chunk_sizes``
    elements of ``dtype``, whose bytes are at ``location``: what one read moves into a
    destination tensor of the region's shape."""

    location: Location
    chunk_sizes: tuple[int, ...]
    region: Box
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """The region's bytes in the saved dtype."""
        return self.region.numel * self.dtype.itemsize

    @property
    def whole(self) -> bool:
        """Whether the region is the whole chunk."""
        return self.region == Box.whole(self.chunk_sizes)

    def fields(self) -> tuple[Location, tuple[int, ...], Box, torch.dtype]:
        """``(location, chunk_sizes, region, dtype)``, for code that uses all four."""
        return self.location, self.chunk_sizes, self.region, self.dtype

    def file_runs(self) -> tuple[np.ndarray, int]:
        """The file offsets of the runs of bytes the region occupies (ascending) and their common
        length: what reading it needs from the file, whichever way it is read."""
        loc = self.location
        if self.whole:
            return np.array([loc.start], dtype=np.int64), loc.nbytes
        stored = self.stored()
        starts, length = region_starts(stored.chunk_sizes, stored.region, self.dtype.itemsize)
        return starts + loc.start, length

    def stored(self) -> ChunkRegion:
        """The same region with the chunk's dimensions in their stored order (itself for a
        row-major chunk): its bytes are row-major in it."""
        order = self.location.dim_order
        if not order:
            return self
        sizes, region = self.chunk_sizes, self.region
        return ChunkRegion(
            self.location,
            tuple(sizes[d] for d in order),
            Box(tuple(region.offsets[d] for d in order), tuple(region.sizes[d] for d in order)),
            self.dtype,
        )


def extents(parts: Iterable[ChunkRegion]) -> Extents:
    """Every byte range reading ``parts`` needs, per file number: what
    :meth:`ByteSource.plan_access <ucp_dcp.byteio.rangeio.ByteSource.plan_access>` chooses
    from."""
    starts: dict[int, list[np.ndarray]] = {}
    lengths: dict[int, list[np.ndarray]] = {}
    for part in parts:
        s, n = part.file_runs()
        starts.setdefault(part.location.file, []).append(s)
        lengths.setdefault(part.location.file, []).append(np.full(len(s), n, dtype=np.int64))
    return {f: (np.concatenate(starts[f]), np.concatenate(lengths[f])) for f in starts}


def needs_staging(dest: torch.Tensor, src_dtype: torch.dtype, location: Location) -> bool:
    """Whether ``dest`` cannot be filled in place from bytes of ``src_dtype`` stored at
    ``location``.

    A cast, a device destination, a conjugate or negative view (its memory holds values
    conjugated or negated: ``copy_`` writes them so), or a chunk stored in another dimension
    order (read into a staging buffer laid out in the stored order, so that
    each read is as long as the region allows, then copied into place).
    """
    return (
        dest.device.type != "cpu"
        or dest.dtype != src_dtype
        or dest.is_conj()
        or dest.is_neg()
        or bool(location.dim_order)
    )


def check_writable(dest: torch.Tensor, name: str) -> None:
    """Refuse a destination some of whose elements are one place in memory (an expanded or
    overlapping view), before anything is written into it. Checked when a load reads, not when
    it plans: planning alone (the scale simulator's expanded stand-ins) writes nothing."""
    if shares_elements(dest):
        raise UnsupportedValueError(
            f"{name!r}: the state dict's tensor is an expanded or overlapping view (shape "
            f"{list(dest.shape)}, strides {list(dest.stride())}): several of its elements are "
            "one place in memory, so no load can give each its own value; load into a tensor of "
            "its own (.clone() it)"
        )


def shares_elements(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one place in memory (an expanded or overlapping view):
    a load into it would leave each such place with whichever value came last."""
    if t.is_contiguous() or t.numel() < 2:  # the common destination: one flag, no arithmetic
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 1  # elements spanned by the dimensions of smaller strides, plus one
    for st, n in dims:
        if st < reach:
            break
        reach += st * (n - 1)
    else:
        return False  # each stride steps past all the smaller ones cover: no overlap
    if any(st == 0 for st, _ in dims):
        return True
    # Interleaved strides (only as_strided makes them): compare the element offsets themselves.
    offsets = np.zeros(1, dtype=np.int64)
    for st, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    return len(np.unique(offsets)) < len(offsets)


def permuted(part: ChunkRegion, dest: torch.Tensor) -> tuple[ChunkRegion, torch.Tensor]:
    """``part`` and ``dest`` as seen in the chunk's stored dimension order.

    For a chunk stored in another order the chunk, the region and the
    destination (a view: same memory, permuted strides) are permuted alike,
    so that the stored bytes are row-major in them and the strided reads
    below apply unchanged. A row-major chunk is returned as it is.
    """
    order = part.location.dim_order
    return (part.stored(), dest.permute(order)) if order else (part, dest)


def segments_into(
    location: Location,
    chunk_sizes: tuple[int, ...],
    region: Box,
    dest: torch.Tensor,
    view: memoryview | None = None,
) -> Iterator[Segment]:
    """Segments that read ``region`` of a saved chunk into CPU tensor ``dest``.

    ``dest`` has the region's shape and the saved dtype; ``view`` is
    :func:`storage_view` of it (pass it when making many calls on one tensor).
    """
    view = storage_view(dest) if view is None else view
    es = dest.element_size()
    grid = runs(chunk_sizes, region, dest.stride(), int(dest.storage_offset()))
    n = grid.count * es
    file = location.file
    for src, dst in zip((grid.src * es + location.start).tolist(), (grid.dst * es).tolist()):
        yield Segment(file, src, view[dst : dst + n])


class StagingBuffers:
    """Host staging memory for :meth:`read`, reused across read items.

    Make one per batch of reads (one ``read_data`` call, one
    ``Checkpoint.read_into``), :meth:`read` every staged region of the
    batch through it, and :meth:`close` it at the end (or use it as a context
    manager): that waits for copies still in flight and drops the memory.

    The memory is one ``uint8`` tensor of at most ``max_buffer_bytes`` (but
    never less than 32 bytes), allocated on first use and no larger than
    the batch needs: ``largest_bytes``, when given, is the size of the
    largest region the batch will stage, and the first allocation covers it
    (twice, for the double-buffered path) up to the bound; without it the
    buffer starts at the first region's size and grows (doubling, up to
    the bound) when a later region needs more. It is pinned when a
    destination is a CUDA tensor; a pinned buffer also serves CPU
    destinations, while an unpinned one is replaced by a pinned one at the
    first CUDA destination.

    Two ways through it:

    * *blocking* (CPU destinations, i.e. dtype casts, and devices other than
      CUDA): the whole buffer carries one slab at a time, read, then copied
      into place with a blocking ``copy_``.
    * *double-buffered* (CUDA destinations): two halves. A slab is read into
      one half while the copy out of the other half runs on the
      destination's current stream (``non_blocking``); before a half is
      refilled, the CUDA event recorded after its last copy is waited for.
      A dtype cast copies the saved dtype to the device and casts there (a
      correctly rounded IEEE cast either way; only NaN payloads may differ
      from a CPU cast). The copies run on the destination's current stream,
      so later work on that stream sees the data even before :meth:`close`.

    ``overlap`` picks the way: None (the default) double-buffers exactly the
    CUDA destinations; True sends every destination through the
    double-buffered code (on a CPU destination the copies complete at once
    and there are no events); False never double-buffers.

    ``device_copy`` (for tests) replaces the copy of the double-buffered
    path for every destination: ``device_copy(target, buf)`` starts copying
    host slab ``buf`` into ``target`` and returns an object whose
    ``synchronize()`` returns once ``buf`` may be overwritten (or None when
    the copy is done). With a copy that completes only when waited for, a
    test on CPU checks that no half is refilled while a copy may still
    read it.

    ``allocations`` counts host allocations (tests check that it is 1 for a
    whole batch), ``slabs`` the slabs staged, ``bytes_staged`` their bytes,
    ``spans`` the slabs read as covering spans (:meth:`read`'s span path).
    Not thread-safe: one per reading thread.
    """

    def __init__(
        self,
        max_buffer_bytes: int,
        *,
        largest_bytes: int | None = None,
        overlap: bool | None = None,
        device_copy: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> None:
        self.max_buffer_bytes = max(int(max_buffer_bytes), _MIN_BYTES)
        self.largest_bytes = largest_bytes
        self.overlap = overlap
        self.device_copy = device_copy
        self.allocations = 0
        self.slabs = 0
        self.bytes_staged = 0
        self.spans = 0
        self._buf: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._pinned = False
        self._next = 0  # the half the next double-buffered slab goes into
        # Per half: its last copy's event, not yet waited for.
        self._events: list[Any] = [None, None]

    # ------------------------------------------------------------ state
    @property
    def capacity(self) -> int:
        """Bytes allocated now (0 before first use and after :meth:`close`)."""
        return 0 if self._buf is None else self._buf.numel()

    @property
    def pinned(self) -> bool:
        """Whether the current buffer is pinned (page-locked) host memory."""
        return self._buf is not None and self._pinned

    def double_buffered(self, dest: torch.Tensor) -> bool:
        """Whether ``dest`` goes through the double-buffered path."""
        if self.overlap is not None:
            return self.overlap
        return dest.device.type == "cuda"

    # ------------------------------------------------------------ memory
    def _want(self, nbytes: int, halves: bool) -> int:
        """Bytes that carry a region of ``nbytes`` in one slab (per half when ``halves``), within
        the bound."""
        n = -(-max(nbytes, 1) // _HALF_ALIGN) * _HALF_ALIGN
        return max(min(2 * n if halves else n, self.max_buffer_bytes), _MIN_BYTES)

    def _ensure(self, nbytes: int, halves: bool, pin: bool) -> None:
        """Make the buffer fit a region of ``nbytes`` as well as the bound allows, pinned if
        ``pin``."""
        want = self._want(nbytes, halves)
        cap = self.capacity
        if cap >= want and (self._pinned or not pin):
            return
        if cap >= want:  # big enough, but a CUDA destination needs it pinned
            size = cap
        elif cap:
            size = max(want, min(2 * cap, self.max_buffer_bytes))
        else:
            size = max(want, self._want(self.largest_bytes or 0, halves))
        self.synchronize()  # no copy may still be reading the memory being dropped
        self._buf = self._view = None
        self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self._view = storage_view(self._buf)
        self._pinned = pin
        self._next = 0
        self.allocations += 1

    # ------------------------------------------------------------ sync
    def _wait(self, half: int) -> None:
        ev = self._events[half]
        if ev is not None:
            ev.synchronize()
            self._events[half] = None

    def synchronize(self) -> None:
        """Wait until every copy out of the buffer has completed."""
        self._wait(0)
        self._wait(1)

    def close(self) -> None:
        """Wait for copies in flight, then release the memory (the object stays usable)."""
        self.synchronize()
        self._buf = self._view = None

    def __enter__(self) -> StagingBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ reading
    def read(
        self,
        reader: ByteSource,
        part: ChunkRegion,
        dest: torch.Tensor,
        check: ChunkCheck | None = None,
        span: bool | None = None,
    ) -> None:
        """Read ``part`` of a saved chunk into ``dest`` (any dtype, any device), slab by slab.

        The copies into a CUDA ``dest`` may still be in flight on return, until :meth:`close` or
        later work on the same stream. Memory stays bounded whatever the tensor size. With
        ``check``, every block each slab's read touches is checked in the staging buffer
        (:mod:`~ucp_dcp.byteio.blocksums`). ``span``: whether to read it as spans, as
        :func:`staging_plan` decided (None: decide here).
        """
        part, dest = permuted(part, dest)
        location, chunk_sizes, region, src_dtype = part.fields()
        es = src_dtype.itemsize
        nbytes = part.nbytes
        if nbytes == 0:
            return
        cuda = dest.device.type == "cuda"
        halves = self.double_buffered(dest)
        if span is None:
            span = spanned(reader, part)
        if not halves and span:
            mapped = read_spans_mapped(reader, part, dest, check)
            if mapped:
                self.spans += mapped
                return
            if self._read_spans(reader, part, dest, check):
                return
        self._ensure(nbytes, halves, pin=cuda and torch.cuda.is_available())
        assert self._buf is not None and self._view is not None
        if not halves:
            self.synchronize()  # the whole buffer is reused: nothing may still read it
        # Every slab fits: slabs() cuts down to single elements if it must,
        # and a half is never smaller than 16 bytes (the largest itemsize).
        half_bytes = (self.capacity // 2) // _HALF_ALIGN * _HALF_ALIGN if halves else self.capacity
        for offs, sizes in slabs(region.sizes, es, half_bytes):
            n = torch.Size(sizes).numel() * es
            base = 0
            if halves:
                base = self._next * half_bytes
                self._wait(self._next)  # its previous copy must be done before it is refilled
            buf = self._buf[base : base + n].view(src_dtype).view(sizes)
            sub = Box(tuple(b + o for b, o in zip(region.offsets, offs)), sizes)
            if check is None:
                reader.read(list(segments_into(location, chunk_sizes, sub, buf, self._view)))
            else:  # checked in the staging buffer, before it is copied anywhere
                read_verified(reader, location, chunk_sizes, sub, buf, check, self._view)
            target = narrowed(dest, offs, sizes)
            self.slabs += 1
            self.bytes_staged += n
            if not halves:
                target.copy_(buf)  # blocking: the next slab reuses the buffer
                continue
            copy = self.device_copy or (_copy_to_cuda if cuda else _copy_now)
            self._events[self._next] = copy(target, buf)
            self._next ^= 1

    def _read_spans(
        self,
        reader: ByteSource,
        part: ChunkRegion,
        dest: torch.Tensor,
        check: ChunkCheck | None,
    ) -> bool:
        """Read ``region`` span by span: each sub-box's covering bytes with one read into the buffer
        (whole blocks with ``check``: the blocks holding needed bytes are checked there), then one
        strided copy into ``dest``. False (nothing read) where the buffer cannot hold a useful
        span."""
        location, chunk_sizes, region, src_dtype = part.fields()
        es = src_dtype.itemsize
        bs = check.sums.block if check is not None else 0
        a, b = span_of(chunk_sizes, region.offsets, region.sizes, es)
        # A span widened to whole blocks takes at most a block more at each end, and up to an
        # element more to put its first needed element at an element boundary of the buffer (blocks
        # need not be a multiple of the itemsize).
        self._ensure(b - a + 2 * bs + es, False, pin=False)
        assert self._buf is not None and self._view is not None
        budget = self.capacity - 2 * bs - es
        if budget < es:  # not even an element besides the blocks at the ends
            return False
        self.synchronize()
        strides = row_major_strides(chunk_sizes)
        prev = (0, 0, 0)  # the span [a0, b0) the buffer holds now, from byte ``shift`` of it
        for offs, sizes in span_slabs(chunk_sizes, region, es, budget):
            a, b, a0, b0, blocks = _sub_span(part, offs, sizes, bs)
            if blocks is None:
                shift = 0
                reader.read([Segment(location.file, location.start + a0, self._view[: b0 - a0])])
            else:
                # Whole blocks: every block holding a needed byte is checked before any byte is
                # handed over.
                assert check is not None
                shift = -(a - a0) % es
                keep = 0
                if a0 < prev[1]:
                    # The previous span ended in this span's first block, and checked it: carry
                    # those bytes over rather than read (and hash) the block a second time.
                    keep = prev[1] - a0
                    end = prev[2] + prev[1] - prev[0]
                    self._buf[shift : shift + keep].copy_(self._buf[end - keep : end].clone())
                    blocks = blocks[blocks != a0 // bs]
                if b0 > a0 + keep:
                    reader.read(
                        [
                            Segment(
                                location.file,
                                location.start + a0 + keep,
                                self._view[shift + keep : shift + b0 - a0],
                            )
                        ]
                    )
                check.verifier.check_span(
                    check, location, self._buf[shift : shift + b0 - a0].numpy(), a0, blocks
                )
                prev = (a0, b0, shift)
            # A multiple of the itemsize: the buffer can be viewed as src_dtype there.
            first = shift + a - a0
            typed = self._buf[first : first + b - a].view(src_dtype)
            src = torch.as_strided(typed, sizes, strides, first // es)
            narrowed(dest, offs, sizes).copy_(src)
            self.slabs += 1
            self.spans += 1
            self.bytes_staged += b0 - a0
        return True


def read_spans_mapped(
    reader: ByteSource, part: ChunkRegion, dest: torch.Tensor, check: ChunkCheck | None
) -> int:
    """Read ``part`` (in the chunk's stored order) into CPU tensor ``dest`` span by span straight
    from the file mapped into memory (:meth:`~ucp_dcp.byteio.rangeio.ByteSource.read_mapped`):
    per sub-box, one strided copy into ``dest``, then (with ``check``) the blocks holding the
    needed bytes checked in the mapping; the sub-boxes run in parallel on the reader's I/O
    threads. The number of spans read; 0 (nothing read) where the source cannot map the file, or
    ``dest`` is not in CPU memory, or the chunk does not start at an element boundary of the file.
    """
    location, chunk_sizes, region, src_dtype = part.fields()
    es = src_dtype.itemsize
    if dest.device.type != "cpu" or location.start % es or region.numel == 0:
        return 0
    bs = check.sums.block if check is not None else 0
    strides = row_major_strides(chunk_sizes)
    spans: list[MappedSpan] = []
    last = -1  # the last block a sub-box before this one checks
    # Sub-boxes of at most a request's span: one per I/O call, several in flight.
    for offs, sizes in span_slabs(chunk_sizes, region, es, MAX_REQUEST_BYTES):
        a, b, lo, hi, blocks = _sub_span(part, offs, sizes, bs)
        if blocks is not None:
            # A block the previous sub-box shares with this one is checked there: the same bytes
            # of the same mapping.
            blocks = blocks[blocks > last]
            last = int(blocks[-1]) if len(blocks) else last
        target = narrowed(dest, offs, sizes)

        def copy_out(
            view: memoryview,
            a: int = a,
            b: int = b,
            lo: int = lo,
            blocks: np.ndarray | None = blocks,
            sizes: tuple[int, ...] = sizes,
            target: torch.Tensor = target,
        ) -> None:
            # From the first needed byte (at an element boundary of the file, unlike ``lo`` where
            # blocks are not a multiple of the element size).
            typed = torch.frombuffer(view[a - lo : b - lo], dtype=src_dtype)
            # The copy first: it faults the needed pages in without the GIL, so the hashing after
            # it (which holds the GIL) finds them in memory; a mismatch still fails the load.
            target.copy_(torch.as_strided(typed, sizes, strides, 0))
            if check is not None and blocks is not None:
                mem = np.frombuffer(view, dtype=np.uint8)
                check.verifier.check_span(check, location, mem, lo, blocks)

        spans.append(MappedSpan(location.start + lo, hi - lo, copy_out))
    return len(spans) if reader.read_mapped(location.file, spans) else 0


def narrowed(t: torch.Tensor, offs: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The sub-box of ``t`` at ``offs`` of ``sizes`` (a view)."""
    for d, (o, n) in enumerate(zip(offs, sizes)):
        t = t.narrow(d, o, n)
    return t


def _sub_span(
    part: ChunkRegion, offs: Sequence[int], sizes: Sequence[int], block: int
) -> tuple[int, int, int, int, np.ndarray | None]:
    """``(a, b, lo, hi, blocks)`` of the sub-box of ``part``'s region at ``offs`` of ``sizes``: its
    span ``[a, b)`` in the chunk, widened to whole blocks ``[lo, hi)``, and the blocks holding its
    needed bytes; with ``block`` 0 (nothing to check) ``lo, hi = a, b`` and no blocks."""
    es = part.dtype.itemsize
    sub = Box(tuple(o + p for o, p in zip(part.region.offsets, offs)), tuple(sizes))
    a, b = span_of(part.chunk_sizes, sub.offsets, sub.sizes, es)
    if not block:
        return a, b, a, b, None
    starts, length = region_starts(part.chunk_sizes, sub, es)
    lo, hi = a // block * block, min(-(-b // block) * block, part.location.nbytes)
    # Every block a run [s, s + length) touches, ascending, once each.
    _, blocks = expand(starts // block, (starts + length - 1) // block + 1)
    return a, b, lo, hi, np.unique(blocks)


def spanned(reader: ByteSource, part: ChunkRegion, dest: torch.Tensor | None = None) -> bool:
    """Whether ``part`` (row-major in the chunk's stored order) is read as spans
    (:mod:`ucp_dcp.core.spans`) rather than run by run, into ``dest`` in place (default: a
    contiguous buffer)."""
    return prefer_span(
        part.chunk_sizes,
        part.region,
        part.dtype.itemsize,
        base=part.location.start,
        gap_bytes=reader.gap_bytes,
        dst_strides=None if dest is None else dest.stride(),
        mapped=reader.maps_files and (dest is None or dest.device.type == "cpu"),
    )


def staging_plan(
    reader: ByteSource, part: ChunkRegion, dest: torch.Tensor, block: int = 0
) -> tuple[bool, int]:
    """How :meth:`StagingBuffers.read` reads ``part`` into ``dest``: ``(as spans, staging
    bytes)``.

    The staging bytes read it in one piece (its span widened by ``block`` at
    each end when it is read as spans, else its own bytes): what a batch's
    :class:`StagingBuffers` should start at. Pass the first to
    :meth:`StagingBuffers.read` as ``span`` so the choice is made once.
    """
    if part.region.numel == 0:
        return False, 0
    itemsize = part.dtype.itemsize
    p, _ = permuted(part, dest)
    if spanned(reader, p):
        a, b = span_of(p.chunk_sizes, p.region.offsets, p.region.sizes, itemsize)
        return True, b - a + 2 * block
    return False, part.nbytes


def _copy_now(target: torch.Tensor, buf: torch.Tensor) -> None:
    """A copy into a non-CUDA ``target``: complete on return, so no event."""
    target.copy_(buf)


def _copy_to_cuda(target: torch.Tensor, buf: torch.Tensor) -> Any:
    """Enqueue the copy of host slab ``buf`` into CUDA view ``target``; the event after the
    transfer."""
    stream = torch.cuda.current_stream(target.device)
    if target.dtype == buf.dtype:
        # A non-contiguous target: torch transfers into a contiguous device
        # temporary (asynchronously, from pinned memory) and scatters on the device.
        target.copy_(buf, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev
    # A cast: transfer the saved dtype, cast on the device (torch would
    # otherwise cast on the CPU into pageable memory, which is not asynchronous).
    tmp = torch.empty(buf.shape, dtype=buf.dtype, device=target.device)
    tmp.copy_(buf, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(stream)
    target.copy_(tmp)
    return ev
