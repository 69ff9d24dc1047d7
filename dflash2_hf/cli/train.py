"""`dflash2-hf train`: a drafter trained on `dflash2-hf data` folders (resumable), then exported."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..modeling import DFlashConfig, DFlashDraftModel
from ..training.labels import LABEL_SOURCES
from .checks import (
    check_data_vocabulary,
    check_minimums,
    check_out_folder,
    check_target_argument,
    drafter_config,
    read_data,
)
from .parsers import add_command, add_compute_dtype, add_target


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dflash2-hf train` and its options, in groups."""
    fit = add_command(commands, "train", "train a DFlash 2 drafter on responses made by `dflash2-hf data`",
                      "Train a DFlash 2 drafter on responses made by `dflash2-hf data`: writes checkpoints to --out "
                      "(a stopped run resumes from the newest), shows the loss as it goes, saves the drafter to "
                      "--export and prints where.")
    add_run_options(fit.add_argument_group("data and output"))
    add_schedule_options(fit.add_argument_group("schedule"))
    add_layout_options(fit.add_argument_group("drafter layout (a new drafter)"))
    add_continuing_options(fit.add_argument_group("continuing a trained drafter"))
    add_loss_options(fit.add_argument_group("loss"))
    fit.set_defaults(run=train)


def add_run_options(group: argparse._ArgumentGroup) -> None:
    add_target(group)
    group.add_argument("--data", required=True, nargs="+",
                       help="folder(s) written by `dflash2-hf data`, read in order (held-out records: the last ones)")
    group.add_argument("--out", required=True, help="run folder: checkpoints (resumed from), config, curves")
    group.add_argument("--export", help="where to save the trained drafter (default: OUT/drafter)")
    group.add_argument("--heldout-fraction", type=float, default=0.05,
                       help="share of records kept out for the acceptance curve (0 <= f < 1)")
    group.add_argument("--seed", type=int, default=0, help="seed of the drafter's initialisation and sampling (>= 0)")


def add_schedule_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--steps", type=int, default=1000, help="optimizer steps (>= 1)")
    group.add_argument("--batch-size", type=int, default=4, help="sequences per step (>= 1)")
    group.add_argument("--blocks", type=int, default=16, help="blocks sampled per sequence (>= 1)")
    group.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (> 0)")
    group.add_argument("--warmup", type=int, default=50, help="steps of linear warm-up (>= 0)")
    group.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (>= 1)")
    group.add_argument("--feature-cache-gb", type=float, default=8.0,
                       help="memory for the target features kept between steps; sequences past it are read from "
                            "--feature-store (>= 0)")
    group.add_argument("--feature-store", metavar="DIR",
                       help="folder keeping each sequence's target features on disk, computed once: share it between "
                            "runs on the same answers (default: OUT/features)")
    add_compute_dtype(group, "the target's dtype and the run's autocast")


def add_layout_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--layers", type=int, default=2, help="drafter layers (>= 1)")
    group.add_argument("--taps", type=int, default=3,
                       help="number of target layers read (>= 1, at most the target's layers)")
    group.add_argument("--block-size", type=int, default=16, help="tokens drafted per block (>= 2)")
    group.add_argument("--selector-rank", type=int, default=64,
                       help="rank of the candidate selector (>= 0; 0 trains a DFlash v1 drafter, no selector)")
    group.add_argument("--factorised-selector", action="store_true",
                       help="a new selector (new drafter or --new-selector) derives its token codes from the target's "
                            "input embeddings (3 x hidden x rank parameters instead of two vocabulary-sized "
                            "codebooks)")
    group.add_argument("--draft-vocab-size", type=int, metavar="N",
                       help="draft from the N tokens the training answers use most, through a head of the drafter's "
                            "own (rows of the target's head, frozen): cheaper drafts and training steps (>= 1; "
                            "also cuts an --init-from drafter; default: the target's whole head)")
    group.add_argument("--intermediate-size", type=int, help="MLP width (>= 1; default: the target's)")
    group.add_argument("--mask-token", default="<empty_output>", help="an existing token the target never emits")
    group.add_argument("--mask-token-id", type=int,
                       help="the mask token by id instead (>= 0, below the target's vocabulary)")


