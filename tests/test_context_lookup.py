"""Context lookup: the tokens that followed an earlier occurrence of the text's last few tokens, and the branch they
add to a token tree (greedy output stays identical; sampling exactness is in test_sampling_exactness.py)."""

import pytest
import torch

from conftest import tiny_drafter
from dflash2_hf.cost.cycle_cost import CycleCost
from dflash2_hf.drafting.lookup import LookupOdds, lookup_continuation, lookup_match
from dflash2_hf.drafting.tree import ROOT, DraftTree
from dflash2_hf.generation.verification import verify_greedy


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_the_guess():
    assert lookup_continuation([7, 1, 2, 3, 4, 9, 1, 2], length=3) == [3, 4, 9]


def test_the_longest_recurring_suffix_wins_over_a_later_shorter_match():
    # "5 2" recurs at the start (followed by 8); "2" alone recurs later (followed by 6)
    assert lookup_continuation([5, 2, 8, 0, 2, 6, 5, 2], length=1) == [8]


def test_among_occurrences_of_the_same_suffix_the_latest_wins():
    assert lookup_continuation([4, 1, 4, 2, 4, 3, 4], length=1) == [3]


def test_the_guess_stops_at_the_requested_length_and_at_the_end_of_the_text():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert lookup_continuation(tokens, length=2) == [3, 4]
    assert lookup_continuation(tokens, length=10) == [3, 4, 5, 1, 2]


def test_a_run_of_one_token_guesses_that_token_again():
    assert lookup_continuation([9, 9, 9], length=4) == [9]


def test_no_recurring_suffix_or_no_length_gives_no_guess():
    assert lookup_continuation([1, 2, 3, 4], length=4) == []
    assert lookup_continuation([1, 2, 1], length=0) == []
    assert lookup_continuation([1], length=4) == []


def test_a_minimum_ngram_size_ignores_shorter_matches():
    assert lookup_continuation([3, 8, 5, 3], length=2, min_ngram=2) == []
    assert lookup_continuation([3, 8, 5, 3], length=2) == [8, 5]



def test_up_to_eight_tokens_of_suffix_are_matched_by_default():
    # the last 8 tokens recur once (followed by 5); their last 3 recur later too (followed by 6)
    text = [1, 2, 3, 4, 10, 11, 12, 13, 5, 9, 11, 12, 13, 6, 0, 1, 2, 3, 4, 10, 11, 12, 13]
    assert lookup_continuation(text, length=1) == [5]
    assert lookup_continuation(text, length=1, max_ngram=3) == [6]


def brute_force_lookup(tokens, length, max_ngram, min_ngram):
    """The definition, spelled out: every suffix size from the longest down, every occurrence from the latest."""
    for size in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start : start + size] == tokens[len(tokens) - size :]:
                return tokens[start + size : start + size + length]
    return []


def test_the_one_pass_search_finds_what_trying_every_suffix_size_finds():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        size = int(torch.randint(1, 40, (1,), generator=generator))
        tokens = torch.randint(0, 3 + trial % 5, (size,), generator=generator).tolist()
        for max_ngram, min_ngram in ((8, 1), (3, 1), (4, 2)):
            assert lookup_continuation(tokens, 5, max_ngram, min_ngram) == brute_force_lookup(tokens, 5, max_ngram, min_ngram)

# --- the lookup branch of a token tree ---------------------------------------------------------------------------

PROMPT = torch.tensor([[5, 17, 33, 2, 71, 8]])


def two_paths() -> DraftTree:
    tree = DraftTree()
    for path in ([10, 11], [20]):
        tree.add_path(path)
    return tree


def test_the_match_comes_with_the_length_of_the_suffix_it_matched():
    assert lookup_match([7, 1, 2, 3, 4, 9, 1, 2], length=3) == ([3, 4, 9], 2)
    assert lookup_match([7, 1, 2, 3, 4, 9, 5, 2], length=3) == ([3, 4, 9], 1)
    assert lookup_match([1, 2, 3, 4], length=3) == ([], 0)


def test_longer_matches_start_with_better_odds_and_a_copied_token_is_worth_less_the_later_it_comes():
    odds = LookupOdds()
    chances = [odds.chance(matched) for matched in range(1, 7)]
    assert chances == sorted(chances) and chances[0] < 0.5 < chances[-1]
    assert odds.chance(0) == 0.0 and odds.gains(0, 3) == [0.0, 0.0, 0.0]
    chance = odds.chance(2)
    assert odds.gains(2, 3) == pytest.approx([chance, chance**2, chance**3])


def test_the_odds_follow_what_verification_accepted():
    odds = LookupOdds()
    start = odds.chance(3)
    for _ in range(20):
        odds.record(3, offered=8, accepted=0)  # every copy after a 3-token match rejected at once
    assert odds.chance(3) < 0.2 < start
    for _ in range(20):
        odds.record(1, offered=8, accepted=8)  # every copy after a 1-token match accepted whole
    assert odds.chance(1) > 0.9
    assert odds.chance(5) == odds.chance(9), "five tokens or more share one estimate"


def test_a_lookup_branch_reuses_drafted_nodes_and_stays_out_of_the_draws():
    tree = two_paths()
    tree.add_lookup_path([10, 12, 13])
    assert tree.tokens == [10, 11, 20, 12, 13]
    assert tree.parents == [ROOT, 0, ROOT, 0, 3]
    assert tree.lookup_children == {ROOT: 0, 0: 3, 3: 4}
    assert tree.draws == {ROOT: [0, 2], 0: [1]}, "the guess is not a draw from the drafter's proposals"


