"""`dflash2-hf heldout`: teacher-forced acceptance on a data folder's held-out records."""

from __future__ import annotations

import argparse

import torch

from ..modeling import DFlashDraftModel
from .checks import (
    check_data_vocabulary,
    check_minimums,
    check_out_file,
    check_target_argument,
    drafter_config,
    read_data,
    write_json,
)
from .parsers import add_command, add_drafter_and_target


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dflash2-hf heldout` and its options."""
    held = add_command(commands, "heldout", "teacher-forced acceptance on a data folder's held-out records",
                       "Measure a drafter's teacher-forced acceptance on the held-out records of `dflash2-hf data` "
                       "folders (the figure training records) and print it for the argmax path and the selector's "
                       "walk, with the selector's lift; --out also writes the figures and the command as JSON.")
    models = held.add_argument_group("models and data")
    add_drafter_and_target(models)
    models.add_argument("--data", required=True, nargs="+",
                        help="folder(s) written by `dflash2-hf data`, as given to train")
    models.add_argument("--heldout-fraction", type=float, default=0.05,
                        help="the share train held out, its last records (0 < f < 1)")
    blocks = held.add_argument_group("blocks")
    blocks.add_argument("--anchors", choices=["random", "decoding"], default="random",
                        help="blocks at random anchors (as training samples them) or where greedy decoding would "
                             "start them (after each block's accepted tokens; the figure decoding shows; target and "
                             "drafter in fp32)")
    blocks.add_argument("--decoding-tokens", type=int, default=128,
                        help="with --anchors decoding: answer tokens followed (>= 1)")
    blocks.add_argument("--blocks", type=int, default=24,
                        help="blocks sampled per sequence (>= 1; --anchors random; with --anchors decoding, --blocks "
                             "x --batch-size blocks go through each forward pass)")
    blocks.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (>= 1)")
    held.add_argument_group("output").add_argument("--out", help="write the figures and the command to this JSON file")
    held.set_defaults(run=heldout)


def heldout(args: argparse.Namespace) -> None:
    """Teacher-forced acceptance on the held-out records of a `dflash2-hf data` folder, for the argmax path and the
    selector's greedy walk: the figures `train --heldout-fraction` records while it trains, for any drafter (the same
    split, blocks and seed), e.g. to see what a selector lifts on your own data; with ``--anchors decoding``, over the
    blocks greedy decoding of those answers would draft instead (the figure decoding shows)."""
    from ..presets import load_target
    from ..training.trainer import DrafterTrainer, TrainingConfig

    check_out_file("heldout", "--out", args.out)
    check_minimums("dflash2-hf heldout", args, {"--blocks": 1, "--batch-size": 1})
    records = [record for folder in read_data(args.data, "heldout") for record in folder]
    if not 0 < args.heldout_fraction < 1 or int(len(records) * args.heldout_fraction) == 0:
        raise SystemExit(f"--heldout-fraction {args.heldout_fraction} of {len(records)} records in {' '.join(args.data)} holds "
                         "out no record; pass the fraction the drafter was trained with (between 0 and 1).")
    if args.decoding_tokens < 1:
        raise SystemExit(f"--decoding-tokens {args.decoding_tokens}: follow at least one answer token.")
    try:
        settings = TrainingConfig(output_dir=args.drafter, steps=0, batch_size=args.batch_size,
                                  blocks_per_sequence=args.blocks, heldout_fraction=args.heldout_fraction)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf heldout: {error}") from None
    check_target_argument("dflash2-hf heldout", "--target", args.target)
    drafter_config("dflash2-hf heldout", "drafter", args.drafter, args.target)
    decoding = args.anchors == "decoding"  # in fp32 throughout, as `evaluate` decodes by default
    # The random-anchor measure runs as training does (bf16 under autocast where the hardware computes bf16).
    target, _ = load_target(args.target, dtype=torch.bfloat16 if settings.bf16 and not decoding else torch.float32)
    check_data_vocabulary("heldout", records, target, args.data)
    drafter = DFlashDraftModel.from_pretrained(args.drafter).float()
    trainer = DrafterTrainer(drafter, target, records, settings)
    if decoding:
        acceptance = trainer.heldout_decoding_acceptance(tokens=args.decoding_tokens)
    else:
        acceptance = trainer.heldout_acceptance()
    for path, value in acceptance.items():
        lift = value / acceptance["argmax"] - 1
        print(f"{path}: {value:.3f}" + (f" ({lift:+.1%} over argmax)" if path != "argmax" else ""))
    if args.out:
        write_json(args.out, {"command": args.command_line, "target": args.target, "drafter": args.drafter,
                              "heldout_records": len(trainer.heldout), "anchors": args.anchors,
                              "acceptance": acceptance})
