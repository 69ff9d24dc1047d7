"""The statistics of the exactness checks (dflash2_hf.measuring.exactness), which the sampling tests and
scripts/device_check.py share."""

import pytest
import torch
from scipy.stats import chisquare

from conftest import tiny_target
from dflash2_hf.measuring.exactness import chi_square_pvalue, continuation_distribution, goodness_of_fit

EXACT = {(0,): 0.5, (1,): 0.3, (2,): 0.15, (3,): 0.05}


@pytest.mark.parametrize("observed, expected", [([48, 35, 17], [50, 30, 20]), ([10, 90], [50, 50]),
                                                ([5, 5, 5, 5, 80], [20, 20, 20, 20, 20])])
def test_the_p_value_is_scipys_chi_square_p_value(observed, expected):
    assert chi_square_pvalue(observed, expected) == pytest.approx(chisquare(observed, expected).pvalue, rel=1e-9)


def draws_from(distribution: dict, count: int, seed: int) -> list:
    keys = list(distribution)
    picks = torch.multinomial(torch.tensor([distribution[k] for k in keys]), count, replacement=True,
                              generator=torch.Generator().manual_seed(seed))
    return [keys[i] for i in picks.tolist()]


def test_draws_from_the_exact_distribution_fit_it():
    assert goodness_of_fit(draws_from(EXACT, 1000, seed=0), EXACT) > 1e-3


def test_draws_from_another_distribution_do_not_fit():
    biased = {(0,): 0.45, (1,): 0.35, (2,): 0.15, (3,): 0.05}
    assert goodness_of_fit(draws_from(biased, 4000, seed=0), EXACT) < 1e-6


def test_rare_continuations_are_pooled_into_one_cell():
    """(3,) is expected 2.5 times in 50 draws: pooled, the test still runs; never drawn, it is no evidence."""
    draws = [(0,)] * 25 + [(1,)] * 15 + [(2,)] * 10
    assert goodness_of_fit(draws, EXACT) > 0.05


def test_the_exact_distribution_is_the_one_generate_samples_from():
    target = tiny_target("qwen3", seed=2, vocab_size=5)
    prompt = torch.tensor([[1, 3, 2, 0]])
    exact = continuation_distribution(target, prompt, 2, temperature=0.7, top_k=3)
    assert len(exact) == 25 and sum(exact.values()) == pytest.approx(1.0, abs=1e-9)
    assert sum(p > 0 for p in exact.values()) <= 9, "top-k 3 leaves at most 3 tokens at each of the 2 positions"
    logits = target(prompt).logits[0, -1].double() / 0.7
    first = torch.softmax(logits.masked_fill(logits < logits.topk(3).values[-1], float("-inf")), dim=-1)
    assert sum(exact[(0, t)] for t in range(5)) == pytest.approx(float(first[0]), abs=1e-6)