def test_the_greedy_walk_follows_the_lookup_branch_where_the_target_agrees_with_it():
    tree = two_paths()
    tree.add_lookup_path([30, 31])
    verdict = verify_greedy(tree, {ROOT: 30, 3: 31, 4: 7}.__getitem__)
    assert verdict.nodes == [3, 4] and verdict.emitted == [30, 31, 7]


def test_greedy_output_with_a_lookup_branch_equals_plain_generate(target, drafter):
    plain = target.generate(PROMPT, max_new_tokens=60, do_sample=False)
    ours = target.generate(PROMPT, max_new_tokens=60, do_sample=False, assistant_model=drafter, dflash_tree_nodes=4,
                           dflash_lookup_tokens=8)
    assert torch.equal(plain, ours)
    assert max(drafter.last_generation_stats.verified_lengths) == 12, "trees of 4 drafted + 8 looked-up tokens"


def test_a_lookup_branch_accepts_more_tokens_on_a_repetitive_output(target, drafter):
    # this random target repeats itself (runs of one token, recurring pairs), which the random drafter cannot guess
    mean_acceptance = {}
    for lookup in (0, 8):
        target.generate(PROMPT, max_new_tokens=60, do_sample=False, assistant_model=drafter, dflash_tree_nodes=4,
                        dflash_lookup_tokens=lookup)
        mean_acceptance[lookup] = drafter.last_generation_stats.mean_acceptance_length
    assert mean_acceptance[8] > mean_acceptance[0]


def test_max_matching_ngram_size_sets_the_longest_suffix_the_lookup_matches(target, drafter, monkeypatch):
    import dflash2_hf.generation.loop as decoding

    sizes = []

    def recording_lookup(tokens, length, max_ngram):
        sizes.append(max_ngram)
        return lookup_match(tokens, length, max_ngram)

    monkeypatch.setattr(decoding, "lookup_match", recording_lookup)
    plain = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    for setting, expected in ((None, 8), (2, 2)):
        sizes.clear()
        ours = target.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=drafter, dflash_tree_nodes=4,
                               dflash_lookup_tokens=8, max_matching_ngram_size=setting)
        assert torch.equal(ours, plain)
        assert sizes and set(sizes) == {expected}


def test_lookup_tokens_without_a_tree_or_below_zero_are_refused(target, drafter):
    with pytest.raises(ValueError, match="set tree_nodes > 0"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=drafter, dflash_tree_nodes=0, dflash_lookup_tokens=8)
    with pytest.raises(ValueError, match="lookup_tokens must be >= 0"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=drafter, dflash_tree_nodes=4, dflash_lookup_tokens=-1)


def test_the_drafter_config_can_add_a_lookup_branch_to_its_trees(target):
    drafter = tiny_drafter("dflash2", seed=4, default_tree_nodes=4, default_lookup_tokens=8)
    plain = target.generate(PROMPT, max_new_tokens=60, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=60, do_sample=False, assistant_model=drafter), plain)
    assert max(drafter.last_generation_stats.verified_lengths) == 12
    target.generate(PROMPT, max_new_tokens=60, do_sample=False, assistant_model=drafter, dflash_tree_nodes=0)
    assert max(drafter.last_generation_stats.verified_lengths) == 7, "one path: the config's lookup does not apply"


# Drafting costs ten forwards and rows cost nothing: steps without drafting copy from the context where it matches.
COPYING_PAYS = CycleCost(fixed_seconds=10.0, verify_seconds=(1.0,) * 16)
# Drafting costs as much, and every row costs a whole forward: copying does not pay either.
ROWS_COST_FORWARDS = CycleCost(fixed_seconds=10.0, verify_seconds=tuple(1.0 + m for m in range(16)))


def test_steps_without_drafting_verify_copied_tokens_where_rows_are_cheap(target, drafter):
    plain = target.generate(PROMPT, max_new_tokens=60, do_sample=False)
    ours = target.generate(PROMPT, max_new_tokens=60, do_sample=False, assistant_model=drafter, dflash_tree_nodes=4,
                           dflash_lookup_tokens=8, dflash_plain_fallback=COPYING_PAYS,
                           dflash_adaptive_block=COPYING_PAYS)
    stats = drafter.last_generation_stats
    assert torch.equal(ours, plain)
    assert stats.lookup_cycles > 0
    assert stats.new_tokens == ours.shape[1] - PROMPT.shape[1]


def test_steps_without_drafting_stay_plain_where_rows_cost_a_forward(target, drafter):
    ours = target.generate(PROMPT, max_new_tokens=60, do_sample=False, assistant_model=drafter, dflash_tree_nodes=4,
                           dflash_lookup_tokens=8, dflash_plain_fallback=ROWS_COST_FORWARDS,
                           dflash_adaptive_block=ROWS_COST_FORWARDS)
    stats = drafter.last_generation_stats
    assert torch.equal(ours, target.generate(PROMPT, max_new_tokens=60, do_sample=False))
    assert stats.lookup_cycles == 0 and stats.plain_steps > stats.cycles


@pytest.mark.parametrize("matched,copies", [(1, False), (2, True)])
def test_a_step_without_drafting_copies_only_after_a_match_of_two_tokens_or_more(target, drafter, monkeypatch,
                                                                                 matched, copies):
    import dflash2_hf.generation.loop as decoding

    monkeypatch.setattr(decoding, "lookup_match", lambda tokens, length, max_ngram: (tokens[len(tokens) - length:], matched))
    ours = target.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=drafter, dflash_tree_nodes=4,
                           dflash_lookup_tokens=4, dflash_plain_fallback=COPYING_PAYS,
                           dflash_adaptive_block=COPYING_PAYS)
    assert torch.equal(ours, target.generate(PROMPT, max_new_tokens=30, do_sample=False))
    assert (drafter.last_generation_stats.lookup_cycles > 0) == copies
