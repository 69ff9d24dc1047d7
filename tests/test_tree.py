"""Tree verification: building the token tree, its mask and positions, cache compaction, and exact greedy output."""

import pytest
import torch
from transformers import DynamicCache

from conftest import steep_cost, tiny_drafter, tiny_target
from dflash2_hf.cost.cycle_cost import CycleCost
from dflash2_hf.drafting.lattice import Lattice
from dflash2_hf.drafting.tree import ROOT, DraftTree, keep_branch, likeliest_tree, sampled_tree, worthwhile_tree_size
from dflash2_hf.generation.verification import verify_greedy

PROMPT = torch.tensor([[5, 17, 33, 2, 71, 8]])


def three_paths() -> DraftTree:
    tree = DraftTree()
    for path in ([10, 11, 12], [10, 13], [20, 21]):
        tree.add_path(path)
    return tree


def test_paths_sharing_a_prefix_share_its_nodes():
    tree = three_paths()
    assert tree.tokens == [10, 11, 12, 13, 20, 21]
    assert tree.parents == [ROOT, 0, 1, 0, ROOT, 4]
    assert tree.draws[ROOT] == [0, 0, 4] and tree.draws[0] == [1, 3]
    assert tree.depths() == [1, 2, 3, 2, 1, 2]
    assert tree.branch(2) == [0, 1, 2] and tree.branch(ROOT) == []


def test_each_node_sees_the_context_the_anchor_and_its_own_ancestors_only():
    tree = three_paths()
    allowed = tree.attention_mask(past_length=2, dtype=torch.float32)[0, 0] == 0
    # rows: anchor, nodes 0..5; columns: 2 cached tokens, anchor, nodes 0..5
    expected = torch.tensor([
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    assert tree.position_ids(anchor_position=7).tolist() == [[7, 8, 9, 10, 9, 8, 9]]


def test_greedy_walk_follows_the_targets_choices_down_the_tree():
    tree = three_paths()
    choices = {ROOT: 10, 0: 13, 3: 99}
    verdict = verify_greedy(tree, choices.__getitem__)
    assert verdict.nodes == [0, 3] and verdict.emitted == [10, 13, 99]


def test_the_likeliest_tree_grows_best_first_by_branch_probability():
    scores = torch.full((1, 2, 2, 2), -10.0)
    scores[0, 0, :, 0], scores[0, 0, :, 1] = 0.0, -0.1  # position 0: q = (0.52, 0.48)
    scores[0, 1, 0] = torch.tensor([-3.0, -4.0])  # after candidate 0: q = (0.73, 0.27)
    scores[0, 1, 1] = torch.tensor([2.0, -3.0])  # after candidate 1: q = (0.99, 0.01)
    lattice = Lattice(torch.tensor([1]), torch.tensor([[[5, 6], [7, 8]]]), torch.zeros(1, 2, 2), scores)
    # branch probabilities: 5: .52, 6: .48, 6-7: .48 * .99 = .475, 5-7: .52 * .73 = .38, 5-8: .14, 6-8: .005
    assert likeliest_tree(lattice, 4).tokens == [5, 6, 7, 7]
    assert likeliest_tree(lattice, 4).parents == [ROOT, ROOT, 1, 0]
    assert likeliest_tree(lattice, 4).branch_probabilities == pytest.approx([0.525, 0.475, 0.4718, 0.3836], abs=1e-3)
    assert len(likeliest_tree(lattice, 10)) == 6, "no more nodes than the lattice holds"


def test_keep_branch_leaves_the_cache_a_plain_forward_over_the_branch_would_build(target):
    tree = three_paths()
    prompt = PROMPT[:, :5]
    anchor = int(PROMPT[0, 5])
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt, cache=cache, use_cache=True)
    past = prompt.shape[1]
    target(input_ids=torch.tensor([[anchor] + tree.tokens]), cache=cache, use_cache=True,
           attention_mask=tree.attention_mask(past, torch.float32), position_ids=tree.position_ids(past))
    keep_branch(cache, past, [0, 3])

    reference = DynamicCache(config=target.config)
    target(input_ids=torch.cat([prompt, torch.tensor([[anchor, 10, 13]])], dim=1), cache=reference, use_cache=True)
    for kept, plain in zip(cache.layers, reference.layers):
        assert torch.allclose(kept.keys, plain.keys, atol=1e-5) and torch.allclose(kept.values, plain.values, atol=1e-5)


@pytest.mark.parametrize("nodes", [1, 4, 12])
@pytest.mark.parametrize("path", ["argmax", "greedy"])
def test_greedy_output_with_a_token_tree_equals_plain_generate(target, drafter, nodes, path):
    plain = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    ours = target.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=drafter, dflash_path=path,
                           dflash_tree_nodes=nodes)
    assert torch.equal(plain, ours)
    stats = drafter.last_generation_stats
    assert sum(stats.acceptance_lengths) + 1 == ours.shape[1] - PROMPT.shape[1]
    assert max(stats.verified_lengths) == nodes, "trees of the requested size were verified (blocks hold 7 drafts)"


