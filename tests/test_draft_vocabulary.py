"""A draft vocabulary: the drafter drafts from the target tokens its answers use most, through a head of its own, and
decoding stays exact (greedy identical to plain generate, sampling the target's distribution)."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict

import pytest
import torch

from conftest import TINY_VOCAB, random_records, refusal, tiny_drafter, tiny_target
from dflash2_hf import DFlashDraftModel
from dflash2_hf.cli import main
from dflash2_hf.drafting.block import BlockDrafter
from dflash2_hf.drafting.options import DraftOptions
from dflash2_hf.export import ExportError, export_drafter
from dflash2_hf.generation import loop
from dflash2_hf.measuring.exactness import goodness_of_fit, keep_every_draft
from dflash2_hf.modeling import DrafterLoadError
from dflash2_hf.training.draft_vocabulary import (
    answer_coverage, answer_token_counts, most_used_tokens, with_draft_vocabulary, with_the_target_head,
)
from dflash2_hf.training.trainer import DrafterTrainer, TrainingConfig
from test_sampling_exactness import SETTINGS, VOCAB, exact_distribution, sample_with_drafter

#: Every other token of the tiny vocabulary, the mask token among them.
EVEN_TOKENS = torch.arange(0, TINY_VOCAB, 2)


def cut(drafter: DFlashDraftModel, target: torch.nn.Module, token_ids: torch.Tensor = EVEN_TOKENS) -> DFlashDraftModel:
    return with_draft_vocabulary(drafter, target.get_output_embeddings().weight, token_ids).eval()


def test_the_most_used_tokens_are_kept_with_the_end_ids_sorted_by_id():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert most_used_tokens(counts, 3).tolist() == [2, 3, 5]
    assert most_used_tokens(counts, 3, always=[1]).tolist() == [1, 2, 3]
    assert most_used_tokens(counts, 4).tolist() == [0, 2, 3, 5]  # ties by lower id: 0 (5) before 4 (1)


@pytest.mark.parametrize("size", [0, -1, 7])
def test_a_size_outside_the_vocabulary_is_refused(size):
    with pytest.raises(ValueError, match=r"a draft vocabulary holds 1 to 6 tokens .*got"):
        most_used_tokens(torch.ones(6, dtype=torch.long), size)


def test_coverage_is_the_share_of_answer_tokens_in_the_vocabulary():
    counts = answer_token_counts([{"response_ids": [1, 1, 2, 3]}, {"response_ids": [1]}], vocab_size=5)
    assert counts.tolist() == [0, 3, 1, 1, 0]
    assert answer_coverage(counts, torch.tensor([1, 3])) == pytest.approx(0.8)


def test_the_cut_head_gives_the_target_heads_logits_of_the_vocabulary(target, drafter):
    hidden = torch.randn(2, 5, drafter.config.hidden_size)
    head = target.get_output_embeddings()
    cut_drafter = cut(drafter, target)
    torch.testing.assert_close(cut_drafter.compute_logits(hidden, head), drafter.compute_logits(hidden, head)[..., EVEN_TOKENS])


def test_drafted_candidates_are_target_ids_of_the_vocabulary(target, drafter):
    cut_drafter = cut(drafter, target)
    block = BlockDrafter(cut_drafter, target, DraftOptions.for_drafter(cut_drafter, target=target))
    context = torch.randn(1, 6, len(cut_drafter.target_layer_ids) * cut_drafter.config.hidden_size)
    lattice, _ = block.draft(context, anchor_id=3, anchor_position=6, length=5)
    full, _ = BlockDrafter(drafter, target, DraftOptions.for_drafter(drafter, target=target)).draft(context, 3, 6, 5)
    assert torch.isin(lattice.candidate_ids, EVEN_TOKENS).all()
    assert not torch.isin(full.candidate_ids, EVEN_TOKENS).all(), "the full head drafts tokens outside it"


@pytest.mark.parametrize("options", [{}, {"dflash_tree_nodes": 0, "dflash_path": "argmax"}], ids=["default", "argmax"])
def test_greedy_output_is_plain_generates(target, drafter, options):
    prompt = torch.tensor([[5, 17, 3, 40, 22, 9]])
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
    out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=cut(drafter, target),
                          return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, plain)
    assert out.dflash_stats.cycles > 0


def test_sampling_keeps_the_targets_distribution_and_the_control_fails(monkeypatch):
    target = tiny_target("qwen3", seed=2, vocab_size=VOCAB)
    drafter = tiny_drafter("dflash2", seed=3, vocab_size=VOCAB, mask_token_id=VOCAB - 1, block_size=3, selector_top_k=3)
    cut_drafter = cut(drafter, target, torch.tensor([0, 2, 3]))  # tokens 1 and 4 are never drafted
    settings = SETTINGS["temperature 1"]
    exact = exact_distribution(target, settings)
    draws, acceptance = sample_with_drafter(target, cut_drafter, settings)
    assert {1, 2, 3} <= set(acceptance)
    assert goodness_of_fit(draws, exact) > 1e-3
    monkeypatch.setattr(loop, "verify_sampled", keep_every_draft)
    control, _ = sample_with_drafter(target, cut_drafter, settings)
    assert goodness_of_fit(control, exact) < 1e-6, "the test must be able to detect a biased decoder"


def test_a_cut_drafter_saves_and_loads_back_its_vocabulary(target, drafter, tmp_path):
    cut(drafter, target).save_pretrained(tmp_path / "cut")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "cut")
    assert loaded.config.draft_vocab_size == EVEN_TOKENS.numel()
    assert loaded.draft_vocabulary.dtype == torch.long and torch.equal(loaded.draft_vocabulary, EVEN_TOKENS)
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["dflash_config"]["draft_vocab_size"] == 48


BAD_VOCABULARIES = {
    "a repeated id": torch.cat([EVEN_TOKENS[:-1], EVEN_TOKENS[:1]]),
    "an id past the vocabulary": torch.cat([EVEN_TOKENS[:-1], torch.tensor([TINY_VOCAB])]),
    "a negative id": torch.cat([torch.tensor([-1]), EVEN_TOKENS[1:]]),
}


@pytest.mark.parametrize("case", BAD_VOCABULARIES)
def test_a_vocabulary_that_is_not_distinct_target_ids_is_refused_at_load(target, drafter, tmp_path, case):
    broken = cut(drafter, target)
    broken.draft_vocabulary.copy_(BAD_VOCABULARIES[case])
    broken.save_pretrained(tmp_path / "cut")
    with pytest.raises(DrafterLoadError, match="draft_vocabulary that is not 48 distinct token ids below vocab_size 96"):
        DFlashDraftModel.from_pretrained(tmp_path / "cut")


@pytest.mark.parametrize(("size", "problem"), [
    (TINY_VOCAB + 1, "draft_vocab_size must be <= vocab_size 96"),
    (3, "selector_top_k must be <= draft_vocab_size 3"),
    (0, "draft_vocab_size must be"),
    (2.5, "draft_vocab_size must be"),
])
def test_a_draft_vocab_size_that_does_not_fit_is_refused(size, problem):
    with pytest.raises(ValueError, match=problem):
        tiny_drafter("dflash2", draft_vocab_size=size)


def test_a_drafter_cut_once_is_not_cut_again(target, drafter):
    with pytest.raises(ValueError, match="already has a draft vocabulary of 48 tokens"):
        cut(cut(drafter, target), target)


def test_head_rows_of_target_ids_and_back():
    drafter = tiny_drafter("dflash2", draft_vocab_size=48)
    drafter.draft_vocabulary.copy_(EVEN_TOKENS)
    ids = torch.tensor([[0, 2, 94, 1, 95, -100]])
    assert drafter.head_token_ids(ids).tolist() == [[0, 1, 47, -1, -1, -1]]
    assert torch.equal(drafter.target_token_ids(drafter.head_token_ids(EVEN_TOKENS)), EVEN_TOKENS)


def trainer_for(drafter, target, records, folder, **overrides) -> DrafterTrainer:
    settings = dict(steps=6, batch_size=4, blocks_per_sequence=4, warmup_steps=1, learning_rate=3e-3,
                    checkpoint_every=3, heldout_fraction=0.25) | overrides
    return DrafterTrainer(drafter, target, records, TrainingConfig(output_dir=str(folder), **settings))


@pytest.mark.parametrize("distill_weight", [0.0, 0.5])
def test_a_cut_to_every_token_trains_as_the_whole_head_does(target, drafter, tmp_path, distill_weight):
    records = random_records(12)
    whole = trainer_for(copy.deepcopy(drafter), target, records, tmp_path / "whole", distill_weight=distill_weight)
    every = cut(copy.deepcopy(drafter), target, torch.arange(TINY_VOCAB))
    cut_run = trainer_for(every, target, records, tmp_path / "cut", distill_weight=distill_weight)
    batch = whole.batch_for_step(0)
    with torch.no_grad():
        expected, got = asdict(whole.losses(batch)[1]), asdict(cut_run.losses(batch)[1])
    assert got.pop("accuracy_by_position") == expected.pop("accuracy_by_position")
    assert got == pytest.approx(expected, rel=1e-5)
    assert whole.heldout_acceptance() == cut_run.heldout_acceptance()


def test_training_a_cut_drafter_keeps_its_head_and_vocabulary_and_trains_the_rest(target, drafter, tmp_path):
    cut_drafter = cut(copy.deepcopy(drafter), target)
    head, layer = cut_drafter.draft_head.weight.clone(), cut_drafter.layers[0].mlp.down_proj.weight.clone()
    history = trainer_for(cut_drafter, target, random_records(12), tmp_path / "run").train()
    assert torch.equal(cut_drafter.draft_head.weight, head) and torch.equal(cut_drafter.draft_vocabulary, EVEN_TOKENS)
    assert not torch.equal(cut_drafter.layers[0].mlp.down_proj.weight, layer)
    assert all(torch.isfinite(torch.tensor(step["loss"])) for step in history)
    assert 1.0 <= history[-1]["heldout_acceptance"] <= drafter.block_size
    assert history[-1]["heldout_selector_acceptance"] >= 1.0


def test_the_whole_head_copy_drafts_as_the_drafter_it_was_cut_from(target, drafter, tmp_path):
    hidden = torch.randn(2, 5, drafter.config.hidden_size)
    head = target.get_output_embeddings()
    whole = with_the_target_head(cut(drafter, target))
    assert whole.draft_head is None and whole.config.draft_vocab_size is None
    torch.testing.assert_close(whole.compute_logits(hidden, head), drafter.compute_logits(hidden, head), rtol=0, atol=0)


def test_the_published_layout_takes_a_cut_drafter_with_the_whole_head(target, drafter, tmp_path):
    cut(drafter, target).save_pretrained(tmp_path / "cut")
    export_drafter(tmp_path / "cut", tmp_path / "out", layout="published", dtype=torch.float32, whole_head=True)
    assert "draft_vocab_size" not in json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"]


#: Layouts with no place for a draft vocabulary on a DFlash 2 drafter, and the words of their refusal.
NO_PLACE = {"published": "no field for draft_vocab_size=48", "speculators": "draft_vocab_size 48 on a DFlash 2 drafter"}


@pytest.mark.parametrize(("layout", "named"), NO_PLACE.items(), ids=NO_PLACE.keys())
def test_layouts_without_a_draft_vocabulary_refuse_a_cut_drafter_naming_whole_head(target, drafter, tmp_path, layout,
                                                                                   named):
    cut(drafter, target).save_pretrained(tmp_path / "cut")
    with pytest.raises(ExportError, match="--whole-head") as error:
        export_drafter(tmp_path / "cut", tmp_path / "out", layout=layout, dtype=torch.float32)
    assert named in str(error.value)


@pytest.fixture
def answers(tmp_path):
    """A data folder whose answers use the even tokens 2..40 and the end id 1."""
    folder = tmp_path / "answers"
    folder.mkdir()
    record = {"prompt": "p", "prompt_ids": [3, 5], "response_ids": list(range(2, 42, 2)) + [1]}
    (folder / "shard-0000000.jsonl").write_text(json.dumps(record) + "\n")
    return folder


@pytest.fixture
def target_folder(tmp_path):
    """The module's target, saved with end id 1."""
    target = tiny_target("qwen3", seed=1)
    target.generation_config.eos_token_id = 1
    target.save_pretrained(tmp_path / "target")
    return tmp_path / "target"


