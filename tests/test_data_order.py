"""How the data step answers: like-sized prompts batched together, in an order a resumed run repeats, with the
target's dtype in the manifest."""

import json
from dataclasses import asdict, replace

import pytest
import torch

from conftest import tiny_target
from dflash2_hf.training import data
from dflash2_hf.training.data import ResponseGenerator, read_responses, shard_files
from dflash2_hf.training.setup import fastest_dtype
from interruptible import chat_tokenizer

PROMPTS = ["w1 w2 w3 w4 w5", "w6", "w7 w8 w9", "w10 w11", "w12 w13 w14 w15", "w16 w17 w18 w19 w20 w21", "w22"]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def generator(target, folder, prompts=PROMPTS, batch_size=2, **settings) -> ResponseGenerator:
    chosen = replace(ResponseGenerator.settings_for("tiny", prompts, max_new_tokens=4, temperature=0.0), **settings)
    return ResponseGenerator(target, chat_tokenizer(), folder, chosen, batch_size=batch_size)


def test_prompts_are_answered_shortest_first_within_each_window(target, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "LENGTH_WINDOW", 4)
    order = generator(target, tmp_path).answering_order(PROMPTS)
    words = [len(prompt.split()) for prompt in order]
    assert words == sorted(words[:4]) + sorted(words[4:]) and sorted(order) == sorted(PROMPTS)


def test_records_come_in_answering_order_one_per_prompt(target, tmp_path):
    run = generator(target, tmp_path)
    run.run(PROMPTS)
    assert [record["prompt"] for record in read_responses(tmp_path)] == run.answering_order(PROMPTS)


def test_the_batch_size_changes_no_answer(target, tmp_path):
    """Sorted batches pad less, but each answer is the target's own, whatever the batch."""
    generator(target, tmp_path / "one", batch_size=1).run(PROMPTS)
    generator(target, tmp_path / "three", batch_size=3).run(PROMPTS)
    assert read_responses(tmp_path / "one") == read_responses(tmp_path / "three")


def test_a_run_resumed_with_another_batch_size_answers_each_prompt_once(target, tmp_path):
    generator(target, tmp_path, batch_size=2).run(PROMPTS)
    for shard in shard_files(tmp_path)[2:]:  # as if stopped after two batches
        shard.unlink()
    generator(target, tmp_path, batch_size=3).run(PROMPTS)
    assert sorted(record["prompt"] for record in read_responses(tmp_path)) == sorted(PROMPTS)


def test_a_folder_begun_before_sorting_goes_on_in_prompt_order(target, tmp_path):
    manifest = asdict(generator(target, tmp_path).settings)
    del manifest["order"], manifest["dtype"]  # fields older manifests lack
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    older = generator(target, tmp_path, order="as given", dtype="bfloat16")
    older.run(PROMPTS)
    assert [record["prompt"] for record in read_responses(tmp_path)] == PROMPTS


def test_the_manifest_records_the_targets_dtype_and_a_resume_in_another_is_refused(target, tmp_path):
    generator(target, tmp_path).run(PROMPTS[:2])
    assert json.loads((tmp_path / "manifest.json").read_text())["dtype"] == "float32"
    with pytest.raises(ValueError, match="holds responses made with other settings: .*'dtype': 'float32'"):
        generator(target, tmp_path, dtype="bfloat16").run(PROMPTS[:2])


@pytest.mark.parametrize("choice, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_a_named_dtype_is_taken_as_named(choice, dtype):
    assert fastest_dtype(choice) == dtype


def test_auto_computes_in_float32_on_a_cpu_held_below_its_bf16_instructions(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fastest_dtype("auto") == torch.float32