def test_tree_output_with_logits_processors_and_scores_matches_plain_generate(target, drafter):
    settings = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.3, return_dict_in_generate=True,
                    output_scores=True)
    plain = target.generate(PROMPT, **settings)
    ours = target.generate(PROMPT, **settings, assistant_model=drafter, dflash_tree_nodes=10)
    assert torch.equal(plain.sequences, ours.sequences)
    assert len(ours.scores) == len(plain.scores)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(plain.scores, ours.scores))


def test_tree_nodes_must_not_be_negative(target, drafter):
    with pytest.raises(ValueError, match="tree_nodes must be >= 0"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=drafter, dflash_tree_nodes=-1)


def test_a_cost_sized_tree_holds_only_the_nodes_that_pay_for_themselves():
    lattice = Lattice(torch.tensor([1]), torch.tensor([[[5, 6], [7, 8]]]), torch.zeros(1, 2, 2), None)
    # no pair scores: q = (1/2, 1/2) at both positions, so branch probabilities .5, .5, .25, .25, .25, .25
    flat = CycleCost(0.0, (1.0,) * 7)
    assert worthwhile_tree_size(lattice, 6, flat) == (6, 0)
    steep = steep_cost(7)  # rates 1, 1.15, 1.25, 1.19: two nodes
    assert worthwhile_tree_size(lattice, 6, steep) == (2, 0)


def test_copied_tokens_and_tree_nodes_are_sized_together_best_first():
    lattice = Lattice(torch.tensor([1]), torch.tensor([[[5, 6], [7, 8]]]), torch.zeros(1, 2, 2), None)
    steep = steep_cost(10)  # pays for the two best tokens when they are worth .5 each
    assert worthwhile_tree_size(lattice, 6, steep, lookup_gains=[0.9, 0.81, 0.73]) == (0, 3)
    assert worthwhile_tree_size(lattice, 6, steep, lookup_gains=[0.1, 0.01]) == (2, 0)
    assert worthwhile_tree_size(lattice, 6, steep, lookup_gains=[0.6, 0.36]) == (2, 1)


def test_a_tree_sized_to_no_nodes_is_empty_in_both_modes():
    lattice = Lattice(torch.tensor([1]), torch.tensor([[[5, 6], [7, 8]]]), torch.zeros(1, 2, 2), None)
    assert len(likeliest_tree(lattice, 0)) == 0 and len(sampled_tree(lattice, 0, temperature=1.0)) == 0
    assert len(sampled_tree(lattice, 1, temperature=1.0)) == 1


STEEP_TREE_COST = steep_cost(13)


@pytest.mark.parametrize("path", ["argmax", "greedy"])
def test_greedy_output_with_a_cost_sized_tree_equals_plain_generate(target, drafter, path):
    plain = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    ours = target.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=drafter, dflash_path=path,
                           dflash_tree_nodes=12, dflash_adaptive_block=STEEP_TREE_COST)
    assert torch.equal(plain, ours)
    verified = drafter.last_generation_stats.verified_lengths
    assert max(verified) < 12 and len(set(verified)) > 1, "the cost sized the trees, differently per cycle"


def test_a_cost_model_narrower_than_the_tree_is_refused(target, drafter):
    with pytest.raises(ValueError, match="cycle cost covers verifying 8 tokens"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=drafter, dflash_tree_nodes=12,
                        dflash_adaptive_block=CycleCost(0.0, (1.0,) * 8))


def test_a_target_with_sliding_window_layers_is_refused_for_trees(drafter):
    sliding = tiny_target("qwen3", seed=1, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                          use_sliding_window=True)
    with pytest.raises(ValueError, match="sliding-window layers"):
        sliding.generate(PROMPT, max_new_tokens=4, assistant_model=drafter, dflash_tree_nodes=2)


def test_the_drafter_config_can_make_a_tree_the_default_and_a_call_can_override_it(target):
    drafter = tiny_drafter("dflash2", seed=4, default_tree_nodes=12)
    plain = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=drafter), plain)
    assert max(drafter.last_generation_stats.verified_lengths) == 12
    flat = CycleCost(0.0, (1.0,) * 8)
    target.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=drafter, dflash_adaptive_block=flat)
    assert max(drafter.last_generation_stats.verified_lengths) == 7, "an adaptive block drops the config's tree"
    target.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=drafter, dflash_tree_nodes=0)
    assert max(drafter.last_generation_stats.verified_lengths) == 7
