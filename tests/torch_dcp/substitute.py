"""Make DCP's default classes be ucp_dcp's, so PyTorch's own DCP tests run against ucp_dcp.

:func:`activate` replaces, in every loaded ``torch.distributed.checkpoint``
module, the names

* ``FileSystemWriter`` / ``FileSystemReader`` (what ``dcp.FileSystemWriter(...)``
  builds, and what ``dcp.save``/``dcp.load`` pick through ``_storage_setup``
  when only a ``checkpoint_id`` is given),
* ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` (what ``dcp.save``/``dcp.load``
  use when no planner is given, and what a test builds by those names)

with thin subclasses of :class:`ucp_dcp.UCPStorageWriter`,
:class:`ucp_dcp.UCPStorageReader`, :class:`ucp_dcp.UCPSavePlanner` and
:class:`ucp_dcp.UCPLoadPlanner` that take DCP's constructor arguments.

Every ``torch.distributed.checkpoint`` submodule is imported *before* the
names are replaced, so DCP's own subclasses (``FsspecWriter``,
``HuggingFaceStorageWriter``, ``_EmptyStateDictLoadPlanner``,
``DynamicMetaLoadPlanner``, ...) keep DCP's classes as their bases; only code
that looks the names up after activation (test modules, ``_storage_setup``,
``save``/``load`` defaults, ``format_utils``) gets the UCP classes.

Argument mapping (DCP argument -> what the substitute does):

* ``FileSystemWriter(path, single_file_per_rank, sync_files, thread_count,
  per_thread_copy_ahead, cache_staged_state_dict, overwrite, _extensions,
  serialization_format)``: ``path``, ``sync_files`` and ``overwrite`` (DCP's
  default ``True``) go to ``UCPStorageWriter``; layout and threading options
  have no UCP counterpart and are accepted and ignored; a non-empty
  ``_extensions`` (stream transforms such as ZStandard) raises
  :class:`SubstitutionUnsupported`, since UCP data files have no per-stream
  transforms.
* ``FileSystemReader(path, _extension_registry)``: ``UCPStorageReader(path,
  dcp_values="weights_only")``, so a checkpoint that DCP itself wrote (one
  the substitution did not reach) still loads its pickled values.
* ``DefaultSavePlanner(...)``: ``UCPSavePlanner()`` with its defaults; DCP's
  flattening/dedup/caching flags are accepted and ignored (UCP always
  flattens and writes each replicated value once).
* ``DefaultLoadPlanner(flatten_state_dict, flatten_sharded_tensors,
  allow_partial_load)``: ``UCPLoadPlanner(allow_partial_load=...)``.

The substitution is active in a process when ``UCP_DCP_SUBSTITUTE=1`` is in
its environment and ``tests/torch_dcp`` (the package) is imported: the
harness's ``conftest.py`` in the pytest process and the package
``__init__`` in every rank that PyTorch's multi-process test harness spawns.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Any

from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter

ENV = "UCP_DCP_SUBSTITUTE"
# When set, every process that activates appends "<pid> <names replaced>" to this file.
LOG_ENV = "UCP_DCP_SUBSTITUTE_LOG"

_NAMES = ("FileSystemWriter", "FileSystemReader", "DefaultSavePlanner", "DefaultLoadPlanner")
_originals: dict[str, type] = {}
_patched: list[tuple[Any, str, Any]] = []


class SubstitutionUnsupported(NotImplementedError):
    """A DCP option that the UCP classes have no counterpart for."""


def requested() -> bool:
    """True when the environment asks for the substitution."""
    return os.environ.get(ENV, "") not in ("", "0")


def is_active() -> bool:
    """True once :func:`activate` has replaced DCP's names in this process."""
    return bool(_patched)


class FileSystemWriter(UCPStorageWriter):
    """UCPStorageWriter under DCP's ``FileSystemWriter`` signature (harness substitute)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Any = None,
        serialization_format: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if _extensions:
            names = ", ".join(type(e).__name__ for e in _extensions)
            raise SubstitutionUnsupported(
                f"FileSystemWriter(_extensions=[{names}]): UCP data files have no stream transforms"
            )
        super().__init__(path, overwrite=overwrite, sync_files=sync_files)


class FileSystemReader(UCPStorageReader):
    """UCPStorageReader under DCP's ``FileSystemReader`` signature (harness substitute)."""

    def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, dcp_values="weights_only")


class DefaultSavePlanner(UCPSavePlanner):
    """UCPSavePlanner under DCP's ``DefaultSavePlanner`` signature (harness substitute)."""

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__()


class DefaultLoadPlanner(UCPLoadPlanner):
    """UCPLoadPlanner under DCP's ``DefaultLoadPlanner`` signature (harness substitute)."""

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(allow_partial_load=allow_partial_load)


_SUBSTITUTES: dict[str, type] = {
    "FileSystemWriter": FileSystemWriter,
    "FileSystemReader": FileSystemReader,
    "DefaultSavePlanner": DefaultSavePlanner,
    "DefaultLoadPlanner": DefaultLoadPlanner,
}


def _import_dcp_modules() -> None:
    """Import every torch.distributed.checkpoint submodule, so their subclasses bind to DCP's classes."""
    import torch.distributed.checkpoint as dcp

    for info in pkgutil.walk_packages(dcp.__path__, dcp.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except Exception:  # optional dependencies, experimental modules
            pass


def activate() -> None:
    """Replace DCP's default classes by the UCP substitutes in every loaded DCP module."""
    if _patched:
        return
    _import_dcp_modules()
    from torch.distributed.checkpoint import default_planner, filesystem

    _originals.update(
        FileSystemWriter=filesystem.FileSystemWriter,
        FileSystemReader=filesystem.FileSystemReader,
        DefaultSavePlanner=default_planner.DefaultSavePlanner,
        DefaultLoadPlanner=default_planner.DefaultLoadPlanner,
    )
    subs = _SUBSTITUTES
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "torch.distributed.checkpoint" or mod_name.startswith("torch.distributed.checkpoint.")):
            continue
        for name in _NAMES:
            if getattr(mod, name, None) is _originals[name]:
                _patched.append((mod, name, _originals[name]))
                setattr(mod, name, subs[name])
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {len(_patched)}\n")


def deactivate() -> None:
    """Put DCP's classes back where :func:`activate` replaced them."""
    while _patched:
        mod, name, orig = _patched.pop()
        setattr(mod, name, orig)


def original(name: str) -> type:
    """DCP's own class ``name`` (valid after :func:`activate`)."""
    return _originals[name]
