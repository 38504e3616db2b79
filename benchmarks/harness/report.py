"""Result reporting: units, number formatting, statistics, text and markdown tables, JSON files.

Reported sizes are decimal (``MB`` = 10^6 bytes, ``GB`` = 10^9) unless a
script says MiB. Result JSON goes to ``benchmarks/results/`` (kept in git)
or, for smoke runs, ``out/`` (ignored by git).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MB = 1_000_000
GB = 1_000_000_000
MiB = 1 << 20

BENCH_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = BENCH_DIR / "results"
"""``benchmarks/results``: the JSON (and plots) of runs quoted in the README."""
OUT_DIR = BENCH_DIR.parent / "out"
"""``out/`` at the repository root: smoke-run results, ignored by git."""


def default_out(name: str, quick: bool = False, quick_name: str | None = None) -> str:
    """``results/<name>``, or ``out/<quick_name>`` for a ``--quick`` run that has one."""
    if quick and quick_name:
        return str(OUT_DIR / quick_name)
    return str(RESULTS_DIR / name)


def write_json(path: str | Path, doc: Any, *, indent: int = 2, default: Callable[[Any], Any] | None = None) -> Path:
    """Write ``doc`` as JSON to ``path`` (parent directories made); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=indent, default=default))
    return p


def fmt_num(v: float | None, spec: str, unit: str = "") -> str:
    """``format(v, spec) + unit``, or ``-`` for None."""
    return "-" if v is None else format(v, spec) + unit


def fmt_mb(v: float | None, spec: str = ".1f") -> str:
    """Bytes as decimal MB, or ``-`` for None."""
    return fmt_num(None if v is None else v / MB, spec)


def fmt_seconds(x: float) -> str:
    """``12.3 ms`` below a second, ``1.23 s`` above."""
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def fmt_bytes(x: float) -> str:
    """Bytes in GB, MB or kB, whichever reads best."""
    if x >= GB:
        return f"{x / GB:.2f} GB"
    if x >= MB:
        return f"{x / MB:.1f} MB"
    return f"{x / 1e3:.1f} kB"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return None if a is None or b is None or b == 0 else a / b


def median(xs: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(xs) if xs else None


def paired_ratios(ours: Sequence[float] | None, base: Sequence[float] | None) -> list[float]:
    """``ours[i] / base[i]`` for every repeat ``i`` both ran (repeat ``i`` of both ran back to back)."""
    return [a / b for a, b in zip(ours or [], base or []) if b]


def paired_ratio(ours: Sequence[float] | None, base: Sequence[float] | None) -> float | None:
    """The median of :func:`paired_ratios`, or None: steadier on a busy machine than a ratio of medians."""
    return median(paired_ratios(ours, base))


def verdict(value: float | None, limit: float) -> str:
    """``met`` when ``value <= limit``, ``MISSED`` above it, ``-`` when there is no value."""
    return "-" if value is None else ("met" if value <= limit else "MISSED")


def stats(xs: Sequence[float]) -> dict[str, Any]:
    """n, mean, max, min, median and sum of ``xs`` (just n for none)."""
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "max": max(xs), "min": min(xs),
            "median": statistics.median(xs), "sum": sum(xs)}


@dataclass(frozen=True)
class Column:
    """A fixed-width text-table column: title, width, alignment (``<`` or ``>``), spaces before it."""

    title: str
    width: int = 0
    align: str = ">"
    gap: int = 0


def text_table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[str]:
    """Header line plus one line per row of already-formatted cells."""

    def line(cells: Sequence[str]) -> str:
        return "".join(" " * c.gap + format(cell, f"{c.align}{c.width}") for c, cell in zip(columns, cells))

    return [line([c.title for c in columns]), *(line(r) for r in rows)]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def print_failures(failures: Sequence[str], *, bar: bool = False, limit: int | None = None) -> None:
    """The failures, one per line, on stderr (framed by a bar of ``!`` if asked)."""
    if not failures:
        return
    line = "!" * 78
    print(f"\n{line}" if bar else "", file=sys.stderr)
    print(f"FAILURES ({len(failures)}):", file=sys.stderr)
    for msg in failures[:limit]:
        print(f"  - {msg.strip()}", file=sys.stderr)
    if bar:
        print(line, file=sys.stderr)
