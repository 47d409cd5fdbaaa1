"""TTFT of the engine: baseline vs Prompt Cache vs the floor — experiment 1 of the performance
suite (``perf/suite/ttft.py``), kept as a shortcut for ``python -m perf --only ttft``.

    python perf/bench_engine.py [--lengths 1024 2048 4096] [--repeats 5] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from perf.suite.cli import main

    sys.exit(main(["--only", "ttft", *sys.argv[1:]]))
