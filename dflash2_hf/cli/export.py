"""`dflash2-hf export`: a Hub-ready drafter folder with its model card."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..export_layouts import LAYOUTS
from .checks import PATHS, check_target_argument
from .parsers import add_command


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dflash2-hf export` and its options."""
    share = add_command(commands, "export", "write a Hub-ready drafter folder with a model card",
                        "Write a Hub-ready copy of a drafter folder (weights, config, remote code, "
                        "custom_generate/generate.py for transformers' remote-code generation, generation defaults "
                        "and a model card) and print where it was written.")
    folders = share.add_argument_group("folders")
    folders.add_argument("drafter", help="drafter folder (e.g. written by `dflash2-hf train`)")
    folders.add_argument("out", help="folder to write; refused when it exists and is not empty")
    folders.add_argument("--overwrite", action="store_true", help="replace OUT when it is not empty")
    weights = share.add_argument_group("weights and layout")
    weights.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                         help="dtype of the exported weights")
    weights.add_argument("--format", default="package", choices=LAYOUTS,
                         help="package: this package's config and remote code; published: the published DFlash 2 "
                              "layout; speculators: speculators' format, which vLLM serves (the last two: no remote "
                              "code)")
    weights.add_argument("--published-layout", action="store_true", help="the same as --format published")
    weights.add_argument("--target", help="the drafter's target (preset or checkpoint folder): a factorised selector "
                                          "is stored as codebooks computed from its input embeddings, and speculators' "
                                          "config names its architecture")
    card = share.add_argument_group("model card and decoding defaults")
    card.add_argument("--base-model", help="Hub id of the target (default: the target recorded in training.json)")
    card.add_argument("--license", default="apache-2.0", help="license identifier for the model card")
    card.add_argument("--results", help="results.json or results.md of `dflash2-hf bench` to put in the card")
    card.add_argument("--path", choices=PATHS, help="path strategy generate uses by default (default: the drafter's own)")
    share.set_defaults(run=export)


def export(args: argparse.Namespace) -> None:
    """Write a Hub-ready copy of a drafter folder: weights, remote code, generation config and model card."""
    from ..export import ExportError, check_destination, chosen_layout, export_drafter
    from ..presets import load_target

    try:
        chosen_layout(args.format, args.published_layout)
        check_destination(Path(args.out), Path(args.drafter), args.overwrite)  # before the target loads
        if args.target:
            check_target_argument("dflash2-hf export", "--target", args.target)
        target = load_target(args.target, dtype=torch.float32)[0] if args.target else None
        export_drafter(args.drafter, args.out, base_model=args.base_model, license_id=args.license,
                       results=args.results, path=args.path, dtype=getattr(torch, args.dtype),
                       layout=args.format, published_layout=args.published_layout, target=target,
                       overwrite=args.overwrite)
    except ExportError as error:
        raise SystemExit(f"dflash2-hf export: {error}") from None
    print(f"Hub-ready drafter written to {args.out}")
