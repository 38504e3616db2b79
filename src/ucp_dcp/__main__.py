"""``python -m ucp_dcp``: the ``ucp-dcp`` command line."""

import sys

from .tools.cli import main

sys.exit(main())
