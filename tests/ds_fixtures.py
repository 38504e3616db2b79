"""The DeepSpeed fixtures' generator scripts (tests/fixtures/deepspeed/generate*.py) as modules,
and a way to rewrite one of their files without DeepSpeed (:func:`resave`).

The tests rebuild the fixtures' models, batches and losses from them; each script imports
deepspeed only inside its worker, so they load without it.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

DEEPSPEED_FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"


def generator(script: str) -> ModuleType:
    """``DEEPSPEED_FIXTURES / script`` as a module, loaded once (their dataclasses look their
    module up in ``sys.modules``)."""
    name = f"ds_fixture_{Path(script).stem}"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, DEEPSPEED_FIXTURES / script)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


def _standin(module: str, name: str) -> type:
    cls = type(name, (), {})
    cls.__module__, cls.__qualname__ = module, name
    return cls


class _ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


_ZeroStageEnum.__module__, _ZeroStageEnum.__qualname__ = "deepspeed.runtime.zero.config", "ZeroStageEnum"

STANDINS: list[type] = [
    _standin("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    _standin("deepspeed.utils.tensor_fragment", "fragment_address"),
    _standin("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
    _ZeroStageEnum,
]
"""Stand-ins for the DeepSpeed classes the fixtures' pickles name (module and name as
DeepSpeed's): ``torch.load(weights_only=True)`` reads the files with them as safe globals."""


def _standins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make :data:`STANDINS` importable under DeepSpeed's module names, so that a test can load a
    file with ``torch.load``, change an entry and save it back without DeepSpeed."""
    for cls in STANDINS:
        module = cls.__module__
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in sys.modules:
                m = types.ModuleType(name)
                m.__path__ = []  # type: ignore[attr-defined]  # a package: its children import
                monkeypatch.setitem(sys.modules, name, m)
            if i > 1:
                parent = sys.modules[".".join(parts[: i - 1])]
                monkeypatch.setattr(parent, parts[i - 1], sys.modules[name], raising=False)
        monkeypatch.setattr(sys.modules[module], cls.__qualname__, cls, raising=False)


def resave(path: Path, edit: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrite the DeepSpeed file ``path`` as ``edit(its object)``, or the object as ``edit``
    changed it in place where ``edit`` returns None (DeepSpeed's classes: stand-ins)."""
    _standins(monkeypatch)
    obj = torch.load(path, weights_only=False)
    out = edit(obj)
    torch.save(obj if out is None else out, path)
