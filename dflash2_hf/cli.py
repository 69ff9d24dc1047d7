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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash2-hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="describe a drafter folder (config.json + weights)")
    info.add_argument("folder")
    args = parser.parse_args(argv)
    if args.command == "info":
        json.dump(describe_drafter(args.folder), sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
