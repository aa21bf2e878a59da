"""``ddpscope ...``: an alias of the ``ddpscope`` command (``tracer/cli.py``)."""

import sys

from ddpscope.tracer.cli import main

sys.exit(main())
