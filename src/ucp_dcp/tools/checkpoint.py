"""A single-process, read-only view of a checkpoint of any supported format, and the hand-off.

No process group, no planners: open a checkpoint (any format
:mod:`ucp_dcp.sources` reads), list what it holds, read full tensors
(exactly their bytes, one tensor at a time) and values, and re-verify every
checksum. The hand-off functions, the CLI and the Hugging Face export are
built on this.

The hand-off functions (:func:`load_state_dict`, :func:`load_into_module`) take a training
checkpoint into one process, or into a plain module, for fine-tuning, evaluation or inference jobs
that do not run the training job's parallel layout: no process group, full tensors, reading only
the selected tensors' bytes, one tensor at a time.
"""

from __future__ import annotations

import difflib
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..adapters.layout_spec import LayoutSpec
from ..byteio.engine import ChunkReads
from ..byteio.integrity import HASH_BLOCK, chunk_what, hash_range, value_what
from ..byteio.location import path_arg
from ..byteio.objstore import is_url, local_path
from ..byteio.progress import ProgressFn, progress_fn
from ..byteio.rangeio import ByteSource
from ..byteio.transfer import ChunkRegion, check_writable, narrowed
from ..core.placement_digest import box_share, digest_hex
from ..core.sharding import Box
from ..core.values import decode_value
from ..dcp.options import ReadOptions
from ..dcp.placement import (
    PlacementReport,
    check_placement,
    flat_state,
    local_shares,
    no_digests_error,
)
from ..errors import (
    CheckpointFormatError,
    CheckpointKeyError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    ShapeMismatchError,
    StorageError,
    listed,
)
from ..format import Location, TensorRecord, rank_local_key
from ..format.names import dtype_named
from ..format.schema import check_flags
from ..sources import Source, read_values

__all__ = ["Checkpoint", "load_state_dict", "load_into_module", "KeySelector", "ModuleLoadResult"]


