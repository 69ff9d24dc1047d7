"""Every command's `--help`: one line on what it does and what it prints or writes, then its options in named
groups, each explained, with its default where it has one."""

import argparse

import pytest

from dflash2_hf.cli import COMMANDS, command_parser

SUBCOMMANDS = command_parser()._subparsers._group_actions[0].choices  # argparse keeps them only here
#: What each command's first help line must say it prints or writes.
PRINTS = {"info": "prints", "data": "prints", "train": "prints", "evaluate": "print", "heldout": "print",
          "generate": "prints", "bench": "prints", "export": "print"}


def test_every_command_module_registers_one_described_subcommand():
    assert sorted(SUBCOMMANDS) == sorted(PRINTS) and len(COMMANDS) == len(PRINTS)


@pytest.mark.parametrize("name", sorted(PRINTS))
def test_help_starts_with_one_line_on_what_the_command_does_and_prints(name, capsys):
    with pytest.raises(SystemExit):
        command_parser().parse_args([name, "--help"])
    text = capsys.readouterr().out
    description = SUBCOMMANDS[name].description
    assert " ".join(text.split("\n\n")[1].split()) == description, "the paragraph after the usage"
    assert description.endswith(".") and description.count(". ") == 0, "one sentence"
    assert PRINTS[name] in description


@pytest.mark.parametrize("name", sorted(PRINTS))
def test_every_option_is_explained_in_a_named_group(name):
    parser = SUBCOMMANDS[name]
    unexplained = [action.dest for action in parser._actions
                   if not isinstance(action, argparse._HelpAction) and not action.help]
    assert not unexplained, f"dflash2-hf {name}: options without help: {unexplained}"
    generic = [action.dest for group in parser._action_groups if group.title == "options"
               for action in group._group_actions if not isinstance(action, argparse._HelpAction)]
    if len(parser._actions) > 4:
        assert not generic, f"dflash2-hf {name}: options outside a named group: {generic}"


@pytest.mark.parametrize("name", sorted(PRINTS))
def test_help_states_each_default(name):
    text = " ".join(SUBCOMMANDS[name].format_help().split())  # the parser whose defaults are read below
    for action in SUBCOMMANDS[name]._actions:
        if action.option_strings and action.default is not None and action.default is not False \
                and action.default != argparse.SUPPRESS:
            stated = "default" in action.help or f"(default: {action.default})" in text
            assert stated, f"dflash2-hf {name} {action.option_strings[0]}: its default is not in --help"


def test_the_default_is_appended_only_where_the_help_does_not_state_one(capsys):
    with pytest.raises(SystemExit):
        command_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "optimizer steps (>= 1) (default: 1000)" in text
    assert "where to save the trained drafter (default: OUT/drafter)" in text and "OUT/drafter) (default" not in text
    assert "--selector-only freeze the drafter and train its candidate selector alone" in text, "flags: no default"
    assert "sampling (>= 0) (default: 0)" in text and "(default: 0.0)" in text, "a zero default is a default"
