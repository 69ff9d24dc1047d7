"""Every `dflash2-hf` command has one error boundary: a user's mistake found after the models load (a bad value, a bad
file, models that do not fit together) prints one line naming the command and exits with status 2; a real bug keeps
its traceback.

The commands run on a loadable tiny target with SmolLM2's tokenizer and on tiny drafters saved for it (or, to be
refused, for another target).
"""

import json
from pathlib import Path

import pytest
from conftest import refusal, smollm2_tiny_target_folder, tiny_drafter

from dflash2_hf.cli import main
from dflash2_hf.presets import SMOLLM2_135M


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer and a 64-token context, as a checkpoint folder."""
    return smollm2_tiny_target_folder(tmp_path_factory.mktemp("target"), max_position_embeddings=64)


def saved_drafter(folder: Path, vocab_size: int = len(SMOLLM2_135M.load_tokenizer()), **overrides) -> str:
    """A tiny drafter saved for the target (``vocab_size``, ``overrides``: for another one)."""
    tiny_drafter(vocab_size=vocab_size, mask_token_id=vocab_size - 1, max_position_embeddings=64,
                 **overrides).save_pretrained(folder)
    return str(folder)


def truncated_drafter(folder: Path) -> str:
    saved_drafter(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(folder)


def prompts_file(folder: Path, text: str) -> str:
    folder.mkdir()
    (folder / "prompts.jsonl").write_text(text)
    return str(folder / "prompts.jsonl")


def generate_argv(target: str, drafter: str, *extra: str, prompt: str = "Hi") -> list[str]:
    return ["generate", prompt, "--target", target, "--drafter", drafter, "--dtype", "float32", "--no-baseline",
            "--max-new-tokens", "4", *extra]


def bench_argv(target: str, drafter: str, out: Path, *extra: str) -> list[str]:
    return ["bench", "--target", target, "--drafter", drafter, "--per-source", "1", "--temperatures", "0",
            "--max-new-tokens", "4", "--threads", "1", "--out", str(out), *extra]


def train_data(folder: Path) -> str:
    """A `dflash2-hf data` folder of 4 records, as the command writes it."""
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"target": "tiny"}))
    record = {"prompt": "Hi", "prompt_ids": [1, 2, 3, 4], "response_ids": list(range(5, 35))}
    (folder / "shard-0000000.jsonl").write_text((json.dumps(record) + "\n") * 4)
    return str(folder)


# A user's mistake that shows only once the models are loaded -> (argv builder over (target, tmp_path), what the
# refusal says). Each command that loads models is walked.
MISTAKES = {
    "generate: a prompt longer than the target's context": (
        lambda target, tmp: generate_argv(target, saved_drafter(tmp / "d"), prompt="word " * 200),
        "the answer would pass the target's context of 64 tokens (max_position_embeddings). Shorten the prompt"),
    "generate: a drafter made for another vocabulary": (
        lambda target, tmp: generate_argv(target, saved_drafter(tmp / "d", vocab_size=1000)),
        "does not fit the target model: vocabulary: drafter 1000, target 49152."),
    "generate: a drafter with truncated weights": (
        lambda target, tmp: generate_argv(target, truncated_drafter(tmp / "d")),
        "is truncated or corrupt"),
    "generate: a drafter tapping layers the target lacks": (
        lambda target, tmp: generate_argv(target, saved_drafter(tmp / "d", num_target_layers=12,
                                                                target_layer_ids=[0, 11])),
        "does not fit the target model: target_layer_ids [0, 11] need more than the target's 4 layers"),
    "generate: a tree far larger than the drafter's block": (
        lambda target, tmp: generate_argv(target, saved_drafter(tmp / "d"), "--tree-nodes", "100000"),
        "tree_nodes must be at most 21844, the branches a lattice of 7 drafted positions by 4 candidates holds"),
    "bench: a drafter with truncated weights": (
        lambda target, tmp: bench_argv(target, truncated_drafter(tmp / "d"), tmp / "out"),
        "is truncated or corrupt"),
    "bench: a prompts file that is not JSON": (
        lambda target, tmp: bench_argv(target, saved_drafter(tmp / "d"), tmp / "out", "--prompts",
                                       prompts_file(tmp / "p", '{"prompt": "Hi"}\nnot json\n'), "--per-source", "2"),
        "line 2 is not JSON"),
    "bench: a prompts file whose lines lack a prompt": (
        lambda target, tmp: bench_argv(target, saved_drafter(tmp / "d"), tmp / "out", "--prompts",
                                       prompts_file(tmp / "p", '{"question": "Hi"}\n')),
        'line 1 holds neither a non-empty "prompt" string'),
    "evaluate: a drafter made for another vocabulary": (
        lambda target, tmp: ["evaluate", saved_drafter(tmp / "d", vocab_size=1000), "--target", target,
                             "--prompts", "1", "--max-new-tokens", "4"],
        "does not fit the target model: vocabulary: drafter 1000, target 49152."),
    "train: --init-from a drafter made for another vocabulary": (
        lambda target, tmp: ["train", "--target", target, "--data", train_data(tmp / "data"), "--out",
                             str(tmp / "run"), "--steps", "1", "--init-from", saved_drafter(tmp / "d", vocab_size=1000)],
        "does not fit the target model: vocabulary: drafter 1000, target 49152."),
    "train: more taps than the target has layers to read": (
        lambda target, tmp: ["train", "--target", target, "--data", train_data(tmp / "data"), "--out",
                             str(tmp / "run"), "--steps", "1", "--taps", "40"],
        "--taps 40: the target's 4 layers give 1 distinct layers to read"),
    "heldout: a drafter tapping layers the target lacks": (
        lambda target, tmp: ["heldout", saved_drafter(tmp / "d", num_target_layers=12, target_layer_ids=[0, 11]),
                             "--target", target, "--data", train_data(tmp / "data"), "--heldout-fraction", "0.5"],
        "does not fit the target model: target_layer_ids [0, 11] need more than the target's 4 layers"),
}


@pytest.mark.parametrize("case", MISTAKES)
def test_a_mistake_found_after_loading_is_one_line_and_exit_status_two(target, tmp_path, case):
    argv_for, says = MISTAKES[case]
    message = refusal(argv_for(target, tmp_path))
    assert says in message, message


def test_a_bug_keeps_its_traceback(target, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("dflash2_hf.presets.load_target", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(generate_argv(target, saved_drafter(tmp_path / "d")))