def add_continuing_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--init-from", metavar="DRAFTER",
                       help="start from a trained drafter folder instead of the target's layers (continue training "
                            "it; a DFlash v1 drafter gets a new selector of --selector-rank)")
    group.add_argument("--selector-only", action="store_true",
                       help="freeze the drafter and train its candidate selector alone")
    group.add_argument("--new-selector", action="store_true",
                       help="with --init-from: replace the drafter's selector by a fresh one of --selector-rank "
                            "(--factorised-selector for a factorised one)")


def add_loss_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--selector-gold", choices=("insert", "skip"), default="insert",
                       help="where the right token is not among the drafter's top-K: put it into the candidates "
                            "(insert, the published recipe) or leave the position out of the selector loss (skip: "
                            "decoding only ever chooses among the top-K)")
    group.add_argument("--anchors", choices=("random", "decoding"), default="random",
                       help="where blocks start: random answer positions, or (with --selector-only, on the target's "
                            "greedy answers) where greedy decoding with the drafter's argmax path would start them")
    group.add_argument("--labels", choices=LABEL_SOURCES, default="text",
                       help="what blocks learn to draft: the data's own tokens (text), the target's teacher-forced "
                            "choices on them (target), or those choices up to where the text leaves them "
                            "(target-prefix); target labels need data made with `dflash2-hf data "
                            "--existing-responses`, which records the target's choices")
    group.add_argument("--distill-weight", type=float, default=0.0,
                       help="share of the drafter's loss taken from the target's whole next-token distribution at "
                            "each drafted position (soft labels, 0-1) instead of its chosen token alone")


#: The smallest value of each whole-number `dflash2-hf train` option (the target bounds some further once it loads:
#: --taps by its layers, --mask-token-id by its vocabulary).
TRAIN_MINIMUMS = {"--steps": 1, "--batch-size": 1, "--blocks": 1, "--warmup": 0, "--checkpoint-every": 1,
                  "--layers": 1, "--taps": 1, "--block-size": 2, "--selector-rank": 0, "--intermediate-size": 1,
                  "--mask-token-id": 0, "--seed": 0, "--feature-cache-gb": 0, "--draft-vocab-size": 1}


