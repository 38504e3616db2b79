"""Suite-wide hooks: a test marked ``cuda`` is skipped where no CUDA device is available.

``@pytest.mark.cuda`` is the one way a test says it needs a GPU (setup.cfg registers the
marker): ``pytest -m cuda`` selects exactly these tests, and ``benchmarks/device_run.py --gpu``
runs them on a lent machine. Without CUDA they are reported as skipped, never deselected.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``cuda``-marked tests when ``torch.cuda.is_available()`` is false."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
