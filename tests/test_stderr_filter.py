"""core.stderr_filter: lines on file descriptor 2 matching a pattern are dropped inside the
block; everything else (Python's own writes, a child's, partial and \\r-updated lines) comes
through in order, and the descriptor is restored after."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from captionkit.core.stderr_filter import dropping_lines

NOISE = "[2026-11-26 02:53:14,123 E 1 2] core_worker.cc:2465: Actor with class name: 'X' has args\n"


SCRIPT = f"""
import os, subprocess, sys, time
from captionkit.core.stderr_filter import dropping_lines
noise = {NOISE!r}
with dropping_lines(r"core_worker\\.cc:\\d+: Actor with class name"):
    os.write(2, b"before\\n" + noise.encode() + b"after\\n")
    print("from python", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "import os; os.write(2, " + repr(noise.encode()) + " + b'child\\\\n')"], check=True)
    os.write(2, b"50%\\r")
    time.sleep(0.5)
    os.write(2, b"100%\\rdone")
os.write(2, noise.encode())
"""


def test_only_the_matching_lines_are_dropped():
    """In a process of its own, as a command runs it: Python's writes to sys.stderr, a child's
    and the C-level ones all pass through the one descriptor."""
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, check=True)  # (bytes: keep \r)
    # the noise line dropped three times inside the block, kept once after it
    assert run.stderr.decode() == "before\nafter\nfrom python\nchild\n50%\r100%\rdone" + NOISE


def test_a_partial_line_is_written_within_the_hold_time(capfd):
    with dropping_lines("never"):
        os.write(2, b"Password: ")
        time.sleep(0.5)
        assert capfd.readouterr().err == "Password: "
    assert capfd.readouterr().err == ""
