"""The grouped-query attention the decoder verifies with gives sdpa's results bit for bit, without sdpa's copy of the
keys and values per query head, and is on only while ``generate`` decodes with a drafter."""

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations import sdpa_attention

from conftest import tiny_drafter, tiny_target
from dflash2_hf.cpu.grouped_attention import GROUPED_SDPA, grouped_attention

SHAPES = [(prefix, rows) for prefix in (5, 40, 130) for rows in (2, 9, 17)]


@pytest.fixture(scope="module")
def grouped_target():
    """A tiny Llama whose 4 query heads share 2 key/value heads (grouped-query attention), on sdpa."""
    model = tiny_target("llama", seed=2, num_attention_heads=4, num_key_value_heads=2)
    model.set_attn_implementation("sdpa")
    return model


def tree_like_mask(prefix: int, rows: int) -> torch.Tensor:
    """A boolean mask as a token tree's verification has it: the prefix for every row, then each row itself and
    every second row before it."""
    mask = torch.ones(1, 1, rows, prefix + rows, dtype=torch.bool)
    block = torch.eye(rows, dtype=torch.bool) | (torch.tril(torch.ones(rows, rows, dtype=torch.bool)) &
                                                  (torch.arange(rows)[None] % 2 == 0))
    mask[0, 0, :, prefix:] = block
    return mask


def block_logits(model, tokens: torch.Tensor, prefix: int, rows: int, mask: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(tokens[:, :prefix], cache=cache)
        kwargs = {} if mask is None else {"attention_mask": mask.float().log()}  # additive: 0 or -inf
        return model(tokens[:, prefix : prefix + rows], cache=cache, **kwargs).logits[0]


@pytest.mark.parametrize("prefix,rows", SHAPES)
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree mask"])
def test_block_forwards_give_sdpas_logits_bit_for_bit(grouped_target, prefix, rows, tree):
    tokens = torch.randint(0, grouped_target.config.vocab_size, (1, prefix + rows),
                           generator=torch.Generator().manual_seed(prefix + rows))
    mask = tree_like_mask(prefix, rows) if tree else None
    stock = block_logits(grouped_target, tokens, prefix, rows, mask)
    with grouped_attention(grouped_target):
        grouped = block_logits(grouped_target, tokens, prefix, rows, mask)
    assert torch.equal(grouped, stock)


def test_block_forwards_do_not_copy_the_keys_and_values_per_head(grouped_target, monkeypatch):
    copies = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *args: copies.append(1) or original(*args))
    tokens = torch.arange(30)[None]
    block_logits(grouped_target, tokens, 20, 10, None)
    assert copies, "sdpa copies the cache per query head for a masked block (the cost this attention removes)"
    copies.clear()
    with grouped_attention(grouped_target):
        block_logits(grouped_target, tokens, 20, 10, None)
    assert not copies


def test_generate_verifies_with_it_and_gives_sdpa_back(grouped_target):
    seen = []
    hook = grouped_target.register_forward_pre_hook(lambda model, args: seen.append(model.config._attn_implementation))
    try:
        prompt = torch.tensor([[3, 17, 9, 41, 5, 22, 8]])
        plain = grouped_target.generate(prompt, do_sample=False, max_new_tokens=24)
        seen.clear()
        ours = grouped_target.generate(prompt, do_sample=False, max_new_tokens=24,
                                       assistant_model=tiny_drafter(seed=5), dflash_tree_nodes=4)
    finally:
        hook.remove()
    assert torch.equal(ours, plain)
    assert seen and set(seen) == {GROUPED_SDPA}
    assert grouped_target.config._attn_implementation == "sdpa"


def test_other_attentions_are_left_as_they_are():
    model = tiny_target("llama", seed=2)
    model.set_attn_implementation("eager")
    with grouped_attention(model):
        assert model.config._attn_implementation == "eager"


def test_sdpa_comes_back_after_an_error(grouped_target):
    with pytest.raises(RuntimeError), grouped_attention(grouped_target):
        assert grouped_target.config._attn_implementation == GROUPED_SDPA
        raise RuntimeError("stopped")
    assert grouped_target.config._attn_implementation == "sdpa"
