"""Training sees what decoding sees: at every anchor ``generate`` drafted from, the block the trainer builds at that
anchor (context features of the same target layers and positions, the anchor token in slot 0, mask tokens after it,
the same positions and attention) gives the drafter the same hidden states and logits.

A mismatch here (an anchor shifted by one, a layer id off by one, a window or causal mask applied on one side only)
costs a drafter most of its acceptance while every decode-identity test stays green: greedy output is exact whatever
the drafter proposes."""

import copy

import pytest
import torch

from conftest import PARITY_TOLERANCE, drafted_blocks, tiny_drafter, tiny_target
from dflash2_hf.training.blocks import blocks_at
from dflash2_hf.training.trainer import DrafterTrainer, TrainingConfig

#: drafter layouts whose attention or taps differ: each must be trained as it drafts.
DRAFTERS = {
    "dflash2": dict(kind="dflash2"),
    "dflash v1": dict(kind="dflash"),
    "causal block": dict(kind="dflash2", is_causal=True),
    "sliding window": dict(kind="dflash2", layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "every layer sliding": dict(kind="dflash", sliding_window=3),
    "last target layer tapped": dict(kind="dflash2", target_layer_ids=[1, 3]),
}

PLANS = {  # the default plan drafts trees and copies branches; one path per cycle drafts whole blocks
    "default plan": {},
    "one argmax path": dict(dflash_path="argmax", dflash_tree_nodes=0, dflash_lookup_tokens=0),
}


def trained_blocks(target, drafter, sequence: list[int], prompt_length: int, anchors: list[int], folder):
    """The trainer's drafter hidden states and logits ``[N, B-1, ...]`` of blocks at ``anchors`` of ``sequence``, in
    the drafter's own dtype (no autocast), as decoding runs it."""
    config = TrainingConfig(output_dir=str(folder), steps=0, blocks_per_sequence=len(anchors))
    run = DrafterTrainer(copy.deepcopy(drafter), target, [{"prompt_ids": sequence[:prompt_length],
                                                           "response_ids": sequence[prompt_length:]}], config)
    batch = blocks_at(run.records, [anchors], drafter.block_size, config.max_length, record_ids=[0])
    with run._evaluating(), torch.no_grad():
        hidden, logits, _ = run._forward(batch, mixed_precision=False)
    return hidden, logits


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
@pytest.mark.parametrize("layout", DRAFTERS.values(), ids=DRAFTERS.keys())
def test_the_trainer_drafts_each_block_as_generate_drafts_it(layout, plan, monkeypatch, tmp_path, one_thread):
    target = tiny_target("qwen3", seed=1)
    drafter = tiny_drafter(seed=4, **layout)
    prompt = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(3))
    sequence, drafts = drafted_blocks(target, drafter, prompt, monkeypatch, **plan)
    assert len(drafts) >= 3, "decoding drafted too few blocks to compare"
    hidden, logits = trained_blocks(target, drafter, sequence, prompt.shape[1], [a for a, _ in drafts], tmp_path)
    head = target.get_output_embeddings()
    for row, (anchor, decoded) in enumerate(drafts):
        drafted = decoded.shape[0]
        torch.testing.assert_close(hidden[row, :drafted], decoded, **PARITY_TOLERANCE,
                                   msg=lambda m: f"block at anchor {anchor}: {m}")
        torch.testing.assert_close(logits[row, :drafted], drafter.compute_logits(decoded, head),
                                   **PARITY_TOLERANCE, msg=lambda m: f"block at anchor {anchor}: {m}")


def test_a_block_at_an_anchor_one_off_is_told_apart(monkeypatch, tmp_path, one_thread):
    """The negative control: the comparison fails when the trainer's anchors are shifted by one position."""
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter(seed=4)
    prompt = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(3))
    sequence, drafts = drafted_blocks(target, drafter, prompt, monkeypatch)
    hidden, _ = trained_blocks(target, drafter, sequence, prompt.shape[1], [a + 1 for a, _ in drafts], tmp_path)
    assert all(not torch.allclose(hidden[row, : d.shape[0]], d, atol=1e-3) for row, (_, d) in enumerate(drafts))
