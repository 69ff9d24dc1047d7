"""A target whose weights optimum-quanto quantized is a different target; decoding stays exact relative to it."""

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from optimum.quanto import freeze, qint8, quantize

PROMPT = torch.tensor([[5, 17, 33, 2, 71, 8]])


@pytest.fixture(scope="module")
def int8_target():
    target = tiny_target("qwen3", seed=1)
    quantize(target, weights=qint8)
    freeze(target)
    return target


@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_greedy_output_on_an_int8_target_equals_that_targets_plain_generate(int8_target, tree_nodes):
    drafter = tiny_drafter("dflash2", seed=4)
    plain = int8_target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    ours = int8_target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                                dflash_tree_nodes=tree_nodes)
    assert torch.equal(plain, ours)
    assert len(drafter.last_generation_stats.acceptance_lengths) > 1, "drafted cycles ran"
