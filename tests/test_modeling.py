"""Behaviour of the drafter forward pass: context injection, caching, attention windows, DFlash 2 parts."""

import pytest
import torch
from conftest import tiny_drafter, tiny_drafter_config, tiny_target
from transformers import DynamicCache

from dflash2_hf import DFlash2DraftModel, DFlashDraftModel
from dflash2_hf.modeling import CandidateSelector, GroupedDynamicConv


def block_inputs(drafter, context_length=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = drafter.config.hidden_size
    context = torch.randn(1, context_length, len(drafter.target_layer_ids) * hidden, generator=generator)
    noise = torch.randn(1, drafter.block_size, hidden, generator=generator)
    return context, noise


def test_config_picks_the_class():
    assert type(tiny_drafter("dflash")) is DFlashDraftModel
    assert type(tiny_drafter("dflash2")) is DFlash2DraftModel
    with pytest.raises(ValueError, match="needs a DFlash 2 config"):
        DFlash2DraftModel.class_for_config(tiny_drafter_config("dflash"))


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_forward_returns_one_hidden_state_per_block_position(kind):
    drafter = tiny_drafter(kind)
    context, noise = block_inputs(drafter)
    output = drafter(noise, context_hidden_states=context)
    assert output.last_hidden_state.shape == (1, drafter.block_size, drafter.config.hidden_size)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_cached_context_gives_the_same_block_as_all_context_at_once(kind):
    drafter = tiny_drafter(kind)
    context, noise = block_inputs(drafter, context_length=12)
    block = drafter.block_size
    with torch.no_grad():
        full = drafter(noise, context_hidden_states=context, position_ids=torch.arange(12 + block)[None])
        cache = DynamicCache()
        drafter(noise, context_hidden_states=context[:, :7], position_ids=torch.arange(7 + block)[None], cache=cache)
        cache.crop(-block)  # drop the first block's keys, keep the context
        split = drafter(noise, context_hidden_states=context[:, 7:], position_ids=torch.arange(7, 12 + block)[None], cache=cache)
    torch.testing.assert_close(split.last_hidden_state, full.last_hidden_state, atol=1e-5, rtol=1e-5)


def outputs_before_and_after_changing_the_last_block_position(drafter):
    context, noise = block_inputs(drafter)
    changed = noise.clone()
    changed[:, -1] += 1.0
    with torch.no_grad():
        before = drafter(noise, context_hidden_states=context).last_hidden_state
        after = drafter(changed, context_hidden_states=context).last_hidden_state
    return before, after


def test_block_positions_see_each_other_bidirectionally():
    before, after = outputs_before_and_after_changing_the_last_block_position(tiny_drafter("dflash"))
    assert not torch.allclose(before[:, 0], after[:, 0]), "the first position must see the last one"


def test_causal_option_hides_later_block_positions():
    before, after = outputs_before_and_after_changing_the_last_block_position(tiny_drafter("dflash", is_causal=True))
    torch.testing.assert_close(before[:, :-1], after[:, :-1])


def test_sliding_window_hides_context_beyond_the_window():
    drafter = tiny_drafter("dflash", layer_types=["sliding_attention"] * 2, sliding_window=4)
    context, noise = block_inputs(drafter, context_length=20)
    changed = context.clone()
    changed[:, :5] += 1.0  # more than `window` positions before every block query
    with torch.no_grad():
        before = drafter(noise, context_hidden_states=context).last_hidden_state
        after = drafter(noise, context_hidden_states=changed).last_hidden_state
    torch.testing.assert_close(before, after)
    changed[:, -1] += 1.0
    with torch.no_grad():
        near = drafter(noise, context_hidden_states=changed).last_hidden_state
    assert not torch.allclose(before, near), "context inside the window must matter"


def test_context_changes_the_draft():
    drafter = tiny_drafter("dflash2")
    context, noise = block_inputs(drafter)
    with torch.no_grad():
        one = drafter(noise, context_hidden_states=context).last_hidden_state
        other = drafter(noise, context_hidden_states=context.flip(1)).last_hidden_state
    assert not torch.allclose(one, other)


def test_fresh_convolution_is_the_identity():
    drafter = DFlash2DraftModel(tiny_drafter_config("dflash2"))
    hidden = torch.randn(2, 5, 64)
    layer_conv: GroupedDynamicConv = drafter.layers[0].attention_conv
    with torch.no_grad():
        layer_conv.kernel_projection.weight.zero_()
        prepared, second = layer_conv.prepare(hidden)
        torch.testing.assert_close(prepared, hidden)
        torch.testing.assert_close(layer_conv.finish(hidden, second), hidden)


def test_convolution_is_causal_along_the_block():
    conv = tiny_drafter("dflash2").layers[0].mlp_conv
    hidden = torch.randn(1, 6, 64)
    changed = hidden.clone()
    changed[:, 4] += 1.0
    with torch.no_grad():
        before, _ = conv.prepare(hidden)
        after, _ = conv.prepare(changed)
    torch.testing.assert_close(before[:, :4], after[:, :4])
    assert not torch.allclose(before[:, 5], after[:, 5]), "a two-tap kernel mixes position t-1 into t"


def test_logits_apply_multiplier_then_softcap():
    drafter = tiny_drafter("dflash2", output_multiplier=0.5, final_logit_softcapping=2.0)
    head = torch.nn.Linear(64, 96, bias=False)
    hidden = torch.randn(1, 3, 64)
    expected = torch.tanh(head(hidden) * 0.5 / 2.0) * 2.0
    torch.testing.assert_close(drafter.compute_logits(hidden, head), expected)


def test_selector_pair_scores_are_logit_plus_gated_bilinear_term():
    selector = tiny_drafter("dflash2").candidate_selector
    hidden = torch.randn(1, 3, 64)
    predecessors = torch.randint(0, 96, (1, 3, 4))
    candidates = torch.randint(0, 96, (1, 3, 4))
    logits = torch.randn(1, 3, 4)
    scores = selector.pair_scores(hidden, predecessors, candidates, logits)
    position, a, b = 2, 1, 3
    gate = selector.hidden_projection(hidden[0, position])
    term = (selector.predecessor_codebook[predecessors[0, position, a]] * gate * selector.successor_codebook[candidates[0, position, b]]).sum()
    torch.testing.assert_close(scores[0, position, a, b], logits[0, position, b] + term)
    assert scores.shape == (1, 3, 4, 4)


def selector_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Hidden states, predecessor and candidate ids and candidate logits of 2 blocks of 3 positions, 4 candidates."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 64, generator=generator), torch.randint(0, 96, (2, 3, 4), generator=generator),
            torch.randint(0, 96, (2, 3, 4), generator=generator), torch.randn(2, 3, 4, generator=generator))


