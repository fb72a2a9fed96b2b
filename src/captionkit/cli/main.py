"""The ``captionkit`` command line: it parses and calls the library. Each command group has its
module (caption, score, training, experiments, export, hub, serve), which holds its subcommands'
functions ``cmd_NAME`` and, beside each, the function that adds its parser and options and binds
it by ``set_defaults(func=...)``; options and helpers several groups share are in ``common``.
This module assembles the parser and runs a command. A user's mistake
(:class:`captionkit.core.errors.UserError`) is printed as one line naming the file or field; any other
exception is an internal error and keeps its traceback."""

from __future__ import annotations

import argparse
import gc
import os
import sys

from ..core.allocator import tune_allocator
from ..core.errors import UserError, WeightsUnavailable
from ..core.signals import EXIT_PREEMPTED, Preempted
from ..inference.writer import EXIT_STDOUT_CLOSED, silence_stdout
from . import caption, experiments, export, hub, models, score, serve, training

# the order of captionkit --help's commands: each function adds one command's parser and options
COMMANDS = (caption.add_caption, caption.add_evaluate, score.add_score, training.add_train, training.add_features,
            training.add_matcher, training.add_pack, training.add_average, export.add_merge_lora, caption.add_zero_shot,
            export.add_export,
            models.add_models, models.add_ensemble, models.add_rerank, hub.add_push, serve.add_serve,
            experiments.add_sweep, experiments.add_plot, experiments.add_report)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="captionkit", description="Image captioning: caption, train, evaluate.")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                   help="print captionkit's version and exit")
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def package_version() -> str:
    """captionkit's version as installed (the package metadata, from pyproject.toml)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("captionkit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from ..core.version import __version__
        return f"{__version__} (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Parse, call the command's function; a user's mistake (UserError, WeightsUnavailable) is one
    line on stderr and exit status 2, anything else an internal error with its traceback
    (CAPTIONKIT_DEBUG=1 shows the user's mistakes with theirs too)."""
    args = vars(build_parser().parse_args(argv))
    tune_allocator()
    command, func = args.pop("command"), args.pop("func")
    sub = args.pop("subcommand", None)  # export's format: its func already says which; errors name it
    command = f"{command} {sub}" if sub else command
    try:
        code = func(**args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:  # stdout closed early (`captionkit models | head -1`): end quietly, as Unix tools do
        silence_stdout()
        return EXIT_STDOUT_CLOSED
    except (UserError, WeightsUnavailable) as e:
        if os.environ.get("CAPTIONKIT_DEBUG"):
            raise
        print(f"captionkit {command}: error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:  # stopped on SIGTERM/SIGUSR1 with its state saved: rerun to resume
        print(f"captionkit {command}: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print(f"captionkit {command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``captionkit`` program (its console script, and ``python -m captionkit``): :func:`main`,
    then exit without the interpreter's last collection of the objects torch made at import
    (0.4-0.5 s of every command, measured: gc.freeze moves them out of its reach). Not in
    :func:`main`, which tests call in one process: frozen objects are never collected."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
