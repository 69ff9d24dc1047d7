"""The ``dflash2-hf`` command line: one module per command (its options and what it runs), the checks they share in
:mod:`~dflash2_hf.cli.checks`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, data, evaluate, export, generate, heldout, info, train
from .checks import check_finite_numbers, check_text_arguments

#: The commands, in the order ``dflash2-hf --help`` lists them.
COMMANDS = (info, data, train, evaluate, heldout, generate, bench, export)

#: What a user's mistake raises once the models are loaded: a bad value or a mismatched model (``ValueError``, which
#: the library words for the user) or a file that cannot be read or written (``OSError``). Any other exception is a
#: bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError)

#: The exit status of a refused command, argparse's for a bad argument.
REFUSED = 2
#: The exit status after Ctrl-C, as a shell reports a command ended by SIGINT.
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dflash2-hf`` command; its command line is recorded with the results it writes."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = command_parser().parse_args(words)
    try:
        check_text_arguments(f"dflash2-hf {args.command}", args, words)
        args.command_line = "dflash2-hf " + " ".join(words)  # recorded in results
        check_finite_numbers(f"dflash2-hf {args.command}", args)
        args.run(args)
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        refuse(args.command, stop.code)
    except USER_ERRORS as error:
        refuse(args.command, str(error))
    except KeyboardInterrupt:
        print(f"dflash2-hf {args.command}: interrupted; files are written whole or not at all, and data and training "
              "resume where they stopped.", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    return 0


def command_parser() -> argparse.ArgumentParser:
    """The ``dflash2-hf`` parser, one sub-command per module of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="dflash2-hf", description="DFlash 2 speculative decoding for Hugging Face transformers: make data, train "
        "and export a drafter, and generate, evaluate and benchmark with it. `dflash2-hf COMMAND --help` says what "
        "each command does and prints.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def refuse(command: str, reason: str) -> None:
    """The one error boundary of every command: print the reason on one line, named by its command, and exit with
    status 2, as argparse does for a bad argument."""
    line = " ".join(reason.split())
    if not line.startswith("dflash2-hf "):
        line = f"dflash2-hf {command}: {line}"
    print(line, file=sys.stderr)
    raise SystemExit(REFUSED)


if __name__ == "__main__":
    sys.exit(main())
