"""`dflash2-hf export`: a Hub-ready drafter folder with its model card."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..export_layouts import LAYOUTS
from .checks import PATHS, check_target_argument, read_data
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
    vocabulary = share.add_argument_group("draft vocabulary")
    vocabulary.add_argument("--draft-vocab-size", type=int, metavar="N",
                            help="draft from the N tokens the target's answers in --vocab-data use most, through a "
                                 "head of the drafter's own (rows of the target's head; needs --target): a cheaper "
                                 "draft, verified as exactly as before (default: the target's whole head)")
    vocabulary.add_argument("--vocab-data", nargs="+", metavar="DIR",
                            help="folders written by `dflash2-hf data` whose answers choose the draft vocabulary")
    vocabulary.add_argument("--whole-head", action="store_true",
                            help="export a drafter that has a draft vocabulary reading the target's whole head again "
                                 "(the drafter it was cut from), for layouts without one: published, and speculators' "
                                 "DFlash 2")
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
    from ..training.draft_vocabulary import draft_vocabulary_from_answers

    try:
        chosen_layout(args.format, args.published_layout)
        check_destination(Path(args.out), Path(args.drafter), args.overwrite)  # before the target loads
        if args.target:
            check_target_argument("dflash2-hf export", "--target", args.target)
        check_vocabulary_arguments(args)
        target = load_target(args.target, dtype=torch.float32)[0] if args.target else None
        vocabulary = None
        if args.draft_vocab_size is not None:
            vocabulary = draft_vocabulary_from_answers(target, args.vocab_data, args.draft_vocab_size)
            print(f"dflash2-hf export: {vocabulary.describe()}")
        export_drafter(args.drafter, args.out, base_model=args.base_model, license_id=args.license,
                       results=args.results, path=args.path, dtype=getattr(torch, args.dtype),
                       layout=args.format, published_layout=args.published_layout, target=target,
                       overwrite=args.overwrite, whole_head=args.whole_head,
                       draft_vocabulary=None if vocabulary is None else vocabulary.token_ids)
    except ExportError as error:
        raise SystemExit(f"dflash2-hf export: {error}") from None
    print(f"Hub-ready drafter written to {args.out}")


def check_vocabulary_arguments(args: argparse.Namespace) -> None:
    """Refuse a draft vocabulary asked for without what it is made from (a positive size, answers, the target)."""
    if args.whole_head and args.draft_vocab_size is not None:
        raise SystemExit("dflash2-hf export: --whole-head exports the target's whole head, --draft-vocab-size a draft "
                         "vocabulary: give one.")
    if args.draft_vocab_size is None:
        if args.vocab_data:
            raise SystemExit("dflash2-hf export: --vocab-data chooses a draft vocabulary; give its size too "
                             "(--draft-vocab-size N).")
        return
    if args.draft_vocab_size < 1:
        raise SystemExit(f"dflash2-hf export: --draft-vocab-size must be >= 1, got {args.draft_vocab_size}.")
    if not args.vocab_data or not args.target:
        raise SystemExit("dflash2-hf export: --draft-vocab-size needs --vocab-data (answers made by `dflash2-hf "
                         "data`) and --target (whose head rows the drafter copies).")
    read_data(args.vocab_data, "export")  # every shard readable, before the target loads
