"""``python -m perf.fidelity``: run the fidelity evaluation."""

import sys

from perf.fidelity.runner import main

sys.exit(main())
