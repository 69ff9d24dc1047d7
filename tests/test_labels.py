"""Cheap labels: the target's teacher-forced choices on text it did not write, and the three label sources."""

import pytest
import torch

from conftest import new_drafter, tiny_target
from dflash2_hf.training.blocks import IGNORE, blocks_at
from dflash2_hf.training.labels import (
    LABEL_SOURCES,
    block_labels,
    label_row,
    missing_choices,
    teacher_forced_choices,
)
from dflash2_hf.training.trainer import DrafterTrainer, TrainingConfig, check_trainable


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def test_teacher_forced_choices_are_the_targets_greedy_pick_after_each_prefix(target):
    prompt, response = [5, 17, 3, 40], [8, 8, 61, 2, 33, 90]
    choices = teacher_forced_choices(target, prompt, response)
    with torch.no_grad():
        one_by_one = [int(target(torch.tensor([prompt + response[:i]])).logits[0, -1].argmax())
                      for i in range(len(response))]
    assert choices == one_by_one


def test_on_the_targets_own_greedy_answer_the_choices_are_the_answer(target):
    prompt = [5, 17, 3, 40]
    output = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    response = output[0, len(prompt):].tolist()
    assert teacher_forced_choices(target, prompt, response) == response


def test_an_empty_response_has_no_choices(target):
    assert teacher_forced_choices(target, [1, 2, 3], []) == []


TEXT = [1, 2, 3, 10, 11, 12, 13, 14, 15]  # the prompt is [1, 2, 3]; the text leaves the target's choice at 12
CHOICES = [1, 2, 3, 10, 11, 22, 23, 14, 25]  # the prompt, then the target's choice where each response token stands


@pytest.mark.parametrize(("source", "anchor", "expected"), [
    ("text", 2, [3, 10, 11, 12, 13]),
    ("target", 2, [3, 10, 11, 22, 23]),
    ("target-prefix", 2, [3, 10, 11, 22]),  # stopped at the first departure, the target's correction kept
    ("target-prefix", 3, [10, 11, 22]),
    ("target-prefix", 4, [11, 22]),  # the text departs right after the anchor: one label
    ("target-prefix", 6, [13, 14, 25]),  # cut by the end of the sequence and by a departure at its last token
    ("target", 6, [13, 14, 25]),
])
def test_block_labels_by_source(source, anchor, expected):
    record = {"prompt_ids": TEXT[:3], "response_ids": TEXT[3:], "target_choices": CHOICES[3:]}
    assert block_labels(TEXT, label_row(record, source), anchor, 5, source) == expected


def test_a_block_whose_text_is_the_targets_choice_throughout_keeps_every_label():
    assert block_labels(TEXT, TEXT, 3, 5, "target-prefix") == [10, 11, 12, 13, 14]


def test_blocks_read_their_labels_from_the_chosen_source():
    record = {"prompt_ids": TEXT[:3], "response_ids": TEXT[3:], "target_choices": CHOICES[3:]}
    batch = blocks_at([record], [[2]], block_size=5, max_length=64, labels="target-prefix")
    assert batch.labels[0, 0].tolist() == [3, 10, 11, 22, IGNORE]
    assert batch.input_ids[0, :9].tolist() == TEXT, "the blocks still read the text itself"


def test_training_on_the_targets_choices_refuses_records_without_them():
    records = [{"prompt_ids": [1, 2], "response_ids": [3, 4, 5]},
               {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "target_choices": [3, 4, 5]}]
    assert missing_choices(records) == 1
    check_trainable(records, 64, "text")
    for source in LABEL_SOURCES[1:]:
        with pytest.raises(ValueError, match=rf"labels '{source}' read the target's choices, which 1 of the 2"):
            check_trainable(records, 64, source)


@pytest.mark.parametrize("labels", ["TEXT", "targets", "", "prefix"])
def test_an_unknown_label_source_is_refused(labels, tmp_path):
    with pytest.raises(ValueError, match="labels must be one of text, target, target-prefix"):
        TrainingConfig(output_dir=str(tmp_path), labels=labels)


def test_on_the_targets_own_answers_every_label_source_trains_on_the_same_blocks(target, tmp_path):
    records = []
    for seed in range(4):
        prompt = torch.randint(0, 90, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        response = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, 6:].tolist()
        records.append({"prompt_ids": prompt, "response_ids": response,
                        "target_choices": teacher_forced_choices(target, prompt, response)})
    batches = [DrafterTrainer(new_drafter(), target, records,
                              TrainingConfig(output_dir=str(tmp_path / source), labels=source)).batch_for_step(3)
               for source in LABEL_SOURCES]
    assert all(torch.equal(batch.labels, batches[0].labels) for batch in batches[1:])
