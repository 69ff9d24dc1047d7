"""Sampling with a drafter has exactly the target's output distribution.

Setup: a tiny random target over a 5-token vocabulary, a tiny random DFlash 2 drafter (its selector distribution q is
far from the target's p), blocks of 3 (2 drafted tokens per cycle) and 4 new tokens, so outputs pass through
acceptance, rejection at either drafted position, residual resampling and bonus tokens.

For each sampling setting we compute the exact distribution of the 625 possible continuations from plain `generate`'s
own processed scores, draw N continuations with the drafter, and run a chi-square goodness-of-fit test (cells with
expected count < 5 pooled). With N = 1000 the negative control (keep every drafted token) is rejected at
p < 1e-200 in every setting (we require < 1e-6), while the real decoder must pass at p > 1e-3; seeds are fixed, so
the outcome is reproducible.

Cost-aware block length (verifying only a prefix of each drafted path), token trees (several sampled paths
verified at once by recursive rejection sampling) and their context-lookup branches keep the distribution exact;
their negative controls (a cut that looks at the sampled tokens themselves; multi-draft rejection without residual
updates; a rejected guess that leaves no residual) are rejected. So do generations that mix drafting cycles with the
plain steps of the fallback to plain decoding; their control (plain steps that take the likeliest token) is rejected;
and the fallback's lookup cycles (copied tokens verified alone, without a draft), whose control is the lookup
branches' one.
"""

import functools

import pytest
import torch

import dflash2_hf
from conftest import steep_cost, tiny_drafter, tiny_target
from dflash2_hf.cost.cycle_cost import CycleCost
from dflash2_hf.cost.guard import DraftingGuard
from dflash2_hf.drafting.lattice import path_confidences
from dflash2_hf.generation import loop
from dflash2_hf.generation.verification import rejection_distribution
from dflash2_hf.measuring.exactness import continuation_distribution, goodness_of_fit, keep_every_draft, walk_down

VOCAB, NEW_TOKENS, SAMPLES = 5, 4, 1000
PROMPT = torch.tensor([[1, 3, 2, 0]])
SETTINGS = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top-k 3": dict(temperature=0.7, top_k=3),
    "temperature 1.3, top-p 0.8, repetition penalty 1.5": dict(temperature=1.3, top_p=0.8, repetition_penalty=1.5),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen3", seed=2, vocab_size=VOCAB)
    drafter = tiny_drafter("dflash2", seed=3, vocab_size=VOCAB, mask_token_id=VOCAB - 1, block_size=3, selector_top_k=3)
    return target, drafter


def exact_distribution(target, settings) -> dict[tuple[int, ...], float]:
    """P(continuation) of every 4-token continuation of PROMPT under plain sampling with ``settings``."""
    return continuation_distribution(target, PROMPT, NEW_TOKENS, **settings)


def _without_top_k(settings):
    return {k: v for k, v in settings.items() if k != "top_k"}


def sample_with_drafter(target, drafter, settings, seed=0, **dflash_kwargs) -> tuple[list[tuple[int, ...]], list[int]]:
    """N continuations sampled with the drafter (``seam=True``: through ``custom_generate``), and the acceptance
    length of every cycle (or, with ``statistic="verified_lengths"``, the drafted tokens each cycle verified;
    ``"plain_steps"``, each generation's count of plain steps)."""
    statistic = dflash_kwargs.pop("statistic", "acceptance_lengths")
    route = ({"custom_generate": dflash2_hf.custom_generate, "drafter": drafter} if dflash_kwargs.pop("seam", False)
             else {"assistant_model": drafter})
    torch.manual_seed(seed)
    draws, per_cycle = [], []
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, return_dict_in_generate=True,
                              top_k=settings.get("top_k", 0), **_without_top_k(settings), **route, **dflash_kwargs)
        draws.append(tuple(out.sequences[0, PROMPT.shape[1]:].tolist()))
        recorded = getattr(out.dflash_stats, statistic)
        per_cycle += recorded if isinstance(recorded, list) else [recorded]
    return draws, per_cycle


@pytest.mark.parametrize("setting", SETTINGS)
def test_sampled_continuations_follow_the_target_distribution(models, setting, monkeypatch):
    target, drafter = models
    settings = SETTINGS[setting]
    exact = exact_distribution(target, settings)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-9)

    draws, acceptance = sample_with_drafter(target, drafter, settings)
    assert {1, 2, 3} <= set(acceptance), "rejections at both drafted positions and fully accepted blocks all occur"
    assert goodness_of_fit(draws, exact) > 1e-3

    monkeypatch.setattr(loop, "verify_sampled", keep_every_draft)
    control, _ = sample_with_drafter(target, drafter, settings)
    assert goodness_of_fit(control, exact) < 1e-6, "the test must be able to detect a biased decoder"


