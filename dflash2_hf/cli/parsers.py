"""How every command presents itself in ``--help``: one line on what it does and what it prints, then its options in
groups, each with its default and its allowed range."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to an option's help where it has a default worth stating and the help does not state
    one already (flags and options without a default say nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unstated = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if unstated or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def add_command(commands: argparse._SubParsersAction, name: str, summary: str,
                description: str) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` is its line in ``dflash2-hf --help``, ``description`` the line its own ``--help``
    starts with (what it does and what it prints or writes)."""
    return commands.add_parser(name, help=summary, description=description, formatter_class=DefaultsFormatter)
