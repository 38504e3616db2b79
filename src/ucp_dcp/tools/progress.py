"""A tiny progress bar on stderr, for the ``ucp-dcp`` command line.

No dependencies. A :class:`ProgressBar` is a ``progress(done, total)``
callback: pass it to ``Checkpoint.verify``, ``diff_checkpoints`` or the
conversion functions. It draws only when its stream is a terminal (or when
forced), redraws at most every ``min_interval`` seconds, and ends its line
when ``done`` reaches ``total`` or when it is closed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["ProgressFn", "ProgressBar", "format_bytes"]

ProgressFn = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``: called as work proceeds."""

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def format_bytes(n: int | float) -> str:
    """``'1.5 GB'`` for 1.5e9: decimal units, three significant digits."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1000 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


class ProgressBar:
    """``label [#####.....]  45%  1.2 GB / 2.6 GB`` on one self-overwriting line.

    Args:
        label: text in front of the bar.
        stream: where to draw (stderr by default).
        enabled: force drawing on (True) or off (False); None draws only
            when ``stream`` is a terminal.
        width: characters inside the brackets.
        min_interval: least seconds between two redraws (the final state is
            always drawn).
    """

    def __init__(
        self,
        label: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        width: int = 30,
        min_interval: float = 0.1,
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_tty(self.stream) if enabled is None else enabled
        self.width = max(width, 1)
        self.min_interval = min_interval
        self._last_draw = float("-inf")
        self._open_line = False  # something drawn on a line not yet ended

    def __call__(self, done: int, total: int) -> None:
        """Report that ``done`` of ``total`` bytes (or units) are finished."""
        if not self.enabled:
            return
        finished = total <= 0 or done >= total
        now = time.monotonic()
        if not finished and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        self.stream.write("\r" + self.render(done, total))
        self._open_line = True
        if finished:
            self.close()
        else:
            self.stream.flush()

    def render(self, done: int, total: int) -> str:
        """The text of the bar for ``done`` of ``total`` (no control characters)."""
        frac = 1.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        prefix = f"{self.label} " if self.label else ""
        return f"{prefix}[{bar}] {frac * 100:3.0f}%  {format_bytes(done)} / {format_bytes(total)}"

    def close(self) -> None:
        """End the bar's line, if one is open, so later output starts clean."""
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
