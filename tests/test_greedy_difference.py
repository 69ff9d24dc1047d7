"""Every greedy difference from plain decoding is judged: identical, parted at a near-tie of plain decoding's logits
(gap within the rounding bound measured here), or parted where the target's choice was clear (a bug)."""

import pytest
import torch
from transformers import BatchEncoding

from conftest import tiny_drafter, tiny_target
from dflash2_hf.generation import exact_widths
from dflash2_hf.measuring.greedy_difference import (
    ROUNDING_MARGIN,
    GreedyDifference,
    compare_greedy,
    first_difference,
    near_tie_bound,
    plain_scores_at,
)

PROMPT = torch.tensor([[5, 17, 3, 42, 8, 11]])
NEW_TOKENS = 16

FIRST_DIFFERENCES = {
    "the same": ([1, 2, 3], [1, 2, 3], None),
    "the first token": ([9, 2, 3], [1, 2, 3], 0),
    "a later token": ([1, 2, 9, 4], [1, 2, 3, 4], 2),
    "ours ended first": ([1, 2], [1, 2, 3], 2),
    "plain ended first": ([1, 2, 3], [1, 2], 2),
    "both empty": ([], [], None),
}


@pytest.mark.parametrize(("ours", "plain", "position"), FIRST_DIFFERENCES.values(), ids=FIRST_DIFFERENCES.keys())
def test_the_first_difference_is_the_first_new_token_that_differs_or_is_missing(ours, plain, position):
    assert first_difference(ours, plain) == position


INPUT_FORMS = {
    "input_ids": lambda ids: ids,
    "a dict": lambda ids: {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
    "a tokenizer's BatchEncoding": lambda ids: BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
}


@pytest.mark.parametrize("form", INPUT_FORMS.values(), ids=INPUT_FORMS.keys())
def test_plain_scores_are_read_from_every_input_form_generate_takes(form):
    target = tiny_target(seed=1)
    assert torch.equal(plain_scores_at(target, form(PROMPT), 2), plain_scores_at(target, PROMPT, 2))


def plain_tokens(target) -> list[int]:
    return target.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1]:].tolist()


def test_drafted_output_equal_to_plain_decodings_is_identical_without_decoding_again():
    target, drafter = tiny_target(seed=1), tiny_drafter(seed=4)
    ours = target.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
    difference = compare_greedy(target, PROMPT, ours[0, PROMPT.shape[1]:].tolist(), plain_tokens(target))
    assert difference == GreedyDifference("identical") and difference.explained
    assert difference.describe() == "identical"


def test_negative_control_taking_the_runner_up_where_the_choice_was_clear_is_a_bug():
    target = tiny_target(seed=1)
    plain = plain_tokens(target)
    runner_up = int(plain_scores_at(target, PROMPT, 3).topk(2).indices[1])
    ours = plain[:3] + [runner_up] + plain[4:]
    difference = compare_greedy(target, PROMPT, ours, plain)
    assert (difference.outcome, difference.position) == ("clear", 3) and not difference.explained
    assert difference.gap == pytest.approx(difference.top2_gap) and difference.gap > difference.bound
    assert difference.describe().startswith("DIFFERS at new token 3, where the target's choice was clear")


def twin_token_target() -> tuple[torch.nn.Module, int, int]:
    """A tiny target whose LM head gives a second token exactly the logits of plain decoding's first choice: the
    two tie at every position, as the closest near-tie can."""
    target = tiny_target(seed=1)
    chosen = plain_tokens(target)[0]
    twin = (chosen + 1) % target.config.vocab_size
    with torch.no_grad():
        target.lm_head.weight[twin] = target.lm_head.weight[chosen]
    return target, chosen, twin


def test_taking_a_token_whose_logit_ties_plain_decodings_choice_is_a_near_tie():
    target, chosen, twin = twin_token_target()
    plain = plain_tokens(target)
    assert plain[0] == min(chosen, twin), "plain decoding breaks the tie towards the lower id"
    ours = [max(chosen, twin)] + plain[1:]
    difference = compare_greedy(target, PROMPT, ours, plain)
    assert (difference.outcome, difference.position, difference.gap) == ("near-tie", 0, 0.0) and difference.explained
    assert difference.describe().startswith("differs from new token 0 on, at a near-tie of plain decoding's logits")


def test_an_output_that_ends_where_the_other_goes_on_is_a_bug_with_no_gap():
    target = tiny_target(seed=1)
    plain = plain_tokens(target)
    difference = compare_greedy(target, PROMPT, plain[:5], plain)
    assert (difference.outcome, difference.position, difference.gap) == ("clear", 5, None)
    assert "where one output had ended and the other went on" in difference.describe()


def test_the_bound_is_twice_the_margin_times_the_rounding_measured_here(monkeypatch):
    target = tiny_target(seed=1)
    measured = exact_widths.logit_rounding(target, 5)
    monkeypatch.setattr("dflash2_hf.measuring.greedy_difference.PackedLinears",
                        lambda model: (_ for _ in ()).throw(ValueError("no packing here")))
    assert near_tie_bound(target, 5) == 2 * ROUNDING_MARGIN * measured


class RowsRoundedApart(torch.nn.Module):
    """A target whose many-row forwards add ``offset`` to every logit, as kernels rounding a block's rows unlike
    single rows would (by far more than real ones)."""

    def __init__(self, target: torch.nn.Module, offset: float):
        super().__init__()
        self.inner, self.offset, self.config = target, offset, target.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids, **kwargs):
        output = self.inner(input_ids=input_ids, **kwargs)
        if input_ids.shape[1] > 1:
            output.logits = output.logits + self.offset
        return output


def test_negative_control_a_target_rounding_blocks_apart_measures_that_rounding():
    measured = exact_widths.logit_rounding(RowsRoundedApart(tiny_target(seed=1), 1e-2), 4)
    assert measured == pytest.approx(1e-2, rel=1e-3)


def test_the_rounding_is_measured_once_per_target_and_setting(monkeypatch):
    target = tiny_target(seed=2)
    first = exact_widths.logit_rounding(target, 4)
    monkeypatch.setattr(exact_widths, "_blocks_against_steps", lambda *args: pytest.fail("measured again"))
    assert exact_widths.logit_rounding(target, 4) == first
