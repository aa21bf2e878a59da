"""``python -m tracer ...``: an alias of the ``ddpscope`` command (``tracer/cli.py``)."""

import sys

from tracer.cli import main

sys.exit(main())
