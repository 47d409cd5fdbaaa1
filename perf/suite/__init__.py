"""The performance suite: TTFT vs length, workloads against exact prefix reuse, cache-hit-ratio
sweep, encoding amortisation, memory per token and decode rate, measured side by side.

    python -m perf --quick           # or: promptcache bench --quick
    python -m perf --gpu             # the one-shot GPU check (perf/gpu_suite.py)

See ``perf/suite/runner.py`` for the programmatic entry (``run_suite``, ``write_results``).
"""
