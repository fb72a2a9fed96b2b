"""Timing shared by the benchmark scripts."""

import statistics
import time


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def min_time(fn, repeats: int) -> float:
    """Fastest wall-clock seconds of ``fn()`` over ``repeats`` calls, no warm-up: for costs whose
    first call is the one measured against the others (a hash, a file write), the least disturbed
    run on a shared machine."""
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)
