"""pytest hooks for the PyTorch DCP test harness (tests/torch_dcp).

* The PyTorch tests under ``upstream/`` are collected only when
  ``UCP_DCP_TORCH_TESTS=1`` (``run.py`` sets it), so the project's default
  ``pytest`` run does not pick them up.
* With ``UCP_DCP_SUBSTITUTE=1`` the package ``__init__`` (imported before this
  file) has already replaced DCP's default classes by the UCP ones.
* ``UCP_DCP_TEST_TIMEOUT`` (seconds, default 300) bounds each test's call
  phase with SIGALRM; a test past it fails with :class:`TestTimeout`.
* ``UCP_DCP_RESULTS`` names a JSON-lines file that receives one record per
  test phase: node id, phase, outcome, the exception line and the duration.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import pytest

from . import substitute

collect_ignore_glob: list[str] = []
if os.environ.get("UCP_DCP_TORCH_TESTS", "") in ("", "0"):
    collect_ignore_glob.append("upstream/*")


class TestTimeout(Exception):
    """A PyTorch test ran past UCP_DCP_TEST_TIMEOUT."""

    __test__ = False


def _on_alarm(signum, frame):  # pragma: no cover - fires only on a hung test
    raise TestTimeout(f"test ran past UCP_DCP_TEST_TIMEOUT={os.environ.get('UCP_DCP_TEST_TIMEOUT', '300')}s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    seconds = int(os.environ.get("UCP_DCP_TEST_TIMEOUT", "300") or 0)
    armed = seconds > 0 and threading.current_thread() is threading.main_thread()
    if armed:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(seconds)
    try:
        yield
    finally:
        if armed:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


# "SomeError: message" lines of a traceback text, pytest's "E   " prefix allowed
# (also inside a child rank's traceback, captured on stderr or re-raised by
# MultiProcessTestCase in the parent).
_EXC_LINE = re.compile(
    r"^(?:E\s+)?\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Timeout|Unsupported|Interrupt))(?::\s?(.*))?$"
)
_PREFIX = re.compile(r"^(?:E\s+)?\s*")


def _is_wrapper(typ: str, msg: str) -> bool:
    """Exceptions that only carry another one: DCP's per-rank wrapper, the harness's rank checks."""
    if typ == "CheckpointException":
        return True
    if typ == "RuntimeError" and msg.startswith("Process ") and ("exited with error code" in msg or "timed out" in msg):
        return True
    if typ == "AssertionError" and (not msg or msg.startswith("Scalars are not equal")):
        return True  # MultiProcessTestCase's exit-code check; the rank's own error is elsewhere
    return False


def _shorten(msg: str, limit: int = 150) -> str:
    """Collapse the longest parenthesised reprs of a long message, so one cause reads (and groups) the same."""
    msg = re.sub(r"\s+", " ", msg).strip()
    while True:
        groups = list(re.finditer(r"\(([^()]*)\)", msg))
        if not groups:
            break
        g = max(groups, key=lambda m: len(m.group(0)))
        # Any innermost group of 60+ characters goes; shorter ones only while the message is long.
        if len(g.group(0)) >= 60 or (len(msg) > limit and len(g.group(0)) > 12):
            msg = msg[: g.start()] + "<...>" + msg[g.end():]
        else:
            # Keep the short groups, but hide their parentheses so the groups around them become innermost.
            msg = re.sub(r"\(([^()]*)\)", "\x01\\1\x02", msg)
    return msg.replace("\x01", "(").replace("\x02", ")")


def cause_of(*texts: str) -> str:
    """The most telling ``Type: message`` of a failure: the first non-wrapper exception line found."""
    found: list[tuple[str, str]] = []
    for text in texts:
        lines = text.splitlines()
        for n, line in enumerate(lines):
            m = _EXC_LINE.match(line)
            if not m:
                continue
            typ = m.group(1).rsplit(".", 1)[-1]
            msg = (m.group(2) or "").strip()
            if msg.endswith(":") and n + 1 < len(lines):
                msg += " " + _PREFIX.sub("", lines[n + 1]).strip()
            found.append((typ, msg))
    for typ, msg in found:
        if not _is_wrapper(typ, msg):
            return f"{typ}: {_shorten(msg)}"[:200]
    if found:
        typ, msg = found[-1]
        return f"{typ}: {_shorten(msg)}"[:200]
    for text in texts:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if lines:
            return lines[-1][:200]
    return ""


def pytest_runtest_logreport(report):
    path = os.environ.get("UCP_DCP_RESULTS")
    if not path:
        return
    if report.when != "call" and report.outcome == "passed":
        return
    rec = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": round(report.duration, 3),
        "substituted": substitute.is_active(),
    }
    if report.outcome == "skipped":
        lr = report.longrepr
        rec["reason"] = (lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr))[:200]
    elif report.outcome == "failed":
        text = report.longreprtext or ""
        # A rank's own traceback is on the captured stderr; DCP's and the
        # harness's wrappers are in the report text.
        captured = [content for title, content in report.sections if "stderr" in title]
        rec["cause"] = cause_of(*captured, text)
        rec["timeout"] = "TestTimeout" in text
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
