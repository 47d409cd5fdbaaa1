"""``python -m perf``: the performance suite (see ``perf/suite/cli.py``)."""

import sys

from perf.suite.cli import main

sys.exit(main())
