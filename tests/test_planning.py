"""Drafting only where it pays: the guard that falls back to plain decoding, and the plan chosen from row costs.

The guard's choices are tested with injected costs (``prices``: a :class:`CycleCost` instead of the wall clock), so
they do not hang on this machine's timing; the decoding tests check that every plan gives plain decoding's tokens.
"""

import warnings

import pytest
import torch

from conftest import tiny_drafter, tiny_target
from dflash2_hf.cost.cycle_cost import CycleCost
from dflash2_hf.cost.guard import DraftingGuard

# A forward over any number of rows costs what one row costs, and drafting is free: drafting never loses.
CHEAP_ROWS = CycleCost(fixed_seconds=0.0, verify_seconds=(0.01,) * 16)
# Each verified row costs as much as a one-token forward, and drafting as much again: drafting always loses.
EXPENSIVE_ROWS = CycleCost(fixed_seconds=0.01, verify_seconds=tuple(0.01 * (1 + m) for m in range(16)))
PROMPT = torch.tensor([[1, 5, 7, 9, 11]])


def run(guard: DraftingGuard, emitted_per_cycle: int, verified: int, steps: int) -> list[bool]:
    """Drive the guard for ``steps`` steps as the decoder does; ``True`` where it drafted."""
    kinds = []
    for _ in range(steps):
        drafts = guard.drafts_next()
        kinds.append(drafts)
        if drafts:
            guard.record_cycle(emitted_per_cycle, verified, seconds=1.0)
        else:
            guard.record_plain(seconds=1.0)
    return kinds


def test_drafting_that_pays_keeps_drafting_with_a_timed_plain_step_now_and_then():
    kinds = run(DraftingGuard(replain_every=32, prices=CHEAP_ROWS), emitted_per_cycle=2, verified=8, steps=100)
    assert kinds[:2] == [True, True] and kinds[2] is False, "two cycles, then one plain step to time plain decoding"
    assert kinds.count(False) == 1 + (100 - 3) // 33, "afterwards one plain step every 32 cycles"


def test_drafting_slower_than_plain_decoding_pauses_for_plain_steps():
    guard = DraftingGuard(first_pause=16, prices=EXPENSIVE_ROWS)
    kinds = run(guard, emitted_per_cycle=2, verified=8, steps=3 + 16 + 2)
    assert kinds[:3] == [True, True, False]
    assert kinds[3 : 3 + 16] == [False] * 16, "a pause of 16 plain steps"
    assert kinds[3 + 16 :] == [True, True], "then a probe of two cycles"


def test_each_failed_probe_doubles_the_pause_up_to_the_longest():
    guard = DraftingGuard(first_pause=4, longest_pause=16, prices=EXPENSIVE_ROWS)
    kinds = run(guard, emitted_per_cycle=1, verified=4, steps=200)
    pauses, length = [], 0
    for drafted in kinds[3:]:  # after the first two cycles and the timing step
        if drafted and length:
            pauses.append(length)
            length = 0
        elif not drafted:
            length += 1
    assert pauses[:4] == [4, 8, 16, 16]


def test_a_probe_that_finds_drafting_faster_resumes_it():
    guard = DraftingGuard(first_pause=4, prices=EXPENSIVE_ROWS)
    run(guard, emitted_per_cycle=1, verified=4, steps=3 + 4)  # drafting lost: four plain steps taken
    assert guard.drafts_next(), "the probe drafts"
    kinds = run(guard, emitted_per_cycle=16, verified=4, steps=40)  # now each cycle emits 16 tokens for 6 rows' cost
    assert kinds.count(False) <= 1, "drafting continues (one timing step at most)"


def test_a_pause_ends_early_when_the_context_lookup_keeps_foreseeing_the_tokens():
    guard = DraftingGuard(first_pause=16, prices=EXPENSIVE_ROWS)
    run(guard, emitted_per_cycle=1, verified=4, steps=3)  # drafting lost: a pause of 16 begins
    guard.record_plain(1.0, foreseen=True)
    guard.record_plain(1.0, foreseen=False)  # the run is broken: the pause goes on
    guard.record_plain(1.0, foreseen=True)
    assert not guard.drafts_next()
    guard.record_plain(1.0, foreseen=True)  # two in a row
    assert guard.drafts_next(), "the probe starts after 4 of the 16 plain steps"


def test_without_prices_the_measured_seconds_decide():
    guard = DraftingGuard()
    guard.record_cycle(tokens=3, verified=8, seconds=0.2)
    guard.record_cycle(tokens=3, verified=8, seconds=0.2)
    assert guard.drafting_rate == pytest.approx(15.0)
    guard.record_plain(seconds=0.05)
    assert guard.plain_rate == pytest.approx(20.0)
    assert not guard.drafts_next(), "20 tokens/s plainly against 15 drafting"


def test_a_guard_refuses_non_positive_counts():
    with pytest.raises(ValueError, match="positive counts"):
        DraftingGuard(first_pause=0)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=1)


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter("dflash2", seed=0)


def decode(target, drafter=None, **kwargs) -> torch.Tensor:
    extra = {"assistant_model": drafter} if drafter is not None else {}
    return target.generate(PROMPT, max_new_tokens=40, do_sample=False, **extra, **kwargs)


