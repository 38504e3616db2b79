"""Checkpoint formats under comparison: storage writer/reader and planner factories, save/load calls.

=======  ==============================================  ====================================
format   writer / reader                                 planners
=======  ==============================================  ====================================
``dcp``  ``FileSystemWriter`` / ``FileSystemReader``     DCP defaults
``ucp``  ``UCPStorageWriter`` / ``UCPStorageReader``     ``UCPSavePlanner`` / ``UCPLoadPlanner``
``hf``   ``HuggingFaceStorageWriter`` (distributed,      DCP defaults
         consolidated) / ``HuggingFaceStorageReader``
=======  ==============================================  ====================================

ucp_dcp is imported lazily, so DCP-only runs work while it is missing or
broken. Keyword options go to the writer's or reader's constructor.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

FORMATS = ("dcp", "ucp", "hf")


_CLASS_PREFIX = {"dcp": "FileSystem", "ucp": "UCPStorage", "hf": "HuggingFaceStorage"}
_HF_WRITER = {"save_distributed": True, "enable_consolidation": True}  # consolidated full-tensor safetensors


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")


def _ucp(name: str) -> Any:
    import ucp_dcp

    return getattr(ucp_dcp, name)


def save_planner(fmt: str, default_planner: bool = True) -> SavePlanner | None:
    """``UCPSavePlanner`` for ucp; for DCP's formats a ``DefaultSavePlanner``, or None (``dcp.save``'s default)."""
    _check(fmt)
    if fmt == "ucp":
        return _ucp("UCPSavePlanner")()
    return DefaultSavePlanner() if default_planner else None


def load_planner(fmt: str, default_planner: bool = True) -> LoadPlanner | None:
    """``UCPLoadPlanner`` for ucp; for DCP's formats a ``DefaultLoadPlanner``, or None (``dcp.load``'s default)."""
    _check(fmt)
    if fmt == "ucp":
        return _ucp("UCPLoadPlanner")()
    return DefaultLoadPlanner() if default_planner else None


def _storage_class(fmt: str, side: str) -> type:
    name = _CLASS_PREFIX[fmt] + side
    return _ucp(name) if fmt == "ucp" else getattr(dcp, name)


def make_writer(fmt: str, path: str, *, default_planner: bool = False,
                **options: Any) -> tuple[StorageWriter, SavePlanner | None]:
    """(storage writer, save planner) of ``fmt`` writing to ``path``; planner as :func:`save_planner`.

    hf: every rank writes its shards, then the coordinator consolidates them
    into plain full-tensor safetensors (the usual HF layout) in ``path``.
    """
    planner = save_planner(fmt, default_planner)
    options = {**_HF_WRITER, **options} if fmt == "hf" else options
    return _storage_class(fmt, "Writer")(path, **options), planner


def make_reader(fmt: str, path: str, *, default_planner: bool = False,
                **options: Any) -> tuple[StorageReader, LoadPlanner | None]:
    """(storage reader, load planner) of ``fmt`` reading ``path``; planner as :func:`load_planner`.
    For ``ucp``, the fields of ``ReadOptions`` among ``options`` go to the reader as its ``options``."""
    planner = load_planner(fmt, default_planner)
    if fmt == "ucp":
        read_options = _ucp("ReadOptions")
        knobs = {k: options.pop(k) for k in list(options) if k in read_options.__dataclass_fields__}
        if knobs:
            options["options"] = read_options(**knobs)
    return _storage_class(fmt, "Reader")(path, **options), planner


def metadata_file(fmt: str) -> str:
    """Name of the file in which ``fmt`` keeps its checkpoint metadata."""
    return {"dcp": ".metadata", "ucp": "ucp_index.json"}[fmt]


def save_state(fmt: str, state: dict[str, Any], path: str, *, options: dict[str, Any] | None = None,
               **save_kwargs: Any) -> StorageWriter:
    """``dcp.save`` of ``state`` to ``path`` in ``fmt``; ``save_kwargs`` go to ``dcp.save``. Returns the writer."""
    writer, planner = make_writer(fmt, path, **(options or {}))
    dcp.save(state, storage_writer=writer, planner=planner, **save_kwargs)
    return writer


def async_save_state(fmt: str, state: dict[str, Any], path: str, *, options: dict[str, Any] | None = None,
                     **save_kwargs: Any) -> Any:
    """``dcp.async_save`` of ``state`` to ``path`` in ``fmt``; returns what it returns (a future)."""
    writer, planner = make_writer(fmt, path, **(options or {}))
    return dcp.async_save(state, storage_writer=writer, planner=planner, **save_kwargs)


def load_state(fmt: str, state: dict[str, Any], path: str, *, options: dict[str, Any] | None = None,
               **load_kwargs: Any) -> StorageReader:
    """``dcp.load`` of ``path`` (format ``fmt``) into ``state``; returns the reader (for its counters)."""
    reader, planner = make_reader(fmt, path, **(options or {}))
    dcp.load(state, storage_reader=reader, planner=planner, **load_kwargs)
    return reader


def round_trip(fmt: str, path: str, saved: dict[str, Any], target: dict[str, Any] | None,
               group: dist.ProcessGroup | None = None) -> None:
    """An untimed save (and load into ``target``, if given) that pays one-off costs before timing.

    The first ``dcp.save``/``dcp.load`` in a process pays lazy imports, first
    collectives and planner caches; without a warm-up, whichever format is
    timed first would carry them.
    """
    save_state(fmt, saved, path, process_group=group)
    if target is not None:
        load_state(fmt, target, path, process_group=group)


def reader_counters(reader: StorageReader) -> dict[str, Any]:
    """A storage reader's plain counters and settings after a load (numbers, strings, flags, flat dicts).

    Whatever the reader keeps in its attributes, so statistics a reader
    gains later (an access strategy, request counts) reach the result JSON
    without the benchmarks naming them. Paths, options and ids are left out.
    """
    plain = (bool, int, float, str)
    out: dict[str, Any] = {}
    for k, v in vars(reader).items():
        if k.startswith("_") or k in ("path", "storage_options", "load_id", "options"):
            continue
        if isinstance(v, plain) or v is None:
            out[k] = v
        elif isinstance(v, dict) and all(isinstance(x, plain) for x in v.values()):
            out[k] = {str(a): b for a, b in v.items()}
    # What the last load found (ucp_dcp's LoadReport, replaced on every load): its plain fields.
    report = getattr(reader, "last_load", None)
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        for field in dataclasses.fields(report):
            v = getattr(report, field.name)
            if isinstance(v, plain) or v is None:
                out[field.name] = v
            elif isinstance(v, dict) and all(isinstance(x, plain) for x in v.values()):
                out[field.name] = {str(a): b for a, b in v.items()}
    stats = getattr(reader, "stats", None)
    if callable(stats):
        try:
            got = stats()
        except Exception as e:  # a counter must never fail a benchmark
            got = f"stats() raised {type(e).__name__}: {e}"
        # JSON-able whatever it holds: the result file is written with plain json.dump
        out["stats()"] = json.loads(json.dumps(got, default=repr)) if isinstance(got, dict) else repr(got)
    return out