def test_the_public_seam_samples_the_target_distribution(models, monkeypatch):
    target, drafter = models
    settings = SETTINGS["temperature 1.3, top-p 0.8, repetition penalty 1.5"]
    exact = exact_distribution(target, settings)
    draws, acceptance = sample_with_drafter(target, drafter, settings, seam=True)
    assert {1, 2, 3} <= set(acceptance)
    assert goodness_of_fit(draws, exact) > 1e-3

    monkeypatch.setattr(loop, "verify_sampled", keep_every_draft)
    control, _ = sample_with_drafter(target, drafter, settings, seam=True)
    assert goodness_of_fit(control, exact) < 1e-6, "the test must be able to detect a biased decoder"


# Verifying costs 1.0 / 1.4 / 1.8 for 1 / 2 / 3 tokens: with this drafter's confidences, cycles verify 0, 1 and 2
# drafted tokens, so the cut itself varies with the drafted path.
STEEP_COST = CycleCost(fixed_seconds=0.0, verify_seconds=(1.0, 1.4, 1.8))


def peeking_confidences(lattice, path, sampled, temperature=1.0):
    """Negative control: cut a sampled path on the probability of its own sampled tokens (not a stopping rule)."""
    return path_confidences(lattice, path, False, temperature)


def test_adaptive_blocks_keep_sampling_exact(models, monkeypatch):
    target, drafter = models
    settings = SETTINGS["temperature 1"]
    exact = exact_distribution(target, settings)

    draws, verified = sample_with_drafter(target, drafter, settings, dflash_adaptive_block=STEEP_COST,
                                          statistic="verified_lengths")
    assert {0, 1, 2} <= set(verified), "the cut varies from cycle to cycle"
    assert goodness_of_fit(draws, exact) > 1e-3

    monkeypatch.setattr(loop, "path_confidences", peeking_confidences)
    control, _ = sample_with_drafter(target, drafter, settings, dflash_adaptive_block=STEEP_COST)
    assert goodness_of_fit(control, exact) < 1e-6, "a cut that looks at the sampled tokens biases the output"


def keeps_draw(tree, child, p, q) -> bool:
    """The single-draft test of a drafted child: kept with probability ``min(1, p(x) / q(x))``."""
    token = tree.tokens[child]
    return float(torch.rand(())) < min(1.0, float(p[token]) / q.prob_of(token))


def accept_against_the_unchanged_target(tree, target_probs, generator=None):
    """Negative control for trees: every draw at a node is tested against the target's ``p`` itself, with no residual
    update after a rejection (a natural-looking but biased multi-draft scheme)."""

    def choose(node, p):
        q = tree.proposals.get(node)
        return next((child for child in tree.draws.get(node, []) if keeps_draw(tree, child, p, q)), None), p

    return walk_down(tree, target_probs, choose)


STEEP_TREE_COST = steep_cost(10)


def test_cost_sized_token_trees_keep_sampling_exact(models, monkeypatch):
    target, drafter = models
    settings = SETTINGS["temperature 1"]
    exact = exact_distribution(target, settings)

    draws, verified = sample_with_drafter(target, drafter, settings, dflash_tree_nodes=9,
                                          dflash_adaptive_block=STEEP_TREE_COST, statistic="verified_lengths")
    assert len(set(verified)) >= 3 and max(verified) < 9, "the cost sizes each tree, differently per cycle"
    assert goodness_of_fit(draws, exact) > 1e-3

    monkeypatch.setattr(loop, "verify_sampled", accept_against_the_unchanged_target)
    control, _ = sample_with_drafter(target, drafter, settings, dflash_tree_nodes=9,
                                     dflash_adaptive_block=STEEP_TREE_COST)
    assert goodness_of_fit(control, exact) < 1e-6, "the test still detects a biased multi-draft scheme"


def ignore_the_rejected_guess(tree, target_probs, generator=None):
    """Negative control for lookup branches: a rejected guess leaves ``p`` as it was (no residual without the
    guessed token) before the drafted children are tested, so the guessed token gets a second chance."""

    def choose(node, p):
        q, guess = tree.proposals.get(node), tree.lookup_children.get(node)
        if guess is not None and float(torch.rand(())) < float(p[tree.tokens[guess]]):
            return guess, p
        for child in tree.draws.get(node, []):
            if keeps_draw(tree, child, p, q):
                return child, p
            p = rejection_distribution(p, q)
        return None, p

    return walk_down(tree, target_probs, choose)


# kwargs, drafted tokens a tree must exceed at least once (so the case is exercised), negative control, its failure
TREE_CASES = {
    # 9 nodes over blocks of 2 drafted tokens: trees of 3 independently sampled paths of 2
    "3 sampled paths": (dict(dflash_tree_nodes=9), 2, accept_against_the_unchanged_target,
                        "a multi-draft scheme without residual updates is biased"),
    # trees of 2 sampled paths of 2, plus up to 2 tokens copied from the context (over 5 tokens, nearly always)
    "2 sampled paths and a lookup branch": (dict(dflash_tree_nodes=4, dflash_lookup_tokens=2), 4,
                                            ignore_the_rejected_guess,
                                            "a rejected guess must leave the residual, or the output is biased"),
}


