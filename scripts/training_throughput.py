"""Measure the training step's throughput on this machine: target features per second (one target forward per
sequence) and drafted positions per second of optimizer steps once the features are at hand.

    python scripts/training_throughput.py --data runs/smollm2-data --dtype float32 --records 40 --steps 8

A new 2-layer DFlash 2 drafter (block 16, selector rank 64) for SmolLM2-135M trains on the first ``--records``
answers of ``--data``, ``--batch-size`` sequences of ``--blocks`` blocks per step, as `dflash2-hf train` does by
default (``--draft-vocab-size N``: cut to the N tokens all of ``--data``'s answers use most). It uses only the
trainer's long-standing interface, so it also measures an older checkout (``PYTHONPATH=OLD_CHECKOUT``, without
``--draft-vocab-size``): that is how docs/training.md compares before and after.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from dflash2_hf.cpu.kernels import cpu_description
from dflash2_hf.modeling import DFlashDraftModel
from dflash2_hf.presets import load_target
from dflash2_hf.training.data import read_responses
from dflash2_hf.training.setup import drafter_config_for, initialize_from_target
from dflash2_hf.training.trainer import DrafterTrainer, TrainingConfig


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a `dflash2-hf data` folder of SmolLM2-135M answers")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the target's dtype; bfloat16 also trains under bf16 autocast")
    parser.add_argument("--records", type=int, default=40, help="answers to train on (>= 1)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps after one untimed step (>= 1)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step (>= 1)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per sequence (>= 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (>= 1)")
    parser.add_argument("--draft-vocab-size", type=int,
                        help="cut the drafter to the N tokens the answers use most (>= 1; default: the whole head)")
    args = parser.parse_args()
    for name in ("records", "steps", "batch_size", "blocks", "threads", "draft_vocab_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def new_trainer(args: argparse.Namespace) -> DrafterTrainer:
    """A trainer of a fresh drafter on the first ``--records`` answers."""
    bf16 = args.dtype == "bfloat16"
    target, tokenizer = load_target("smollm2-135m", dtype=getattr(torch, args.dtype))
    config = drafter_config_for(target.config, tokenizer.get_vocab()["<empty_output>"], num_layers=2, num_taps=3,
                                block_size=16, selector_rank=64)
    torch.manual_seed(0)
    drafter = DFlashDraftModel.class_for_config(config)(config)
    initialize_from_target(drafter, target)
    records = read_responses(args.data)[: args.records]
    if args.draft_vocab_size is not None:
        from dflash2_hf.training.draft_vocabulary import draft_vocabulary_of, with_draft_vocabulary

        vocabulary = draft_vocabulary_of(target, read_responses(args.data), args.draft_vocab_size)
        drafter = with_draft_vocabulary(drafter, target.get_output_embeddings().weight, vocabulary.token_ids)
    settings = TrainingConfig(output_dir=tempfile.mkdtemp(), steps=10**6, batch_size=args.batch_size,
                              blocks_per_sequence=args.blocks, checkpoint_every=10**6, bf16=bf16)
    return DrafterTrainer(drafter, target, records, settings)


def drafted_positions(trainer: DrafterTrainer, steps: range) -> int:
    """Drafted positions with a label in the batches of ``steps`` (fewer than batch x blocks x (block - 1) where an
    answer has fewer anchors than ``--blocks`` or a block runs past its end)."""
    return sum(int((trainer.batch_for_step(step).labels[..., 1:] != -100).sum()) for step in steps)


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    trainer = new_trainer(args)
    started = time.perf_counter()
    for record_id, record in enumerate(trainer.records):
        trainer._target_states(record_id, torch.tensor((record["prompt_ids"] + record["response_ids"])[:512]))
    features = len(trainer.records) / (time.perf_counter() - started)
    trainer.drafter.train()
    trainer.train_step()  # untimed: first-call allocations
    started = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    seconds = (time.perf_counter() - started) / args.steps
    positions = drafted_positions(trainer, range(1, args.steps + 1)) / args.steps
    print(f"{cpu_description()}, target {args.dtype}: features {features:.2f} sequences/s; "
          f"{seconds:.2f} s/step, {positions / seconds:.0f} drafted positions/s")


if __name__ == "__main__":
    main()