def dtype_arg(dtype: Any, what: str) -> torch.dtype | None:
    """``dtype`` (None, a ``torch.dtype`` or a name such as ``"bf16"``) as a ``torch.dtype``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    named = dtype_named(dtype) if isinstance(dtype, str) else None
    if named is None:
        unknown = f"unknown dtype {dtype!r}; " if isinstance(dtype, str) else ""
        raise InvalidArgumentError(
            f"{what}: {unknown}dtype must be a torch.dtype or one of bf16, fp16, fp32, fp64, got "
            f"{dtype!r}"
        )
    return named


def device_arg(device: Any, what: str) -> torch.device:
    """``device`` as a ``torch.device`` this process can allocate on."""
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)
    except (RuntimeError, TypeError, AssertionError) as e:
        raise InvalidArgumentError(f"{what}: cannot place tensors on {device!r} ({e})") from None
    return dev


def local_output(dst: str, writer: str, elsewhere: str = "") -> str:
    """``dst``, the output directory of ``writer`` (``convert``, ``export_hf``...), as a local path
    (a ``file://`` URL is one); :class:`~ucp_dcp.errors.StorageError` for any other URL, saying
    to ``writer``'s first word (``export``) into a local directory and copy it there
    (``elsewhere``: what else to do)."""
    if is_url(dst):
        verb = writer.split("_")[0]
        raise StorageError(
            f"{dst}: {writer} writes a local directory, not object storage; {verb} into a local "
            f"directory and copy it there{elsewhere}"
        )
    return local_path(dst)


class Checkpoint:
    """Open the checkpoint at ``path`` for reading in this process.

    Args:
        path: the checkpoint: a universal checkpoint, a DCP ``FileSystemWriter`` directory, a
            Hugging Face safetensors model, or a directory whose subfolders are checkpoints; or the
            fsspec URL of a universal checkpoint, a DCP checkpoint or a Hugging Face safetensors
            model in object storage (``s3://...``), read with ranged requests.
        options: how to read (:class:`~ucp_dcp.ReadOptions`; its defaults when None): here
            ``io_threads``, ``max_buffer_bytes`` (the staging bound for dtype casts and device
            copies), ``gap_bytes``, ``max_request_bytes``, ``requests``, ``tp_rules`` and
            ``verify`` (every byte :meth:`read_tensor` / :meth:`read_into` read checked against
            the checksums recorded at save, as a load checks it; values are always checked).
        storage_options: for a URL, passed to fsspec as they are.
        prefix: prepended to the tensor names of a Hugging Face model.
        dcp_values: ``"weights_only"`` to load the pickled values of a DCP checkpoint with
            ``torch.load(weights_only=True)``; refused by default.

    Raises :class:`~ucp_dcp.CheckpointFormatError` when ``path`` is not a
    readable checkpoint. Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        options: ReadOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        prefix: str = "",
        dcp_values: str | None = None,
    ) -> None:
        self.options = opts = ReadOptions.given(options, "Checkpoint")
        self.path = path_arg(path, "Checkpoint: path")
        self.source = opts.open_source(
            self.path, opts.source_options(dcp_values, prefix), storage_options
        )
        self.index = self.source.index
        self._reader = opts.open_reader(self.source)
        self._ranks = self.source.file_ranks()
        self._verified = 0
        # close(), or when collected unclosed (``Checkpoint(path).verify()``): nothing is kept.
        self._release = weakref.finalize(self, _release, self._reader, self.source)

    @property
    def format(self) -> str:
        """The checkpoint's format (``"ucp_dcp"``, ``"dcp"``, ``"hf"``, ``"subfolders"``)."""
        return self.source.format

    @property
    def has_checksums(self) -> bool:
        """Whether the format records checksums, so :meth:`verify` can detect changed bytes."""
        return self.source.checksums

    @property
    def placement_digests(self) -> int:
        """How many of its tensors the checkpoint records a placement digest for (0: none; see
        :meth:`verify_loaded`)."""
        return sum(t.digest is not None for t in self.index.tensors.values())

    # ------------------------------------------------------------ listing
    def tensor_names(self) -> list[str]:
        """Names of all tensors, sorted."""
        return sorted(self.index.tensors)

    def value_names(self) -> list[str]:
        """Names of all non-tensor values, sorted."""
        return sorted(self.index.values)

    def rank_local_names(self) -> list[str]:
        """Names of all rank-local values, sorted."""
        return sorted(self.index.rank_local)

    def tensor_record(self, name: str) -> TensorRecord:
        """The index record (dtype, shape, layout) of tensor ``name``."""
        return _named(name, "tensor", self.index.tensors, self.path)

    @property
    def bytes_read(self) -> int:
        """Bytes requested from storage so far by this object (data-file headers excluded)."""
        return self._reader.stats.bytes

    @property
    def verified_bytes(self) -> int:
        """Bytes of tensor data hashed so far to check reads (``verify=True``)."""
        return self._verified

    # ------------------------------------------------------------ reading
    def read_tensor(
        self,
        name: str,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
    ) -> torch.Tensor:
        """The full tensor ``name``, reading exactly its bytes.

        ``dtype``/``device`` convert on the way (through the bounded staging
        buffer), so no second full-size copy is made.
        """
        rec = self.tensor_record(name)
        cast = dtype_arg(dtype, "read_tensor: dtype")
        dev = device_arg(device, "read_tensor: device")
        # Locate every chunk first: nothing is allocated for a tensor whose
        # bytes the data files do not hold (each chunk is checked against its file).
        self.chunks(name)
        out = torch.empty(rec.shape, dtype=cast or rec.dtype, device=dev)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill existing tensor ``out`` (the full shape; any dtype, device, strides) with
        ``name``."""
        rec = self.tensor_record(name)
        if not isinstance(out, torch.Tensor):
            raise InvalidArgumentTypeError(
                f"read_into: out must be a torch.Tensor, got {type(out).__name__}"
            )
        check_writable(out, name)
        if tuple(out.shape) != rec.shape:
            raise ShapeMismatchError(
                f"size mismatch for {name!r}: the checkpoint has shape {list(rec.shape)}, the "
                f"target has {list(out.shape)}"
            )
        chunks = self.chunks(name)
        # Made per call, so that a failed read leaves nothing pending for the next.
        engine = self._chunk_reads(self.options.buffer_bytes)
        try:
            for i, (box, loc) in enumerate(chunks):
                engine.add(
                    ChunkRegion(loc, box.sizes, Box.whole(box.sizes), rec.dtype),
                    narrowed(out, box.offsets, box.sizes),
                    name=name,
                    chunk_offsets=box.offsets,
                    sums=self.source.sums_to_check(name, i, loc, engine.verify),
                )
            engine.flush()
        finally:
            engine.close()
            self._verified += engine.stats.verified_bytes

    def _chunk_reads(self, max_buffer_bytes: int) -> ChunkReads:
        """A chunk reader over this checkpoint's files, staging at most ``max_buffer_bytes`` and
        checking what it reads when the options say ``verify`` (also :mod:`.convert`'s)."""
        return ChunkReads(
            self._reader,
            self.source.paths,
            self._ranks,
            verify=self.options.verify,
            max_buffer_bytes=max_buffer_bytes,
            scratch_in_buffer=False,
        )

    def chunks(self, name: str) -> list[tuple[Box, Location]]:
        """Every saved chunk of tensor ``name``: its box and where its bytes are."""
        self.tensor_record(name)
        return [
            (c.box, self.source.locate(name, i)) for i, c in enumerate(self.source.chunks(name))
        ]

    def read_value(self, name: str) -> Any:
        """The non-tensor value ``name`` (checksum verified)."""
        _named(name, "value", self.index.values, self.path)
        return decode_value(read_values(self.source, self._reader, [name])[0], name)

    def read_rank_local(self, name: str) -> dict[int, Any]:
        """Every rank's copy of rank-local value ``name``, by rank."""
        per_rank = _named(name, "rank-local value", self.index.rank_local, self.path)
        ranks = sorted(per_rank)
        raws = read_values(self.source, self._reader, [rank_local_key(r, name) for r in ranks])
        return {r: decode_value(raw, name) for r, raw in zip(ranks, raws)}

    # ------------------------------------------------------------ verifying
    def verify(self, on_progress: ProgressFn | None = None) -> list[str]:
        """Re-check every data file, index entry and checksum.

        For a native checkpoint the index is also cross-checked with every
        data file's header, both ways: each chunk and value the index lists
        is an entry of its file's header with the same box, byte range and
        checksum, and each entry of the headers is listed by the index (so a
        deleted or renamed index entry is reported).

        Returns one line per problem, naming the file and the tensor or value;
        an empty list means the checkpoint is intact. Reads every byte once,
        in blocks of 16 MiB; ``on_progress(done_bytes, total_bytes)`` after each chunk and value.
        """
        progress = progress_fn(on_progress, "verify")
        problems: list[str] = self.source.check_files()
        work: list[tuple[str, Location]] = []

        def note(e: CheckpointFormatError) -> None:
            # A damaged header fails every entry in that file: say it once.
            if str(e) not in problems:
                problems.append(str(e))

        for name in self.tensor_names():
            try:
                work += [(chunk_what(name, box.offsets), loc) for box, loc in self.chunks(name)]
            except CheckpointFormatError as e:
                note(e)
        keys = sorted(self.index.values)
        keys += [
            rank_local_key(r, k)
            for k, per_rank in sorted(self.index.rank_local.items())
            for r in sorted(per_rank)
        ]
        for key in keys:
            try:
                work.append((value_what(key), self.source.value_location(key)))
            except CheckpointFormatError as e:
                note(e)
        work += self.source.checksummed_records()
        problems += self._check_digests()
        total = sum(loc.nbytes for _, loc in work)
        done = 0
        buf = bytearray(min(HASH_BLOCK, max((loc.nbytes for _, loc in work), default=1)))
        for what, loc in work:
            path = self.source.paths[loc.file]
            try:
                digest = hash_range(self._reader, loc, buf)
            except (
                CheckpointFormatError,
                EOFError,
            ) as e:  # a missing or short file: the message names it
                problems.append(f"{what}: {e}")
                continue
            except OSError as e:
                problems.append(
                    f"{path}: {what}: cannot read bytes [{loc.start}, {loc.start + loc.nbytes}): "
                    f"{e}"
                )
                continue
            if loc.xxh3 and digest != loc.xxh3:
                problems.append(
                    f"{path}: {what}: checksum mismatch (recorded {loc.xxh3}, data hashes to "
                    f"{digest})"
                )
            done += loc.nbytes
            progress(done, total)
        return problems

    def _check_digests(self) -> list[str]:
        """Every recorded placement digest against the saved tensor (read whole, one at a
        time): a digest that does not match the data is reported like a checksum mismatch."""
        problems = []
        for name, rec in sorted(self.index.tensors.items()):
            if rec.digest is None:
                continue
            try:
                data = self.read_tensor(name)
            except CheckpointFormatError:
                continue  # the data's own checks below report it
            got = digest_hex(box_share(data, (0,) * data.dim(), rec.shape))
            if got != rec.digest:
                problems.append(
                    f"{self.path}: tensor {name!r}: placement digest mismatch (the index records "
                    f"{rec.digest}, the saved data hashes to {got})"
                )
        return problems

    def verify_loaded(
        self, state: Mapping[str, Any], *, process_group: dist.ProcessGroup | None = None
    ) -> PlacementReport:
        """Prove that ``state``, already loaded from this checkpoint, holds every element where
        the save found it: the check ``ReadOptions(verify_placement=True)`` makes.

        ``state`` is the (nested) state dict as loaded: plain tensors, DTensors of any mesh and
        placements, ShardedTensors, :class:`~ucp_dcp.TensorPieces`. Each box is hashed at the
        global position its own layout gives it; under an initialised process group with more
        than one rank, every rank of ``process_group`` must call this (one all-reduce adds the
        ranks' shares up). Every copy the job holds is checked; tensors loaded into another
        dtype and tensors without a digest are listed as not checked in the returned
        :class:`~ucp_dcp.dcp.placement.PlacementReport`.

        Raises :class:`~ucp_dcp.PlacementError` on every rank, naming the tensor, when a tensor
        does not match its digest, and when the checkpoint records no digests at all.
        """
        records = self.index.tensors
        no_digests_error(records, self.path)
        return check_placement(
            records, local_shares(flat_state(state), records), process_group, self.path
        )

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release files and threads (also done when the object is collected unclosed)."""
        self._release()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(reader: ByteSource, source: Source) -> None:
    reader.close()
    source.close()


_T = TypeVar("_T")


def _named(name: Any, what: str, known: Mapping[str, _T], path: str) -> _T:
    """``known[name]``, the checkpoint's ``what`` called ``name``: an
    :class:`~ucp_dcp.errors.InvalidArgumentTypeError` for a name that is not a string, a
    :class:`~ucp_dcp.errors.CheckpointKeyError` naming the closest names for one not there."""
    if not isinstance(name, str):
        raise InvalidArgumentTypeError(f"a {what} name must be a string, got {type(name).__name__}")
    try:
        return known[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(known), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise CheckpointKeyError(f"{path}: no {what} named {name!r}{hint}") from None


# ---------------------------------------------- hand-off: into one process, or a plain module

KeySelector = str | Iterable[str] | Callable[[str], bool] | None
"""Which keys to load: None (all), a name or prefix, several, or a predicate."""


def _selector(keys: KeySelector) -> Callable[[str], bool]:
    if keys is None:
        return lambda _: True
    if callable(keys):
        return keys
    wanted = [keys] if isinstance(keys, str) else list(keys) if isinstance(keys, Iterable) else None
    if wanted is None or not all(isinstance(k, str) for k in wanted):
        raise InvalidArgumentTypeError(
            f"keys must be None, a name or prefix, several of them, or a predicate; got {keys!r}"[
                :200
            ]
        )
    # "model" and "model." both select everything under model.
    prefixes = tuple(k if k.endswith(".") else k + "." for k in wanted)
    exact = set(wanted)
    return lambda name: name in exact or name.startswith(prefixes)


def load_state_dict(
    path: str | os.PathLike[str],
    keys: KeySelector = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    rank_local: bool = False,
    layout: LayoutSpec | None = None,
    options: ReadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "",
    dcp_values: str | None = None,
) -> dict[str, Any]:
    """Full tensors and values of a checkpoint of any format, in this process.

    Args:
        path: the checkpoint (see :class:`~ucp_dcp.Checkpoint` for the formats).
        keys: names (``"model.layers.0.w"``), prefixes (``"model."``), a list of either, or a
            predicate on the name; None for everything. Only the selected tensors' bytes are read.
        dtype: cast floating-point tensors to this dtype, a ``torch.dtype`` or a name (``"bf16"``,
            as :func:`~ucp_dcp.tools.hf.export_hf` takes it; integer and bool tensors, such as
            step counters, keep theirs).
        device: where the tensors go.
        rank_local: also return rank-local values, as ``{rank: value}``.
        layout: return the logical tensors this :class:`~ucp_dcp.LayoutSpec` makes of the selected
            tensors (:meth:`~ucp_dcp.LayoutSpec.logical`: renamed, fused ones split into their
            parts, e.g. a Megatron QKV as Hugging Face's q/k/v) instead of them.
        options, storage_options, prefix, dcp_values: how to read ``path``, as
            :class:`~ucp_dcp.Checkpoint` takes them.

    Keys are DCP's flattened names (``"model.embed.weight"``,
    ``"optim.state.embed.weight.exp_avg"``). Tensors are read one at a
    time, so peak memory is the result plus a fixed staging buffer.
    """
    if isinstance(keys, Iterable) and not isinstance(keys, str) and not callable(keys):
        keys = list(keys)  # read twice: to select, then to name those that matched nothing
    select = _selector(keys)
    dtype = dtype_arg(dtype, "load_state_dict: dtype")
    if layout is not None and not isinstance(layout, LayoutSpec):
        raise InvalidArgumentTypeError(
            f"load_state_dict: layout must be a LayoutSpec, got {type(layout).__name__}"
        )
    out: dict[str, Any] = {}
    with Checkpoint(
        path,
        options=options,
        storage_options=storage_options,
        prefix=prefix,
        dcp_values=dcp_values,
    ) as ckpt:
        for name in ckpt.tensor_names():
            if select(name):
                src = ckpt.tensor_record(name).dtype
                cast = dtype if dtype is not None and src.is_floating_point else None
                out[name] = ckpt.read_tensor(name, dtype=cast, device=device)
        for name in ckpt.value_names():
            if select(name):
                out[name] = ckpt.read_value(name)
        if rank_local:
            for name in ckpt.rank_local_names():
                if select(name):
                    out[name] = ckpt.read_rank_local(name)
    if keys is not None and not callable(keys):
        wanted = [keys] if isinstance(keys, str) else list(keys)
        unmatched = [k for k in wanted if not any(_selector(k)(n) for n in out)]
        if unmatched:
            raise CheckpointKeyError(f"{os.fspath(path)}: no key matches {unmatched}")
    if layout is not None:
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        out = {**{k: v for k, v in out.items() if k not in tensors}, **layout.logical(tensors)}
    return out


class ModuleLoadResult(NamedTuple):
    """What :func:`load_into_module` could not match (empty lists when ``strict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _same_memory(t: torch.Tensor) -> tuple[object, ...]:
    """What makes two module tensors one: storage, offset, shape and strides.

    A tensor with no memory (meta, empty, a DTensor, refused later) is only itself.
    """
    ptr = 0 if hasattr(t, "device_mesh") else t.untyped_storage().data_ptr()
    if not ptr:
        return (id(t),)
    return (t.device, ptr, t.storage_offset(), t.shape, t.stride())


def load_into_module(
    module: nn.Module,
    path: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    strict: bool = True,
    options: ReadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ModuleLoadResult:
    """Fill ``module``'s parameters and buffers in place from checkpoint ``path``.

    The module's state-dict key ``k`` is read from checkpoint tensor ``prefix + k``; ``path`` may be
    any format :class:`~ucp_dcp.Checkpoint` reads (for a Hugging Face model saved from the same
    class, ``prefix=""``). Each tensor is read straight into the module's own storage when dtypes
    agree, and through the bounded staging buffer (cast to the module's dtype, or copied to its
    device) otherwise: no full copy of the model is ever made.

    With ``strict`` (the default) a module key missing from the checkpoint,
    or a checkpoint tensor under ``prefix`` that the module lacks, is an
    error that lists the keys, as with the load planner. A key whose tensor is
    another key's (tied weights, as ``lm_head.weight`` with
    ``tie_word_embeddings``) is not missing when the checkpoint holds the
    other: the one read fills both, as ``from_pretrained`` does. A shape
    mismatch is always an error naming the tensor and both shapes.

    ``options`` and ``storage_options`` are :class:`~ucp_dcp.Checkpoint`'s: by default every
    byte read is checked against the checksums recorded at save.
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgumentTypeError(
            f"load_into_module: module must be a torch.nn.Module, got {type(module).__name__}"
        )
    if not isinstance(prefix, str):
        raise InvalidArgumentTypeError(f"load_into_module: prefix must be a string, got {prefix!r}")
    check_flags("load_into_module", strict=strict)
    targets = module.state_dict(keep_vars=True)
    with Checkpoint(path, options=options, storage_options=storage_options) as ckpt:
        available = {n[len(prefix) :] for n in ckpt.tensor_names() if n.startswith(prefix)}
        # A tied weight (``lm_head.weight`` sharing the embedding's storage) is one tensor under
        # two keys, and Hugging Face saves it once: it is filled when its twin is read.
        filled = {_same_memory(t) for k, t in targets.items() if k in available}
        missing = sorted(
            k for k in targets if k not in available and _same_memory(targets[k]) not in filled
        )
        unexpected = sorted(k for k in available if k not in targets)
        if strict and (missing or unexpected):
            raise CheckpointKeyError(
                f"{os.fspath(path)}: loading into {type(module).__name__} with prefix {prefix!r}: "
                f"missing keys [{listed(list(map(repr, missing)), 20)}], "
                f"unexpected keys [{listed(list(map(repr, unexpected)), 20)}]. "
                "Pass strict=False to load the keys that match"
            )
        for key, target in targets.items():
            if key not in available:
                continue
            rec = ckpt.tensor_record(prefix + key)
            if tuple(target.shape) != rec.shape:
                raise CheckpointKeyError(
                    f"size mismatch for {prefix + key!r}: the checkpoint has shape "
                    f"{list(rec.shape)}, "
                    f"the module expects {list(target.shape)}"
                )
            if hasattr(target, "device_mesh"):
                raise InvalidArgumentTypeError(
                    f"{key!r} is a DTensor: use dcp.load with UCPStorageReader/UCPLoadPlanner for "
                    "sharded modules"
                )
            with torch.no_grad():
                ckpt.read_into(prefix + key, target.detach())
    return ModuleLoadResult(missing, unexpected)