def check_train_numbers(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, every numeric `dflash2-hf train` option out of its range."""
    check_minimums("dflash2-hf train", args, TRAIN_MINIMUMS)
    if not args.lr > 0:
        raise SystemExit(f"dflash2-hf train: --lr must be > 0, got {args.lr}.")


def vocabulary_id(tokenizer, token: str) -> int:
    """The id of ``token`` as one entry of the tokenizer's vocabulary; a token it lacks is refused (tokenizers would
    silently map it to their unknown token)."""
    vocabulary = tokenizer.get_vocab()
    if token not in vocabulary:
        raise SystemExit(f"--mask-token {token!r} is not a token of the target's vocabulary; pass one it has and never "
                         "emits (e.g. an unused special token such as <|fim_pad|> for Qwen2.5) or --mask-token-id.")
    return vocabulary[token]


#: The drafter config fields a resumed `dflash2-hf train` run must keep, with the flag that sets each.
LAYOUT_FLAGS = {"num_hidden_layers": "--layers", "target_layer_ids": "--taps", "block_size": "--block-size",
                "selector_rank": "--selector-rank", "selector_factorised": "--factorised-selector",
                "intermediate_size": "--intermediate-size", "mask_token_id": "--mask-token/--mask-token-id",
                "hidden_size": "--target", "vocab_size": "--target", "num_target_layers": "--target",
                "draft_vocab_size": "--draft-vocab-size"}


def check_resumed_layout(saved_file: Path, asked: DFlashConfig, init_from: bool) -> None:
    """Refuse to resume a run whose drafter layout, saved in ``saved_file`` when it started, differs from the one
    this command asks for (``asked``: built from the flags, or the ``--init-from`` drafter's): its checkpoints hold
    that layout, so the flags would be ignored silently, or the checkpoint would not load."""
    saved = DFlashConfig.from_pretrained(saved_file)
    differences = [f"{'--init-from' if init_from else flag} ({field}): {getattr(saved, field)!r} saved, "
                   f"{getattr(asked, field)!r} asked"
                   for field, flag in LAYOUT_FLAGS.items() if getattr(saved, field) != getattr(asked, field)]
    if differences:
        raise SystemExit(f"dflash2-hf train: {saved_file.parent} holds checkpoints of another drafter layout: "
                         f"{'; '.join(differences)} (saved in {saved_file}). Resume with the saved values, or pass a "
                         "new --out to start fresh.")


def check_export_keeps_the_start(args: argparse.Namespace) -> None:
    """Refuse an export folder (``--export``, default ``OUT/drafter``) that is the ``--init-from`` drafter or holds
    it: the trained drafter would be written over the one the run starts from."""
    start = Path(args.init_from).resolve()
    export = Path(args.export or Path(args.out) / "drafter").resolve()
    if export == start or export in start.parents:
        raise SystemExit(f"dflash2-hf train: the drafter is exported to {export}, which holds the --init-from drafter "
                         "it starts from; pass another --export (or --out).")


def check_resumed_schedule(out: Path, training) -> None:
    """Refuse to resume a run whose newest checkpoint was trained on another learning-rate schedule (--lr,
    --warmup): resuming restores the saved schedule, so the flags would be ignored silently."""
    from ..training.checkpoint import latest_checkpoint

    found = latest_checkpoint(out)
    if found is None:
        return
    try:
        saved = json.loads((found / "state.json").read_text())["extra"]["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # a damaged checkpoint: the trainer resumes from an intact one, or starts afresh, and says so
    asked = {"learning_rate": ("--lr", training.learning_rate), "warmup_steps": ("--warmup", training.warmup_steps)}
    differences = [f"{flag} {saved[field]} saved, {value} asked" for field, (flag, value) in asked.items()
                   if field in saved and saved[field] != value]
    if differences:
        raise SystemExit(f"dflash2-hf train: {out} holds a run trained with another schedule: "
                         f"{'; '.join(differences)} ({found.name}). Resume with the saved values, or pass a new --out "
                         "to start fresh.")


def training_settings(args: argparse.Namespace, records: list[dict]):
    """The run's :class:`~dflash2_hf.training.trainer.TrainingConfig`, checked (with the records it would train on)
    before anything loads."""
    from ..training.setup import fastest_dtype
    from ..training.trainer import TrainingConfig, check_trainable, split_heldout

    try:
        training = TrainingConfig(output_dir=args.out, steps=args.steps, batch_size=args.batch_size,
                                  blocks_per_sequence=args.blocks, learning_rate=args.lr, warmup_steps=args.warmup,
                                  checkpoint_every=args.checkpoint_every, seed=args.seed,
                                  heldout_fraction=args.heldout_fraction, train_drafter=not args.selector_only,
                                  selector_gold=args.selector_gold, distill_weight=args.distill_weight,
                                  anchors=args.anchors, labels=args.labels, feature_cache_gb=args.feature_cache_gb,
                                  feature_store=args.feature_store or str(Path(args.out) / "features"),
                                  bf16=fastest_dtype(args.dtype) == torch.bfloat16)
        check_trainable(split_heldout(records, training.heldout_fraction)[0], training.max_length, training.labels)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf train: {error}") from None
    return training


def starting_drafter(args: argparse.Namespace, target, tokenizer, records: list[dict]) -> DFlashDraftModel:
    """The drafter training starts from: the ``--init-from`` drafter (continued, or upgraded to DFlash 2), else a new
    one of the flags' layout initialised from the target's layers; cut to ``--draft-vocab-size`` tokens of
    ``records``' answers when asked. Its layout is saved in ``--out``; a resumed run asking for another is refused
    (the newest checkpoint there then replaces these starting weights)."""
    from ..training.checkpoint import latest_checkpoint

    out = Path(args.out)
    torch.manual_seed(args.seed)
    drafter = continued_drafter(args) if args.init_from else new_drafter(args, target, tokenizer)
    if args.draft_vocab_size is not None:
        drafter = with_answers_vocabulary(drafter, target, records, args.draft_vocab_size)
    saved_config = out / "drafter_config.json"
    # A config without any checkpoint next to it (a run that failed before its first one) fixes nothing.
    if latest_checkpoint(out) is not None and saved_config.exists():
        check_resumed_layout(saved_config, drafter.config, init_from=bool(args.init_from))
    out.mkdir(parents=True, exist_ok=True)
    drafter.config.to_json_file(saved_config)
    return drafter


def continued_drafter(args: argparse.Namespace) -> DFlashDraftModel:
    """The ``--init-from`` drafter, continued as saved, upgraded to DFlash 2 or given a new selector."""
    from ..training.setup import drafter_to_continue

    return drafter_to_continue(args.init_from, selector_rank=args.selector_rank or None,
                               new_selector=args.new_selector, selector_factorised=args.factorised_selector)


def new_drafter(args: argparse.Namespace, target, tokenizer) -> DFlashDraftModel:
    """A new drafter of the flags' layout, initialised from the target's last layers."""
    from ..training.setup import drafter_config_for, initialize_from_target

    mask = args.mask_token_id if args.mask_token_id is not None else vocabulary_id(tokenizer, args.mask_token)
    config = drafter_config_for(target.config, mask, num_layers=args.layers, num_taps=args.taps,
                                block_size=args.block_size, selector_rank=args.selector_rank or None,
                                intermediate_size=args.intermediate_size, selector_factorised=args.factorised_selector)
    drafter = DFlashDraftModel.class_for_config(config)(config)
    initialize_from_target(drafter, target)
    return drafter


def with_answers_vocabulary(drafter: DFlashDraftModel, target, records: list[dict], size: int) -> DFlashDraftModel:
    """``drafter`` drafting from the ``size`` tokens ``records``' answers use most (one already cut to that size is
    kept as it is; to another size, refused)."""
    from ..training.draft_vocabulary import draft_vocabulary_of, with_draft_vocabulary

    if drafter.config.draft_vocab_size is not None:
        if drafter.config.draft_vocab_size != size:
            raise SystemExit(f"dflash2-hf train: the --init-from drafter drafts from {drafter.config.draft_vocab_size} "
                             f"tokens, not --draft-vocab-size {size}; leave the flag out to keep its vocabulary.")
        return drafter
    vocabulary = draft_vocabulary_of(target, records, size)
    print(f"dflash2-hf train: {vocabulary.describe()}")
    return with_draft_vocabulary(drafter, target.get_output_embeddings().weight, vocabulary.token_ids)


def export_trained(args: argparse.Namespace, trainer, history: list[dict], folders: list[list[dict]]) -> None:
    """Save the trained drafter with its provenance (target, data, the run it continues) and training curves."""
    from ..export import read_training_record
    from ..measuring.plots import training_curves
    from ..presets import target_name
    from ..training.data import describe_data

    export = Path(args.export or Path(args.out) / "drafter")
    data = " + ".join(describe_data(name, len(folder)) for name, folder in zip(args.data, folders))
    provenance = {"target": target_name(args.target), "data": data}
    if args.init_from:  # keep the record of the run this one continues
        provenance["started_from"] = read_training_record(Path(args.init_from)) or {"drafter": args.init_from}
    trainer.export(export, provenance=provenance)
    if trainer.accelerator.is_main_process:  # the export folder exists on the main process only
        training_curves(history, export / "training_curves.png")
        print(f"drafter saved to {export}")


def train(args: argparse.Namespace) -> None:
    """Train a drafter on cached responses (resumes from ``--out``), then export it. Settings, data and output
    folders are checked before the target loads, the data's token ids and a resumed run's layout right after."""
    from ..presets import load_target
    from ..training.trainer import DrafterTrainer, split_heldout

    check_train_numbers(args)
    folders = read_data(args.data, "train")
    records = [record for folder in folders for record in folder]
    training = training_settings(args, records)
    check_out_folder("train", "--out", args.out)
    if args.export:
        check_out_folder("train", "--export", args.export)
    check_target_argument("dflash2-hf train", "--target", args.target)
    if args.init_from:
        drafter_config("dflash2-hf train", "--init-from", args.init_from, args.target)
        check_export_keeps_the_start(args)
    check_resumed_schedule(Path(args.out), training)
    target, tokenizer = load_target(args.target, dtype=torch.bfloat16 if training.bf16 else torch.float32)
    check_data_vocabulary("train", records, target, args.data)
    trained_on = split_heldout(records, training.heldout_fraction)[0]  # the held-out answers choose no token
    trainer = DrafterTrainer(starting_drafter(args, target, tokenizer, trained_on), target, records, training)
    history = trainer.train()
    export_trained(args, trainer, history, folders)
    trainer.finish()
