"""Bad input to `target.generate(assistant_model=drafter)`: refused with a message that says what to do, before the
target or the drafter runs; valid input at the limits still decodes exactly as plain `generate`."""

import re

import numpy as np
import pytest
import torch
from conftest import tiny_drafter
from transformers import DynamicCache


def prompt() -> torch.Tensor:
    return torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(3))


def refuse_before_any_work(target, drafter, match: str, inputs=None, **kwargs) -> None:
    """``generate`` raises ``ValueError`` matching ``match`` without running a forward of the target or drafter."""
    forwards = []
    hooks = [model.register_forward_pre_hook(lambda module, args: forwards.append(type(module).__name__))
             for model in (target, drafter)]
    try:
        with pytest.raises(ValueError, match=match):
            target.generate(inputs, max_new_tokens=5, do_sample=False, assistant_model=drafter, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    assert forwards == [], f"{forwards} ran before the refusal"


def test_use_cache_false_is_refused(target, drafter):
    refuse_before_any_work(target, drafter, r"needs the target's KV cache.*got use_cache=False.*Pass use_cache=True",
                           prompt(), use_cache=False)


def test_top_k_above_the_vocabulary_is_refused(target, drafter):
    refuse_before_any_work(target, drafter, "top_k .* must be at most the vocabulary size, 96; got 97", prompt(),
                           dflash_top_k=97)


def test_top_k_may_keep_the_whole_vocabulary(target, drafter):
    expected = target.generate(prompt(), max_new_tokens=12, do_sample=False)
    actual = target.generate(prompt(), max_new_tokens=12, do_sample=False, assistant_model=drafter, dflash_top_k=96)
    assert torch.equal(actual, expected)


def test_a_tree_larger_than_its_lattice_holds_is_refused(target, drafter):
    # 2 drafted positions by 2 candidates: 2 + 2 * 2 = 6 branches
    refuse_before_any_work(target, drafter, "tree_nodes must be at most 6, the branches a lattice of 2 drafted "
                           "positions by 2 candidates holds; got 7", prompt(),
                           dflash_block_size=3, dflash_top_k=2, dflash_tree_nodes=7)


def test_a_tree_of_every_branch_of_its_lattice_decodes_as_plain_generate(target, drafter):
    expected = target.generate(prompt(), max_new_tokens=12, do_sample=False)
    actual = target.generate(prompt(), max_new_tokens=12, do_sample=False, assistant_model=drafter,
                             dflash_block_size=3, dflash_top_k=2, dflash_tree_nodes=6)
    assert torch.equal(actual, expected)
    assert max(drafter.last_generation_stats.verified_lengths) == 6


@pytest.mark.parametrize(("tree_nodes", "lookup_tokens", "width"), [(512, 0, 513), (4, 10**9, 10**9 + 5)])
def test_a_tree_forward_wider_than_the_target_context_is_refused(target, drafter, tree_nodes, lookup_tokens, width):
    refuse_before_any_work(target, drafter, f"one target forward of {width} tokens, more than the target's context of "
                           r"512 \(max_position_embeddings\)", prompt(),
                           dflash_tree_nodes=tree_nodes, dflash_lookup_tokens=lookup_tokens)


@pytest.mark.parametrize(("option", "value", "shown"), [
    ("dflash_block_size", 8.5, r"block_size must be an integer, got 8.5 \(float\)"),
    ("dflash_block_size", "8", r"block_size must be an integer, got '8' \(str\)"),
    ("dflash_top_k", 2.0, r"top_k must be an integer, got 2.0 \(float\)"),
    ("dflash_tree_nodes", True, r"tree_nodes must be an integer, got True \(bool\)"),
    ("dflash_tree_nodes", torch.tensor(True), r"tree_nodes must be an integer, got tensor\(True\) \(Tensor\)"),
])
def test_a_size_that_is_not_an_integer_is_refused(target, drafter, option, value, shown):
    refuse_before_any_work(target, drafter, shown, prompt(), **{option: value})


def test_a_lookup_length_that_is_not_an_integer_is_refused(target, drafter):
    refuse_before_any_work(target, drafter, r"lookup_tokens must be an integer, got 1.5 \(float\)", prompt(),
                           dflash_tree_nodes=4, dflash_lookup_tokens=1.5)


@pytest.mark.parametrize("block_size", [np.int64(4), torch.tensor(4)])
def test_numpy_and_torch_integers_are_accepted(target, drafter, block_size):
    expected = target.generate(prompt(), max_new_tokens=12, do_sample=False)
    actual = target.generate(prompt(), max_new_tokens=12, do_sample=False, assistant_model=drafter,
                             dflash_block_size=block_size)
    assert torch.equal(actual, expected)
    assert type(drafter.last_generation_stats.block_size) is int and drafter.last_generation_stats.block_size == 4


def test_inputs_embeds_alone_is_refused(target, drafter):
    embeds = target.get_input_embeddings()(prompt()).detach()
    refuse_before_any_work(target, drafter, r"DFlash decoding needs input_ids.*inputs_embeds is not supported",
                           inputs_embeds=embeds)


def test_inputs_embeds_next_to_input_ids_is_refused(target, drafter):
    # decoding the ids would silently ignore the embeddings that plain generate prefills with
    embeds = 2 * target.get_input_embeddings()(prompt()).detach()
    refuse_before_any_work(target, drafter, r"inputs_embeds is not supported \(alone or next to input_ids\)",
                           prompt(), inputs_embeds=embeds)


def test_a_cache_that_already_holds_tokens_is_refused(target, drafter):
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(prompt()[:, :4], cache=cache, use_cache=True)
    refuse_before_any_work(target, drafter, "The cache passed to generate already holds 4 tokens", prompt(),
                           cache=cache)


def test_an_empty_cache_passed_in_is_used(target, drafter):
    expected = target.generate(prompt(), max_new_tokens=12, do_sample=False)
    actual = target.generate(prompt(), max_new_tokens=12, do_sample=False, assistant_model=drafter,
                             cache=DynamicCache(config=target.config))
    assert torch.equal(actual, expected)


def test_a_v1_drafter_without_vocab_size_is_bounded_by_the_target_vocabulary(target):
    drafter = tiny_drafter("dflash", vocab_size=None)
    refuse_before_any_work(target, drafter, "must be at most the vocabulary size, 96", prompt(), dflash_top_k=200)


@pytest.mark.parametrize("value", ["no", "yes", "", 1, 0, 1.0, [True]])
def test_a_flag_that_is_not_a_bool_is_refused(target, drafter, value):
    refuse_before_any_work(target, drafter, rf"record_drafts must be True or False, got {re.escape(repr(value))}",
                           prompt(), dflash_record_drafts=value)


# An attention mask DFlash decoding cannot honour (for the 12-token prompt) -> what the refusal says.
BAD_MASKS = {
    "shorter than the prompt": (torch.ones(1, 11, dtype=torch.long), r"attention_mask \(or position_ids\) has shape "
                                r"\(1, 11\); input_ids has \(1, 12\)"),
    "longer than the prompt": (torch.ones(1, 13, dtype=torch.long), r"has shape \(1, 13\); input_ids has"),
    "shorter, with a zero": (torch.tensor([[1] * 10 + [0]]), r"has shape \(1, 11\); input_ids has"),
    "left padding": (torch.tensor([[0, 0] + [1] * 10]), "The prompt is left-padded .2 masked tokens."),
    "holes in the prompt": (torch.tensor([[1] * 5 + [0] + [1] * 6]), r"hides prompt tokens at positions \[5\]"),
}


@pytest.mark.parametrize("case", BAD_MASKS)
def test_an_attention_mask_that_does_not_attend_to_the_whole_prompt_is_refused(target, drafter, case):
    mask, says = BAD_MASKS[case]
    refuse_before_any_work(target, drafter, says, prompt(), attention_mask=mask)


def test_position_ids_of_ones_own_are_refused_rather_than_ignored(target, drafter):
    refuse_before_any_work(target, drafter, r"places the prompt at positions 0 .. n-1; pass no position_ids",
                           prompt(), position_ids=torch.arange(12)[None] + 5)


def test_prompt_tokens_equal_to_the_pad_token_are_refused_as_such_not_as_padding(target, drafter):
    # generate masks every token equal to pad_token_id when no mask is passed and the pad token is not EOS
    ids = prompt()
    refuse_before_any_work(target, drafter, rf"Prompt tokens at positions \[3\] equal pad_token_id {int(ids[0, 3])}, "
                           r"which generate masks out .* attention_mask=torch.ones_like\(input_ids\)", ids,
                           pad_token_id=int(ids[0, 3]), eos_token_id=95)


def test_a_full_attention_mask_decodes_as_plain_generate(target, drafter):
    ids = prompt()
    settings = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids),
                    pad_token_id=int(ids[0, 3]), eos_token_id=95)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **settings), target.generate(ids, **settings))


