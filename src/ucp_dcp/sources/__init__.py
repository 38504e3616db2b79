"""Checkpoint sources: every format the readers understand, behind one seam (:class:`Source`).

:func:`open_source` detects the format of a path and opens it. The formats,
tried in this order:

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
from typing import Any

from ..byteio.objstore import ObjectStore, is_url, local_path
from ..errors import CheckpointFormatError, NotACheckpointError
from ..format import INDEX_FILE
from ._dcp_metadata import DCP_METADATA_FILE
from ._dirs import StoreDir
from ._ds_utils import LATEST_FILE, looks_like_deepspeed
from ._hf_utils import _NATIVE_DATA_FILE, HF_INDEX_NAME, HF_WEIGHTS_NAME, looks_like_hf
from .base import Source, SourceOptions, read_value, register, source_types

# Registration order is detection order: keep these imports in this order.
# isort: off
from .native import NativeSource
from .distcp import DCPSource
from .deepspeed import DeepSpeedSource
from .ds_universal import DeepSpeedUniversalSource
from .hf import HFSource
from .composite import CompositeSource
# isort: on

__all__ = [
    "Source",
    "SourceOptions",
    "open_source",
    "checkpoint_exists",
    "read_value",
    "register",
    "source_types",
    "NativeSource",
    "DCPSource",
    "HFSource",
    "DeepSpeedSource",
    "DeepSpeedUniversalSource",
    "CompositeSource",
]


def open_source(
    path: str | os.PathLike[str],
    options: SourceOptions | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Source:
    """Open the checkpoint at ``path``, detecting its format.

    ``options`` (or its fields as keyword arguments, see
    :class:`SourceOptions`) tune the formats that need them. A path no format
    recognises fails as a native checkpoint would, with
    :class:`~ucp_dcp.CheckpointFormatError` naming the path and what is
    missing. An fsspec URL (``s3://bucket/ckpt``; ``storage_options`` go to
    fsspec) opens a checkpoint in object storage, read with ranged requests:
    a native one (``ucp_index.json``), one in DCP's ``FileSystemWriter`` /
    ``FsspecWriter`` format (``.metadata``), a DeepSpeed ZeRO checkpoint
    (the directory with ``latest``, or a tag folder), or a Hugging Face
    safetensors model (the URL of its directory, or of one ``.safetensors``
    file or index).
    """
    if is_url(path):
        return _open_url(os.fspath(path), options or SourceOptions(**kwargs), storage_options)
    path = local_path(path)
    opts = options if options is not None else SourceOptions(**kwargs)
    if not os.path.exists(path):
        raise NotACheckpointError(f"{path}: not a checkpoint (no such directory)", path)
    for cls in source_types():
        if cls.detect(path):
            return cls.open(path, opts)
    if os.path.isdir(path) and any(_NATIVE_DATA_FILE.fullmatch(n) for n in os.listdir(path)):
        # Data files and no index: a save that did not finish (its error says how to recover).
        return NativeSource.open(path, opts)
    formats = [c.format for c in source_types()]
    what = "a file" if os.path.isfile(path) else "a directory that none of them recognises"
    raise NotACheckpointError(
        f"{path}: not a checkpoint: looked for the formats {', '.join(formats)} "
        f"({INDEX_FILE}, {DCP_METADATA_FILE}, {LATEST_FILE}, {HF_WEIGHTS_NAME}, ...); it is {what}",
        path,
        formats,
    )


def _open_url(url: str, options: SourceOptions, storage_options: dict[str, Any] | None) -> Source:
    """The checkpoint at fsspec URL ``url``: native if ``ucp_index.json`` is there, else DCP's
    format if
    ``.metadata`` is, else DeepSpeed's if ``latest`` or a rank's optimizer file is, else a Hugging
    Face model."""
    parent, _, last = url.rstrip("/").rpartition("/")
    if "://" in parent and last.endswith((".safetensors", ".safetensors.index.json")):
        # One file named directly, as a local path may name one.
        return HFSource.open_store(ObjectStore(parent, storage_options), options, named=last)
    store = ObjectStore(url, storage_options)
    # One GET, rather than asking whether it exists first.
    raw_index = store.read_if_exists(INDEX_FILE)
    if raw_index is not None:
        return NativeSource(store.url, store, raw_index)
    model_dir = StoreDir(store)  # listed once: detection and opening share the listing
    if model_dir.is_file(DCP_METADATA_FILE):
        return DCPSource.open_store(store, options, model_dir)
    if looks_like_deepspeed(model_dir):
        return DeepSpeedSource.open_store(store, options, model_dir)
    if looks_like_hf(model_dir):
        return HFSource(store.url, options.prefix, model_dir=model_dir)
    listing = sorted(model_dir.list())
    held = (
        f"it holds {', '.join(listing[:10])}{' ...' if len(listing) > 10 else ''}"
        if listing
        else "it is empty"
    )
    raise CheckpointFormatError(
        f"{store.url}: not a ucp_dcp checkpoint: {INDEX_FILE} is missing; nor a DCP checkpoint: no "
        f"{DCP_METADATA_FILE}; nor a DeepSpeed ZeRO checkpoint: no {LATEST_FILE} or "
        "*zero_pp_rank_*_optim_states.pt files; nor a Hugging Face safetensors model: no "
        f"{HF_WEIGHTS_NAME}, "
        f"{HF_INDEX_NAME} or single .safetensors file ({held}). A save that did not finish leaves "
        "no index. "
        "Object storage is read for these four formats only; copy a DeepSpeed Universal "
        "checkpoint to a local "
        "directory first"
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
