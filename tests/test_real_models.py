"""Real-model checks (marked slow; CI runs them): SmolLM2-135M-Instruct from its PyPI package, de-quantized from
GGUF to fp32, drafted for by a freshly initialised DFlash 2 drafter sized for it. Only a real model shows that the
hidden-state taps, embeddings and LM head of a real architecture are wired right and that exactness holds on real
text."""

import pytest
import torch
from transformers import pipeline

from conftest import assert_plain_decodings_output
from dflash2_hf import DFlashConfig, DFlashDraftModel
from dflash2_hf.presets import SMOLLM2_135M

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return SMOLLM2_135M.load_model(torch.float32), SMOLLM2_135M.load_tokenizer()


@pytest.fixture(scope="module")
def drafter(smollm2):
    target, tokenizer = smollm2
    text = target.config
    config = DFlashConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=1536, num_hidden_layers=1,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_target_layers=text.num_hidden_layers,
        target_layer_ids=[1, 14, 27], block_size=16, mask_token_id=tokenizer.pad_token_id or 0,
        conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=16,
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
        rope_parameters=dict(text.rope_parameters),
    )
    torch.manual_seed(0)
    return DFlashDraftModel.class_for_config(config)(config).eval()


def chat(tokenizer, question: str) -> torch.Tensor:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


@pytest.mark.parametrize("path", ["argmax", "greedy", "viterbi", "expected"])
def test_smollm2_greedy_output_is_identical_with_a_drafter(smollm2, drafter, path):
    target, tokenizer = smollm2
    inputs = chat(tokenizer, "Write a Python function that checks whether a number is prime.")
    expected = target.generate(inputs, max_new_tokens=48, do_sample=False)
    actual = target.generate(inputs, max_new_tokens=48, do_sample=False, assistant_model=drafter, dflash_path=path)
    assert_plain_decodings_output(target, inputs, actual, expected)
    assert drafter.last_generation_stats.new_tokens == expected.shape[1] - inputs.shape[1]


def test_smollm2_pipeline_with_a_drafter_gives_the_same_text(smollm2, drafter):
    target, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    kwargs = dict(max_new_tokens=24, do_sample=False)
    assert assisted(messages, **kwargs) == plain(messages, **kwargs)
