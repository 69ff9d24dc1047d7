"""Cost-aware block length: the cut rule, the cost model, and exactness of decoding with cut blocks."""

import json

import pytest
import torch

from dflash2_hf.cost.cycle_cost import CycleCost, cycle_cost_for, interpolate, measure_cycle_cost
from dflash2_hf.cpu.kernels import PackedLinears
from dflash2_hf.drafting.lattice import Lattice, path_confidences

PROMPT = torch.tensor([[5, 17, 33, 2, 71, 8]])


def test_flat_verification_cost_verifies_the_whole_path():
    cost = CycleCost(fixed_seconds=0.5, verify_seconds=(1.0,) * 8)
    assert cost.verified_length([0.1] * 7) == 7


def test_the_block_is_cut_where_an_extra_token_no_longer_pays_for_itself():
    # rates: n=0 1/1.0; n=1 1.9/1.5 = 1.27; n=2 (1.9 + 0.9 * 0.5 = 2.35)/2.0 = 1.18 < 1.27 -> cut after 1
    cost = CycleCost(fixed_seconds=0.0, verify_seconds=(1.0, 1.5, 2.0, 2.5))
    assert cost.verified_length([0.9, 0.5, 0.99]) == 1
    assert cost.verified_length([0.9, 0.9, 0.9]) == 3  # 2.71/2 = 1.36, 3.439/2.5 = 1.38: each extra token pays
    assert cost.verified_length([0.2, 0.9, 0.9]) == 0  # 1.2/1.5 < 1/1.0: not even the first token pays


def test_the_cut_is_a_stopping_rule_later_confident_tokens_do_not_extend_it():
    cost = CycleCost(fixed_seconds=0.0, verify_seconds=(1.0, 1.5, 2.0, 2.5))
    assert cost.verified_length([0.9, 0.05, 1.0]) == 1


def test_a_tree_grows_by_branch_probabilities_while_each_node_pays_for_itself():
    # rates: 0 nodes 1/1.0; 1: 1.9/1.5 = 1.27; 2: 2.7/2.0 = 1.35; 3: 3.0/2.5 = 1.2 -> two nodes
    cost = CycleCost(fixed_seconds=0.0, verify_seconds=(1.0, 1.5, 2.0, 2.5))
    assert cost.worthwhile_size([0.9, 0.8, 0.3]) == 2
    assert cost.worthwhile_size([0.9, 0.81, 0.729]) == cost.verified_length([0.9, 0.9, 0.9]) == 3, \
        "a path's gains are its survival probabilities"


def test_a_size_stops_where_the_next_token_no_longer_pays_for_its_row():
    # rows are cheap up to 4, then each costs a whole forward more: 0 tokens 1/1.0; 1: 1.9/1.1; 2: 2.7/1.2;
    # 3: 3.0/1.3; 4: 3.1/2.3 -> three tokens
    cost = CycleCost(fixed_seconds=0.0, verify_seconds=(1.0, 1.1, 1.2, 1.3, 2.3, 3.3, 4.3))
    assert cost.worthwhile_size([0.9, 0.8, 0.3, 0.1]) == 3


def test_interpolation_is_linear_between_and_beyond_the_measured_lengths():
    assert interpolate({1: 1.0, 2: 2.0, 4: 3.0}, 6) == pytest.approx((1.0, 2.0, 2.5, 3.0, 3.5, 4.0))


def test_cycle_cost_refuses_non_positive_verify_times():
    with pytest.raises(ValueError, match="positive verify times"):
        CycleCost(fixed_seconds=0.1, verify_seconds=(0.0, 1.0))


def hand_lattice() -> Lattice:
    scores = torch.zeros(1, 2, 2, 2)
    scores[0, 0, :, 0] = torch.tensor(3.0).log()  # position 0: q = (3/4, 1/4) whatever the row
    scores[0, 1, 0] = torch.tensor([0.0, 0.0])  # after candidate 0: q = (1/2, 1/2)
    scores[0, 1, 1] = torch.tensor([9.0, 1.0]).log()  # after candidate 1: q = (9/10, 1/10)
    return Lattice(torch.tensor([7]), torch.tensor([[[1, 2], [3, 4]]]), torch.zeros(1, 2, 2), scores)