def test_factorised_selector_scores_exactly_as_codebooks_materialised_from_the_target_embeddings(one_thread):
    factorised = tiny_drafter("dflash2", selector_factorised=True).candidate_selector
    table = tiny_target().get_input_embeddings().weight.detach()
    full = tiny_drafter("dflash2").candidate_selector
    with torch.no_grad():
        full.hidden_projection.weight.copy_(factorised.hidden_projection.weight)
        predecessors, successors = factorised.codebooks(table)
        full.predecessor_codebook.copy_(predecessors)
        full.successor_codebook.copy_(successors)
    torch.testing.assert_close(predecessors, table @ factorised.predecessor_projection.weight.T)  # P = E @ A
    inputs = selector_inputs()
    with torch.no_grad():
        assert torch.equal(factorised.pair_scores(*inputs, embedding_table=table), full.pair_scores(*inputs))


@pytest.mark.parametrize("vocab_size", [96, 50_000])
def test_factorised_selector_size_does_not_depend_on_the_vocabulary(vocab_size):
    config = tiny_drafter_config("dflash2", vocab_size=vocab_size, selector_factorised=True)
    with torch.device("meta"):
        selector = CandidateSelector(config)
    shapes = {name: tuple(p.shape) for name, p in selector.named_parameters()}
    assert shapes == {"hidden_projection.weight": (8, 64), "predecessor_projection.weight": (8, 64),
                      "successor_projection.weight": (8, 64)}  # W, A, B: 3 x hidden x rank


def test_factorised_selector_asks_for_the_target_embeddings():
    selector = tiny_drafter("dflash2", selector_factorised=True).candidate_selector
    with pytest.raises(ValueError, match=r"factorised.*pass embedding_table=target.get_input_embeddings\(\).weight"):
        selector.pair_scores(*selector_inputs())
    with pytest.raises(ValueError, match=r"\[vocab, 64\] input embedding matrix, got shape \[96, 32\]"):
        selector.pair_scores(*selector_inputs(), embedding_table=torch.zeros(96, 32))
