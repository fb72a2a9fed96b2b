"""Captioning on a CPU in several processes (``captionkit caption --processes``; docs/speed.md).

Beam decoding on a CPU is matmuls of a few dozen rows (a batch's beams), which two OpenMP threads
of one process share poorly: they meet at every operation. Two processes of one thread each
caption twice as many batches side by side instead. Measured on 2 cores, the default model, fp32,
the whole command on the 1,000 Flickr8k test photos: 59.1 s in one process of two threads, 53.7 s
in two processes of one, the same captions (docs/speed.md, "Two cores, two processes").

How the work is split: the images are cut into the batches one process would form (``batch_size``
consecutive images), and each process, the caller included, claims the next batch from one
shared counter whenever it starts on one (its reader threads read the batch it claimed next
while it captions this one: captionkit.encoders.image_batches.claimed_batches). The caller
captions with its own captioner; the helpers are started with ``spawn`` (a fresh interpreter:
nothing of the caller's OpenMP or reader threads is inherited, which ``fork`` would make unsafe)
and load the same model through the caller's ``load`` (a picklable callable, e.g. a
``functools.partial`` of the loading function), best started (:func:`start_helpers`) before the
caller loads its own, so both load at once. The caller yields every image's result
in the order given, holding any batch that finished early. Claiming as they go, the caller
works alone while the helpers start (a few seconds) and no process waits for another's share.
Since the batches are the single process's and a row's numbers do not depend on the thread
count, the captions are the single process's (tests/test_processes.py).

A helper that fails makes the caller raise with the helper's traceback (or its one line, for a
user's mistake); one that dies (killed, out of memory) holding a batch makes it raise naming its
exit code. One that failed holding no batch (the others captioned everything) is said in a line
on standard error once every image is done. The helpers end with the caller's iteration, also
when it stops early, and with the caller's process when it is killed.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from ..core.errors import UserError
from ..core.process_count import cpu_processes

POLL_S = 1.0  # how often the caller, waiting for a helper, checks that it is still alive
PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h): a signal for this process when its parent dies


def auto_processes(device: torch.device | str, threads: int, images: int, batch_size: int) -> int:
    """``--processes auto``: on a CPU, captionkit.core.process_count's rule (one process per torch
    thread, as the batches and half the available memory allow); one elsewhere (a GPU is one
    device, fed by one process)."""
    if torch.device(device).type != "cpu":
        return 1
    return cpu_processes(threads, images, batch_size)


class Helpers:
    """Helper processes started ahead of the work (:func:`start_helpers`), so that they import
    torch and load the model while the caller loads its own; :func:`caption_in_processes` hands
    them their images and ends them. One use."""

    def __init__(self, load: Callable, count: int, threads: int):
        ctx = multiprocessing.get_context("spawn")
        self.threads = threads
        self.counter = ctx.Value("q", 0)  # the next batch to claim
        self.jobs = ctx.Queue()  # what to caption: one job a helper
        self.results = ctx.Queue()  # ("batch", k, outcomes) | ("user" | "error", helper, message)
        self.procs = []
        try:
            for j in range(1, count + 1):
                proc = ctx.Process(target=_helper, name=f"captionkit-captioner-{j}", daemon=True,
                                   args=(load, threads, self.counter, self.jobs, self.results, os.getpid()))
                proc.start()
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join()
        self.jobs.close()
        self.results.close()


def start_helpers(load: Callable, processes: int, threads: int | None = None) -> Helpers | None:
    """The ``processes - 1`` helpers of a :func:`caption_in_processes` call to come, started now
    (None when ``processes`` is 1), each to run ``threads // processes`` torch threads (at
    least one) of ``threads`` (None: this process's)."""
    if processes <= 1:
        return None
    share = max(1, (threads or torch.get_num_threads()) // processes)
    return Helpers(load, processes - 1, share)


def caption_in_processes(cap, load: Callable, paths: Sequence[Path], processes: int, batch_size: int = 16,
                         workers: int = 1, helpers: Helpers | None = None,
                         **options) -> Iterator[tuple[Path, object]]:
    """``cap.caption_files(paths, batch_size=batch_size, workers=workers, **options)``'s (path,
    Result or ImageError) pairs, in the same order, captioned by ``processes`` processes: this
    one (with ``cap``) and ``processes - 1`` helpers that call ``load()`` for their own captioner
    (module docstring): ``helpers`` started earlier by :func:`start_helpers`, or started here.
    Each process runs ``threads // processes`` torch threads (at least one) of this process's
    ``threads`` and ``workers`` reader threads; this process's torch threads are restored at
    the end, and the helpers end with the iteration."""
    try:
        paths = list(paths)
        n = math.ceil(len(paths) / batch_size)
        if helpers is None and min(processes, n) > 1:
            helpers = start_helpers(load, min(processes, n))
        if helpers is None:
            yield from cap.caption_files(paths, batch_size=batch_size, workers=workers, **options)
            return
        if cap.device.type != "cpu":
            raise ValueError(f"captioning in several processes is for the CPU; this captioner runs on {cap.device}")
        if cap.encoder is None:
            raise RuntimeError("this Captioner was loaded without its encoder")
        for _ in helpers.procs:
            helpers.jobs.put((paths, batch_size, workers, n, options))
        yield from _shared(cap, helpers, paths, batch_size, workers, n, options)
    finally:
        if helpers is not None:
            helpers.close()


def _shared(cap, helpers: Helpers, paths: list[Path], batch_size: int, workers: int, n: int, options: dict):
    """The caller's side of the shared work: its own batches while the helpers' come in."""
    threads = torch.get_num_threads()
    torch.set_num_threads(helpers.threads)
    try:
        ours = _batches(cap, paths, batch_size, workers, _claimer(helpers.counter, n), options)
        done: dict[int, list] = {}  # finished batches not yet yielded
        for k in range(n):
            while k not in done:
                _collect(helpers.results, done, helpers.procs, wait=False)
                if k in done:
                    break
                mine = next(ours, None)  # our next batch, while the helpers work on theirs
                if mine is not None:
                    done[mine[0]] = mine[1]
                else:
                    _collect(helpers.results, done, helpers.procs, wait=True)
            outcomes = done.pop(k)
            yield from zip(paths[k * batch_size:(k + 1) * batch_size], outcomes)
        _report_late_failures(helpers.results, helpers.procs)
    finally:
        torch.set_num_threads(threads)


def _report_late_failures(results, helpers: list) -> None:
    """Every image is captioned; a helper that failed without holding a batch (while it loaded,
    say) cost nothing but its share of the speed: said in a line on standard error."""
    try:
        _collect(results, {}, helpers, wait=False)
    except (UserError, RuntimeError) as e:
        last = str(e).strip().splitlines()[-1]
        print(f"captionkit: a captioning process failed and the others captioned its share: {last}",
              file=sys.stderr, flush=True)


def _claimer(counter, n: int) -> Callable[[], int | None]:
    """The next unclaimed batch of ``n`` from the processes' shared ``counter`` (None: none left)."""
    def claim() -> int | None:
        with counter.get_lock():
            k = counter.value
            if k >= n:
                return None
            counter.value = k + 1
            return k
    return claim


def _batches(cap, paths: list[Path], batch_size: int, workers: int, claim: Callable, options: dict):
    """This process's batches as it claims them: (k, [each image's Result or ImageError]). The
    reader threads read the next claimed batch while this one is captioned."""
    from ..encoders.image_batches import claimed_batches

    for k, batch in claimed_batches(paths, cap.encoder.preprocess, batch_size, workers, claim):
        yield k, [res for _, res in cap.caption_batches([batch], **options)]


def _collect(results, done: dict[int, list], helpers: list, wait: bool) -> None:
    """Move the helpers' finished batches into ``done`` (waiting for one when ``wait``), or raise
    what a helper sent or died of."""
    while True:
        try:
            message = results.get(timeout=POLL_S) if wait else results.get_nowait()
        except queue.Empty:
            if not wait:
                return
            dead = [p for p in helpers if not p.is_alive()]
            if dead:
                raise RuntimeError(f"captioning process {dead[0].name} (pid {dead[0].pid}) ended with exit code "
                                   f"{dead[0].exitcode} before the images were done") from None
            continue
        kind, first, second = message
        if kind == "batch":
            done[first] = [_restored(r) for r in second]
            wait = False  # one arrived: take what else is there, without waiting
            continue
        if kind == "user":
            raise UserError(second)
        raise RuntimeError(f"captioning process {first} failed:\n{second}")


def _portable(res):
    """A Result with its attention as a numpy array (a torch tensor sent between processes would
    travel through a shared-memory segment of its own); ImageErrors as they are."""
    from .captioner import Result

    if isinstance(res, Result):
        return Result(res.words, res.attention.numpy(), res.grid, res.candidates, res.captions)
    return res


def _restored(res):
    from .captioner import Result

    if isinstance(res, Result):
        res.attention = torch.from_numpy(res.attention)
    return res


def _die_with_parent() -> None:
    """Linux: have the kernel end this process when the caller's process dies (killed with
    SIGKILL, say, when its ``finally`` cannot run): a helper left behind would go on captioning
    for nobody, holding its memory. Elsewhere the helper stops at its next claim."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _helper(load: Callable, threads: int, counter, jobs, results, caller: int) -> None:
    """A helper process: load the captioner, wait for the caller's job, then caption the
    batches it claims and put each on ``results``; a failure goes there too, for the caller to
    raise."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the caller, which ends the helpers
    _die_with_parent()
    if os.getppid() != caller:  # it died before the line above
        os._exit(0)
    from ..core.allocator import tune_allocator

    tune_allocator()  # as the command line does in the caller
    torch.set_num_threads(threads)
    name = multiprocessing.current_process().name
    try:
        cap = load()
        paths, batch_size, workers, n, options = jobs.get()
        claim = _claimer(counter, n)

        def claim_while_the_caller_lives() -> int | None:
            if os.getppid() != caller:  # the caller was killed (where PR_SET_PDEATHSIG is not there)
                os._exit(0)
            return claim()

        for k, outcomes in _batches(cap, paths, batch_size, workers, claim_while_the_caller_lives, options):
            results.put(("batch", k, [_portable(r) for r in outcomes]))
    except UserError as e:
        results.put(("user", name, str(e)))
    except BaseException:  # an internal error: the caller raises it with this traceback
        results.put(("error", name, traceback.format_exc()))
    results.close()
    results.join_thread()