@pytest.mark.parametrize("case", TREE_CASES)
@pytest.mark.parametrize("setting", ["temperature 1", "temperature 1.3, top-p 0.8, repetition penalty 1.5"])
def test_token_trees_keep_sampling_exact(models, setting, case, monkeypatch):
    target, drafter = models
    settings = SETTINGS[setting]
    exact = exact_distribution(target, settings)
    options, exceeded, biased_verifier, why = TREE_CASES[case]

    draws, verified = sample_with_drafter(target, drafter, settings, **options, statistic="verified_lengths")
    assert max(verified) > exceeded, "trees wider than one path (or than the drafted paths) were verified"
    assert goodness_of_fit(draws, exact) > 1e-3

    monkeypatch.setattr(loop, "verify_sampled", biased_verifier)
    control, _ = sample_with_drafter(target, drafter, settings, **options)
    assert goodness_of_fit(control, exact) < 1e-6, why


def test_same_seed_gives_the_same_output(models):
    target, drafter = models
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(target.generate(PROMPT, max_new_tokens=12, do_sample=True, assistant_model=drafter))
    assert torch.equal(*runs)


# Drafting always loses under this cost (a cycle costs 2-4 plain steps for at most 3 tokens), and a guard with the
# shortest pauses alternates one drafting cycle with plain steps inside each 4-token generation.
LOSING_COST = CycleCost(fixed_seconds=1.0, verify_seconds=(1.0, 2.0, 3.0))
ALTERNATING_GUARD = functools.partial(DraftingGuard, min_cycles=1, first_pause=1, longest_pause=1)


def greedy_plain_steps(monkeypatch) -> None:
    """Negative control: the fallback's plain steps take the target's likeliest token instead of sampling it."""
    plain_step = loop.DFlashDecoder._plain_step

    def greedy(self, sequence, context):
        self.do_sample = False
        try:
            return plain_step(self, sequence, context)
        finally:
            self.do_sample = True

    monkeypatch.setattr(loop.DFlashDecoder, "_plain_step", greedy)


def test_plain_steps_mixed_with_drafting_keep_sampling_exact(models, monkeypatch):
    """With token trees (the plain step is the same code for one path)."""
    target, drafter = models
    settings = SETTINGS["temperature 1.3, top-p 0.8, repetition penalty 1.5"]
    exact = exact_distribution(target, settings)
    monkeypatch.setattr(loop, "DraftingGuard", ALTERNATING_GUARD)
    options = dict(dflash_tree_nodes=4, dflash_plain_fallback=LOSING_COST)

    draws, plain_steps = sample_with_drafter(target, drafter, settings, **options, statistic="plain_steps")
    assert 0 < sum(plain_steps) < SAMPLES * NEW_TOKENS, "both plain steps and drafting cycles emitted tokens"
    assert goodness_of_fit(draws, exact) > 1e-3

    greedy_plain_steps(monkeypatch)
    control, _ = sample_with_drafter(target, drafter, settings, **options)
    assert goodness_of_fit(control, exact) < 1e-6, "plain steps that do not sample bias the output"


# Rows cost nothing, so a step without drafting verifies the copied tokens alone (a lookup cycle) wherever the
# context has a match; the guard never drafts, so these steps make each whole generation.
COPYING_COST = CycleCost(fixed_seconds=10.0, verify_seconds=(1.0,) * 8)


class NeverDrafting(DraftingGuard):
    def drafts_next(self) -> bool:
        return False


def test_lookup_cycles_keep_sampling_exact(models, monkeypatch):
    target, drafter = models
    settings = SETTINGS["temperature 1.3, top-p 0.8, repetition penalty 1.5"]
    exact = exact_distribution(target, settings)
    monkeypatch.setattr(loop, "DraftingGuard", NeverDrafting)
    options = dict(dflash_tree_nodes=4, dflash_lookup_tokens=2, dflash_plain_fallback=COPYING_COST,
                   dflash_adaptive_block=COPYING_COST)

    draws, lookup_cycles = sample_with_drafter(target, drafter, settings, **options, statistic="lookup_cycles")
    assert sum(lookup_cycles) > SAMPLES / 4, "steps without drafting verified copied tokens"
    assert goodness_of_fit(draws, exact) > 1e-3

    monkeypatch.setattr(loop, "verify_sampled", ignore_the_rejected_guess)
    control, _ = sample_with_drafter(target, drafter, settings, **options)
    assert goodness_of_fit(control, exact) < 1e-6, "a rejected guess must leave the residual, or the output is biased"
