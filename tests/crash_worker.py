"""Saves in a loop until killed: the subject of the SIGKILL crash-consistency tests.

Usage: python crash_worker.py ROOT LOCAL|- FIRST_STEP SCALE
Prints "staged N" after each save call returns, "committed N" after each wait().
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from manager_utils import make_state  # noqa: E402
from ucp_dcp import CheckpointManager  # noqa: E402


def main() -> None:
    root, local, first, scale = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    kw = {"local": local, "persistent_interval": 2} if local != "-" else {}
    mgr = CheckpointManager(root, keep_last=2, local_keep_last=1, max_in_flight=2, **kw)
    print("ready", flush=True)
    step = first
    while True:
        mgr.save(step, make_state(step, scale=scale))
        print(f"staged {step}", flush=True)
        if step % 3 == 0:
            mgr.wait()
            print(f"committed {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
