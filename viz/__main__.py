"""``python -m ddpscope.viz summary|perfetto``: an alias of ``ddpscope summary|perfetto``."""

import sys

from ddpscope.viz.cli import main

sys.exit(main())
