"""Checkpoint sources: every format the readers understand, behind one seam (:class:`Source`).

:func:`open_source` opens a location (a local path or an fsspec URL) as a
directory view (:func:`~ucp_dcp.byteio.location.open_location`) and asks each
registered format, in this order, whether it recognises the view; the first
that does opens it:

========================  ==========================================================
``ucp_dcp`` (native)      ``ucp_index.json`` + safetensors data files (:mod:`.native`)
``dcp``                   DCP's ``FileSystemWriter`` format, Megatron-core ``torch_dist``
                          included (:mod:`.distcp`)
``deepspeed``             a DeepSpeed ZeRO-1/2/3 checkpoint: the directory with ``latest``,
                          or a tag folder (:mod:`.deepspeed`)
``deepspeed-universal``   ``ds_to_universal``'s output, one file per parameter and state
                          (:mod:`.ds_universal`)
``hf``                    a Hugging Face safetensors model (:mod:`.hf`)
``subfolders``            subfolders that are checkpoints, read as one: accelerate's
                          ``pytorch_model_fsdp_0/`` + ``optimizer_0/`` (:mod:`.composite`)
========================  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..byteio.location import ModelDir, StoreDir, open_location
from ..byteio.objstore import ObjectStore, is_url, local_path
from ..byteio.requests import RequestPolicy
from ..errors import CheckpointFormatError, NotACheckpointError, listed
from ..format.names import save_id_of
from .base import Source, SourceOptions, read_values, register, source_types
from .composite import CompositeSource
from .deepspeed import DeepSpeedSource
from .distcp import DCPSource
from .ds_universal import DeepSpeedUniversalSource
from .hf import HFSource
from .native import NativeSource, load_index, missing_index, rebuild_index

__all__ = [
    "Source",
    "SourceOptions",
    "open_source",
    "checkpoint_exists",
    "read_values",
    "register",
    "source_types",
    "formats_looked_for",
    "NativeSource",
    "DCPSource",
    "HFSource",
    "DeepSpeedSource",
    "DeepSpeedUniversalSource",
    "CompositeSource",
    "load_index",
    "rebuild_index",
]


def open_source(
    path: str | os.PathLike[str],
    options: SourceOptions | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    known_files: Mapping[str, bytes] | None = None,
    requests: RequestPolicy | None = None,
    **kwargs: Any,
) -> Source:
    """Open the checkpoint at ``path``, detecting its format.

    ``options`` (or its fields as keyword arguments, see
    :class:`SourceOptions`) tune the formats that need them. ``path`` is a
    local path or an fsspec URL (``s3://bucket/ckpt``; ``storage_options`` go
    to fsspec), read with ranged requests; either is opened as a directory
    view and every registered format is asked, in registration order, whether
    it recognises it (:meth:`Source.detect`). A location no format recognises
    is a :class:`~ucp_dcp.errors.NotACheckpointError` naming it and the
    formats looked for (:func:`formats_looked_for`). ``known_files``: files of
    the checkpoint the caller has already read (name -> bytes, such as an
    index whose digest it checked), opened from these bytes instead of being
    read or fetched again (:meth:`ModelDir.keep`). ``requests``: deadlines and
    hedging of a URL's requests (:class:`~ucp_dcp.byteio.requests.RequestPolicy`).
    """
    opts = options if options is not None else SourceOptions(**kwargs)
    d = open_location(path, storage_options, requests)
    if known_files:
        d.keep(known_files)
    for cls in source_types():
        if cls.detect(d):
            return cls.open(d, opts)
    raise _not_a_checkpoint(d)


def formats_looked_for() -> list[str]:
    """``"<what detection looks for> (<format>)"`` for every registered format, in detection
    order."""
    return [f"{c.looks_for} ({c.title or c.format})" for c in source_types()]


def _not_a_checkpoint(d: ModelDir) -> CheckpointFormatError:
    """The error for view ``d``, which no registered format recognises.

    Native data files without an index are a save that did not finish: a damaged checkpoint
    (``ucp-dcp verify`` exits 1), with the way to recover. Anything else is a
    :class:`NotACheckpointError` naming the location, the formats looked for and what it holds.
    """
    formats = formats_looked_for()
    if d.named is not None:
        held = "it is a file"
        names: list[str] = []
    else:
        names = sorted(d.list())
        held = f"it holds {listed(names)}" if names else "it is empty"
        if not names and isinstance(d, StoreDir):
            # A store lists folders apart from objects; subfolders read as one are read locally.
            folders = sorted(d.store.list_folders())
            if folders:
                held = (
                    f"it holds only folders ({listed(folders)}): open a subfolder's URL, or copy "
                    "the directory down to read its subfolders as one"
                )
    if any(save_id_of(n) is not None for n in names):
        return missing_index(d.location, local=d.store is None)
    return NotACheckpointError(
        f"{d.location} is not a checkpoint: found none of {', '.join(formats)}; {held}",
        d.location,
        formats,
    )


def checkpoint_exists(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> bool:
    """Whether anything is at ``path``: a local file or directory, or, at an fsspec URL, an object
    or a prefix with objects.

    Tools ask this first so that a path with nothing at it gets "no such
    checkpoint" rather than a format error; it says nothing about the format.
    A store that cannot be reached raises :class:`~ucp_dcp.errors.StorageError`
    naming the URL (once its retries are spent).
    """
    if is_url(path):
        return ObjectStore(os.fspath(path), storage_options).exists("")
    return os.path.exists(local_path(path))