def test_export_cuts_the_drafter_to_the_answers_vocabulary(drafter, target_folder, answers, tmp_path, capsys):
    drafter.save_pretrained(tmp_path / "drafter")
    out = tmp_path / "cut"
    assert main(["export", str(tmp_path / "drafter"), str(out), "--target", str(target_folder), "--dtype", "float32",
                 "--draft-vocab-size", "24", "--vocab-data", str(answers)]) == 0
    assert "draft vocabulary of 24 tokens: 100.0% of the 21 answer tokens" in capsys.readouterr().out
    loaded = DFlashDraftModel.from_pretrained(out)
    assert loaded.draft_vocabulary.numel() == 24
    assert {1, *range(2, 42, 2)} <= set(loaded.draft_vocabulary.tolist())
    assert "it drafts from 24 of the target's tokens, through a head of its own" in (out / "README.md").read_text()


@pytest.mark.parametrize("layout", ["speculators", "published"])
def test_cutting_a_dflash2_drafter_for_a_whole_head_layout_gives_advice_that_works_when_followed(
        drafter, target_folder, answers, tmp_path, layout):
    drafter.save_pretrained(tmp_path / "drafter")
    common = ["export", str(tmp_path / "drafter"), "--target", str(target_folder), "--dtype", "float32"]
    cut = ["--draft-vocab-size", "24", "--vocab-data", str(answers)]
    message = refusal([*common[:2], str(tmp_path / "refused"), *common[2:], *cut, "--format", layout])
    assert message.endswith("drop --draft-vocab-size and --vocab-data to export it with the target's whole head, or "
                            "drop --format to cut it in this package's layout.")
    assert not (tmp_path / "refused").exists()
    assert main([*common[:2], str(tmp_path / "whole"), *common[2:], "--format", layout]) == 0  # the first advice
    assert main([*common[:2], str(tmp_path / "cut"), *common[2:], *cut]) == 0  # the second
    assert DFlashDraftModel.from_pretrained(tmp_path / "cut").draft_vocabulary.numel() == 24


@pytest.mark.parametrize(("arguments", "message"), [
    (["--draft-vocab-size", "8"], "--draft-vocab-size needs --vocab-data"),
    (["--vocab-data", "DATA"], "--vocab-data chooses a draft vocabulary; give its size too"),
    (["--draft-vocab-size", "0", "--vocab-data", "DATA", "--target", "TARGET"], "--draft-vocab-size must be >= 1"),
])
def test_export_refuses_a_draft_vocabulary_it_cannot_make(drafter, tmp_path, answers, target_folder, arguments,
                                                          message):
    drafter.save_pretrained(tmp_path / "drafter")
    given = [{"DATA": str(answers), "TARGET": str(target_folder)}.get(word, word) for word in arguments]
    assert message in refusal(["export", str(tmp_path / "drafter"), str(tmp_path / "out"), *given])
    assert not (tmp_path / "out").exists()
