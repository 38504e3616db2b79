"""Which lines of ``src/ucp_dcp`` the test suite runs, ranks included (opt-in; not part of CI).

    .venv/bin/pip install coverage
    .venv/bin/python tests/coverage_run.py [--out DIR] [pytest arguments ...]

``pytest --cov`` alone would miss most of the library: the multi-rank tests run
their ranks in processes forked from a fork server (``tests/dist_utils.py``) or
started by torchrun, and those ranks end with ``os._exit``, which skips
coverage's exit-time save. So every Python process of the run starts coverage
from a ``sitecustomize`` placed first on ``PYTHONPATH``, and that same module
makes ``os._exit`` save the process's data first. The library, tests and
examples are run unchanged.

Writes ``DIR/report.txt`` (``coverage report -m``: every missed line by file)
and ``DIR/coverage.json``, and prints the total. The whole suite takes about
13 minutes on a 2-core machine (the plain suite: 10-12).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_SITECUSTOMIZE = """\
import os
import coverage

coverage.process_startup()
_exit = os._exit


def _save_then_exit(code):
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.stop()
        cov.save()
    _exit(code)


os._exit = _save_then_exit
"""

_RC = """\
[run]
parallel = True
source = ucp_dcp
concurrency = thread,multiprocessing
sigterm = True
data_file = {data}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", default="coverage-report", help="folder for report.txt and coverage.json"
    )
    args, pytest_args = parser.parse_known_args()
    try:
        import coverage  # noqa: F401 - only checks that it is installed
    except ImportError:
        print("coverage is not installed: .venv/bin/pip install coverage", file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parent.parent
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp, "site")
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        rc_file = Path(tmp, "coveragerc")
        rc_file.write_text(_RC.format(data=Path(tmp, "data", ".coverage")))
        Path(tmp, "data").mkdir()
        env = dict(os.environ)
        env["COVERAGE_PROCESS_START"] = str(rc_file)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), str(repo / "src"), env.get("PYTHONPATH")) if p
        )
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", *pytest_args], cwd=repo, env=env
        ).returncode
        cov = [sys.executable, "-m", "coverage"]
        subprocess.run([*cov, "combine", "-q", f"--rcfile={rc_file}"], cwd=repo, check=True)
        with open(out / "report.txt", "w") as report:
            subprocess.run(
                [*cov, "report", "-m", f"--rcfile={rc_file}"], cwd=repo, stdout=report, check=True
            )
        subprocess.run(
            [*cov, "json", "-q", f"--rcfile={rc_file}", "-o", str(out / "coverage.json")],
            cwd=repo,
            check=True,
        )
    print((out / "report.txt").read_text().splitlines()[-1])
    print(f"missed lines by file: {out / 'report.txt'}")
    return tests


if __name__ == "__main__":
    sys.exit(main())
