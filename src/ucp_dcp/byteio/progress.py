"""Progress of long work: a load or save logged per rank (:class:`Progress`), a command drawn as a
bar (:class:`ProgressBar`, tqdm, only on a terminal unless forced); :func:`format_bytes` writes
byte counts for people to read. What the lines say and when: docs/storage-speed.md ("The slow rank
named").

Why logging and not tqdm for loads and saves: a job of many ranks writes log files, not terminals;
one line per rank per interval is what an operator can grep for the rank that lags, and the
logging configuration routes or silences it. Why no thread: a timer thread per rank for a line
every few seconds costs more than a clock read per request. The price is that a rank whose storage
delivers nothing at all logs nothing until it does; the deadlines on requests are what end such a
wait.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm

from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..format.schema import check_field_types

__all__ = [
    "ProgressConfig",
    "Progress",
    "log",
    "mb",
    "ProgressFn",
    "progress_fn",
    "ProgressBar",
    "format_bytes",
]

log = logging.getLogger("ucp_dcp.progress")


@dataclass(frozen=True)
class ProgressConfig:
    """When a rank logs the progress of a long load or save (``ReadOptions(progress=)``,
    ``UCPStorageWriter(progress=)``)."""

    interval: float = 10.0
    """Seconds between two progress lines of one rank (a line is logged at the first request
    completed after that)."""
    threshold: float = 5.0
    """Seconds a load or save runs before its first line: shorter ones log nothing.
    ``math.inf`` turns the lines off."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.interval > 0 or not self.threshold >= 0:
            raise InvalidArgumentError(
                f"ProgressConfig(interval={self.interval}, threshold={self.threshold}): the "
                "interval must be positive and the threshold at least 0 seconds"
            )


def mb(n: float) -> str:
    """``'12.3 MB'``: bytes (or bytes per second) as progress lines write them."""
    return f"{n / 1e6:.1f} MB"


def _rate(nbytes: float, seconds: float) -> str:
    """``nbytes`` over ``seconds`` as :func:`mb` writes it (0 over no time)."""
    return mb(nbytes / seconds if seconds > 0 else 0.0)


class Progress:
    """Counts the bytes of one load or save of one rank and logs them at ``config``'s interval.

    Args:
        what: the operation as lines name it (``"load of /ckpt"``).
        rank: this rank.
        verb: what is done to the bytes (``"read"``, ``"written"``).
        config: when to log.
        clock: seconds, monotonic (tests pass a fake).

    Not locked: callers that add from several threads serialize the calls (ReadStats adds
    under its lock).
    """

    def __init__(
        self,
        what: str,
        rank: int,
        *,
        verb: str = "read",
        config: ProgressConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.rank = rank
        self.verb = verb
        self.config = config = config if config is not None else ProgressConfig()
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.lines = 0  # progress lines logged so far
        self._next = self.start + config.threshold  # inf when lines are off
        self._mark = (self.start, 0)  # time and bytes at the last line: the recent rate

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes done; log a line if the interval has passed."""
        self.done += nbytes
        now = self.clock()
        if now >= self._next:
            self._line(now)

    def _line(self, now: float) -> None:
        since, at = self._mark
        last = f"; {_rate(self.done - at, now - since)}/s over the last {now - since:.1f} s"
        self._log(now, "", last, "")
        self._mark = (now, self.done)
        self._next = now + self.config.interval

    def _log(self, now: float, done: str, inside: str, after: str) -> None:
        # "rank R: WHAT: [done, ]N MB VERB in T s (RATE/s[inside])[after]"
        total = now - self.start
        log.info(
            "rank %d: %s: %s%s %s in %.1f s (%s/s%s)%s",
            self.rank,
            self.what,
            done,
            mb(self.done),
            self.verb,
            total,
            _rate(self.done, total),
            inside,
            after,
        )
        self.lines += 1

    def finish(self, detail: str = "") -> float:
        """Log the last line (``detail`` appended) if the operation ran past the threshold; its
        seconds so far."""
        now = self.clock()
        total = now - self.start
        if total >= self.config.threshold:
            self._log(now, "done, ", "", f"; {detail}" if detail else "")
        return total


ProgressFn = Callable[[int, int], None]
"""``on_progress(done_bytes, total_bytes)``: called as work proceeds (a :class:`ProgressBar` draws
it)."""


def progress_fn(on_progress: object, who: str) -> ProgressFn:
    """``on_progress`` as an entry point ``who`` takes it: a call that does nothing for None,
    :class:`~ucp_dcp.errors.InvalidArgumentTypeError` naming ``who`` for what cannot be
    called (checked before the work starts, not after its first chunk)."""
    if on_progress is None:
        return lambda done, total: None
    if not callable(on_progress):
        raise InvalidArgumentTypeError(
            f"{who}: on_progress must be a function of (done_bytes, total_bytes), got "
            f"{type(on_progress).__name__}"
        )
    return on_progress


_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def format_bytes(n: int | float) -> str:
    """``'1.5 GB'`` for 1.5e9: decimal units, three significant digits."""
    value = float(n)
    if abs(value) < 1000:
        return f"{int(value)} B"
    for unit in _UNITS[1:]:
        value /= 1000
        if abs(value) < 1000 or unit == _UNITS[-1]:
            break
    return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"


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
