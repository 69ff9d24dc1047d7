"""The drafter shipped for SmolLM2-135M-Instruct (marked slow; CI runs it): the README's main command works offline
and the trained drafter is lossless and actually drafts right on real text."""

import re

import pytest
import torch

from dflash2_hf import DFlash2DraftModel, DFlashDraftModel
from dflash2_hf.cli import main
from conftest import assert_plain_decodings_output
from dflash2_hf.presets import SMOLLM2_135M, default_drafter_folder

pytestmark = pytest.mark.slow


def test_shipped_drafter_is_a_small_bf16_dflash2_checkpoint():
    folder = default_drafter_folder("smollm2-135m")
    assert (folder / "model.safetensors").stat().st_size <= 64 * 2**20
    assert not list(folder.glob("*.py")), "the package's own modeling code serves the shipped drafter"
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert isinstance(drafter, DFlash2DraftModel) and drafter.dtype == torch.bfloat16


@pytest.mark.measured_widths
@pytest.mark.parametrize("exactness", [[], ["--exactness", "bitwise"]], ids=["default", "bitwise"])
def test_readme_main_command_streams_an_answer_and_matches_plain_decoding(capsys, exactness):
    assert main(["generate", "Write a Python function that reverses a string.", "--max-new-tokens", "48",
                 *exactness]) == 0
    out = capsys.readouterr().out
    drafted = re.search(r"mean acceptance length (\d+\.\d+)", out)
    plain_here = "plain decoding here, since no verification width of this CPU rounds as one-token steps" in out
    assert bool(drafted) != plain_here, "drafted, or decoded plainly saying why"
    assert drafted or exactness, "the default drafts whatever this CPU's kernels round"
    assert out.startswith("--- setting for "), "the command says first which setting it chose for this CPU"
    assert "--- dflash2 (greedy, tree of up to 8, sized by cost + lookup of 8" in out, (
        "the shipped drafter's config makes a cost-sized tree of up to 8 nodes with an 8-token lookup branch, and the "
        "fallback to plain steps, the default")
    assert re.search(r"speedup \d+\.\d\dx", out)
    assert re.search(r"identical to plain decoding: (yes|no: differs from new token \d+ on, at a near-tie)", out)


def test_trained_drafter_accepts_more_than_one_token_per_cycle_on_code():
    target, tokenizer = SMOLLM2_135M.load_model(torch.bfloat16), SMOLLM2_135M.load_tokenizer()
    drafter = DFlashDraftModel.from_pretrained(default_drafter_folder("smollm2-135m"), dtype=torch.bfloat16)
    messages = [{"role": "user", "content": "Write a Python function that returns the sum of a list of numbers."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    target.generate(**inputs, assistant_model=drafter, max_new_tokens=64, do_sample=False, dflash_lookup_tokens=0,
                    dflash_plain_fallback=False)  # every step a drafting cycle, whatever this machine's speed
    assert drafter.last_generation_stats.mean_acceptance_length > 1.2, "an untrained drafter accepts ~1.0"


def test_the_lookup_branch_accepts_more_on_code_that_repeats_its_prompt_and_keeps_the_output():
    target, tokenizer = SMOLLM2_135M.load_model(torch.float32), SMOLLM2_135M.load_tokenizer()
    drafter = DFlashDraftModel.from_pretrained(default_drafter_folder("smollm2-135m"), dtype=torch.float32)
    request = ("Complete this function:\n\ndef count_vowels(text: str) -> int:\n"
               '    """Return how many vowels (a, e, i, o, u) the text holds."""\n')
    messages = [{"role": "user", "content": request}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, max_new_tokens=64, do_sample=False)
    acceptance = {}
    for lookup in (0, 16):
        ours = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64, do_sample=False,
                               dflash_tree_nodes=8, dflash_lookup_tokens=lookup, dflash_plain_fallback=False)
        assert_plain_decodings_output(target, inputs, ours, plain)
        acceptance[lookup] = drafter.last_generation_stats.mean_acceptance_length
    assert acceptance[16] > acceptance[0], "the answer repeats the prompt's signature, which the lookup copies"


def test_the_exported_shipped_drafter_decodes_through_transformers_custom_generate(tmp_path):
    """A real export (`dflash2-hf export`) of the shipped drafter, used the way its model card says: no drafter
    argument, transformers' remote-code generation, token-identical to plain greedy decoding, drafting right."""
    out = tmp_path / "smollm2-135m-dflash2"
    assert main(["export", str(default_drafter_folder("smollm2-135m")), str(out)]) == 0
    target, tokenizer = SMOLLM2_135M.load_model(torch.float32), SMOLLM2_135M.load_tokenizer()
    messages = [{"role": "user", "content": "Write a Python function that returns the sum of a list of numbers."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    ours = target.generate(**inputs, custom_generate=str(out), trust_remote_code=True, max_new_tokens=48,
                           do_sample=False, return_dict_in_generate=True)
    assert_plain_decodings_output(target, inputs, ours.sequences, plain)
    drafted = target.generate(**inputs, custom_generate=str(out), trust_remote_code=True, max_new_tokens=48,
                              do_sample=False, return_dict_in_generate=True, dflash_tree_nodes=0,
                              dflash_plain_fallback=False)  # one whole path every cycle, whatever this machine's speed
    assert_plain_decodings_output(target, inputs, drafted.sequences, plain)
    assert drafted.dflash_stats.mean_acceptance_length > 1.2, "the export's trained drafter drafted"


def test_bench_compares_the_shipped_drafter_with_another_in_one_run(tmp_path, capsys):
    """docs/training.md's side-by-side bench (here 1 HumanEval prompt, 16 new tokens): `shipped` names the preset's
    drafter; a copy of it elsewhere runs next to it, the same plain decoding the unit of both."""
    import json
    import shutil

    copy = tmp_path / "copy-run" / "drafter"
    shutil.copytree(default_drafter_folder("smollm2-135m"), copy)
    threads = torch.get_num_threads()
    try:
        main(["bench", "--drafter", "shipped", str(copy), "--prompts", "humaneval", "--per-source", "1",
              "--temperatures", "0", "--max-new-tokens", "16", "--threads", "2", "--paths", "argmax",
              "--out", str(tmp_path / "report")])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "report" / "results.json").read_text())
    rows = {row["method"]: row for row in report["summary"]}
    shipped, copied = rows["dflash2 argmax (smollm2-135m)"], rows["dflash2 argmax (copy-run)"]
    assert shipped["same_tokens_as_plain"] == copied["same_tokens_as_plain"] == 1
    assert shipped["mean_acceptance_length"] == copied["mean_acceptance_length"] > 1
    assert set(report["settings"]["drafters"]) == {"smollm2-135m", "copy-run"}
    assert "Drafter copy-run:" in capsys.readouterr().out
