"""Packed bf16 linears compute what the plain layers compute, bit for bit, and switch on and off cleanly."""

import pytest
import torch
from conftest import tiny_drafter, tiny_target

from dflash2_hf.cpu_kernels import PackedLinears, packed_linears_supported

PROMPT = torch.tensor([[5, 17, 33, 2, 71, 8]])
needs_onednn_bf16 = pytest.mark.skipif(not packed_linears_supported(),
                                       reason="this CPU has no oneDNN bf16 matmuls (AVX512-BF16 or AMX)")


@pytest.fixture(scope="module")
def bf16_target():
    return tiny_target("qwen3", seed=1).to(torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_drafter():
    return tiny_drafter("dflash2", seed=4).to(torch.bfloat16)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 5, 25])
def test_every_packed_layer_gives_the_plain_layers_output_bit_for_bit(bf16_target, bf16_drafter, rows):
    layers = [m for model in (bf16_target, bf16_drafter) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, rows, layer.in_features).to(torch.bfloat16) for layer in layers]
    with torch.no_grad():
        plain = [layer(x) for layer, x in zip(layers, inputs)]
        with PackedLinears(bf16_target, bf16_drafter):
            packed = [layer(x) for layer, x in zip(layers, inputs)]
    assert all(torch.equal(a, b) for a, b in zip(plain, packed))


@needs_onednn_bf16
@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_decoding_with_packed_linears_gives_the_same_tokens(bf16_target, bf16_drafter, tree_nodes):
    def decode(**kwargs):
        return bf16_target.generate(PROMPT, max_new_tokens=24, do_sample=False, **kwargs)

    ours = dict(assistant_model=bf16_drafter, dflash_tree_nodes=tree_nodes)
    plain, drafted = decode(), decode(**ours)
    with PackedLinears(bf16_target, bf16_drafter):
        assert torch.equal(decode(), plain)
        assert torch.equal(decode(**ours), drafted)
    assert len(bf16_drafter.last_generation_stats.acceptance_lengths) > 1, "drafted cycles ran"


@needs_onednn_bf16
def test_layers_with_a_bias_give_the_same_tokens_packed():
    target = tiny_target("qwen2", seed=2).to(torch.bfloat16)  # Qwen2: q, k and v projections carry biases
    assert target.model.layers[0].self_attn.q_proj.bias is not None
    plain = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    with PackedLinears(target):
        assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False), plain)


@needs_onednn_bf16
def test_disable_gives_each_layer_its_own_forward_back(bf16_target):
    packed = PackedLinears(bf16_target).enable()
    assert all("forward" in vars(layer) for layer in packed.layers)
    packed.disable()
    assert not any("forward" in vars(layer) for layer in packed.layers)


@needs_onednn_bf16
def test_enable_repacks_a_weight_changed_since_it_was_packed():
    target = tiny_target("qwen3", seed=1).to(torch.bfloat16)
    layer = target.lm_head
    hidden = torch.randn(1, 3, layer.in_features).to(torch.bfloat16)
    packed = PackedLinears(target)
    with packed, torch.no_grad():
        before = layer(hidden)
    with torch.no_grad():
        layer.weight.mul_(2)
    with packed, torch.no_grad():
        after = layer(hidden)
    assert not torch.equal(before, after)
    assert torch.equal(after, torch.nn.functional.linear(hidden, layer.weight))


@needs_onednn_bf16
def test_weights_not_in_bf16_are_refused_by_layer_name():
    with pytest.raises(ValueError, match=r"bfloat16 weights on the CPU; model\.layers\.0\.self_attn\.q_proj holds torch\.float32"):
        PackedLinears(tiny_target("qwen3", seed=1))


@pytest.mark.skipif(packed_linears_supported(), reason="this CPU has oneDNN bf16 matmuls")
def test_a_cpu_without_onednn_bf16_is_refused(bf16_target):
    with pytest.raises(ValueError, match="need a CPU whose bf16 matmuls run through oneDNN"):
        PackedLinears(bf16_target)


@needs_onednn_bf16
@pytest.mark.slow
def test_smollm2_decodes_the_same_tokens_on_packed_linears():
    """The real SmolLM2-135M and its shipped drafter in bf16 (oneDNN's own choice of kernels for these shapes), one
    HumanEval prompt: plain decoding and the default tree + lookup give the same tokens packed and unpacked."""
    from dflash2_hf import DFlashDraftModel
    from dflash2_hf.evaluation import benchmark_prompts
    from dflash2_hf.presets import default_drafter_folder, load_target

    target, tokenizer = load_target("smollm2-135m", dtype=torch.bfloat16)
    drafter = DFlashDraftModel.from_pretrained(default_drafter_folder("smollm2-135m"), dtype=torch.bfloat16).eval()
    (_, prompt), = benchmark_prompts(tokenizer, ["humaneval"], 1)

    def decode(**kwargs):
        return target.generate(prompt, max_new_tokens=48, do_sample=False, **kwargs)

    plain, ours = decode(), decode(assistant_model=drafter)
    with PackedLinears(target, drafter):
        assert torch.equal(decode(), plain)
        assert torch.equal(decode(assistant_model=drafter), ours)
