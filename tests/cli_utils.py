"""Running the ``ucp-dcp`` command in-process, for the CLI tests."""

from __future__ import annotations

import pytest

from ucp_dcp.tools.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """``ucp-dcp *argv`` in this process: ``(exit status, stdout, stderr)``."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    """The one ``ucp-dcp: error: ...`` line a failed command prints (asserted: one line, no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ucp-dcp: error: "), err
    assert "Traceback" not in err
    return lines[0]
