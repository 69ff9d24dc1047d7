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


def add_target(group: argparse._ArgumentGroup) -> None:
    """``--target``, as every command that loads a target takes it."""
    group.add_argument("--target", default="smollm2-135m", help="a preset name or a local checkpoint folder")


def add_compute_dtype(group: argparse._ArgumentGroup, what: str) -> None:
    """`--dtype` of the data and training steps: ``what`` the dtype sets; auto picks what the hardware computes
    fastest (:func:`dflash2_hf.training.setup.fastest_dtype`)."""
    group.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                       help=f"{what} (auto: bfloat16 on a GPU or a CPU with bf16 instructions, float32 elsewhere)")


def add_drafter_and_target(group: argparse._ArgumentGroup) -> None:
    """The drafter folder to measure (first argument) and its ``--target``."""
    group.add_argument("drafter", help="drafter folder")
    add_target(group)


def add_cpu_kernel_options(group: argparse._ArgumentGroup, applies_to: str) -> None:
    """``--packed-linears`` and ``--exact-attention``, applied to ``applies_to`` (the methods a command runs)."""
    group.add_argument("--packed-linears", action="store_true",
                       help=f"pack every linear weight once (oneDNN, bf16 or float32; {applies_to})")
    group.add_argument("--exact-attention", action="store_true",
                       help="with --dtype bfloat16: the target attends in float64 (slower), so greedy bf16 output "
                            f"is token-identical to plain decoding with that attention ({applies_to})")
