"""Progress bars on stderr for the ``ucp-dcp`` command line, drawn by tqdm.

A :class:`ProgressBar` is a ``progress(done, total)`` callback: pass it to
``Checkpoint.verify``, ``diff_checkpoints`` or the conversion functions (any
callable with that signature works there; this one draws). tqdm draws the
bar with its rate and time left; the bar draws only when its stream is a
terminal (or when forced) and ends its line when ``done`` reaches ``total``
or when it is closed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

__all__ = ["ProgressFn", "ProgressBar", "format_bytes", "size_bytes"]

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


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def size_bytes(text: str) -> int | None:
    """Bytes in ``'5GB'`` (decimal, as Hugging Face counts), ``'512MiB'`` (binary) or ``'1000'``
    (any case, blanks around); None when ``text`` is not a size. Callers check the sign."""
    m = _SIZE_RE.fullmatch(text)
    scale = _SIZE_UNITS.get(m.group(2).upper()) if m else None
    if m is None or scale is None:
        return None
    return int(float(m.group(1)) * scale)


class ProgressBar:
    """A ``progress(done, total)`` callback that draws ``label: 45%|####  | 1.2G/2.6G [rate, ETA]``.

    Args:
        label: text in front of the bar.
        stream: where to draw (stderr by default).
        enabled: force drawing on (True) or off (False); None draws only when ``stream`` is a
            terminal.
        min_interval: least seconds between two redraws (the final state is always drawn).
    """

    def __init__(
        self,
        label: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        min_interval: float = 0.1,
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_tty(self.stream) if enabled is None else enabled
        self.min_interval = min_interval
        self._bar: tqdm[None] | None = None

    def __call__(self, done: int, total: int) -> None:
        """Report that ``done`` of ``total`` bytes (or units) are finished."""
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = tqdm(
                total=max(total, 0),
                desc=self.label or None,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                file=self.stream,
                mininterval=self.min_interval,
                miniters=1,
                dynamic_ncols=True,
            )
        bar = self._bar
        if bar.total != max(total, 0):
            bar.total = max(total, 0)
        bar.update(done - bar.n)
        if total <= 0 or done >= total:
            self.close()

    def close(self) -> None:
        """End the bar's line, if one is open, so later output starts clean."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