def test_an_option_out_of_range_names_the_drafter_config_when_the_call_set_none(target):
    drafter = tiny_drafter("dflash2", default_tree_nodes=8)  # a 1-position lattice of 4 candidates holds 4 branches
    refuse_before_any_work(target, drafter, "got 8 from the drafter config's default_tree_nodes. Pass a smaller "
                           "dflash_tree_nodes", prompt(), dflash_block_size=2)


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_drafter_with_non_finite_weights_is_refused_naming_them(target, do_sample, bad):
    drafter = tiny_drafter("dflash2")
    name, weight = list(drafter.named_parameters())[3]
    with torch.no_grad():
        weight.view(-1)[0] = bad
    with pytest.raises(ValueError, match=rf"The drafter has NaN or Inf weights in {re.escape(name)}; load or train"):
        target.generate(prompt(), max_new_tokens=5, do_sample=do_sample, assistant_model=drafter)


def on_meta(drafter):
    return drafter.to("meta")


def one_weight_on_meta(drafter):
    drafter.fc.weight = torch.nn.Parameter(torch.empty_like(drafter.fc.weight, device="meta"))
    return drafter


def an_integer_weight(drafter):
    drafter.fc.weight = torch.nn.Parameter(drafter.fc.weight.detach().to(torch.int32), requires_grad=False)
    return drafter


@pytest.mark.parametrize("break_it, message", [
    (on_meta, r"The drafter's \S+ is on the meta device \(no values\)"),
    (one_weight_on_meta, r"The drafter's fc.weight is on the meta device"),
    (an_integer_weight, r"The drafter's weight fc.weight holds torch.int32, not floating point"),
], ids=["whole drafter on meta", "one weight on meta", "an integer weight"])
def test_a_drafter_whose_tensors_are_not_what_they_claim_is_refused_naming_one(target, break_it, message):
    refuse_before_any_work(target, break_it(tiny_drafter(seed=4)), message, prompt())
