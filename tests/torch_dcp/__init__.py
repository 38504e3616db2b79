"""Harness that runs PyTorch's own DCP tests with ucp_dcp's classes substituted.

See docs/torch-dcp-tests.md. Importing this package activates the
substitution (:mod:`.substitute`) when ``UCP_DCP_SUBSTITUTE=1`` is set: the
ranks that PyTorch's multi-process test harness spawns import the test
module by its package name, so they pass through here before the test code
binds ``FileSystemWriter`` & co.
"""

from . import substitute as _substitute

if _substitute.requested():
    _substitute.activate()
