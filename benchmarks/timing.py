"""Timing shared by the benchmark scripts."""

import statistics
import time


_clock = time.perf_counter


def use_cpu_time() -> None:
    """Time ``median_time`` by this process's CPU time instead of the wall clock: on a machine
    other processes load, a one-thread measurement then counts only the cycles it ran (with
    more threads it would count their waiting too, so use it with one)."""
    global _clock
    _clock = time.process_time


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds (wall clock, or CPU time after ``use_cpu_time()``) of ``fn()`` over
    ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t = _clock()
        fn()
        ts.append(_clock() - t)
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
