"""Resumable work that test_interrupts.py kills and restarts: `python interruptible.py train|data FOLDER`.

* ``train``: trains a tiny drafter in ``FOLDER/run`` (checkpoints every few steps), then writes the final weights to
  ``FOLDER/final.safetensors``.
* ``data``: answers a few prompts with a tiny target, batch by batch, into shards in ``FOLDER``.

Either prints ``started N`` (flushed) as it starts step / batch ``N``, so the test knows how far a killed run got
and where a restarted one began. The test runs the same work unbroken in its own process for comparison.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).parent))
from conftest import TINY_VOCAB, new_drafter, random_records, tiny_target  # noqa: E402
from dflash2_hf.training.data import ResponseGenerator  # noqa: E402
from dflash2_hf.training.trainer import DrafterTrainer, TrainingConfig  # noqa: E402

STEPS, CHECKPOINT_EVERY = 12, 3
PROMPTS, BATCH_SIZE, NEW_TOKENS = 20, 2, 16
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def trainer(folder: Path) -> DrafterTrainer:
    """A short training run of a tiny drafter that checkpoints into ``folder`` every ``CHECKPOINT_EVERY`` steps.

    bf16 autocast as by default: accelerate allows one mixed-precision setting per process, and the other tests'
    trainers use the default."""
    config = TrainingConfig(output_dir=str(folder), steps=STEPS, batch_size=4, blocks_per_sequence=4, warmup_steps=2,
                            learning_rate=1e-3, checkpoint_every=CHECKPOINT_EVERY)
    return DrafterTrainer(new_drafter(), tiny_target("qwen3"), random_records(), config)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny targets' vocabulary (words ``w0``, ``w1``, ...) with a chat template."""
    words = SPECIAL_TOKENS + [f"w{i}" for i in range(TINY_VOCAB - len(SPECIAL_TOKENS))]
    backend = Tokenizer(WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompts() -> list[str]:
    """Distinct prompts of 1 to 8 words (so batches are padded)."""
    draw = random.Random(0)
    return [" ".join([f"w{i}"] + [f"w{draw.randrange(80)}" for _ in range(draw.randrange(8))]) for i in range(PROMPTS)]


def response_generator(folder: Path) -> ResponseGenerator:
    """Greedy answers of a tiny target, ``BATCH_SIZE`` prompts per shard in ``folder``."""
    settings = ResponseGenerator.settings_for("tiny-qwen3", prompts(), max_new_tokens=NEW_TOKENS, temperature=0.0)
    return ResponseGenerator(tiny_target("qwen3"), chat_tokenizer(), folder, settings, batch_size=BATCH_SIZE)


def announce_starts(owner: object, method: str, number: Callable[..., int]) -> None:
    """Make ``owner.method`` print ``started N`` first, ``N = number(*arguments)``."""
    original = getattr(owner, method)

    def announced(*args):
        print(f"started {number(*args)}", flush=True)
        return original(*args)

    setattr(owner, method, announced)


def main(kind: str, folder: Path) -> None:
    torch.set_num_threads(1)  # the same reduction order as the unbroken run, for bit-for-bit comparisons
    if kind == "train":
        run = trainer(folder / "run")
        announce_starts(run, "batch_for_step", lambda step: step)
        run.train()
        save_file({k: v.contiguous() for k, v in run.unwrapped.state_dict().items()}, folder / "final.safetensors")
    else:
        generator, texts = response_generator(folder), prompts()
        order = generator.answering_order(texts)
        announce_starts(generator, "_answer", lambda batch: order.index(batch[0]) // BATCH_SIZE)
        generator.run(texts)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
