"""Puts the checkout's ``src/`` first on ``sys.path``: the benchmarks measure this ucp_dcp, installed or not."""

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
