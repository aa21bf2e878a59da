"""``python -m ddpscope.viz summary|whatif|perfetto|merge``: the ``ddpscope`` command (``ddpscope.cli``), kept as an alias for this release."""

import sys

from ddpscope.cli.main import main

sys.exit(main())
