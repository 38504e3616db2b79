"""The DeepSpeed fixtures' generator scripts (tests/fixtures/deepspeed/generate*.py) as modules.

The tests rebuild the fixtures' models, batches and losses from them; each script imports
deepspeed only inside its worker, so they load without it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
