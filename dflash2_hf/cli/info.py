"""`dflash2-hf info`: describe a drafter folder, its weights checked when it has any."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..modeling import DFlashDraftModel
from .checks import drafter_config
from .parsers import add_command


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dflash2-hf info`."""
    describe = add_command(commands, "info", "describe a drafter folder",
                           "Describe a drafter folder: prints its kind, layout, parameter counts and decoding defaults "
                           "as JSON (the weights, when it has any, are read in full and checked first).")
    describe.add_argument("folder", help="a drafter folder (config.json, and model.safetensors when trained)")
    describe.set_defaults(run=info)


def info(args: argparse.Namespace) -> None:
    """Describe a drafter folder from its config; its safetensors weights, when it has any, are read in full first,
    so that a truncated or corrupt file, tensors that do not match the config or NaN/Inf values stop the command with
    the reason instead of a healthy summary. A folder with a config only (e.g. a published config) is described
    from the config."""
    from ..export import describe_config

    config = drafter_config("dflash2-hf info", "folder", args.folder, target="")
    if any(Path(args.folder).glob("*.safetensors*")):
        try:
            DFlashDraftModel.from_pretrained(args.folder, config=config)
        except (OSError, ValueError) as error:
            raise SystemExit(f"dflash2-hf info: {error}") from None
    json.dump(describe_config(config), sys.stdout, indent=2)
    print()
