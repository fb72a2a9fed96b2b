"""argparse ``type=`` functions for numeric options (and a few others): a value out of range is
refused by the parser, with the option's name, before anything loads. Light on imports (no
torch)."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, NamedTuple

from ..core.devices import check_device_name
from ..core.fields import is_dotted_key, parse_value


def _at_least(low: float, convert: Callable[[str], float], what: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value):  # float("nan") and float("inf") parse
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {value:g}")
        return value
    parse.__name__ = f"{convert.__name__}_at_least_{low:g}"
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """A whole number >= ``low``: "1.5" and "1e3" are refused."""
    return _at_least(low, int, "a whole number")


def float_at_least(low: float) -> Callable[[str], float]:
    """A finite number >= ``low`` ("nan" and "inf" are refused)."""
    return _at_least(low, float, "a number")


positive_int = int_at_least(1)


def positive_floats(text: str) -> list[float]:
    """A comma-separated list of finite positive numbers ("0.6,0.4"), e.g. ensemble weights."""
    parse = _at_least(0, float, "a number")
    values = [parse(part) for part in text.split(",")]
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"must all be positive, got {text!r}")
    return values


def mixing_weights(text: str) -> list[float]:
    """A comma-separated list of finite numbers summing to 1 ("0.5,0.5", "-0.25,1.25"): the
    weights of an average of checkpoints, where a negative one extrapolates."""
    parse = _at_least(-math.inf, float, "a number")
    values = [parse(part) for part in text.split(",")]
    if abs(sum(values) - 1) > 1e-6:
        raise argparse.ArgumentTypeError(f"must sum to 1, got {text!r} (sum {sum(values):g})")
    return values


def processes_count(text: str) -> int | None:
    """``--processes``: ``auto`` (None: chosen for the machine and the images) or a whole number >= 1."""
    if text == "auto":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or auto)") from None


def device_name(text: str) -> str:
    """A ``--device`` spelling (captionkit.core.devices.DEVICE_HELP), checked without probing the
    hardware: a typo is refused by the parser; a device that is not there is refused by
    :func:`captionkit.core.devices.resolve_device` before any model loads."""
    try:
        return check_device_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Setting(NamedTuple):
    """One ``train --set TABLE.FIELD=VALUE``: the dotted key, the value, the text as given."""

    key: str
    value: Any
    text: str


def config_setting(text: str) -> Setting:
    """``TABLE.FIELD=VALUE``, the value in TOML's syntax (2, 1e-4, true, [0.0, 0.5], "adamw"; a
    bare word is a string: train.optimizer=adamw). Whether the field exists and the value fits
    is the config's check (RunConfig.load), which names the field."""
    key, eq, value = text.partition("=")
    key = key.strip()
    if not eq or not value.strip() or not is_dotted_key(key):
        raise argparse.ArgumentTypeError(f"expected TABLE.FIELD=VALUE, e.g. train.seed=2, got {text!r}")
    return Setting(key, parse_value(value), text)
