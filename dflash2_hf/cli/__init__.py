"""The ``dflash2-hf`` command line: one module per command (its options and what it runs), the checks they share in
:mod:`~dflash2_hf.cli.checks`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, data, evaluate, export, generate, heldout, info, train

#: The commands, in the order ``dflash2-hf --help`` lists them.
COMMANDS = (info, data, train, evaluate, heldout, generate, bench, export)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dflash2-hf`` command; its command line is recorded with the results it writes."""
    parser = argparse.ArgumentParser(prog="dflash2-hf", description="The dflash2-hf command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    args = parser.parse_args(argv)
    args.command_line = "dflash2-hf " + " ".join(sys.argv[1:] if argv is None else argv)  # recorded in results
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
