"""Exact whatever the user did to the weights between two calls: the packed copies of the linears (and the drafter
copy in the target's dtype) follow the weights' values, however they were changed."""

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from conftest import tiny_drafter, tiny_target
from dflash2_hf.cpu.kernels import packed_linears_supported

pytestmark = pytest.mark.skipif(not packed_linears_supported(torch.float32),
                                reason="this torch build has no oneDNN: nothing is packed, so nothing can go stale")


def scale_through_data(model):
    for name, module in model.named_modules():
        if name.endswith("o_proj"):
            module.weight.data.mul_(1.5)


def scale_in_place_without_grad(model):
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("o_proj"):
                module.weight.mul_(1.5)


def load_scaled_state_dict(model):
    state = {name: value * 1.5 if name.endswith("o_proj.weight") else value
             for name, value in model.state_dict().items()}
    model.load_state_dict(state)


def round_trip_through_bf16(model):
    model.to(torch.bfloat16).to(torch.float32)


def swap_parameters(model):
    for name, module in model.named_modules():
        if name.endswith("o_proj"):
            module.weight = torch.nn.Parameter(module.weight.detach() * 1.5)


def lora_layers(model) -> list[LoraLayer]:
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def with_lora(model):
    """``model`` with a random (non-zero) LoRA adapter on its attention output projections, unmerged."""
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False), model)
    return model


def merge_lora(model):
    for layer in lora_layers(model):
        layer.merge()


def unmerge_lora(model):
    for layer in lora_layers(model):
        layer.unmerge()


CHANGES = {  # name -> (prepare the model before the first call, change it between the calls)
    ".data in place": (None, scale_through_data),
    "in place under no_grad": (None, scale_in_place_without_grad),
    "load_state_dict": (None, load_scaled_state_dict),
    "to() and back": (None, round_trip_through_bf16),
    "a swapped nn.Parameter": (None, swap_parameters),
    "PEFT merge": (with_lora, merge_lora),
    "PEFT unmerge": (lambda model: (with_lora(model), merge_lora(model))[0], unmerge_lora),
}

PROMPT = torch.tensor([[5, 17, 33, 2, 61, 8]])


def linear_weights(model) -> list[torch.Tensor]:
    """A copy of every ``nn.Linear`` weight (what the packed copies are made from)."""
    return [module.weight.detach().clone() for module in model.modules() if isinstance(module, torch.nn.Linear)]


def decode(target, drafter=None, **options):
    extra = dict(assistant_model=drafter, dflash_record_drafts=True, **options) if drafter is not None else {}
    return target.generate(PROMPT, max_new_tokens=48, do_sample=False, **extra)


def assert_decodes_with_changed_target_weights(prepare, change) -> None:
    """A call, then the target's weights changed by ``change`` (after ``prepare``), then a call equal to plain
    decoding with the new weights."""
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter(seed=4)
    target = prepare(target) if prepare else target
    decode(target, drafter)
    before = linear_weights(target)
    change(target)
    assert any(not torch.equal(a, b) for a, b in zip(before, linear_weights(target))), "no linear weight changed"
    assert torch.equal(decode(target, drafter), decode(target))


@pytest.mark.parametrize("prepare, change", CHANGES.values(), ids=CHANGES.keys())
def test_a_call_after_the_targets_weights_changed_matches_plain_decoding_with_the_new_weights(prepare, change,
                                                                                           one_thread):
    assert_decodes_with_changed_target_weights(prepare, change)


@pytest.mark.parametrize("prepare, change", CHANGES.values(), ids=CHANGES.keys())
@pytest.mark.parametrize("drafter_dtype", [torch.float32, torch.bfloat16], ids=["packed drafter", "drafter copy"])
def test_a_call_after_the_drafters_weights_changed_drafts_with_the_new_weights(prepare, change, drafter_dtype,
                                                                                one_thread):
    """Not a matter of exactness (verification keeps any proposal exact) but of drafting with the drafter the user
    has: the drafts equal a fresh copy's of the changed drafter."""
    target, drafter = tiny_target("qwen3", seed=1), tiny_drafter(seed=4, kind="dflash")
    drafter = (prepare(drafter) if prepare else drafter).to(drafter_dtype)
    decode(target, drafter)
    change(drafter)
    decode(target, drafter)
    changed = drafter.last_generation_stats.drafts
    fresh = copy.deepcopy(drafter)
    decode(target, fresh)
    assert [d.candidate_ids.tolist() for d in changed] == [
        d.candidate_ids.tolist() for d in fresh.last_generation_stats.drafts]


def test_without_torchs_tensor_hash_the_values_are_hashed_all_the_same(monkeypatch, one_thread):
    """torch before 2.8 has no ``torch.hash_tensor``: the weights' bytes are hashed instead, with the same effect."""
    monkeypatch.delattr(torch, "hash_tensor", raising=False)
    assert_decodes_with_changed_target_weights(*CHANGES[".data in place"])
