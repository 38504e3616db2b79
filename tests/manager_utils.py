"""Deterministic training states for the CheckpointManager tests (and their crash worker)."""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from dist_utils import bit_equal


def make_state(step: int, *, scale: int = 1) -> dict[str, Any]:
    """A nested state whose every value is a function of ``step`` (so any step can be re-derived)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {
            "embed.weight": torch.randn(37 * scale, 24, generator=g),
            "layer.weight": torch.randn(24, 24 * scale, generator=g).to(torch.bfloat16),
            "layer.bias": torch.randn(24, generator=g, dtype=torch.float64),
        },
        "optim": {"state": {"count": torch.tensor(step, dtype=torch.int64)}, "lr": 0.01 * (step + 1)},
        "step": step,
        "history": [step, step * 2],
    }


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """Same structure, tensors filled with a sentinel, values changed (a load must overwrite all)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = empty_like_state(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, 13)
        else:
            out[k] = -1 if isinstance(v, (int, float)) else None
    return out


def assert_state_equal(got: Any, want: Any, path: str = "") -> None:
    """Bit-exact equality of nested states (tensors by bytes, other values by ==)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {set(got) ^ set(want)}"
        for k in want:
            assert_state_equal(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and bit_equal(got, want), f"{path}: tensor differs"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def flip_byte(path: str, rng: random.Random, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
    """XOR one byte of ``path`` in [lo, hi) with a random non-zero mask; returns (offset, old byte)."""
    size = os.path.getsize(path)
    hi = size if hi is None else hi
    off = rng.randrange(lo, hi)
    with open(path, "r+b") as f:
        f.seek(off)
        old = f.read(1)[0]
        f.seek(off)
        f.write(bytes([old ^ rng.randrange(1, 256)]))
    return off, old


def restore_byte(path: str, off: int, old: int) -> None:
    """Undo :func:`flip_byte`."""
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(bytes([old]))
