"""`dflash2-hf evaluate`: mean acceptance length on held-out HumanEval and MT-Bench prompts."""

from __future__ import annotations

import argparse

import torch

from ..modeling import DFlashDraftModel
from .checks import (
    PATHS,
    check_decoding_sizes,
    check_out_file,
    check_selector_paths,
    check_target_argument,
    drafter_config,
    refuse_below,
    write_json,
)
from .parsers import add_command, add_drafter_and_target


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dflash2-hf evaluate` and its options."""
    check = add_command(commands, "evaluate", "mean acceptance length on held-out HumanEval and MT-Bench prompts",
                        "Decode held-out HumanEval and MT-Bench prompts with a drafter and print a table of its mean "
                        "acceptance length per benchmark, temperature and path, drafting at every cycle (speed is "
                        "`bench`'s job); --out also writes every figure and the command as JSON.")
    models = check.add_argument_group("models")
    add_drafter_and_target(models)
    models.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of both models")
    prompts = check.add_argument_group("prompts")
    prompts.add_argument("--prompts", type=int, default=10, help="prompts per benchmark (>= 1)")
    prompts.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (>= 1)")
    prompts.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0],
                         help="sampling temperatures (>= 0; 0 decodes greedily)")
    decoding = check.add_argument_group("decoding")
    decoding.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS, help="path strategies to evaluate")
    decoding.add_argument("--tree-nodes", type=int, help="token tree size (>= 0; 0: one path; default: the drafter's)")
    decoding.add_argument("--lookup-tokens", type=int,
                          help="context-lookup branch added to each tree (>= 0; 0: none; default: the drafter's)")
    check.add_argument_group("output").add_argument("--out", help="write every figure and the command to this JSON "
                                                                   "file")
    check.set_defaults(run=evaluate)


def check_evaluate_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line and before any model loads, every `dflash2-hf evaluate` argument that would otherwise
    fail after loading or measuring (an ``--out`` it cannot write), or measure nothing."""
    command = "dflash2-hf evaluate"
    check_out_file("evaluate", "--out", args.out)
    check_decoding_sizes(args, command, smallest_tree=0)
    refuse_below(command, "--prompts", args.prompts, 1)
    refuse_below(command, "--temperatures", args.temperatures, 0, " (0: greedy)")
    check_target_argument(command, "--target", args.target)
    config = drafter_config(command, "drafter", args.drafter, args.target)
    check_selector_paths(command, "--paths", args.paths, config)


def evaluate(args: argparse.Namespace) -> None:
    """Mean acceptance length on held-out HumanEval / MT-Bench prompts, per path and temperature."""
    from ..measuring.evaluation import as_records, measure_acceptance, results_table
    from ..presets import load_target

    check_evaluate_arguments(args)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).eval()
    options = {"dflash_tree_nodes": args.tree_nodes, "dflash_lookup_tokens": args.lookup_tokens}
    results = measure_acceptance(target, tokenizer, drafter, args.paths, args.temperatures, args.prompts,
                                 max_new_tokens=args.max_new_tokens,
                                 dflash_kwargs={k: v for k, v in options.items() if v is not None})
    table = results_table(results)
    print(table)
    if args.out:
        record = {"command": args.command_line, "target": args.target, "drafter": args.drafter, "dtype": args.dtype,
                  "max_new_tokens": args.max_new_tokens, "tree_nodes": args.tree_nodes,
                  "lookup_tokens": args.lookup_tokens, "results": as_records(results)}
        write_json(args.out, record)