def test_cheap_rows_verify_wide_trees_and_keep_drafting(target, drafter):
    out = decode(target, drafter, dflash_tree_nodes=6, dflash_adaptive_block=CHEAP_ROWS,
                 dflash_plain_fallback=CHEAP_ROWS)
    stats = drafter.last_generation_stats
    assert torch.equal(out, decode(target))
    assert max(stats.verified_lengths) == 6, "every node pays when rows cost nothing"
    assert stats.plain_steps <= 2, "plain steps only to time plain decoding"


def test_expensive_rows_verify_small_trees_and_fall_back_to_plain_decoding(target, drafter):
    out = decode(target, drafter, dflash_tree_nodes=6, dflash_adaptive_block=EXPENSIVE_ROWS,
                 dflash_plain_fallback=EXPENSIVE_ROWS)
    stats = drafter.last_generation_stats
    assert torch.equal(out, decode(target))
    assert max(stats.verified_lengths) < 6
    assert stats.plain_steps > stats.cycles, "mostly plain steps where drafting does not pay"
    assert stats.new_tokens == out.shape[1] - PROMPT.shape[1]


@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_plain_steps_give_plain_decodings_tokens_and_scores(target, drafter, tree_nodes):
    """Mixed plain steps and cycles (one path or a tree), with a logits processor and the scores returned."""
    settings = dict(repetition_penalty=1.3, return_dict_in_generate=True, output_scores=True)
    ours = decode(target, drafter, dflash_tree_nodes=tree_nodes, dflash_plain_fallback=EXPENSIVE_ROWS, **settings)
    plain = decode(target, **settings)
    assert drafter.last_generation_stats.plain_steps > 0 and drafter.last_generation_stats.cycles > 0
    assert torch.equal(ours.sequences, plain.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours.scores, plain.scores))


def test_the_wall_clock_guard_keeps_greedy_output_exact(target, drafter):
    assert torch.equal(decode(target, drafter, dflash_tree_nodes=6, dflash_plain_fallback=True), decode(target))


def test_a_bad_plain_fallback_value_is_refused_before_work(target, drafter):
    with pytest.raises(ValueError, match="plain_fallback must be True, False or a CycleCost"):
        decode(target, drafter, dflash_plain_fallback="yes")


# A CPU's bf16 (instructions in hardware, a block's rows rounded as alone) -> the warning a bf16 call gets, if any.
BF16_CPUS = [
    ((False, False), "no bf16 matmul instructions"),
    ((True, False), "round some values of a many-token block differently"),
    ((True, True), None),
]


@pytest.mark.parametrize(("cpu", "warning"), BF16_CPUS, ids=["emulated", "blocks-round-unlike-rows", "exact"])
def test_bf16_where_it_is_slow_or_inexact_warns_and_names_float32(monkeypatch, cpu, warning):
    from dflash2_hf.generation import request

    monkeypatch.setattr(request, "native_bf16_matmuls", lambda: cpu[0])
    monkeypatch.setattr(request, "bf16_rows_independent", lambda: cpu[1])
    target = tiny_target("qwen3", seed=1).to(torch.bfloat16)
    drafter = tiny_drafter("dflash2", seed=0).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    ours = [str(w.message) for w in caught if "dtype=torch.float32" in str(w.message)]
    assert ours == [] if warning is None else (len(ours) == 1 and warning in ours[0])


def jittery_clock(seed: int):
    """A device clock whose steps take anywhere from 0.1 ms to 1 s: a machine so noisy that choosing steps by the
    clock would choose differently on every run."""
    import random

    draws, now = random.Random(seed), [0.0]

    def seconds(device) -> float:
        now[0] += draws.uniform(1e-4, 1.0)
        return now[0]

    return seconds


def sampled_twice(target, drafter, monkeypatch) -> list[tuple[torch.Tensor, int]]:
    """Two seeded sampled generations under two different jittery clocks: each one's tokens and plain steps."""
    runs = []
    for clock in (1, 2):
        monkeypatch.setattr("dflash2_hf.generation.loop.device_seconds", jittery_clock(clock))
        torch.manual_seed(7)
        out = target.generate(PROMPT, max_new_tokens=40, do_sample=True, assistant_model=drafter,
                              dflash_plain_fallback=True, return_dict_in_generate=True)
        runs.append((out.sequences, out.dflash_stats.plain_steps))
    return runs


def test_a_seed_gives_the_same_sampled_text_whatever_the_clock_says(target, drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_HF_CACHE", str(tmp_path))
    (first, first_plain), (second, second_plain) = sampled_twice(target, drafter, monkeypatch)
    assert torch.equal(first, second) and first_plain == second_plain
    assert list((tmp_path / "cycle-costs").glob("*.json")), "steps priced by the machine's cached cycle cost"


def test_choosing_sampled_steps_by_the_clock_would_not_repeat_a_seed(target, drafter, tmp_path, monkeypatch):
    """The control: the same runs with the guard timing steps (as greedy decoding does) give other text."""
    from dflash2_hf.generation.loop import DFlashDecoder

    monkeypatch.setattr(DFlashDecoder, "_guard_prices", lambda self, options: None)
    (first, first_plain), (second, second_plain) = sampled_twice(target, drafter, monkeypatch)
    assert first_plain != second_plain and not torch.equal(first, second)
