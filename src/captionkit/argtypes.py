"""argparse ``type=`` functions for numeric options: a value out of range is refused by the
parser, with the option's name, before anything loads. Light on imports (no torch)."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """A whole number >= ``low``; "1.5" and "-1" are refused (for ``low`` >= 0)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = f"int_at_least_{low}"
    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    """A finite number >= ``low`` ("nan" and "inf" are refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {value:g}")
        return value
    parse.__name__ = f"float_at_least_{low:g}"
    return parse


positive_int = int_at_least(1)