def test_a_picked_path_is_scored_by_the_probability_of_its_tokens():
    confidences = path_confidences(hand_lattice(), torch.tensor([[1, 0]]), sampled=False)
    assert confidences[0].tolist() == pytest.approx([0.25, 0.9])


def test_a_sampled_path_is_scored_without_looking_at_its_own_tokens():
    lattice = hand_lattice()
    first = path_confidences(lattice, torch.tensor([[1, 0]]), sampled=True)
    second = path_confidences(lattice, torch.tensor([[1, 1]]), sampled=True)
    assert first[0].tolist() == pytest.approx([0.75**2 + 0.25**2, 0.81 + 0.01])
    assert torch.equal(first, second), "position i depends on the token before it only"


def test_without_a_selector_the_drafters_own_distribution_is_used():
    lattice = Lattice(torch.tensor([7]), torch.tensor([[[1, 2]]]), torch.tensor([[[0.0, 0.0]]]))
    assert path_confidences(lattice, torch.tensor([[0]]), sampled=False)[0].tolist() == pytest.approx([0.5])


STEEP = CycleCost(fixed_seconds=0.01, verify_seconds=tuple(1.0 + 0.4 * m for m in range(8)))


@pytest.mark.parametrize("path", ["argmax", "greedy", "viterbi", "expected"])
@pytest.mark.parametrize("cost", [STEEP, CycleCost(0.0, tuple(1.0 + 0.05 * m for m in range(8)))])
def test_greedy_output_with_adaptive_blocks_equals_plain_generate(target, drafter, path, cost):
    plain = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    ours = target.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=drafter, dflash_path=path,
                           dflash_adaptive_block=cost)
    assert torch.equal(plain, ours)
    stats = drafter.last_generation_stats
    assert sum(stats.acceptance_lengths) + 1 == ours.shape[1] - PROMPT.shape[1]
    assert all(accepted <= verified + 1 for accepted, verified in zip(stats.acceptance_lengths, stats.verified_lengths))


def test_a_steep_cost_verifies_shorter_blocks_than_a_flat_one(target, drafter):
    lengths = {}
    for name, cost in {"steep": STEEP, "flat": CycleCost(0.0, (1.0,) * 8)}.items():
        target.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=drafter, dflash_adaptive_block=cost)
        lengths[name] = drafter.last_generation_stats.verified_lengths
    assert max(lengths["steep"]) < 7 and lengths["flat"][:10] == [7] * 10  # later cycles near max_new_tokens are shorter


def test_a_cost_model_shorter_than_the_block_is_refused(target, drafter):
    with pytest.raises(ValueError, match="covers verifying 4 tokens"):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=drafter,
                        dflash_adaptive_block=CycleCost(0.0, (1.0, 1.0, 1.0, 1.0)))


def test_a_bad_adaptive_block_value_is_refused_before_work(target, drafter):
    with pytest.raises(ValueError, match="adaptive_block must be"):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=drafter, dflash_adaptive_block="yes")


def test_measured_cost_covers_every_block_length(target, drafter):
    cost = measure_cycle_cost(target, drafter, block_size=8, context_tokens=16, repeats=1)
    assert len(cost.verify_seconds) == 8 and min(cost.verify_seconds) > 0 and cost.fixed_seconds > 0


