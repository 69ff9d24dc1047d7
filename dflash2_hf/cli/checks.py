"""Checks the commands share, each refusing bad input in one line before any model loads."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from ..cpu.kernels import packed_linears_supported
from ..drafting.lattice import PathStrategy
from ..modeling import DFlashConfig

PATHS = [strategy.value for strategy in PathStrategy]
#: The prompt sources `bench --prompts` knows by name (anything else must be a JSONL file).
PROMPT_SOURCES = ("humaneval", "mtbench", "sharegpt")


def read_data(folders: list[str], command: str) -> list[list[dict]]:
    """The records of each `dflash2-hf data` folder; a folder without any, or a shard line that is not a whole record,
    stops the command before it loads a model."""
    from ..training.data import read_responses

    try:
        return [read_responses(folder) for folder in folders]
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"dflash2-hf {command}: {error}") from None


def check_out_folder(command: str, flag: str, folder: str) -> None:
    """Refuse, before anything loads, an output folder the command could not write (a file, a path under a file, a
    place where no folder can be made)."""
    from ..training.checkpoint import check_writable_folder

    try:
        check_writable_folder(folder)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf {command}: {flag} {error}") from None


def check_out_file(command: str, flag: str, file: str | None) -> None:
    """Refuse, before anything loads, an output file (``None``: not asked for) the command could not write at the
    end of its work: an existing folder, or a file whose folder is a file, lies under one, or cannot be made."""
    from ..training.checkpoint import check_writable_folder

    if file is None:
        return
    if Path(file).is_dir():
        raise SystemExit(f"dflash2-hf {command}: {flag} {file} is a folder; name a file to write.")
    try:
        check_writable_folder(Path(file).parent)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf {command}: {flag} {file}: its folder {error}") from None


def write_json(file: str, record: dict) -> None:
    """Write ``record`` to ``file`` (its folder made if missing) through a temporary file moved into place, so an
    interrupted write never leaves a truncated file where an earlier one was."""
    path = Path(file)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(path)


def check_data_vocabulary(command: str, records: list[dict], target, folders: list[str]) -> None:
    """Refuse, right after the target loads and before any work, records whose token ids its vocabulary lacks."""
    from ..training.data import check_token_ids

    try:
        check_token_ids(records, target.get_input_embeddings().weight.shape[0], folders)
    except ValueError as error:
        raise SystemExit(f"dflash2-hf {command}: {error}") from None


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


def check_finite_numbers(command: str, args: argparse.Namespace) -> None:
    """Refuse, by rule for every option of every command, a number that is NaN or infinite (``float`` parses both):
    no range check can hold it, and it would reach a model, a schedule or a manifest."""
    for name, values in vars(args).items():
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, float) and not math.isfinite(value):
                raise SystemExit(f"{command}: --{name.replace('_', '-')} must be a finite number, got {value}.")


def check_minimums(command: str, args: argparse.Namespace, minimums: dict[str, int]) -> None:
    """Refuse each option of ``minimums`` (flag -> its smallest value) below it, naming the first."""
    for flag, minimum in minimums.items():
        refuse_below(command, flag, getattr(args, flag.removeprefix("--").replace("-", "_")), minimum)


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
    from ..presets import check_target

    try:
        check_target(target)
    except FileNotFoundError as error:
        raise SystemExit(f"{command}: {flag}: {error}") from None


def drafter_config(command: str, flag: str, folder: str | None, target: str) -> DFlashConfig:
    """The config of the drafter folder given (``None``: the one shipped for the preset ``target``), read without
    its weights, so that a missing folder, or one holding no DFlash drafter, is refused before the target loads."""
    from ..presets import default_drafter_folder

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


def check_prompts_fit(command: str, prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int, target) -> None:
    """Refuse, before any decoding, a tokenized prompt whose answer of ``max_new_tokens`` would not fit in the
    target's context (``max_position_embeddings``), naming the prompt by its source and place."""
    context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if context is None:
        return
    counts: dict[str, int] = {}
    for source, ids in prompts:
        counts[source] = counts.get(source, 0) + 1
        if ids.shape[-1] + max_new_tokens > context:
            where = "the prompt" if len(prompts) == 1 else f"prompt {counts[source]} of {source}"
            raise SystemExit(f"{command}: {where} has {ids.shape[-1]} tokens; with --max-new-tokens {max_new_tokens} "
                             f"the answer would pass the target's context of {context} tokens "
                             "(max_position_embeddings). Shorten the prompt or lower --max-new-tokens.")


def check_text_arguments(command: str, args: argparse.Namespace, argv: list[str]) -> None:
    """Refuse, in one line naming the argument, text or a path from the command line that is not valid UTF-8 (bytes
    Python could only decode with surrogate escapes, such as Latin-1 text from a terminal in another encoding)."""
    for name, value in vars(args).items():
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not is_unicode_text(text):
                flag = f"--{name.replace('_', '-')}"
                shown = flag if flag in argv else name.upper()
                raise SystemExit(f"{command}: {shown} is not valid UTF-8 ({ascii(text)}); pass it in UTF-8, e.g. "
                                 "from a terminal set to UTF-8, or convert it with iconv.")


def is_unicode_text(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (holds no lone surrogates, which undecodable bytes become)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
