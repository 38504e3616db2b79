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
from ..errors import CheckpointFormatError
from .base import Source, SourceOptions, read_value, register, source_types
from .native import NativeSource
from .distcp import DCPSource  # noqa: E402  (registration order is detection order)
from .deepspeed import DeepSpeedSource
from .ds_universal import DeepSpeedUniversalSource
from .hf import HFSource
from .composite import CompositeSource

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
    fsspec) opens a native checkpoint in object storage, read with ranged
    requests.
    """
    if is_url(path):
        return NativeSource.open_store(ObjectStore(os.fspath(path), storage_options))
    path = local_path(path)
    opts = options if options is not None else SourceOptions(**kwargs)
    if not os.path.exists(path):
        raise CheckpointFormatError(f"{path}: not a checkpoint (no such directory)")
    for cls in source_types():
        if cls.detect(path):
            return cls.open(path, opts)
    return NativeSource.open(path, opts)  # raises, naming what is missing


def checkpoint_exists(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether anything is at ``path``: a local file or directory, or, at an fsspec URL, an object or a prefix with objects.

    Tools ask this first so that a path with nothing at it gets "no such
    checkpoint" rather than a format error; it says nothing about the format.
    A store that cannot be reached raises :class:`~ucp_dcp.errors.StorageError`
    naming the URL (once its retries are spent).
    """
    if is_url(path):
        return ObjectStore(os.fspath(path), storage_options).exists("")
    return os.path.exists(local_path(path))