def test_measured_cost_is_cached_per_machine_and_model_pair(target, drafter, tmp_path):
    first = cycle_cost_for(target, drafter, 8, folder=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    assert CycleCost.from_json(json.loads(entry.read_text())) == first
    assert cycle_cost_for(target, drafter, 8, folder=tmp_path) == first
    assert len(list(tmp_path.glob("*.json"))) == 1
    cycle_cost_for(target, drafter, 4, folder=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2, "another block size is another measurement"


def test_a_burst_of_load_while_measuring_is_not_recorded(monkeypatch):
    from dflash2_hf.cost import cycle_cost

    clock, calls = [0.0], []
    monkeypatch.setattr(cycle_cost, "device_seconds", lambda device: clock[0])

    def forward(seconds: float):
        def run():
            busy = len(calls) < 6  # another process loads the machine through the first rounds
            clock[0] += seconds * (4 if busy else 1)
            calls.append(seconds)
        return run

    fastest = cycle_cost._fastest_seconds({1: forward(0.05), 16: forward(0.08)}, rounds=5, device=None)
    assert fastest == {1: pytest.approx(0.05), 16: pytest.approx(0.08)}


def test_costs_measured_another_way_are_measured_again(target, drafter, tmp_path, monkeypatch):
    from dflash2_hf.cost import cycle_cost

    cycle_cost_for(target, drafter, 8, folder=tmp_path)
    monkeypatch.setattr(cycle_cost, "MEASUREMENT", "median of repeats")
    cycle_cost_for(target, drafter, 8, folder=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_packed_linears_and_kernel_limits_get_measurements_of_their_own(target, drafter, tmp_path, monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    cycle_cost_for(target, drafter, 8, folder=tmp_path)
    with PackedLinears(target, drafter):
        cycle_cost_for(target, drafter, 8, folder=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2, "packed weights verify at another cost"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    cycle_cost_for(target, drafter, 8, folder=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 3, "kernels held to AVX2 run at another cost"


# Cache entries that are not a cost this version wrote: a file edited by hand, cut short or of another shape.
BAD_CACHE_ENTRIES = {
    "not JSON": "{not json",
    "not UTF-8": b"\xff\xfe",
    "a list": "[1, 2, 3]",
    "a number": "3",
    "no verify times": '{"fixed_seconds": 0.1}',
    "verify times as a mapping": '{"fixed_seconds": 0.1, "verify_seconds": {"1": 0.1}}',
    "verify times as strings": '{"fixed_seconds": 0.1, "verify_seconds": ["0.1", "0.2"]}',
    "a boolean time": '{"fixed_seconds": true, "verify_seconds": [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]}',
    "a negative time": '{"fixed_seconds": 0.1, "verify_seconds": [-1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]}',
    "an infinite time": '{"fixed_seconds": 0.1, "verify_seconds": [Infinity, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]}',
    "a NaN time": '{"fixed_seconds": NaN, "verify_seconds": [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]}',
    "too few lengths": '{"fixed_seconds": 0.1, "verify_seconds": [0.1, 0.2]}',
}


@pytest.mark.parametrize("case", BAD_CACHE_ENTRIES)
def test_a_cache_entry_of_another_shape_is_measured_again_and_replaced(target, drafter, tmp_path, case):
    cycle_cost_for(target, drafter, 8, folder=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    bad = BAD_CACHE_ENTRIES[case]
    entry.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    with pytest.warns(UserWarning, match=f"the cached cycle cost {entry} cannot be used .*; measuring it again"):
        cost = cycle_cost_for(target, drafter, 8, folder=tmp_path)
    assert len(cost.verify_seconds) == 8
    assert CycleCost.from_json(json.loads(entry.read_text())) == cost, "replaced by the new measurement"


def test_a_cache_folder_that_cannot_be_made_leaves_decoding_to_go_on_with_a_warning(target, drafter, tmp_path,
                                                                                    monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path / "file" / "cache"))  # as a read-only home would
    plain = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    with pytest.warns(UserWarning, match="cannot keep the measured cycle cost in .*; decoding goes on"):
        ours = target.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                               dflash_adaptive_block=True)
    assert torch.equal(plain, ours)


def test_adaptive_true_measures_once_and_keeps_the_output_exact(target, drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path))
    plain = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    ours = target.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                           dflash_adaptive_block=True)
    assert torch.equal(plain, ours)
    assert len(list((tmp_path / "cycle-costs").glob("*.json"))) == 1


def test_a_length_is_priced_at_the_cheapest_forward_at_least_that_long():
    # verifying 3 drafted tokens (4-token forward) is cheaper than 1 or 2: whatever is worth verifying, 3 are verified
    cost = CycleCost(fixed_seconds=0.0, verify_seconds=(1.0, 1.6, 1.7, 1.2, 2.0))
    assert cost.verified_length([0.5, 0.5, 0.5, 0.5]) == 3
    assert cost.verified_length([0.9, 0.9]) == 2  # only 2 drafted: the cheaper 4-token forward is out of reach
    assert cost.verified_length([0.1, 0.1, 0.1, 0.1]) == 0
