"""``python -m ddpscope.cli``: the ``ddpscope`` command."""

import sys

from ddpscope.cli.main import main

sys.exit(main())
