"""Train a tiny drafter for a few steps; run with `accelerate launch --cpu --num_processes N` by test_distributed.py.

Writes the initial and trained weights to OUT/initial.safetensors and OUT/drafter.safetensors (main process).
"""

import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from conftest import new_drafter, random_records, tiny_target  # noqa: E402
from dflash2_hf.training.trainer import DrafterTrainer, TrainingConfig  # noqa: E402


def main(out: Path) -> None:
    target = tiny_target("qwen3")
    records = random_records()
    drafter = new_drafter()
    initial = {k: v.clone().contiguous() for k, v in drafter.state_dict().items()}
    training = TrainingConfig(output_dir=str(out / "run"), steps=6, batch_size=4, blocks_per_sequence=4,
                              warmup_steps=2, learning_rate=1e-3, checkpoint_every=100, bf16=False)
    trainer = DrafterTrainer(drafter, target, records, training)
    trainer.train()
    if trainer.accelerator.is_main_process:
        save_file(initial, out / "initial.safetensors")
        save_file({k: v.contiguous() for k, v in trainer.unwrapped.state_dict().items()}, out / "drafter.safetensors")
        print(f"processes={trainer.accelerator.num_processes}")
    trainer.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
