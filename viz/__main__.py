"""``python -m viz summary|perfetto``: an alias of ``ddpscope summary|perfetto``."""

import sys

from viz.cli import main

sys.exit(main())
