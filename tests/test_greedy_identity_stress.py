"""Greedy identity every run: with the verify forward's width changing from cycle to cycle and from run to run (a
jittery cost model sizes every path, tree and copied branch at random), fp32 greedy output is plain decoding's on
every prompt of every run, or parts from it only at a near-tie within the rounding measured here (the default,
``dflash_exactness="rounding"``, drafting at every width); with ``"bitwise"`` at the widths this machine measures
exact (none on the CPUs measured so far: plain decoding)."""

import random

import pytest
import torch

from conftest import assert_plain_decodings_output, tiny_drafter, tiny_target


class JitteryCost:
    """A cycle cost that verifies a random number of the candidate tokens each time (seeded per run)."""

    def __init__(self, seed: int):
        self.draw = random.Random(seed)

    def worthwhile_size(self, gains) -> int:
        return self.draw.randint(0, len(gains))

    def verified_length(self, confidences) -> int:
        return self.draw.randint(0, len(confidences))


PROMPTS = 40
PLANS = {
    "token trees with a copied branch": dict(dflash_tree_nodes=8, dflash_lookup_tokens=8),
    "one path": dict(dflash_tree_nodes=0, dflash_path="greedy"),
}


def jittered_runs(plan: dict, **options) -> tuple[set[int], set[int | None]]:
    """40 prompts x 2 runs with the widths jittered, each output checked against plain decoding's; the widths the
    verification forwards had, and the exact widths the calls measured (``None``: every width)."""
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter(seed=4)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 90, (1, int(torch.randint(3, 20, (1,), generator=generator))), generator=generator)
               for _ in range(PROMPTS)]
    plain = [target.generate(prompt, max_new_tokens=32, do_sample=False) for prompt in prompts]
    widths, exact = set(), set()
    for run in range(2):
        cost = JitteryCost(seed=run)
        for index, prompt in enumerate(prompts):
            ours = target.generate(prompt, max_new_tokens=32, do_sample=False, assistant_model=drafter,
                                   dflash_adaptive_block=cost, dflash_plain_fallback=False, **plan, **options)
            assert_plain_decodings_output(target, prompt, ours, plain[index])
            stats = drafter.last_generation_stats
            widths |= {1 + length for length in stats.verified_lengths}
            exact.add(stats.exact_width)
    return widths, exact


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_every_prompt_of_every_run_is_plain_decodings_output(plan, one_thread):
    widths, _ = jittered_runs(plan)
    assert len(widths) >= 6, f"the forwards' widths barely varied: {sorted(widths)}"


@pytest.mark.measured_widths
def test_bitwise_every_prompt_of_every_run_is_plain_decodings_output_at_the_widths_measured_here(one_thread):
    widths, exact = jittered_runs(PLANS["token trees with a copied branch"], dflash_exactness="bitwise")
    assert len(exact) == 1 and None not in exact, "one measurement, applied to every call"
    assert max(widths, default=1) <= exact.pop(), "verified only within the widths measured exact here"
